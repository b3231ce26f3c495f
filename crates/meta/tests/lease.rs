//! Lease behaviour, on both stores.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ashlar_meta::{
    Compare, CompareOp, EventKind, KeyRange, LeaseId, MetaError, MetaStore, Txn, TxnOp,
};
use common::{Backend, Settings};

async fn keys_vanish_after_ttl_without_keep_alive<B: Backend>() {
    let (_guard, store) = B::open(Settings::default()).await;
    let mut watch = store
        .watch(KeyRange::prefix("/owner/"), None)
        .await
        .expect("watch");
    let granted = Instant::now();
    let lease = store.grant_lease(B::TTL).await.expect("grant");
    store
        .put(b"/owner/vd1", b"node-a", Some(lease))
        .await
        .expect("put");
    store.put(b"/plain", b"stays", None).await.expect("put");
    let kv = store
        .get(b"/owner/vd1")
        .await
        .expect("get")
        .expect("present");
    assert_eq!(kv.lease, Some(lease));
    assert_eq!(watch.next().await.map(|e| e.kind), Some(EventKind::Put));

    // Only the watch is awaited: the store deletes the key by itself.
    let ev = tokio::time::timeout(B::TTL * 10, watch.next())
        .await
        .expect("expiry within 10 TTLs")
        .expect("event");
    assert!(granted.elapsed() >= B::TTL, "expired before its TTL");
    assert_eq!(ev.kind, EventKind::Delete);
    assert_eq!(ev.kv.key, b"/owner/vd1");
    assert_eq!(ev.prev.as_ref().and_then(|p| p.lease), Some(lease));
    assert_eq!(store.get(b"/owner/vd1").await.expect("get"), None);
    assert!(store.get(b"/plain").await.expect("get").is_some());
    assert!(
        matches!(store.keep_alive(lease).await, Err(MetaError::LeaseNotFound(id)) if id == lease)
    );
    assert!(matches!(
        store.put(b"/owner/vd1", b"again", Some(lease)).await,
        Err(MetaError::LeaseNotFound(id)) if id == lease
    ));
}

async fn keep_alive_keeps_keys<B: Backend>() {
    let (_guard, store) = B::open(Settings::default()).await;
    let lease = store.grant_lease(B::TTL).await.expect("grant");
    store
        .put(b"/owner/vd1", b"node-a", Some(lease))
        .await
        .expect("put");
    // Letting time pass is the point here: 8 keep-alives a third of a TTL apart.
    for _ in 0..8 {
        tokio::time::sleep(B::TTL / 3).await;
        store.keep_alive(lease).await.expect("keep alive");
    }
    // Well past the original TTL, still there.
    assert!(store.get(b"/owner/vd1").await.expect("get").is_some());
}

/// While other tasks keep the store as busy as they can, keep-alives still
/// answer quickly and the lease lives.
async fn keep_alive_is_not_starved_by_other_traffic<B: Backend>() {
    const FLOODERS: usize = 8;
    let (_guard, store) = B::open(Settings::default()).await;
    let lease = store.grant_lease(B::TTL).await.expect("grant");
    store
        .put(b"/hb/me", b"alive", Some(lease))
        .await
        .expect("put");

    let stop = Arc::new(AtomicBool::new(false));
    let ops = Arc::new(AtomicU64::new(0));
    let mut flooders = Vec::new();
    for t in 0..FLOODERS {
        let (store, stop, ops) = (store.clone(), Arc::clone(&stop), Arc::clone(&ops));
        flooders.push(tokio::spawn(async move {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                store
                    .put(format!("/flood/{t}/{}", i % 64), vec![7u8; 512], None)
                    .await
                    .expect("flood put");
                store
                    .range(KeyRange::prefix(format!("/flood/{t}/")), None)
                    .await
                    .expect("flood range");
                ops.fetch_add(2, Ordering::Relaxed);
                i += 1;
            }
        }));
    }

    let mut slowest = Duration::ZERO;
    let until = Instant::now() + B::TTL * 4;
    while Instant::now() < until {
        tokio::time::sleep(B::TTL / 4).await;
        let sent = Instant::now();
        store
            .keep_alive(lease)
            .await
            .expect("keep alive under load");
        slowest = slowest.max(sent.elapsed());
    }
    stop.store(true, Ordering::Relaxed);
    for f in flooders {
        f.await.expect("flooder");
    }
    assert!(ops.load(Ordering::Relaxed) > 100, "the flood did not run");
    assert!(
        slowest < B::TTL / 2,
        "a keep-alive took {slowest:?}, too close to the TTL {:?}",
        B::TTL
    );
    assert!(store.get(b"/hb/me").await.expect("get").is_some());
}

async fn revoke_deletes_keys_in_one_revision<B: Backend>() {
    let (_guard, store) = B::open(Settings::default()).await;
    let lease = store
        .grant_lease(Duration::from_secs(60))
        .await
        .expect("grant");
    store.put(b"/l/a", b"1", Some(lease)).await.expect("put");
    store.put(b"/l/b", b"2", Some(lease)).await.expect("put");
    // Re-put without the lease detaches /l/b.
    store.put(b"/l/b", b"2", None).await.expect("put");
    store.put(b"/l/c", b"3", Some(lease)).await.expect("put");
    let mut watch = store
        .watch(KeyRange::prefix("/l/"), None)
        .await
        .expect("watch");
    let before = store.current_revision().await.expect("rev");

    store.revoke_lease(lease).await.expect("revoke");
    assert_eq!(store.get(b"/l/a").await.expect("get"), None);
    assert_eq!(store.get(b"/l/c").await.expect("get"), None);
    assert!(store.get(b"/l/b").await.expect("get").is_some());
    assert_eq!(store.current_revision().await.expect("rev"), before.next());

    for key in [&b"/l/a"[..], b"/l/c"] {
        let ev = watch.next().await.expect("event");
        assert_eq!(ev.kind, EventKind::Delete);
        assert_eq!(ev.kv.key, key);
        assert_eq!(ev.revision(), before.next());
    }
    assert!(matches!(
        store.revoke_lease(lease).await,
        Err(MetaError::LeaseNotFound(id)) if id == lease
    ));
    assert!(matches!(
        store.keep_alive(LeaseId(12345)).await,
        Err(MetaError::LeaseNotFound(LeaseId(12345)))
    ));
}

async fn lease_compare_and_zero_ttl<B: Backend>() {
    let (_guard, store) = B::open(Settings::default()).await;
    assert!(matches!(
        store.grant_lease(Duration::ZERO).await,
        Err(MetaError::InvalidArgument(_))
    ));
    let lease = store
        .grant_lease(Duration::from_secs(60))
        .await
        .expect("grant");
    let other = store
        .grant_lease(Duration::from_secs(60))
        .await
        .expect("grant");
    assert_ne!(lease, other);
    store.put(b"/owner", b"a", Some(lease)).await.expect("put");
    let resp = store
        .txn(
            Txn::new()
                .when([Compare::lease("/owner", CompareOp::Equal, Some(lease))])
                .and_then([TxnOp::put("/owner", "a2", Some(lease))]),
        )
        .await
        .expect("txn");
    assert!(resp.succeeded);
    let resp = store
        .txn(Txn::new().when([Compare::lease("/owner", CompareOp::Equal, Some(other))]))
        .await
        .expect("txn");
    assert!(!resp.succeeded);
}

conformance!(
    keys_vanish_after_ttl_without_keep_alive,
    keep_alive_keeps_keys,
    keep_alive_is_not_starved_by_other_traffic,
    revoke_deletes_keys_in_one_revision,
    lease_compare_and_zero_ttl,
);

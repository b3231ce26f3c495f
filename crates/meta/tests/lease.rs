//! Lease behaviour of the embedded store.

mod common;

use std::time::Duration;

use ashlar_meta::{
    Compare, CompareOp, EventKind, KeyRange, LeaseId, MetaError, MetaStore, Txn, TxnOp,
};

const TTL: Duration = Duration::from_millis(300);

#[tokio::test]
async fn keys_vanish_after_ttl_without_keep_alive() {
    let (_dir, store) = common::store();
    let lease = store.grant_lease(TTL).await.expect("grant");
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

    tokio::time::sleep(TTL * 2).await;
    assert_eq!(store.get(b"/owner/vd1").await.expect("get"), None);
    assert!(store.get(b"/plain").await.expect("get").is_some());
    assert!(
        matches!(store.keep_alive(lease).await, Err(MetaError::LeaseNotFound(id)) if id == lease)
    );
    assert!(matches!(
        store.put(b"/owner/vd1", b"again", Some(lease)).await,
        Err(MetaError::LeaseNotFound(_))
    ));
}

#[tokio::test]
async fn keep_alive_keeps_keys() {
    let (_dir, store) = common::store();
    let lease = store.grant_lease(TTL).await.expect("grant");
    store
        .put(b"/owner/vd1", b"node-a", Some(lease))
        .await
        .expect("put");
    for _ in 0..8 {
        tokio::time::sleep(TTL / 3).await;
        store.keep_alive(lease).await.expect("keep alive");
    }
    // Well past the original TTL, still there.
    assert!(store.get(b"/owner/vd1").await.expect("get").is_some());
}

#[tokio::test]
async fn revoke_deletes_keys_in_one_revision() {
    let (_dir, store) = common::store();
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
        Err(MetaError::LeaseNotFound(_))
    ));
    assert!(matches!(
        store.keep_alive(LeaseId(12345)).await,
        Err(MetaError::LeaseNotFound(_))
    ));
}

#[tokio::test]
async fn expiry_task_deletes_keys_without_further_calls() {
    let (_dir, store) = common::store();
    let lease = store.grant_lease(TTL).await.expect("grant");
    store
        .put(b"/hb/node-a", b"alive", Some(lease))
        .await
        .expect("put");
    let mut watch = store
        .watch(KeyRange::prefix("/hb/"), None)
        .await
        .expect("watch");
    // Only the watch is awaited: the deletion must come from the background task.
    let ev = tokio::time::timeout(TTL * 10, watch.next())
        .await
        .expect("expiry within 10 TTLs")
        .expect("event");
    assert_eq!(ev.kind, EventKind::Delete);
    assert_eq!(ev.kv.key, b"/hb/node-a");
    assert_eq!(ev.prev.as_ref().and_then(|p| p.lease), Some(lease));
}

#[tokio::test]
async fn lease_compare_and_zero_ttl() {
    let (_dir, store) = common::store();
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

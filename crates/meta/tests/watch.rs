//! Watch behaviour, on both stores.

mod common;

use common::{Backend, Settings};

use std::time::Duration;

use ashlar_meta::{
    EmbeddedOptions, EventKind, KeyRange, MetaError, MetaStore, Revision, Txn, TxnOp,
};

async fn next(watch: &mut ashlar_meta::Watch) -> ashlar_meta::WatchEvent {
    tokio::time::timeout(Duration::from_secs(5), watch.next_event())
        .await
        .expect("event within 5s")
        .expect("watch alive")
}

async fn puts_and_deletes_arrive_in_order<B: Backend>() {
    let (_guard, store) = B::open(Settings::default()).await;
    let mut watch = store
        .watch(KeyRange::prefix(""), None)
        .await
        .expect("watch");
    let r1 = store.put(b"/a", b"1", None).await.expect("put");
    let r2 = store.put(b"/a", b"2", None).await.expect("put");
    store.delete(KeyRange::key("/a")).await.expect("delete");
    let r4 = store
        .txn(Txn::new().and_then([TxnOp::put("/x", "x", None), TxnOp::put("/y", "y", None)]))
        .await
        .expect("txn")
        .revision;

    let e = next(&mut watch).await;
    assert_eq!(
        (e.kind, e.kv.value.as_slice(), e.revision()),
        (EventKind::Put, &b"1"[..], r1)
    );
    assert_eq!(e.prev, None);
    let e = next(&mut watch).await;
    assert_eq!(
        (e.kind, e.kv.version, e.revision()),
        (EventKind::Put, 2, r2)
    );
    assert_eq!(e.prev.map(|p| p.value), Some(b"1".to_vec()));
    let e = next(&mut watch).await;
    assert_eq!(
        (e.kind, e.kv.key.as_slice()),
        (EventKind::Delete, &b"/a"[..])
    );
    assert_eq!(e.revision(), r2.next());
    assert!(e.kv.value.is_empty());
    assert_eq!(e.prev.map(|p| p.value), Some(b"2".to_vec()));
    // One transaction: one revision, events in op order.
    let ex = next(&mut watch).await;
    let ey = next(&mut watch).await;
    assert_eq!(
        (ex.kv.key.as_slice(), ey.kv.key.as_slice()),
        (&b"/x"[..], &b"/y"[..])
    );
    assert_eq!((ex.revision(), ey.revision()), (r4, r4));
}

async fn prefix_filtering<B: Backend>() {
    let (_guard, store) = B::open(Settings::default()).await;
    let mut vdisks = store
        .watch(KeyRange::prefix("/ashlar/v1/vdisks/"), None)
        .await
        .expect("watch");
    let mut one = store
        .watch(KeyRange::key("/ashlar/v1/vdisks/b"), None)
        .await
        .expect("watch");
    store
        .put(b"/ashlar/v1/nodes/n1", b"{}", None)
        .await
        .expect("put");
    store
        .put(b"/ashlar/v1/vdisks/a", b"{}", None)
        .await
        .expect("put");
    store
        .put(b"/ashlar/v1/vdisks/b", b"{}", None)
        .await
        .expect("put");
    store
        .put(b"/ashlar/v1/vdisks/bb", b"{}", None)
        .await
        .expect("put");

    assert_eq!(next(&mut vdisks).await.kv.key, b"/ashlar/v1/vdisks/a");
    assert_eq!(next(&mut vdisks).await.kv.key, b"/ashlar/v1/vdisks/b");
    assert_eq!(next(&mut vdisks).await.kv.key, b"/ashlar/v1/vdisks/bb");
    assert_eq!(next(&mut one).await.kv.key, b"/ashlar/v1/vdisks/b");
    // Nothing else is queued for the single-key watch.
    assert!(tokio::time::timeout(Duration::from_millis(100), one.next())
        .await
        .is_err());
}

async fn start_revision_replays_history<B: Backend>() {
    let (_guard, store) = B::open(Settings::default()).await;
    let r1 = store.put(b"/a", b"1", None).await.expect("put");
    store.put(b"/b", b"1", None).await.expect("put");
    let r3 = store.put(b"/a", b"2", None).await.expect("put");

    // List-then-watch: a read-only txn gives the revision the read saw.
    let read = store
        .txn(Txn::new().and_then([TxnOp::get(KeyRange::prefix("/"))]))
        .await
        .expect("txn");
    assert_eq!(read.revision, r3);

    let mut from_start = store
        .watch(KeyRange::key("/a"), Some(r1))
        .await
        .expect("watch");
    assert_eq!(next(&mut from_start).await.revision(), r1);
    assert_eq!(next(&mut from_start).await.revision(), r3);
    // Replay continues seamlessly into live events.
    let r4 = store.put(b"/a", b"3", None).await.expect("put");
    assert_eq!(next(&mut from_start).await.revision(), r4);

    let mut after_read = store
        .watch(KeyRange::prefix("/"), Some(read.revision.next()))
        .await
        .expect("watch");
    assert_eq!(next(&mut after_read).await.revision(), r4);
}

/// Revisions 2..=11 were written and history before 7 is gone: watching from
/// 2 is refused, watching from 7 replays it.
async fn assert_compacted_before_7(store: &impl MetaStore) {
    match store.watch(KeyRange::prefix(""), Some(Revision(2))).await {
        Err(MetaError::Compacted { requested, oldest }) => {
            assert_eq!(requested, Revision(2));
            assert_eq!(oldest, Revision(7));
        }
        other => panic!("expected Compacted, got {other:?}"),
    }
    let mut w = store
        .watch(KeyRange::prefix(""), Some(Revision(7)))
        .await
        .expect("watch");
    assert_eq!(next(&mut w).await.revision(), Revision(7));
    assert!(matches!(
        store.watch(KeyRange::prefix(""), Some(Revision(-1))).await,
        Err(MetaError::InvalidArgument(_))
    ));
}

async fn put_ten(store: &impl MetaStore) {
    for i in 0..10 {
        store.put(b"/k", format!("{i}"), None).await.expect("put");
    }
}

/// The embedded store keeps a bounded history in memory.
#[tokio::test]
async fn embedded_history_limit_compacts() {
    let options = EmbeddedOptions {
        watch_history_events: 5,
        ..EmbeddedOptions::default()
    };
    let (_dir, store) = common::store_with(options);
    put_ten(&store).await;
    assert_compacted_before_7(&store).await;
}

/// etcd keeps everything until compacted.
#[tokio::test]
async fn etcd_compaction_compacts() {
    let (_server, store) = common::Etcd::open(Settings::default()).await;
    put_ten(&store).await;
    store.compact(Revision(7)).await.expect("compact");
    assert_compacted_before_7(&store).await;
}

async fn lagging_watcher_is_dropped_without_blocking_writers<B: Backend>() {
    let settings = Settings {
        watch_channel_capacity: Some(4),
    };
    let (_guard, store) = B::open(settings).await;
    let mut slow = store
        .watch(KeyRange::prefix(""), None)
        .await
        .expect("watch");
    let mut fast = store
        .watch(KeyRange::prefix(""), None)
        .await
        .expect("watch");
    for i in 0..20 {
        // Would hang here if writers waited for the slow watcher.
        tokio::time::timeout(
            Duration::from_secs(5),
            store.put(b"/k", format!("{i}"), None),
        )
        .await
        .expect("write not blocked")
        .expect("put");
        if i < 19 {
            // The fast watcher keeps up.
            assert_eq!(next(&mut fast).await.kv.value, format!("{i}").into_bytes());
        }
    }
    // The slow one gets what fit in its channel, then the lag error.
    for i in 0..4 {
        assert_eq!(next(&mut slow).await.kv.value, format!("{i}").into_bytes());
    }
    assert!(matches!(
        slow.next_event().await,
        Err(MetaError::WatchLagged { capacity: 4 })
    ));
    assert_eq!(slow.next().await, None);
    assert!(matches!(
        slow.end_reason(),
        Some(MetaError::WatchLagged { .. })
    ));
    assert_eq!(next(&mut fast).await.kv.value, b"19");
}

async fn watch_ends_with_closed_when_store_is_dropped<B: Backend>() {
    let (_guard, store) = B::open(Settings::default()).await;
    let mut watch = store
        .watch(KeyRange::prefix(""), None)
        .await
        .expect("watch");
    store.put(b"/a", b"1", None).await.expect("put");
    assert_eq!(next(&mut watch).await.kv.key, b"/a");
    drop(store);
    let end = tokio::time::timeout(Duration::from_secs(5), watch.next_event())
        .await
        .expect("ends");
    assert!(matches!(end, Err(MetaError::Closed)));
}

conformance!(
    puts_and_deletes_arrive_in_order,
    prefix_filtering,
    start_revision_replays_history,
    lagging_watcher_is_dropped_without_blocking_writers,
    watch_ends_with_closed_when_store_is_dropped,
);

//! Key-value operations, revisions and transactions, on both stores.

mod common;

use common::{Backend, Settings};

use std::sync::Arc;

use ashlar_meta::{
    Compare, CompareOp, KeyRange, MetaError, MetaStore, Revision, Txn, TxnOp, TxnOpResult,
};

async fn put_get_range_prefix_delete<B: Backend>() {
    let (_guard, store) = B::open(Settings::default()).await;
    assert_eq!(store.get(b"/a").await.expect("get"), None);

    store.put(b"/a", b"1", None).await.expect("put");
    store.put(b"/b/1", b"2", None).await.expect("put");
    store.put(b"/b/2", b"3", None).await.expect("put");
    store.put(b"/c", b"4", None).await.expect("put");

    let a = store.get(b"/a").await.expect("get").expect("present");
    assert_eq!(a.key, b"/a");
    assert_eq!(a.value, b"1");
    assert_eq!(a.lease, None);

    let keys =
        |kvs: Vec<ashlar_meta::KeyValue>| kvs.into_iter().map(|kv| kv.key).collect::<Vec<_>>();
    let b = store
        .range(KeyRange::prefix("/b/"), None)
        .await
        .expect("range");
    assert_eq!(keys(b), vec![b"/b/1".to_vec(), b"/b/2".to_vec()]);

    let all = store
        .range(KeyRange::prefix(""), None)
        .await
        .expect("range");
    assert_eq!(all.len(), 4);
    let limited = store
        .range(KeyRange::prefix(""), Some(2))
        .await
        .expect("range");
    assert_eq!(keys(limited), vec![b"/a".to_vec(), b"/b/1".to_vec()]);
    assert!(matches!(
        store.range(KeyRange::prefix(""), Some(0)).await,
        Err(MetaError::InvalidArgument(_))
    ));

    // [start, end) excludes end; an inverted range is empty.
    let half_open = store
        .range(KeyRange::range("/b/", "/c"), None)
        .await
        .expect("range");
    assert_eq!(half_open.len(), 2);
    assert!(store
        .range(KeyRange::range("/c", "/a"), None)
        .await
        .expect("range")
        .is_empty());
    // Inside a transaction too, where etcd has no way to say "nothing".
    let inverted = KeyRange::range("/c", "/a");
    let resp = store
        .txn(Txn::new().and_then([TxnOp::get(inverted.clone()), TxnOp::delete(inverted)]))
        .await
        .expect("txn");
    assert_eq!(
        resp.results,
        vec![
            TxnOpResult::Get { kvs: Vec::new() },
            TxnOpResult::Delete { deleted: 0 }
        ]
    );
    assert_eq!(
        store
            .range(KeyRange::prefix(""), None)
            .await
            .expect("range")
            .len(),
        4
    );
    let single = store.range(KeyRange::key("/c"), None).await.expect("range");
    assert_eq!(keys(single), vec![b"/c".to_vec()]);

    assert_eq!(
        store.delete(KeyRange::prefix("/b/")).await.expect("delete"),
        2
    );
    assert_eq!(
        store.delete(KeyRange::key("/nope")).await.expect("delete"),
        0
    );
    assert_eq!(store.delete(KeyRange::key("/a")).await.expect("delete"), 1);
    assert_eq!(
        keys(
            store
                .range(KeyRange::prefix(""), None)
                .await
                .expect("range")
        ),
        vec![b"/c".to_vec()]
    );

    assert!(matches!(
        store.put(b"", b"x", None).await,
        Err(MetaError::InvalidArgument(_))
    ));
}

async fn revisions_and_versions_follow_etcd<B: Backend>() {
    let (_guard, store) = B::open(Settings::default()).await;
    // etcd starts at revision 1; the first write is revision 2.
    assert_eq!(store.current_revision().await.expect("rev"), Revision(1));

    let r1 = store.put(b"/k", b"v1", None).await.expect("put");
    assert_eq!(r1, Revision(2));
    let kv = store.get(b"/k").await.expect("get").expect("present");
    assert_eq!(
        (kv.create_revision, kv.mod_revision, kv.version),
        (r1, r1, 1)
    );

    let r2 = store.put(b"/k", b"v2", None).await.expect("put");
    assert_eq!(r2, Revision(3));
    let kv = store.get(b"/k").await.expect("get").expect("present");
    assert_eq!(
        (kv.create_revision, kv.mod_revision, kv.version),
        (r1, r2, 2)
    );

    // Another key moves the store revision but not /k's.
    let r3 = store.put(b"/other", b"x", None).await.expect("put");
    let kv = store.get(b"/k").await.expect("get").expect("present");
    assert_eq!(kv.mod_revision, r2);
    assert_eq!(store.current_revision().await.expect("rev"), r3);

    // Deleting nothing does not bump the revision; deleting something does.
    store
        .delete(KeyRange::key("/missing"))
        .await
        .expect("delete");
    assert_eq!(store.current_revision().await.expect("rev"), r3);
    store.delete(KeyRange::key("/k")).await.expect("delete");
    let r4 = store.current_revision().await.expect("rev");
    assert_eq!(r4, r3.next());

    // Recreated: a new life with a new create revision and version 1.
    let r5 = store.put(b"/k", b"v3", None).await.expect("put");
    let kv = store.get(b"/k").await.expect("get").expect("present");
    assert_eq!(
        (kv.create_revision, kv.mod_revision, kv.version),
        (r5, r5, 1)
    );
}

async fn txn_create_if_absent<B: Backend>() {
    let (_guard, store) = B::open(Settings::default()).await;
    let create = |value: &'static str| {
        Txn::new()
            .when([Compare::absent("/vd/a")])
            .and_then([TxnOp::put("/vd/a", value, None)])
            .or_else([TxnOp::get(KeyRange::key("/vd/a"))])
    };

    let first = store.txn(create("first")).await.expect("txn");
    assert!(first.succeeded);
    assert_eq!(first.results, vec![TxnOpResult::Put]);
    assert_eq!(first.revision, Revision(2));

    let second = store.txn(create("second")).await.expect("txn");
    assert!(!second.succeeded);
    // A read-only branch leaves the revision alone.
    assert_eq!(second.revision, Revision(2));
    match &second.results[..] {
        [TxnOpResult::Get { kvs }] => assert_eq!(kvs[0].value, b"first"),
        other => panic!("unexpected results {other:?}"),
    }
    assert_eq!(
        store
            .get(b"/vd/a")
            .await
            .expect("get")
            .expect("present")
            .value,
        b"first"
    );
}

async fn txn_update_if_mod_revision_matches<B: Backend>() {
    let (_guard, store) = B::open(Settings::default()).await;
    store.put(b"/cfg", b"v1", None).await.expect("put");
    let seen = store.get(b"/cfg").await.expect("get").expect("present");

    // Someone else writes in between: our CAS must fail.
    store.put(b"/cfg", b"other", None).await.expect("put");
    let stale = Txn::new()
        .when([Compare::mod_revision_equals("/cfg", seen.mod_revision)])
        .and_then([TxnOp::put("/cfg", "mine", None)]);
    let resp = store.txn(stale).await.expect("txn");
    assert!(!resp.succeeded);
    assert!(resp.results.is_empty());
    assert_eq!(
        store
            .get(b"/cfg")
            .await
            .expect("get")
            .expect("present")
            .value,
        b"other"
    );

    // With the fresh revision it succeeds, and all ops share one revision.
    let fresh = store.get(b"/cfg").await.expect("get").expect("present");
    let resp = store
        .txn(
            Txn::new()
                .when([
                    Compare::mod_revision_equals("/cfg", fresh.mod_revision),
                    Compare::value("/cfg", CompareOp::Equal, "other"),
                    Compare::version("/cfg", CompareOp::Greater, 1),
                ])
                .and_then([
                    TxnOp::put("/cfg", "mine", None),
                    TxnOp::put("/log", "changed", None),
                    TxnOp::get(KeyRange::key("/cfg")),
                ]),
        )
        .await
        .expect("txn");
    assert!(resp.succeeded);
    let cfg = store.get(b"/cfg").await.expect("get").expect("present");
    let log = store.get(b"/log").await.expect("get").expect("present");
    assert_eq!(cfg.value, b"mine");
    assert_eq!(cfg.mod_revision, resp.revision);
    assert_eq!(log.mod_revision, resp.revision);
    // A get after a put in the same branch sees the put.
    match &resp.results[2] {
        TxnOpResult::Get { kvs } => assert_eq!(kvs[0].value, b"mine"),
        other => panic!("unexpected result {other:?}"),
    }
}

/// etcd compares an absent key's fields as zero, except its value: a value
/// compare on an absent key is always false (absent is not empty).
async fn compares_on_absent_and_present_keys<B: Backend>() {
    let (_guard, store) = B::open(Settings::default()).await;
    store.put(b"/b", b"b", None).await.expect("put");
    let holds = |compare: Compare| {
        let store = store.clone();
        async move {
            store
                .txn(Txn::new().when([compare]))
                .await
                .expect("txn")
                .succeeded
        }
    };
    assert!(!holds(Compare::value("/none", CompareOp::Equal, "")).await);
    assert!(!holds(Compare::value("/none", CompareOp::NotEqual, "x")).await);
    assert!(holds(Compare::version("/none", CompareOp::Equal, 0)).await);
    assert!(holds(Compare::absent("/none")).await);
    assert!(holds(Compare::mod_revision("/none", CompareOp::Less, Revision(1))).await);
    assert!(holds(Compare::lease("/none", CompareOp::Equal, None)).await);

    assert!(holds(Compare::exists("/b")).await);
    assert!(holds(Compare::value("/b", CompareOp::Greater, "a")).await);
    assert!(holds(Compare::value("/b", CompareOp::Less, "c")).await);
    assert!(!holds(Compare::value("/b", CompareOp::Less, "b")).await);
    assert!(holds(Compare::value("/b", CompareOp::NotEqual, "a")).await);
    assert!(
        holds(Compare::create_revision(
            "/b",
            CompareOp::Equal,
            Revision(2)
        ))
        .await
    );
    assert!(!holds(Compare::mod_revision("/b", CompareOp::Greater, Revision(2))).await);
    assert!(holds(Compare::version("/b", CompareOp::Less, 2)).await);
}

async fn txn_rejects_what_etcd_rejects<B: Backend>() {
    let (_guard, store) = B::open(Settings::default()).await;
    let dup = Txn::new().and_then([TxnOp::put("/a", "1", None), TxnOp::put("/a", "2", None)]);
    assert!(matches!(
        store.txn(dup).await,
        Err(MetaError::InvalidArgument(_))
    ));
    let covered = Txn::new().and_then([
        TxnOp::delete(KeyRange::prefix("/d/")),
        TxnOp::put("/d/1", "x", None),
    ]);
    assert!(matches!(
        store.txn(covered).await,
        Err(MetaError::InvalidArgument(_))
    ));
    let too_many = Txn::new().and_then((0..129).map(|i| TxnOp::put(format!("/k{i}"), "v", None)));
    assert!(matches!(
        store.txn(too_many).await,
        Err(MetaError::InvalidArgument(_))
    ));
    // A put with an unknown lease applies nothing.
    let leased = Txn::new().and_then([
        TxnOp::put("/x", "1", None),
        TxnOp::put("/y", "1", Some(ashlar_meta::LeaseId(999))),
    ]);
    assert!(matches!(
        store.txn(leased).await,
        Err(MetaError::LeaseNotFound(_))
    ));
    assert_eq!(store.get(b"/x").await.expect("get"), None);
    assert_eq!(store.current_revision().await.expect("rev"), Revision(1));
}

async fn concurrent_cas_counter_is_exact<B: Backend>() {
    const TASKS: u64 = 8;
    const INCREMENTS: u64 = 25;
    let (_guard, store) = B::open(Settings::default()).await;
    let store = Arc::new(store);

    let mut handles = Vec::new();
    for _ in 0..TASKS {
        let store = Arc::clone(&store);
        handles.push(tokio::spawn(async move {
            let mut conflicts = 0u64;
            for _ in 0..INCREMENTS {
                loop {
                    let current = store.get(b"/counter").await.expect("get");
                    let (value, rev) = match &current {
                        Some(kv) => {
                            let n: u64 =
                                String::from_utf8_lossy(&kv.value).parse().expect("number");
                            (n, kv.mod_revision)
                        }
                        None => (0, Revision(0)),
                    };
                    let txn = Txn::new()
                        .when([Compare::mod_revision_equals("/counter", rev)])
                        .and_then([TxnOp::put("/counter", (value + 1).to_string(), None)]);
                    if store.txn(txn).await.expect("txn").succeeded {
                        break;
                    }
                    conflicts += 1;
                }
            }
            conflicts
        }));
    }
    for h in handles {
        h.await.expect("task");
    }
    let kv = store.get(b"/counter").await.expect("get").expect("present");
    assert_eq!(
        String::from_utf8_lossy(&kv.value),
        (TASKS * INCREMENTS).to_string()
    );
    assert_eq!(kv.version as u64, TASKS * INCREMENTS);
}

/// Drive a future without any async runtime (a noop waker and a poll loop).
fn block_on<F: std::future::Future>(fut: F) -> F::Output {
    let mut fut = std::pin::pin!(fut);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    loop {
        if let std::task::Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::yield_now();
    }
}

#[test]
fn works_without_a_tokio_runtime() {
    // No runtime: no expiry task, calls run inline, lease expiry is lazy.
    let dir = tempfile::tempdir().expect("tempdir");
    let store = ashlar_meta::EmbeddedMetaStore::open(&common::db_path(&dir)).expect("open");
    block_on(async {
        store.put(b"/a", b"1", None).await.expect("put");
        assert_eq!(
            store.get(b"/a").await.expect("get").expect("present").value,
            b"1"
        );
        let lease = store
            .grant_lease(std::time::Duration::from_millis(50))
            .await
            .expect("grant");
        store.put(b"/leased", b"x", Some(lease)).await.expect("put");
        std::thread::sleep(std::time::Duration::from_millis(120));
        assert_eq!(store.get(b"/leased").await.expect("get"), None);
    });
}

conformance!(
    put_get_range_prefix_delete,
    revisions_and_versions_follow_etcd,
    txn_create_if_absent,
    txn_update_if_mod_revision_matches,
    compares_on_absent_and_present_keys,
    txn_rejects_what_etcd_rejects,
    concurrent_cas_counter_is_exact,
);

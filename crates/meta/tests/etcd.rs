//! What only the etcd store has: several endpoints, timeouts, errors when
//! etcd is unreachable or dies, and request counting.

mod common;

use std::net::TcpListener;
use std::time::{Duration, Instant};

use ashlar_meta::{EtcdMetaStore, EtcdOptions, KeyRange, MetaError, MetaStore, RequestCounts};
use common::{EtcdServer, Settings};

/// A loopback URL where nothing listens.
fn dead_endpoint() -> String {
    format!("http://127.0.0.1:{}", common::etcd_server::free_port())
}

fn options(endpoints: &str, timeout: Duration) -> EtcdOptions {
    EtcdOptions {
        connect_timeout: timeout,
        request_timeout: timeout,
        ..EtcdOptions::new(endpoints).expect("endpoints")
    }
}

async fn start_etcd() -> EtcdServer {
    tokio::task::spawn_blocking(EtcdServer::start)
        .await
        .expect("start etcd")
}

#[tokio::test]
async fn unreachable_endpoints_fail_promptly_with_one_line() {
    let (a, b) = (dead_endpoint(), dead_endpoint());
    let started = Instant::now();
    let err = EtcdMetaStore::connect(options(&format!("{a},{b}"), Duration::from_secs(1)))
        .await
        .expect_err("nothing listens");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "took {:?}",
        started.elapsed()
    );
    match &err {
        MetaError::Unavailable { endpoints, reason } => {
            assert_eq!(endpoints, &format!("{a},{b}"));
            assert!(reason.contains(&a) && reason.contains(&b), "{reason}");
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
    let line = err.to_string();
    assert!(
        !line.contains('\n') && line.contains("etcd unavailable"),
        "{line}"
    );
}

#[test]
fn bad_endpoints_are_refused() {
    for bad in ["", " , ", "https://h:2379", "unix:///run/etcd.sock"] {
        assert!(
            matches!(EtcdOptions::new(bad), Err(MetaError::InvalidArgument(_))),
            "{bad:?} accepted"
        );
    }
    let opts = EtcdOptions::new("h1:2379, http://h2:2379").expect("valid");
    assert_eq!(opts.endpoints, ["http://h1:2379", "http://h2:2379"]);
    // Outside a runtime: an error, not tonic's panic.
    assert!(matches!(
        EtcdMetaStore::connect_lazy(opts),
        Err(MetaError::InvalidArgument(_))
    ));
}

/// A dead first endpoint costs one failed attempt, once: later calls, writes
/// included, go straight to the member that answered.
#[tokio::test]
async fn fails_over_to_the_next_endpoint() {
    let server = start_etcd().await;
    let endpoints = format!("{},{}", dead_endpoint(), server.url);
    let store = EtcdMetaStore::connect(options(&endpoints, Duration::from_secs(2)))
        .await
        .expect("connect through the second endpoint");
    assert_eq!(store.request_counts().range, 2);
    store.put(b"/a", b"1", None).await.expect("put");
    assert_eq!(
        store.get(b"/a").await.expect("get").map(|kv| kv.value),
        Some(b"1".to_vec())
    );
    let counts = store.request_counts();
    assert_eq!((counts.range, counts.put), (3, 1));

    // A write also moves on when the connection cannot be made at all:
    // it never left this host, so it cannot be applied twice.
    let fresh =
        EtcdMetaStore::connect_lazy(options(&endpoints, Duration::from_secs(2))).expect("options");
    fresh
        .put(b"/b", b"2", None)
        .await
        .expect("put through the second endpoint");
    assert_eq!(fresh.request_counts().put, 2);
}

/// An endpoint that accepts connections and never answers: reads move on
/// after the request timeout, writes stop there (they may have been applied).
#[tokio::test]
async fn silent_endpoint_times_out_reads_move_on_writes_do_not() {
    let server = start_etcd().await;
    let silent = TcpListener::bind("127.0.0.1:0").expect("bind");
    let silent_url = format!("http://{}", silent.local_addr().expect("addr"));
    // Accepted connections are kept open and never read.
    std::thread::spawn(move || {
        let held: Vec<_> = silent.incoming().collect();
        drop(held);
    });
    let timeout = Duration::from_millis(500);
    let store =
        EtcdMetaStore::connect_lazy(options(&format!("{silent_url},{}", server.url), timeout))
            .expect("options");

    let started = Instant::now();
    let err = store
        .put(b"/w", b"1", None)
        .await
        .expect_err("silent endpoint");
    assert!(
        started.elapsed() < timeout * 4,
        "took {:?}",
        started.elapsed()
    );
    match &err {
        MetaError::Unavailable { reason, .. } => {
            assert!(
                reason.contains(&silent_url) && reason.contains("may or may not"),
                "{reason}"
            )
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
    assert_eq!(store.request_counts().put, 1, "a write was sent twice");

    let started = Instant::now();
    assert_eq!(store.get(b"/w").await.expect("read fails over"), None);
    assert!(
        started.elapsed() < timeout * 4,
        "took {:?}",
        started.elapsed()
    );
    assert_eq!(store.request_counts().range, 2);
}

#[tokio::test]
async fn etcd_dying_ends_calls_and_watches_with_unavailable() {
    let server = start_etcd().await;
    let store = common::etcd_store(&server.url, Settings::default()).await;
    let mut watch = store
        .watch(KeyRange::prefix("/"), None)
        .await
        .expect("watch");
    store.put(b"/a", b"1", None).await.expect("put");
    assert_eq!(watch.next().await.map(|e| e.kv.key), Some(b"/a".to_vec()));

    drop(server);
    let ended = tokio::time::timeout(Duration::from_secs(10), watch.next_event())
        .await
        .expect("watch ends once etcd is gone");
    assert!(
        matches!(ended, Err(MetaError::Unavailable { .. })),
        "{ended:?}"
    );
    let started = Instant::now();
    let err = store.get(b"/a").await.expect_err("etcd is gone");
    assert!(matches!(err, MetaError::Unavailable { .. }), "{err:?}");
    assert!(
        started.elapsed() < Duration::from_secs(6),
        "took {:?}",
        started.elapsed()
    );
}

/// One request per call, of the call's kind: what lets a later test show the
/// data path sends etcd nothing per client I/O.
#[tokio::test]
async fn every_call_is_one_counted_request() {
    let server = start_etcd().await;
    let store = common::etcd_store(&server.url, Settings::default()).await;
    let before = store.request_counts();
    assert_eq!(before.total(), 1, "connect checks with one read");

    let lease = store
        .grant_lease(Duration::from_secs(30))
        .await
        .expect("grant");
    for i in 0..5 {
        store
            .put(format!("/k{i}"), "v", Some(lease))
            .await
            .expect("put");
    }
    store
        .range(KeyRange::prefix("/k"), Some(2))
        .await
        .expect("range");
    store.delete(KeyRange::key("/k0")).await.expect("delete");
    store.keep_alive(lease).await.expect("keep alive");
    store.keep_alive(lease).await.expect("keep alive");
    let _watch = store
        .watch(KeyRange::prefix("/"), None)
        .await
        .expect("watch");
    store.revoke_lease(lease).await.expect("revoke");
    // Empty ranges never reach etcd.
    assert!(store
        .range(KeyRange::range("b", "a"), None)
        .await
        .expect("range")
        .is_empty());

    let expected = RequestCounts {
        range: 2,
        put: 5,
        delete_range: 1,
        watch: 1,
        lease_grant: 1,
        lease_revoke: 1,
        lease_keep_alive: 2,
        ..RequestCounts::default()
    };
    assert_eq!(store.request_counts(), expected);
    assert_eq!(expected.total(), 13);
}

/// A range answer larger than gRPC's usual 4 MiB message limit.
#[tokio::test]
async fn large_ranges_are_read_whole() {
    let server = start_etcd().await;
    let store = common::etcd_store(&server.url, Settings::default()).await;
    // etcd takes at most 1.5 MiB per request, so several puts of 1 MiB.
    for i in 0..6u8 {
        store
            .put(format!("/big/{i}"), vec![i; 1 << 20], None)
            .await
            .expect("put 1 MiB");
    }
    let kvs = store
        .range(KeyRange::prefix("/big/"), None)
        .await
        .expect("range of 6 MiB");
    assert_eq!(kvs.len(), 6);
    assert!(kvs
        .iter()
        .enumerate()
        .all(|(i, kv)| kv.value.len() == 1 << 20 && kv.value[0] == i as u8));
}

/// Create `key` unless it exists, retrying while the cluster elects a
/// leader: a create-if-absent applies at most once however often it is sent.
async fn create_with_retry(store: &EtcdMetaStore, key: &str) -> ashlar_meta::Revision {
    use ashlar_meta::{Compare, Txn, TxnOp};
    let txn = Txn::new()
        .when([Compare::absent(key)])
        .and_then([TxnOp::put(key, "v", None)]);
    for _ in 0..100 {
        match store.txn(txn.clone()).await {
            Ok(_) => {
                return store
                    .get(key.as_bytes())
                    .await
                    .expect("get")
                    .expect("created")
                    .mod_revision
            }
            // Backoff while the cluster has no leader; nothing to wait on.
            Err(MetaError::Unavailable { .. }) => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Err(e) => panic!("create {key}: {e}"),
        }
    }
    panic!("{key} not created within 100 tries");
}

/// In a three-member cluster, losing the member a client talks to costs
/// neither calls nor watch events: both continue on another member, and the
/// watch resumes exactly where it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn member_loss_fails_over_calls_and_resumes_watches() {
    let mut members = tokio::task::spawn_blocking(|| EtcdServer::start_cluster(3))
        .await
        .expect("start cluster");
    let urls: Vec<String> = members.iter().map(|m| m.url.clone()).collect();
    let store = common::etcd_store(&urls.join(","), Settings::default()).await;
    let mut watch = store
        .watch(KeyRange::prefix("/m/"), None)
        .await
        .expect("watch");
    let a = create_with_retry(&store, "/m/a").await;
    let ev = watch.next_event().await.expect("event");
    assert_eq!((ev.kv.key.as_slice(), ev.revision()), (&b"/m/a"[..], a));

    // The store and its watch talk to the first member: kill it.
    drop(members.remove(0));
    let b = create_with_retry(&store, "/m/b").await;
    let c = create_with_retry(&store, "/m/c").await;
    for (key, rev) in [(&b"/m/b"[..], b), (b"/m/c", c)] {
        let ev = tokio::time::timeout(Duration::from_secs(10), watch.next_event())
            .await
            .expect("event after failover")
            .expect("watch resumed");
        assert_eq!((ev.kv.key.as_slice(), ev.revision()), (key, rev));
    }
    assert!(
        store.request_counts().watch >= 2,
        "the watch was not resumed"
    );
    let keys: Vec<Vec<u8>> = store
        .range(KeyRange::prefix("/m/"), None)
        .await
        .expect("range")
        .into_iter()
        .map(|kv| kv.key)
        .collect();
    assert_eq!(keys, [b"/m/a".to_vec(), b"/m/b".to_vec(), b"/m/c".to_vec()]);
}

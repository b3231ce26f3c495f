//! Helpers of the cluster tests. The store harness (both stores, a real etcd per test, the
//! `conformance!` macro) is ashlar-meta's own, included by path so both crates test the same way.
#![allow(dead_code)]

use ashlar_cluster::{AdvertisedAddresses, DiskRecord, NodeId, NodeRecord, NODE_RECORD_VERSION};

/// A record for node number `n` (ids and addresses derived from `n`).
pub fn node_record(n: u16) -> NodeRecord {
    NodeRecord {
        version: NODE_RECORD_VERSION,
        node_id: node_id(n),
        addresses: AdvertisedAddresses {
            http: format!("10.0.0.{n}:10810"),
            nbd: format!("10.0.0.{n}:10809"),
            iscsi: format!("10.0.0.{n}:3260"),
            node: format!("10.0.0.{n}:10811"),
        },
        storage_only: n.is_multiple_of(2),
        disks: vec![DiskRecord {
            path: format!("/srv/disk{n}"),
            tier: "fast".into(),
            capacity_bytes: 1 << 40,
            free_bytes: u64::from(n) << 30,
        }],
        software_version: "0.1.0".into(),
        started_at_unix_ms: 1_700_000_000_000 + u64::from(n),
    }
}

pub fn node_id(n: u16) -> NodeId {
    NodeId::new(0xa5a5_0000 + u128::from(n)).expect("non-zero")
}

/// Polls `done` every 50 ms until it holds; panics naming `what` after `limit`.
pub async fn wait_until<F, Fut>(what: &str, limit: std::time::Duration, mut done: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + limit;
    while !done().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: not within {limit:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

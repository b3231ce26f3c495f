//! Node drain (docs/cluster-metadata.md): an operator marks a node to be emptied before it is
//! removed. A draining node claims no vdisk and gets no new copy; the curator moves every copy
//! and claim it holds to other nodes. One record per draining node, without a lease, so a
//! drain survives restarts of the node and of everything else until it is cancelled.

use ashlar_meta::{KeyRange, MetaStore, Txn, TxnOp};
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;

use crate::error::ClusterError;
use crate::keys;
use crate::node_id::NodeId;
use crate::record::{self, Versioned};

/// Format version of [`DrainRecord`].
pub const DRAIN_RECORD_VERSION: u32 = 1;

/// The value of a draining node's drain key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DrainRecord {
    pub version: u32,
    pub node: NodeId,
    /// When the drain was asked for (Unix time, milliseconds).
    pub started_unix_ms: u64,
}

impl Versioned for DrainRecord {
    const VERSION: u32 = DRAIN_RECORD_VERSION;
    const NAME: &'static str = "drain record";
}

/// Marks `node` draining (again: the start time is kept).
pub async fn start_drain<M: MetaStore>(
    store: &M,
    node: NodeId,
    now_unix_ms: u64,
) -> Result<DrainRecord, ClusterError> {
    let key = keys::drain_key(node);
    let wanted = DrainRecord {
        version: DRAIN_RECORD_VERSION,
        node,
        started_unix_ms: now_unix_ms,
    };
    let txn = Txn::new()
        .when([ashlar_meta::Compare::absent(key.clone())])
        .and_then([TxnOp::put(key.clone(), record::encode(&wanted), None)]);
    store.txn(txn).await?;
    match store.get(&key).await? {
        Some(kv) => record::decode(&kv.key, &kv.value),
        None => Ok(wanted),
    }
}

/// Ends `node`'s drain; whether it was draining.
pub async fn cancel_drain<M: MetaStore>(store: &M, node: NodeId) -> Result<bool, ClusterError> {
    let key = keys::drain_key(node);
    let existed = store.get(&key).await?.is_some();
    store.delete(KeyRange::key(key)).await?;
    Ok(existed)
}

/// The nodes being drained.
pub async fn draining_nodes<M: MetaStore>(store: &M) -> Result<BTreeSet<NodeId>, ClusterError> {
    let kvs = store.range(keys::drains(), None).await?;
    kvs.iter()
        .map(|kv| record::decode::<DrainRecord>(&kv.key, &kv.value).map(|r| r.node))
        .collect()
}

/// Whether `node` is being drained.
pub async fn is_draining<M: MetaStore>(store: &M, node: NodeId) -> Result<bool, ClusterError> {
    Ok(store.get(&keys::drain_key(node)).await?.is_some())
}

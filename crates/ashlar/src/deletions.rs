//! Cluster mode: a vdisk deleted through another node is dropped here too. The deleting
//! node writes a tombstone (`ashlar_engine::catalog`); this task watches tombstones and has
//! the engine remove this node's copy of the vdisk (its oplog and extent files), so copies of
//! replicated vdisks do not outlive them and `vdisk list` stops naming them.

use crate::cluster::NodeMeta;
use crate::registry::NodeEngine;
use ashlar_engine::catalog;
use ashlar_meta::{EventKind, MetaStore};
use std::sync::Arc;
use std::time::Duration;

/// Pause before watching again after the watch failed (etcd away).
const RETRY: Duration = Duration::from_secs(1);

/// Follows tombstones for as long as the node runs (spawned on the control runtime).
pub async fn follow_deletions(engine: Arc<NodeEngine>, meta: NodeMeta) {
    loop {
        if let Err(error) = follow_once(&engine, &meta).await {
            tracing::debug!(%error, "watch of deleted vdisks ended; watching again");
        }
        tokio::time::sleep(RETRY).await;
    }
}

/// Drops every vdisk the catalog no longer names (deleted while this node was not watching:
/// the deleting node removes its tombstone once its own data is gone), then each one
/// tombstoned from now on, until the watch fails. The watch starts at the revision read
/// before the first pass, so nothing deleted in between is missed (dropping twice does
/// nothing).
async fn follow_once(engine: &NodeEngine, meta: &NodeMeta) -> Result<(), String> {
    let revision = meta.current_revision().await.map_err(|e| e.to_string())?;
    let listed: std::collections::HashSet<_> = catalog::list(meta)
        .await
        .map_err(|e| e.to_string())?
        .into_iter()
        .map(|record| record.id)
        .collect();
    for vdisk in engine.list_vdisks() {
        if !listed.contains(&vdisk.id) {
            forget(engine, vdisk.id).await;
        }
    }
    let mut watch = meta
        .watch(catalog::tombstone_range(), Some(revision.next()))
        .await
        .map_err(|e| e.to_string())?;
    loop {
        let event = watch.next_event().await.map_err(|e| e.to_string())?;
        if event.kind != EventKind::Put {
            continue;
        }
        match catalog::tombstone_id(&event.kv.key) {
            Ok(id) => forget(engine, id).await,
            Err(error) => tracing::warn!(%error, "ignoring a tombstone that names no vdisk"),
        }
    }
}

async fn forget(engine: &NodeEngine, id: ashlar_core::VdiskId) {
    if let Err(error) = engine.forget_deleted(id).await {
        tracing::warn!(vdisk = %id, %error,
            "could not remove this node's copy of a deleted vdisk; it stays on disk (the next \
             start sets it aside in quarantine)");
    }
}

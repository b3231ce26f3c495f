//! `GET /api/v1/cluster` (`ashlar cluster status`): the cluster's health as etcd records it,
//! gathered here and judged by the pure `ashlar_cluster::cluster_status`.

use crate::cluster::NodeMeta;
use ashlar_cluster::{
    cluster_status, keys, list_nodes, read_ownership, record, ClusterStatus, PlacementRecord,
    ResyncRecord, VdiskFacts,
};
use ashlar_meta::MetaStore;
use std::collections::HashMap;

/// Reads nodes, the catalog, owners, copy sets and resyncs (a handful of etcd requests per
/// vdisk: a control-plane page, never on the data path).
pub async fn gather(meta: &NodeMeta) -> Result<ClusterStatus, String> {
    let nodes = list_nodes(meta)
        .await
        .map_err(|e| format!("listing nodes: {e}"))?;
    let records = ashlar_engine::catalog::list(meta)
        .await
        .map_err(|e| format!("reading the vdisk catalog: {e}"))?;
    let mut placements: HashMap<_, PlacementRecord> = HashMap::new();
    for kv in range(meta, keys::placements()).await? {
        let placement: PlacementRecord =
            record::decode(&kv.key, &kv.value).map_err(|e| e.to_string())?;
        placements.insert(placement.vdisk, placement);
    }
    let mut resyncs = HashMap::new();
    for kv in range(meta, keys::resyncs()).await? {
        let resync: ResyncRecord = record::decode(&kv.key, &kv.value).map_err(|e| e.to_string())?;
        resyncs.insert(resync.vdisk, resync);
    }
    let mut vdisks = Vec::with_capacity(records.len());
    for vdisk in records {
        let ownership = read_ownership(meta, vdisk.id)
            .await
            .map_err(|e| format!("reading the ownership of {}: {e}", vdisk.name))?;
        let placement = placements.remove(&vdisk.id);
        vdisks.push(VdiskFacts {
            id: vdisk.id,
            name: vdisk.name,
            replication_factor: vdisk.replication_factor,
            owner: ownership.owner.map(|(owner, _)| owner.node),
            last_owner: ownership.last_owner,
            synced_epoch: placement.as_ref().map_or(0, |p| p.synced_epoch),
            copies: placement.map(|p| p.copies).unwrap_or_default(),
        });
    }
    Ok(cluster_status(&nodes, &vdisks, &resyncs))
}

async fn range(
    meta: &NodeMeta,
    range: ashlar_meta::KeyRange,
) -> Result<Vec<ashlar_meta::KeyValue>, String> {
    meta.range(range, None)
        .await
        .map_err(|e| format!("reading etcd: {e}"))
}

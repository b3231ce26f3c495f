//! `ashlar cluster status`: how healthy the cluster's data is, from what etcd holds (nodes,
//! the catalog's vdisks, owners, copy sets and resyncs in progress). Pure: the records and
//! the time come in, the report goes out, so every rule is unit-tested.

use crate::membership::{NodeState, NodeStatus};
use crate::node_id::NodeId;
use crate::record::Versioned;
use ashlar_core::VdiskId;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

pub const RESYNC_RECORD_VERSION: u32 = 1;

/// A resync in progress (`/ashlar/v1/cluster/resync/<vdisk>`), written by the node copying
/// a vdisk to its other copies about once a second, deleted when it ends.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResyncRecord {
    pub version: u32,
    pub vdisk: VdiskId,
    pub node: NodeId,
    pub epoch: u64,
    /// Bytes of the vdisk to go through, and gone through so far.
    pub total_bytes: u64,
    pub done_bytes: u64,
    pub started_unix_ms: u64,
    pub updated_unix_ms: u64,
}

impl Versioned for ResyncRecord {
    const VERSION: u32 = RESYNC_RECORD_VERSION;
    const NAME: &'static str = "resync record";
}

/// One vdisk as the status needs it.
#[derive(Debug, Clone)]
pub struct VdiskFacts {
    pub id: VdiskId,
    pub name: String,
    pub replication_factor: u8,
    pub owner: Option<NodeId>,
    pub last_owner: Option<NodeId>,
    /// The recorded copy set (replicated vdisks claimed at least once, RF 1 vdisks that
    /// moved).
    pub copies: Vec<NodeId>,
    /// The placement's `synced_epoch`: the last claim whose resync completed (0: none since
    /// the set changed, or no set).
    pub synced_epoch: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Health {
    /// Every copy is on a node that is up.
    Ok,
    /// Its owner is copying it to other copies (they lack older data until it ends).
    Rebuilding,
    /// Some copies are on nodes that are down.
    UnderReplicated,
    /// No node that is up holds it.
    Unavailable,
    /// Never served: it holds no data yet.
    Empty,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ResyncView {
    pub node: NodeId,
    pub total_bytes: u64,
    pub done_bytes: u64,
    pub rate_bytes_per_second: u64,
    /// `None` until there is a rate to go by.
    pub eta_seconds: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct VdiskHealth {
    pub name: String,
    pub id: VdiskId,
    pub replication_factor: u8,
    pub owner: Option<NodeId>,
    /// The nodes holding its data (the last owner of an unreplicated vdisk that never moved).
    pub copies: Vec<NodeId>,
    pub copies_up: usize,
    pub health: Health,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resync: Option<ResyncView>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ClusterStatus {
    pub nodes_up: usize,
    pub nodes_down: usize,
    pub vdisks: Vec<VdiskHealth>,
    pub under_replicated: usize,
    pub rebuilding: usize,
    pub unavailable: usize,
    /// How many more node failures every vdisk's data survives now (`None`: no data yet).
    pub fault_tolerance: Option<usize>,
}

pub fn cluster_status(
    nodes: &[NodeStatus],
    vdisks: &[VdiskFacts],
    resyncs: &HashMap<VdiskId, ResyncRecord>,
) -> ClusterStatus {
    let up = |node: &NodeId| {
        nodes
            .iter()
            .any(|n| n.record.node_id == *node && n.state == NodeState::Up)
    };
    let nodes_up = nodes.iter().filter(|n| n.state == NodeState::Up).count();
    let mut fault_tolerance: Option<usize> = None;
    let mut report = Vec::new();
    for vdisk in vdisks {
        // An RF 1 vdisk that never moved has no copy set: its data is on its last owner.
        let copies = if vdisk.replication_factor > 1 || !vdisk.copies.is_empty() {
            vdisk.copies.clone()
        } else {
            vdisk.last_owner.into_iter().collect()
        };
        let copies_up = copies.iter().filter(|n| up(n)).count();
        let record = resyncs.get(&vdisk.id);
        let resync = record
            .filter(|r| up(&r.node) && vdisk.owner == Some(r.node))
            .map(resync_view);
        // A record its claim did not see through (the resync failed, or its node died or
        // gave the vdisk up) and no later claim replaced: the other copies may lack writes.
        let unfinished = resync.is_none() && record.is_some_and(|r| vdisk.synced_epoch < r.epoch);
        let health = match (copies.len(), copies_up, &resync) {
            (0, _, _) => Health::Empty,
            (_, 0, _) => Health::Unavailable,
            (_, _, Some(_)) => Health::Rebuilding,
            (n, up, None) if up < n || n < usize::from(vdisk.replication_factor) || unfinished => {
                Health::UnderReplicated
            }
            _ => Health::Ok,
        };
        // Copies still being filled do not hold older data yet: only the owner counts (or
        // the node whose resync did not finish).
        let holding = match health {
            Health::Empty => None,
            Health::Rebuilding => Some(1),
            _ if unfinished => Some(1),
            _ => Some(copies_up),
        };
        if let Some(holding) = holding {
            let survives = holding.saturating_sub(1);
            fault_tolerance = Some(fault_tolerance.map_or(survives, |f| f.min(survives)));
        }
        report.push(VdiskHealth {
            name: vdisk.name.clone(),
            id: vdisk.id,
            replication_factor: vdisk.replication_factor,
            owner: vdisk.owner,
            copies,
            copies_up,
            health,
            resync,
        });
    }
    let count = |h: Health| report.iter().filter(|v| v.health == h).count();
    ClusterStatus {
        nodes_up,
        nodes_down: nodes.len() - nodes_up,
        under_replicated: count(Health::UnderReplicated),
        rebuilding: count(Health::Rebuilding),
        unavailable: count(Health::Unavailable),
        vdisks: report,
        fault_tolerance,
    }
}

fn resync_view(record: &ResyncRecord) -> ResyncView {
    let elapsed_ms = record
        .updated_unix_ms
        .saturating_sub(record.started_unix_ms);
    let rate = record.done_bytes.saturating_mul(1000) / elapsed_ms.max(1);
    let left = record.total_bytes.saturating_sub(record.done_bytes);
    ResyncView {
        node: record.node,
        total_bytes: record.total_bytes,
        done_bytes: record.done_bytes,
        rate_bytes_per_second: rate,
        eta_seconds: (rate > 0).then(|| left.div_ceil(rate)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u128) -> NodeId {
        NodeId::new(n).unwrap()
    }

    fn node(n: u128, up: bool) -> NodeStatus {
        NodeStatus::bare(id(n), if up { NodeState::Up } else { NodeState::Down })
    }

    fn vdisk(n: u64, rf: u8, owner: Option<u128>, copies: &[u128]) -> VdiskFacts {
        VdiskFacts {
            id: VdiskId(n),
            name: format!("v{n}"),
            replication_factor: rf,
            owner: owner.map(id),
            last_owner: owner.map(id),
            copies: copies.iter().map(|c| id(*c)).collect(),
            synced_epoch: 0,
        }
    }

    #[test]
    fn fault_tolerance_is_the_least_any_vdisk_survives() {
        let nodes = [node(1, true), node(2, true), node(3, false)];
        let vdisks = [
            vdisk(1, 3, Some(1), &[1, 2, 3]), // one copy down: survives 1 more failure
            vdisk(2, 2, Some(2), &[2, 1]),    // fine: survives 1
            vdisk(3, 2, None, &[]),           // never served
        ];
        let status = cluster_status(&nodes, &vdisks, &HashMap::new());
        assert_eq!((status.nodes_up, status.nodes_down), (2, 1));
        let health: Vec<Health> = status.vdisks.iter().map(|v| v.health).collect();
        assert_eq!(health, [Health::UnderReplicated, Health::Ok, Health::Empty]);
        assert_eq!(status.fault_tolerance, Some(1));
        assert_eq!(status.under_replicated, 1);
        // An unreplicated vdisk with data survives no failure.
        let status = cluster_status(&nodes, &[vdisk(4, 1, Some(1), &[])], &HashMap::new());
        assert_eq!(status.fault_tolerance, Some(0));
        assert_eq!(status.vdisks[0].copies, vec![id(1)]);
        // Its only node down: unavailable.
        let status = cluster_status(&nodes, &[vdisk(5, 1, Some(3), &[])], &HashMap::new());
        assert_eq!(status.vdisks[0].health, Health::Unavailable);
        assert_eq!(status.unavailable, 1);
        assert_eq!(
            cluster_status(&nodes, &[], &HashMap::new()).fault_tolerance,
            None
        );
    }

    #[test]
    fn a_rebuild_shows_its_rate_and_eta_and_counts_only_the_owner() {
        let nodes = [node(1, true), node(2, true)];
        let record = ResyncRecord {
            version: RESYNC_RECORD_VERSION,
            vdisk: VdiskId(1),
            node: id(1),
            epoch: 4,
            total_bytes: 10_000_000,
            done_bytes: 2_000_000,
            started_unix_ms: 1_000,
            updated_unix_ms: 11_000,
        };
        let resyncs = HashMap::from([(VdiskId(1), record.clone())]);
        let status = cluster_status(&nodes, &[vdisk(1, 2, Some(1), &[1, 2])], &resyncs);
        let v = &status.vdisks[0];
        assert_eq!(v.health, Health::Rebuilding);
        let view = v.resync.as_ref().unwrap();
        assert_eq!(view.rate_bytes_per_second, 200_000);
        assert_eq!(view.eta_seconds, Some(40));
        assert_eq!(status.fault_tolerance, Some(0));
        assert_eq!(status.rebuilding, 1);
        // A record its claim did not see through (the resync failed, or its node died or
        // released the vdisk) and no later claim replaced: the other copies may lack writes.
        for owner in [None, Some(2)] {
            let status = cluster_status(&nodes, &[vdisk(1, 2, owner, &[2, 1])], &resyncs);
            let v = &status.vdisks[0];
            assert_eq!(v.health, Health::UnderReplicated, "owner {owner:?}");
            assert!(v.resync.is_none());
            assert_eq!(status.fault_tolerance, Some(0));
        }
        // The same record once the placement says that resync (or a later one) completed: a
        // leftover whose removal failed, ignored.
        let synced = VdiskFacts {
            synced_epoch: 4,
            ..vdisk(1, 2, None, &[2, 1])
        };
        let status = cluster_status(&nodes, &[synced], &resyncs);
        assert_eq!(status.vdisks[0].health, Health::Ok);
        assert_eq!(status.fault_tolerance, Some(1));
    }
}

//! Trimming copies (cluster mode): a node that holds data of a replicated vdisk whose copy
//! set no longer names it (its copy was replaced while it was down, moved off by a drain, or
//! handed on with the vdisk) removes that data once the set is known to hold everything
//! without it (`docs/replication.md`, "Trimming dropped copies").
//!
//! Every node scans its own vdisks every [`TRIM_SCAN_INTERVAL`]. A copy is dropped when this
//! node neither owns the vdisk nor is in its copy set, the set's last claim finished its
//! resync (the placement's `synced_epoch`, and no copy is being filled), and every node of the
//! set is up. Once it has
//! been seen dropped for `--trim-copies-after-s`, the replica receiver removes it, in its
//! loop and only if no claim at the current owner epoch or later fenced this node (such a
//! claim may be making it a copy again).

use crate::cluster::NodeMeta;
use crate::ownership::NodeOwnership;
use crate::registry::NodeEngine;
use ashlar_cluster::{
    list_nodes, read_ownership, read_placement, NodeId, NodeState, NodeStatus, PlacementRecord,
};
use ashlar_core::VdiskId;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often a node looks for data of vdisks whose copy set left it behind.
pub const TRIM_SCAN_INTERVAL: Duration = Duration::from_secs(10);

/// Whether this node's data of a vdisk is a copy the vdisk no longer needs: the rule, pure.
pub fn copy_is_dropped(
    me: NodeId,
    owner: Option<NodeId>,
    placement: &PlacementRecord,
    nodes: &[NodeStatus],
) -> bool {
    let up = |node: &NodeId| {
        nodes
            .iter()
            .any(|n| n.record.node_id == *node && n.state == NodeState::Up)
    };
    owner != Some(me)
        && !placement.copies.contains(&me)
        && placement.synced_epoch > 0
        && placement.filling.is_empty()
        && placement.copies.iter().all(up)
}

/// Vdisks whose copy here was seen dropped, and since when (this node's clock).
#[derive(Default)]
pub struct DroppedSince(HashMap<VdiskId, Instant>);

impl DroppedSince {
    /// Updates from one scan (`dropped`: what it found dropped now); returns those dropped
    /// for at least `after` at `now`. A copy not dropped at some scan starts over.
    pub fn update(&mut self, dropped: &[VdiskId], now: Instant, after: Duration) -> Vec<VdiskId> {
        self.0.retain(|vdisk, _| dropped.contains(vdisk));
        for vdisk in dropped {
            self.0.entry(*vdisk).or_insert(now);
        }
        let mut due: Vec<VdiskId> = self
            .0
            .iter()
            .filter(|(_, since)| now.duration_since(**since) >= after)
            .map(|(vdisk, _)| *vdisk)
            .collect();
        due.sort();
        due
    }
}

/// Scans for as long as the node runs.
pub async fn run(
    engine: Arc<NodeEngine>,
    meta: NodeMeta,
    ownership: NodeOwnership,
    me: NodeId,
    after: Duration,
) {
    let mut since = DroppedSince::default();
    loop {
        tokio::time::sleep(TRIM_SCAN_INTERVAL).await;
        let Ok(nodes) = list_nodes(&meta).await else {
            continue;
        };
        let mut dropped = Vec::new();
        let mut epochs = HashMap::new();
        let local = engine.list_vdisks();
        for info in &local {
            // The owner epoch is read before the copy set: a claim that makes this node a
            // copy again fences it at that epoch or a later one, which stops the trim.
            let Ok(state) = read_ownership(&meta, info.id).await else {
                continue;
            };
            let Ok(Some(placement)) = read_placement(&meta, info.id).await else {
                continue;
            };
            let owner = state.owner.as_ref().map(|(owner, _)| owner.node);
            if info.connections == 0 && copy_is_dropped(me, owner, &placement, &nodes) {
                dropped.push(info.id);
                epochs.insert(info.id, state.epoch().0);
            }
        }
        for vdisk in since.update(&dropped, Instant::now(), after) {
            let epoch = epochs[&vdisk];
            match ownership.trim_copy(vdisk, epoch).await {
                Ok(true) => {
                    tracing::info!(%vdisk, epoch, "trimmed this node's copy: the copy set holds everything without it");
                }
                Ok(false) => {}
                Err(error) => {
                    tracing::warn!(%vdisk, %error, "could not trim this node's dropped copy; trying again at the next scan");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u128) -> NodeId {
        NodeId::new(n).unwrap()
    }

    fn placement(copies: &[NodeId], synced_epoch: u64) -> PlacementRecord {
        PlacementRecord {
            version: ashlar_cluster::PLACEMENT_RECORD_VERSION,
            vdisk: VdiskId(1),
            copies: copies.to_vec(),
            synced_epoch,
            filling: Vec::new(),
            released_in_sync: None,
        }
    }

    #[test]
    fn only_a_copy_left_out_of_a_complete_set_of_live_nodes_is_dropped() {
        let (me, a, b) = (id(1), id(2), id(3));
        let up = |n: NodeId| NodeStatus::bare(n, NodeState::Up);
        let nodes = [up(me), up(a), up(b)];
        assert!(copy_is_dropped(me, Some(a), &placement(&[a, b], 5), &nodes));
        assert!(copy_is_dropped(me, None, &placement(&[a, b], 5), &nodes));
        // In the set, owner, or the set not resynced since it changed: kept.
        assert!(!copy_is_dropped(
            me,
            Some(a),
            &placement(&[a, me], 5),
            &nodes
        ));
        assert!(!copy_is_dropped(
            me,
            Some(me),
            &placement(&[a, b], 5),
            &nodes
        ));
        assert!(!copy_is_dropped(
            me,
            Some(a),
            &placement(&[a, b], 0),
            &nodes
        ));
        let mut still_filling = placement(&[a, b], 5);
        still_filling.filling = vec![b];
        assert!(!copy_is_dropped(me, Some(a), &still_filling, &nodes));
        // A node of the set is down: this data may still be worth something.
        let down = [up(me), up(a), NodeStatus::bare(b, NodeState::Down)];
        assert!(!copy_is_dropped(me, Some(a), &placement(&[a, b], 5), &down));
    }

    #[test]
    fn a_copy_is_due_only_after_being_seen_dropped_for_the_delay() {
        let (one, two) = (VdiskId(1), VdiskId(2));
        let after = Duration::from_secs(60);
        let start = Instant::now();
        let mut since = DroppedSince::default();
        assert!(since.update(&[one], start, after).is_empty());
        let later = start + Duration::from_secs(61);
        assert_eq!(since.update(&[one, two], later, after), vec![one]);
        // Not dropped at one scan: the delay starts over.
        assert!(since.update(&[two], later, after).is_empty());
        assert!(since.update(&[one], later, after).is_empty());
        assert_eq!(since.update(&[one], later, Duration::ZERO), vec![one]);
    }
}

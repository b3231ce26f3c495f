//! The curator's re-replication (cluster mode): a replicated vdisk with a copy on a node that
//! has been down for `--rereplicate-after-s` gets its full copy count back from the copies
//! that survive, whether or not a client writes to it (`docs/replication.md`, "Curator").
//!
//! Each node scans every few seconds. The owner of such a vdisk claims it again, which renews
//! its copy set (the down node replaced by the best live node) and resynchronizes the new
//! copy before the gate opens again. A vdisk nobody owns is restored by one node, the
//! *curator leader* (the serving node that is up with the lowest id): it claims the vdisk,
//! which does the same, then gives the claim up again. Writes to an owned vdisk fail while
//! its claim is renewed (as after a failed copy); without a client nothing waits.
//!
//! A node being drained counts as down at once, and its drain also moves the only copy of
//! an RF 1 vdisk it holds ([`placement_to_move`]).
//!
//! Each scan also claims again every vdisk this node serves whose copy set holds a copy
//! beyond its RF that nobody asked for within `--hand-over-copy-keep-s`
//! ([`shrink_extra_copy`]): the claim drops it (`docs/forwarding.md`).

use crate::cluster::NodeMeta;
use crate::ownership::NodeOwnership;
use crate::registry::NodeEngine;
use ashlar_cluster::{
    list_nodes, read_ownership, read_placement, record_placement, NodeId, NodeState, NodeStatus,
    PlacementRecord,
};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often a node looks for vdisks with copies on nodes that are down.
pub const CURATOR_SCAN_INTERVAL: Duration = Duration::from_secs(2);

/// What this node does about one vdisk with a copy on a node down for too long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Restore {
    /// Someone else's job (another node owns it, or another node leads).
    Nothing,
    /// This node owns it: claim it again, which replaces the copy.
    Reclaim,
    /// Nobody owns it and this node leads: claim it to replace the copy, then release.
    ClaimAndRelease,
    /// This node owns it but is being drained: give the claim up, so the leader moves it.
    Release,
}

/// The rule, as a pure function of what the scan read.
/// `overdue`: nodes down long enough, and draining nodes (whose copies move at once).
pub fn restore_action(
    me: NodeId,
    leader: Option<NodeId>,
    owner: Option<NodeId>,
    copies: &[NodeId],
    overdue: &HashSet<NodeId>,
) -> Restore {
    let owned_here = owner == Some(me);
    if owned_here && overdue.contains(&me) {
        // Draining (this node is up): its claims go first, then its copies.
        return Restore::Release;
    }
    if !copies.iter().any(|copy| overdue.contains(copy)) {
        return Restore::Nothing;
    }
    match owner {
        Some(_) if owned_here => Restore::Reclaim,
        Some(_) => Restore::Nothing,
        None if leader == Some(me) => Restore::ClaimAndRelease,
        None => Restore::Nothing,
    }
}

/// Whether the owner of a vdisk with `copies` (RF `rf`) should claim it again to drop the
/// copy beyond RF: a node that asked to take the vdisk over was added to the set, then
/// stopped asking (for `--hand-over-copy-keep-s`) without taking it, and every write still goes to one
/// copy more than RF. The claim's `renew_copies` drops the least preferred copy.
pub fn shrink_extra_copy(rf: u8, copies: &[NodeId], wished: bool) -> bool {
    copies.len() > usize::from(rf) && !wished
}

/// The serving node that is up and not draining with the lowest id: it restores vdisks
/// nobody owns.
pub fn curator_leader(nodes: &[NodeStatus]) -> Option<NodeId> {
    nodes
        .iter()
        .filter(|n| n.state == NodeState::Up && !n.record.storage_only && !n.draining)
        .map(|n| n.record.node_id)
        .min()
}

/// Nodes seen down, and since when (by this node's clock: the first scan that saw it).
#[derive(Default)]
pub struct DownSince(HashMap<NodeId, Instant>);

impl DownSince {
    /// Updates from one listing; returns the nodes down for at least `after` at `now`.
    pub fn update(
        &mut self,
        nodes: &[NodeStatus],
        now: Instant,
        after: Duration,
    ) -> HashSet<NodeId> {
        for node in nodes {
            let id = node.record.node_id;
            if node.state == NodeState::Up {
                self.0.remove(&id);
            } else {
                self.0.entry(id).or_insert(now);
            }
        }
        self.0
            .iter()
            .filter(|(_, since)| now.duration_since(**since) >= after)
            .map(|(id, _)| *id)
            .collect()
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
    let mut down = DownSince::default();
    // A failed restore is logged once per vdisk until it succeeds.
    let mut failing: HashSet<String> = HashSet::new();
    loop {
        tokio::time::sleep(CURATOR_SCAN_INTERVAL).await;
        let nodes = match list_nodes(&meta).await {
            Ok(nodes) => nodes,
            Err(error) => {
                tracing::debug!(%error, "curator: listing nodes failed; next scan");
                continue;
            }
        };
        shrink_extra_copies(&engine, &meta, &ownership).await;
        let draining: HashSet<NodeId> = nodes
            .iter()
            .filter(|n| n.draining)
            .map(|n| n.record.node_id)
            .collect();
        let mut overdue = down.update(&nodes, Instant::now(), after);
        overdue.extend(draining.iter().copied());
        if overdue.is_empty() {
            failing.clear();
            continue;
        }
        let leader = curator_leader(&nodes);
        let records = match ashlar_engine::catalog::list(&meta).await {
            Ok(records) => records,
            Err(error) => {
                tracing::debug!(%error, "curator: listing vdisks failed; next scan");
                continue;
            }
        };
        for record in &records {
            let Ok(state) = read_ownership(&meta, record.id).await else {
                continue;
            };
            let owner = state.owner.as_ref().map(|(owner, _)| owner.node);
            let Some(placement) =
                placement_to_move(&meta, record, me, owner, state.last_owner, &draining).await
            else {
                continue;
            };
            // An RF 1 vdisk's one copy moves off a draining node; on a node that is down
            // there is nothing to restore it from.
            let overdue = if record.replication_factor > 1 {
                &overdue
            } else {
                &draining
            };
            let action = restore_action(me, leader, owner, &placement.copies, overdue);
            if action == Restore::Nothing {
                continue;
            }
            let down_copies: Vec<String> = placement
                .copies
                .iter()
                .filter(|c| overdue.contains(c))
                .map(|c| c.to_string())
                .collect();
            tracing::info!(vdisk = %record.name, moving_from = ?down_copies, ?action,
                "curator: a copy is on a node down for {after:?} or being drained; restoring the vdisk's copies");
            let done = match action {
                Restore::Release => ownership
                    .hand_back(
                        &engine,
                        std::slice::from_ref(&record.name),
                        "this node is being drained",
                    )
                    .await
                    .map_err(|e| e.message),
                _ => {
                    let release = action == Restore::ClaimAndRelease;
                    ownership
                        .restore_copies(&engine, &record.name, release)
                        .await
                }
            };
            match done {
                Ok(()) => {
                    failing.remove(&record.name);
                    tracing::info!(vdisk = %record.name, "curator: copies restored");
                }
                Err(message) => {
                    if failing.insert(record.name.clone()) {
                        tracing::warn!(vdisk = %record.name, reason = %message,
                            "curator: could not restore the vdisk's copies; trying again at the next scan");
                    }
                }
            }
        }
    }
}

/// The vdisk's copy set, for the scan. An RF 1 vdisk has none until it first moves: its
/// data is on its last owner. When that is this node and it is being drained, this node
/// records the set (itself) so that the curator leader can move the copy
/// (`placement::renew_copies` keeps this one as the source).
async fn placement_to_move(
    meta: &NodeMeta,
    record: &ashlar_engine::catalog::VdiskRecord,
    me: NodeId,
    owner: Option<NodeId>,
    last_owner: Option<NodeId>,
    draining: &HashSet<NodeId>,
) -> Option<PlacementRecord> {
    match read_placement(meta, record.id).await {
        Ok(Some(placement)) => return Some(placement),
        Ok(None) => {}
        Err(_) => return None,
    }
    if !records_single_copy(me, record.replication_factor, owner, last_owner, draining) {
        return None;
    }
    match record_placement(meta, record.id, vec![me]).await {
        Ok(placement) => {
            tracing::info!(vdisk = %record.name,
                "curator: this node is being drained and holds the vdisk's one copy; recorded it as the copy set, so that the copy can move");
            Some(placement)
        }
        Err(error) => {
            tracing::debug!(vdisk = %record.name, %error, "curator: recording the copy set failed; next scan");
            None
        }
    }
}

/// Whether `me` records itself as the copy set of a vdisk (RF `rf`) that has none, so that
/// its one copy can move: an RF 1 vdisk whose data is here (owned here, or owned by nobody
/// and last owned here) while this node is being drained.
pub fn records_single_copy(
    me: NodeId,
    rf: u8,
    owner: Option<NodeId>,
    last_owner: Option<NodeId>,
    draining: &HashSet<NodeId>,
) -> bool {
    rf <= 1 && draining.contains(&me) && owner.or(last_owner) == Some(me)
}

/// Claims again each vdisk this node serves whose copy set holds a copy more than its RF
/// that nobody asked for recently (`shrink_extra_copy`).
async fn shrink_extra_copies(engine: &NodeEngine, meta: &NodeMeta, ownership: &NodeOwnership) {
    for info in engine.list_vdisks() {
        if ownership.serving_claim(info.id).is_err() {
            continue;
        }
        let Ok(Some(placement)) = read_placement(meta, info.id).await else {
            continue;
        };
        let wished = ownership.copy_wished(info.id);
        if !shrink_extra_copy(info.replication_factor, &placement.copies, wished) {
            continue;
        }
        tracing::info!(vdisk = %info.name, copies = placement.copies.len(),
            rf = info.replication_factor,
            "curator: the copy added for a node that wanted the vdisk is no longer asked for; \
             claiming the vdisk again to drop the copy beyond its RF");
        if let Err(reason) = ownership.restore_copies(engine, &info.name, false).await {
            tracing::warn!(vdisk = %info.name, %reason,
                "curator: could not drop the copy beyond the vdisk's RF; trying again at the next scan");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u128) -> NodeId {
        NodeId::new(n).unwrap()
    }

    #[test]
    fn the_owner_or_else_the_leader_restores_and_nobody_else() {
        let (me, other, down) = (id(1), id(2), id(3));
        let overdue: HashSet<NodeId> = [down].into();
        let copies = [me, down];
        assert_eq!(
            restore_action(me, Some(other), Some(me), &copies, &overdue),
            Restore::Reclaim
        );
        assert_eq!(
            restore_action(me, Some(me), Some(other), &copies, &overdue),
            Restore::Nothing
        );
        assert_eq!(
            restore_action(me, Some(me), None, &[other, down], &overdue),
            Restore::ClaimAndRelease
        );
        assert_eq!(
            restore_action(me, Some(other), None, &[other, down], &overdue),
            Restore::Nothing
        );
        // This node owns it and is being drained (listed as overdue itself): release.
        let draining: HashSet<NodeId> = [me].into();
        assert_eq!(
            restore_action(me, Some(other), Some(me), &[me, other], &draining),
            Restore::Release
        );
        // Every copy on a node that is up (or not down long enough): nothing to do.
        assert_eq!(
            restore_action(me, Some(me), Some(me), &[me, other], &overdue),
            Restore::Nothing
        );
    }

    #[test]
    fn a_draining_node_records_the_copy_set_of_the_single_copies_it_holds() {
        let (me, other) = (id(1), id(2));
        let draining: HashSet<NodeId> = [me].into();
        assert!(records_single_copy(me, 1, Some(me), Some(me), &draining));
        assert!(records_single_copy(me, 1, None, Some(me), &draining));
        // Its data is elsewhere, it is replicated, or this node is not draining.
        assert!(!records_single_copy(
            me,
            1,
            Some(other),
            Some(other),
            &draining
        ));
        assert!(!records_single_copy(me, 1, None, Some(other), &draining));
        assert!(!records_single_copy(me, 1, None, None, &draining));
        assert!(!records_single_copy(me, 2, Some(me), Some(me), &draining));
        assert!(!records_single_copy(
            me,
            1,
            Some(me),
            Some(me),
            &HashSet::new()
        ));
    }

    #[test]
    fn a_copy_beyond_rf_is_dropped_once_nobody_wants_it() {
        let copies = [id(1), id(2), id(3)];
        assert!(shrink_extra_copy(2, &copies, false));
        assert!(!shrink_extra_copy(2, &copies, true), "asked for recently");
        assert!(!shrink_extra_copy(3, &copies, false), "RF copies");
        assert!(!shrink_extra_copy(2, &copies[..2], false));
    }

    #[test]
    fn a_node_is_overdue_only_after_the_delay_and_forgotten_when_up() {
        let status = |n: u128, up: bool| {
            NodeStatus::bare(id(n), if up { NodeState::Up } else { NodeState::Down })
        };
        let after = Duration::from_secs(60);
        let start = Instant::now();
        let mut down = DownSince::default();
        assert!(down
            .update(&[status(1, true), status(2, false)], start, after)
            .is_empty());
        let later = start + Duration::from_secs(61);
        assert_eq!(
            down.update(&[status(1, true), status(2, false)], later, after),
            [id(2)].into()
        );
        // Back up: forgotten; down again: the delay starts over.
        assert!(down.update(&[status(2, true)], later, after).is_empty());
        assert!(down.update(&[status(2, false)], later, after).is_empty());
        assert_eq!(
            curator_leader(&[status(5, true), status(3, true), status(2, false)]),
            Some(id(3))
        );
    }
}

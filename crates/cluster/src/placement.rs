//! Where a replicated vdisk's copies live: the *copy set*, one record per vdisk under
//! `/ashlar/v1/cluster/placement/` (docs/cluster-metadata.md).
//!
//! The first node that claims a vdisk with RF > 1 chooses its copy set (itself first, for
//! data locality, then RF − 1 other live nodes) and records it with a create-if-absent
//! transaction, so two claimants can never record two different sets. From then on every
//! write of the vdisk goes to every node of the set. Choosing is pure ([`choose_copies`]).

use crate::error::ClusterError;
use crate::keys;
use crate::membership::{NodeState, NodeStatus};
use crate::node_id::NodeId;
use crate::record::{self, Versioned};
use ashlar_core::VdiskId;
use ashlar_meta::{Compare, MetaStore, Revision, Txn, TxnOp};
use serde::{Deserialize, Serialize};

pub const PLACEMENT_RECORD_VERSION: u32 = 1;

/// The value of a vdisk's placement key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlacementRecord {
    pub version: u32,
    pub vdisk: VdiskId,
    /// The nodes holding a copy, the node that chose them first. Distinct.
    pub copies: Vec<NodeId>,
    /// The owner epoch of the last claim that made every copy of this set hold all its
    /// data (0: not since the set was last changed). Only then may a node outside the set
    /// drop what it still holds of the vdisk ([`mark_placement_synced`]).
    #[serde(default)]
    pub synced_epoch: u64,
    /// Copies that may not hold all the data yet (put in the set by a claim whose resync has
    /// not ended): no claimant takes its data from one, and one that claims first gets a
    /// copy from a complete one.
    #[serde(default)]
    pub filling: Vec<NodeId>,
    /// Set by an owner that gave its claim up with every copy holding all of its writes
    /// ([`record_in_sync_release`]): the next claim, if it finds the same copies (or fewer),
    /// compares nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub released_in_sync: Option<InSyncRelease>,
}

/// What an owner recorded when it released a vdisk whose copies all held every write of
/// its claim: its writes were settled, none had failed, and its resync had completed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InSyncRelease {
    /// The released claim's owner epoch.
    pub epoch: u64,
    pub size_bytes: u64,
    /// Every copy of the set then, with the identity it had (a copy that restarted having
    /// lost data, or was trimmed, has a new one).
    pub copies: Vec<InSyncCopy>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InSyncCopy {
    pub node: NodeId,
    /// The copy's identity, 32 hex digits.
    pub identity: String,
}

impl PlacementRecord {
    /// Whether `node` holds a complete copy: in the set and not being filled.
    pub fn holds_complete_copy(&self, node: NodeId) -> bool {
        self.copies.contains(&node) && !self.filling.contains(&node)
    }
}

impl Versioned for PlacementRecord {
    const VERSION: u32 = PLACEMENT_RECORD_VERSION;
    const NAME: &'static str = "placement record";
}

/// Why no copy set can be chosen now.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    #[error("the vdisk keeps {wanted} copies on distinct nodes, but only {up} node(s) are up to hold them; start more nodes")]
    TooFewNodes { wanted: u8, up: usize },
}

/// The copy set for a vdisk first claimed by `me`: `me`, then the `rf − 1` best other nodes
/// that are up ([`ranked_others`]).
pub fn choose_copies(
    me: NodeId,
    rf: u8,
    nodes: &[NodeStatus],
) -> Result<Vec<NodeId>, PlacementError> {
    let others = ranked_others(me, nodes);
    let wanted = usize::from(rf);
    if others.len() + 1 < wanted {
        return Err(PlacementError::TooFewNodes {
            wanted: rf,
            up: others.len() + 1,
        });
    }
    let mut copies = vec![me];
    copies.extend(others.into_iter().take(wanted - 1));
    Ok(copies)
}

/// The nodes other than `me` that are up and not draining, best first for a new copy: storage-only nodes
/// (they hold replicas and serve nobody), then most free space, then lowest id (so the
/// choice is deterministic).
fn ranked_others(me: NodeId, nodes: &[NodeStatus]) -> Vec<NodeId> {
    let mut others: Vec<&NodeStatus> = nodes
        .iter()
        .filter(|n| n.state == NodeState::Up && !n.draining && n.record.node_id != me)
        .collect();
    others.sort_by(|a, b| {
        b.record
            .storage_only
            .cmp(&a.record.storage_only)
            .then(b.record.free_bytes().cmp(&a.record.free_bytes()))
            .then(a.record.node_id.cmp(&b.record.node_id))
    });
    others.iter().map(|n| n.record.node_id).collect()
}

/// The vdisk's recorded copy set, if it has one.
pub async fn read_placement<M: MetaStore>(
    store: &M,
    vdisk: VdiskId,
) -> Result<Option<PlacementRecord>, ClusterError> {
    let key = keys::placement_key(vdisk);
    match store.get(&key).await? {
        Some(kv) => Ok(Some(record::decode(&kv.key, &kv.value)?)),
        None => Ok(None),
    }
}

/// The vdisk's copy set and the revision it was last written at (for
/// [`replace_placement`]).
pub async fn read_placement_revision<M: MetaStore>(
    store: &M,
    vdisk: VdiskId,
) -> Result<Option<(PlacementRecord, Revision)>, ClusterError> {
    let key = keys::placement_key(vdisk);
    match store.get(&key).await? {
        Some(kv) => Ok(Some((record::decode(&kv.key, &kv.value)?, kv.mod_revision))),
        None => Ok(None),
    }
}

/// Replaces the vdisk's copy set by `copies`, of which `filling` do not hold all the data
/// yet, if it is still as read at `revision` (a node that took the vdisk over replaces the
/// copies it found down); false if it changed since.
pub async fn replace_placement<M: MetaStore>(
    store: &M,
    vdisk: VdiskId,
    revision: Revision,
    copies: Vec<NodeId>,
    filling: Vec<NodeId>,
) -> Result<bool, ClusterError> {
    let key = keys::placement_key(vdisk);
    let record = PlacementRecord {
        version: PLACEMENT_RECORD_VERSION,
        vdisk,
        copies,
        synced_epoch: 0,
        filling,
        released_in_sync: None,
    };
    let txn = Txn::new()
        .when([Compare::mod_revision_equals(key.clone(), revision)])
        .and_then([TxnOp::put(key, record::encode(&record), None)]);
    Ok(store.txn(txn).await?.succeeded)
}

/// The copy set a node taking a vdisk over (or claiming it again) serves with: itself first,
/// then the other copies that are up (best first, as [`choose_copies`] ranks nodes: a
/// claimant from outside the set, or a set holding one copy more than RF, drops the least
/// preferred one: a copy still being filled (in `filling`) before any complete one, and
/// never a storage-only copy before a serving node's), then, in place of those that are
/// down, the best other nodes that are up; `rf` nodes in all, or one more when only that
/// keeps a complete copy in the set ([`keep_a_complete_copy`]).
pub fn renew_copies(
    me: NodeId,
    rf: u8,
    copies: &[NodeId],
    filling: &[NodeId],
    nodes: &[NodeStatus],
) -> Result<Vec<NodeId>, PlacementError> {
    // A copy on a draining node is replaced like one on a node that is down.
    let up = |node: &NodeId| {
        nodes
            .iter()
            .any(|n| n.record.node_id == *node && n.state == NodeState::Up && !n.draining)
    };
    let ranked = ranked_others(me, nodes);
    let mut kept: Vec<NodeId> = copies
        .iter()
        .filter(|n| **n != me && up(n))
        .copied()
        .collect();
    if kept.len() >= usize::from(rf) {
        // A claimant from outside the set: the least preferred copy makes room for it.
        kept.sort_by_key(|n| {
            let rank = ranked.iter().position(|r| r == n).unwrap_or(usize::MAX);
            (filling.contains(n), rank)
        });
    }
    let mut renewed = vec![me];
    renewed.extend(kept);
    renewed.truncate(usize::from(rf));
    for candidate in ranked {
        if renewed.len() >= usize::from(rf) {
            break;
        }
        if !renewed.contains(&candidate) {
            renewed.push(candidate);
        }
    }
    keep_a_complete_copy(&mut renewed, copies, filling, nodes);
    if renewed.len() < usize::from(rf) {
        return Err(PlacementError::TooFewNodes {
            wanted: rf,
            up: renewed.len(),
        });
    }
    Ok(renewed)
}

/// A renewed set must not lose the data: when none of its nodes holds a complete copy (the
/// claimant has none, and the complete ones are on draining nodes, or left no room at RF 1),
/// the first complete copy on a node that is up stays in it, one beyond RF. The claimant
/// takes its copy from there; a later claim, once the claimant's copy is complete, drops it.
fn keep_a_complete_copy(
    renewed: &mut Vec<NodeId>,
    copies: &[NodeId],
    filling: &[NodeId],
    nodes: &[NodeStatus],
) {
    let complete = |node: &NodeId| copies.contains(node) && !filling.contains(node);
    if renewed.iter().any(complete) {
        return;
    }
    let up = |node: &NodeId| {
        nodes
            .iter()
            .any(|n| n.record.node_id == *node && n.state == NodeState::Up)
    };
    if let Some(source) = copies.iter().find(|n| complete(n) && up(n)) {
        renewed.push(*source);
    }
}

/// Records `copies` as the vdisk's copy set unless it has one; returns the set now recorded
/// (the one given, or the one another node recorded first).
pub async fn record_placement<M: MetaStore>(
    store: &M,
    vdisk: VdiskId,
    copies: Vec<NodeId>,
) -> Result<PlacementRecord, ClusterError> {
    let key = keys::placement_key(vdisk);
    let wanted = PlacementRecord {
        version: PLACEMENT_RECORD_VERSION,
        vdisk,
        copies,
        synced_epoch: 0,
        filling: Vec::new(),
        released_in_sync: None,
    };
    let txn = Txn::new()
        .when([Compare::absent(key.clone())])
        .and_then([TxnOp::put(key.clone(), record::encode(&wanted), None)]);
    if store.txn(txn).await?.succeeded {
        return Ok(wanted);
    }
    read_placement(store, vdisk)
        .await?
        .ok_or_else(|| ClusterError::corrupt(&key, "placement vanished while being recorded"))
}

/// Records that every copy of `copies` holds all of the vdisk's data as of the claim at
/// `epoch` (its resync ended: none is being filled any more), if the recorded set is still
/// `copies`; false if it changed.
pub async fn mark_placement_synced<M: MetaStore>(
    store: &M,
    vdisk: VdiskId,
    copies: &[NodeId],
    epoch: u64,
) -> Result<bool, ClusterError> {
    let Some((mut placement, revision)) = read_placement_revision(store, vdisk).await? else {
        return Ok(false);
    };
    if placement.copies != copies {
        return Ok(false);
    }
    if placement.synced_epoch >= epoch && placement.filling.is_empty() {
        return Ok(true);
    }
    placement.synced_epoch = placement.synced_epoch.max(epoch);
    placement.filling.clear();
    let key = keys::placement_key(vdisk);
    let txn = Txn::new()
        .when([Compare::mod_revision_equals(key.clone(), revision)])
        .and_then([TxnOp::put(key, record::encode(&placement), None)]);
    Ok(store.txn(txn).await?.succeeded)
}

/// Records `release` in the vdisk's placement if the record still shows the released claim's
/// set as complete: the same nodes, none being filled, synced at `release.epoch`; false if
/// not (the release then records nothing, and the next claim compares everything).
pub async fn record_in_sync_release<M: MetaStore>(
    store: &M,
    vdisk: VdiskId,
    release: InSyncRelease,
) -> Result<bool, ClusterError> {
    let Some((mut placement, revision)) = read_placement_revision(store, vdisk).await? else {
        return Ok(false);
    };
    let same_nodes = placement.copies.len() == release.copies.len()
        && release
            .copies
            .iter()
            .all(|copy| placement.copies.contains(&copy.node));
    if !same_nodes || !placement.filling.is_empty() || placement.synced_epoch != release.epoch {
        return Ok(false);
    }
    placement.released_in_sync = Some(release);
    let key = keys::placement_key(vdisk);
    let txn = Txn::new()
        .when([Compare::mod_revision_equals(key.clone(), revision)])
        .and_then([TxnOp::put(key, record::encode(&placement), None)]);
    Ok(store.txn(txn).await?.succeeded)
}

/// Forgets the vdisk's copy set (the vdisk was deleted).
pub async fn remove_placement<M: MetaStore>(store: &M, vdisk: VdiskId) -> Result<(), ClusterError> {
    store
        .delete(ashlar_meta::KeyRange::key(keys::placement_key(vdisk)))
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{AdvertisedAddresses, DiskRecord, NodeRecord, NODE_RECORD_VERSION};

    fn node(id: u128, up: bool, storage_only: bool, free_bytes: u64) -> NodeStatus {
        NodeStatus {
            record: NodeRecord {
                version: NODE_RECORD_VERSION,
                node_id: NodeId::new(id).unwrap(),
                addresses: AdvertisedAddresses::default(),
                storage_only,
                disks: vec![DiskRecord {
                    path: "/d".into(),
                    tier: "fast".into(),
                    capacity_bytes: 1 << 40,
                    free_bytes,
                }],
                software_version: String::new(),
                started_at_unix_ms: 0,
            },
            state: if up { NodeState::Up } else { NodeState::Down },
            vdisks_owned: 0,
            draining: false,
        }
    }

    fn id(n: u128) -> NodeId {
        NodeId::new(n).unwrap()
    }

    #[test]
    fn the_claimant_comes_first_then_storage_only_then_free_space() {
        let nodes = [
            node(1, true, false, 100),
            node(2, true, false, 500),
            node(3, true, true, 10),
            node(4, false, true, 900),
            node(5, true, false, 500),
        ];
        assert_eq!(choose_copies(id(1), 1, &nodes), Ok(vec![id(1)]));
        // Node 4 is down; storage-only node 3 beats the emptier nodes 2 and 5.
        assert_eq!(choose_copies(id(1), 2, &nodes), Ok(vec![id(1), id(3)]));
        // Equal free space: the lower id, so every node would choose the same.
        assert_eq!(
            choose_copies(id(1), 3, &nodes),
            Ok(vec![id(1), id(3), id(2)])
        );
    }

    #[test]
    fn too_few_nodes_up_is_an_error_naming_both_counts() {
        let nodes = [node(1, true, false, 1), node(2, false, false, 1)];
        let error = choose_copies(id(1), 2, &nodes).unwrap_err();
        assert_eq!(error, PlacementError::TooFewNodes { wanted: 2, up: 1 });
        assert!(
            error.to_string().contains("only 1 node(s) are up"),
            "{error}"
        );
    }

    #[test]
    fn a_taker_keeps_the_copies_that_are_up_and_replaces_the_others() {
        let nodes = [
            node(1, true, false, 100),
            node(2, false, false, 500), // the old owner, down
            node(3, true, true, 10),
            node(4, true, false, 900),
        ];
        // Node 3 takes over from node 2: it keeps itself, replaces 2 by the best up node.
        assert_eq!(
            renew_copies(id(3), 2, &[id(2), id(3)], &[], &nodes),
            Ok(vec![id(3), id(4)])
        );
        // Nothing down: the same set, the claimant first.
        assert_eq!(
            renew_copies(id(1), 3, &[id(4), id(1), id(3)], &[], &nodes),
            Ok(vec![id(1), id(4), id(3)])
        );
        // A claimant from outside the set (its client moved there): the storage-only copy
        // stays, the serving node's copy makes room.
        assert_eq!(
            renew_copies(id(4), 2, &[id(1), id(3)], &[], &nodes),
            Ok(vec![id(4), id(3)])
        );
        // A set of RF + 1 (a copy added for a node that asked for the vdisk): the copy still
        // being filled leaves before a complete one, whatever their ranks.
        assert_eq!(
            renew_copies(id(1), 2, &[id(1), id(3), id(4)], &[id(3)], &nodes),
            Ok(vec![id(1), id(4)])
        );
        assert_eq!(
            renew_copies(id(1), 2, &[id(1), id(3), id(4)], &[], &nodes),
            Ok(vec![id(1), id(3)])
        );
        // A copy on a draining node is replaced, and no new copy goes to one.
        let mut drained = nodes.clone();
        drained[3].draining = true;
        assert_eq!(
            renew_copies(id(1), 2, &[id(1), id(4)], &[], &drained),
            Ok(vec![id(1), id(3)])
        );
        assert_eq!(choose_copies(id(1), 2, &drained), Ok(vec![id(1), id(3)]));
        // The only complete copy is on a draining node: it stays, one beyond RF, as the
        // claimant's source (RF 1 moved off a draining node; RF 2 whose complete copies
        // all drain).
        assert_eq!(
            renew_copies(id(1), 1, &[id(4)], &[], &drained),
            Ok(vec![id(1), id(4)])
        );
        assert_eq!(
            renew_copies(id(1), 2, &[id(4), id(2)], &[id(2)], &drained),
            Ok(vec![id(1), id(3), id(4)])
        );
        // Once the claimant's copy is complete, the draining one goes.
        assert_eq!(
            renew_copies(id(1), 1, &[id(1), id(4)], &[], &drained),
            Ok(vec![id(1)])
        );
        // At RF 1 a claimant from outside keeps the complete copy it takes its data from.
        assert_eq!(
            renew_copies(id(3), 1, &[id(1)], &[], &nodes),
            Ok(vec![id(3), id(1)])
        );
        // No complete copy up: nothing to keep (the claim is refused, `replication`).
        assert_eq!(
            renew_copies(id(1), 1, &[id(2)], &[], &nodes),
            Ok(vec![id(1)])
        );
        let two = [node(1, true, false, 1), node(2, false, false, 1)];
        assert_eq!(
            renew_copies(id(1), 2, &[id(2), id(1)], &[], &two),
            Err(PlacementError::TooFewNodes { wanted: 2, up: 1 })
        );
    }
}

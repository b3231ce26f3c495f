//! Which node may serve a vdisk's I/O, and for how long: the pure decisions behind
//! [`crate::ownership::claim_to_serve`] and the node's serving gates. No store and no clock
//! here: the owner records and the time come in as arguments, so every rule is unit-tested.
//!
//! An unreplicated vdisk's data lives only on the node that served it; a replicated one's on
//! every node of its copy set. Hence a node serves a vdisk only while it holds its ownership
//! claim, claims it only when nobody owns it and it holds the data (it was the last owner or
//! nobody was; or it is in the copy set), and stops serving as soon as its lease is not
//! surely valid any more (docs/cluster-metadata.md, "Serving gate").

use ashlar_meta::LeaseId;
use tokio::time::Instant;

use crate::membership::LeaseStatus;
use crate::node_id::NodeId;
use crate::ownership::{Owner, OwnershipEpoch};

/// Why a node will not serve a vdisk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServeRefusal {
    /// This node holds replicas only; it never owns a vdisk.
    StorageOnly,
    /// Another node owns the vdisk under a live lease.
    OwnedElsewhere {
        owner: NodeId,
        epoch: OwnershipEpoch,
    },
    /// Nobody owns the vdisk, but its data is on `node`, its last owner: serving it here
    /// would show this node's (empty or stale) copy instead.
    DataOnDownNode { node: NodeId },
}

/// Whether `me` may claim a vdisk to serve it, given its current owner record (if any), the
/// node its highest epoch went to (`last_owner`, `None` if it was never claimed) and its copy
/// set (`copies`: empty for an unreplicated vdisk or one never claimed). Every acknowledged
/// write of a replicated vdisk is on every node of its copy set, so any node may take it over
/// when nobody owns it: one holding a copy serves from it, another first gets one.
///
/// An owner record naming `me` is an earlier claim of this same node: a previous run
/// (killed before its lease ended) or a claim whose lease lapsed while etcd was away. The
/// data-directory lock makes sure no other process is this node, so such a claim may be
/// taken over; doing so raises the epoch like any claim.
pub fn decide_serve(
    me: NodeId,
    storage_only: bool,
    owner: Option<&Owner>,
    last_owner: Option<NodeId>,
    copies: &[NodeId],
) -> Result<(), ServeRefusal> {
    if storage_only {
        return Err(ServeRefusal::StorageOnly);
    }
    match (owner, last_owner) {
        (Some(owner), _) if owner.node != me => Err(ServeRefusal::OwnedElsewhere {
            owner: owner.node,
            epoch: owner.epoch,
        }),
        (Some(_), _) => Ok(()),
        // Replicated: the claimant gets a copy from a node holding one if it has none.
        (None, _) if !copies.is_empty() => Ok(()),
        (None, Some(last)) if last != me => Err(ServeRefusal::DataOnDownNode { node: last }),
        (None, _) => Ok(()),
    }
}

/// What to do with one held claim when the node's lease status changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GateStep {
    /// The claim's lease is the node's current one and the gate never lapsed: serve until
    /// this instant.
    ExtendUntil(Instant),
    /// The gate must stay shut until the vdisk is claimed again, at a higher epoch: the
    /// lease changed (every claim on the old one has ended) or the gate lapsed meanwhile
    /// (it refused I/O, so serving again starts a new epoch).
    Reclaim,
}

/// The decision for one claim held on `claim_lease` whose gate is open until `open_until`
/// (`None`: closed), at `now`, given the node's current lease `status`.
pub fn gate_step(
    claim_lease: LeaseId,
    open_until: Option<Instant>,
    status: &LeaseStatus,
    now: Instant,
) -> GateStep {
    match open_until {
        Some(until) if claim_lease == status.lease && now < until => {
            // A keep-alive never moves validity back (LeaseStatus guarantees that), but
            // the gate must not move back either, whatever order updates arrive in.
            GateStep::ExtendUntil(until.max(status.valid_until))
        }
        _ => GateStep::Reclaim,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn node(n: u128) -> NodeId {
        NodeId::new(n).unwrap()
    }

    fn owner(n: u128, epoch: u64) -> Owner {
        Owner {
            node: node(n),
            epoch: OwnershipEpoch(epoch),
            lease: Some(LeaseId(n as i64)),
        }
    }

    #[test]
    fn a_node_claims_what_nobody_owns_and_it_last_owned_or_nobody_did() {
        let me = node(1);
        assert_eq!(decide_serve(me, false, None, None, &[]), Ok(()));
        assert_eq!(decide_serve(me, false, None, Some(me), &[]), Ok(()));
        // Its own earlier claim (previous run, lapsed lease) is taken over.
        assert_eq!(
            decide_serve(me, false, Some(&owner(1, 4)), Some(me), &[]),
            Ok(())
        );
    }

    #[test]
    fn another_owner_or_data_on_a_down_node_is_refused() {
        let me = node(1);
        assert_eq!(
            decide_serve(me, false, Some(&owner(2, 3)), Some(node(2)), &[]),
            Err(ServeRefusal::OwnedElsewhere {
                owner: node(2),
                epoch: OwnershipEpoch(3)
            })
        );
        assert_eq!(
            decide_serve(me, false, None, Some(node(2)), &[]),
            Err(ServeRefusal::DataOnDownNode { node: node(2) })
        );
    }

    #[test]
    fn any_node_takes_over_a_replicated_vdisk_nobody_owns() {
        let (me, a, b) = (node(1), node(2), node(3));
        // The last owner is down (no owner record): a copy holder may claim, and so may a
        // node holding none (it gets a copy first); unlike an unreplicated vdisk's.
        assert_eq!(decide_serve(me, false, None, Some(a), &[a, me]), Ok(()));
        assert_eq!(decide_serve(me, false, None, Some(a), &[a, b]), Ok(()));
        assert_eq!(
            decide_serve(me, false, None, Some(a), &[]),
            Err(ServeRefusal::DataOnDownNode { node: a })
        );
        // A live owner still wins.
        assert_eq!(
            decide_serve(me, false, Some(&owner(2, 5)), Some(a), &[a, me]),
            Err(ServeRefusal::OwnedElsewhere {
                owner: a,
                epoch: OwnershipEpoch(5)
            })
        );
    }

    #[test]
    fn storage_only_nodes_never_claim() {
        let me = node(1);
        for (current, last) in [(None, None), (Some(owner(1, 1)), Some(me))] {
            assert_eq!(
                decide_serve(me, true, current.as_ref(), last, &[me]),
                Err(ServeRefusal::StorageOnly)
            );
        }
    }

    #[test]
    fn gate_extends_only_on_the_same_lease_before_it_lapsed() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let status = LeaseStatus {
            lease: LeaseId(7),
            valid_until: t0 + 10 * s,
        };
        assert_eq!(
            gate_step(LeaseId(7), Some(t0 + 5 * s), &status, t0 + s),
            GateStep::ExtendUntil(t0 + 10 * s)
        );
        // Never moves back, even if an older status arrives late.
        assert_eq!(
            gate_step(LeaseId(7), Some(t0 + 12 * s), &status, t0 + s),
            GateStep::ExtendUntil(t0 + 12 * s)
        );
        // Lapsed (at or past its instant): a new epoch first, even on the same lease.
        assert_eq!(
            gate_step(LeaseId(7), Some(t0 + 5 * s), &status, t0 + 5 * s),
            GateStep::Reclaim
        );
        // Another lease: every claim on the old one is gone.
        assert_eq!(
            gate_step(LeaseId(6), Some(t0 + 5 * s), &status, t0 + s),
            GateStep::Reclaim
        );
        // A closed gate reopens only through a claim.
        assert_eq!(gate_step(LeaseId(7), None, &status, t0), GateStep::Reclaim);
    }
}

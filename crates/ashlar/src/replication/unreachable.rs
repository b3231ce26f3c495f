//! Copies this node's claims could not reach, and since when (`docs/replication.md`,
//! "Unreachable copies"). Pure: time is a parameter.
//!
//! A copy on a node that keeps its etcd lease but does not answer this node (a network cut
//! between the two, a copy that refuses its fence) is not replaced as a copy on a node that
//! is down would be: writes fail until it answers again. After
//! `--replace-unreachable-copy-after-s` of failed fences in a row, the next claim replaces
//! it like a copy on a down node, provided the claimant holds a complete copy itself and
//! the replacement answers a fence first (so a claimant cut off from everyone never gives
//! away a complete copy for one it cannot reach either).

use ashlar_cluster::NodeId;
use ashlar_core::VdiskId;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Copies tracked at once; failures of more are not tracked (those copies wait for the
/// cut to heal, as with the replacement off).
pub const UNREACHABLE_COPIES_LIMIT: usize = 4096;

/// Since when each copy has failed every fence of this node's claims.
#[derive(Default)]
pub struct UnreachableCopies {
    since: HashMap<(VdiskId, NodeId), Instant>,
}

impl UnreachableCopies {
    /// A claim at `now` could not fence `node`'s copy of `vdisk`.
    pub fn failed(&mut self, vdisk: VdiskId, node: NodeId, now: Instant) {
        if self.since.len() >= UNREACHABLE_COPIES_LIMIT && !self.since.contains_key(&(vdisk, node))
        {
            return;
        }
        self.since.entry((vdisk, node)).or_insert(now);
    }

    /// `node`'s copy of `vdisk` answered a fence.
    pub fn answered(&mut self, vdisk: VdiskId, node: NodeId) {
        self.since.remove(&(vdisk, node));
    }

    /// The nodes whose copy of `vdisk` has failed every fence for at least `after`.
    pub fn due(&self, vdisk: VdiskId, now: Instant, after: Duration) -> Vec<NodeId> {
        let mut due: Vec<NodeId> = self
            .since
            .iter()
            .filter(|((v, _), since)| *v == vdisk && now.duration_since(**since) >= after)
            .map(|((_, node), _)| *node)
            .collect();
        due.sort();
        due
    }

    /// Forgets the vdisk's copies (it was given up, or its set no longer names them).
    pub fn forget(&mut self, vdisk: VdiskId, keep: impl Fn(NodeId) -> bool) {
        self.since.retain(|(v, node), _| *v != vdisk || keep(*node));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VDISK: VdiskId = VdiskId(3);

    fn node(n: u128) -> NodeId {
        NodeId::new(n).unwrap()
    }

    #[test]
    fn a_copy_is_due_after_failing_every_fence_for_long_enough() {
        let mut copies = UnreachableCopies::default();
        let start = Instant::now();
        let after = Duration::from_secs(30);
        copies.failed(VDISK, node(2), start);
        copies.failed(VDISK, node(2), start + Duration::from_secs(20));
        assert!(copies
            .due(VDISK, start + Duration::from_secs(29), after)
            .is_empty());
        assert_eq!(
            copies.due(VDISK, start + Duration::from_secs(30), after),
            vec![node(2)]
        );
        assert!(
            copies
                .due(VdiskId(4), start + Duration::from_secs(60), after)
                .is_empty(),
            "another vdisk's copies"
        );

        // An answer starts the count again.
        copies.answered(VDISK, node(2));
        copies.failed(VDISK, node(2), start + Duration::from_secs(40));
        assert!(copies
            .due(VDISK, start + Duration::from_secs(60), after)
            .is_empty());
        assert_eq!(
            copies.due(VDISK, start + Duration::from_secs(70), after),
            vec![node(2)]
        );

        copies.forget(VDISK, |n| n != node(2));
        assert!(copies
            .due(VDISK, start + Duration::from_secs(99), after)
            .is_empty());
    }

    #[test]
    fn tracking_is_bounded() {
        let mut copies = UnreachableCopies::default();
        let start = Instant::now();
        for v in 0..UNREACHABLE_COPIES_LIMIT as u64 {
            copies.failed(VdiskId(v + 100), node(2), start);
        }
        copies.failed(VDISK, node(2), start);
        assert!(copies
            .due(VDISK, start + Duration::from_secs(3600), Duration::ZERO)
            .is_empty());
        assert_eq!(copies.since.len(), UNREACHABLE_COPIES_LIMIT);
    }
}

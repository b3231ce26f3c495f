//! Whether a claim may catch the copies up on the chunks failed writes touched instead of
//! comparing the whole vdisk (docs/replication.md, "Catching up"). Pure: the claim gives
//! what it found, the [`Tracks`] remember what this node's earlier claims did.
//!
//! A copy can differ from this node's only where a write failed (a write that succeeded is
//! durable on every copy) or where something other than this node's records changed it.
//! The catch-up is sound when nothing else can have: every claim since the last complete
//! resync was this node's (consecutive epochs), that resync completed, the copy set and
//! the vdisk's size are the same, and every copy answered its fence with the identity it
//! had then (`ashlar_storage::copy_identity`: kept across a restart that lost nothing, new
//! after a trim or any loss). Anything else compares everything.

use super::wire::CopyIdentity;
use ashlar_cluster::{InSyncCopy, InSyncRelease, NodeId};
use ashlar_core::VdiskId;
use std::collections::HashMap;

/// What this node's claims of one vdisk did.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Track {
    /// The epoch of this node's last claim of the vdisk (prepared, whatever came of it).
    last_claim: u64,
    /// The claim whose resync started last, and whether that resync completed.
    resync_epoch: u64,
    resync_complete: bool,
    /// The other copies and their identities when that claim fenced them.
    copies: Vec<(NodeId, Option<CopyIdentity>)>,
    size_bytes: u64,
}

/// What a claim found once it fenced the copies.
#[derive(Clone, Debug)]
pub struct ClaimFound {
    pub epoch: u64,
    /// The other copies, in the set's order, with the identity each fence answered.
    pub copies: Vec<(NodeId, Option<CopyIdentity>)>,
    pub size_bytes: u64,
    /// The set was renewed, is being filled, or this node pulled a copy: compare everything.
    pub set_changed: bool,
}

/// The tracks of every replicated vdisk this node claimed since it started.
#[derive(Default)]
pub struct Tracks {
    tracks: HashMap<VdiskId, Track>,
}

impl Tracks {
    /// Notes a claim at `epoch` (before it fences anything), and says whether the last one
    /// before it was this node's too.
    pub fn claim(&mut self, vdisk: VdiskId, epoch: u64) -> bool {
        let Some(track) = self.tracks.get_mut(&vdisk) else {
            return false;
        };
        let consecutive = track.last_claim.checked_add(1) == Some(epoch);
        track.last_claim = track.last_claim.max(epoch);
        consecutive
    }

    /// Whether the claim may catch up (only the chunks failed writes touched), given that
    /// the last claim before it was this node's (`consecutive`).
    pub fn may_catch_up(&self, vdisk: VdiskId, consecutive: bool, found: &ClaimFound) -> bool {
        let Some(track) = self.tracks.get(&vdisk) else {
            return false;
        };
        consecutive
            && !found.set_changed
            && track.resync_complete
            && track.size_bytes == found.size_bytes
            && track.copies == found.copies
            && found.copies.iter().all(|(_, identity)| identity.is_some())
    }

    /// Notes that the claim at `found.epoch` starts its resync (the chunk sets were taken:
    /// from here on, only this resync's completion makes a later catch-up sound).
    /// `complete`: nothing to resync (a first claim).
    pub fn resync_started(&mut self, vdisk: VdiskId, found: &ClaimFound, complete: bool) {
        self.tracks.insert(
            vdisk,
            Track {
                last_claim: found.epoch,
                resync_epoch: found.epoch,
                resync_complete: complete,
                copies: found.copies.clone(),
                size_bytes: found.size_bytes,
            },
        );
    }

    /// Notes that the resync of the claim at `epoch` completed (ignored if a later claim
    /// started its own since).
    pub fn resync_completed(&mut self, vdisk: VdiskId, epoch: u64) {
        if let Some(track) = self.tracks.get_mut(&vdisk) {
            if track.resync_epoch == epoch && track.last_claim == epoch {
                track.resync_complete = true;
            }
        }
    }

    /// The other copies and the identities they answered, if this node's claim at `epoch`
    /// is its last one and that claim's resync completed: what an in-sync release records.
    pub fn in_sync_at(
        &self,
        vdisk: VdiskId,
        epoch: u64,
    ) -> Option<&[(NodeId, Option<CopyIdentity>)]> {
        let track = self.tracks.get(&vdisk)?;
        let in_sync =
            track.last_claim == epoch && track.resync_epoch == epoch && track.resync_complete;
        in_sync.then_some(track.copies.as_slice())
    }

    /// Forgets the vdisk (it has one copy now).
    pub fn forget(&mut self, vdisk: VdiskId) {
        self.tracks.remove(&vdisk);
    }
}

/// A copy's identity as an [`InSyncRelease`] records it.
pub fn identity_text(identity: CopyIdentity) -> String {
    format!("{:032x}", identity.0)
}

/// `node`'s copy, with `identity`, as an [`InSyncRelease`] records it.
pub fn in_sync_copy(node: NodeId, identity: CopyIdentity) -> InSyncCopy {
    InSyncCopy {
        node,
        identity: identity_text(identity),
    }
}

/// Whether a claim at `epoch` finds every copy as the previous owner left them when it
/// released the vdisk in sync (`release`): the very next claim, the same size, and every copy
/// of the new set (`holders`: this node's own and the others', with the identity each
/// answered) one of the released set with the identity it had then. The copies then hold
/// the same data and nothing needs comparing. A copy not in the released set (a new one)
/// or with a new identity (restarted having lost data, or trimmed) needs the full compare.
pub fn in_sync_since_release(
    release: &InSyncRelease,
    epoch: u64,
    size_bytes: u64,
    holders: &[(NodeId, Option<CopyIdentity>)],
) -> bool {
    release.epoch.checked_add(1) == Some(epoch)
        && release.size_bytes == size_bytes
        && holders.iter().all(|(node, identity)| {
            identity.is_some_and(|identity| release.copies.contains(&in_sync_copy(*node, identity)))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    const VDISK: VdiskId = VdiskId(7);

    fn node(n: u128) -> NodeId {
        NodeId::new(n).unwrap()
    }

    fn found(epoch: u64, run: u128) -> ClaimFound {
        ClaimFound {
            epoch,
            copies: vec![(node(2), Some(CopyIdentity(run)))],
            size_bytes: 1 << 30,
            set_changed: false,
        }
    }

    /// A first claim (nothing to resync), then claims again after a copy failed.
    fn synced_at_epoch_5() -> Tracks {
        let mut tracks = Tracks::default();
        assert!(
            !tracks.claim(VDISK, 5),
            "nothing known before the first claim"
        );
        tracks.resync_started(VDISK, &found(5, 1), true);
        tracks
    }

    #[test]
    fn consecutive_claims_with_the_same_copies_catch_up() {
        let mut tracks = synced_at_epoch_5();
        // Claim 6 could not reach the copy; claim 7 could.
        assert!(tracks.claim(VDISK, 6));
        assert!(tracks.claim(VDISK, 7));
        assert!(tracks.may_catch_up(VDISK, true, &found(7, 1)));
    }

    #[test]
    fn another_claim_in_between_a_changed_copy_or_a_new_set_compare_everything() {
        let mut tracks = synced_at_epoch_5();
        assert!(!tracks.claim(VDISK, 7), "epoch 6 was another node's");
        assert!(!tracks.may_catch_up(VDISK, false, &found(7, 1)));

        let tracks = synced_at_epoch_5();
        assert!(
            !tracks.may_catch_up(VDISK, true, &found(6, 2)),
            "the copy's identity changed (trimmed, or restarted having lost data)"
        );
        let old_version = ClaimFound {
            copies: vec![(node(2), None)],
            ..found(6, 1)
        };
        assert!(!tracks.may_catch_up(VDISK, true, &old_version));
        let other_copy = ClaimFound {
            copies: vec![(node(3), Some(CopyIdentity(1)))],
            ..found(6, 1)
        };
        assert!(!tracks.may_catch_up(VDISK, true, &other_copy));
        let renewed = ClaimFound {
            set_changed: true,
            ..found(6, 1)
        };
        assert!(!tracks.may_catch_up(VDISK, true, &renewed));
        let resized = ClaimFound {
            size_bytes: 2 << 30,
            ..found(6, 1)
        };
        assert!(!tracks.may_catch_up(VDISK, true, &resized));
    }

    #[test]
    fn the_claim_after_an_in_sync_release_compares_nothing_if_every_copy_is_as_released() {
        let id = |n: u128| Some(CopyIdentity(n));
        let release = InSyncRelease {
            epoch: 9,
            size_bytes: 1 << 30,
            copies: vec![
                in_sync_copy(node(1), CopyIdentity(11)),
                in_sync_copy(node(2), CopyIdentity(22)),
                in_sync_copy(node(3), CopyIdentity(33)),
            ],
        };
        let holders = [(node(2), id(22)), (node(3), id(33))];
        assert!(in_sync_since_release(&release, 10, 1 << 30, &holders));
        // The released owner's copy left the set: fewer copies, nothing to compare either.
        assert!(in_sync_since_release(&release, 10, 1 << 30, &holders[..1]));
        // Another claim came in between, or the vdisk was resized.
        assert!(!in_sync_since_release(&release, 11, 1 << 30, &holders));
        assert!(!in_sync_since_release(&release, 10, 2 << 30, &holders));
        // A copy restarted having lost data, answered without an identity, or is new.
        for changed in [
            [(node(2), id(22)), (node(3), id(34))],
            [(node(2), id(22)), (node(3), None)],
            [(node(2), id(22)), (node(4), id(33))],
        ] {
            assert!(!in_sync_since_release(&release, 10, 1 << 30, &changed));
        }
    }

    #[test]
    fn only_a_completed_resync_of_the_latest_claim_allows_a_catch_up() {
        let mut tracks = synced_at_epoch_5();
        assert!(tracks.claim(VDISK, 6));
        tracks.resync_started(VDISK, &found(6, 1), false);
        assert!(tracks.claim(VDISK, 7));
        assert!(
            !tracks.may_catch_up(VDISK, true, &found(7, 1)),
            "the resync of claim 6 did not complete"
        );
        // Claim 6's resync ends after claim 7 started: too late to count.
        tracks.resync_completed(VDISK, 6);
        assert!(!tracks.may_catch_up(VDISK, true, &found(7, 1)));
        tracks.resync_started(VDISK, &found(7, 1), false);
        tracks.resync_completed(VDISK, 7);
        assert!(tracks.claim(VDISK, 8));
        assert!(tracks.may_catch_up(VDISK, true, &found(8, 1)));
    }
}

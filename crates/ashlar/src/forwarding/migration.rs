//! Ownership follows the clients: a vdisk whose client I/O this node has forwarded to its
//! owner without a pause for `--migrate-after-s` is asked over (`docs/forwarding.md`).

use ashlar_core::VdiskId;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A pause in forwarded I/O longer than this ends a run of sustained I/O.
pub const SUSTAINED_GAP: Duration = Duration::from_secs(5);

/// The node's forwarded I/O per vdisk, and when to ask for a vdisk.
pub struct Migrations {
    /// `None`: ownership never moves for forwarded I/O.
    after: Option<Duration>,
    base: Instant,
    vdisks: Mutex<HashMap<VdiskId, Arc<Activity>>>,
}

/// One vdisk's forwarded I/O. Atomics only: every forwarded request notes itself here.
#[derive(Default)]
pub struct Activity {
    /// Start of the current run of sustained I/O, in ms since `Migrations::base`.
    since_ms: AtomicU64,
    /// The last forwarded request, in ms since `Migrations::base` (0: none yet).
    last_ms: AtomicU64,
    /// A move is under way (or was refused for good: a vdisk with one copy).
    moving: AtomicBool,
}

impl Activity {
    /// Notes one forwarded request at `now_ms` (> 0); true when the run of sustained I/O
    /// it belongs to has lasted `after_ms` and no move is under way: the caller starts one.
    pub fn note_at(&self, now_ms: u64, after_ms: u64, gap_ms: u64) -> bool {
        let last = self.last_ms.swap(now_ms, Ordering::Relaxed);
        if last == 0 || now_ms.saturating_sub(last) > gap_ms {
            self.since_ms.store(now_ms, Ordering::Relaxed);
            return false;
        }
        let since = self.since_ms.load(Ordering::Relaxed);
        now_ms.saturating_sub(since) >= after_ms && !self.moving.swap(true, Ordering::Relaxed)
    }

    /// A move ended without the vdisk coming here: a new full run is needed to try again.
    pub fn restart_at(&self, now_ms: u64) {
        self.since_ms.store(now_ms, Ordering::Relaxed);
        self.moving.store(false, Ordering::Relaxed);
    }
}

impl Migrations {
    pub fn new(after: Option<Duration>) -> Migrations {
        Migrations {
            after,
            base: Instant::now(),
            vdisks: Mutex::new(HashMap::new()),
        }
    }

    /// The activity record of `vdisk` (looked up when a connection's route is made).
    pub fn activity(&self, vdisk: VdiskId) -> Arc<Activity> {
        let mut vdisks = self.vdisks.lock().unwrap_or_else(|p| p.into_inner());
        vdisks.entry(vdisk).or_default().clone()
    }

    fn now_ms(&self) -> u64 {
        self.base.elapsed().as_millis() as u64 + 1
    }

    /// Notes one forwarded request of `activity`'s vdisk; true when it should move here now.
    pub fn note(&self, activity: &Activity) -> bool {
        let Some(after) = self.after else {
            return false;
        };
        activity.note_at(
            self.now_ms(),
            after.as_millis() as u64,
            SUSTAINED_GAP.as_millis() as u64,
        )
    }

    /// See [`Activity::restart_at`].
    pub fn restart(&self, activity: &Activity) {
        activity.restart_at(self.now_ms());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_sustained_io_moves_a_vdisk_once() {
        let activity = Activity::default();
        let (after, gap) = (10_000, 5_000);
        assert!(!activity.note_at(1, after, gap));
        // Requests every second for 9 s: not yet.
        for t in 1..10 {
            assert!(!activity.note_at(1 + t * 1000, after, gap));
        }
        // 10 s of I/O without a pause longer than the gap: move, once.
        assert!(activity.note_at(10_001, after, gap));
        assert!(!activity.note_at(10_500, after, gap));
        // The move failed: a whole new run is needed.
        activity.restart_at(10_500);
        assert!(!activity.note_at(15_000, after, gap));
        assert!(!activity.note_at(19_000, after, gap));
        assert!(activity.note_at(20_500, after, gap));
    }

    #[test]
    fn a_pause_longer_than_the_gap_starts_a_new_run() {
        let activity = Activity::default();
        let (after, gap) = (10_000, 5_000);
        assert!(!activity.note_at(1, after, gap));
        assert!(!activity.note_at(4_000, after, gap));
        // 6 s without I/O.
        assert!(!activity.note_at(10_001, after, gap));
        assert!(!activity.note_at(15_000, after, gap));
        assert!(!activity.note_at(19_000, after, gap));
        assert!(activity.note_at(20_001, after, gap));
    }

    #[test]
    fn disabled_migration_never_moves() {
        let migrations = Migrations::new(None);
        let activity = migrations.activity(VdiskId(1));
        for _ in 0..1000 {
            assert!(!migrations.note(&activity));
        }
    }
}

//! When a reactor's poll window is worth spending (see `reactor::poll_while_active`). Pure:
//! the reactor reports what each spin caught, the policy says whether to spin next time.
//!
//! A spin starts at a client request (its data may come back from the disk within the
//! window) or at a reply (the client's next request may follow within the window). Each
//! ends *caught* (more client I/O came while it spun) or *missed* (the window passed).
//! Spins after one kind of event that keep missing cost CPU for nothing: a durable write
//! on a disk slower than the window, say, where the spin after the request never sees the
//! completion, while the spin after the reply catches the next request. So a kind whose
//! last [`COLD_AFTER_MISSES`] spins all missed is *cold*: the reactor sleeps at once after
//! it, except for one probe spin in [`PROBE_EVERY`], which warms it again if it catches.

/// Consecutive missed spins after which a kind of event is cold.
pub const COLD_AFTER_MISSES: u32 = 4;
/// A cold kind still spins once per this many events, to notice when spinning pays again.
pub const PROBE_EVERY: u32 = 32;

/// What started a spin.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpinStart {
    Request,
    Reply,
}

impl SpinStart {
    fn index(self) -> usize {
        match self {
            SpinStart::Request => 0,
            SpinStart::Reply => 1,
        }
    }
}

#[derive(Debug, Default)]
pub struct SpinPolicy {
    misses_in_a_row: [u32; 2],
    skipped: [u32; 2],
}

impl SpinPolicy {
    /// Whether to spin after an event of kind `start`.
    pub fn should_spin(&mut self, start: SpinStart) -> bool {
        let kind = start.index();
        if self.misses_in_a_row[kind] < COLD_AFTER_MISSES {
            return true;
        }
        self.skipped[kind] += 1;
        if self.skipped[kind] >= PROBE_EVERY {
            self.skipped[kind] = 0;
            return true;
        }
        false
    }

    /// The spin after `start` saw more client I/O.
    pub fn caught(&mut self, start: SpinStart) {
        self.misses_in_a_row[start.index()] = 0;
        self.skipped[start.index()] = 0;
    }

    /// The spin after `start` ran its whole window for nothing.
    pub fn missed(&mut self, start: SpinStart) {
        let misses = &mut self.misses_in_a_row[start.index()];
        *misses = misses.saturating_add(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kind_that_keeps_missing_goes_cold_and_is_probed_now_and_then() {
        let mut policy = SpinPolicy::default();
        for _ in 0..COLD_AFTER_MISSES {
            assert!(policy.should_spin(SpinStart::Request));
            policy.missed(SpinStart::Request);
        }
        // Cold: no spin, except one probe in PROBE_EVERY events.
        let spins = (0..PROBE_EVERY * 3)
            .filter(|_| policy.should_spin(SpinStart::Request))
            .count();
        assert_eq!(spins, 3);
        // The other kind is unaffected.
        assert!(policy.should_spin(SpinStart::Reply));
        // A probe that catches warms the kind again.
        policy.caught(SpinStart::Request);
        assert!(policy.should_spin(SpinStart::Request));
        assert!(policy.should_spin(SpinStart::Request));
    }

    #[test]
    fn a_miss_among_catches_keeps_a_kind_warm() {
        let mut policy = SpinPolicy::default();
        for round in 0..100 {
            assert!(policy.should_spin(SpinStart::Reply), "round {round}");
            if round % 3 == 0 {
                policy.missed(SpinStart::Reply);
            } else {
                policy.caught(SpinStart::Reply);
            }
        }
    }
}

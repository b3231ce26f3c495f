//! The serving gate: one per vdisk, checked by every client request before it reaches a
//! shard. On a single node it is open for good. In a cluster the node's ownership layer
//! opens it until the instant the node's lease is surely valid (and moves that instant
//! with each keep-alive); past it, or once closed, requests fail (`IoError::NotServing`)
//! until the vdisk is claimed again. The check is one atomic load and, in a cluster, one clock read: no
//! metadata request is ever made on the data path.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

use ashlar_core::{IoError, IoResult};

/// The gate's value when it is open without a deadline (single node).
const OPEN_FOREVER_NS: u64 = u64::MAX;
/// The gate's value when it is closed. Deadlines are stored as nanoseconds since
/// [`clock_base`] plus one, so no deadline is ever 0.
const CLOSED_NS: u64 = 0;

/// The instant gate deadlines are counted from: the first use of any gate in the process.
fn clock_base() -> Instant {
    static BASE: OnceLock<Instant> = OnceLock::new();
    *BASE.get_or_init(Instant::now)
}

/// Nanoseconds since the base, plus one (so the base itself is not [`CLOSED_NS`]); an
/// instant before the base counts as the base.
fn to_ns(at: Instant) -> u64 {
    let since = at.saturating_duration_since(clock_base()).as_nanos();
    u64::try_from(since)
        .unwrap_or(OPEN_FOREVER_NS - 1)
        .saturating_add(1)
        .min(OPEN_FOREVER_NS - 1)
}

#[derive(Debug)]
pub struct ServeGate {
    open_until_ns: AtomicU64,
    /// Set by the first refused request after the gate shut, so the refusal is logged once
    /// per vdisk and shutting, not once per request.
    refusal_logged: AtomicBool,
}

impl Default for ServeGate {
    fn default() -> Self {
        ServeGate::open_forever()
    }
}

impl ServeGate {
    pub fn open_forever() -> Self {
        ServeGate {
            open_until_ns: AtomicU64::new(OPEN_FOREVER_NS),
            refusal_logged: AtomicBool::new(false),
        }
    }

    pub fn closed() -> Self {
        ServeGate {
            open_until_ns: AtomicU64::new(CLOSED_NS),
            refusal_logged: AtomicBool::new(false),
        }
    }

    /// Requests fail from now on, until the gate is opened again.
    pub fn close(&self) {
        self.open_until_ns.store(CLOSED_NS, Ordering::Release);
    }

    /// Admits requests strictly before `until` (after a new claim).
    pub fn open_until(&self, until: Instant) {
        self.refusal_logged.store(false, Ordering::Relaxed);
        self.open_until_ns.store(to_ns(until), Ordering::Release);
    }

    /// Moves the deadline to `until` only if the gate is still open at `now` and the
    /// deadline does not move back; false when it had already shut (then only a new claim
    /// may open it). One compare-and-swap, so a gate that lapses meanwhile stays shut.
    pub fn extend(&self, until: Instant, now: Instant) -> bool {
        let (until, now) = (to_ns(until), to_ns(now));
        self.open_until_ns
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |current| {
                (current != OPEN_FOREVER_NS && now < current).then_some(current.max(until))
            })
            .is_ok()
    }

    /// Whether a request arriving at `now` is admitted.
    pub fn admits(&self, now: Instant) -> bool {
        match self.open_until_ns.load(Ordering::Acquire) {
            OPEN_FOREVER_NS => true,
            until => to_ns(now) < until,
        }
    }

    /// The deadline, when the gate has one and is open at `now`.
    pub fn open_until_at(&self, now: Instant) -> Option<Instant> {
        match self.open_until_ns.load(Ordering::Acquire) {
            OPEN_FOREVER_NS | CLOSED_NS => None,
            until if to_ns(now) < until => {
                Some(clock_base() + std::time::Duration::from_nanos(until - 1))
            }
            _ => None,
        }
    }

    /// The data-path check: Ok, or [`IoError::NotServing`] (EIO to an NBD client, NOT READY
    /// to an iSCSI initiator) with the refusal logged once per shutting.
    pub fn admit(&self, vdisk: &str) -> IoResult<()> {
        // Single node: no clock read at all.
        if self.open_until_ns.load(Ordering::Acquire) == OPEN_FOREVER_NS
            || self.admits(Instant::now())
        {
            return Ok(());
        }
        if !self.refusal_logged.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                vdisk,
                "refusing I/O: this node does not hold a surely valid ownership claim on the \
                 vdisk (lease lapsed, lost or not claimed); requests fail with EIO until it \
                 claims the vdisk again"
            );
        }
        Err(IoError::NotServing(format!(
            "vdisk {vdisk}: this node's ownership claim is not surely valid; I/O refused"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn open_forever_admits_and_closed_refuses() {
        let now = Instant::now();
        assert!(ServeGate::open_forever().admits(now));
        assert!(ServeGate::open_forever().admit("v").is_ok());
        let closed = ServeGate::closed();
        assert!(!closed.admits(now));
        assert!(matches!(closed.admit("v"), Err(IoError::NotServing(_))));
        // An open-forever gate is never "extended" into a deadline.
        assert!(!ServeGate::open_forever().extend(now + Duration::from_secs(1), now));
    }

    #[test]
    fn a_deadline_admits_strictly_before_it() {
        let now = Instant::now();
        let gate = ServeGate::closed();
        let until = now + Duration::from_millis(500);
        gate.open_until(until);
        assert!(gate.admits(now));
        assert!(!gate.admits(until));
        assert!(!gate.admits(until + Duration::from_millis(1)));
        assert_eq!(gate.open_until_at(now), Some(until));
        assert_eq!(gate.open_until_at(until), None);
        gate.close();
        assert!(!gate.admits(now));
    }

    #[test]
    fn extend_moves_forward_only_while_open() {
        let now = Instant::now();
        let s = Duration::from_secs(1);
        let gate = ServeGate::closed();
        assert!(
            !gate.extend(now + s, now),
            "a closed gate opens only by a claim"
        );
        gate.open_until(now + 2 * s);
        assert!(gate.extend(now + 5 * s, now + s));
        assert!(gate.admits(now + 4 * s));
        assert!(
            gate.extend(now + 3 * s, now + s),
            "still open; deadline kept"
        );
        assert!(gate.admits(now + 4 * s));
        // Lapsed: extending no longer reopens it.
        assert!(!gate.extend(now + 10 * s, now + 5 * s));
        assert!(!gate.admits(now + 6 * s));
    }
}

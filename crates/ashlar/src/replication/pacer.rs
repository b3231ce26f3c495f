//! How fast an online resync goes while clients use the vdisk: paced by its effect on their
//! latency. Pure: the caller gives the client samples and the time.
//!
//! With no client I/O (the vdisk's I/O count did not move within the last window) the
//! resync goes as fast as it can. While clients do I/O, the pacer needs to know what their
//! latency is *without* the resync, and nothing measures that while the resync runs: so it
//! pauses the resync now and then (a **probe**: [`PROBE_WINDOWS`] windows every
//! [`PROBE_EVERY`], the first of which lets the chunks in flight finish) and takes the
//! clients' mean latency over the rest as their **baseline**. Between probes, at the end of
//! each window the clients' mean latency over the last [`SMOOTHING_WINDOWS`] windows (one
//! window's mean is too noisy: a drain step or a sync makes spikes that have nothing to do
//! with the resync) is compared with the baseline: within `latency_limit_percent` of it, the
//! resync's rate rises by [`BUSY_RATE_STEP_BYTES_PER_S`] up to the cap; above, it drops by a
//! quarter, never below [`MIN_BUSY_RATE_BYTES_PER_S`] (the resync always ends). With
//! `latency_limit_percent` 0 there are no probes and the rate is the cap.

use std::time::Duration;
use tokio::time::Instant;

/// How often the pacer looks at the vdisk's client I/O.
pub const CLIENT_ACTIVITY_WINDOW: Duration = Duration::from_millis(100);
/// The slowest an online resync goes while clients use the vdisk.
pub const MIN_BUSY_RATE_BYTES_PER_S: u64 = 1 << 20;
/// How much faster a resync may go after each window in which the clients' latency stayed
/// within its limit; also its first rate.
pub const BUSY_RATE_STEP_BYTES_PER_S: u64 = 2 << 20;
/// Windows whose client latency is averaged before it is compared with the baseline.
pub const SMOOTHING_WINDOWS: usize = 5;
/// How often the resync pauses to measure the clients' latency without it.
pub const PROBE_EVERY: Duration = Duration::from_secs(3);
/// Windows a probe lasts: the first lets the resync's chunks in flight finish, the others
/// measure.
pub const PROBE_WINDOWS: u32 = 3;

/// `--resync-max-mib-s` and `--resync-latency-percent`.
#[derive(Clone, Copy, Debug)]
pub struct Pacing {
    /// Bytes per second (`None`: no cap).
    pub busy_cap: Option<u64>,
    /// 0: no latency control.
    pub latency_limit_percent: u32,
}

/// The vdisk's client I/O so far: operations, and their latencies summed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClientSample {
    pub ops: u64,
    pub latency_nanos: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Running {
        since: Instant,
    },
    /// The resync waits; windows after the first add to the baseline's measurement.
    Probing {
        started: Instant,
        windows: u32,
        ops: u64,
        latency_nanos: u64,
    },
}

pub struct Pacer {
    pacing: Pacing,
    rate: u64,
    /// (ops, summed latency) of the last windows the resync ran in, newest last.
    recent: std::collections::VecDeque<(u64, u64)>,
    baseline_nanos: Option<u64>,
    phase: Phase,
    last: ClientSample,
    last_check: Instant,
    clients_active: bool,
    next_start: Instant,
}

impl Pacer {
    pub fn new(pacing: Pacing, sample: ClientSample, now: Instant) -> Pacer {
        let cap = pacing.busy_cap.unwrap_or(u64::MAX);
        Pacer {
            pacing,
            rate: BUSY_RATE_STEP_BYTES_PER_S
                .min(cap)
                .max(MIN_BUSY_RATE_BYTES_PER_S),
            recent: std::collections::VecDeque::with_capacity(SMOOTHING_WINDOWS),
            baseline_nanos: None,
            phase: Phase::Running { since: now },
            last: sample,
            last_check: now,
            clients_active: false,
            next_start: now,
        }
    }

    /// The rate clients in use allow now (bytes per second; `None`: no limit).
    pub fn busy_rate(&self) -> Option<u64> {
        if self.pacing.latency_limit_percent == 0 {
            return self.pacing.busy_cap;
        }
        Some(self.rate)
    }

    /// The clients' latency without the resync, as last measured (nanoseconds).
    #[cfg(test)]
    pub fn baseline_nanos(&self) -> Option<u64> {
        self.baseline_nanos
    }

    /// Takes the vdisk's client I/O `sample` at `now`; ends a window every
    /// [`CLIENT_ACTIVITY_WINDOW`].
    pub fn observe(&mut self, sample: ClientSample, now: Instant) {
        if now.duration_since(self.last_check) < CLIENT_ACTIVITY_WINDOW {
            return;
        }
        let ops = sample.ops.saturating_sub(self.last.ops);
        let latency_nanos = sample.latency_nanos.saturating_sub(self.last.latency_nanos);
        self.last = sample;
        self.last_check = now;
        self.clients_active = ops > 0;
        if self.pacing.latency_limit_percent == 0 {
            return;
        }
        self.phase = match self.phase {
            Phase::Probing {
                started,
                windows,
                ops: probe_ops,
                latency_nanos: probe_latency,
            } => self.probe_window(
                started,
                windows + 1,
                probe_ops,
                probe_latency,
                (ops, latency_nanos),
                now,
            ),
            Phase::Running { since } => {
                if self.recent.len() == SMOOTHING_WINDOWS {
                    self.recent.pop_front();
                }
                self.recent.push_back((ops, latency_nanos));
                let (ops, latency) = self
                    .recent
                    .iter()
                    .fold((0, 0), |(o, l), (wo, wl)| (o + wo, l + wl));
                if let Some(mean) = latency.checked_div(ops) {
                    self.adjust_rate(mean);
                }
                let due = self.baseline_nanos.is_none() || now.duration_since(since) >= PROBE_EVERY;
                if self.clients_active && due {
                    Phase::Probing {
                        started: now,
                        windows: 0,
                        ops: 0,
                        latency_nanos: 0,
                    }
                } else {
                    Phase::Running { since }
                }
            }
        };
    }

    /// The phase after a probe's window number `windows` (`window`: its ops and latency).
    fn probe_window(
        &mut self,
        started: Instant,
        windows: u32,
        ops: u64,
        latency_nanos: u64,
        window: (u64, u64),
        now: Instant,
    ) -> Phase {
        // The first window still carries the chunks that were in flight.
        let (ops, latency_nanos) = if windows > 1 {
            (ops + window.0, latency_nanos + window.1)
        } else {
            (ops, latency_nanos)
        };
        if windows < PROBE_WINDOWS {
            return Phase::Probing {
                started,
                windows,
                ops,
                latency_nanos,
            };
        }
        if let Some(mean) = latency_nanos.checked_div(ops) {
            self.baseline_nanos = Some(mean);
        }
        // Windows from before the pause say nothing of the rate from now on.
        self.recent.clear();
        Phase::Running { since: now }
    }

    fn adjust_rate(&mut self, mean_nanos: u64) {
        let Some(baseline) = self.baseline_nanos else {
            return;
        };
        let cap = self.pacing.busy_cap.unwrap_or(u64::MAX);
        let limit = u128::from(baseline) * u128::from(self.pacing.latency_limit_percent);
        self.rate = if u128::from(mean_nanos) * 100 <= limit {
            self.rate
                .saturating_add(BUSY_RATE_STEP_BYTES_PER_S)
                .min(cap)
        } else {
            (self.rate - self.rate / 4).max(MIN_BUSY_RATE_BYTES_PER_S)
        };
    }

    /// How long until the next chunk may start (zero: now).
    pub fn wait(&self, now: Instant) -> Duration {
        if !self.clients_active {
            return Duration::ZERO;
        }
        if let Phase::Probing { started, .. } = self.phase {
            let end = started + CLIENT_ACTIVITY_WINDOW * PROBE_WINDOWS;
            // Never zero while probing: the probe ends at a window's end, seen by observe.
            return end
                .saturating_duration_since(now)
                .max(Duration::from_millis(1));
        }
        match self.busy_rate() {
            Some(_) => self.next_start.saturating_duration_since(now),
            None => Duration::ZERO,
        }
    }

    /// A chunk of `length` bytes starts at `now`.
    pub fn started(&mut self, length: u64, now: Instant) {
        let rate = match self.busy_rate() {
            Some(rate) if self.clients_active => rate,
            _ => {
                self.next_start = now;
                return;
            }
        };
        let start = self.next_start.max(now);
        self.next_start = start + Duration::from_secs_f64(length as f64 / rate as f64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// A pacer driven window by window by a client doing 1000 ops per window.
    struct Drive {
        pacer: Pacer,
        now: Instant,
        total: ClientSample,
    }

    impl Drive {
        fn new(cap_mib: Option<u64>, percent: u32) -> Drive {
            let now = Instant::now();
            let pacing = Pacing {
                busy_cap: cap_mib.map(|c| c * MIB),
                latency_limit_percent: percent,
            };
            Drive {
                pacer: Pacer::new(pacing, ClientSample::default(), now),
                now,
                total: ClientSample::default(),
            }
        }

        /// One window of client I/O at `mean_us`; whether the resync waits after it.
        fn window(&mut self, ops: u64, mean_us: u64) -> bool {
            self.now += CLIENT_ACTIVITY_WINDOW;
            self.total.ops += ops;
            self.total.latency_nanos += ops * mean_us * 1000;
            self.pacer.observe(self.total, self.now);
            !self.pacer.wait(self.now).is_zero()
        }

        fn rate_mib(&self) -> u64 {
            self.pacer.busy_rate().unwrap() / MIB
        }
    }

    #[test]
    fn idle_clients_let_the_resync_go_full_speed_and_busy_ones_cap_it() {
        let mut drive = Drive::new(Some(32), 0);
        assert!(!drive.window(0, 0), "no client I/O: no wait");
        drive.pacer.started(MIB, drive.now);
        assert!(drive.pacer.wait(drive.now).is_zero());
        assert!(!drive.window(1000, 100), "busy, but nothing started yet");
        // Busy: 1 MiB per 1/32 s.
        drive.pacer.started(MIB, drive.now);
        assert_eq!(
            drive.pacer.wait(drive.now),
            Duration::from_secs_f64(1.0 / 32.0)
        );
        drive.pacer.started(MIB, drive.now);
        assert_eq!(
            drive.pacer.wait(drive.now),
            Duration::from_secs_f64(2.0 / 32.0)
        );
        assert!(!drive.window(0, 0), "idle again: full speed");
        let mut uncapped = Drive::new(None, 0);
        uncapped.window(1000, 100);
        uncapped.pacer.started(MIB, uncapped.now);
        assert!(
            uncapped.pacer.wait(uncapped.now).is_zero(),
            "no cap, no latency control"
        );
    }

    #[test]
    fn a_probe_measures_the_baseline_with_the_resync_paused() {
        let mut drive = Drive::new(Some(64), 130);
        // Clients start: a probe at once (no baseline yet); the resync waits through it.
        assert!(
            drive.window(1000, 900),
            "the first busy window starts a probe"
        );
        assert!(
            drive.window(1000, 900),
            "its first window lets chunks in flight end"
        );
        assert!(drive.window(1000, 100));
        assert!(!drive.window(1000, 120), "the probe is over");
        assert_eq!(
            drive.pacer.baseline_nanos(),
            Some(110_000),
            "the mean of its last two windows"
        );
    }

    #[test]
    fn the_rate_rises_while_client_latency_holds_and_drops_when_it_grows() {
        let mut drive = Drive::new(Some(64), 130);
        for mean in [500, 500, 100, 100] {
            drive.window(1000, mean);
        }
        assert_eq!(drive.pacer.baseline_nanos(), Some(100_000));
        assert_eq!(drive.rate_mib(), 2);
        assert!(!drive.window(1000, 120));
        assert_eq!(drive.rate_mib(), 4, "within 130 %: a step up");
        for _ in 0..12 {
            drive.window(1000, 125);
        }
        assert_eq!(drive.rate_mib(), 28);
        // One slow window among fast ones is smoothed away: 5-window mean 124 us.
        drive.window(1000, 120);
        drive.window(1000, 120);
        drive.window(1000, 120);
        drive.window(1000, 120);
        drive.window(1000, 140);
        assert_eq!(
            drive.rate_mib(),
            38,
            "a lone slow window does not slow the resync"
        );
        // Sustained slow windows do: a quarter less each, down to the floor.
        drive.window(1000, 200);
        drive.window(1000, 200);
        let once = 38 * MIB - 38 * MIB / 4;
        assert_eq!(drive.pacer.busy_rate(), Some(once - once / 4));
        for _ in 0..8 {
            drive.window(1000, 400);
        }
        assert_eq!(drive.rate_mib(), 2);

        let mut slow = Drive::new(Some(64), 130);
        for mean in [100, 100, 100, 100] {
            slow.window(1000, mean);
        }
        for _ in 0..20 {
            slow.window(1000, 400);
        }
        assert_eq!(slow.rate_mib(), 1, "never below the floor");
    }

    #[test]
    fn probes_come_every_few_seconds_and_leave_the_rate_alone() {
        let mut drive = Drive::new(Some(8), 130);
        for mean in [100, 100, 100, 100] {
            drive.window(1000, mean);
        }
        // On within the limit: up to the cap, until a probe is due (3 s after the last).
        let mut windows = 1;
        while !drive.window(1000, 110) {
            windows += 1;
            assert!(windows < 40, "no probe came");
        }
        assert!(windows >= 29, "a probe came after {windows} windows");
        assert_eq!(drive.rate_mib(), 8, "up to the cap");
        while drive.window(1000, 100) {}
        assert_eq!(drive.rate_mib(), 8, "a probe leaves the rate alone");
    }
}

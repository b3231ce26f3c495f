//! Target-initiated NOP-In pings (RFC 7143 11.19): when an initiator has sent nothing for an
//! interval, the target pings it; if it still sends nothing (the NOP-Out answer or any other
//! PDU) within the timeout, the connection is dead and is dropped, so its commands and
//! memory do not stay held by a host that vanished without closing its socket.
//!
//! [`Keepalive`] is the decision alone, over the count of PDUs received; the session's ping
//! task does the sleeping and sending.

use std::time::{Duration, Instant};

/// When to ping and how long an answer may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NopSettings {
    /// Quiet time before a ping.
    pub interval: Duration,
    /// Time the initiator has to send anything after a ping.
    pub timeout: Duration,
}

/// What the ping task does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Decision {
    /// Sleep until then and decide again.
    Wait(Instant),
    /// Send a NOP-In now, then decide again.
    Ping,
    /// No PDU since the ping's timeout: drop the connection.
    Dead,
}

#[derive(Debug)]
pub(crate) struct Keepalive {
    settings: NopSettings,
    /// PDUs received as of the last decision.
    seen: u64,
    /// When the next quiet check is due.
    check_at: Instant,
    /// The ping awaiting an answer, sent then.
    ping_sent: Option<Instant>,
}

impl Keepalive {
    pub(crate) fn new(settings: NopSettings, now: Instant) -> Self {
        assert!(
            !settings.interval.is_zero() && !settings.timeout.is_zero(),
            "a zero interval means no pings: no Keepalive then"
        );
        Keepalive {
            settings,
            seen: 0,
            check_at: now + settings.interval,
            ping_sent: None,
        }
    }

    /// Decides at `now`, given `received`, the PDUs the connection has read so far.
    pub(crate) fn decide(&mut self, now: Instant, received: u64) -> Decision {
        if received != self.seen {
            // The initiator is alive: start a new quiet interval.
            self.seen = received;
            self.ping_sent = None;
            self.check_at = now + self.settings.interval;
            return Decision::Wait(self.check_at);
        }
        if let Some(sent) = self.ping_sent {
            let deadline = sent + self.settings.timeout;
            return if now >= deadline {
                Decision::Dead
            } else {
                Decision::Wait(deadline)
            };
        }
        if now >= self.check_at {
            self.ping_sent = Some(now);
            return Decision::Ping;
        }
        Decision::Wait(self.check_at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SETTINGS: NopSettings = NopSettings {
        interval: Duration::from_secs(5),
        timeout: Duration::from_secs(10),
    };

    #[test]
    fn a_quiet_initiator_is_pinged_then_dropped() {
        let t0 = Instant::now();
        let mut k = Keepalive::new(SETTINGS, t0);
        assert_eq!(k.decide(t0, 0), Decision::Wait(t0 + SETTINGS.interval));
        let t1 = t0 + SETTINGS.interval;
        assert_eq!(k.decide(t1, 0), Decision::Ping);
        assert_eq!(k.decide(t1, 0), Decision::Wait(t1 + SETTINGS.timeout));
        assert_eq!(
            k.decide(t1 + SETTINGS.timeout - Duration::from_millis(1), 0),
            Decision::Wait(t1 + SETTINGS.timeout)
        );
        assert_eq!(k.decide(t1 + SETTINGS.timeout, 0), Decision::Dead);
    }

    #[test]
    fn any_pdu_answers_and_restarts_the_interval() {
        let t0 = Instant::now();
        let mut k = Keepalive::new(SETTINGS, t0);
        let t1 = t0 + SETTINGS.interval;
        assert_eq!(k.decide(t1, 0), Decision::Ping);
        let t2 = t1 + Duration::from_secs(3);
        assert_eq!(k.decide(t2, 1), Decision::Wait(t2 + SETTINGS.interval));
        // A busy initiator is never pinged.
        let t3 = t2 + SETTINGS.interval;
        assert_eq!(k.decide(t3, 40), Decision::Wait(t3 + SETTINGS.interval));
        assert_eq!(k.decide(t3 + SETTINGS.interval, 40), Decision::Ping);
    }
}

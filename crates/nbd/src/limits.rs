//! Connection limits, the budget shared by connections, and the protocol-valid values derived
//! from them.

use crate::budget::{RequestBudget, DEFAULT_CONNECTION_ALLOWANCE_BYTES};
use std::time::Duration;

/// Limits of NBD connections. Each bounds memory or time a client can make the server spend;
/// see `docs/nbd.md`. Clones share one [`RequestBudget`], so every connection served with a
/// clone of these limits draws on the same budget.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NbdLimits {
    /// Largest READ or WRITE payload accepted, advertised as the maximum block size.
    pub max_request_bytes: u32,
    /// Requests read but not yet answered, per connection; at the limit the server stops
    /// reading (backpressure).
    pub max_in_flight_requests: usize,
    /// Payload bytes (WRITE data being read or waiting to execute, READ data waiting to be
    /// sent) held in memory by all connections together, beyond their allowances. A
    /// connection that cannot reserve its next request's payload stops reading until it can.
    pub request_budget: RequestBudget,
    /// Payload bytes each connection may hold without drawing on `request_budget`, so small
    /// I/O is never starved by clients that hold the budget (say, by stalling in the middle
    /// of a large write). Memory bound: `request_budget` + connections × this.
    pub connection_allowance_bytes: u32,
    /// Time a client has from connecting until it enters transmission.
    pub handshake_timeout: Duration,
    /// Advertised minimum block size; requests not aligned to it fail with EINVAL.
    pub min_block_size: u32,
    /// Advertised preferred block size.
    pub preferred_block_size: u32,
}

impl Default for NbdLimits {
    fn default() -> Self {
        Self {
            max_request_bytes: 32 << 20,
            max_in_flight_requests: 64,
            request_budget: RequestBudget::default(),
            connection_allowance_bytes: DEFAULT_CONNECTION_ALLOWANCE_BYTES,
            handshake_timeout: Duration::from_secs(10),
            min_block_size: 1,
            preferred_block_size: 4096,
        }
    }
}

/// Largest minimum block size the protocol allows.
const MAX_MIN_BLOCK: u32 = 1 << 16;
/// Keeps the semaphore and channel sizes far from their implementation maxima.
const MAX_IN_FLIGHT_CAP: usize = 1 << 16;

/// [`NbdLimits`] coerced into values the protocol permits (powers of two, minimum below
/// preferred below maximum), so a misconfiguration cannot make the server advertise sizes
/// a client would reject.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Effective {
    pub min_block: u32,
    pub preferred_block: u32,
    pub max_request: u32,
    pub max_in_flight: usize,
    pub budget: RequestBudget,
    pub allowance: u32,
    pub handshake_timeout: Duration,
}

impl From<&NbdLimits> for Effective {
    fn from(limits: &NbdLimits) -> Self {
        let min_block = limits
            .min_block_size
            .clamp(1, MAX_MIN_BLOCK)
            .next_power_of_two();
        // min_block is at most 64 KiB, so the clamp bounds are ordered.
        let preferred_block = limits
            .preferred_block_size
            .clamp(min_block.max(512), 1 << 30)
            .next_power_of_two();
        Self {
            min_block,
            preferred_block,
            max_request: limits.max_request_bytes.max(preferred_block),
            max_in_flight: limits.max_in_flight_requests.clamp(1, MAX_IN_FLIGHT_CAP),
            budget: limits.request_budget.clone(),
            allowance: limits.connection_allowance_bytes,
            handshake_timeout: limits.handshake_timeout,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_pass_through() {
        let e = Effective::from(&NbdLimits::default());
        assert_eq!(
            (e.min_block, e.preferred_block, e.max_request),
            (1, 4096, 32 << 20)
        );
        assert_eq!(e.max_in_flight, 64);
        assert_eq!(e.budget.capacity_bytes(), 256 << 20);
        assert_eq!(e.allowance, 128 << 10);
    }

    #[test]
    fn clones_share_one_budget() {
        let limits = NbdLimits::default();
        let clone = limits.clone();
        assert_eq!(limits, clone);
        assert_eq!(Effective::from(&clone).budget, limits.request_budget);
        assert_ne!(
            limits,
            NbdLimits::default(),
            "a fresh default is another budget"
        );
    }

    #[test]
    fn nonsense_is_coerced() {
        let e = Effective::from(&NbdLimits {
            max_request_bytes: 100,
            max_in_flight_requests: 0,
            handshake_timeout: Duration::from_secs(1),
            min_block_size: 1000,
            preferred_block_size: 0,
            ..NbdLimits::default()
        });
        assert_eq!(e.min_block, 1024);
        assert_eq!(e.preferred_block, 1024);
        assert_eq!(e.max_request, 1024);
        assert_eq!(e.max_in_flight, 1);
        let big = Effective::from(&NbdLimits {
            min_block_size: u32::MAX,
            ..NbdLimits::default()
        });
        assert_eq!(big.min_block, 1 << 16);
    }
}

//! Logging of client protocol violations: each kind is logged at `warn` once per
//! connection (with the peer address) so a hostile client cannot flood the log; repeats go
//! to `debug`.

use std::fmt::Display;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Violation {
    ClientFlags,
    HandshakeTimeout,
    OptionMagic,
    OptionTooLarge,
    TooManyOptions,
    MalformedOption,
    Truncated,
    RequestMagic,
    PayloadTooLarge,
    UnknownCommand,
    BadFlags,
    NotNegotiated,
    NonZeroFields,
    Oversized,
    Misaligned,
    OutOfRange,
    ZeroLength,
}

pub(crate) struct ViolationLog {
    peer: String,
    seen: u32,
}

impl ViolationLog {
    pub fn new(peer: String) -> Self {
        Self { peer, seen: 0 }
    }

    pub fn peer(&self) -> &str {
        &self.peer
    }

    pub fn report(&mut self, kind: Violation, detail: &dyn Display) {
        let bit = 1u32 << (kind as u32);
        if self.seen & bit == 0 {
            self.seen |= bit;
            tracing::warn!(peer = %self.peer, ?kind, "NBD protocol violation: {detail}");
        } else {
            tracing::debug!(peer = %self.peer, ?kind, "NBD protocol violation: {detail}");
        }
    }
}

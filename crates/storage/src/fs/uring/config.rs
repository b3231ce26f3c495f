//! The limits of the io_uring backend ([`UringConfig`]).

use crate::fs::DIRECT_IO_ALIGNMENT_BYTES;
use std::io;

/// Limits of the io_uring backend. They apply per thread; a thread's ring is created with the
/// configuration of the first [`super::UringFs`] that does I/O on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UringConfig {
    /// Submission-queue entries of each thread's ring (a power of two, at most 32768); the
    /// completion queue gets twice as many. Default 256.
    pub ring_entries: u32,
    /// Operations admitted at once per thread (at most `ring_entries`); more wait for one to
    /// finish. Default 256.
    pub max_in_flight_ops: usize,
    /// Bytes of bounce buffers per thread (at least `max_op_bytes`); operations that need more
    /// wait. Default 16 MiB.
    pub bounce_pool_bytes: usize,
    /// Most bytes one ring operation moves (a power of two, 4 KiB to 64 MiB); larger calls run
    /// in pieces of this size. Default 1 MiB.
    pub max_op_bytes: usize,
    /// Open files with O_DIRECT where the filesystem allows it. Default true; false keeps
    /// every file in the page cache (tests, tools).
    pub prefer_direct: bool,
}

/// Default [`UringConfig::ring_entries`].
pub const DEFAULT_RING_ENTRIES: u32 = 256;
/// Default [`UringConfig::max_in_flight_ops`].
pub const DEFAULT_MAX_IN_FLIGHT_OPS: usize = 256;
/// Default [`UringConfig::bounce_pool_bytes`].
pub const DEFAULT_BOUNCE_POOL_BYTES: usize = 16 << 20;
/// Default [`UringConfig::max_op_bytes`].
pub const DEFAULT_MAX_OP_BYTES: usize = 1 << 20;

impl Default for UringConfig {
    fn default() -> Self {
        UringConfig {
            ring_entries: DEFAULT_RING_ENTRIES,
            max_in_flight_ops: DEFAULT_MAX_IN_FLIGHT_OPS,
            bounce_pool_bytes: DEFAULT_BOUNCE_POOL_BYTES,
            max_op_bytes: DEFAULT_MAX_OP_BYTES,
            prefer_direct: true,
        }
    }
}

impl UringConfig {
    pub(super) fn validate(&self) -> io::Result<()> {
        let align = DIRECT_IO_ALIGNMENT_BYTES as usize;
        let problem = if !self.ring_entries.is_power_of_two() || self.ring_entries > 32768 {
            "ring_entries must be a power of two, at most 32768"
        } else if self.max_in_flight_ops == 0 || self.max_in_flight_ops > self.ring_entries as usize
        {
            "max_in_flight_ops must be between 1 and ring_entries"
        } else if !self.max_op_bytes.is_power_of_two()
            || self.max_op_bytes < align
            || self.max_op_bytes > 64 << 20
        {
            "max_op_bytes must be a power of two from 4 KiB to 64 MiB"
        } else if self.bounce_pool_bytes < self.max_op_bytes {
            "bounce_pool_bytes must be at least max_op_bytes"
        } else {
            return Ok(());
        };
        Err(io::Error::new(io::ErrorKind::InvalidInput, problem))
    }
}

//! An in-process network for tests (this machine's kernel has no netem): hosts are IP
//! addresses, connections are in-memory pipes, and each directed link between two hosts can
//! be given a delay with jitter, a loss rate, or be cut; connections can be reset. Loss and
//! jitter come from one seeded generator, so a test on a current-thread runtime with paused
//! time replays the same run from the same seed.
//!
//! Faults act on segments (what one write handed over). A cut link or a lost segment drops
//! it silently, as a dead network does: the caller times out, and a connection that hears
//! nothing for its idle timeout closes. The end of a stream (a peer's close) is always
//! delivered, after the data ahead of it.

mod network;
mod pipe;

pub use crate::faults::LinkFaults;
pub use network::{SimListener, SimNetwork, SimTransport};
pub use pipe::{SimReader, SimWriter, PIPE_BUFFER_BYTES};

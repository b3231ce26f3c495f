//! Shared vocabulary of Ashlar: identifiers, units, size parsing and the one vdisk I/O
//! interface that every front-end (NBD today, iSCSI later) speaks.
//!
//! Nothing in this crate does I/O of its own (`buffers::receive` reads from a socket its
//! caller hands it); it is depended on by every other crate.

pub mod buffers;
mod io;
mod size;
mod units;

pub use io::{check_range, BlockDevice, BlockStatusRun, IoError, IoResult};
pub use size::{format_size, parse_size, SizeParseError};
pub use units::{
    ByteCount, ByteOffset, Epoch, ExtentIndex, VdiskId, BLOCK_SIZE_BYTES, EXTENT_SIZE_BYTES,
    MAX_VDISK_SIZE_BYTES,
};

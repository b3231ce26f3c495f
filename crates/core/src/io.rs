//! The one vdisk I/O interface. Front-ends (NBD, later iSCSI) translate their protocol into these
//! calls and know nothing of shards, oplog, replication or metadata.

use bytes::Bytes;
use std::future::Future;
use thiserror::Error;

/// Why an I/O failed. Each variant maps onto one protocol error code in the front-ends.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum IoError {
    /// The data could not be read or written intact (checksum mismatch, disk error).
    #[error("I/O error: {0}")]
    Io(String),
    /// The request reaches past the end of the vdisk.
    #[error("request [{offset}, +{length}) is past the end of the vdisk ({size} bytes)")]
    OutOfRange { offset: u64, length: u64, size: u64 },
    /// The request is malformed in a way other than its range (e.g. too long).
    #[error("invalid request: {0}")]
    Invalid(String),
    /// The node has no space left for new data.
    #[error("no space left on the node's disks")]
    NoSpace,
    /// The vdisk is going away (deleted, or the node is shutting down).
    #[error("vdisk is shutting down")]
    ShuttingDown,
    /// This node may not serve the vdisk now (in a cluster: it holds no surely valid
    /// ownership claim on it). Unlike [`IoError::Io`] nothing is wrong with the data: the
    /// request may succeed later, here once the node claims the vdisk again.
    #[error("not serving: {0}")]
    NotServing(String),
}

pub type IoResult<T> = Result<T, IoError>;

/// One run of [`BlockDevice::block_status`]: `length` bytes that are all holes or all data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockStatusRun {
    pub length: u64,
    /// No storage is allocated for this run.
    pub hole: bool,
    /// The run reads as zeros (always true for holes).
    pub zero: bool,
}

/// A vdisk as a front-end sees it. One handle per client connection; handles of one vdisk may
/// live on different reactor threads, so the futures need not be `Send` but the handle must be
/// cheap to create per connection.
///
/// Every method checks the range against [`BlockDevice::size_bytes`] and fails with
/// [`IoError::OutOfRange`] instead of touching data. A write is durable on stable storage when
/// its future resolves `Ok`, whether or not `fua` was set.
pub trait BlockDevice {
    /// Current size of the vdisk in bytes. May change (resize) while connected.
    fn size_bytes(&self) -> u64;
    fn read(&self, offset: u64, length: u32) -> impl Future<Output = IoResult<Bytes>>;
    fn write(&self, offset: u64, data: Bytes, fua: bool) -> impl Future<Output = IoResult<()>>;
    fn flush(&self) -> impl Future<Output = IoResult<()>>;
    /// Discard: the range may read back as zeros or as the old data; storage may be freed.
    fn trim(&self, offset: u64, length: u32) -> impl Future<Output = IoResult<()>>;
    /// The range reads back as zeros. With `may_punch_hole` storage may be freed (thin).
    fn write_zeroes(
        &self,
        offset: u64,
        length: u32,
        may_punch_hole: bool,
    ) -> impl Future<Output = IoResult<()>>;
    /// A read that can be answered at once, without waiting for anything (typically: the
    /// data is in a cache owned by the calling thread). `None` means "not at once": the caller
    /// then uses [`BlockDevice::read`], which gives the same data. Front-ends call this first
    /// so the common cached read costs no task, no message and no wakeup.
    fn read_now(&self, _offset: u64, _length: u32) -> Option<IoResult<Bytes>> {
        None
    }
    /// Allocation status of `[offset, offset+length)`, as consecutive runs covering at least
    /// the first byte and at most the whole range.
    fn block_status(
        &self,
        offset: u64,
        length: u32,
    ) -> impl Future<Output = IoResult<Vec<BlockStatusRun>>>;
}

/// Checks `[offset, offset+length)` against `size`, without overflow.
pub fn check_range(offset: u64, length: u64, size: u64) -> IoResult<()> {
    match offset.checked_add(length) {
        Some(end) if end <= size => Ok(()),
        _ => Err(IoError::OutOfRange {
            offset,
            length,
            size,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn range_check_rejects_overflow_and_past_end() {
        assert!(check_range(0, 4096, 4096).is_ok());
        assert!(check_range(4096, 0, 4096).is_ok());
        assert!(check_range(1, 4096, 4096).is_err());
        assert!(check_range(u64::MAX, 2, 4096).is_err());
    }
}

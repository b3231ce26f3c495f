//! Errors of the oplog.

use std::io;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OplogError {
    #[error("oplog I/O error on {}: {source}", .path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The filesystem holding the oplog is full (ENOSPC), e.g. when preparing a new segment
    /// file. Distinct from a full log ([`super::Backpressure::Full`]), which is backpressure.
    /// Writes succeed again once space is freed: the next write retries.
    #[error("no space left on the device holding {}", .path.display())]
    NoSpace { path: PathBuf },
    /// The log's structure is broken in a way replay cannot attribute to a range (for example
    /// sequence numbers going backwards in valid headers).
    #[error("corrupt oplog {} at byte {file_offset}: {reason}", .path.display())]
    Corrupt {
        path: PathBuf,
        file_offset: u64,
        reason: String,
    },
    /// A read found a payload chunk that fails its CRC32C: the bytes of `[offset,
    /// offset+length)` in the log are not what was acknowledged. Map to EIO; a drain records
    /// the range as lost in the extent store and completes the item.
    #[error("oplog {} at byte {file_offset} holds rotted data for {length} bytes at vdisk offset {offset}: {reason}", .path.display())]
    ChecksumMismatch {
        offset: u64,
        length: u64,
        path: PathBuf,
        file_offset: u64,
        reason: String,
    },
    /// The range was found lost at replay (see [`super::ReplayReport::lost`]): its acknowledged
    /// contents are gone. Map to EIO; a drain records the range as lost in the extent store.
    #[error("{length} bytes at vdisk offset {offset} were lost to corruption in oplog {} at byte {file_offset}: {reason}", .path.display())]
    Lost {
        offset: u64,
        length: u64,
        path: PathBuf,
        file_offset: u64,
        reason: String,
    },
    /// Replay found acknowledged records it could not locate at all (their record headers and
    /// their batch's table are both unreadable), or could not tell whether damaged data is
    /// live: which vdisk ranges were lost is unknown. Only this log (one vdisk) is affected:
    /// take that vdisk offline and restore it from a replica or backup.
    #[error("oplog {} lost records whose ranges are unknown (at byte {file_offset}): {reason}; the vdisk's contents cannot be trusted: take it offline and restore it", .path.display())]
    LostUnknownRanges {
        path: PathBuf,
        file_offset: u64,
        reason: String,
    },
    /// A segment file of another log (another `log_id`) sits in this log's directory.
    #[error("{} belongs to oplog {found:#x}, not to this oplog ({expected:#x}): move it away", .path.display())]
    ForeignFile {
        path: PathBuf,
        found: u64,
        expected: u64,
    },
    /// One record larger than the log can take in one batch: split it (see
    /// `Oplog::max_write_bytes`).
    #[error("a record of {length} bytes is larger than the {max} bytes one batch can hold")]
    TooLarge { length: u64, max: u64 },
    /// The range does not fit in the 64-bit address space, is empty, or a piece / buffer pair
    /// disagree.
    #[error("invalid range: {length} bytes at offset {offset}")]
    InvalidRange { offset: u64, length: u64 },
    /// `OplogConfig` values that cannot work together.
    #[error("invalid oplog configuration: {reason}")]
    InvalidConfig { reason: String },
    /// The record behind a piece was superseded and its segment freed since the lookup: the
    /// data now lives elsewhere, so look the range up again.
    #[error("oplog record for {length} bytes at offset {offset} was freed since the lookup")]
    Stale { offset: u64, length: u64 },
    /// `destroy` on a log that still holds live entries or unfinished writes.
    #[error("oplog {} still holds {live_bytes} live bytes or unfinished writes", .path.display())]
    NotEmpty { path: PathBuf, live_bytes: u64 },
    /// A write failed and the log could not yet make the failed region dead on disk (the disk
    /// still fails). Writes fail until that succeeds; every new write retries it.
    #[error("oplog {} cannot take writes: {reason}", .path.display())]
    Failed { path: PathBuf, reason: String },
    /// The directory holds a log of an older format (version 1 or 2), opened read-only for an
    /// upgrade by replay: read and drain it, then `destroy` it and write to a new log.
    #[error("oplog {} is in format version {version}: it was opened read-only to be drained (upgrade by replay); write to a new oplog directory", .path.display())]
    ReadOnly { path: PathBuf, version: u8 },
}

impl OplogError {
    /// The vdisk range whose log contents a read or drain found lost or rotted, if the error
    /// is about one range: a drain records it with `ExtentStore::mark_lost` and then completes
    /// the item.
    pub fn lost_range(&self) -> Option<(u64, u64)> {
        match self {
            OplogError::Lost { offset, length, .. }
            | OplogError::ChecksumMismatch { offset, length, .. } => Some((*offset, *length)),
            _ => None,
        }
    }
}

/// Wraps an I/O error, keeping ENOSPC recognisable so the front-end can report it as such.
pub fn io_error(path: &Path, source: io::Error) -> OplogError {
    if crate::fs::is_no_space(&source) {
        OplogError::NoSpace {
            path: path.to_path_buf(),
        }
    } else {
        OplogError::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}

/// Why an operation failed, kept so every writer it affects gets its own `OplogError`.
#[derive(Clone, Debug)]
pub(super) struct Failure {
    pub path: PathBuf,
    pub kind: FailureKind,
    pub message: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum FailureKind {
    NoSpace,
    Io(io::ErrorKind),
    /// The log cannot take writes until a recovery succeeds.
    Failed,
}

impl Failure {
    pub fn from_io(path: &Path, error: &io::Error) -> Self {
        let kind = if crate::fs::is_no_space(error) {
            FailureKind::NoSpace
        } else {
            FailureKind::Io(error.kind())
        };
        Failure {
            path: path.to_path_buf(),
            kind,
            message: error.to_string(),
        }
    }

    pub fn failed(path: &Path, message: String) -> Self {
        Failure {
            path: path.to_path_buf(),
            kind: FailureKind::Failed,
            message,
        }
    }

    pub fn to_error(&self) -> OplogError {
        match self.kind {
            FailureKind::NoSpace => OplogError::NoSpace {
                path: self.path.clone(),
            },
            FailureKind::Io(kind) => OplogError::Io {
                path: self.path.clone(),
                source: io::Error::new(kind, self.message.clone()),
            },
            FailureKind::Failed => OplogError::Failed {
                path: self.path.clone(),
                reason: self.message.clone(),
            },
        }
    }
}

//! Errors of the oplog.

use std::io;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum OplogError {
    #[error("oplog I/O error on {}: {source}", .path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The filesystem holding the oplog is full (ENOSPC). Distinct from waiting for oplog
    /// capacity, which is backpressure and never an error.
    #[error("no space left on the device holding {}", .path.display())]
    NoSpace { path: PathBuf },
    /// A record or chunk failed its checksum, or the log's structure is broken.
    #[error("corrupt oplog {} at byte {file_offset}: {reason}", .path.display())]
    Corrupt {
        path: PathBuf,
        file_offset: u64,
        reason: String,
    },
    /// One record would not fit in the whole log.
    #[error("a record of {length} bytes cannot fit in an oplog of {capacity} bytes")]
    TooLarge { length: u64, capacity: u64 },
    /// The range does not fit in the 64-bit address space, or a piece / buffer pair disagree.
    #[error("invalid range: {length} bytes at offset {offset}")]
    InvalidRange { offset: u64, length: u64 },
    /// The record behind a piece was superseded and its segment freed since the lookup: the
    /// data now lives elsewhere, so look the range up again.
    #[error("oplog record for {length} bytes at offset {offset} was freed since the lookup")]
    Stale { offset: u64, length: u64 },
    /// `destroy` on a log that still holds live entries or unfinished writes.
    #[error("oplog {} still holds {live_bytes} live bytes or unfinished writes", .path.display())]
    NotEmpty { path: PathBuf, live_bytes: u64 },
    /// An earlier commit or segment deletion failed: the on-disk tail is unknown, so the log
    /// takes no more records. Reads and drains still work; reopening recovers.
    #[error("oplog {} failed earlier and takes no more writes until reopened: {reason}", .path.display())]
    Failed { path: PathBuf, reason: String },
}

/// Wraps an I/O error, keeping ENOSPC recognisable so the front-end can report it as such.
pub fn io_error(path: &Path, source: io::Error) -> OplogError {
    if source.raw_os_error() == Some(libc::ENOSPC) || source.kind() == io::ErrorKind::StorageFull {
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

//! The extent store: a vdisk's data in extent groups (egroups), one sparse file per egroup on
//! one of the node's disks, every 4 KiB block checked against a CRC32C on every read, and
//! every write batch crash-safe under power loss. Format and protocol:
//! docs/extent-store-format.md (format version 3).
//!
//! - `format`: the on-disk layout, paths and the header block;
//! - `table`: the checksum block of an extent (block states, CRC slots), in memory and on disk;
//! - `batch`: [`WriteBatch`] and its per-egroup, per-block plan;
//! - `egroup`: one open egroup: opening, creating, validating, reading verified blocks;
//! - `disk_state`: write primitives, syncs, normalization and recovery of an open egroup;
//! - `apply`: the two-phase write protocol for one egroup;
//! - `store`: [`ExtentStore`]: the location set, the open set and its eviction;
//! - `requests`: reads, write batches and allocation maps, split per extent or egroup and run
//!   concurrently;
//! - `block_log`, `journal`, `overlay`, `log_reads`, `replay`, `cleaning`: format 3's block
//!   log, where drain batches put whole blocks (docs/extent-store-log-proposal.md).
//!
//! All file and directory operations go through [`crate::fs::Filesystem`]; every write is
//! 4 KiB-aligned in offset and length, so the data path may use O_DIRECT.

mod apply;
mod batch;
mod block_log;
mod cleaning;
mod disk_state;
mod egroup;
mod extent_lock;
mod format;
mod journal;
mod log_reads;
mod overlay;
mod replay;
mod requests;
mod store;
mod table;

pub use batch::WriteBatch;
pub use block_log::{LogId, SegmentCounter, SegmentSeq, SEGMENT_BYTES};
pub use cleaning::CleanReport;
pub use format::{EGROUP_SPAN_BYTES, EXTENTS_PER_EGROUP};
pub use journal::{
    segment_counters, JournalConfig, DEFAULT_CHECKPOINT_BLOCKS, DEFAULT_MAX_SEGMENTS,
    DEFAULT_SEGMENT_CHUNKS,
};
pub use replay::{replay_block_logs, ReplayReport};
pub use requests::READ_NEW_MIN_BYTES;
pub use store::ExtentStore;

use crate::disk::Disk;
use crate::fs::{self, DiskFile, Filesystem};
use ashlar_core::VdiskId;
use format::{egroup_dir, parse_egroup_file_name, table_offset, Decoded};
use std::io;
use std::path::{Path, PathBuf};
use table::{decode_table, BlockState};

#[derive(Clone, Debug)]
pub struct ExtentStoreConfig {
    pub vdisk: VdiskId,
    pub disks: Vec<Disk>,
    /// Egroups kept open when idle: bounds file handles and checksum tables (about 20.3 KiB
    /// each; see [`ExtentStore`]).
    pub max_open_egroups: usize,
    /// Egroups one write batch (a drain step, a bypass write) writes at a time (at most
    /// `max_open_egroups`): enough to keep the disk busy, few enough that the oplog's commits
    /// are not queued behind a whole batch's writes and syncs.
    pub max_writing_egroups: usize,
    /// Disk writes one egroup's write phase keeps in flight (at least 1). A large drain step
    /// brings tens of blocks to each egroup: issued all at once, they queue the oplog's
    /// commits (a QD1 client's every write) behind them.
    pub writes_in_flight_per_egroup: usize,
    /// Where `apply_journaled` puts whole blocks: the store's block log (format 3). `None`:
    /// every block is written home, as in format 2.
    pub journal: Option<JournalConfig>,
}

/// Default of [`ExtentStoreConfig::max_writing_egroups`].
pub const DEFAULT_MAX_WRITING_EGROUPS: usize = 16;

/// Default of [`ExtentStoreConfig::writes_in_flight_per_egroup`].
pub const DEFAULT_WRITES_IN_FLIGHT_PER_EGROUP: usize = 8;

/// What went wrong. Every variant names the file; those about data name the vdisk offset and
/// the file offset. `Corrupt`, `Poisoned`, `Lost`, `BadHeader` and `BadChecksumBlock` persist
/// until the blocks are rewritten ([`ExtentError::is_corruption`]); the client gets EIO.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ExtentError {
    #[error("I/O error on {path}{}: {source}", at_offset(*.file_offset))]
    Io {
        path: PathBuf,
        /// `None` for whole-file and directory operations.
        file_offset: Option<u64>,
        source: io::Error,
    },
    /// ENOSPC: nothing of the failed operation was acknowledged; it may be retried later.
    #[error("no space left on the disk holding {path}")]
    NoSpace { path: PathBuf },
    #[error("checksum mismatch in vdisk {vdisk} at offset {offset}: {path} at file offset {file_offset}: data crc {actual:08x}, stored {expected:08x?}")]
    Corrupt {
        vdisk: VdiskId,
        offset: u64,
        path: PathBuf,
        file_offset: u64,
        expected: [u32; 2],
        actual: u32,
    },
    #[error("vdisk {vdisk} offset {offset} is unreadable: a partial write was merged into a corrupt block ({path} at file offset {file_offset})")]
    Poisoned {
        vdisk: VdiskId,
        offset: u64,
        path: PathBuf,
        file_offset: u64,
    },
    #[error("vdisk {vdisk} offset {offset} was lost (marked lost, {path} at file offset {file_offset}); it reads as an error until rewritten")]
    Lost {
        vdisk: VdiskId,
        offset: u64,
        path: PathBuf,
        file_offset: u64,
    },
    #[error("bad extent group header in {path} (file offset 0; vdisk {vdisk} offset {offset}): {reason}")]
    BadHeader {
        vdisk: VdiskId,
        offset: u64,
        path: PathBuf,
        reason: String,
    },
    #[error("bad checksum block in {path} at file offset {file_offset} (vdisk {vdisk} offset {offset}): {reason}")]
    BadChecksumBlock {
        vdisk: VdiskId,
        offset: u64,
        path: PathBuf,
        file_offset: u64,
        reason: String,
    },
    /// A block log chunk whose two summary copies are both unreadable (or that names an
    /// egroup of another disk): which blocks it holds is unknown, so replay cannot finish.
    #[error("bad block log chunk in {path} at file offset {file_offset}: {reason}")]
    BadLogChunk {
        path: PathBuf,
        file_offset: u64,
        reason: String,
    },
    #[error("range at {offset} of {length} bytes ends beyond the largest vdisk (1 PiB)")]
    OutOfRange { offset: u64, length: u64 },
}

fn at_offset(offset: Option<u64>) -> String {
    offset.map_or(String::new(), |at| format!(" at file offset {at}"))
}

impl ExtentError {
    /// Damage on disk that stays until the blocks are rewritten (as opposed to a failed I/O,
    /// which a retry may get through).
    pub fn is_corruption(&self) -> bool {
        matches!(
            self,
            ExtentError::Corrupt { .. }
                | ExtentError::Poisoned { .. }
                | ExtentError::Lost { .. }
                | ExtentError::BadHeader { .. }
                | ExtentError::BadChecksumBlock { .. }
                | ExtentError::BadLogChunk { .. }
        )
    }

    /// The file the error is about, if any.
    pub fn path(&self) -> Option<&Path> {
        match self {
            ExtentError::Io { path, .. }
            | ExtentError::NoSpace { path }
            | ExtentError::Corrupt { path, .. }
            | ExtentError::Poisoned { path, .. }
            | ExtentError::Lost { path, .. }
            | ExtentError::BadHeader { path, .. }
            | ExtentError::BadChecksumBlock { path, .. }
            | ExtentError::BadLogChunk { path, .. } => Some(path),
            ExtentError::OutOfRange { .. } => None,
        }
    }
}

pub(crate) fn io_error(path: &Path, file_offset: Option<u64>, source: io::Error) -> ExtentError {
    if fs::is_no_space(&source) {
        ExtentError::NoSpace {
            path: path.to_path_buf(),
        }
    } else {
        ExtentError::Io {
            path: path.to_path_buf(),
            file_offset,
            source,
        }
    }
}

/// The vdisk's extent directory on each disk (whether or not it exists yet).
pub fn vdisk_extent_dirs(disks: &[Disk], vdisk: VdiskId) -> Vec<std::path::PathBuf> {
    disks.iter().map(|d| egroup_dir(&d.path, vdisk)).collect()
}

/// Deletes every egroup of the vdisk on every disk, durably. No `ExtentStore` of the vdisk may
/// be in use.
pub async fn remove_vdisk_data<F: Filesystem>(
    fs: &F,
    disks: &[Disk],
    vdisk: VdiskId,
) -> io::Result<()> {
    for disk in disks {
        fs::remove_tree(fs, &egroup_dir(&disk.path, vdisk)).await?;
    }
    Ok(())
}

/// Bytes the vdisk's egroups hold, from their checksum blocks: 4 KiB per block that is not a
/// hole (an extent whose checksum block is damaged counts in full) plus 20 KiB of metadata
/// per egroup. For stats and tests; reads every egroup's metadata.
pub async fn vdisk_bytes_used<F: Filesystem>(
    fs: &F,
    disks: &[Disk],
    vdisk: VdiskId,
) -> Result<u64, ExtentError> {
    let mut total = 0;
    for disk in disks {
        let dir = egroup_dir(&disk.path, vdisk);
        let entries = match fs.list_dir(&dir).await {
            Ok(entries) => entries,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(io_error(&dir, None, e)),
        };
        for (egroup, name) in entries
            .iter()
            .filter_map(|e| parse_egroup_file_name(&e.name).map(|g| (g, &e.name)))
        {
            let path = dir.join(name);
            let file = fs
                .open(&path, false)
                .await
                .map_err(|e| io_error(&path, None, e))?;
            let mut meta = vec![0u8; format::META_BYTES as usize];
            file.read_at(&mut meta, 0)
                .await
                .map_err(|e| io_error(&path, Some(0), e))?;
            total += format::META_BYTES;
            for extent in 0..format::EXTENTS {
                let at = table_offset(extent) as usize;
                let blocks =
                    match decode_table(&meta[at..at + format::BLOCK_LEN], vdisk, egroup, extent) {
                        Decoded::Valid(table) => table
                            .entries
                            .iter()
                            .filter(|e| e.state != BlockState::Hole)
                            .count(),
                        Decoded::Zero => 0,
                        Decoded::Bad(_) => format::BLOCKS_PER_EXTENT,
                    };
                total += (blocks * format::BLOCK_LEN) as u64;
            }
        }
    }
    Ok(total)
}

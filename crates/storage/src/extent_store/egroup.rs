//! One open extent group: its file, its checksum tables in memory, what this process learned
//! about the data on disk (normalization), and the bookkeeping that makes a failed write or
//! sync safe to retry (recovery). A write batch mutates the extents it holds the lock of
//! (`extent_lock`), recovery holds every extent; reads take no lock and see a state that is
//! valid at every await.

use super::block_log::Position;
use super::format::{
    data_offset, decode_header, encode_header, table_offset, Decoded, BLOCKS_PER_EXTENT, BLOCK_LEN,
    EGROUP_SPAN_BYTES, EXTENTS, META_BYTES,
};
use super::table::{decode_table, encode_table, BlockState, DecodedTable, Entry, Table};
use super::{io_error, ExtentError};
use crate::fs::{DiskBuf, DiskFile, Filesystem};
use ashlar_core::VdiskId;
use smallvec::SmallVec;
use std::cell::{Cell, RefCell};
use std::path::{Path, PathBuf};

/// The entries of the blocks one read covers: a small read's in place, no allocation.
pub(crate) type Entries = SmallVec<[Entry; 8]>;

/// Bit of `unsynced`/`needs_recovery` standing for the header (bits 0..4 are the extents).
pub(crate) const HEADER_BIT: u8 = 1 << EXTENTS;
pub(crate) const ALL_BITS: u8 = HEADER_BIT | ((1 << EXTENTS) - 1);
/// Bit of `needs_recovery`: the file's directory entry may not be durable yet.
pub(crate) const DIR_BIT: u8 = HEADER_BIT << 1;

pub(crate) struct ExtentState {
    /// The checksum entries, or why the checksum block is unusable.
    pub table: Result<Box<Table>, String>,
    /// `current` and `zero_known` of every entry reflect the data on disk.
    pub normalized: bool,
    /// The newest block log position whose entries the table holds: the stamp its next
    /// write carries (replay applies only newer entries).
    pub position: Position,
}

/// An open egroup. Memory: 4 × 256 entries of 20 bytes (20 KiB) plus the file handle, path and
/// a few words (see `ExtentStore`'s memory note).
pub(crate) struct Egroup<D> {
    pub vdisk: VdiskId,
    pub index: u64,
    pub path: PathBuf,
    pub file: D,
    /// Why the header is unusable: every block of the egroup then reads as EIO.
    pub bad_header: RefCell<Option<String>>,
    pub extents: RefCell<[ExtentState; EXTENTS]>,
    /// A `sync_data` of the file succeeded since it was opened: what reads return is durable.
    pub synced_since_open: Cell<bool>,
    /// What was written (extent bits, `HEADER_BIT`) since the last successful sync.
    pub unsynced: Cell<u8>,
    /// What must be rewritten and re-synced before the next write (after a failed write or
    /// sync, a creation cut short, or a reset of damaged metadata). Never evicted while set.
    pub needs_recovery: Cell<u8>,
    /// Failed writes and syncs of the file so far. Batches on other extents run at the same
    /// time, and a failed `fsync` reports its error once: a batch whose sync succeeds after
    /// another batch's failed cannot trust it (the failure may have dropped its writes), so it
    /// fails too (`sync_checked`).
    pub failures: Cell<u64>,
}

pub(crate) fn is_zero(block: &[u8]) -> bool {
    block.chunks_exact(8).all(|word| {
        u64::from_ne_bytes([
            word[0], word[1], word[2], word[3], word[4], word[5], word[6], word[7],
        ]) == 0
    })
}

impl<D: DiskFile> Egroup<D> {
    /// Creates the egroup file and makes it durable (header and empty checksum blocks synced,
    /// directory entry synced) before anything is written into it. If that fails once the
    /// file exists, the egroup is returned needing recovery, which redoes all of it before the
    /// first write (a failed sync may have left a page cache that shows metadata the disk does
    /// not hold, so a later open could not tell).
    pub(crate) async fn create<F: Filesystem<File = D>>(
        fs: &F,
        path: &Path,
        vdisk: VdiskId,
        index: u64,
    ) -> Result<Self, ExtentError> {
        let file = fs
            .open(path, true)
            .await
            .map_err(|e| io_error(path, None, e))?;
        let mut table = Box::new([Entry::HOLE; BLOCKS_PER_EXTENT]);
        table.iter_mut().for_each(|e| e.zero_known = true);
        let extents = std::array::from_fn(|_| ExtentState {
            table: Ok(table.clone()),
            normalized: true,
            position: Position(0),
        });
        let created = Self::assemble(vdisk, index, path, file, None, extents, true, 0);
        if let Err(error) = created.initialize(fs).await {
            tracing::warn!(path = %path.display(), %error,
                "creating an extent group failed: it is rewritten before its first write");
            created.needs_recovery.set(ALL_BITS | DIR_BIT);
        }
        Ok(created)
    }

    async fn initialize<F: Filesystem<File = D>>(&self, fs: &F) -> Result<(), ExtentError> {
        self.unsynced.set(ALL_BITS);
        let mut meta = encode_header(self.vdisk, self.index);
        for (extent, state) in self.extents.borrow().iter().enumerate() {
            if let Ok(table) = &state.table {
                meta.extend_from_slice(&encode_table(
                    table,
                    self.vdisk,
                    self.index,
                    extent,
                    state.position,
                ));
            }
        }
        self.file
            .write_at(&meta, 0)
            .await
            .map_err(|e| io_error(&self.path, Some(0), e))?;
        self.sync(ALL_BITS).await?;
        self.sync_dir(fs).await
    }

    pub(super) async fn sync_dir<F: Filesystem<File = D>>(
        &self,
        fs: &F,
    ) -> Result<(), ExtentError> {
        let dir = self.path.parent().unwrap_or(Path::new("/"));
        fs.sync_dir(dir).await.map_err(|e| io_error(dir, None, e))
    }

    #[allow(clippy::too_many_arguments)]
    fn assemble(
        vdisk: VdiskId,
        index: u64,
        path: &Path,
        file: D,
        bad_header: Option<String>,
        extents: [ExtentState; EXTENTS],
        synced: bool,
        needs_recovery: u8,
    ) -> Self {
        Egroup {
            vdisk,
            index,
            path: path.to_path_buf(),
            file,
            bad_header: RefCell::new(bad_header),
            extents: RefCell::new(extents),
            synced_since_open: Cell::new(synced),
            unsynced: Cell::new(0),
            needs_recovery: Cell::new(needs_recovery),
            failures: Cell::new(0),
        }
    }

    /// Opens an existing egroup and validates its header and checksum blocks. A file that holds
    /// no written block but has a zero or torn header or checksum block (a creation cut short)
    /// is re-initialized before its first write; damage anywhere else is kept as the error its
    /// blocks will read as.
    pub(crate) async fn open<F: Filesystem<File = D>>(
        fs: &F,
        path: &Path,
        vdisk: VdiskId,
        index: u64,
    ) -> Result<Self, ExtentError> {
        let file = fs
            .open(path, false)
            .await
            .map_err(|e| io_error(path, None, e))?;
        let mut meta = vec![0u8; META_BYTES as usize];
        file.read_at(&mut meta, 0)
            .await
            .map_err(|e| io_error(path, Some(0), e))?;
        let len = file.len().await.map_err(|e| io_error(path, None, e))?;
        let header = decode_header(&meta[..BLOCK_LEN], vdisk, index);
        let tables: Vec<Decoded<DecodedTable>> = (0..EXTENTS)
            .map(|e| {
                let at = table_offset(e) as usize;
                decode_table(&meta[at..at + BLOCK_LEN], vdisk, index, e)
            })
            .collect();
        let all_valid = matches!(header, Decoded::Valid(()))
            && tables.iter().all(|t| matches!(t, Decoded::Valid(_)));
        let holds_entries = tables.iter().any(|t| match t {
            Decoded::Valid(table) => table.entries.iter().any(|e| e.state != BlockState::Hole),
            _ => false,
        });
        let no_data = !holds_entries
            && (len <= META_BYTES || tables.iter().all(|t| matches!(t, Decoded::Valid(_))));
        if !all_valid && no_data {
            tracing::warn!(path = %path.display(),
                "extent group holds no data but its header or checksum blocks are torn (a creation cut short): re-initializing it");
            let extents = std::array::from_fn(|_| ExtentState {
                table: Ok(Box::new([Entry::HOLE; BLOCKS_PER_EXTENT])),
                normalized: true,
                position: Position(0),
            });
            return Ok(Self::assemble(
                vdisk,
                index,
                path,
                file,
                None,
                extents,
                false,
                ALL_BITS | DIR_BIT,
            ));
        }
        let bad_header = match header {
            Decoded::Valid(()) => None,
            Decoded::Zero => Some("header is all zeros".to_string()),
            Decoded::Bad(reason) => Some(reason),
        };
        if let Some(reason) = &bad_header {
            tracing::error!(path = %path.display(), %reason,
                "bad extent group header: its blocks read as EIO until rewritten");
        }
        let mut tables = tables.into_iter();
        let extents = std::array::from_fn(|extent| {
            let (table, position) = match tables.next() {
                Some(Decoded::Valid(table)) => (Ok(table.entries), table.position),
                Some(Decoded::Zero) => {
                    (Err("checksum block is all zeros".to_string()), Position(0))
                }
                Some(Decoded::Bad(reason)) => (Err(reason), Position(0)),
                None => (Err("missing".to_string()), Position(0)),
            };
            if let Err(reason) = &table {
                tracing::error!(path = %path.display(), file_offset = table_offset(extent), %reason,
                    "bad checksum block: the extent's blocks read as EIO until rewritten");
            }
            ExtentState {
                table,
                normalized: false,
                position,
            }
        });
        Ok(Self::assemble(
            vdisk, index, path, file, bad_header, extents, false, 0,
        ))
    }

    pub(crate) fn vdisk_offset(&self, block: usize) -> u64 {
        self.index * EGROUP_SPAN_BYTES + (block * BLOCK_LEN) as u64
    }

    /// Reads and verifies blocks `[first, first + out.len() / 4096)` of the egroup: blocks at
    /// home with one read of the range, blocks in the block log from there.
    pub(crate) async fn read_blocks<F: Filesystem<File = D>>(
        &self,
        fs: &F,
        first: usize,
        out: &mut [u8],
    ) -> Result<(), ExtentError> {
        let count = out.len() / BLOCK_LEN;
        let entries = self.entries(first, count)?;
        if entries.iter().any(|e| e.state == BlockState::Written) {
            let at = data_offset(first);
            self.file
                .read_at(out, at)
                .await
                .map_err(|e| io_error(&self.path, Some(at), e))?;
        }
        self.fill_from_log(fs, &entries, out).await?;
        self.check_blocks(first, &entries, out)
    }

    /// Blocks `[first, first + count)` as `read_blocks` reads them, in a buffer of their own
    /// that the disk read fills directly (see `DiskFile::read_new`).
    pub(crate) async fn read_blocks_new<F: Filesystem<File = D>>(
        &self,
        fs: &F,
        first: usize,
        count: usize,
    ) -> Result<DiskBuf, ExtentError> {
        let entries = self.entries(first, count)?;
        let mut buf = if entries.iter().any(|e| e.state == BlockState::Written) {
            let at = data_offset(first);
            self.file
                .read_new(at, count * BLOCK_LEN)
                .await
                .map_err(|e| io_error(&self.path, Some(at), e))?
        } else {
            DiskBuf::zeroed(count * BLOCK_LEN)
        };
        self.fill_from_log(fs, &entries, buf.as_mut_slice()).await?;
        self.check_blocks(first, &entries, buf.as_mut_slice())?;
        Ok(buf)
    }

    /// Checks blocks read from `first` on against their entries: a written block's CRC must
    /// match one of its slots, a block in the log its one CRC; holes become zeros; poisoned
    /// and lost blocks are errors.
    fn check_blocks(
        &self,
        first: usize,
        entries: &[Entry],
        out: &mut [u8],
    ) -> Result<(), ExtentError> {
        for (i, (entry, block)) in entries.iter().zip(out.chunks_mut(BLOCK_LEN)).enumerate() {
            let index = first + i;
            // Built only on failure: the success path of a read allocates nothing per block.
            let (vdisk, path) = (self.vdisk, || self.path.clone());
            let (offset, file_offset) = (self.vdisk_offset(index), data_offset(index));
            match entry.state {
                BlockState::Hole => block.fill(0),
                BlockState::Written => {
                    let actual = crc32c::crc32c(block);
                    if entry.slot_of(actual).is_none() {
                        return Err(ExtentError::Corrupt {
                            vdisk,
                            offset,
                            path: path(),
                            file_offset,
                            expected: entry.crc,
                            actual,
                        });
                    }
                }
                BlockState::InLog => self.check_log_block(index, entry, block)?,
                BlockState::Poisoned => {
                    return Err(ExtentError::Poisoned {
                        vdisk,
                        offset,
                        path: path(),
                        file_offset,
                    })
                }
                BlockState::Lost => {
                    return Err(ExtentError::Lost {
                        vdisk,
                        offset,
                        path: path(),
                        file_offset,
                    })
                }
            }
        }
        Ok(())
    }

    /// A copy of the entries of blocks `[first, first + count)`, or the error of the damaged
    /// header or checksum block covering them.
    pub(crate) fn entries(&self, first: usize, count: usize) -> Result<Entries, ExtentError> {
        if let Some(reason) = self.bad_header.borrow().as_ref() {
            return Err(ExtentError::BadHeader {
                vdisk: self.vdisk,
                offset: self.vdisk_offset(first),
                path: self.path.clone(),
                reason: reason.clone(),
            });
        }
        let extents = self.extents.borrow();
        let mut out = Entries::with_capacity(count);
        for block in first..first + count {
            let extent = block / BLOCKS_PER_EXTENT;
            match &extents[extent].table {
                Ok(table) => out.push(table[block % BLOCKS_PER_EXTENT]),
                Err(reason) => {
                    return Err(ExtentError::BadChecksumBlock {
                        vdisk: self.vdisk,
                        offset: self.vdisk_offset(block),
                        path: self.path.clone(),
                        file_offset: table_offset(extent),
                        reason: reason.clone(),
                    })
                }
            }
        }
        Ok(out)
    }

    /// The extents of blocks `[first, end)` must be normalized again before their next
    /// write (their data on disk changed behind the store: damage found by a read).
    pub(crate) fn forget_normalization(&self, first: usize, end: usize) {
        let mut extents = self.extents.borrow_mut();
        for extent in first / BLOCKS_PER_EXTENT..end.div_ceil(BLOCKS_PER_EXTENT) {
            if let Some(state) = extents.get_mut(extent) {
                state.normalized = false;
            }
        }
    }

    pub(crate) fn entry(&self, block: usize) -> Entry {
        match &self.extents.borrow()[block / BLOCKS_PER_EXTENT].table {
            Ok(table) => table[block % BLOCKS_PER_EXTENT],
            Err(_) => Entry::HOLE,
        }
    }

    pub(crate) fn set_entry(&self, block: usize, entry: Entry) {
        if let Ok(table) = &mut self.extents.borrow_mut()[block / BLOCKS_PER_EXTENT].table {
            table[block % BLOCKS_PER_EXTENT] = entry;
        }
    }
}

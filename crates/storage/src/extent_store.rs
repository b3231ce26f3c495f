//! The extent store: a vdisk's data in extent groups (egroups), one sparse file per egroup,
//! with two CRC32C slots per 4 KiB block checked on every read. Format: docs/extent-store-format.md.
//!
//! An `ExtentStore` is single-threaded: one shard controller owns the egroups of its ranges.
//! No `RefCell` borrow is held across an await, so concurrent local tasks may share it.

use crate::disk::{Disk, FileIo, FileOpener};
use ashlar_core::{VdiskId, BLOCK_SIZE_BYTES, EXTENT_SIZE_BYTES};
use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};
use std::io;
use std::path::{Path, PathBuf};
use std::rc::Rc;

/// Extents per extent group: an egroup covers 4 MiB of a vdisk, aligned.
pub const EXTENTS_PER_EGROUP: u64 = 4;
pub const EGROUP_SPAN_BYTES: u64 = EXTENTS_PER_EGROUP * EXTENT_SIZE_BYTES;
const BLOCK: u64 = BLOCK_SIZE_BYTES;
const BLOCKS_PER_EXTENT: u64 = EXTENT_SIZE_BYTES / BLOCK;
/// Header block + one checksum block per extent precede the data.
const DATA_START_BLOCK: u64 = 1 + EXTENTS_PER_EGROUP;
const MAGIC: &[u8; 8] = b"ASHLAREG";
const FORMAT_VERSION: u32 = 1;
const ENTRY_BYTES: usize = 16;
/// Above this many dirty egroup files, `sync` flushes each disk's filesystem once instead.
const SYNC_FILESYSTEM_THRESHOLD: usize = 4;

#[derive(Clone, Debug)]
pub struct ExtentStoreConfig {
    pub vdisk: VdiskId,
    pub disks: Vec<Disk>,
    /// Egroups kept open: bounds fds and cached checksum blocks (16 KiB each).
    pub max_open_egroups: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum ExtentError {
    #[error("I/O error on {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("no space left on {path}")]
    NoSpace { path: PathBuf },
    #[error("checksum mismatch in vdisk {vdisk} at offset {offset} in {path}: data crc {actual:08x}, stored {expected:08x?}")]
    Corrupt {
        vdisk: VdiskId,
        offset: u64,
        path: PathBuf,
        expected: [u32; 2],
        actual: u32,
    },
    #[error("bad extent group header in {path}: {reason}")]
    BadHeader { path: PathBuf, reason: String },
}

fn io_error(path: &Path, source: io::Error) -> ExtentError {
    if source.raw_os_error() == Some(libc::ENOSPC) {
        ExtentError::NoSpace {
            path: path.to_path_buf(),
        }
    } else {
        ExtentError::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}

/// Checksum state of one 4 KiB block.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Entry {
    written: bool,
    /// Part of the block was lost to corruption and a partial write merged into it: it stays
    /// unreadable (EIO) until fully overwritten or zeroed, rather than serve guessed bytes.
    poisoned: bool,
    current_slot: u8,
    crc: [u32; 2],
}

impl Entry {
    fn encode(&self, out: &mut [u8]) {
        out.fill(0);
        out[0] = if self.poisoned { 2 } else { self.written as u8 };
        out[1] = self.current_slot;
        out[4..8].copy_from_slice(&self.crc[0].to_le_bytes());
        out[8..12].copy_from_slice(&self.crc[1].to_le_bytes());
    }

    fn decode(bytes: &[u8]) -> Entry {
        let word = |at: usize| {
            u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
        };
        Entry {
            written: bytes[0] == 1 || bytes[0] == 2,
            poisoned: bytes[0] == 2,
            current_slot: bytes[1] & 1,
            crc: [word(4), word(8)],
        }
    }

    fn matches(&self, crc: u32) -> Option<u8> {
        if self.crc[self.current_slot as usize] == crc {
            Some(self.current_slot)
        } else if self.crc[1 - self.current_slot as usize] == crc {
            Some(1 - self.current_slot)
        } else {
            None
        }
    }
}

fn zero_block_crc() -> u32 {
    crc32c::crc32c(&[0u8; BLOCK as usize])
}

struct Egroup<F> {
    file: Rc<F>,
    path: PathBuf,
    /// Checksum entries, one Vec of 256 per extent.
    entries: RefCell<Vec<Vec<Entry>>>,
    dirty: Cell<bool>,
    last_use: Cell<u64>,
}

pub struct ExtentStore<O: FileOpener> {
    opener: O,
    config: ExtentStoreConfig,
    open: RefCell<HashMap<u64, Rc<Egroup<O::File>>>>,
    /// Where each egroup lives (disk index), once known; `None` = exists nowhere yet.
    location: RefCell<HashMap<u64, Option<usize>>>,
    /// Extents whose current slots were checked against their data in this process (see
    /// "normalization" in the format doc). Survives eviction; 16 bytes per extent written.
    normalized: RefCell<HashSet<(u64, u64)>>,
    /// Evicted or newly created files whose data or directory entry still needs a sync.
    pending_sync: RefCell<Vec<Rc<O::File>>>,
    new_dirs: RefCell<HashSet<PathBuf>>,
    clock: Cell<u64>,
}

fn egroup_dir(disk: &Disk, vdisk: VdiskId) -> PathBuf {
    disk.path.join("extents").join(vdisk.to_string())
}

fn egroup_file(disk: &Disk, vdisk: VdiskId, egroup: u64) -> PathBuf {
    egroup_dir(disk, vdisk).join(format!("{egroup:016x}.egroup"))
}

fn header_block(vdisk: VdiskId, egroup: u64) -> Vec<u8> {
    let mut block = vec![0u8; BLOCK as usize];
    block[0..8].copy_from_slice(MAGIC);
    block[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    block[12..16].copy_from_slice(&(BLOCK as u32).to_le_bytes());
    block[16..20].copy_from_slice(&(EXTENTS_PER_EGROUP as u32).to_le_bytes());
    block[20..28].copy_from_slice(&vdisk.0.to_le_bytes());
    block[28..36].copy_from_slice(&egroup.to_le_bytes());
    let crc = crc32c::crc32c(&block[0..36]);
    block[36..40].copy_from_slice(&crc.to_le_bytes());
    block
}

fn check_header(block: &[u8], vdisk: VdiskId, egroup: u64, path: &Path) -> Result<(), ExtentError> {
    let bad = |reason: &str| {
        Err(ExtentError::BadHeader {
            path: path.to_path_buf(),
            reason: reason.into(),
        })
    };
    if &block[0..8] != MAGIC {
        return bad("wrong magic");
    }
    let expected = header_block(vdisk, egroup);
    if block[8..12] != expected[8..12] {
        return bad("unsupported format version");
    }
    if block[36..40] != block_crc_bytes(&block[0..36]) {
        return bad("header checksum mismatch");
    }
    if block[12..36] != expected[12..36] {
        return bad("header names another vdisk, egroup or geometry");
    }
    Ok(())
}

fn block_crc_bytes(bytes: &[u8]) -> [u8; 4] {
    crc32c::crc32c(bytes).to_le_bytes()
}

fn data_file_offset(extent_in_group: u64, block_in_extent: u64) -> u64 {
    (DATA_START_BLOCK + extent_in_group * BLOCKS_PER_EXTENT + block_in_extent) * BLOCK
}

/// One piece of a request inside one extent: whole-block span `[first_block, end_block)`.
#[derive(Clone, Copy, Debug)]
struct Span {
    egroup: u64,
    extent: u64, // within the egroup
    offset: u64, // vdisk offset of the piece
    length: u64,
}

fn spans(offset: u64, length: u64) -> Vec<Span> {
    let mut out = Vec::new();
    let end = offset + length;
    let mut at = offset;
    while at < end {
        let extent_end = (at / EXTENT_SIZE_BYTES + 1) * EXTENT_SIZE_BYTES;
        let piece_end = extent_end.min(end);
        out.push(Span {
            egroup: at / EGROUP_SPAN_BYTES,
            extent: (at % EGROUP_SPAN_BYTES) / EXTENT_SIZE_BYTES,
            offset: at,
            length: piece_end - at,
        });
        at = piece_end;
    }
    out
}

impl Span {
    fn first_block(&self) -> u64 {
        (self.offset % EXTENT_SIZE_BYTES) / BLOCK
    }
    fn end_block(&self) -> u64 {
        ((self.offset % EXTENT_SIZE_BYTES) + self.length).div_ceil(BLOCK)
    }
    fn block_offset(&self, block: u64) -> u64 {
        (self.offset / EXTENT_SIZE_BYTES) * EXTENT_SIZE_BYTES + block * BLOCK
    }
}

impl<O: FileOpener> ExtentStore<O> {
    pub fn new(opener: O, config: ExtentStoreConfig) -> Self {
        assert!(
            !config.disks.is_empty(),
            "an extent store needs at least one disk"
        );
        ExtentStore {
            opener,
            config,
            open: RefCell::new(HashMap::new()),
            location: RefCell::new(HashMap::new()),
            normalized: RefCell::new(HashSet::new()),
            pending_sync: RefCell::new(Vec::new()),
            new_dirs: RefCell::new(HashSet::new()),
            clock: Cell::new(0),
        }
    }

    fn tick(&self) -> u64 {
        self.clock.set(self.clock.get() + 1);
        self.clock.get()
    }

    fn find(&self, egroup: u64) -> Option<usize> {
        if let Some(known) = self.location.borrow().get(&egroup) {
            return *known;
        }
        let found = self
            .config
            .disks
            .iter()
            .position(|disk| egroup_file(disk, self.config.vdisk, egroup).exists());
        self.location.borrow_mut().insert(egroup, found);
        found
    }

    /// The open egroup, opening (or with `create`, creating) it. `None`: it does not exist.
    async fn egroup(
        &self,
        egroup: u64,
        create: bool,
    ) -> Result<Option<Rc<Egroup<O::File>>>, ExtentError> {
        if let Some(open) = self.open.borrow().get(&egroup) {
            open.last_use.set(self.tick());
            return Ok(Some(open.clone()));
        }
        let (disk_index, created) = match self.find(egroup) {
            Some(index) => (index, false),
            None if create => (self.choose_disk(), true),
            None => return Ok(None),
        };
        let disk = &self.config.disks[disk_index];
        let path = egroup_file(disk, self.config.vdisk, egroup);
        let state = if created {
            self.create_file(disk, egroup, &path).await?
        } else {
            self.open_file(egroup, &path).await?
        };
        self.location.borrow_mut().insert(egroup, Some(disk_index));
        let state = Rc::new(state);
        state.last_use.set(self.tick());
        self.evict_if_full();
        self.open.borrow_mut().insert(egroup, state.clone());
        Ok(Some(state))
    }

    async fn create_file(
        &self,
        disk: &Disk,
        egroup: u64,
        path: &Path,
    ) -> Result<Egroup<O::File>, ExtentError> {
        let dir = egroup_dir(disk, self.config.vdisk);
        if !dir.exists() {
            std::fs::create_dir_all(&dir).map_err(|e| io_error(&dir, e))?;
            if let Some(parent) = dir.parent() {
                self.new_dirs.borrow_mut().insert(parent.to_path_buf());
            }
        }
        self.new_dirs.borrow_mut().insert(dir);
        let file = self
            .opener
            .open(path, true)
            .map_err(|e| io_error(path, e))?;
        file.write_at(&header_block(self.config.vdisk, egroup), 0)
            .await
            .map_err(|e| io_error(path, e))?;
        let entries =
            vec![vec![Entry::default(); BLOCKS_PER_EXTENT as usize]; EXTENTS_PER_EGROUP as usize];
        let state = Egroup {
            file: Rc::new(file),
            path: path.to_path_buf(),
            entries: RefCell::new(entries),
            dirty: Cell::new(true),
            last_use: Cell::new(0),
        };
        for extent in 0..EXTENTS_PER_EGROUP {
            // A new egroup has no old data: nothing to normalize.
            self.normalized.borrow_mut().insert((egroup, extent));
        }
        Ok(state)
    }

    async fn open_file(&self, egroup: u64, path: &Path) -> Result<Egroup<O::File>, ExtentError> {
        let file = self
            .opener
            .open(path, false)
            .map_err(|e| io_error(path, e))?;
        let mut head = vec![0u8; (DATA_START_BLOCK * BLOCK) as usize];
        file.read_at(&mut head, 0)
            .await
            .map_err(|e| io_error(path, e))?;
        check_header(&head[..BLOCK as usize], self.config.vdisk, egroup, path)?;
        let entries = (0..EXTENTS_PER_EGROUP as usize)
            .map(|extent| {
                let block = &head[(1 + extent) * BLOCK as usize..(2 + extent) * BLOCK as usize];
                block.chunks(ENTRY_BYTES).map(Entry::decode).collect()
            })
            .collect();
        Ok(Egroup {
            file: Rc::new(file),
            path: path.to_path_buf(),
            entries: RefCell::new(entries),
            dirty: Cell::new(false),
            last_use: Cell::new(0),
        })
    }

    fn choose_disk(&self) -> usize {
        let free = |disk: &Disk| free_bytes(&disk.path).unwrap_or(0);
        (0..self.config.disks.len())
            .max_by_key(|&i| free(&self.config.disks[i]))
            .unwrap_or(0)
    }

    fn evict_if_full(&self) {
        let mut open = self.open.borrow_mut();
        while open.len() >= self.config.max_open_egroups.max(1) {
            let Some((&victim, _)) = open.iter().min_by_key(|(_, e)| e.last_use.get()) else {
                break;
            };
            if let Some(evicted) = open.remove(&victim) {
                if evicted.dirty.get() {
                    self.pending_sync.borrow_mut().push(evicted.file.clone());
                }
            }
        }
    }

    pub async fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), ExtentError> {
        let mut done = 0usize;
        for span in spans(offset, buf.len() as u64) {
            let out = &mut buf[done..done + span.length as usize];
            done += span.length as usize;
            match self.egroup(span.egroup, false).await? {
                None => out.fill(0),
                Some(group) => {
                    let blocks = self
                        .read_blocks(&group, &span, span.first_block(), span.end_block())
                        .await?;
                    let skip = (span.offset % BLOCK) as usize;
                    out.copy_from_slice(&blocks[skip..skip + out.len()]);
                }
            }
        }
        Ok(())
    }

    /// Reads and verifies whole blocks `[first, end)` of the span's extent.
    async fn read_blocks(
        &self,
        group: &Egroup<O::File>,
        span: &Span,
        first: u64,
        end: u64,
    ) -> Result<Vec<u8>, ExtentError> {
        let mut data = vec![0u8; ((end - first) * BLOCK) as usize];
        let written: Vec<Entry> =
            group.entries.borrow()[span.extent as usize][first as usize..end as usize].to_vec();
        if written.iter().any(|e| e.written) {
            group
                .file
                .read_at(&mut data, data_file_offset(span.extent, first))
                .await
                .map_err(|e| io_error(&group.path, e))?;
        }
        for (i, entry) in written.iter().enumerate() {
            let block = &mut data[i * BLOCK as usize..(i + 1) * BLOCK as usize];
            if !entry.written {
                block.fill(0);
                continue;
            }
            let actual = crc32c::crc32c(block);
            if entry.poisoned || entry.matches(actual).is_none() {
                return Err(ExtentError::Corrupt {
                    vdisk: self.config.vdisk,
                    offset: span.block_offset(first + i as u64),
                    path: group.path.clone(),
                    expected: entry.crc,
                    actual,
                });
            }
        }
        Ok(data)
    }

    /// Before the first write to an extent in this process, make each block's current slot
    /// the one its data on disk matches (a crash may have left the persisted slot stale).
    async fn normalize(
        &self,
        group: &Egroup<O::File>,
        egroup: u64,
        extent: u64,
    ) -> Result<(), ExtentError> {
        if self.normalized.borrow().contains(&(egroup, extent)) {
            return Ok(());
        }
        let entries: Vec<Entry> = group.entries.borrow()[extent as usize].clone();
        if entries.iter().any(|e| e.written) {
            let mut data = vec![0u8; EXTENT_SIZE_BYTES as usize];
            group
                .file
                .read_at(&mut data, data_file_offset(extent, 0))
                .await
                .map_err(|e| io_error(&group.path, e))?;
            let mut table = group.entries.borrow_mut();
            for (block, entry) in entries.iter().enumerate() {
                if !entry.written {
                    continue;
                }
                let crc =
                    crc32c::crc32c(&data[block * BLOCK as usize..(block + 1) * BLOCK as usize]);
                if let Some(slot) = entry.matches(crc) {
                    table[extent as usize][block].current_slot = slot;
                }
            }
        }
        self.normalized.borrow_mut().insert((egroup, extent));
        Ok(())
    }

    pub async fn write(&self, offset: u64, data: &[u8]) -> Result<(), ExtentError> {
        let mut done = 0usize;
        for span in spans(offset, data.len() as u64) {
            let piece = &data[done..done + span.length as usize];
            done += span.length as usize;
            let group = self
                .egroup(span.egroup, true)
                .await?
                .ok_or_else(|| ExtentError::Io {
                    path: PathBuf::from("egroup"),
                    source: io::Error::other("egroup vanished while being created"),
                })?;
            self.normalize(&group, span.egroup, span.extent).await?;
            let (first, end) = (span.first_block(), span.end_block());
            let mut blocks = vec![0u8; ((end - first) * BLOCK) as usize];
            let head = span.offset % BLOCK;
            let partial_head = head != 0;
            let partial_tail = !(head + span.length).is_multiple_of(BLOCK);
            let mut poisoned = Vec::new();
            if partial_head {
                self.read_edge(
                    &group,
                    &span,
                    first,
                    &mut blocks[..BLOCK as usize],
                    &mut poisoned,
                )
                .await?;
            }
            if partial_tail && (end - first > 1 || !partial_head) {
                let at = blocks.len() - BLOCK as usize;
                self.read_edge(&group, &span, end - 1, &mut blocks[at..], &mut poisoned)
                    .await?;
            }
            blocks[head as usize..head as usize + piece.len()].copy_from_slice(piece);
            self.write_blocks(&group, span.extent, first, &blocks, &poisoned)
                .await?;
        }
        Ok(())
    }

    /// Read-modify-write of an edge block, verified like any read. A corrupt old block cannot
    /// be merged honestly: the write still lands (so the oplog can drain), and the block is
    /// poisoned so it keeps failing reads instead of serving the guessed remainder.
    async fn read_edge(
        &self,
        group: &Egroup<O::File>,
        span: &Span,
        block: u64,
        out: &mut [u8],
        poisoned: &mut Vec<u64>,
    ) -> Result<(), ExtentError> {
        match self.read_blocks(group, span, block, block + 1).await {
            Ok(old) => {
                out.copy_from_slice(&old);
                Ok(())
            }
            Err(ExtentError::Corrupt { offset, path, .. }) => {
                tracing::error!(vdisk = %self.config.vdisk, offset, path = %path.display(),
                    "partial write into a corrupt block: the block stays unreadable until fully rewritten");
                poisoned.push(block);
                Ok(())
            }
            Err(other) => Err(other),
        }
    }

    /// New CRCs go to each block's non-current slot and reach the file before the data, so a
    /// crash between the two writes leaves data that still matches one slot.
    async fn write_blocks(
        &self,
        group: &Egroup<O::File>,
        extent: u64,
        first: u64,
        blocks: &[u8],
        poisoned: &[u64],
    ) -> Result<(), ExtentError> {
        let zero_crc = zero_block_crc();
        let mut flips = Vec::new();
        let table_bytes = {
            let mut table = group.entries.borrow_mut();
            let entries = &mut table[extent as usize];
            for (i, block) in blocks.chunks(BLOCK as usize).enumerate() {
                let entry = &mut entries[first as usize + i];
                let crc = crc32c::crc32c(block);
                if !entry.written {
                    // The old content is a hole (zeros): keep that valid in the other slot.
                    *entry = Entry {
                        written: true,
                        poisoned: false,
                        current_slot: 0,
                        crc: [zero_crc, crc],
                    };
                    flips.push((first as usize + i, 1u8));
                } else {
                    let next = 1 - entry.current_slot;
                    entry.crc[next as usize] = crc;
                    flips.push((first as usize + i, next));
                }
                entry.poisoned = poisoned.contains(&(first + i as u64));
            }
            encode_table(entries)
        };
        let table_offset = (1 + extent) * BLOCK;
        group
            .file
            .write_at(&table_bytes, table_offset)
            .await
            .map_err(|e| io_error(&group.path, e))?;
        group
            .file
            .write_at(blocks, data_file_offset(extent, first))
            .await
            .map_err(|e| io_error(&group.path, e))?;
        let mut table = group.entries.borrow_mut();
        for (block, slot) in flips {
            table[extent as usize][block].current_slot = slot;
        }
        group.dirty.set(true);
        Ok(())
    }

    pub async fn write_zeroes(&self, offset: u64, length: u64) -> Result<(), ExtentError> {
        for span in spans(offset, length) {
            let Some(group) = self.egroup(span.egroup, false).await? else {
                continue;
            };
            let start = span.offset % EXTENT_SIZE_BYTES;
            let end = start + span.length;
            let full_start = start.div_ceil(BLOCK) * BLOCK;
            let full_end = end / BLOCK * BLOCK;
            let extent_base = span.offset - start;
            if full_start >= full_end {
                // No whole block: the bytes get real zeros.
                self.write(span.offset, &vec![0u8; span.length as usize])
                    .await?;
                continue;
            }
            if start < full_start {
                self.write(span.offset, &vec![0u8; (full_start - start) as usize])
                    .await?;
            }
            if full_end < end {
                self.write(
                    extent_base + full_end,
                    &vec![0u8; (end - full_end) as usize],
                )
                .await?;
            }
            self.unwrite_blocks(&group, span.extent, full_start / BLOCK, full_end / BLOCK)
                .await?;
        }
        Ok(())
    }

    /// Whole blocks become holes: state cleared first, then the space freed.
    async fn unwrite_blocks(
        &self,
        group: &Egroup<O::File>,
        extent: u64,
        first: u64,
        end: u64,
    ) -> Result<(), ExtentError> {
        let table_bytes = {
            let mut table = group.entries.borrow_mut();
            let entries = &mut table[extent as usize];
            if entries[first as usize..end as usize]
                .iter()
                .all(|e| !e.written)
            {
                return Ok(());
            }
            for entry in &mut entries[first as usize..end as usize] {
                *entry = Entry::default();
            }
            encode_table(entries)
        };
        group
            .file
            .write_at(&table_bytes, (1 + extent) * BLOCK)
            .await
            .map_err(|e| io_error(&group.path, e))?;
        group
            .file
            .punch_hole(data_file_offset(extent, first), (end - first) * BLOCK)
            .await
            .map_err(|e| io_error(&group.path, e))?;
        group.dirty.set(true);
        Ok(())
    }

    /// Makes every write since the last sync durable: data and checksum blocks of each
    /// touched egroup, and the directory entries of new egroup files.
    pub async fn sync(&self) -> Result<(), ExtentError> {
        let dirty: Vec<Rc<Egroup<O::File>>> = self
            .open
            .borrow()
            .values()
            .filter(|e| e.dirty.get())
            .cloned()
            .collect();
        let evicted: Vec<Rc<O::File>> = self.pending_sync.borrow_mut().drain(..).collect();
        if dirty.len() + evicted.len() > SYNC_FILESYSTEM_THRESHOLD {
            self.sync_filesystems(&dirty, &evicted).await?;
        } else {
            for group in &dirty {
                group.dirty.set(false);
                if let Err(e) = group.file.sync_data().await {
                    group.dirty.set(true);
                    return Err(io_error(&group.path, e));
                }
            }
            for file in evicted {
                file.sync_data()
                    .await
                    .map_err(|e| io_error(file.path(), e))?;
            }
        }
        let dirs: Vec<PathBuf> = self.new_dirs.borrow_mut().drain().collect();
        for dir in dirs {
            sync_dir(&dir).map_err(|e| io_error(&dir, e))?;
        }
        Ok(())
    }

    /// One syncfs per disk instead of one fdatasync per file: a drain that touched hundreds of
    /// egroups would otherwise pay hundreds of journal commits.
    async fn sync_filesystems(
        &self,
        dirty: &[Rc<Egroup<O::File>>],
        evicted: &[Rc<O::File>],
    ) -> Result<(), ExtentError> {
        let mut synced_disks = HashSet::new();
        let files = dirty.iter().map(|g| &g.file).chain(evicted.iter());
        for file in files {
            let path = file.path();
            let disk = self
                .config
                .disks
                .iter()
                .position(|d| path.starts_with(&d.path));
            if synced_disks.insert(disk) {
                file.sync_filesystem()
                    .await
                    .map_err(|e| io_error(path, e))?;
            }
        }
        for group in dirty {
            group.dirty.set(false);
        }
        Ok(())
    }

    pub async fn allocation(
        &self,
        offset: u64,
        length: u64,
    ) -> Result<Vec<(u64, bool)>, ExtentError> {
        let mut runs: Vec<(u64, bool)> = Vec::new();
        let mut push = |len: u64, allocated: bool| {
            if len == 0 {
                return;
            }
            match runs.last_mut() {
                Some(last) if last.1 == allocated => last.0 += len,
                _ => runs.push((len, allocated)),
            }
        };
        for span in spans(offset, length) {
            let Some(group) = self.egroup(span.egroup, false).await? else {
                push(span.length, false);
                continue;
            };
            let table = group.entries.borrow();
            let entries = &table[span.extent as usize];
            let end = span.offset + span.length;
            let mut at = span.offset;
            while at < end {
                let block = (at % EXTENT_SIZE_BYTES) / BLOCK;
                let block_end = ((at / BLOCK) + 1) * BLOCK;
                let piece = block_end.min(end) - at;
                push(piece, entries[block as usize].written);
                at += piece;
            }
        }
        Ok(runs)
    }

    /// Drops open files and cached checksums (after `sync`), e.g. when a shard hands over.
    pub fn close_all(&self) {
        self.open.borrow_mut().clear();
        self.location.borrow_mut().clear();
        self.normalized.borrow_mut().clear();
    }
}

fn encode_table(entries: &[Entry]) -> Vec<u8> {
    let mut bytes = vec![0u8; BLOCK as usize];
    for (entry, out) in entries.iter().zip(bytes.chunks_mut(ENTRY_BYTES)) {
        entry.encode(out);
    }
    bytes
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

fn free_bytes(path: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: statvfs writes into the zeroed struct we own; the path is a valid C string.
    unsafe {
        let mut stat: libc::statvfs = std::mem::zeroed();
        if libc::statvfs(c_path.as_ptr(), &mut stat) != 0 {
            return None;
        }
        Some(stat.f_bavail as u64 * stat.f_frsize as u64)
    }
}

/// Deletes every egroup of the vdisk on every disk.
pub fn remove_vdisk_data(disks: &[Disk], vdisk: VdiskId) -> io::Result<()> {
    for disk in disks {
        match std::fs::remove_dir_all(egroup_dir(disk, vdisk)) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Allocated bytes of the vdisk's egroups (st_blocks), for stats and tests.
pub fn vdisk_bytes_used(disks: &[Disk], vdisk: VdiskId) -> io::Result<u64> {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0;
    for disk in disks {
        let Ok(entries) = std::fs::read_dir(egroup_dir(disk, vdisk)) else {
            continue;
        };
        for entry in entries.flatten() {
            total += entry.metadata()?.blocks() * 512;
        }
    }
    Ok(total)
}

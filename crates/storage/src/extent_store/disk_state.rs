//! Keeping an open egroup's memory and its file in step: the write primitives (which record
//! what is not yet synced), syncing, normalization (learning which slot the data on disk
//! matches and which holes are really zeros) and recovery after a failed write or sync.

use super::egroup::{is_zero, Egroup, ALL_BITS, DIR_BIT, HEADER_BIT};
use super::format::{
    data_offset, encode_header, table_offset, BLOCKS_PER_EGROUP, BLOCKS_PER_EXTENT, BLOCK_LEN,
    EXTENTS,
};
use super::table::{encode_table, zero_block_crc, BlockState, Entry};
use super::{io_error, ExtentError};
use crate::fs::{DiskFile, Filesystem};

impl<D: DiskFile> Egroup<D> {
    /// Whether a batch writing `extents_touched` must hold every extent of the egroup: recovery
    /// is pending (it rewrites extents other batches may hold), or damage is about to be reset
    /// (a damaged header resets every extent).
    pub(crate) fn needs_every_extent(&self, extents_touched: u8) -> bool {
        let extents = self.extents.borrow();
        self.needs_recovery.get() != 0
            || self.bad_header.borrow().is_some()
            || (0..EXTENTS).any(|e| extents_touched & (1 << e) != 0 && extents[e].table.is_err())
    }

    /// Before writing: a damaged header makes every extent all-lost (its blocks kept reading as
    /// EIO, now durably and writable); a damaged checksum block of an extent about to be
    /// written makes that extent all-lost. Both are rewritten by `recover`.
    pub(crate) fn reset_damage(&self, extents_touched: u8) {
        let bad_header = self.bad_header.borrow_mut().take();
        let mut extents = self.extents.borrow_mut();
        let lost = Entry {
            state: BlockState::Lost,
            ..Entry::HOLE
        };
        let mut reset = 0u8;
        for (extent, state) in extents.iter_mut().enumerate() {
            if bad_header.is_some()
                || (extents_touched & (1 << extent) != 0 && state.table.is_err())
            {
                state.table = Ok(Box::new([lost; BLOCKS_PER_EXTENT]));
                state.normalized = true;
                reset |= 1 << extent;
            }
        }
        if bad_header.is_some() {
            reset |= HEADER_BIT;
        }
        if reset != 0 {
            tracing::error!(path = %self.path.display(), reset,
                "writing into a damaged extent group: its unreadable blocks are recorded as lost");
            self.needs_recovery.set(self.needs_recovery.get() | reset);
        }
    }

    /// Makes `current`/`zero_known` of the extent's entries reflect the data on disk, once per
    /// open (and again after a failure). Returns the extent's data if it read it.
    pub(crate) async fn normalize(&self, extent: usize) -> Result<Option<Vec<u8>>, ExtentError> {
        {
            let extents = self.extents.borrow();
            if extents[extent].normalized || extents[extent].table.is_err() {
                return Ok(None);
            }
        }
        if !self.synced_since_open.get() {
            // After a kill -9 the page cache may hold writes that are not durable: make what we
            // are about to read durable, so it is what a power cut leaves.
            self.sync(1 << extent).await?;
        }
        let first = extent * BLOCKS_PER_EXTENT;
        let mut view = vec![0u8; BLOCKS_PER_EXTENT * BLOCK_LEN];
        self.file
            .read_at(&mut view, data_offset(first))
            .await
            .map_err(|e| io_error(&self.path, Some(data_offset(first)), e))?;
        let mut extents = self.extents.borrow_mut();
        let state = &mut extents[extent];
        if let Ok(table) = &mut state.table {
            for (entry, block) in table.iter_mut().zip(view.chunks(BLOCK_LEN)) {
                match entry.state {
                    BlockState::Written => entry.current = entry.slot_of(crc32c::crc32c(block)),
                    BlockState::Hole => entry.zero_known = is_zero(block),
                    _ => {}
                }
            }
        }
        state.normalized = true;
        Ok(Some(view))
    }

    /// `sync_data` of the file, made by the holder of the extents (and header) in `bits`:
    /// their writes, all complete, are durable when it succeeds. Bits of extents other batches
    /// hold stay set (their writes may have been in flight). On failure everything written
    /// since the last successful sync must be rewritten before the next write (a failed fsync
    /// may have dropped it: see the doc).
    pub(crate) async fn sync(&self, bits: u8) -> Result<(), ExtentError> {
        match self.file.sync_data().await {
            Ok(()) => {
                self.unsynced.set(self.unsynced.get() & !bits);
                self.synced_since_open.set(true);
                Ok(())
            }
            Err(e) => {
                self.mark_failed();
                Err(io_error(&self.path, None, e))
            }
        }
    }

    /// The file was found without a listing (its directory entry may not be durable yet).
    pub(crate) fn found_unlisted(&self) {
        self.needs_recovery.set(self.needs_recovery.get() | DIR_BIT);
    }

    /// After a failed write or sync: what was written since the last good sync is uncertain.
    pub(crate) fn mark_failed(&self) {
        self.needs_recovery
            .set(self.needs_recovery.get() | self.unsynced.get());
        self.failures.set(self.failures.get() + 1);
    }

    /// [`Self::sync`] for a batch that began when `failures` was `failures_at_start`: fails if
    /// any write or sync of the file failed since, even when this sync succeeds (that failure
    /// may have dropped this batch's writes, and the kernel reports it only once).
    pub(crate) async fn sync_checked(
        &self,
        bits: u8,
        failures_at_start: u64,
    ) -> Result<(), ExtentError> {
        self.sync(bits).await?;
        if self.failures.get() != failures_at_start {
            return Err(ExtentError::Io {
                path: self.path.clone(),
                file_offset: None,
                source: std::io::Error::other(
                    "a concurrent write or sync of this extent group failed; retried after recovery",
                ),
            });
        }
        Ok(())
    }

    /// The checksum blocks of the extents in `extents` (a bit per extent) as runs of
    /// neighbouring blocks, each `(first extent, bytes)`, to be written with one write per run:
    /// the blocks are adjacent on disk, and each write costs its submitter far more than 4 KiB
    /// of copying (on a virtual disk, an exit to the hypervisor). A damaged table is not
    /// rewritten (it ends a run): its extent is reset first (`reset_damage`).
    pub(crate) fn table_runs(&self, extents: u8) -> Vec<(usize, Vec<u8>)> {
        let states = self.extents.borrow();
        let mut runs: Vec<(usize, Vec<u8>)> = Vec::new();
        for extent in (0..EXTENTS).filter(|e| extents & (1 << e) != 0) {
            let Ok(table) = &states[extent].table else {
                continue;
            };
            let position = states[extent].position;
            let block = encode_table(table, self.vdisk, self.index, extent, position);
            match runs.last_mut() {
                Some((first, bytes)) if *first + bytes.len() / BLOCK_LEN == extent => {
                    bytes.extend_from_slice(&block)
                }
                _ => runs.push((extent, block)),
            }
        }
        runs
    }

    /// Writes one run of checksum blocks from [`Self::table_runs`].
    pub(crate) async fn write_table_run(
        &self,
        first: usize,
        bytes: &[u8],
    ) -> Result<(), ExtentError> {
        let count = bytes.len() / BLOCK_LEN;
        let bits = (first..first + count).fold(0u8, |bits, e| bits | 1 << e);
        self.unsynced.set(self.unsynced.get() | bits);
        let at = table_offset(first);
        self.file
            .write_at(bytes, at)
            .await
            .map_err(|e| io_error(&self.path, Some(at), e))
    }

    /// Writes whole blocks starting at egroup block `first`.
    pub(crate) async fn write_data(&self, first: usize, bytes: &[u8]) -> Result<(), ExtentError> {
        let at = self.start_data_write(first, bytes.len());
        self.file
            .write_at(bytes, at)
            .await
            .map_err(|e| io_error(&self.path, Some(at), e))
    }

    /// As `write_data`, from `bytes` itself where the file can (`DiskFile::write_from`).
    pub(crate) async fn write_data_from(
        &self,
        first: usize,
        bytes: bytes::Bytes,
    ) -> Result<(), ExtentError> {
        let at = self.start_data_write(first, bytes.len());
        self.file
            .write_from(bytes, at, false)
            .await
            .map_err(|e| io_error(&self.path, Some(at), e))
    }

    /// Marks the extents of `len` bytes of blocks from `first` unsynced; their file offset.
    fn start_data_write(&self, first: usize, len: usize) -> u64 {
        self.unsynced
            .set(self.unsynced.get() | extent_bits(first, len / BLOCK_LEN));
        data_offset(first)
    }

    pub(crate) async fn punch(&self, first: usize, count: usize) -> Result<(), ExtentError> {
        self.unsynced
            .set(self.unsynced.get() | extent_bits(first, count));
        let at = data_offset(first);
        self.file
            .punch_hole(at, (count * BLOCK_LEN) as u64)
            .await
            .map_err(|e| io_error(&self.path, Some(at), e))
    }

    /// Re-establishes "what is on disk is what memory describes" after a failure: first the
    /// header and checksum blocks from memory (synced), then each affected extent's data as
    /// this process sees it rewritten (blocks that read as zeros, and holes, punched), synced.
    /// A failed fsync may have dropped the data from the disk while the page cache still shows
    /// it; rewriting makes it dirty again so the next sync writes it.
    pub(crate) async fn recover<F: Filesystem<File = D>>(&self, fs: &F) -> Result<(), ExtentError> {
        let mask = self.needs_recovery.get();
        if mask == 0 {
            return Ok(());
        }
        let result = self.recover_mask(fs, mask).await;
        if result.is_err() {
            self.mark_failed();
        }
        result
    }

    async fn recover_mask<F: Filesystem<File = D>>(
        &self,
        fs: &F,
        mask: u8,
    ) -> Result<(), ExtentError> {
        if mask & HEADER_BIT != 0 {
            self.unsynced.set(self.unsynced.get() | HEADER_BIT);
            self.file
                .write_at(&encode_header(self.vdisk, self.index), 0)
                .await
                .map_err(|e| io_error(&self.path, Some(0), e))?;
        }
        let extents: Vec<usize> = (0..EXTENTS).filter(|e| mask & (1 << e) != 0).collect();
        for (first, bytes) in self.table_runs(mask) {
            self.write_table_run(first, &bytes).await?;
        }
        self.sync(ALL_BITS).await?;
        if mask & DIR_BIT != 0 {
            self.sync_dir(fs).await?;
        }
        let zero_crc = zero_block_crc();
        for &extent in &extents {
            let first = extent * BLOCKS_PER_EXTENT;
            let mut view = vec![0u8; BLOCKS_PER_EXTENT * BLOCK_LEN];
            self.file
                .read_at(&mut view, data_offset(first))
                .await
                .map_err(|e| io_error(&self.path, Some(data_offset(first)), e))?;
            // Per block: Some(true) = rewrite, Some(false) = punch, None = leave.
            let mut actions = Vec::with_capacity(BLOCKS_PER_EXTENT);
            if let Ok(table) = &mut self.extents.borrow_mut()[extent].table {
                for (entry, block) in table.iter_mut().zip(view.chunks(BLOCK_LEN)) {
                    actions.push(match entry.state {
                        BlockState::Hole => Some(false),
                        BlockState::Written => {
                            let crc = crc32c::crc32c(block);
                            entry.current = entry.slot_of(crc);
                            entry.current.map(|_| crc != zero_crc)
                        }
                        _ => None,
                    });
                }
            }
            let mut at = 0;
            while at < actions.len() {
                let run = actions[at..]
                    .iter()
                    .take_while(|a| **a == actions[at])
                    .count();
                let bytes = &view[at * BLOCK_LEN..(at + run) * BLOCK_LEN];
                match actions[at] {
                    Some(true) => self.write_data(first + at, bytes).await?,
                    Some(false) => self.punch(first + at, run).await?,
                    None => {}
                }
                at += run;
            }
        }
        self.sync(ALL_BITS).await?;
        let mut states = self.extents.borrow_mut();
        for &extent in &extents {
            if let Ok(table) = &mut states[extent].table {
                for entry in table.iter_mut() {
                    if entry.state == BlockState::Hole {
                        entry.zero_known = true;
                    }
                }
            }
            states[extent].normalized = true;
        }
        self.needs_recovery.set(0);
        Ok(())
    }
}

/// Extent bits of egroup blocks `[first, first + count)`.
pub(crate) fn extent_bits(first: usize, count: usize) -> u8 {
    if count == 0 {
        return 0;
    }
    let last = (first + count - 1).min(BLOCKS_PER_EGROUP - 1);
    (first / BLOCKS_PER_EXTENT..=last / BLOCKS_PER_EXTENT).fold(0, |bits, e| bits | 1 << e)
}

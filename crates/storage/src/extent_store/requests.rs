//! The requests an `ExtentStore` serves: reads (split per extent, run concurrently), write
//! batches (split per egroup, `max_writing_egroups` of them in flight at a time) and
//! allocation maps.

use super::apply::{apply_plan, extents_touched};
use super::batch::{plan, Op, WriteBatch};
use super::block_log::parse_segment_file_name;
use super::egroup::Egroup;
use super::extent_lock::EVERY_EXTENT;
use super::format::{BLOCK, BLOCK_LEN, EGROUP_SPAN_BYTES};
use super::store::Slot;
use super::table::BlockState;
use super::{ExtentError, ExtentStore};
use crate::fs::{DiskBuf, DiskFile, Filesystem};
use crate::join::{try_join_all, try_run_windowed, AfterError};
use ashlar_core::{EXTENT_SIZE_BYTES, MAX_VDISK_SIZE_BYTES};
use bytes::Bytes;

/// Smallest read `read_bytes` has the kernel make into a buffer of its own: one block. Such a
/// buffer is a slot of `fs::small_buffers` (up to 32 KiB) or a mapping of its own, never a
/// heap block (an aligned heap block cost up to 4 KiB of fragment beside it, so 4 KiB reads
/// used to be copied out of a bounce buffer instead).
pub const READ_NEW_MIN_BYTES: u64 = BLOCK;

/// The end of the range; ranges beyond the largest vdisk (1 PiB) are refused, which keeps
/// every offset computation far from overflow.
fn range_end(offset: u64, length: u64) -> Result<u64, ExtentError> {
    offset
        .checked_add(length)
        .filter(|&end| end <= MAX_VDISK_SIZE_BYTES)
        .ok_or(ExtentError::OutOfRange { offset, length })
}

impl<F: Filesystem> ExtentStore<F> {
    /// Reads `buf.len()` bytes at vdisk `offset` (any alignment). Every written block read is
    /// checked against its CRC; blocks never written read as zeros. The extents of a large
    /// read are read concurrently.
    pub async fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), ExtentError> {
        let length = buf.len() as u64;
        range_end(offset, length)?;
        self.ensure_listing().await?;
        // (A read of nothing has no extent: it takes the general path, which reads nothing.)
        if length > 0 && offset / EXTENT_SIZE_BYTES == (offset + length - 1) / EXTENT_SIZE_BYTES {
            // One extent (every small read): no list of pieces to join.
            let result = self.read_piece(offset, buf).await;
            self.trim();
            return result;
        }
        let mut pieces = Vec::new();
        let mut rest: &mut [u8] = buf;
        let mut at = offset;
        while !rest.is_empty() {
            let extent_end = (at / EXTENT_SIZE_BYTES + 1).saturating_mul(EXTENT_SIZE_BYTES);
            let take = ((extent_end - at) as usize).min(rest.len());
            let (piece, tail) = std::mem::take(&mut rest).split_at_mut(take);
            pieces.push(self.read_piece(at, piece));
            rest = tail;
            at += take as u64;
        }
        let result = try_join_all(pieces).await.map(|_| ());
        self.trim();
        result
    }

    async fn read_piece(&self, offset: u64, out: &mut [u8]) -> Result<(), ExtentError> {
        self.ensure_listing().await?; // again: a `close_all` may have run since the request began
        let egroup = offset / EGROUP_SPAN_BYTES;
        if self.find(egroup).is_none() {
            out.fill(0);
            return Ok(());
        }
        let slot = self.pin(egroup);
        let Some(open) = self.load(&slot, egroup, false).await? else {
            out.fill(0);
            return Ok(());
        };
        let in_egroup = offset % EGROUP_SPAN_BYTES;
        let first = (in_egroup / BLOCK) as usize;
        let end = (in_egroup as usize + out.len()).div_ceil(BLOCK_LEN);
        let skip = (in_egroup % BLOCK) as usize;
        let aligned = skip == 0 && out.len().is_multiple_of(BLOCK_LEN);
        let mut scratch = if aligned {
            Vec::new()
        } else {
            vec![0u8; (end - first) * BLOCK_LEN]
        };
        let target: &mut [u8] = if aligned { &mut *out } else { &mut scratch };
        read_verified(&slot, open, (first, end), async || {
            open.read_blocks(&self.fs, first, target).await
        })
        .await?;
        if !aligned {
            out.copy_from_slice(&scratch[skip..skip + out.len()]);
        }
        Ok(())
    }

    /// Reads `length` bytes at vdisk `offset` as `read` does, into a buffer of their own: a
    /// range of at least [`READ_NEW_MIN_BYTES`] of whole blocks within one extent is read
    /// straight into it (the kernel's read lands in the returned memory, see
    /// `DiskFile::read_new`); others through `read`.
    pub async fn read_bytes(&self, offset: u64, length: u64) -> Result<Bytes, ExtentError> {
        let end = range_end(offset, length)?;
        let one_extent = length > 0 && offset / EXTENT_SIZE_BYTES == (end - 1) / EXTENT_SIZE_BYTES;
        let whole_blocks = offset.is_multiple_of(BLOCK) && length.is_multiple_of(BLOCK);
        if !(one_extent && whole_blocks && length >= READ_NEW_MIN_BYTES) {
            // Not read straight into its own buffer, but kept off the heap all the same (see
            // `fs::small_buffers`): it may be cached for long.
            let mut buf = DiskBuf::zeroed(length as usize);
            self.read(offset, buf.as_mut_slice()).await?;
            return Ok(buf.into_bytes());
        }
        self.ensure_listing().await?;
        let result = self.read_whole_blocks(offset, length as usize).await;
        self.trim();
        result.map(DiskBuf::into_bytes)
    }

    /// The blocks of `[offset, offset + length)`, whole blocks within one extent.
    async fn read_whole_blocks(&self, offset: u64, length: usize) -> Result<DiskBuf, ExtentError> {
        let egroup = offset / EGROUP_SPAN_BYTES;
        if self.find(egroup).is_none() {
            return Ok(DiskBuf::zeroed(length));
        }
        let slot = self.pin(egroup);
        let Some(open) = self.load(&slot, egroup, false).await? else {
            return Ok(DiskBuf::zeroed(length));
        };
        let first = ((offset % EGROUP_SPAN_BYTES) / BLOCK) as usize;
        let count = length / BLOCK_LEN;
        read_verified(&slot, open, (first, first + count), async || {
            open.read_blocks_new(&self.fs, first, count).await
        })
        .await
    }

    /// Writes `data` at vdisk `offset` (any alignment); durable when it returns `Ok`.
    pub async fn write(&self, offset: u64, data: &[u8]) -> Result<(), ExtentError> {
        self.apply(WriteBatch::new().write(offset, data)).await
    }

    /// As [`ExtentStore::write`], writing whole blocks from `data`'s own memory where the disk
    /// can (see [`WriteBatch::write_shared`]).
    pub async fn write_shared(&self, offset: u64, data: &Bytes) -> Result<(), ExtentError> {
        self.apply(WriteBatch::new().write_shared(offset, data))
            .await
    }

    /// Makes the range read as zeros (whole blocks become holes, their space freed); durable
    /// when it returns `Ok`.
    pub async fn write_zeroes(&self, offset: u64, length: u64) -> Result<(), ExtentError> {
        self.apply(WriteBatch::new().write_zeroes(offset, length))
            .await
    }

    /// Makes every block overlapping the range read as [`ExtentError::Lost`] until it is fully
    /// overwritten or zeroed (partial blocks at the edges included); durable on `Ok`.
    pub async fn mark_lost(&self, offset: u64, length: u64) -> Result<(), ExtentError> {
        self.apply(WriteBatch::new().mark_lost(offset, length))
            .await
    }

    /// Applies a batch; returns once all of it is durable (two `sync_data` per touched egroup
    /// file at most, one when only holes are filled).
    ///
    /// On error, each block reads its old or its new content, also after a power cut; nothing
    /// of the batch may be acknowledged. The caller retries the **whole batch** later (the
    /// oplog keeps its records until a batch succeeds): after a failed sync the data written
    /// since the last successful sync may never reach the disk even though reads still return
    /// it ("fsyncgate"), so the store first rewrites what it wrote since then (see `sync`) and
    /// the retry rewrites the rest.
    pub async fn apply(&self, batch: &WriteBatch<'_>) -> Result<(), ExtentError> {
        self.check_ranges(batch)?;
        self.ensure_durable_listing().await?;
        let groups = batch.by_egroup(|first, last| self.known_in(first, last));
        try_run_windowed(
            groups.into_iter().map(|(egroup, ops)| async move {
                let result = self.apply_egroup_except(egroup, ops, |_| false).await;
                self.trim();
                result
            }),
            self.writing_width(),
            AfterError::StopStarting,
        )
        .await
    }

    /// Every range of the batch ends within the largest vdisk.
    pub(super) fn check_ranges(&self, batch: &WriteBatch<'_>) -> Result<(), ExtentError> {
        for (offset, length) in batch.ranges() {
            range_end(offset, length)?;
        }
        Ok(())
    }

    /// Egroups a batch writes at a time. A few, not all: a batch spread over hundreds of
    /// egroups would put thousands of writes and syncs ahead of the oplog's commits in the
    /// disk's and the kernel's queues, and every client write would wait out the whole batch.
    pub(super) fn writing_width(&self) -> usize {
        self.config
            .max_writing_egroups
            .clamp(1, self.config.max_open_egroups.max(1))
    }

    /// Applies `ops` to `egroup` with the two-slot protocol, leaving out the blocks `skip`
    /// names (already in the block log: `apply_journaled`).
    pub(super) async fn apply_egroup_except(
        &self,
        egroup: u64,
        ops: Vec<Op<'_>>,
        skip: impl Fn(usize) -> bool,
    ) -> Result<(), ExtentError> {
        self.ensure_durable_listing().await?;
        let mut blocks = plan(egroup, &ops);
        blocks.retain(|&block, _| !skip(block));
        if blocks.is_empty() {
            return Ok(());
        }
        let create = ops.iter().any(Op::needs_egroup);
        if !create && self.find(egroup).is_none() {
            return Ok(());
        }
        let slot = self.pin(egroup);
        let mut guard = slot.lock.lock(extents_touched(&blocks)).await;
        let Some(open) = self.load(&slot, egroup, create).await? else {
            return Ok(());
        };
        if guard.mask() != EVERY_EXTENT && open.needs_every_extent(extents_touched(&blocks)) {
            drop(guard);
            guard = slot.lock.lock(EVERY_EXTENT).await;
        }
        let writes_in_flight = self.config.writes_in_flight_per_egroup;
        apply_plan(&self.fs, open, blocks, writes_in_flight, guard.mask()).await
    }

    /// Runs of `(length, allocated)` covering the range: a block is allocated unless it is a
    /// hole (lost, poisoned and damaged blocks count as allocated: they do not read as zeros).
    pub async fn allocation(
        &self,
        offset: u64,
        length: u64,
    ) -> Result<Vec<(u64, bool)>, ExtentError> {
        let end = range_end(offset, length)?;
        if length == 0 {
            return Ok(Vec::new());
        }
        self.ensure_listing().await?;
        let mut runs: Vec<(u64, bool)> = Vec::new();
        let mut push = |len: u64, allocated: bool| match runs.last_mut() {
            _ if len == 0 => {}
            Some(last) if last.1 == allocated => last.0 += len,
            _ => runs.push((len, allocated)),
        };
        let mut at = offset;
        for egroup in self.known_in(offset / EGROUP_SPAN_BYTES, (end - 1) / EGROUP_SPAN_BYTES) {
            let start = (egroup * EGROUP_SPAN_BYTES).max(offset);
            let stop = ((egroup + 1) * EGROUP_SPAN_BYTES).min(end);
            push(start - at, false);
            let slot = self.pin(egroup);
            let Some(open) = self.load(&slot, egroup, false).await? else {
                push(stop - start, false);
                at = stop;
                continue;
            };
            let mut pos = start;
            while pos < stop {
                let block = ((pos % EGROUP_SPAN_BYTES) / BLOCK) as usize;
                let piece = ((pos / BLOCK + 1) * BLOCK).min(stop) - pos;
                let allocated = open
                    .entries(block, 1)
                    .map_or(true, |e| e[0].state != BlockState::Hole);
                push(piece, allocated);
                pos += piece;
            }
            at = stop;
        }
        push(end - at, false);
        self.trim();
        Ok(runs)
    }
}

/// Runs `read` of blocks `[first, end)` of `open`. A write of a block may have been in flight:
/// a checksum mismatch is looked at again with writers held off before it counts as corruption.
async fn read_verified<D: DiskFile, T>(
    slot: &Slot<D>,
    open: &Egroup<D>,
    (first, end): (usize, usize),
    mut read: impl AsyncFnMut() -> Result<T, ExtentError>,
) -> Result<T, ExtentError> {
    match read().await {
        // Cleaning removed a segment after this read took a block's entry naming it: the
        // entry names the block's home now.
        Err(error) if is_removed_log_segment(&error) => read().await,
        Err(ExtentError::Corrupt { .. }) => {
            let _guard = slot.lock.lock(EVERY_EXTENT).await;
            let again = read().await;
            if matches!(again, Err(ExtentError::Corrupt { .. })) {
                // Real damage (no writer runs): what the egroup knows of its data on disk is
                // wrong there. Read the extents again before the next write, which then treats
                // the damaged blocks as matching neither slot (a rewrite, e.g. a repair from
                // another copy, must not be skipped as "already holds this").
                open.forget_normalization(first, end);
            }
            again
        }
        other => other,
    }
}

/// A read of a block log segment that is gone (cleaning removed it).
fn is_removed_log_segment(error: &ExtentError) -> bool {
    match error {
        ExtentError::Io { path, source, .. } => {
            source.kind() == std::io::ErrorKind::NotFound
                && path
                    .file_name()
                    .and_then(|name| name.to_str())
                    .is_some_and(|name| parse_segment_file_name(name).is_some())
        }
        _ => false,
    }
}

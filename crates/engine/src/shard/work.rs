//! Storage work of a shard controller: futures over the shard's oplog and extent store that
//! the controller's loop runs and whose results it applies. None of them touches controller
//! state; each returns what it found or did.

use super::inline::block_range;
use super::Storage;
use crate::drain_budget::DrainBudget;
use ashlar_core::{BlockStatusRun, IoError, VdiskId, BLOCK_SIZE_BYTES, EXTENT_SIZE_BYTES};
use ashlar_storage::extent_store::{ExtentError, ExtentStore, WriteBatch};
use ashlar_storage::fs::{remove_tree, NodeFs};
use ashlar_storage::oplog::{DrainData, DrainReadLimits, LogPiece, Oplog, OplogError, PieceSource};
use bytes::{Bytes, BytesMut};
use smallvec::{smallvec, SmallVec};
use std::rc::Rc;

/// Why a read did not produce data.
#[derive(Debug)]
pub(super) enum ReadFailure {
    /// A drain freed an oplog segment between lookup and read: look the range up again.
    LogMoved,
    /// A block failed its checksum. A read-modify-write of the block by a concurrent
    /// extent-store writer can look like this; the controller retries once writers are done.
    Corrupt(IoError),
    Failed(IoError),
}

/// A read's data, and the whole extent-store blocks it read, for the cache.
pub(super) struct ReadData {
    pub data: Bytes,
    /// (first block, whole blocks read from the extent store).
    pub fills: SmallVec<[(u64, Bytes); 1]>,
}

pub(super) fn oplog_error(vdisk: VdiskId, offset: u64, error: OplogError) -> IoError {
    match error {
        OplogError::NoSpace { .. } => IoError::NoSpace,
        other => logged_io_error(vdisk, "oplog", offset, other),
    }
}

pub(super) fn store_error(vdisk: VdiskId, offset: u64, error: ExtentError) -> IoError {
    match error {
        ExtentError::NoSpace { .. } => IoError::NoSpace,
        error if error.is_corruption() => {
            tracing::error!(vdisk = %vdisk, offset, %error,
                "extent store data failed its checks; returning EIO");
            IoError::Io(error.to_string())
        }
        other => logged_io_error(vdisk, "extent store", offset, other),
    }
}

fn logged_io_error(
    vdisk: VdiskId,
    what: &str,
    offset: u64,
    error: impl std::fmt::Display,
) -> IoError {
    tracing::error!(vdisk = %vdisk, offset, %error, "{what} failed");
    IoError::Io(format!("{what} at offset {offset}: {error}"))
}

/// Reads `[offset, offset+length)`: oplog pieces checksum-verified from the log, the rest
/// from the extent store in whole blocks (which the controller may cache).
pub(super) async fn read(
    storage: Rc<Storage>,
    vdisk: VdiskId,
    offset: u64,
    length: u64,
) -> Result<ReadData, ReadFailure> {
    if length > 0 && is_block_aligned(offset, length) && !storage.oplog.holds_any_of(offset, length)
    {
        // The common cold read: whole blocks, none in the log. The blocks read are the
        // answer itself (no second buffer, no copy) and, shared, the cache's fill.
        let whole = read_whole_blocks(&storage, vdisk, offset, length).await?;
        return Ok(ReadData {
            data: whole.clone(),
            fills: smallvec![(offset / BLOCK_SIZE_BYTES, whole)],
        });
    }
    let pieces = storage.oplog.lookup(offset, length);
    let mut buffer = BytesMut::zeroed(length as usize);
    let mut fills = SmallVec::new();
    for piece in pieces {
        let start = (piece.offset - offset) as usize;
        let slice = &mut buffer[start..start + piece.length as usize];
        match piece.source {
            PieceSource::Absent => {
                let (first, whole) = read_store(&storage, vdisk, piece.offset, slice).await?;
                fills.push((first, whole));
            }
            _ => read_log(&storage, vdisk, &piece, slice).await?,
        }
    }
    Ok(ReadData {
        data: buffer.freeze(),
        fills,
    })
}

async fn read_log(
    storage: &Storage,
    vdisk: VdiskId,
    piece: &LogPiece,
    slice: &mut [u8],
) -> Result<(), ReadFailure> {
    match storage.oplog.read_piece(piece, slice).await {
        Ok(()) => Ok(()),
        Err(OplogError::Stale { .. }) => Err(ReadFailure::LogMoved),
        Err(other) => Err(ReadFailure::Failed(oplog_error(vdisk, piece.offset, other))),
    }
}

/// Reads the whole blocks enclosing `slice`'s range from the extent store.
async fn read_store(
    storage: &Storage,
    vdisk: VdiskId,
    offset: u64,
    slice: &mut [u8],
) -> Result<(u64, Bytes), ReadFailure> {
    let blocks = block_range(offset, slice.len() as u64);
    let first_byte = blocks.start * BLOCK_SIZE_BYTES;
    let whole_length = (blocks.end - blocks.start) * BLOCK_SIZE_BYTES;
    let whole = read_whole_blocks(storage, vdisk, first_byte, whole_length).await?;
    let skip = (offset - first_byte) as usize;
    slice.copy_from_slice(&whole[skip..skip + slice.len()]);
    Ok((blocks.start, whole))
}

fn is_block_aligned(offset: u64, length: u64) -> bool {
    offset.is_multiple_of(BLOCK_SIZE_BYTES) && length.is_multiple_of(BLOCK_SIZE_BYTES)
}

/// Reads `[offset, offset + length)`, whole blocks, from the extent store (verified there).
/// Errors carry the first byte of the range.
async fn read_whole_blocks(
    storage: &Storage,
    vdisk: VdiskId,
    offset: u64,
    length: u64,
) -> Result<Bytes, ReadFailure> {
    debug_assert!(is_block_aligned(offset, length));
    match storage.store.read_bytes(offset, length).await {
        Ok(whole) => Ok(whole),
        Err(error) if error.is_corruption() => {
            Err(ReadFailure::Corrupt(store_error(vdisk, offset, error)))
        }
        Err(other) => Err(ReadFailure::Failed(store_error(vdisk, offset, other))),
    }
}

/// Whether a write goes straight to the extent store: whole extents with nothing of the
/// range in the oplog (so no older log record can be drained over it later).
pub(super) fn bypasses_oplog(oplog: &Oplog<NodeFs>, offset: u64, length: u64) -> bool {
    offset.is_multiple_of(EXTENT_SIZE_BYTES)
        && length.is_multiple_of(EXTENT_SIZE_BYTES)
        && length > 0
        && !oplog.holds_any_of(offset, length)
}

/// Large, extent-aligned writes skip the oplog: written in place, durable when this returns.
/// If a replay could still bring back an older log record of the range (one in a segment
/// not yet freed, drained or not: `Oplog::replay_may_reach`), the controller then appends a
/// barrier record, which tells replay that those records are superseded, and acknowledges
/// the write once the barrier is durable; otherwise it acknowledges it at once.
pub(super) async fn write_bypass(
    storage: Rc<Storage>,
    vdisk: VdiskId,
    offset: u64,
    data: Bytes,
) -> Result<(), IoError> {
    storage
        .store
        .write_shared(offset, &data)
        .await
        .map_err(|e| store_error(vdisk, offset, e))
}

pub(super) async fn block_status(
    storage: Rc<Storage>,
    vdisk: VdiskId,
    offset: u64,
    length: u64,
) -> Result<Vec<BlockStatusRun>, IoError> {
    let mut runs: Vec<BlockStatusRun> = Vec::new();
    for piece in storage.oplog.lookup(offset, length) {
        match piece.source {
            // Lost data is still allocated data (reading it fails).
            PieceSource::Data { .. } | PieceSource::Lost { .. } => {
                push_run(&mut runs, piece.length, false)
            }
            PieceSource::Zero => push_run(&mut runs, piece.length, true),
            PieceSource::Absent => {
                let allocation = storage
                    .store
                    .allocation(piece.offset, piece.length)
                    .await
                    .map_err(|e| store_error(vdisk, piece.offset, e))?;
                for (run_length, allocated) in allocation {
                    push_run(&mut runs, run_length, !allocated);
                }
            }
        }
    }
    Ok(runs)
}

fn push_run(runs: &mut Vec<BlockStatusRun>, length: u64, hole: bool) {
    if length == 0 {
        return;
    }
    if let Some(last) = runs.last_mut() {
        if last.hole == hole {
            last.length += length;
            return;
        }
    }
    runs.push(BlockStatusRun {
        length,
        hole,
        zero: hole,
    });
}

#[derive(Debug, thiserror::Error)]
pub(super) enum DrainError {
    #[error(transparent)]
    Oplog(#[from] OplogError),
    #[error(transparent)]
    Store(#[from] ExtentError),
}

impl DrainError {
    /// What a writer waiting for the space this drain would have made is told.
    pub(super) fn to_io_error(&self, vdisk: VdiskId) -> IoError {
        if self.is_no_space() {
            return IoError::NoSpace;
        }
        IoError::Io(format!(
            "the oplog of vdisk {vdisk} is full and cannot drain: {self}"
        ))
    }

    pub(super) fn is_no_space(&self) -> bool {
        matches!(
            self,
            DrainError::Oplog(OplogError::NoSpace { .. })
                | DrainError::Store(ExtentError::NoSpace { .. })
        )
    }
}

/// Moves about `max_bytes` of the oldest live oplog entries into the extent store (less when
/// the node's drain budget has less free), syncs it, and lets the oplog free what it no
/// longer needs. Returns how many entries moved.
pub(super) async fn drain_step(
    storage: Rc<Storage>,
    budget: DrainBudget,
    max_bytes: u64,
) -> Result<usize, DrainError> {
    let allowance = budget.take(max_bytes).await;
    drain_batch(&storage.oplog, &storage.store, allowance.bytes()).await
}

async fn drain_batch(
    oplog: &Oplog<NodeFs>,
    store: &ExtentStore<NodeFs>,
    max_bytes: u64,
) -> Result<usize, DrainError> {
    let items = oplog.drain_batch(max_bytes).await;
    if items.is_empty() {
        return Ok(0);
    }
    let started = std::time::Instant::now();
    // The items' data is read back from the log in few large reads (neighbouring records
    // together): one small read per item, a batch of 4 KiB random writes cost thousands of
    // disk round trips and the drain could not keep up with the writers it makes room for.
    let data = oplog
        .read_drain_data(&items, DrainReadLimits::default())
        .await?;
    let mut batch = WriteBatch::new();
    for (item, data) in items.iter().zip(&data) {
        match data {
            DrainData::Data(bytes) => batch.write(item.offset, bytes),
            DrainData::Zero => batch.write_zeroes(item.offset, item.length),
            // Lost to corruption in the log: the blocks read as EIO until overwritten, and
            // the log can let go of the record (a bad record costs its own blocks only).
            DrainData::Lost(_) => batch.mark_lost(item.offset, item.length),
            DrainData::Rotted { bytes, lost } => {
                batch.write(item.offset, bytes);
                for error in lost {
                    tracing::error!(%error, "oplog data rotted since it was written: the range is recorded lost in the extent store");
                    if let Some((offset, length)) = error.lost_range() {
                        batch.mark_lost(offset, length);
                    }
                }
                &mut batch
            }
        };
    }
    let read = started.elapsed();
    // Durable when it returns; only then may the log forget the items.
    store.apply_journaled(&batch).await?;
    oplog.complete_drain(&items).await;
    tracing::debug!(
        items = items.len(),
        read_us = read.as_micros() as u64,
        total_us = started.elapsed().as_micros() as u64,
        "drain step"
    );
    Ok(items.len())
}

/// Drains every live oplog entry into the extent store, in steps of at most `step_bytes`
/// taken from the node's drain budget, then lets the log finish freeing its segments. Used
/// when a shard retires and when a node recovers oplogs left by a crash.
pub async fn drain_all(
    oplog: &Oplog<NodeFs>,
    store: &ExtentStore<NodeFs>,
    budget: &DrainBudget,
    step_bytes: u64,
) -> Result<(), String> {
    while !oplog.is_empty() {
        let allowance = budget.take(step_bytes).await;
        drain_batch(oplog, store, allowance.bytes())
            .await
            .map_err(|e| e.to_string())?;
    }
    oplog.idle().await;
    Ok(())
}

/// Removes an oplog directory (a drained or discarded log), durably.
pub async fn remove_oplog_dir(fs: &NodeFs, dir: &std::path::Path) -> Result<(), String> {
    remove_tree(fs, dir)
        .await
        .map_err(|e| format!("cannot remove {}: {e}", dir.display()))
}

/// Final act of a retiring shard: leave nothing behind that a successor must know about.
/// The drained log holds no live record, so removing it moves ownership with no data copied.
pub(super) async fn hand_over(
    storage: Rc<Storage>,
    fs: NodeFs,
    oplog_dir: std::path::PathBuf,
    discard: bool,
    (budget, step_bytes): (DrainBudget, u64),
) -> Result<(), String> {
    if discard {
        storage.oplog.idle().await;
    } else {
        drain_all(&storage.oplog, &storage.store, &budget, step_bytes).await?;
    }
    // The next owner of the ranges reads the tables: they must name every block in the log.
    storage
        .store
        .checkpoint()
        .await
        .map_err(|e| format!("checkpointing the block log: {e}"))?;
    // The next shard with this log id may own other ranges: it must find none of these blocks.
    storage
        .store
        .clean_own_log()
        .await
        .map_err(|e| format!("cleaning the block log: {e}"))?;
    storage.store.close_all();
    remove_oplog_dir(&fs, &oplog_dir).await
}

/// Reads of a resync chunk that found the log moved or a block mid-rewrite before it gives
/// up (each waits a little: a drain step may be rewriting the chunk's blocks).
const RESYNC_READ_ATTEMPTS: u32 = 8;

/// What one held chunk's resync did, and the blocks of this copy that failed their checks
/// (their content came from another copy; the controller then repairs them here).
pub(super) struct ChunkResynced {
    pub outcome: crate::replication::ChunkResync,
    pub damaged_blocks: Vec<u64>,
}

/// Reads the held chunk `range` of the vdisk and hands it to `replicator` (zeros as a zero
/// record), for an online resync. Blocks of this copy that keep failing their checks are
/// taken from another copy the replicator may repair from (`Replicator::fetch`): the
/// others then get them as that copy holds them, never a guess.
pub(super) async fn resync_chunk(
    storage: Rc<Storage>,
    vdisk: VdiskId,
    range: (u64, u64),
    replicator: Option<std::sync::Arc<Box<dyn crate::replication::Replicator>>>,
) -> Result<ChunkResynced, IoError> {
    let Some(replicator) = replicator else {
        return Err(IoError::Io(format!(
            "vdisk {vdisk}: no replicator is installed to resync its copies"
        )));
    };
    let (offset, length) = (range.0, range.1 - range.0);
    let (data, damaged_blocks) = match read_held(storage.clone(), vdisk, offset, length).await {
        Ok(data) => (data, Vec::new()),
        Err(ReadFailure::Corrupt(error)) => {
            tracing::warn!(%vdisk, offset, length, %error,
                "this copy failed its checksums in a chunk being resynced; taking those blocks from another copy");
            patch_from_copy(&storage, vdisk, offset, length, &**replicator).await?
        }
        Err(ReadFailure::LogMoved) => {
            return Err(IoError::Io(format!(
                "vdisk {vdisk}: the oplog kept changing under the resync read at {offset}"
            )))
        }
        Err(ReadFailure::Failed(error)) => return Err(error),
    };
    let content = if data.iter().all(|&b| b == 0) {
        crate::replication::ReplicaOp::Zero { offset, length }
    } else {
        crate::replication::ReplicaOp::Write { offset, data }
    };
    let outcome = replicator.resync(vdisk, content).await?;
    Ok(ChunkResynced {
        outcome,
        damaged_blocks,
    })
}

/// Reads a held range, again a few times while the log moves or a block looks corrupt (a
/// drain step may be rewriting it).
async fn read_held(
    storage: Rc<Storage>,
    vdisk: VdiskId,
    offset: u64,
    length: u64,
) -> Result<Bytes, ReadFailure> {
    let mut attempt = 1;
    loop {
        match read(storage.clone(), vdisk, offset, length).await {
            Ok(read) => return Ok(read.data),
            Err(ReadFailure::LogMoved | ReadFailure::Corrupt(_))
                if attempt < RESYNC_READ_ATTEMPTS =>
            {
                attempt += 1;
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
            Err(failure) => return Err(failure),
        }
    }
}

/// The held chunk with every block that fails its checks here replaced by the block as
/// another copy holds it; and those blocks' offsets. Blocks that read well stay this copy's
/// (the newest: this node owns the vdisk).
async fn patch_from_copy(
    storage: &Rc<Storage>,
    vdisk: VdiskId,
    offset: u64,
    length: u64,
    replicator: &dyn crate::replication::Replicator,
) -> Result<(Bytes, Vec<u64>), IoError> {
    let theirs = replicator.fetch(vdisk, offset, length).await.map_err(|e| {
        IoError::Io(format!(
            "vdisk {vdisk}: this copy is damaged at {offset} (+{length}) and no other copy could supply it: {e}"
        ))
    })?;
    if theirs.len() as u64 != length {
        return Err(IoError::Io(format!(
            "vdisk {vdisk}: another copy answered {} bytes for {length}",
            theirs.len()
        )));
    }
    let mut data = BytesMut::with_capacity(length as usize);
    let mut damaged = Vec::new();
    let mut block = offset;
    while block < offset + length {
        let block_length = BLOCK_SIZE_BYTES.min(offset + length - block);
        match read_held(storage.clone(), vdisk, block, block_length).await {
            Ok(mine) => data.extend_from_slice(&mine),
            Err(ReadFailure::Corrupt(_)) => {
                let at = (block - offset) as usize;
                data.extend_from_slice(&theirs[at..at + block_length as usize]);
                damaged.push(block);
            }
            Err(ReadFailure::LogMoved) => {
                return Err(IoError::Io(format!(
                    "vdisk {vdisk}: the oplog kept changing under the resync read at {block}"
                )))
            }
            Err(ReadFailure::Failed(error)) => return Err(error),
        }
        block += block_length;
    }
    Ok((data.freeze(), damaged))
}

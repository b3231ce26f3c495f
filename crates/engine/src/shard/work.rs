//! Storage work of a shard controller: futures over the shard's oplog and extent store that
//! the controller's loop runs and whose results it applies. None of them touches controller
//! state; each returns what it found or did.

use super::inline::block_range;
use super::{LogFs, Storage};
use ashlar_core::{BlockStatusRun, IoError, VdiskId, BLOCK_SIZE_BYTES, EXTENT_SIZE_BYTES};
use ashlar_storage::extent_store::{ExtentError, ExtentStore, WriteBatch};
use ashlar_storage::fs::NodeFs;
use ashlar_storage::oplog::{LogPiece, Oplog, OplogError, PieceSource};
use bytes::{Bytes, BytesMut};
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
    pub fills: Vec<(u64, Bytes)>,
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
    let mut buffer = BytesMut::zeroed(length as usize);
    let mut fills = Vec::new();
    for piece in storage.oplog.lookup(offset, length) {
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
        Err(OplogError::Corrupt {
            path,
            file_offset,
            reason,
        }) => {
            tracing::error!(vdisk = %vdisk, offset = piece.offset, path = %path.display(),
                file_offset, %reason, "checksum mismatch in the oplog");
            Err(ReadFailure::Failed(IoError::Io(format!(
                "checksum mismatch in oplog {} at {file_offset}",
                path.display()
            ))))
        }
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
    let mut whole = vec![0u8; ((blocks.end - blocks.start) * BLOCK_SIZE_BYTES) as usize];
    match storage.store.read(first_byte, &mut whole).await {
        Ok(()) => {}
        Err(error) if error.is_corruption() => {
            return Err(ReadFailure::Corrupt(store_error(vdisk, offset, error)))
        }
        Err(other) => return Err(ReadFailure::Failed(store_error(vdisk, offset, other))),
    }
    let skip = (offset - first_byte) as usize;
    slice.copy_from_slice(&whole[skip..skip + slice.len()]);
    Ok((blocks.start, Bytes::from(whole)))
}

/// Whether a write goes straight to the extent store: whole extents with nothing of the
/// range in the oplog (so no older log record can be drained over it later).
pub(super) fn bypasses_oplog(oplog: &Oplog<LogFs>, offset: u64, length: u64) -> bool {
    offset.is_multiple_of(EXTENT_SIZE_BYTES)
        && length.is_multiple_of(EXTENT_SIZE_BYTES)
        && length > 0
        && oplog
            .lookup(offset, length)
            .iter()
            .all(|p| matches!(p.source, PieceSource::Absent))
}

pub(super) async fn append_write(
    storage: Rc<Storage>,
    vdisk: VdiskId,
    offset: u64,
    data: Bytes,
) -> Result<(), IoError> {
    storage
        .oplog
        .write(offset, data)
        .await
        .map_err(|e| oplog_error(vdisk, offset, e))
}

pub(super) async fn append_zeroes(
    storage: Rc<Storage>,
    vdisk: VdiskId,
    offset: u64,
    length: u64,
) -> Result<(), IoError> {
    storage
        .oplog
        .write_zeroes(offset, length)
        .await
        .map_err(|e| oplog_error(vdisk, offset, e))
}

/// Large, extent-aligned writes skip the oplog: written in place, synced, then a barrier
/// record tells replay that older log records for the range are superseded.
pub(super) async fn write_bypass(
    storage: Rc<Storage>,
    vdisk: VdiskId,
    offset: u64,
    data: Bytes,
) -> Result<(), IoError> {
    // Durable when it returns: the barrier below must not reach the log before the data.
    storage
        .store
        .write(offset, &data)
        .await
        .map_err(|e| store_error(vdisk, offset, e))?;
    storage
        .oplog
        .barrier(offset, data.len() as u64)
        .await
        .map_err(|e| oplog_error(vdisk, offset, e))
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
            PieceSource::Data { .. } => push_run(&mut runs, piece.length, false),
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
    pub(super) fn is_no_space(&self) -> bool {
        matches!(
            self,
            DrainError::Oplog(OplogError::NoSpace { .. })
                | DrainError::Store(ExtentError::NoSpace { .. })
        )
    }
}

/// Moves about `max_bytes` of the oldest live oplog entries into the extent store, syncs it,
/// and lets the oplog free what it no longer needs. Returns how many entries moved.
pub(super) async fn drain_step(storage: Rc<Storage>, max_bytes: u64) -> Result<usize, DrainError> {
    drain_batch(&storage.oplog, &storage.store, max_bytes).await
}

async fn drain_batch(
    oplog: &Oplog<LogFs>,
    store: &ExtentStore<NodeFs>,
    max_bytes: u64,
) -> Result<usize, DrainError> {
    let items = oplog.drain_batch(max_bytes);
    if items.is_empty() {
        return Ok(0);
    }
    let mut data = Vec::with_capacity(items.len());
    for item in &items {
        data.push(if item.zero {
            None
        } else {
            Some(oplog.read_drain_item(item).await?)
        });
    }
    let mut batch = WriteBatch::new();
    for (item, bytes) in items.iter().zip(&data) {
        match bytes {
            Some(bytes) => batch.write(item.offset, bytes),
            None => batch.write_zeroes(item.offset, item.length),
        };
    }
    // Durable when it returns; only then may the log forget the items.
    store.apply(&batch).await?;
    oplog.complete_drain(&items).await?;
    Ok(items.len())
}

/// Drains every live oplog entry into the extent store and syncs it. Used when a shard
/// retires and when a node recovers oplogs left by a crash.
pub async fn drain_all(oplog: &Oplog<LogFs>, store: &ExtentStore<NodeFs>) -> Result<(), String> {
    while !oplog.is_empty() {
        drain_batch(oplog, store, u64::MAX)
            .await
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

pub fn remove_oplog_dir(dir: &std::path::Path) -> Result<(), String> {
    match std::fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(format!("cannot remove {}: {e}", dir.display())),
    }
}

/// Final act of a retiring shard: leave nothing behind that a successor must know about.
/// The drained log holds no live record, so removing it moves ownership with no data copied.
pub(super) async fn hand_over(
    storage: Rc<Storage>,
    oplog_dir: std::path::PathBuf,
    discard: bool,
) -> Result<(), String> {
    if !discard {
        drain_all(&storage.oplog, &storage.store).await?;
    }
    storage.store.sync().await.map_err(|e| e.to_string())?;
    storage.store.close_all();
    remove_oplog_dir(&oplog_dir)
}

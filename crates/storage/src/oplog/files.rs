//! The file and directory I/O of the log, all through [`Filesystem`] / [`DiskFile`]: listing
//! the directory, preparing a segment file, rewriting a segment header, writing a seal,
//! removing a file durably.

use super::buf::AlignedBuf;
use super::error::{io_error, OplogError};
use super::format::{
    self, BatchHeader, SegmentHeader, SegmentState, BLOCK_BYTES, SEGMENT_HEADER_BYTES,
};
use super::state::{FileHandle, Handle};
use super::OplogConfig;
use crate::fs::{DiskBuf, DiskFile, Filesystem};
use std::io;
use std::path::{Path, PathBuf};

/// Zeros are written in pieces of this size when a segment file is prepared.
const ZERO_FILL_BYTES: u64 = 1 << 20;

/// The log's files in a directory listing.
pub(super) struct Listing {
    /// Version 3 segment files as (serial, path), by serial.
    pub segments: Vec<(u64, PathBuf)>,
    /// Files named like version 1/2 segments or spares.
    pub legacy: Vec<String>,
}

pub(super) async fn list<F: Filesystem>(fs: &F, dir: &Path) -> Result<Listing, OplogError> {
    let entries = fs.list_dir(dir).await.map_err(|e| io_error(dir, e))?;
    let mut listing = Listing {
        segments: Vec::new(),
        legacy: Vec::new(),
    };
    for entry in entries {
        if entry.is_dir {
            tracing::warn!(path = %dir.join(&entry.name).display(), "ignoring a directory in the oplog directory");
        } else if let Some(serial) = format::parse_segment_name(&entry.name) {
            listing.segments.push((serial, dir.join(&entry.name)));
        } else if super::legacy::is_legacy_name(&entry.name) {
            listing.legacy.push(entry.name);
        } else {
            tracing::warn!(path = %dir.join(&entry.name).display(), "ignoring a file that is not an oplog segment");
        }
    }
    listing.segments.sort_unstable_by_key(|(serial, _)| *serial);
    Ok(listing)
}

/// Creates segment file `serial` and makes it ready to hold batches without any later write
/// changing filesystem metadata: its blocks are allocated and written (zeros) once, both
/// header slots say "spare", and the data and the directory entry are durable. On error the
/// file is removed again (best effort).
pub(super) async fn prepare<F: Filesystem>(
    fs: F,
    config: OplogConfig,
    serial: u64,
    header: SegmentHeader,
) -> Result<Handle<F::File>, (PathBuf, io::Error)> {
    let path = format::segment_path(&config.dir, serial);
    match prepare_file(&fs, &config, &path, header).await {
        Ok(handle) => Ok(handle),
        Err(error) => {
            if let Err(cleanup) = fs.remove_file(&path).await {
                if cleanup.kind() != io::ErrorKind::NotFound {
                    tracing::warn!(path = %path.display(), error = %cleanup, "cannot remove a segment file whose preparation failed");
                }
            }
            Err((path, error))
        }
    }
}

async fn prepare_file<F: Filesystem>(
    fs: &F,
    config: &OplogConfig,
    path: &Path,
    header: SegmentHeader,
) -> io::Result<Handle<F::File>> {
    let file = fs.open(path, true).await?;
    match file.allocate(0, config.segment_bytes).await {
        // Some filesystems cannot preallocate; the zero fill below allocates the blocks.
        Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {}
        other => other?,
    }
    // Written from the buffer itself (`write_from`): copying 1 MiB of zeros into a bounce
    // buffer per write was most of a segment's preparation, 8 % of the node's time while the
    // log grows under 4 KiB writes at QD1.
    let fill_bytes = ZERO_FILL_BYTES
        .min(config.segment_bytes)
        .div_ceil(BLOCK_BYTES)
        * BLOCK_BYTES;
    let zeros = DiskBuf::zeroed(fill_bytes as usize).into_bytes();
    let mut at = SEGMENT_HEADER_BYTES;
    while at < config.segment_bytes {
        let n = (config.segment_bytes - at).min(zeros.len() as u64);
        file.write_from(zeros.slice(..n as usize), at, false)
            .await?;
        at += n;
    }
    let mut slots = AlignedBuf::zeroed(SEGMENT_HEADER_BYTES);
    let block = header.encode();
    slots.as_mut_slice()[..BLOCK_BYTES as usize].copy_from_slice(&block);
    slots.as_mut_slice()[BLOCK_BYTES as usize..].copy_from_slice(&block);
    file.write_at(slots.as_slice(), 0).await?;
    file.sync_data().await?;
    fs.sync_dir(&config.dir).await?;
    Ok(FileHandle::new(file, path.to_path_buf(), header.generation))
}

/// Rewrites both header slots, slot 1 first, each durable before the next: a crash or a
/// rotted block leaves at least one slot valid, holding either the old or the new header.
pub(super) async fn write_header<F: DiskFile>(file: &F, header: &SegmentHeader) -> io::Result<()> {
    let mut block = AlignedBuf::zeroed(BLOCK_BYTES);
    block.as_mut_slice().copy_from_slice(&header.encode());
    file.write_durable_at(block.as_slice(), BLOCK_BYTES).await?;
    file.write_durable_at(block.as_slice(), 0).await
}

/// Rewrites one header slot (a repair at open), durably.
pub(super) async fn write_header_slot<F: DiskFile>(
    file: &F,
    slot: u64,
    header: &SegmentHeader,
) -> io::Result<()> {
    let mut block = AlignedBuf::zeroed(BLOCK_BYTES);
    block.as_mut_slice().copy_from_slice(&header.encode());
    file.write_durable_at(block.as_slice(), slot * BLOCK_BYTES)
        .await
}

/// The block of a seal.
pub(super) fn seal_block(header: &BatchHeader) -> AlignedBuf {
    assert!(header.seal && header.count == 0 && u64::from(header.bytes) == BLOCK_BYTES);
    let mut bytes = Vec::with_capacity(format::BATCH_FIXED_BYTES as usize);
    header.encode(&[], &mut bytes);
    let mut block = AlignedBuf::zeroed(BLOCK_BYTES);
    block.as_mut_slice()[..bytes.len()].copy_from_slice(&bytes);
    block
}

/// Removes a file and makes the removal durable. `Ok` if it is already gone.
pub(super) async fn remove_durably<F: Filesystem>(
    fs: &F,
    dir: &Path,
    path: &Path,
) -> io::Result<()> {
    match fs.remove_file(path).await {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    }
    fs.sync_dir(dir).await
}

/// A spare header for a file that last held `segment_id`, with the current floors.
pub(super) fn spare_header(
    config: &OplogConfig,
    generation: u64,
    segment_id: u64,
    seq_floor: u64,
    batch_floor: u64,
) -> SegmentHeader {
    SegmentHeader {
        state: SegmentState::Spare,
        log_id: config.log_id,
        generation,
        segment_id,
        seq_floor,
        batch_floor,
    }
}

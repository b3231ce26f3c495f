//! Checksum-verified reads of record payloads.

use super::error::io_error;
use super::format::{verify_chunks, CHUNK_BYTES};
use super::index::DataLoc;
use super::state::ReadGuard;
use super::{Inner, OplogError, SegmentId, Seq};
use crate::fs::{DiskFile, Filesystem};

impl<F: Filesystem> Inner<F> {
    /// Fills `buf` with the record's bytes for vdisk range `[offset, offset + buf.len())`.
    /// Reads the whole chunks enclosing the range and checks each against its CRC32C, so no
    /// unverified byte is returned.
    pub(super) async fn read_data(
        &self,
        segment: SegmentId,
        seq: Seq,
        data: &DataLoc,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<(), OplogError> {
        let length = buf.len() as u64;
        let record_end = data.record_offset + data.record_length;
        if offset < data.record_offset || offset.saturating_add(length) > record_end {
            return Err(OplogError::InvalidRange { offset, length });
        }
        if length == 0 {
            return Ok(());
        }
        let Some(handle) = self.state.borrow().handle(segment) else {
            return Err(OplogError::Stale { offset, length });
        };
        // Held across the reads: the file is not reused while they run.
        let guard = ReadGuard::new(handle, self.wakers.clone());
        let (file, path) = (&guard.handle.file, &guard.handle.path);
        let start = offset - data.record_offset;
        let end = start + length;
        let first_chunk = start / CHUNK_BYTES;
        let end_chunk = end.div_ceil(CHUNK_BYTES);
        let chunk_bytes_start = first_chunk * CHUNK_BYTES;
        let chunk_bytes_end = (end_chunk * CHUNK_BYTES).min(data.record_length);

        let mut crcs = vec![0u8; ((end_chunk - first_chunk) * 4) as usize];
        file.read_at(&mut crcs, data.crcs_at + first_chunk * 4)
            .await
            .map_err(|e| io_error(path, e))?;
        let mut chunks = vec![0u8; (chunk_bytes_end - chunk_bytes_start) as usize];
        file.read_at(&mut chunks, data.payload_at + chunk_bytes_start)
            .await
            .map_err(|e| io_error(path, e))?;

        if let Err(bad) = verify_chunks(&crcs, &chunks, first_chunk) {
            return Err(OplogError::ChecksumMismatch {
                offset,
                length,
                path: path.clone(),
                file_offset: data.payload_at + bad * CHUNK_BYTES,
                reason: format!(
                    "payload chunk {bad} of record {seq} (vdisk offset {}) fails its CRC32C",
                    data.record_offset
                ),
            });
        }
        let skip = (start - chunk_bytes_start) as usize;
        buf.copy_from_slice(&chunks[skip..skip + buf.len()]);
        Ok(())
    }
}

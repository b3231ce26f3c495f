//! Checksum-verified reads of record payloads.

use super::error::io_error;
use super::format::{crcs_start, payload_start, verify_chunks, CHUNK_BYTES};
use super::index::DataLoc;
use super::{Inner, OplogError};
use crate::disk::{FileIo, FileOpener};

impl<O: FileOpener> Inner<O> {
    /// Fills `buf` with the record's bytes for vdisk range `[offset, offset + buf.len())`.
    /// Reads the whole chunks enclosing the range and checks each against its CRC32C, so no
    /// unverified byte is returned.
    pub(super) async fn read_data(
        &self,
        segment: u64,
        seq: u64,
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
        let Some((file, path)) = self.state.borrow().file(segment) else {
            return Err(OplogError::Stale { offset, length });
        };
        let start = offset - data.record_offset;
        let end = start + length;
        let first_chunk = start / CHUNK_BYTES;
        let end_chunk = end.div_ceil(CHUNK_BYTES);
        let chunk_bytes_start = first_chunk * CHUNK_BYTES;
        let chunk_bytes_end = (end_chunk * CHUNK_BYTES).min(data.record_length);

        let mut crcs = vec![0u8; ((end_chunk - first_chunk) * 4) as usize];
        let crcs_at = data.file_offset + crcs_start() + first_chunk * 4;
        file.read_at(&mut crcs, crcs_at)
            .await
            .map_err(|e| io_error(&path, e))?;
        let mut chunks = vec![0u8; (chunk_bytes_end - chunk_bytes_start) as usize];
        let payload_at = data.file_offset + payload_start(data.chunks) + chunk_bytes_start;
        file.read_at(&mut chunks, payload_at)
            .await
            .map_err(|e| io_error(&path, e))?;

        if let Err(bad) = verify_chunks(&crcs, &chunks, first_chunk) {
            return Err(OplogError::Corrupt {
                path,
                file_offset: data.file_offset + payload_start(data.chunks) + bad * CHUNK_BYTES,
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

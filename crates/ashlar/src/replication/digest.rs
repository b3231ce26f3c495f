//! What a copy holds, chunk by chunk: a resync compares digests and sends only the 1 MiB
//! chunks that differ, so a copy that was briefly away (or a node that held the vdisk before)
//! gets what it missed and not the whole vdisk again.

use super::receiver::remote;
use super::resync::{read_chunk, RESYNC_CHUNK_BYTES};
use super::wire::{encode_digests, ChunkDigest, FAILED_CODE, MALFORMED_CODE};
use crate::registry::NodeEngine;
use ashlar_core::VdiskId;
use ashlar_engine::replication::ReplicaOp;
use ashlar_transport::RemoteError;
use bytes::Bytes;
use sha2::{Digest, Sha256};
use std::sync::atomic::Ordering;

/// The most a digest request may cover: what the copy reads (and holds in memory) to answer.
pub const DIGEST_REQUEST_MAX_BYTES: u64 = 16 * RESYNC_CHUNK_BYTES;

/// The digest of a chunk read as a record (its data, or zeros).
pub fn digest_of(op: &ReplicaOp) -> ChunkDigest {
    match op {
        ReplicaOp::Zero { .. } => ChunkDigest::Zeros,
        ReplicaOp::Write { data, .. } => ChunkDigest::Data(Sha256::digest(data).into()),
    }
}

/// Answers a digest request for `[offset, offset + length)` of this node's copy, read below
/// its serving gate: it holds every record this copy acknowledged (the fence of the claim
/// waited for older owners' records). A chunk that cannot be read is `Unreadable`, so the
/// claimant sends it again (which also repairs it).
pub async fn serve(
    engine: &NodeEngine,
    vdisk: VdiskId,
    offset: u64,
    length: u64,
) -> Result<Bytes, RemoteError> {
    let failed = |e: String| remote(FAILED_CODE, format!("vdisk {vdisk}: {e}"));
    let shared = engine
        .replica_target(vdisk)
        .await
        .map_err(|e| failed(e.to_string()))?;
    let size = shared.size_bytes.load(Ordering::Relaxed);
    let valid = offset.is_multiple_of(RESYNC_CHUNK_BYTES)
        && length > 0
        && length <= DIGEST_REQUEST_MAX_BYTES
        && offset.checked_add(length).is_some_and(|end| end <= size);
    if !valid {
        return Err(remote(
            MALFORMED_CODE,
            format!(
                "vdisk {vdisk}: digest request [{offset}, +{length}) is not chunk-aligned, \
                 longer than {DIGEST_REQUEST_MAX_BYTES} bytes or outside the vdisk's {size} bytes"
            ),
        ));
    }
    let reads = (0..length.div_ceil(RESYNC_CHUNK_BYTES)).map(|index| {
        let chunk_offset = offset + index * RESYNC_CHUNK_BYTES;
        let chunk_length = RESYNC_CHUNK_BYTES.min(offset + length - chunk_offset);
        let shared = shared.clone();
        async move {
            match read_chunk(&shared, chunk_offset, chunk_length).await {
                Ok(op) => digest_of(&op),
                Err(error) => {
                    tracing::warn!(%vdisk, offset = chunk_offset, %error,
                        "a chunk of this copy is unreadable; the resync will send it again");
                    ChunkDigest::Unreadable
                }
            }
        }
    });
    let digests = futures_util::future::join_all(reads).await;
    Ok(encode_digests(&digests))
}

//! Making the other copies equal to this node's before it serves a replicated vdisk.
//!
//! Every claim of a replicated vdisk (a first claim, a claim again after a restart or a lapsed
//! lease, a takeover from a dead owner) may find copies that differ: records the last owner
//! had sent when it stopped reached some copies and not others, and a copy put in place of a
//! dead node holds nothing. The claimant holds every acknowledged write, so, with its gate
//! still shut (no client write can race), it sends its whole content to every other copy as
//! one stream of records: 1 MiB at a time, a range of zeros as a zero record (cheap for the
//! thin parts), several in flight. Copies apply the stream in order like any other.
//!
//! This costs a read of the vdisk per claim; sending only the ranges the last owner's
//! unfinished records touched is the next refinement.

use super::peers::Peer;
use super::sender::replica_error;
use super::wire::{self, Message};
use super::REPLICA_TIMEOUT;
use ashlar_cluster::ResyncRecord;
use ashlar_core::VdiskId;
use ashlar_engine::replication::{ReplicaOp, ReplicaRecord};
use ashlar_engine::shard::{ShardOp, ShardReply};
use ashlar_engine::vdisk::VdiskShared;
use ashlar_meta::MetaStore;
use bytes::{Bytes, BytesMut};
use futures_util::stream::{self, StreamExt, TryStreamExt};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The stream id of a resync (shard controllers' streams are their shard-map epochs, which
/// never get near it).
pub const RESYNC_STREAM: u64 = u64::MAX;
/// Bytes per resync record.
pub const RESYNC_CHUNK_BYTES: u64 = 1 << 20;
/// Resync records read and in flight at once.
pub const RESYNC_CHUNKS_IN_FLIGHT: usize = 8;

/// Sends the vdisk's whole content to `peers` at ownership `epoch`; returns the bytes of
/// data (not zeros) sent to each. `done` counts the bytes of the vdisk gone through.
pub async fn resync(
    shared: Arc<VdiskShared>,
    vdisk: VdiskId,
    epoch: u64,
    peers: &[Arc<Peer>],
    done: &AtomicU64,
) -> Result<u64, String> {
    if peers.is_empty() {
        return Ok(0);
    }
    let size = shared.size_bytes.load(Ordering::Relaxed);
    let chunks = size.div_ceil(RESYNC_CHUNK_BYTES);
    let sent = stream::iter(0..chunks)
        .map(|index| {
            let shared = shared.clone();
            async move {
                let offset = index * RESYNC_CHUNK_BYTES;
                let length = RESYNC_CHUNK_BYTES.min(size - offset);
                let op = read_chunk(&shared, offset, length).await?;
                let data_bytes = match &op {
                    ReplicaOp::Write { data, .. } => data.len() as u64,
                    ReplicaOp::Zero { .. } => 0,
                };
                let record = ReplicaRecord {
                    vdisk,
                    shard: 0,
                    stream: RESYNC_STREAM,
                    seq: index + 1,
                    prev_seq: index,
                    op,
                };
                let payload = wire::encode(&Message::Record { epoch, record });
                let calls = peers.iter().map(|peer| {
                    let payload = payload.clone();
                    async move {
                        peer.call(payload, REPLICA_TIMEOUT)
                            .await
                            .map_err(|e| replica_error(peer.node(), vdisk, e).to_string())
                    }
                });
                for result in futures_util::future::join_all(calls).await {
                    result?;
                }
                done.fetch_add(length, Ordering::Relaxed);
                Ok::<u64, String>(data_bytes)
            }
        })
        .buffer_unordered(RESYNC_CHUNKS_IN_FLIGHT)
        .try_fold(0u64, |total, bytes| async move { Ok(total + bytes) })
        .await?;
    Ok(sent)
}

/// The chunk as a record: its data, or a zero record when it reads as zeros.
async fn read_chunk(shared: &VdiskShared, offset: u64, length: u64) -> Result<ReplicaOp, String> {
    let replies = shared
        .call_split(offset, length, |o, l| ShardOp::Read {
            offset: o,
            length: l,
        })
        .await
        .map_err(|e| format!("reading the local copy at {offset} to resync the others: {e}"))?;
    let mut data = BytesMut::with_capacity(length as usize);
    for reply in replies {
        match reply {
            ShardReply::Data(bytes) => data.extend_from_slice(&bytes),
            other => return Err(format!("unexpected shard reply to a read: {other:?}")),
        }
    }
    let data: Bytes = data.freeze();
    if data.iter().all(|&b| b == 0) {
        return Ok(ReplicaOp::Zero { offset, length });
    }
    Ok(ReplicaOp::Write { offset, data })
}

/// Keeps the vdisk's resync record in etcd up to date (about once a second) for `cluster
/// status` until `stop` is notified, then deletes it. An update is never cut short, so no
/// late write can bring the record back after the delete.
pub async fn publish_progress<M: MetaStore>(
    meta: M,
    mut record: ResyncRecord,
    done: Arc<AtomicU64>,
    stop: Arc<tokio::sync::Notify>,
) {
    let key = ashlar_cluster::keys::resync_key(record.vdisk);
    loop {
        record.done_bytes = done.load(Ordering::Relaxed);
        record.updated_unix_ms = unix_ms();
        // Progress is advisory: a failed update is retried at the next tick.
        let _ = meta
            .put(key.clone(), ashlar_cluster::record::encode(&record), None)
            .await;
        tokio::select! {
            () = stop.notified() => break,
            () = tokio::time::sleep(PROGRESS_INTERVAL) => {}
        }
    }
    forget_progress(&meta, record.vdisk).await;
}

/// Deletes the vdisk's resync record (the resync ended, well or not).
async fn forget_progress<M: MetaStore>(meta: &M, vdisk: VdiskId) {
    let key = ashlar_cluster::keys::resync_key(vdisk);
    if let Err(error) = meta.delete(ashlar_meta::KeyRange::key(key)).await {
        tracing::warn!(%vdisk, %error, "could not delete the finished resync's progress record");
    }
}

/// How often a resync's progress record is updated.
pub const PROGRESS_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

//! Making the other copies equal to this node's before it serves a replicated vdisk.
//!
//! Every claim of a replicated vdisk (a first claim, a claim again after a restart or a lapsed
//! lease, a takeover from a dead owner) may find copies that differ: records the last owner
//! had sent when it stopped reached some copies and not others, a copy that restarted missed
//! what was written meanwhile, and a copy put in place of a dead node holds nothing. The
//! claimant holds every acknowledged write, so, with its gate still shut (no client write can
//! race), it compares its content with every other copy's, 1 MiB chunk by chunk (a digest
//! request per window of chunks: zeros, the chunk's SHA-256, or unreadable), and sends each
//! copy the chunks where it differs as one stream of records (a chunk of zeros as a zero
//! record). Copies apply the stream in order like any other. A copy that was away briefly
//! gets what it missed, not the whole vdisk; both sides still read their whole copy (holes
//! cost no disk read), unless the claim may catch up (`catch_up`): then only the chunks
//! that failed writes touched are compared.

use super::digest::digest_of;
use super::pacer::{ClientSample, Pacer, Pacing, CLIENT_ACTIVITY_WINDOW};
use super::peers::Peer;
use super::sender::replica_error;
use super::wire::{self, ChunkDigest, Message};
use super::REPLICA_TIMEOUT;
use ashlar_cluster::ResyncRecord;
use ashlar_core::VdiskId;
use ashlar_engine::replication::{ChunkResync, ReplicaOp, ReplicaRecord};
use ashlar_engine::shard::{ShardOp, ShardReply};
use ashlar_engine::vdisk::VdiskShared;
use ashlar_meta::MetaStore;
use bytes::{Bytes, BytesMut};
use futures_util::stream::{self, StreamExt, TryStreamExt};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// The stream id of a resync (shard controllers' streams are their shard-map epochs, which
/// never get near it).
pub const RESYNC_STREAM: u64 = u64::MAX;
/// Bytes per resync record, and per chunk digest: the chunk shards track failed writes in.
pub const RESYNC_CHUNK_BYTES: u64 = ashlar_engine::shard::UNREPLICATED_CHUNK_BYTES;
/// Chunks compared per digest request (and read at once on each side).
pub const RESYNC_WINDOW_CHUNKS: u64 = 8;
/// Windows compared and sent at once: the claimant holds at most this many windows of its
/// own data (2 × 8 MiB).
pub const RESYNC_WINDOWS_IN_FLIGHT: usize = 2;
/// How long a copy may take to read and digest one window.
pub const DIGEST_TIMEOUT: Duration = Duration::from_secs(30);

/// What a resync did, summed over the copies it brought up to date.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ResyncSummary {
    /// Chunks sent (they differed).
    pub chunks_sent: u64,
    /// Chunks the copy already held.
    pub chunks_same: u64,
    /// Bytes of data (not zeros) sent.
    pub data_bytes: u64,
}

impl ResyncSummary {
    fn add(self, other: ResyncSummary) -> ResyncSummary {
        ResyncSummary {
            chunks_sent: self.chunks_sent + other.chunks_sent,
            chunks_same: self.chunks_same + other.chunks_same,
            data_bytes: self.data_bytes + other.data_bytes,
        }
    }
}

/// One copy being brought up to date: its connection and the last seq of its resync stream
/// at this epoch (each copy gets only its own differing chunks, numbered without gaps).
pub struct Target {
    peer: Arc<Peer>,
    last_seq: AtomicU64,
}

impl Target {
    pub fn new(peer: Arc<Peer>) -> Target {
        Target {
            peer,
            last_seq: AtomicU64::new(0),
        }
    }

    /// Sends `op` to this copy as the next record of its resync stream at `epoch`.
    async fn send(&self, vdisk: VdiskId, epoch: u64, op: ReplicaOp) -> Result<(), String> {
        let seq = self.last_seq.fetch_add(1, Ordering::Relaxed) + 1;
        let record = ReplicaRecord {
            vdisk,
            shard: 0,
            stream: RESYNC_STREAM,
            seq,
            prev_seq: seq - 1,
            op,
        };
        let payload = wire::encode(&Message::Record { epoch, record });
        self.peer
            .call(payload, REPLICA_TIMEOUT)
            .await
            .map(|_| ())
            .map_err(|e| replica_error(self.peer.node(), vdisk, e).to_string())
    }

    /// The copy's digests of the chunks of `[offset, offset + length)`.
    async fn digests(
        &self,
        vdisk: VdiskId,
        epoch: u64,
        offset: u64,
        length: u64,
    ) -> Result<Vec<ChunkDigest>, String> {
        let request = wire::encode(&Message::Digest {
            vdisk,
            epoch,
            offset,
            length,
        });
        let node = self.peer.node();
        let answer = self
            .peer
            .call(request, DIGEST_TIMEOUT)
            .await
            .map_err(|e| replica_error(node, vdisk, e).to_string())?;
        wire::decode_digests(&answer, length.div_ceil(RESYNC_CHUNK_BYTES) as usize)
            .map_err(|e| format!("node {node} answered a digest request for vdisk {vdisk}: {e}"))
    }
}

/// Makes every copy of `targets` hold `content` (one chunk as this node holds it) where it
/// differs: the online resync of one chunk, which the shard runs with the chunk held still.
pub async fn sync_chunk(
    targets: &[Target],
    vdisk: VdiskId,
    epoch: u64,
    content: ReplicaOp,
) -> Result<ChunkResync, String> {
    let (offset, length) = content.range();
    let mine = digest_of(&content);
    let data_bytes = match &content {
        ReplicaOp::Write { data, .. } => data.len() as u64,
        ReplicaOp::Zero { .. } => 0,
    };
    let per_copy = targets.iter().map(|target| {
        let content = content.clone();
        async move {
            let held = target.digests(vdisk, epoch, offset, length).await?;
            if held == [mine] {
                return Ok(false);
            }
            target.send(vdisk, epoch, content).await?;
            Ok::<_, String>(true)
        }
    });
    let mut outcome = ChunkResync::default();
    for sent in futures_util::future::try_join_all(per_copy).await? {
        if sent {
            outcome.copies_sent += 1;
            outcome.data_bytes += data_bytes;
        } else {
            outcome.copies_same += 1;
        }
    }
    Ok(outcome)
}

/// Makes every copy in `peers` hold this node's content of the vdisk at ownership `epoch`,
/// with the vdisk still (no write can race: the gate is shut, or it is not served here).
/// `done` counts the bytes of the vdisk gone through.
pub async fn resync(
    shared: Arc<VdiskShared>,
    vdisk: VdiskId,
    epoch: u64,
    peers: &[Arc<Peer>],
    done: &AtomicU64,
) -> Result<ResyncSummary, String> {
    if peers.is_empty() {
        return Ok(ResyncSummary::default());
    }
    let targets: Vec<Target> = peers.iter().cloned().map(Target::new).collect();
    let size = shared.size_bytes.load(Ordering::Relaxed);
    let window_bytes = RESYNC_WINDOW_CHUNKS * RESYNC_CHUNK_BYTES;
    let windows = size.div_ceil(window_bytes);
    stream::iter(0..windows)
        .map(|index| {
            let offset = index * window_bytes;
            let length = window_bytes.min(size - offset);
            let window = Window {
                shared: &shared,
                vdisk,
                epoch,
                offset,
                length,
            };
            let targets = &targets;
            async move {
                let summary = window.sync(targets).await?;
                done.fetch_add(length, Ordering::Relaxed);
                Ok::<_, String>(summary)
            }
        })
        .buffered(RESYNC_WINDOWS_IN_FLIGHT)
        .try_fold(ResyncSummary::default(), |total, summary| async move {
            Ok(total.add(summary))
        })
        .await
}

/// Chunks of an online resync held and compared at once: client writes to these chunks wait
/// for their resync (a few milliseconds each); writes elsewhere go on.
pub const ONLINE_RESYNC_CHUNKS_IN_FLIGHT: usize = 4;

/// The chunks an online resync goes through: all of the vdisk, or (a catch-up) those that
/// failed writes touched.
pub struct ResyncChunks {
    size_bytes: u64,
    only: Option<Vec<u64>>,
}

impl ResyncChunks {
    /// Every chunk of a vdisk of `size_bytes`, or only the (sorted) `only` ones inside it.
    pub fn new(size_bytes: u64, only: Option<Vec<u64>>) -> ResyncChunks {
        let count = size_bytes.div_ceil(RESYNC_CHUNK_BYTES);
        let only = only.map(|mut chunks| {
            chunks.retain(|&chunk| chunk < count);
            chunks
        });
        ResyncChunks { size_bytes, only }
    }

    pub fn is_catch_up(&self) -> bool {
        self.only.is_some()
    }

    /// (offset, length) of each chunk, in order (lazily: a whole vdisk has many).
    fn ranges(&self) -> impl Iterator<Item = (u64, u64)> + Send + '_ {
        let size_bytes = self.size_bytes;
        let range = move |index: u64| {
            let offset = index * RESYNC_CHUNK_BYTES;
            (offset, RESYNC_CHUNK_BYTES.min(size_bytes - offset))
        };
        let every = self
            .only
            .is_none()
            .then_some(0..size_bytes.div_ceil(RESYNC_CHUNK_BYTES));
        let only = self.only.iter().flatten().copied();
        every.into_iter().flatten().chain(only).map(range)
    }

    /// Bytes of the vdisk the resync goes through.
    pub fn bytes(&self) -> u64 {
        match &self.only {
            Some(_) => self.ranges().map(|(_, length)| length).sum(),
            None => self.size_bytes,
        }
    }
}

/// The online resync of a vdisk that serves: each 1 MiB chunk of `chunks` in turn is held
/// still by its shard (`ShardOp::ResyncChunk`), compared with every copy's and sent where it differs
/// (the installed replicator's `sync_chunk`), paced by a [`Pacer`] at `busy_rate` bytes per
/// second while clients use the vdisk. `done` counts the bytes gone through.
pub async fn resync_online(
    shared: &VdiskShared,
    chunks: ResyncChunks,
    done: &AtomicU64,
    pacing: Pacing,
) -> Result<ResyncSummary, String> {
    let pacer = std::sync::Mutex::new(Pacer::new(pacing, client_sample(shared), Instant::now()));
    let pacer = &pacer;
    stream::iter(chunks.ranges())
        .map(|(offset, length)| async move {
            wait_turn(pacer, shared, length).await;
            let replies = shared
                .call_split(offset, length, |o, l| ShardOp::ResyncChunk {
                    offset: o,
                    length: l,
                })
                .await
                .map_err(|e| format!("resyncing the chunk at {offset}: {e}"))?;
            let mut summary = ResyncSummary::default();
            for reply in replies {
                let ShardReply::Resynced(chunk) = reply else {
                    return Err(format!("unexpected shard reply to a resync: {reply:?}"));
                };
                summary.chunks_sent += u64::from(chunk.copies_sent);
                summary.chunks_same += u64::from(chunk.copies_same);
                summary.data_bytes += chunk.data_bytes;
            }
            done.fetch_add(length, Ordering::Relaxed);
            Ok(summary)
        })
        .buffer_unordered(ONLINE_RESYNC_CHUNKS_IN_FLIGHT)
        .try_fold(ResyncSummary::default(), |total, summary| async move {
            Ok(total.add(summary))
        })
        .await
}

/// The vdisk's client I/O so far.
fn client_sample(shared: &VdiskShared) -> ClientSample {
    let counters = &shared.counters;
    ClientSample {
        ops: counters.read_ops.load(Ordering::Relaxed) + counters.write_ops.load(Ordering::Relaxed),
        latency_nanos: counters.latency_nanos.load(Ordering::Relaxed),
    }
}

/// Waits until the pacer lets a chunk of `length` bytes start. Asks again at least once a
/// window while it waits: the pacer's view of the clients moves on meanwhile (a probe may
/// start or end).
async fn wait_turn(pacer: &std::sync::Mutex<Pacer>, shared: &VdiskShared, length: u64) {
    loop {
        let now = Instant::now();
        let wait = {
            let mut pacer = pacer.lock().unwrap_or_else(|p| p.into_inner());
            pacer.observe(client_sample(shared), now);
            let wait = pacer.wait(now);
            if wait.is_zero() {
                pacer.started(length, now);
            }
            wait
        };
        if wait.is_zero() {
            return;
        }
        tokio::time::sleep(wait.min(CLIENT_ACTIVITY_WINDOW)).await;
    }
}

/// A run of chunks compared with one digest request per copy.
struct Window<'a> {
    shared: &'a Arc<VdiskShared>,
    vdisk: VdiskId,
    epoch: u64,
    offset: u64,
    length: u64,
}

impl Window<'_> {
    async fn sync(&self, targets: &[Target]) -> Result<ResyncSummary, String> {
        let chunk_count = self.length.div_ceil(RESYNC_CHUNK_BYTES);
        let reads = (0..chunk_count).map(|index| {
            let offset = self.offset + index * RESYNC_CHUNK_BYTES;
            let length = RESYNC_CHUNK_BYTES.min(self.offset + self.length - offset);
            read_chunk(self.shared, offset, length)
        });
        let asks = targets
            .iter()
            .map(|target| target.digests(self.vdisk, self.epoch, self.offset, self.length));
        let (own, theirs) = futures_util::future::join(
            futures_util::future::try_join_all(reads),
            futures_util::future::try_join_all(asks),
        )
        .await;
        let (own, theirs) = (own?, theirs?);
        let own_digests: Vec<ChunkDigest> = own.iter().map(digest_of).collect();
        let mut summary = ResyncSummary::default();
        let mut sends = Vec::new();
        for (target, digests) in targets.iter().zip(&theirs) {
            for ((op, mine), held) in own.iter().zip(&own_digests).zip(digests) {
                if mine == held {
                    summary.chunks_same += 1;
                    continue;
                }
                summary.chunks_sent += 1;
                if let ReplicaOp::Write { data, .. } = op {
                    summary.data_bytes += data.len() as u64;
                }
                sends.push(target.send(self.vdisk, self.epoch, op.clone()));
            }
        }
        futures_util::future::try_join_all(sends).await?;
        Ok(summary)
    }
}

/// The chunk as a record: its data, or a zero record when it reads as zeros.
pub async fn read_chunk(
    shared: &VdiskShared,
    offset: u64,
    length: u64,
) -> Result<ReplicaOp, String> {
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
/// status` until `stop` says how the resync ended: completed, the record is deleted; failed,
/// it stays (the copies are not in sync: the vdisk shows as rebuilding until the claim that
/// follows replaces the record). An update is never cut short, so no late write can bring
/// the record back after the delete.
pub async fn publish_progress<M: MetaStore>(
    meta: M,
    mut record: ResyncRecord,
    done: Arc<AtomicU64>,
    mut stop: tokio::sync::oneshot::Receiver<bool>,
) {
    let completed = loop {
        record.done_bytes = done.load(Ordering::Relaxed);
        record.updated_unix_ms = unix_ms();
        put_progress(&meta, &record).await;
        tokio::select! {
            completed = &mut stop => break completed.unwrap_or(false),
            () = tokio::time::sleep(PROGRESS_INTERVAL) => {}
        }
    };
    if completed {
        forget_progress(&meta, record.vdisk).await;
    }
}

/// Writes the vdisk's resync record. Progress is advisory: a failed write is retried at the
/// next tick.
pub async fn put_progress<M: MetaStore>(meta: &M, record: &ResyncRecord) {
    let key = ashlar_cluster::keys::resync_key(record.vdisk);
    let _ = meta
        .put(key, ashlar_cluster::record::encode(record), None)
        .await;
}

/// Deletes the vdisk's resync record (its resync completed, or the vdisk was deleted).
pub async fn forget_progress<M: MetaStore>(meta: &M, vdisk: VdiskId) {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_catch_up_goes_through_its_chunks_only_and_the_last_one_may_be_short() {
        let mib = RESYNC_CHUNK_BYTES;
        let all = ResyncChunks::new(3 * mib + 4096, None);
        assert!(!all.is_catch_up());
        assert_eq!(
            all.ranges().collect::<Vec<_>>(),
            vec![(0, mib), (mib, mib), (2 * mib, mib), (3 * mib, 4096)]
        );
        assert_eq!(all.bytes(), 3 * mib + 4096);
        // Chunks past the end (none should be) are left out.
        let some = ResyncChunks::new(3 * mib + 4096, Some(vec![1, 3, 9]));
        assert!(some.is_catch_up());
        assert_eq!(
            some.ranges().collect::<Vec<_>>(),
            vec![(mib, mib), (3 * mib, 4096)]
        );
        assert_eq!(some.bytes(), mib + 4096);
    }
}

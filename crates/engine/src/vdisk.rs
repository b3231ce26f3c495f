//! A vdisk as the data path sees it: its shard map and the handle a client connection uses.
//!
//! The handle is the splitting half of the vdisk's primary controller: it runs inline on the
//! connection's reactor (no extra hop), cuts each request at shard-range boundaries, sends the
//! pieces to the shard controllers and joins the replies. The control half (shard map changes,
//! resize, delete) lives in [`crate::engine`].

use crate::gate::ServeGate;
use crate::reactor::ReactorId;
use crate::replication::ReplicationSlot;
use crate::shard::{ShardError, ShardLink, ShardOp, ShardReply, ShardRequest};
use crate::stats::{OpKind, VdiskCounters};
use arc_swap::ArcSwap;
use ashlar_core::{check_range, BlockDevice, BlockStatusRun, Epoch, IoError, IoResult, VdiskId};
use ashlar_storage::copy_identity::CopyIdentity;
use bytes::{Bytes, BytesMut};
use smallvec::{smallvec, SmallVec};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::oneshot;

/// Bytes of address space per shard range: range `i` belongs to shard `i % shard count`.
/// 4 MiB = one extent group, so every extent group has exactly one owner at a time.
pub const SHARD_RANGE_BYTES: u64 = 4 << 20;

/// Which shard controller serves which offsets, for one epoch.
pub struct ShardMap {
    pub epoch: Epoch,
    pub shards: Vec<ShardLink>,
}

impl ShardMap {
    fn shard_for(&self, offset: u64) -> &ShardLink {
        let range = offset / SHARD_RANGE_BYTES;
        &self.shards[(range % self.shards.len() as u64) as usize]
    }
}

/// State of one vdisk shared by its handles on every reactor. Only atomics and an atomically
/// swapped shard map: nothing here is locked on the data path.
pub struct VdiskShared {
    pub id: VdiskId,
    pub name: String,
    pub size_bytes: AtomicU64,
    pub map: ArcSwap<ShardMap>,
    pub counters: VdiskCounters,
    pub connections: AtomicUsize,
    /// Set when the vdisk is being deleted or the node is stopping: I/O fails with ESHUTDOWN.
    pub closing: AtomicBool,
    /// Ranges the last startup's oplog replay found lost to corruption.
    pub oplog_lost_ranges: AtomicU64,
    /// Whether this node may serve the vdisk now (cluster ownership; always open on a
    /// single node). Shared with the node's ownership layer, which opens and closes it.
    pub gate: Arc<ServeGate>,
    /// The replicator the vdisk's writes go through while this node replicates them.
    pub replication: Arc<ReplicationSlot>,
    /// Records another node's replication applied to this node's copy.
    pub replica_records: AtomicU64,
    /// Which content this node's copy holds, for a claimant's fence
    /// (`ashlar_storage::copy_identity`); a new one with every start that may have lost data.
    pub copy_identity: CopyIdentity,
}

impl VdiskShared {
    pub fn new(
        id: VdiskId,
        name: String,
        size_bytes: u64,
        map: ShardMap,
        replication: Arc<ReplicationSlot>,
        copy_identity: CopyIdentity,
    ) -> Self {
        VdiskShared {
            id,
            name,
            size_bytes: AtomicU64::new(size_bytes),
            map: ArcSwap::from_pointee(map),
            counters: VdiskCounters::default(),
            connections: AtomicUsize::new(0),
            closing: AtomicBool::new(false),
            oplog_lost_ranges: AtomicU64::new(0),
            gate: Arc::new(ServeGate::open_forever()),
            replication,
            replica_records: AtomicU64::new(0),
            copy_identity,
        }
    }

    /// Queues one record of another node's replication on the shard serving `offset`, past
    /// the serving gate (this node holds a copy, it does not serve clients), and returns once
    /// the shard's queue took it: records queued one after another reach their shard in that
    /// order. The receiver gets the shard's answer. Off the reactors only.
    pub async fn enqueue_replica(
        &self,
        op: ShardOp,
        offset: u64,
    ) -> IoResult<oneshot::Receiver<Result<ShardReply, ShardError>>> {
        if self.closing.load(Ordering::Relaxed) {
            return Err(IoError::ShuttingDown);
        }
        let map = self.map.load_full();
        let (reply, response) = oneshot::channel();
        let request = ShardRequest {
            op,
            reply,
            route: None,
        };
        map.shard_for(offset)
            .requests
            .send(request)
            .await
            .map_err(|_| IoError::Io("the vdisk's shard stopped".into()))?;
        self.replica_records.fetch_add(1, Ordering::Relaxed);
        Ok(response)
    }

    /// Waits until every shard has finished the writes it took so far (see
    /// [`ShardOp::Settle`]). Off the reactors only.
    pub async fn settle(&self) -> IoResult<()> {
        let count = self.shard_count() as u64;
        let offsets: Vec<u64> = (0..count).map(|i| i * SHARD_RANGE_BYTES).collect();
        let settles = offsets
            .iter()
            .map(|&offset| self.call(move || ShardOp::Settle { offset }, offset));
        for result in futures_util::future::join_all(settles).await {
            result?;
        }
        Ok(())
    }

    /// The chunks (of `UNREPLICATED_CHUNK_BYTES`) that failed writes touched since the last
    /// call, over every shard, sorted; `None` if any shard does not know (see
    /// [`ShardOp::TakeUnreplicated`]). Each shard starts a new set. Call it settled, with
    /// the gate shut. Off the reactors only.
    pub async fn take_unreplicated(&self) -> IoResult<Option<Vec<u64>>> {
        let count = self.shard_count() as u64;
        let takes = (0..count).map(|i| {
            let offset = i * SHARD_RANGE_BYTES;
            self.call(move || ShardOp::TakeUnreplicated { offset }, offset)
        });
        let mut known = Some(Vec::new());
        for result in futures_util::future::join_all(takes).await {
            match result? {
                ShardReply::Unreplicated(Some(chunks)) => {
                    if let Some(all) = &mut known {
                        all.extend(chunks);
                    }
                }
                ShardReply::Unreplicated(None) => known = None,
                other => {
                    return Err(IoError::Io(format!(
                        "unexpected shard reply to a take of unreplicated chunks: {other:?}"
                    )))
                }
            }
        }
        Ok(known.map(|mut chunks| {
            chunks.sort_unstable();
            chunks.dedup();
            chunks
        }))
    }

    /// The reactor whose shard serves `offset` (`None` off the reactors, in tests): where a
    /// request that arrives off the reactors is cheapest to run.
    pub fn reactor_for(&self, offset: u64) -> Option<ReactorId> {
        self.map.load().shard_for(offset).reactor
    }

    pub fn shard_count(&self) -> usize {
        self.map.load().shards.len()
    }

    pub fn oplog_usage_bytes(&self) -> u64 {
        self.map
            .load()
            .shards
            .iter()
            .map(|s| s.oplog_gauges.usage_bytes.load(Ordering::Relaxed))
            .sum()
    }

    /// Bytes of the vdisk whose newest data is only in the oplogs (not yet drained).
    pub fn oplog_live_bytes(&self) -> u64 {
        self.map
            .load()
            .shards
            .iter()
            .map(|s| s.oplog_gauges.live_bytes.load(Ordering::Relaxed))
            .sum()
    }

    /// Sends one piece (within one shard range) and waits for its reply, following the shard
    /// map if it changes underneath.
    async fn call(&self, make_op: impl Fn() -> ShardOp, offset: u64) -> IoResult<ShardReply> {
        // A retired shard answers only after the new map is published, so one retry normally
        // suffices; the bound turns a bug into an error instead of a livelock.
        for _ in 0..1000 {
            if self.closing.load(Ordering::Relaxed) {
                return Err(IoError::ShuttingDown);
            }
            let map = self.map.load_full();
            let (reply, response) = oneshot::channel();
            let route = crate::reactor::current_route();
            let on_reactor = route.is_some();
            let request = ShardRequest {
                op: make_op(),
                reply,
                route,
            };
            let to = &map.shard_for(offset).requests;
            if on_reactor {
                crate::outbox::post(to, request);
            } else if to.send(request).await.is_err() {
                tokio::task::yield_now().await;
                continue;
            }
            match response.await {
                Ok(Ok(reply)) => return Ok(reply),
                Ok(Err(ShardError::Io(error))) => return Err(error),
                Ok(Err(ShardError::Retired)) | Err(_) => tokio::task::yield_now().await,
            }
        }
        Err(IoError::Io(
            "shard map kept changing; request abandoned".into(),
        ))
    }

    /// Runs `op_for(piece_offset, piece_length)` on every shard-range piece of the range, all
    /// pieces in flight at once, and returns the replies in offset order.
    pub async fn call_split(
        &self,
        offset: u64,
        length: u64,
        op_for: impl Fn(u64, u64) -> ShardOp,
    ) -> IoResult<ShardReplies> {
        let pieces = split(offset, length);
        if pieces.len() == 1 {
            let (o, l) = pieces[0];
            return Ok(smallvec![self.call(|| op_for(o, l), o).await?]);
        }
        let op_for = &op_for;
        let futures: Vec<_> = pieces
            .iter()
            .map(|&(o, l)| self.call(move || op_for(o, l), o))
            .collect();
        let mut replies = ShardReplies::with_capacity(futures.len());
        // Polled together so every piece is in flight on its shard at once.
        for result in join_all(futures).await {
            replies.push(result?);
        }
        Ok(replies)
    }
}

/// The shards' replies to the pieces of one request, in offset order: one for most requests,
/// kept in place.
pub type ShardReplies = SmallVec<[ShardReply; 1]>;

/// Cuts `[offset, offset+length)` at shard-range boundaries. A zero-length range is one piece.
pub fn split(offset: u64, length: u64) -> SmallVec<[(u64, u64); 2]> {
    let mut pieces = SmallVec::new();
    let end = offset + length;
    let mut at = offset;
    loop {
        let range_end = (at / SHARD_RANGE_BYTES + 1) * SHARD_RANGE_BYTES;
        let piece_end = range_end.min(end);
        pieces.push((at, piece_end - at));
        if piece_end >= end {
            return pieces;
        }
        at = piece_end;
    }
}

/// Polls a set of futures concurrently and returns their outputs in order.
async fn join_all<F: std::future::Future>(futures: Vec<F>) -> Vec<F::Output>
where
    F::Output: Unpin,
{
    use std::future::Future;
    use std::pin::Pin;
    use std::task::{Context, Poll};
    struct JoinAll<F: Future> {
        futures: Vec<Pin<Box<F>>>,
        outputs: Vec<Option<F::Output>>,
    }
    impl<F: Future> Future for JoinAll<F>
    where
        F::Output: Unpin,
    {
        type Output = Vec<F::Output>;
        fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
            let this = self.get_mut();
            let mut pending = false;
            for (future, output) in this.futures.iter_mut().zip(this.outputs.iter_mut()) {
                if output.is_none() {
                    match future.as_mut().poll(cx) {
                        Poll::Ready(value) => *output = Some(value),
                        Poll::Pending => pending = true,
                    }
                }
            }
            if pending {
                return Poll::Pending;
            }
            Poll::Ready(this.outputs.iter_mut().filter_map(Option::take).collect())
        }
    }
    let outputs = futures.iter().map(|_| None).collect();
    JoinAll {
        futures: futures.into_iter().map(Box::pin).collect(),
        outputs,
    }
    .await
}

/// Counts a client connection for as long as any clone of its handle lives.
pub struct ConnectionGuard(Arc<VdiskShared>);

impl ConnectionGuard {
    /// The vdisk is being deleted (or the node is stopping).
    pub fn is_closing(&self) -> bool {
        self.0.closing.load(Ordering::Relaxed)
    }
}

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        self.0.connections.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What a front-end connection holds: implements [`BlockDevice`].
#[derive(Clone)]
pub struct VdiskHandle {
    shared: Arc<VdiskShared>,
    _connection: Rc<ConnectionGuard>,
}

impl VdiskHandle {
    pub fn new(shared: Arc<VdiskShared>) -> Self {
        shared.connections.fetch_add(1, Ordering::Relaxed);
        VdiskHandle {
            _connection: Rc::new(ConnectionGuard(shared.clone())),
            shared,
        }
    }

    /// A second count of this connection that can cross threads: a connection moving to
    /// another reactor stays counted (so a delete without `--force` is still refused) until
    /// [`VdiskHandle::from_moved`] turns it into the handle there.
    pub fn count_while_moving(&self) -> ConnectionGuard {
        self.shared.connections.fetch_add(1, Ordering::Relaxed);
        ConnectionGuard(self.shared.clone())
    }

    /// The handle of a moved connection, counted by the guard it arrived with.
    pub fn from_moved(guard: ConnectionGuard) -> Self {
        VdiskHandle {
            shared: guard.0.clone(),
            _connection: Rc::new(guard),
        }
    }

    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// Where this connection's requests cost least: `None` when the calling reactor already
    /// runs one of the vdisk's shards (or the caller is not on a reactor), else one of the
    /// reactors that do, chosen by connection count so several connections (multi-conn)
    /// spread over them. Off the shard reactors, every request would cross reactors.
    pub fn better_reactor(&self) -> Option<ReactorId> {
        let here = crate::reactor::current_reactor()?;
        let map = self.shared.map.load();
        let mut homes: Vec<ReactorId> = map.shards.iter().filter_map(|s| s.reactor).collect();
        homes.sort_unstable_by_key(|r| r.0);
        homes.dedup();
        if homes.is_empty() || homes.contains(&here) {
            return None;
        }
        let connections = self.shared.connections.load(Ordering::Relaxed);
        Some(homes[connections % homes.len()])
    }

    fn check(&self, offset: u64, length: u64) -> IoResult<()> {
        crate::reactor::note_client_io(crate::spin_policy::SpinStart::Request);
        if self.shared.closing.load(Ordering::Relaxed) {
            return Err(IoError::ShuttingDown);
        }
        self.shared.gate.admit(&self.shared.name)?;
        check_range(offset, length, self.size_bytes())
    }

    fn record<T>(&self, kind: OpKind, bytes: u64, started: Instant, result: &IoResult<T>) {
        crate::reactor::note_client_io(crate::spin_policy::SpinStart::Reply);
        self.shared
            .counters
            .record(kind, bytes, started.elapsed(), result.is_ok());
    }

    async fn read_inner(&self, offset: u64, length: u64) -> IoResult<Bytes> {
        self.check(offset, length)?;
        if length == 0 {
            return Ok(Bytes::new());
        }
        let replies = self
            .shared
            .call_split(offset, length, |o, l| ShardOp::Read {
                offset: o,
                length: l,
            })
            .await?;
        if replies.len() == 1 {
            return match replies.into_iter().next() {
                Some(ShardReply::Data(data)) => Ok(data),
                _ => Err(unexpected_reply()),
            };
        }
        let mut joined = BytesMut::with_capacity(length as usize);
        for reply in replies {
            match reply {
                ShardReply::Data(data) => joined.extend_from_slice(&data),
                _ => return Err(unexpected_reply()),
            }
        }
        Ok(joined.freeze())
    }

    async fn write_inner(&self, offset: u64, data: Bytes) -> IoResult<()> {
        self.check(offset, data.len() as u64)?;
        if data.is_empty() {
            return Ok(());
        }
        let base = offset;
        let data_ref = &data;
        self.shared
            .call_split(offset, data.len() as u64, |o, l| {
                let start = (o - base) as usize;
                ShardOp::Write {
                    offset: o,
                    data: data_ref.slice(start..start + l as usize),
                }
            })
            .await
            .map(|_| ())
    }

    async fn zero_inner(&self, offset: u64, length: u64, punch_hole: bool) -> IoResult<()> {
        self.check(offset, length)?;
        if length == 0 {
            return Ok(());
        }
        self.shared
            .call_split(offset, length, |o, l| ShardOp::WriteZeroes {
                offset: o,
                length: l,
                punch_hole,
            })
            .await
            .map(|_| ())
    }
}

fn unexpected_reply() -> IoError {
    IoError::Io("internal error: unexpected shard reply".into())
}

impl BlockDevice for VdiskHandle {
    fn size_bytes(&self) -> u64 {
        self.shared.size_bytes.load(Ordering::Relaxed)
    }

    async fn read(&self, offset: u64, length: u32) -> IoResult<Bytes> {
        let started = Instant::now();
        let result = self.read_inner(offset, length as u64).await;
        self.record(OpKind::Read, length as u64, started, &result);
        result
    }

    async fn write(&self, offset: u64, data: Bytes, _fua: bool) -> IoResult<()> {
        // Every acknowledged write is already on stable storage, so FUA needs nothing extra.
        let started = Instant::now();
        let length = data.len() as u64;
        let result = self.write_inner(offset, data).await;
        self.record(OpKind::Write, length, started, &result);
        result
    }

    fn read_now(&self, offset: u64, length: u32) -> Option<IoResult<Bytes>> {
        let started = Instant::now();
        let length = u64::from(length);
        if length == 0 || self.check(offset, length).is_err() {
            return None;
        }
        if offset / SHARD_RANGE_BYTES != (offset + length - 1) / SHARD_RANGE_BYTES {
            return None;
        }
        let map = self.shared.map.load();
        let link = map.shard_for(offset);
        if link.reactor.is_none() || link.reactor != crate::reactor::current_reactor() {
            return None;
        }
        let result = Ok(crate::shard::read_cached_now(link.key, offset, length)?);
        self.record(OpKind::Read, length, started, &result);
        Some(result)
    }

    async fn flush(&self) -> IoResult<()> {
        // Writes are durable when acknowledged (oplog group commit or synced direct write).
        if self.shared.closing.load(Ordering::Relaxed) {
            return Err(IoError::ShuttingDown);
        }
        // A flush acknowledges earlier writes as durable: only an owner may say so.
        self.shared.gate.admit(&self.shared.name)
    }

    async fn trim(&self, offset: u64, length: u32) -> IoResult<()> {
        self.zero_inner(offset, length as u64, true).await
    }

    async fn write_zeroes(&self, offset: u64, length: u32, may_punch_hole: bool) -> IoResult<()> {
        let started = Instant::now();
        let result = self.zero_inner(offset, length as u64, may_punch_hole).await;
        self.record(OpKind::Write, length as u64, started, &result);
        result
    }

    async fn block_status(&self, offset: u64, length: u32) -> IoResult<Vec<BlockStatusRun>> {
        self.check(offset, length as u64)?;
        if length == 0 {
            return Ok(Vec::new());
        }
        let replies = self
            .shared
            .call_split(offset, length as u64, |o, l| ShardOp::BlockStatus {
                offset: o,
                length: l,
            })
            .await?;
        let mut runs: Vec<BlockStatusRun> = Vec::new();
        for reply in replies {
            let ShardReply::Status(piece_runs) = reply else {
                return Err(unexpected_reply());
            };
            for run in piece_runs {
                match runs.last_mut() {
                    Some(last) if last.hole == run.hole && last.zero == run.zero => {
                        last.length += run.length
                    }
                    _ => runs.push(run),
                }
            }
        }
        Ok(runs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_cuts_at_range_boundaries() {
        assert_eq!(split(0, 4096).as_slice(), [(0, 4096)]);
        assert_eq!(
            split(SHARD_RANGE_BYTES - 4096, 8192).as_slice(),
            [(SHARD_RANGE_BYTES - 4096, 4096), (SHARD_RANGE_BYTES, 4096)]
        );
        assert_eq!(
            split(0, 2 * SHARD_RANGE_BYTES).as_slice(),
            [
                (0, SHARD_RANGE_BYTES),
                (SHARD_RANGE_BYTES, SHARD_RANGE_BYTES)
            ]
        );
        assert_eq!(split(10, 0).as_slice(), [(10, 0)]);
    }
}

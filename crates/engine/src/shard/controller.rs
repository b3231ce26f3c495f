//! The shard controller's event loop: select an event, apply it, check invariants.
//!
//! Events form a closed set ([`Event`]): a client request, a control command, finished
//! storage work, and the drain's two triggers (the oplog wants space back; writes paused).
//! Only `apply` changes controller state. Storage work runs as futures in `work`, owned by
//! the loop; when one finishes, its result is an event like any other.
//!
//! Extent-store writers exclude each other where they could reorder data: a drain step runs
//! alone (it copies older oplog data and must not land over a newer bypass write), bypass
//! writes run concurrently on disjoint ranges. Reads never wait for writers, but a read that
//! saw a checksum mismatch while a writer ran (a read-modify-write seen half done) is parked
//! and run again once no writer runs; only a mismatch that persists is reported.

use super::appends::{LogWrite, LogWrites, WriteFailure};
use super::holds::{self, Holds};
use super::inline::{block_range, cache_key, Registration};
use super::unreplicated::UnreplicatedChunks;
use super::work::{self, DrainError, ReadData, ReadFailure};
use super::{
    overlaps, OplogGauges, ShardControl, ShardError, ShardOp, ShardReply, ShardRequest, ShardSpec,
    Storage,
};
use crate::cache::{BlockCache, MAX_FILLING_READ_BYTES};
use crate::replication::{ReplicaOp, ReplicaRecord, Replicator};
use ashlar_core::{BlockStatusRun, IoError, BLOCK_SIZE_BYTES};
use ashlar_storage::oplog::{Append, OplogEvent, PieceSource, Seq};
use bytes::Bytes;
use futures_util::future::LocalBoxFuture;
use futures_util::stream::{FuturesUnordered, StreamExt};
use smallvec::SmallVec;
use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;

/// A read whose oplog data moved (a drain freed the segment) is looked up again at most this
/// many times; more means the log is churning faster than a read completes.
const MAX_READ_ATTEMPTS: u32 = 4;
/// After a failed drain step, the next one waits this long (a failing disk is not hammered).
const DRAIN_RETRY_DELAY: Duration = Duration::from_secs(1);
/// Buckets of the write-generation table that keeps stale reads out of the cache.
const WRITE_GENERATION_BUCKETS: usize = 4096;

/// Storage work that finished, with what the loop needs to apply it.
enum Finished {
    Read {
        read: PendingRead,
        result: Result<ReadData, ReadFailure>,
    },
    /// A bypass write's data is durable in the extent store (or failed).
    Bypassed {
        request: ShardRequest,
        offset: u64,
        length: u64,
        result: Result<(), IoError>,
    },
    Status {
        request: ShardRequest,
        result: Result<Vec<BlockStatusRun>, IoError>,
    },
    Drained(Result<usize, DrainError>),
    HandedOver(Result<(), String>),
    /// Another copy's content of a read's whole blocks, asked for because this copy's
    /// failed its checksums (`error`).
    Fetched {
        read: PendingRead,
        error: IoError,
        result: Result<Bytes, IoError>,
    },
    /// A chunk held for an online resync was read and given to the replicator.
    Resynced {
        request: ShardRequest,
        range: (u64, u64),
        result: Result<work::ChunkResynced, IoError>,
    },
    /// Every replica holds record `seq` durably (or one failed to).
    Replicated {
        seq: Seq,
        result: Result<(), IoError>,
    },
}

/// The closed set of things the controller reacts to.
enum Event {
    Request(ShardRequest),
    Control(ShardControl),
    Finished(Finished),
    /// The oplog wrote, failed, freed space or took its pending batch.
    Log(OplogEvent),
    /// The oplog wants space back (live data above half its capacity, or writers waiting).
    DrainWanted,
    /// Writes paused long enough to drain in the background, or a drain retry is due.
    DrainTimer,
    /// The request queue closed: every handle is gone.
    RequestsClosed,
    /// Nothing can happen any more (both queues closed, no work left).
    Quiet,
}

/// A read in flight, with what decides whether its blocks may enter the cache.
struct PendingRead {
    request: ShardRequest,
    offset: u64,
    length: u64,
    attempt: u32,
    /// Write generations of the read's blocks when it started (in place for reads of up to
    /// 16 KiB: no allocation per small read).
    generations: SmallVec<[u64; 4]>,
    /// Extent-store writers started before the read started.
    writers_started_before: u64,
    /// An extent-store writer was running when the read started.
    writer_was_running: bool,
}

enum DrainState {
    Idle,
    Running,
    /// The last step failed; the next may start at `until`.
    BackingOff {
        until: Instant,
    },
}

struct Retiring {
    discard: bool,
    done: Option<oneshot::Sender<Result<(), String>>>,
    handing_over: bool,
}

enum Flow {
    Continue,
    Stop,
}

pub(super) struct Controller {
    spec: ShardSpec,
    storage: Rc<Storage>,
    cache: Rc<RefCell<BlockCache>>,
    registration: Registration,
    oplog_gauges: Arc<OplogGauges>,
    work: FuturesUnordered<LocalBoxFuture<'static, Finished>>,
    /// Client requests accepted and not yet answered (in `work`, waiting for a writer slot,
    /// or parked reads). At most `spec.max_requests_in_flight`.
    requests_in_flight: usize,
    /// Bumped for every block a write touches, when it starts and when it is durable. A
    /// read's blocks enter the cache only if their bucket did not move while it ran.
    generations: Vec<u64>,
    /// Ranges of the bypass writes running now (pairwise disjoint).
    bypass_ranges: Vec<(u64, u64)>,
    /// Bypass writes waiting for a writer slot, in arrival order.
    waiting_bypasses: VecDeque<(ShardRequest, u64, Bytes)>,
    /// Reads that saw a checksum mismatch while a writer ran; rerun when no writer runs.
    parked_reads: Vec<PendingRead>,
    /// `Settle` requests, answered once no write is in flight.
    settling: Vec<ShardRequest>,
    /// Chunks held still for online resyncs, and the writes held back meanwhile.
    holds: Holds,
    /// Chunks failed writes touched since the last claim took them.
    unreplicated: UnreplicatedChunks,
    /// Writes on their way into the oplog (waiting to append, or for their commit).
    log_writes: LogWrites,
    drain: DrainState,
    /// Why the last drain step failed, until one succeeds: writers waiting for the space it
    /// would have made get this error instead of waiting forever.
    drain_failure: Option<IoError>,
    /// Count of extent-store writers started (bypasses and drain steps).
    writers_started: u64,
    last_write: Instant,
    /// The sequence number of the last record handed to the replicator (0: none yet).
    last_replicated_seq: u64,
    /// Which replicator `last_replicated_seq` counts for (its address).
    replicator_identity: Option<usize>,
    retiring: Option<Retiring>,
    requests_open: bool,
    control_open: bool,
}

impl Controller {
    pub(super) fn new(
        spec: ShardSpec,
        storage: Rc<Storage>,
        cache: Rc<RefCell<BlockCache>>,
        registration: Registration,
        oplog_gauges: Arc<OplogGauges>,
    ) -> Self {
        assert!(
            spec.max_requests_in_flight > 0,
            "a shard must take requests"
        );
        Controller {
            spec,
            storage,
            cache,
            registration,
            oplog_gauges,
            work: FuturesUnordered::new(),
            requests_in_flight: 0,
            generations: vec![0; WRITE_GENERATION_BUCKETS],
            bypass_ranges: Vec::new(),
            waiting_bypasses: VecDeque::new(),
            parked_reads: Vec::new(),
            settling: Vec::new(),
            holds: Holds::default(),
            unreplicated: UnreplicatedChunks::default(),
            log_writes: LogWrites::default(),
            drain: DrainState::Idle,
            drain_failure: None,
            writers_started: 0,
            last_write: Instant::now(),
            last_replicated_seq: 0,
            replicator_identity: None,
            retiring: None,
            requests_open: true,
            control_open: true,
        }
    }

    pub(super) async fn run(
        mut self,
        mut requests: mpsc::Receiver<ShardRequest>,
        mut control: mpsc::Receiver<ShardControl>,
        mut gate: watch::Receiver<bool>,
    ) {
        while !*gate.borrow_and_update() {
            if gate.changed().await.is_err() {
                // The gate was dropped unopened (the hand-over before it failed): serving now
                // could expose data older than what the old shards still hold. End without
                // serving; queued requests see their shard gone and fail or retry.
                return;
            }
        }
        self.registration.set_serving(true);
        loop {
            let event = self.next_event(&mut requests, &mut control).await;
            if let Flow::Stop = self.apply(event, &mut requests) {
                break;
            }
            self.check_invariants();
        }
        self.registration.set_serving(false);
    }

    async fn next_event(
        &mut self,
        requests: &mut mpsc::Receiver<ShardRequest>,
        control: &mut mpsc::Receiver<ShardControl>,
    ) -> Event {
        let admitting = self.admitting();
        let drain_may_start = self.drain_may_start();
        let timer = self.drain_timer();
        let storage = self.storage.clone();
        tokio::select! {
            biased;
            Some(finished) = self.work.next(), if !self.work.is_empty() => Event::Finished(finished),
            command = control.recv(), if self.control_open && self.retiring.is_none() => match command {
                Some(command) => Event::Control(command),
                None => {
                    self.control_open = false;
                    Event::Quiet
                }
            },
            request = requests.recv(), if admitting => match request {
                Some(request) => Event::Request(request),
                None => Event::RequestsClosed,
            },
            event = storage.oplog.next_event() => Event::Log(event),
            () = storage.oplog.drain_wanted(), if drain_may_start => Event::DrainWanted,
            () = tokio::time::sleep_until(timer.unwrap_or_else(Instant::now)), if timer.is_some() => Event::DrainTimer,
            else => Event::Quiet,
        }
    }

    fn apply(&mut self, event: Event, requests: &mut mpsc::Receiver<ShardRequest>) -> Flow {
        match event {
            Event::Request(request) => self.accept(request),
            Event::Control(ShardControl::Retire { discard, done }) => {
                self.begin_retiring(discard, done, requests)
            }
            Event::Finished(finished) => {
                if let Flow::Stop = self.finish(finished) {
                    return Flow::Stop;
                }
            }
            Event::Log(event) => {
                tracing::trace!(vdisk = %self.spec.vdisk, shard = self.spec.index, ?event, "oplog event");
                // Whatever happened (space freed, batch taken, records durable or failed),
                // waiting writes may go on; finished ones are answered below.
                let failed = self.log_writes.append_waiting(&self.storage.oplog);
                self.answer_log_writes(failed);
                self.publish_usage();
            }
            Event::DrainWanted => self.start_drain(),
            Event::DrainTimer => {
                if matches!(self.drain, DrainState::BackingOff { .. }) {
                    self.drain = DrainState::Idle;
                }
                if self.drain_may_start() {
                    self.start_drain();
                }
            }
            Event::RequestsClosed => self.requests_open = false,
            Event::Quiet => {
                if self.work.is_empty() && !self.requests_open && self.retiring.is_none() {
                    return Flow::Stop;
                }
            }
        }
        self.start_waiting_writers();
        self.send_to_replicas();
        let finished = self.log_writes.take_finished(&self.storage.oplog);
        self.answer_log_writes(finished);
        self.answer_settled();
        self.start_ready_resyncs();
        self.start_wanted_drain();
        self.maybe_hand_over();
        Flow::Continue
    }

    /// Answers the `Settle` requests once no write is in flight here.
    fn answer_settled(&mut self) {
        let writing = self.log_writes.len()
            + self.waiting_bypasses.len()
            + self.bypass_ranges.len()
            + self.holds.parked_len();
        if writing > 0 || self.settling.is_empty() {
            return;
        }
        for request in std::mem::take(&mut self.settling) {
            self.answer(request, Ok(ShardReply::Done));
        }
    }

    /// New client requests are taken while serving and below the in-flight limit.
    fn admitting(&self) -> bool {
        self.requests_open
            && self.retiring.is_none()
            && self.requests_in_flight < self.spec.max_requests_in_flight
    }

    fn check_invariants(&self) {
        assert!(self.requests_in_flight <= self.spec.max_requests_in_flight);
        assert_eq!(self.generations.len(), WRITE_GENERATION_BUCKETS);
        if matches!(self.drain, DrainState::Running) {
            assert!(
                self.bypass_ranges.is_empty(),
                "a drain step runs alone among extent-store writers"
            );
        }
        for (i, a) in self.bypass_ranges.iter().enumerate() {
            for b in &self.bypass_ranges[i + 1..] {
                assert!(!overlaps(*a, *b), "bypass writes {a:?} and {b:?} overlap");
            }
        }
        if let Some(retiring) = &self.retiring {
            if retiring.handing_over {
                assert_eq!(
                    self.requests_in_flight, 0,
                    "hand-over with requests in flight"
                );
            }
        }
        assert!(
            self.log_writes.len()
                + self.waiting_bypasses.len()
                + self.parked_reads.len()
                + self.settling.len()
                + self.holds.parked_len()
                + self.holds.waiting_len()
                <= self.requests_in_flight,
            "every queued write or read is a request in flight"
        );
        self.holds.check_invariants();
    }

    // ----- client requests -----

    fn accept(&mut self, request: ShardRequest) {
        match request.op {
            ShardOp::Read { offset, length } => {
                if let Some(data) = self.registration.read_cached(offset, length) {
                    request.answer(Ok(ShardReply::Data(data)));
                    return;
                }
                self.requests_in_flight += 1;
                let read = self.pending_read(request, offset, length, 1);
                self.start_read(read);
            }
            ShardOp::Write { .. } | ShardOp::WriteZeroes { .. } => {
                self.requests_in_flight += 1;
                self.dispatch_write(request);
            }
            ShardOp::ResyncChunk { offset, length } => {
                self.requests_in_flight += 1;
                self.holds.hold(request, (offset, offset + length));
            }
            ShardOp::Settle { .. } => {
                self.requests_in_flight += 1;
                self.settling.push(request);
            }
            ShardOp::TakeUnreplicated { .. } => {
                let taken = self.unreplicated.take();
                request.answer(Ok(ShardReply::Unreplicated(taken)));
            }
            ShardOp::BlockStatus { offset, length } => {
                self.requests_in_flight += 1;
                let storage = self.storage.clone();
                let vdisk = self.spec.vdisk;
                self.work.push(Box::pin(async move {
                    let result = work::block_status(storage, vdisk, offset, length).await;
                    Finished::Status { request, result }
                }));
            }
        }
    }

    /// Starts a write request already counted in flight, or holds it back while it meets a
    /// chunk being resynced.
    fn dispatch_write(&mut self, request: ShardRequest) {
        let range = holds::write_range(&request.op).expect("a write request");
        if self.holds.must_park(range) {
            self.holds.park(request, range);
            return;
        }
        match request.op {
            ShardOp::Write { offset, ref data } => {
                let data = data.clone();
                self.start_write(request, offset, data);
            }
            ShardOp::WriteZeroes {
                offset,
                length,
                punch_hole,
            } => {
                if punch_hole {
                    self.start_zeroes(request, offset, length);
                } else {
                    // The client asked for allocated zeros: store real zero bytes.
                    let zeros = Bytes::from(vec![0u8; length as usize]);
                    self.start_write(request, offset, zeros);
                }
            }
            _ => unreachable!("write_range accepted it"),
        }
    }

    /// Starts the held chunks' resyncs that no write in flight touches any more: each reads
    /// its chunk and hands it to the replicator.
    fn start_ready_resyncs(&mut self) {
        let log_writes = &self.log_writes;
        let bypass_ranges = &self.bypass_ranges;
        let waiting_bypasses = &self.waiting_bypasses;
        let ready = self.holds.take_ready(|(start, end)| {
            log_writes.overlaps(start, end)
                || bypass_ranges.iter().any(|r| overlaps(*r, (start, end)))
                || waiting_bypasses
                    .iter()
                    .any(|(_, o, d)| overlaps((*o, o + d.len() as u64), (start, end)))
        });
        for (request, range) in ready {
            let storage = self.storage.clone();
            let vdisk = self.spec.vdisk;
            let replicator = self.spec.replication.current();
            self.work.push(Box::pin(async move {
                let result = work::resync_chunk(storage, vdisk, range, replicator).await;
                Finished::Resynced {
                    request,
                    range,
                    result,
                }
            }));
        }
    }

    fn pending_read(
        &self,
        request: ShardRequest,
        offset: u64,
        length: u64,
        attempt: u32,
    ) -> PendingRead {
        PendingRead {
            request,
            offset,
            length,
            attempt,
            generations: block_range(offset, length)
                .map(|b| self.generations[bucket(b)])
                .collect(),
            writers_started_before: self.writers_started,
            writer_was_running: self.writers_running() > 0,
        }
    }

    fn start_read(&mut self, read: PendingRead) {
        let storage = self.storage.clone();
        let vdisk = self.spec.vdisk;
        let (offset, length) = (read.offset, read.length);
        self.work.push(Box::pin(async move {
            let result = work::read(storage, vdisk, offset, length).await;
            Finished::Read { read, result }
        }));
    }

    fn start_write(&mut self, request: ShardRequest, offset: u64, data: Bytes) {
        let length = data.len() as u64;
        self.invalidate(offset, length);
        self.last_write = Instant::now();
        let replicated = self.spec.replication.is_set();
        // A replicated vdisk's data reaches its copies only through the oplog, in its order.
        let oplog_only = self.spec.replication.oplog_only();
        if !oplog_only && work::bypasses_oplog(&self.storage.oplog, offset, length) {
            self.waiting_bypasses.push_back((request, offset, data));
            return;
        }
        let max_record_bytes = self.storage.oplog.max_write_bytes();
        let write = LogWrite::data(request, offset, data, max_record_bytes);
        self.submit(if replicated {
            write.replicated()
        } else {
            write
        });
    }

    fn start_zeroes(&mut self, request: ShardRequest, offset: u64, length: u64) {
        self.invalidate(offset, length);
        self.last_write = Instant::now();
        let write = LogWrite::zeroes(request, offset, length);
        let replicated = self.spec.replication.is_set();
        self.submit(if replicated {
            write.replicated()
        } else {
            write
        });
    }

    /// Hands the records appended since the last call to the vdisk's replicator, in sequence
    /// order, each naming its predecessor in this controller's stream.
    fn send_to_replicas(&mut self) {
        let outgoing = self.log_writes.take_outgoing();
        if outgoing.is_empty() {
            return;
        }
        let replicator = self.spec.replication.current();
        // A new replicator (a new claim, a new epoch) starts new streams on the copies.
        let identity = replicator
            .as_ref()
            .map(|r| Arc::as_ptr(r) as *const () as usize);
        if identity != self.replicator_identity {
            self.replicator_identity = identity;
            self.last_replicated_seq = 0;
        }
        for (seq, piece) in outgoing {
            let op = match piece {
                Append::Write { offset, data } => ReplicaOp::Write { offset, data },
                Append::Zero { offset, length } => ReplicaOp::Zero { offset, length },
                Append::Barrier { .. } => unreachable!("replicated writes append no barrier"),
            };
            let record = ReplicaRecord {
                vdisk: self.spec.vdisk,
                shard: self.spec.index,
                stream: self.spec.epoch.0,
                seq: seq.get(),
                prev_seq: self.last_replicated_seq,
                op,
            };
            assert!(
                record.seq > record.prev_seq,
                "records reach the replicator in sequence order"
            );
            self.last_replicated_seq = record.seq;
            let ack = replicator.as_ref().map(|r| r.replicate(record));
            self.work.push(Box::pin(async move {
                let result = match ack {
                    Some(ack) => ack.await,
                    // Replication was switched off (the claim ended) between the write's
                    // arrival and its append: it cannot reach the replicas.
                    None => Err(IoError::NotServing(
                        "this node stopped replicating the vdisk".into(),
                    )),
                };
                Finished::Replicated { seq, result }
            }));
        }
    }

    /// Hands a write to the oplog. While the log is full and its drain fails, the write gets
    /// the drain's error at once: a full or failing disk is an error, never a hang.
    fn submit(&mut self, write: LogWrite) {
        if let Some(error) = self.drain_failure.clone() {
            if self.log_writes.log_full() {
                self.answer_log_write(write, Err(error));
                return;
            }
        }
        let failed = self.log_writes.submit(&self.storage.oplog, write);
        self.answer_log_writes(failed);
    }

    fn answer_log_writes(&mut self, finished: Vec<(LogWrite, Result<(), WriteFailure>)>) {
        for (write, result) in finished {
            let offset = write.range.0;
            let result = result.map_err(|failure| match failure {
                WriteFailure::Log(e) => work::oplog_error(self.spec.vdisk, offset, e),
                WriteFailure::Replica(e) => e,
            });
            self.answer_log_write(write, result);
        }
    }

    /// Answers a write that went through the log (once it has an outcome, or was refused).
    fn answer_log_write(&mut self, write: LogWrite, result: Result<(), IoError>) {
        let (offset, end) = write.range;
        if result.is_err() {
            // It may have reached some copies and not others (or this node's log only).
            self.unreplicated.mark(offset, end);
        }
        self.invalidate(offset, end - offset);
        self.publish_usage();
        self.answer(write.request, result.map(|()| ShardReply::Done));
    }

    /// Starts the waiting bypass writes that may run now, in arrival order: not while a drain
    /// step runs or the oplog wants one (a drain must not starve), not over a running one.
    fn start_waiting_writers(&mut self) {
        while let Some((_, offset, data)) = self.waiting_bypasses.front() {
            let range = (*offset, offset + data.len() as u64);
            // A drain the log wants goes first (bypasses must not starve it), unless it
            // cannot start (nothing live to drain: the log frees space by itself).
            let drain_first = self.storage.oplog.needs_drain() && self.drain_may_start_now();
            let blocked = matches!(self.drain, DrainState::Running)
                || drain_first
                || self.bypass_ranges.iter().any(|r| overlaps(*r, range));
            if blocked {
                break;
            }
            let Some((request, offset, data)) = self.waiting_bypasses.pop_front() else {
                break;
            };
            self.bypass_ranges.push(range);
            self.writers_started += 1;
            let storage = self.storage.clone();
            let vdisk = self.spec.vdisk;
            let length = data.len() as u64;
            self.work.push(Box::pin(async move {
                let result = work::write_bypass(storage, vdisk, offset, data).await;
                Finished::Bypassed {
                    request,
                    offset,
                    length,
                    result,
                }
            }));
        }
        if self.writers_running() == 0 {
            for read in std::mem::take(&mut self.parked_reads) {
                let read = self.pending_read(read.request, read.offset, read.length, read.attempt);
                self.start_read(read);
            }
        }
    }

    // ----- finished work -----

    fn finish(&mut self, finished: Finished) -> Flow {
        match finished {
            Finished::Read { read, result } => self.finish_read(read, result),
            Finished::Bypassed {
                request,
                offset,
                length,
                result,
            } => {
                // The data is durable in the store: drains may run again. Its barrier needs no
                // lock: a drain can only copy log records newer than the bypass's start (the
                // bypass began with none of the range in the log), which were written
                // concurrently with it, so either order of the two is one a client may see.
                self.bypass_ranges
                    .retain(|r| *r != (offset, offset + length));
                match result {
                    Ok(()) if self.storage.oplog.replay_may_reach(offset, length) => {
                        self.submit(LogWrite::barrier(request, offset, length))
                    }
                    Ok(()) => {
                        // No record of the range is left for a replay to bring back over the
                        // new data (nor in the index): it is done without a barrier.
                        assert!(
                            !self.storage.oplog.holds_any_of(offset, length),
                            "the log's index holds only records a replay would bring back"
                        );
                        self.invalidate(offset, length);
                        self.answer(request, Ok(ShardReply::Done));
                    }
                    Err(error) => {
                        self.invalidate(offset, length);
                        self.answer(request, Err(error));
                    }
                }
            }
            Finished::Status { request, result } => {
                self.answer(request, result.map(ShardReply::Status));
            }
            Finished::Drained(result) => self.finish_drain(result),
            Finished::Replicated { seq, result } => self.log_writes.replica_acked(seq, result),
            Finished::Resynced {
                request,
                range,
                result,
            } => {
                let damaged = result
                    .as_ref()
                    .map(|r| r.damaged_blocks.clone())
                    .unwrap_or_default();
                self.answer(request, result.map(|r| ShardReply::Resynced(r.outcome)));
                for write in self.holds.release(range) {
                    self.dispatch_write(write);
                }
                for block in damaged {
                    self.repair_block(block);
                }
            }
            Finished::Fetched {
                read,
                error,
                result,
            } => self.finish_fetch(read, error, result),
            Finished::HandedOver(result) => {
                if let Some(done) = self.retiring.as_mut().and_then(|r| r.done.take()) {
                    let _ = done.send(result);
                }
                return Flow::Stop;
            }
        }
        Flow::Continue
    }

    fn finish_read(&mut self, read: PendingRead, result: Result<ReadData, ReadFailure>) {
        match result {
            Ok(data) => {
                self.cache_fills(&read, &data.fills);
                self.answer(read.request, Ok(ShardReply::Data(data.data)));
            }
            Err(ReadFailure::LogMoved) if read.attempt < MAX_READ_ATTEMPTS => {
                let read =
                    self.pending_read(read.request, read.offset, read.length, read.attempt + 1);
                self.start_read(read);
            }
            Err(ReadFailure::LogMoved) => {
                let error = IoError::Io(format!(
                    "oplog kept changing under a read at {}",
                    read.offset
                ));
                self.answer(read.request, Err(error));
            }
            Err(ReadFailure::Corrupt(error)) => {
                let writer_overlapped = read.writer_was_running
                    || read.writers_started_before != self.writers_started
                    || self.writers_running() > 0;
                if writer_overlapped && read.attempt < MAX_READ_ATTEMPTS {
                    let mut read = read;
                    read.attempt += 1;
                    self.parked_reads.push(read);
                } else if let Some(replicator) = self.spec.replication.current() {
                    self.fetch_from_copy(&**replicator, read, error);
                } else {
                    self.answer(read.request, Err(error));
                }
            }
            Err(ReadFailure::Failed(error)) => self.answer(read.request, Err(error)),
        }
    }

    /// Repairs this copy's block at `offset`, which failed its checks during a resync: a
    /// read no client waits for, which finds the damage and takes the block from another
    /// copy like any read (`fetch_from_copy`, with its rules against overwriting newer
    /// writes).
    fn repair_block(&mut self, offset: u64) {
        let (reply, _) = oneshot::channel();
        let request = ShardRequest {
            op: ShardOp::Read {
                offset,
                length: BLOCK_SIZE_BYTES,
            },
            reply,
            route: None,
        };
        self.requests_in_flight += 1;
        let read = self.pending_read(request, offset, BLOCK_SIZE_BYTES, 1);
        self.start_read(read);
    }

    /// This copy failed its checksums under `read` and no write overlapped it: read the
    /// whole blocks from another copy (a replicated vdisk keeps every acknowledged write on
    /// each), answer with them and write them back here (`finish_fetch`).
    fn fetch_from_copy(&mut self, replicator: &dyn Replicator, read: PendingRead, error: IoError) {
        let blocks = block_range(read.offset, read.length);
        let first_byte = blocks.start * BLOCK_SIZE_BYTES;
        let whole_length = (blocks.end - blocks.start) * BLOCK_SIZE_BYTES;
        tracing::warn!(vdisk = %self.spec.vdisk, offset = read.offset, length = read.length,
            %error, "this copy failed its checksums; reading the blocks from another copy to repair them");
        let fetch = replicator.fetch(self.spec.vdisk, first_byte, whole_length);
        self.work.push(Box::pin(async move {
            let result = fetch.await;
            Finished::Fetched {
                read,
                error,
                result,
            }
        }));
    }

    fn finish_fetch(&mut self, read: PendingRead, error: IoError, result: Result<Bytes, IoError>) {
        let whole = match result {
            Ok(whole) => whole,
            Err(fetch_error) => {
                tracing::warn!(vdisk = %self.spec.vdisk, offset = read.offset, error = %fetch_error,
                    "no other copy could supply the damaged blocks");
                return self.answer(read.request, Err(error));
            }
        };
        let blocks = block_range(read.offset, read.length);
        let first_byte = blocks.start * BLOCK_SIZE_BYTES;
        if whole.len() as u64 != (blocks.end - blocks.start) * BLOCK_SIZE_BYTES {
            let error = IoError::Io(format!(
                "another copy answered {} bytes for {} blocks",
                whole.len(),
                blocks.end - blocks.start
            ));
            return self.answer(read.request, Err(error));
        }
        let unchanged = blocks
            .clone()
            .zip(&read.generations)
            .all(|(block, seen)| self.generations[bucket(block)] == *seen);
        let quiet = !read.writer_was_running
            && read.writers_started_before == self.writers_started
            && self.writers_running() == 0;
        if !(unchanged && quiet) {
            // A write reached the range meanwhile: the other copy's blocks may be older
            // than it. Read again (the write may have replaced the damaged blocks).
            if read.attempt < MAX_READ_ATTEMPTS {
                let read =
                    self.pending_read(read.request, read.offset, read.length, read.attempt + 1);
                self.start_read(read);
            } else {
                self.answer(read.request, Err(error));
            }
            return;
        }
        // No write was accepted on the range since the read began, so the other copy's
        // blocks (every acknowledged write) are what this read may return. Writing them back
        // needs more: no write in flight on the range (the copy may lack it) and nothing of
        // the range in the oplog (a record that became durable since the read began is newer
        // than what the copy answered, and must not be overwritten). Otherwise a later read
        // repairs the blocks.
        let end = first_byte + whole.len() as u64;
        let rewrite = !self.log_writes.overlaps(first_byte, end)
            && self
                .storage
                .oplog
                .lookup(first_byte, whole.len() as u64)
                .iter()
                .all(|piece| matches!(piece.source, PieceSource::Absent));
        if rewrite {
            // Written back as whole blocks, through the oplog and to every copy like any
            // write (the others already hold these bytes): the drain overwrites the damage.
            let (reply, _) = oneshot::channel();
            let repair = ShardRequest {
                op: ShardOp::Write {
                    offset: first_byte,
                    data: whole.clone(),
                },
                reply,
                route: None,
            };
            self.requests_in_flight += 1;
            self.start_write(repair, first_byte, whole.clone());
            tracing::warn!(vdisk = %self.spec.vdisk, offset = first_byte, length = whole.len(),
                "blocks that failed their checksums were read from another copy and are rewritten here");
        } else {
            tracing::info!(vdisk = %self.spec.vdisk, offset = first_byte, length = whole.len(),
                "blocks that failed their checksums were served from another copy; a write in flight or in the oplog covers them: a later read rewrites them");
        }
        let skip = (read.offset - first_byte) as usize;
        let data = whole.slice(skip..skip + read.length as usize);
        self.answer(read.request, Ok(ShardReply::Data(data)));
    }

    /// Caches the whole blocks a read brought from the extent store, unless a write touched
    /// their bucket since the read started or the read is a scan (`MAX_FILLING_READ_BYTES`).
    fn cache_fills(&self, read: &PendingRead, fills: &[(u64, Bytes)]) {
        if read.length > MAX_FILLING_READ_BYTES {
            return;
        }
        let first_block = read.offset / BLOCK_SIZE_BYTES;
        let mut cache = self.cache.borrow_mut();
        for (first, whole) in fills {
            for (i, chunk) in whole.chunks(BLOCK_SIZE_BYTES as usize).enumerate() {
                let block = first + i as u64;
                let Some(&seen) = read.generations.get((block - first_block) as usize) else {
                    continue;
                };
                if self.generations[bucket(block)] != seen {
                    continue;
                }
                let start = i * BLOCK_SIZE_BYTES as usize;
                let data = whole.slice(start..start + chunk.len());
                cache.insert(cache_key(self.registration_key(), block), data);
            }
        }
    }

    fn answer(&mut self, request: ShardRequest, result: Result<ShardReply, IoError>) {
        assert!(
            self.requests_in_flight > 0,
            "answering a request never taken"
        );
        self.requests_in_flight -= 1;
        request.answer(result.map_err(ShardError::Io));
    }

    // ----- drain -----

    fn writers_running(&self) -> u64 {
        self.bypass_ranges.len() as u64 + u64::from(matches!(self.drain, DrainState::Running))
    }

    /// Whether a drain could start now if no bypass held the store (bypasses yield to it).
    fn drain_may_start_now(&self) -> bool {
        matches!(self.drain, DrainState::Idle)
            && !self.retiring.as_ref().is_some_and(|r| r.handing_over)
            && !self.storage.oplog.is_empty()
    }

    /// A retiring controller keeps draining until its hand-over: writes it still has in
    /// flight may be waiting for oplog space.
    fn drain_may_start(&self) -> bool {
        matches!(self.drain, DrainState::Idle)
            && self.bypass_ranges.is_empty()
            && !self.retiring.as_ref().is_some_and(|r| r.handing_over)
            && !self.storage.oplog.is_empty()
    }

    /// When the loop should wake for the drain: the end of a retry delay, or (with data in the
    /// log and nothing draining) the moment writes have paused for `drain_idle`.
    fn drain_timer(&self) -> Option<Instant> {
        match self.drain {
            DrainState::BackingOff { until } => Some(until),
            DrainState::Idle if self.drain_may_start() => {
                Some(self.last_write + self.spec.drain_idle)
            }
            _ => None,
        }
    }

    /// Starts a drain step the log wants as soon as one may start. The loop's `DrainWanted`
    /// branch alone is not enough: the select is biased towards completions and requests, and
    /// under a steady write load one of those is always ready, so a wanted drain waited for a
    /// lull (gaps of ~150 ms between steps under durable 4 KiB writes at QD32).
    fn start_wanted_drain(&mut self) {
        if self.drain_may_start() && self.storage.oplog.needs_drain() {
            self.start_drain();
        }
    }

    fn start_drain(&mut self) {
        if !self.drain_may_start() {
            return;
        }
        self.drain = DrainState::Running;
        self.writers_started += 1;
        let storage = self.storage.clone();
        let budget = self.spec.drain_budget.clone();
        let max_bytes = self.spec.drain_batch_bytes;
        self.work.push(Box::pin(async move {
            Finished::Drained(work::drain_step(storage, budget, max_bytes).await)
        }));
    }

    fn finish_drain(&mut self, result: Result<usize, DrainError>) {
        self.publish_usage();
        match result {
            Ok(_) => {
                self.drain = DrainState::Idle;
                if self.drain_failure.take().is_some() {
                    tracing::info!(vdisk = %self.spec.vdisk, shard = self.spec.index,
                        "oplog drain works again");
                }
            }
            Err(error) => {
                tracing::error!(vdisk = %self.spec.vdisk, shard = self.spec.index, %error,
                    no_space = error.is_no_space(),
                    "oplog drain failed; retrying in {DRAIN_RETRY_DELAY:?}");
                let failure = error.to_io_error(self.spec.vdisk);
                for write in self.log_writes.take_waiting_for_space() {
                    self.answer_log_write(write, Err(failure.clone()));
                }
                self.drain_failure = Some(failure);
                self.drain = DrainState::BackingOff {
                    until: Instant::now() + DRAIN_RETRY_DELAY,
                };
            }
        }
    }

    // ----- retirement -----

    fn begin_retiring(
        &mut self,
        discard: bool,
        done: oneshot::Sender<Result<(), String>>,
        requests: &mut mpsc::Receiver<ShardRequest>,
    ) {
        self.registration.set_serving(false);
        requests.close();
        while let Ok(request) = requests.try_recv() {
            request.answer(Err(ShardError::Retired));
        }
        let (cancelled, free) = self.holds.cancel_waiting();
        for request in cancelled {
            self.requests_in_flight -= 1;
            request.answer(Err(ShardError::Retired));
        }
        for write in free {
            self.dispatch_write(write);
        }
        self.retiring = Some(Retiring {
            discard,
            done: Some(done),
            handing_over: false,
        });
    }

    /// Once a retiring controller has nothing in flight, it drains (or drops) its oplog and
    /// removes it; its reply ends the loop.
    fn maybe_hand_over(&mut self) {
        let idle = self.requests_in_flight == 0 && self.work.is_empty();
        let Some(retiring) = self.retiring.as_mut() else {
            return;
        };
        if retiring.handing_over || !idle {
            return;
        }
        retiring.handing_over = true;
        let storage = self.storage.clone();
        let fs = self.spec.fs.clone();
        let dir = self.spec.oplog_dir.clone();
        let discard = retiring.discard;
        let drain = (self.spec.drain_budget.clone(), self.spec.drain_batch_bytes);
        self.work.push(Box::pin(async move {
            Finished::HandedOver(work::hand_over(storage, fs, dir, discard, drain).await)
        }));
    }

    // ----- helpers -----

    fn registration_key(&self) -> super::ShardKey {
        super::ShardKey {
            vdisk: self.spec.vdisk,
            epoch: self.spec.epoch,
            index: self.spec.index,
        }
    }

    /// Marks blocks as changing and drops them from the cache.
    fn invalidate(&mut self, offset: u64, length: u64) {
        let key = self.registration_key();
        let mut cache = self.cache.borrow_mut();
        for block in block_range(offset, length) {
            self.generations[bucket(block)] += 1;
            cache.invalidate(&cache_key(key, block));
        }
    }

    /// Publishes the oplog's space use and how much written data waits for the drain.
    fn publish_usage(&self) {
        self.oplog_gauges.publish(&self.storage.oplog);
    }
}

fn bucket(block: u64) -> usize {
    (block as usize) % WRITE_GENERATION_BUCKETS
}

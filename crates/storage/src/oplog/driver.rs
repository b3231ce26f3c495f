//! The log's I/O: every disk operation after open is a job, a future owned by the log (not by
//! any caller) and polled by `next_event`, so dropping a `next_event` future loses nothing.
//! Each poll schedules what is due, in this order, then polls the jobs and applies the
//! finished ones to the state:
//!
//! - recovery: once the batches in flight after a failed one have finished, a seal over the
//!   failed batch (it makes the region dead on disk, so replay never reads it as corruption);
//! - freeing: the oldest segment, if it holds nothing live (rule 2), gets a spare header (or
//!   is deleted), one at a time;
//! - supply: a spare is activated (or a new file prepared) so `next` is ready before the tail
//!   fills;
//! - submission: the pending batch, if the window has room and a segment can take it, is
//!   written with one `write_durable_at`.
//!
//! Batches finish in any order but are resolved from the front of the window only (see
//! `State::resolve_finished`): a later batch never becomes visible before an earlier one.

use super::error::{Failure, OplogError};
use super::files;
use super::format::{
    BatchHeader, RecordKind, SegmentHeader, SegmentState, TableEntry, BLOCK_BYTES,
    SEGMENT_HEADER_BYTES,
};
use super::state::{
    Handle, IndexUpdate, Inflight, OpenBatch, Recovery, Segment, SegmentKind, Spare, State, Supply,
};
use super::{Append, Backpressure, DrainItem, Inner, OplogEvent, SegmentId, Seq, TryAppendError};
use crate::fs::{DiskBuf, DiskFile, Filesystem};
use std::future::Future;
use std::io;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};

/// A disk operation under way.
pub(super) type Job<F> = Pin<Box<dyn Future<Output = Done<F>>>>;

/// What a finished job reports.
pub(super) enum Done<F> {
    Batch {
        number: u64,
        path: PathBuf,
        result: io::Result<()>,
    },
    Seal {
        segment: SegmentId,
        number: u64,
        path: PathBuf,
        result: io::Result<()>,
    },
    Prepared {
        result: Result<Handle<F>, (PathBuf, io::Error)>,
    },
    Activated {
        spare: Spare<F>,
        id: SegmentId,
        generation: u64,
        result: io::Result<()>,
    },
    Retired {
        id: SegmentId,
        segment: Segment<F>,
        /// Kept as a spare (header rewritten), or deleted.
        kept: bool,
        generation: u64,
        result: io::Result<()>,
    },
}

/// The tasks waiting in `next_event` (or a convenience method): all are woken whenever a job
/// makes progress or the state changes, so each can re-check what it waits for.
#[derive(Default)]
pub(super) struct WakerSet {
    wakers: Mutex<Vec<Waker>>,
}

impl WakerSet {
    fn register(&self, waker: &Waker) {
        let mut wakers = self.wakers.lock().unwrap_or_else(|e| e.into_inner());
        if !wakers.iter().any(|w| w.will_wake(waker)) {
            wakers.push(waker.clone());
        }
    }

    pub fn wake_all(&self) {
        let wakers = std::mem::take(&mut *self.wakers.lock().unwrap_or_else(|e| e.into_inner()));
        for waker in wakers {
            waker.wake();
        }
    }
}

impl Wake for WakerSet {
    fn wake(self: Arc<Self>) {
        self.wake_all();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.wake_all();
    }
}

impl<F: Filesystem> Inner<F> {
    pub(super) fn try_append(&self, append: &Append) -> Result<Seq, TryAppendError> {
        let result = self.state.borrow_mut().admit(&self.config, append);
        if matches!(
            result,
            Err(TryAppendError::Backpressure(Backpressure::Full))
        ) {
            self.drain.notify_waiters();
        }
        result
    }

    /// One poll of `next_event`.
    pub(super) fn poll_event(&self, cx: &mut Context<'_>) -> Poll<OplogEvent> {
        self.wakers.register(cx.waker());
        loop {
            if let Some(event) = self.state.borrow_mut().events.pop_front() {
                return Poll::Ready(event);
            }
            self.schedule();
            if !self.state.borrow().events.is_empty() {
                self.wakers.wake_all();
                continue;
            }
            let finished = self.poll_jobs();
            if finished.is_empty() {
                return Poll::Pending;
            }
            for done in finished {
                self.on_done(done);
            }
            if self.needs_drain() {
                self.drain.notify_waiters();
            }
            // Other waiters' conditions may have changed (their records became durable).
            self.wakers.wake_all();
        }
    }

    /// Nothing under way and nothing startable.
    pub(super) fn is_idle(&self) -> bool {
        self.schedule();
        self.jobs.borrow().is_empty()
    }

    fn poll_jobs(&self) -> Vec<Done<F::File>> {
        let waker = Waker::from(self.wakers.clone());
        let mut cx = Context::from_waker(&waker);
        let mut jobs = std::mem::take(&mut *self.jobs.borrow_mut());
        let mut finished = Vec::new();
        jobs.retain_mut(|job| match job.as_mut().poll(&mut cx) {
            Poll::Ready(done) => {
                finished.push(done);
                false
            }
            Poll::Pending => true,
        });
        let mut slot = self.jobs.borrow_mut();
        jobs.append(&mut slot);
        *slot = jobs;
        finished
    }

    fn start(&self, job: impl Future<Output = Done<F::File>> + 'static) {
        self.jobs.borrow_mut().push(Box::pin(job));
    }

    /// Starts whatever I/O is due (see the module comment for the order).
    fn schedule(&self) {
        {
            let mut state = self.state.borrow_mut();
            self.schedule_seal(&mut state);
            self.schedule_retire(&mut state);
            self.schedule_supply(&mut state);
            self.schedule_submit(&mut state);
        }
        if self.needs_drain() {
            self.drain.notify_waiters();
        }
    }

    fn schedule_seal(&self, state: &mut State<F::File>) {
        let Recovery::Sealing {
            segment,
            pos,
            prev,
            running: running @ false,
            ..
        } = &mut state.recovery
        else {
            return;
        };
        if !state.inflight.is_empty() {
            return;
        }
        *running = true;
        let (segment, pos, prev) = (*segment, *pos, *prev);
        let number = state.next_batch;
        state.next_batch += 1;
        let first_seq = state.open.seqs().map_or(state.next_seq, |seqs| seqs.start);
        let seg = state
            .segments
            .get(&segment)
            .expect("a segment awaiting its seal is never freed");
        let header = BatchHeader {
            seal: true,
            log_id: self.config.log_id,
            segment_id: segment.0,
            segment_first_batch: seg.first_batch.unwrap_or(number),
            number,
            prev,
            first_seq,
            count: 0,
            bytes: BLOCK_BYTES as u32,
            window: 1,
        };
        let block = files::seal_block(&header);
        let handle = seg.handle.clone();
        self.start(async move {
            let result = handle.file.write_durable_at(block.as_slice(), pos).await;
            Done::Seal {
                segment,
                number,
                path: handle.path.clone(),
                result,
            }
        });
    }

    fn schedule_retire(&self, state: &mut State<F::File>) {
        if state.retire_error.is_some() || !matches!(state.recovery, Recovery::None) {
            return;
        }
        let Some(id) = state.retirable() else {
            return;
        };
        let segment = state
            .segments
            .remove(&id)
            .expect("retirable returns an existing segment");
        if state.tail == Some(id) {
            state.tail = None;
        }
        state.retiring = Some(id);
        if state.drain_pinned.contains(&id) {
            state.retired.insert(id, segment.handle.clone());
        }
        // A file is always kept (it carries the floors that keep numbers from going back).
        let keep = segment.kind == SegmentKind::V3
            && (state.spares.len() < self.config.max_spare_segments || state.files == 1);
        let generation = segment.handle.generation.get() + 1;
        let header = files::spare_header(
            &self.config,
            generation,
            id.0,
            state.next_seq,
            state.next_batch,
        );
        let fs = self.fs.clone();
        let dir = self.config.dir.clone();
        self.start(async move {
            let result = if keep {
                files::write_header(&segment.handle.file, &header).await
            } else {
                files::remove_durably(&fs, &dir, &segment.handle.path).await
            };
            Done::Retired {
                id,
                segment,
                kept: keep,
                generation,
                result,
            }
        });
    }

    fn schedule_supply(&self, state: &mut State<F::File>) {
        if state.legacy.is_some() || state.next.is_some() || !matches!(state.supply, Supply::Idle) {
            return;
        }
        if let Some(spare) = state.take_usable_spare(&self.config) {
            let id = SegmentId(state.next_segment_id);
            state.next_segment_id += 1;
            let generation = spare.handle.generation.get() + 1;
            let header = SegmentHeader {
                state: SegmentState::Active,
                log_id: self.config.log_id,
                generation,
                segment_id: id.0,
                // Records pending now go into segments activated from now on: a lower bound
                // on this segment's sequence numbers.
                seq_floor: state.open.seqs().map_or(state.next_seq, |seqs| seqs.start),
                batch_floor: state.next_batch,
            };
            state.supply = Supply::Busy;
            self.start(async move {
                let result = files::write_header(&spare.handle.file, &header).await;
                Done::Activated {
                    spare,
                    id,
                    generation,
                    result,
                }
            });
        } else if state.files < self.config.max_segments() {
            let serial = state.next_serial;
            state.next_serial += 1;
            state.files += 1;
            state.supply = Supply::Busy;
            let header = files::spare_header(&self.config, 1, 0, state.next_seq, state.next_batch);
            let (fs, config) = (self.fs.clone(), self.config.clone());
            self.start(async move {
                Done::Prepared {
                    result: files::prepare(fs, config, serial, header).await,
                }
            });
        }
    }

    fn schedule_submit(&self, state: &mut State<F::File>) {
        if state.open.records.is_empty()
            || !matches!(state.recovery, Recovery::None)
            || state.inflight.len() >= self.config.max_batches_in_flight
        {
            return;
        }
        let bytes = state.open.bytes();
        let Some(segment_id) = state.place(bytes) else {
            if let Supply::Failed(failure) = &state.supply {
                // No segment can be had (no space, or the disk fails): the pending records
                // fail now rather than wait; the next append retries the supply.
                let failure = failure.clone();
                state.fail_open(failure);
            } else if !state.can_supply(&self.config) {
                // Every file holds live records (the tail was sealed, say): only a drain can
                // make room, so ask for one.
                state.wants_space = true;
            }
            return;
        };
        let open = std::mem::take(&mut state.open);
        let number = state.next_batch;
        state.next_batch += 1;
        let window = state.inflight.len() as u32 + 1;
        let segment = state
            .segments
            .get_mut(&segment_id)
            .expect("place returns an existing segment");
        let pos = segment.end;
        segment.end += bytes;
        segment.inflight += 1;
        let first_batch = *segment.first_batch.get_or_insert(number);
        let handle = segment.handle.clone();
        let seqs = open.seqs().expect("a submitted batch has records");
        let header = BatchHeader {
            seal: false,
            log_id: self.config.log_id,
            segment_id: segment_id.0,
            segment_first_batch: first_batch,
            number,
            prev: number - 1,
            first_seq: seqs.start,
            count: open.records.len() as u32,
            bytes: u32::try_from(bytes).expect("batches are bounded by max_batch_bytes"),
            window,
        };
        let (buf, updates) = build_batch(&open, &header, segment_id, pos);
        for update in updates.iter().filter(|u| u.target.is_some()) {
            state.reach.note(update.start, update.end, segment_id);
        }
        state.inflight.push_back(Inflight {
            number,
            segment: segment_id,
            pos,
            seqs,
            updates,
            result: None,
        });
        // The pending batch is empty again: appends refused for lack of room may retry.
        state.owe_ready();
        self.start(async move {
            let result = handle.file.write_from(buf.into_bytes(), pos, true).await;
            Done::Batch {
                number,
                path: handle.path.clone(),
                result,
            }
        });
    }

    fn on_done(&self, done: Done<F::File>) {
        let mut state = self.state.borrow_mut();
        let state = &mut *state;
        match done {
            Done::Batch {
                number,
                path,
                result,
            } => {
                let batch = state
                    .inflight
                    .iter_mut()
                    .find(|b| b.number == number)
                    .expect("a finished batch is in flight");
                batch.result = Some(result.map_err(|e| Failure::from_io(&path, &e)));
                state.resolve_finished();
                state.owe_ready();
            }
            Done::Seal {
                segment,
                number,
                path,
                result,
            } => self.sealed(state, segment, number, path, result),
            Done::Prepared { result } => self.prepared(state, result),
            Done::Activated {
                spare,
                id,
                generation,
                result,
            } => activated(state, spare, id, generation, result),
            Done::Retired {
                id,
                segment,
                kept,
                generation,
                result,
            } => self.retired(state, id, segment, kept, generation, result),
        }
    }

    fn prepared(
        &self,
        state: &mut State<F::File>,
        result: Result<Handle<F::File>, (PathBuf, io::Error)>,
    ) {
        match result {
            Ok(handle) => {
                state.add_spare(Spare {
                    handle,
                    last_id: SegmentId(0),
                    len: self.config.segment_bytes,
                });
                state.supply = Supply::Idle;
            }
            Err((path, error)) => {
                tracing::error!(path = %path.display(), %error, "cannot prepare a new oplog segment file");
                state.files -= 1;
                state.supply = Supply::Failed(Failure::from_io(&path, &error));
            }
        }
    }

    fn retired(
        &self,
        state: &mut State<F::File>,
        id: SegmentId,
        mut segment: Segment<F::File>,
        kept: bool,
        generation: u64,
        result: io::Result<()>,
    ) {
        state.retiring = None;
        segment.handle.generation.set(generation);
        match result {
            Ok(()) => {
                tracing::debug!(path = %segment.handle.path.display(), kept, "freed oplog segment {}", id.0);
                if kept {
                    state.add_spare(Spare {
                        len: segment.len,
                        handle: segment.handle,
                        last_id: id,
                    });
                } else {
                    state.files -= 1;
                }
                // The freeing is durable: replay no longer reads the segment.
                let oldest = state.oldest_unfreed();
                state.reach.forget_before(oldest);
                owe_space(state);
            }
            Err(error) => {
                tracing::error!(path = %segment.handle.path.display(), %error, "cannot free an oplog segment; retried at the next drain or refused write");
                let failure = Failure::from_io(&segment.handle.path, &error);
                state.retire_error = Some(failure.clone());
                // Still the oldest segment, holding nothing live; its header may now say
                // either (both say so).
                segment.closed = true;
                state.retired.remove(&id);
                state.segments.insert(id, segment);
                if state.open_is_stuck(&self.config) {
                    state.fail_open(failure);
                }
            }
        }
    }

    fn sealed(
        &self,
        state: &mut State<F::File>,
        segment: SegmentId,
        number: u64,
        path: PathBuf,
        result: io::Result<()>,
    ) {
        let Recovery::Sealing {
            pos, prev, running, ..
        } = &state.recovery
        else {
            panic!("a seal finished while the log was not sealing");
        };
        assert!(*running, "a seal finished that was not started");
        let (pos, prev) = (*pos, *prev);
        match result {
            Ok(()) => {
                tracing::info!(path = %path.display(), pos, "oplog sealed off a failed write; writes continue in a new segment");
                let seg = state
                    .segments
                    .get_mut(&segment)
                    .expect("a segment awaiting its seal is never freed");
                seg.closed = true;
                if state.tail == Some(segment) {
                    state.tail = None;
                }
                state.last_batch = number;
                state.recovery = Recovery::None;
                state.owe_ready();
            }
            Err(error) => {
                tracing::error!(path = %path.display(), %error, "cannot seal off a failed oplog write; writes fail until a retry succeeds");
                let failure = Failure::failed(
                    &path,
                    format!(
                        "a write failed and the failed region could not be sealed off ({error}); \
                         the next write retries"
                    ),
                );
                state.recovery = Recovery::Failed {
                    segment,
                    pos,
                    prev,
                    failure: failure.clone(),
                };
                state.fail_open(failure);
            }
        }
    }

    /// Drops the index entries still pointing at the records of drained `items`.
    pub(super) fn forget_drained(&self, items: &[DrainItem]) {
        let mut state = self.state.borrow_mut();
        for item in items {
            let end = item.offset.saturating_add(item.length);
            state
                .index
                .remove_if_record(item.offset, end, item.target.seq);
        }
    }

    /// The drain batch is done: its segments may be freed and reused.
    pub(super) fn end_drain(&self) {
        let mut state = self.state.borrow_mut();
        state.drain_pinned.clear();
        state.retired.clear();
        // A failed freeing is retried now.
        state.retire_error = None;
    }

    /// Deletes every file of the log, then the directory. Only for an empty, idle log.
    pub(super) async fn destroy(&self) -> Result<(), OplogError> {
        let paths = {
            let mut state = self.state.borrow_mut();
            if !state.index.is_empty()
                || !state.open.records.is_empty()
                || !state.inflight.is_empty()
                || !self.jobs.borrow().is_empty()
            {
                return Err(OplogError::NotEmpty {
                    path: self.config.dir.clone(),
                    live_bytes: state.index.live_bytes(),
                });
            }
            let mut paths: Vec<PathBuf> = state
                .segments
                .values()
                .map(|s| s.handle.path.clone())
                .chain(state.spares.iter().map(|s| s.handle.path.clone()))
                .collect();
            paths.append(&mut state.other_files);
            state.segments.clear();
            state.spares.clear();
            state.retired.clear();
            state.tail = None;
            state.next = None;
            state.files = 0;
            paths
        };
        let dir = &self.config.dir;
        for path in paths {
            match self.fs.remove_file(&path).await {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(super::error::io_error(&path, e)),
            }
        }
        self.fs
            .remove_dir(dir)
            .await
            .map_err(|e| super::error::io_error(dir, e))?;
        match dir.parent().filter(|p| !p.as_os_str().is_empty()) {
            Some(parent) => self
                .fs
                .sync_dir(parent)
                .await
                .map_err(|e| super::error::io_error(parent, e)),
            None => Ok(()),
        }
    }
}

fn activated<H>(
    state: &mut State<H>,
    spare: Spare<H>,
    id: SegmentId,
    generation: u64,
    result: io::Result<()>,
) {
    // On error its header may now be either one; both say it holds nothing live.
    spare.handle.generation.set(generation);
    match result {
        Ok(()) => {
            state.segments.insert(
                id,
                Segment {
                    handle: spare.handle,
                    kind: SegmentKind::V3,
                    len: spare.len,
                    end: SEGMENT_HEADER_BYTES,
                    closed: false,
                    inflight: 0,
                    first_batch: None,
                },
            );
            state.next = Some(id);
            state.supply = Supply::Idle;
            state.owe_ready();
            owe_space(state);
        }
        Err(error) => {
            tracing::error!(path = %spare.handle.path.display(), %error, "cannot activate an oplog segment");
            let failure = Failure::from_io(&spare.handle.path, &error);
            state.add_spare(spare);
            state.supply = Supply::Failed(failure);
        }
    }
}

/// Appends refused with `Full` may be retried: a segment was freed or made ready.
fn owe_space<H>(state: &mut State<H>) {
    if state.wants_space {
        state.wants_space = false;
        state.events.push_back(OplogEvent::SpaceFreed);
    }
}

/// Lays out a batch: header and table, then the records, padded to whole blocks in a buffer
/// aligned for O_DIRECT. Returns it with the index updates of its records.
fn build_batch(
    open: &OpenBatch,
    header: &BatchHeader,
    segment: SegmentId,
    pos: u64,
) -> (DiskBuf, Vec<IndexUpdate>) {
    let table: Vec<TableEntry> = open
        .records
        .iter()
        .map(|r| TableEntry {
            kind: r.header.kind,
            offset: r.header.offset,
            length: r.header.length,
        })
        .collect();
    let mut head =
        Vec::with_capacity(super::format::batch_header_bytes(table.len() as u64) as usize);
    header.encode(&table, &mut head);
    // A `DiskBuf` the ring writes from directly: no bounce buffer, no second copy of the batch.
    let mut buf = DiskBuf::zeroed(
        usize::try_from(u64::from(header.bytes).div_ceil(BLOCK_BYTES) * BLOCK_BYTES)
            .expect("a batch fits in memory"),
    );
    let out = buf.as_mut_slice();
    out[..head.len()].copy_from_slice(&head);
    let mut at = head.len();
    let mut updates = Vec::with_capacity(open.records.len());
    for record in &open.records {
        updates.push(IndexUpdate::for_record(
            &record.header,
            segment,
            pos + at as u64,
        ));
        out[at..at + super::format::RECORD_HEADER_BYTES as usize]
            .copy_from_slice(&record.header.encode());
        at += super::format::RECORD_HEADER_BYTES as usize;
        if record.header.kind == RecordKind::Write {
            for chunk in record.payload.chunks(super::format::CHUNK_BYTES as usize) {
                out[at..at + 4].copy_from_slice(&crc32c::crc32c(chunk).to_le_bytes());
                at += 4;
            }
            out[at..at + record.payload.len()].copy_from_slice(&record.payload);
            at += record.payload.len();
        }
    }
    assert!(
        at as u64 <= u64::from(header.bytes),
        "batch overflows its length"
    );
    (buf, updates)
}

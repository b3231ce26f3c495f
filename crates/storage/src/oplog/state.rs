//! The log's in-memory state and its transitions that do no I/O: segments and their roles,
//! admission into the pending batch, the in-flight window resolved in batch order, outcomes
//! and events. The I/O itself is started and finished in `driver.rs`.
//!
//! Segment roles: every active segment is in `segments` (by id, so iteration is age order).
//! `tail` receives batches; `next` is activated ahead of need, empty, and becomes the tail when
//! a batch no longer fits the tail. Spare files (freed, or prepared and never used) wait in
//! `spares` for activation.

use super::error::Failure;
use super::format::{batch_header_bytes, pad_to_block, RecordHeader, RecordKind, BLOCK_BYTES};
use super::index::{DataLoc, Index, LostLoc, Target, TargetKind};
use super::reach::ReplayReach;
use super::{
    Append, Backpressure, OplogConfig, OplogError, OplogEvent, SegmentId, Seq, TryAppendError,
};
use bytes::Bytes;
use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::ops::Range;
use std::path::PathBuf;
use std::rc::Rc;

/// Failed sequence ranges kept for `Oplog::outcome` (the convenience methods look their
/// records up there); older ones are forgotten.
const MAX_REMEMBERED_FAILURES: usize = 4096;

/// An open segment file.
pub(super) struct FileHandle<F> {
    pub file: F,
    pub path: PathBuf,
    /// Generation of the newest header written to (or read from) this file.
    pub generation: Cell<u64>,
    /// Reads under way (they hold the file across awaits): a file being read is not reused.
    pub readers: Cell<u32>,
    /// The file is a spare: its last reader wakes the driver, which may be waiting to reuse it.
    pub spare: Cell<bool>,
}

pub(super) type Handle<F> = Rc<FileHandle<F>>;

impl<F> FileHandle<F> {
    pub fn new(file: F, path: PathBuf, generation: u64) -> Handle<F> {
        Rc::new(FileHandle {
            file,
            path,
            generation: Cell::new(generation),
            readers: Cell::new(0),
            spare: Cell::new(false),
        })
    }
}

/// Counts a read of a file while it lives. The last read of a spare file wakes the log's
/// driver: it may be waiting to reuse the file.
pub(super) struct ReadGuard<F> {
    pub handle: Handle<F>,
    wakers: std::sync::Arc<super::driver::WakerSet>,
}

impl<F> ReadGuard<F> {
    pub fn new(handle: Handle<F>, wakers: std::sync::Arc<super::driver::WakerSet>) -> Self {
        handle.readers.set(handle.readers.get() + 1);
        ReadGuard { handle, wakers }
    }
}

impl<F> Drop for ReadGuard<F> {
    fn drop(&mut self) {
        let readers = self.handle.readers.get();
        assert!(readers > 0, "read guard count underflow");
        self.handle.readers.set(readers - 1);
        if readers == 1 && self.handle.spare.get() {
            self.wakers.wake_all();
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum SegmentKind {
    V3,
    /// A read-only segment of a version 1/2 log.
    Legacy,
}

/// An active segment: one incarnation of a segment file.
pub(super) struct Segment<F> {
    pub handle: Handle<F>,
    pub kind: SegmentKind,
    /// The file's length (the configured segment size when it was prepared).
    pub len: u64,
    /// Where the next batch goes: the end of the batches written or placed. (Legacy: the
    /// file length.)
    pub end: u64,
    /// No batch goes here any more: it was sealed, or the tail moved on.
    pub closed: bool,
    /// Batches placed here and not yet resolved: the segment may not be freed.
    pub inflight: u32,
    /// Number of the first batch of this incarnation, once one was placed.
    pub first_batch: Option<u64>,
}

/// A spare segment file, waiting for activation.
pub(super) struct Spare<F> {
    pub handle: Handle<F>,
    /// The incarnation it last held: while the current drain batch may read it, the file is
    /// not reused.
    pub last_id: SegmentId,
    /// The file's length.
    pub len: u64,
}

pub(super) struct PendingRecord {
    pub header: RecordHeader,
    pub payload: Bytes,
}

/// Records appended since the last submission: the next batch.
#[derive(Default)]
pub(super) struct OpenBatch {
    pub records: Vec<PendingRecord>,
    /// Bytes of the records (headers, CRCs, payloads).
    pub record_bytes: u64,
}

impl OpenBatch {
    /// Size on disk with `records` more records of `bytes` more bytes.
    pub fn bytes_with(&self, records: u64, bytes: u64) -> u64 {
        pad_to_block(
            batch_header_bytes(self.records.len() as u64 + records) + self.record_bytes + bytes,
        )
    }

    pub fn bytes(&self) -> u64 {
        self.bytes_with(0, 0)
    }

    pub fn seqs(&self) -> Option<Range<u64>> {
        let first = self.records.first()?.header.seq;
        Some(first..first + self.records.len() as u64)
    }
}

/// A batch submitted and not yet resolved.
pub(super) struct Inflight {
    pub number: u64,
    pub segment: SegmentId,
    pub pos: u64,
    pub seqs: Range<u64>,
    pub updates: Vec<IndexUpdate>,
    /// Set when its write returns; resolved in batch order.
    pub result: Option<Result<(), Failure>>,
}

/// Recovery from a failed batch write.
pub(super) enum Recovery {
    None,
    /// A batch failed: no batch is submitted until the ones in flight finish and a seal is
    /// written at `pos` of `segment` (the failed batch's place), making the region dead.
    Sealing {
        segment: SegmentId,
        pos: u64,
        /// The last batch resolved before the failed one.
        prev: u64,
        failure: Failure,
        running: bool,
    },
    /// Writing the seal failed: appends fail until a retry (started by the next append)
    /// succeeds.
    Failed {
        segment: SegmentId,
        pos: u64,
        prev: u64,
        failure: Failure,
    },
}

/// Getting the `next` segment ready: preparing a file, activating a spare.
pub(super) enum Supply {
    Idle,
    Busy,
    /// The last attempt failed; the next append retries.
    Failed(Failure),
}

/// How a durable record changes the index: `[start, end)` now reads from the target, or from
/// the extent store (`None`, a barrier). Shared by commit and replay, so both build the same
/// index from the same records.
#[derive(Clone, Copy, Debug)]
pub(super) struct IndexUpdate {
    pub start: u64,
    pub end: u64,
    pub target: Option<Target>,
}

impl IndexUpdate {
    /// The update of a record whose header starts at `record_at` in the segment file.
    pub fn for_record(header: &RecordHeader, segment: SegmentId, record_at: u64) -> Self {
        let start = header.offset;
        let end = header.offset + header.length;
        let seq = Seq(header.seq);
        let kind = match header.kind {
            RecordKind::Write => TargetKind::Data(DataLoc {
                crcs_at: record_at + super::format::crcs_start(),
                payload_at: record_at + super::format::payload_start(header.chunks),
                record_offset: header.offset,
                record_length: header.length,
            }),
            RecordKind::Zero => TargetKind::Zero,
            RecordKind::Barrier => {
                return IndexUpdate {
                    start,
                    end,
                    target: None,
                }
            }
        };
        IndexUpdate {
            start,
            end,
            target: Some(Target { seq, segment, kind }),
        }
    }

    /// `[start, end)` of record `seq` is lost.
    pub fn lost(start: u64, end: u64, seq: u64, segment: SegmentId, lost: LostLoc) -> Self {
        IndexUpdate {
            start,
            end,
            target: Some(Target {
                seq: Seq(seq),
                segment,
                kind: TargetKind::Lost(lost),
            }),
        }
    }

    pub fn apply(&self, index: &mut Index) {
        index.apply(self.start, self.end, self.target);
    }
}

pub(super) struct State<F> {
    /// Set for a read-only older log (its format version).
    pub legacy: Option<u8>,
    pub segments: BTreeMap<SegmentId, Segment<F>>,
    pub tail: Option<SegmentId>,
    pub next: Option<SegmentId>,
    pub spares: Vec<Spare<F>>,
    /// Files of the log: segments, spares, and files being prepared or freed.
    pub files: usize,
    pub index: Index,
    /// Which ranges a replay could bring back (records in segments not yet durably freed).
    pub reach: ReplayReach,
    pub next_seq: u64,
    pub next_batch: u64,
    pub next_segment_id: u64,
    pub next_serial: u64,
    /// The last batch resolved (durable or failed): the `prev` of a recovery seal.
    pub last_batch: u64,
    pub open: OpenBatch,
    /// Submitted batches, in batch order; resolved from the front only, so the window is
    /// always a contiguous range of batch numbers.
    pub inflight: VecDeque<Inflight>,
    pub recovery: Recovery,
    pub supply: Supply,
    /// The segment being freed (one at a time, oldest first).
    pub retiring: Option<SegmentId>,
    /// The last freeing failed; retried by the next append refused for space or the next
    /// `complete_drain`.
    pub retire_error: Option<Failure>,
    /// An append was refused with `Full`: a drain is wanted, `SpaceFreed` is owed.
    pub wants_space: bool,
    /// An append was refused with `BatchFull`: `Ready` is owed.
    pub refused: bool,
    pub events: VecDeque<OplogEvent>,
    /// Every record up to this one is resolved (durable or failed).
    pub durable_through: u64,
    pub failures: VecDeque<(Range<u64>, Failure)>,
    /// Segments holding the entries of the latest `drain_batch`: if one is freed before the
    /// drain reads it, its handle moves to `retired` so `read_drain_item` can still read it,
    /// and its file is not reused meanwhile.
    pub drain_pinned: BTreeSet<SegmentId>,
    pub retired: BTreeMap<SegmentId, Handle<F>>,
    /// Other files of the log (a legacy log's spares): removed by `destroy`.
    pub other_files: Vec<PathBuf>,
}

impl<F> State<F> {
    pub fn new(
        next_seq: u64,
        next_batch: u64,
        next_segment_id: u64,
        next_serial: u64,
        reach: ReplayReach,
    ) -> Self {
        State {
            legacy: None,
            segments: BTreeMap::new(),
            tail: None,
            next: None,
            spares: Vec::new(),
            files: 0,
            index: Index::default(),
            reach,
            next_seq,
            next_batch,
            next_segment_id,
            next_serial,
            last_batch: next_batch.saturating_sub(1),
            open: OpenBatch::default(),
            inflight: VecDeque::new(),
            recovery: Recovery::None,
            supply: Supply::Idle,
            retiring: None,
            retire_error: None,
            wants_space: false,
            refused: false,
            events: VecDeque::new(),
            durable_through: next_seq.saturating_sub(1),
            failures: VecDeque::new(),
            drain_pinned: BTreeSet::new(),
            retired: BTreeMap::new(),
            other_files: Vec::new(),
        }
    }

    /// The open handle of a segment, also of one freed while the current drain reads it.
    pub fn handle(&self, segment: SegmentId) -> Option<Handle<F>> {
        if let Some(s) = self.segments.get(&segment) {
            return Some(s.handle.clone());
        }
        self.retired.get(&segment).cloned()
    }

    /// Takes a record into the pending batch, or says why not.
    pub fn admit(&mut self, config: &OplogConfig, append: &Append) -> Result<Seq, TryAppendError> {
        let (kind, offset, length) = append.parts();
        super::check_range(offset, length)?;
        if kind == RecordKind::Write && length > config.max_write_bytes() {
            return Err(OplogError::TooLarge {
                length,
                max: config.max_write_bytes(),
            }
            .into());
        }
        if let Some(version) = self.legacy {
            return Err(OplogError::ReadOnly {
                path: config.dir.clone(),
                version,
            }
            .into());
        }
        // A failed recovery or segment supply is retried by this append, which waits for it.
        if let Recovery::Failed {
            segment,
            pos,
            prev,
            failure,
        } = &self.recovery
        {
            self.recovery = Recovery::Sealing {
                segment: *segment,
                pos: *pos,
                prev: *prev,
                failure: failure.clone(),
                running: false,
            };
        }
        if matches!(self.supply, Supply::Failed(_)) {
            self.supply = Supply::Idle;
        }
        let record_bytes = super::format::record_bytes(kind, length);
        let batch_bytes = self.open.bytes_with(1, record_bytes);
        if !self.open.records.is_empty() && batch_bytes > config.max_batch_bytes {
            self.refused = true;
            return Err(TryAppendError::Backpressure(Backpressure::BatchFull));
        }
        // Freeing a segment failed: this append retries it and waits for the retry; if it
        // fails again, the pending records fail (an error, never a silent wait).
        if !self.can_place(config, batch_bytes) && self.retire_error.take().is_none() {
            self.wants_space = true;
            return Err(TryAppendError::Backpressure(Backpressure::Full));
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        let payload = match append {
            Append::Write { data, .. } => data.clone(),
            Append::Zero { .. } | Append::Barrier { .. } => Bytes::new(),
        };
        self.open.records.push(PendingRecord {
            header: RecordHeader::new(kind, seq, offset, length),
            payload,
        });
        self.open.record_bytes += record_bytes;
        Ok(Seq(seq))
    }

    /// Whether a batch of `bytes` can get a place: in the tail, in `next`, or in a segment
    /// that is being (or can be) made ready.
    fn can_place(&self, config: &OplogConfig, bytes: u64) -> bool {
        self.tail_fits(bytes) || self.next.is_some() || self.can_supply(config)
    }

    /// Whether a `next` segment is being made ready or can be. A spare the current drain batch
    /// still reads does not count: only finishing the drain frees it, so a writer must be
    /// refused (and a drain asked for), not kept waiting.
    pub fn can_supply(&self, config: &OplogConfig) -> bool {
        matches!(self.supply, Supply::Busy)
            || self
                .spares
                .iter()
                .any(|s| s.len == config.segment_bytes && !self.drain_pinned.contains(&s.last_id))
            || self.files < config.max_segments()
            || self
                .retiring
                .is_some_and(|id| !self.drain_pinned.contains(&id))
    }

    fn tail_fits(&self, bytes: u64) -> bool {
        self.tail
            .and_then(|t| self.segments.get(&t))
            .is_some_and(|s| !s.closed && s.end + bytes + BLOCK_BYTES <= s.len)
    }

    /// The segment a batch of `bytes` goes to: the tail if it fits, else `next` (which becomes
    /// the tail). `None` while no segment is ready.
    pub fn place(&mut self, bytes: u64) -> Option<SegmentId> {
        if self.tail_fits(bytes) {
            return self.tail;
        }
        let next = self.next.take()?;
        if let Some(old) = self.tail.and_then(|t| self.segments.get_mut(&t)) {
            old.closed = true;
        }
        self.tail = Some(next);
        Some(next)
    }

    /// Resolves the finished batches at the front of the window, in batch order: applies
    /// the durable ones to the index, fails the failed ones and every one after a failure.
    pub fn resolve_finished(&mut self) {
        while self.inflight.front().is_some_and(|b| b.result.is_some()) {
            let batch = self.inflight.pop_front().expect("front checked above");
            let result = batch.result.expect("finished batches have a result");
            let segment = self
                .segments
                .get_mut(&batch.segment)
                .expect("a segment with a batch in flight is never freed");
            assert!(segment.inflight > 0, "segment in-flight count underflow");
            segment.inflight -= 1;
            match (&self.recovery, result) {
                (Recovery::None, Ok(())) => {
                    for update in &batch.updates {
                        update.apply(&mut self.index);
                    }
                    self.last_batch = batch.number;
                    self.note_durable(batch.seqs.end - 1);
                }
                (Recovery::None, Err(failure)) => {
                    tracing::error!(path = %failure.path.display(), batch = batch.number, error = %failure.message,
                        "oplog batch write failed; failing it and the batches after it, then sealing it off");
                    self.recovery = Recovery::Sealing {
                        segment: batch.segment,
                        pos: batch.pos,
                        prev: self.last_batch,
                        failure: failure.clone(),
                        running: false,
                    };
                    self.fail_seqs(batch.seqs.clone(), failure);
                    self.note_durable(batch.seqs.end - 1);
                }
                (Recovery::Sealing { failure, .. } | Recovery::Failed { failure, .. }, _) => {
                    let failure = failure.clone();
                    self.fail_seqs(batch.seqs.clone(), failure);
                    self.note_durable(batch.seqs.end - 1);
                }
            }
        }
    }

    fn note_durable(&mut self, through: u64) {
        if through <= self.durable_through {
            return;
        }
        self.durable_through = through;
        match self.events.back_mut() {
            Some(OplogEvent::Durable { through: last }) => *last = Seq(through),
            _ => self.events.push_back(OplogEvent::Durable {
                through: Seq(through),
            }),
        }
    }

    /// Records that `seqs` failed and tells the owner.
    pub fn fail_seqs(&mut self, seqs: Range<u64>, failure: Failure) {
        if seqs.is_empty() {
            return;
        }
        self.events.push_back(OplogEvent::Failed {
            seqs: Seq(seqs.start)..Seq(seqs.end),
            error: failure.to_error(),
        });
        self.failures.push_back((seqs, failure));
        if self.failures.len() > MAX_REMEMBERED_FAILURES {
            self.failures.pop_front();
        }
    }

    /// Fails the pending batch's records (its segment cannot be had, or the log cannot
    /// recover).
    pub fn fail_open(&mut self, failure: Failure) {
        let open = std::mem::take(&mut self.open);
        if let Some(seqs) = open.seqs() {
            let through = seqs.end - 1;
            self.fail_seqs(seqs, failure);
            // Only the newest records are pending: they resolve once the window is empty.
            if self.inflight.is_empty() {
                self.note_durable(through);
            }
        }
        self.owe_ready();
    }

    /// Appends refused with `BatchFull` may be retried.
    pub fn owe_ready(&mut self) {
        if self.refused {
            self.refused = false;
            self.events.push_back(OplogEvent::Ready);
        }
    }

    /// The outcome of record `seq`, once resolved.
    pub fn outcome(&self, seq: Seq) -> Option<Result<(), OplogError>> {
        if let Some((_, failure)) = self.failures.iter().rev().find(|(r, _)| r.contains(&seq.0)) {
            return Some(Err(failure.to_error()));
        }
        (seq.0 <= self.durable_through).then_some(Ok(()))
    }

    pub fn usage_bytes(&self) -> u64 {
        let segments: u64 = self.segments.values().map(|s| s.end).sum();
        segments
            + if self.open.records.is_empty() {
                0
            } else {
                self.open.bytes()
            }
    }

    /// The oldest segment whose freeing is not yet durable (the one being freed, else the
    /// oldest active one): replay reads it and every newer one.
    pub fn oldest_unfreed(&self) -> Option<SegmentId> {
        let oldest_active = self.segments.keys().next().copied();
        match (self.retiring, oldest_active) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Whether a replay could bring back a write or zero record overlapping `[start, end)`:
    /// one pending, in flight, or in a segment not yet durably freed (a read-only older log:
    /// always).
    pub fn replay_may_reach(&self, start: u64, end: u64) -> bool {
        self.legacy.is_some()
            || self.open.records.iter().any(|r| {
                let h = &r.header;
                h.kind != RecordKind::Barrier && h.offset < end && start < h.offset + h.length
            })
            || self.reach.reaches(start, end, self.oldest_unfreed())
    }

    /// The oldest segment, if it may be freed now (rule 2): it holds no live entry and no
    /// batch in flight, and it is neither `next` nor a tail still worth writing to.
    pub fn retirable(&self) -> Option<SegmentId> {
        if self.retiring.is_some() {
            return None;
        }
        let (&id, segment) = self.segments.iter().next()?;
        if Some(id) == self.next || segment.inflight > 0 || self.index.segment_is_live(id) {
            return None;
        }
        if Some(id) == self.tail && !segment.closed {
            if !self.open.records.is_empty() {
                // Admission counted on the tail's room for the pending batch.
                return None;
            }
            // A dead tail is freed only when space is wanted or half of it is used, so a
            // stream of records that never stay live (barriers) does not cycle segments.
            let half_used = segment.end * 2 >= segment.len;
            if !self.wants_space && !half_used {
                return None;
            }
        }
        Some(id)
    }

    /// The pending batch cannot be placed and nothing under way will make room for it.
    pub fn open_is_stuck(&self, config: &OplogConfig) -> bool {
        !self.open.records.is_empty()
            && !self.tail_fits(self.open.bytes())
            && self.next.is_none()
            && !self.can_supply(config)
    }

    /// A spare file that may be activated now: not read by anyone, and not the file of a
    /// segment the current drain batch still reads.
    /// (A spare of another size, left by an older configuration and kept only for its
    /// floors, is never reused.)
    pub fn take_usable_spare(&mut self, config: &OplogConfig) -> Option<Spare<F>> {
        let at = self.spares.iter().position(|s| {
            s.len == config.segment_bytes
                && s.handle.readers.get() == 0
                && !self.drain_pinned.contains(&s.last_id)
        })?;
        let spare = self.spares.swap_remove(at);
        spare.handle.spare.set(false);
        Some(spare)
    }

    /// Returns a file to the spare pool.
    pub fn add_spare(&mut self, spare: Spare<F>) {
        spare.handle.spare.set(true);
        self.spares.push(spare);
    }
}

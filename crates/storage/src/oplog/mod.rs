//! The oplog: a vdisk shard's durable write log on the fast tier (format version 3, see
//! docs/oplog-format.md).
//!
//! Records are appended without waiting ([`Oplog::try_append`]) to a pending batch. The log
//! owns its disk I/O: [`Oplog::next_event`], which the owner awaits in its event loop (it is
//! cancel-safe), submits pending batches (each one `write_durable_at` at a 4 KiB-aligned
//! offset of a preallocated segment, several in flight), completes them strictly in batch
//! order, applies their records to the in-memory index and reports them durable
//! ([`OplogEvent::Durable`]). It also prepares segment files ahead of need, frees drained
//! segments oldest first, and recovers by itself from a failed write. The engine's drain moves
//! live entries to the extent store and tells the log ([`Oplog::complete_drain`]).
//!
//! I/O progresses only while someone polls `next_event` (or a convenience method built on it:
//! `write`, `write_zeroes`, `barrier`, `idle`). An `Oplog` belongs to one shard controller on
//! one reactor thread: it is `!Send`, uses `Rc`/`RefCell` inside and never holds a borrow
//! across an `.await`.
//!
//! Module map: `format` (bytes on disk), `index` (ranges -> records), `state` (segments,
//! pending and in-flight batches, admission), `driver` (the I/O jobs and `next_event`),
//! `files` (the I/O each job does), `replay` (rebuilding the index at open, telling a torn
//! tail from corruption), `legacy` (read-only replay of version 1/2 logs), `read`
//! (checksum-verified reads), `buf` (aligned buffers).

mod buf;
mod drain_read;
mod driver;
mod error;
mod files;
mod format;
mod index;
mod legacy;
mod reach;
mod read;
mod replay;
mod state;

pub use drain_read::{DrainData, DrainReadLimits};
pub use error::OplogError;

use crate::fs::Filesystem;
use bytes::Bytes;
use driver::WakerSet;
use format::{RecordKind, BLOCK_BYTES, SEGMENT_HEADER_BYTES};
use index::{DataLoc, LostLoc, Target, TargetKind};
use state::State;
use std::cell::RefCell;
use std::fmt;
use std::future::poll_fn;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::Arc;
use std::task::Poll;
use tokio::sync::Notify;

/// Smallest default segment: keeps the number of files (and opens at replay) small.
const MIN_DEFAULT_SEGMENT_BYTES: u64 = 1 << 20;
const DEFAULT_MAX_BATCH_BYTES: u64 = 4 << 20;
const DEFAULT_MAX_BATCHES_IN_FLIGHT: usize = 4;
/// Default [`OplogConfig::drain_index_entries_per_turn`]: about 0.2 ms of work on the test VM.
/// A whole batch at once (26,000 entries: 9 ms to gather, 14 ms to forget) held up every other
/// client of the reactor for that long (bench/results/20261129-144500-vm).
pub const DEFAULT_DRAIN_INDEX_ENTRIES_PER_TURN: usize = 512;
/// Segments need room for the header, one batch of a 4 KiB write (8 KiB) and a seal.
const MIN_SEGMENT_BYTES: u64 = SEGMENT_HEADER_BYTES + 3 * BLOCK_BYTES;
/// One batch must hold a 4 KiB write: a header block and a payload block.
const MIN_BATCH_BYTES: u64 = 2 * BLOCK_BYTES;
/// The extent size: the unit of the writes that bypass the log.
const DEFAULT_REPLAY_REACH_GRANULE_BYTES: u64 = 1 << 20;

/// The limits of one log. Every limit is named here; memory and disk use follow from them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OplogConfig {
    /// Directory of the segment files; created if missing.
    pub dir: PathBuf,
    /// Identifies this log on disk: written in every segment and batch header, so a file of
    /// another log put in this directory is recognised and refused. The engine derives it
    /// from the vdisk and shard.
    pub log_id: u64,
    /// Bytes of segment files the log may hold: `capacity_bytes / segment_bytes` files (at
    /// least two). Appends are refused with [`Backpressure::Full`] while every file holds live
    /// records.
    pub capacity_bytes: u64,
    /// Size of each segment file, preallocated when created: a multiple of 4 KiB, at least
    /// 20 KiB. One write record must fit in one batch, so it also bounds a record.
    pub segment_bytes: u64,
    /// Upper bound on one batch on disk (header, records, padding): memory held by the
    /// pending batch and by each batch in flight. A multiple of 4 KiB, at least 8 KiB, and at
    /// most `segment_bytes - 12 KiB`.
    pub max_batch_bytes: u64,
    /// Batches written concurrently. Replay can only find the last `max_batches_in_flight`
    /// batches before a crash torn; acknowledgements stay in batch order whatever the limit.
    pub max_batches_in_flight: usize,
    /// Freed segment files kept (their headers marked spare) for reuse rather than deleted.
    /// Reusing a file avoids preparing a new one (allocating and zero-filling it); deleting
    /// returns idle disk space. At least one file is always kept, so sequence numbers never
    /// restart.
    pub max_spare_segments: usize,
    /// Granule of the map that says whether a replay could bring back a record of a range
    /// (`Oplog::replay_may_reach`): a record marks every granule it touches, so a coarser
    /// granule answers "maybe" more often and remembers fewer entries (about 24 bytes per
    /// granule touched by records of segments not yet freed). A multiple of 4 KiB.
    pub replay_reach_granule_bytes: u64,
    /// Index entries a drain visits (gathering its batch in `drain_batch`, or forgetting the
    /// drained entries in `complete_drain`) before it lets the thread's other tasks run.
    /// Default [`DEFAULT_DRAIN_INDEX_ENTRIES_PER_TURN`].
    pub drain_index_entries_per_turn: usize,
}

impl OplogConfig {
    /// The defaults: segments of capacity/8 (at least 1 MiB), batches of up to 4 MiB, four
    /// batches in flight, every freed segment kept as a spare.
    pub fn new(dir: impl Into<PathBuf>, log_id: u64, capacity_bytes: u64) -> Self {
        let segment_bytes =
            (capacity_bytes / 8 / BLOCK_BYTES * BLOCK_BYTES).max(MIN_DEFAULT_SEGMENT_BYTES);
        OplogConfig {
            dir: dir.into(),
            log_id,
            capacity_bytes,
            segment_bytes,
            max_batch_bytes: DEFAULT_MAX_BATCH_BYTES.min(max_batch_for(segment_bytes)),
            max_batches_in_flight: DEFAULT_MAX_BATCHES_IN_FLIGHT,
            max_spare_segments: usize::MAX,
            replay_reach_granule_bytes: DEFAULT_REPLAY_REACH_GRANULE_BYTES,
            drain_index_entries_per_turn: DEFAULT_DRAIN_INDEX_ENTRIES_PER_TURN,
        }
    }

    /// Segment files the log may hold.
    pub fn max_segments(&self) -> usize {
        usize::try_from(self.capacity_bytes / self.segment_bytes.max(1)).unwrap_or(usize::MAX)
    }

    fn validate(&self) -> Result<(), OplogError> {
        let fail = |reason: String| Err(OplogError::InvalidConfig { reason });
        if !self.segment_bytes.is_multiple_of(BLOCK_BYTES) || self.segment_bytes < MIN_SEGMENT_BYTES
        {
            return fail(format!(
                "segment_bytes {} must be a multiple of 4 KiB and at least {MIN_SEGMENT_BYTES}",
                self.segment_bytes
            ));
        }
        if self.max_segments() < 2 {
            return fail(format!(
                "capacity_bytes {} must hold at least two segments of {} bytes",
                self.capacity_bytes, self.segment_bytes
            ));
        }
        if !self.max_batch_bytes.is_multiple_of(BLOCK_BYTES)
            || self.max_batch_bytes < MIN_BATCH_BYTES
            || self.max_batch_bytes > max_batch_for(self.segment_bytes)
            || self.max_batch_bytes > u64::from(u32::MAX) / BLOCK_BYTES * BLOCK_BYTES
        {
            return fail(format!(
                "max_batch_bytes {} must be a multiple of 4 KiB between {MIN_BATCH_BYTES} and {}",
                self.max_batch_bytes,
                max_batch_for(self.segment_bytes)
            ));
        }
        if self.max_batches_in_flight == 0 || self.max_batches_in_flight > u32::MAX as usize {
            return fail("max_batches_in_flight must be at least 1".into());
        }
        if self.drain_index_entries_per_turn == 0 {
            return fail("drain_index_entries_per_turn must be at least 1".into());
        }
        if self.max_spare_segments == 0 {
            return fail("max_spare_segments must be at least 1".into());
        }
        if self.replay_reach_granule_bytes == 0
            || !self.replay_reach_granule_bytes.is_multiple_of(BLOCK_BYTES)
        {
            return fail(format!(
                "replay_reach_granule_bytes {} must be a positive multiple of 4 KiB",
                self.replay_reach_granule_bytes
            ));
        }
        Ok(())
    }

    /// The largest write payload one record may carry: a multiple of 4 KiB.
    pub fn max_write_bytes(&self) -> u64 {
        let room = self
            .max_batch_bytes
            .saturating_sub(format::batch_header_bytes(1) + format::RECORD_HEADER_BYTES);
        // Each 4 KiB chunk costs its bytes and a 4-byte CRC.
        room / (BLOCK_BYTES + 4) * BLOCK_BYTES
    }
}

/// The largest batch a segment of `segment_bytes` can hold beside its header and a seal.
fn max_batch_for(segment_bytes: u64) -> u64 {
    segment_bytes.saturating_sub(SEGMENT_HEADER_BYTES + BLOCK_BYTES)
}

/// A record's sequence number: assigned by `try_append`, increasing, never reused by the log
/// (across reopens and reused files).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Seq(u64);

impl Seq {
    pub const fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for Seq {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// One incarnation of a segment file (a file reused later gets a new id). Increasing in age
/// order; never reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SegmentId(u64);

impl SegmentId {
    pub const fn get(self) -> u64 {
        self.0
    }
}

/// One record to append.
#[derive(Clone, Debug)]
pub enum Append {
    /// `data` at vdisk `offset`; at most [`Oplog::max_write_bytes`] bytes, not empty.
    Write { offset: u64, data: Bytes },
    /// `[offset, offset+length)` reads as zeros.
    Zero { offset: u64, length: u64 },
    /// The extent store holds newer, synced data for the range than any record in the log:
    /// the range leaves the index, and replay will not resurrect older records.
    Barrier { offset: u64, length: u64 },
}

impl Append {
    fn parts(&self) -> (RecordKind, u64, u64) {
        match self {
            Append::Write { offset, data } => (RecordKind::Write, *offset, data.len() as u64),
            Append::Zero { offset, length } => (RecordKind::Zero, *offset, *length),
            Append::Barrier { offset, length } => (RecordKind::Barrier, *offset, *length),
        }
    }
}

/// Why `try_append` cannot take a record now. Not an error: retry after an event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backpressure {
    /// Every segment file holds live records: a drain must free one (`needs_drain()` is now
    /// true). Retry after [`OplogEvent::SpaceFreed`].
    Full,
    /// The pending batch is at `max_batch_bytes` and cannot be submitted yet (the in-flight
    /// window is full, or the log is recovering or waiting for its next segment). Retry after
    /// the next event.
    BatchFull,
}

/// The outcome of a refused `try_append`.
#[derive(Debug)]
pub enum TryAppendError {
    /// Try again later: after the next [`OplogEvent`] (`Ready` or `SpaceFreed`).
    Backpressure(Backpressure),
    /// The record cannot be taken: invalid or too large, or the log cannot take writes now
    /// (read-only older log; a failing disk whose recovery is retried by the next append).
    Rejected(OplogError),
}

impl From<OplogError> for TryAppendError {
    fn from(error: OplogError) -> Self {
        TryAppendError::Rejected(error)
    }
}

/// What happened in the log. `next_event` returns one at a time.
#[derive(Debug)]
#[non_exhaustive]
pub enum OplogEvent {
    /// Every record with a sequence number up to `through` that did not fail is durable and
    /// indexed (tell its writer). Increases monotonically.
    Durable { through: Seq },
    /// These records failed and will never be indexed; reported before the `Durable` event
    /// that passes them.
    Failed { seqs: Range<Seq>, error: OplogError },
    /// A segment was freed after appends were refused with [`Backpressure::Full`]: retry them.
    SpaceFreed,
    /// Appends refused with [`Backpressure::BatchFull`] may succeed now: retry them.
    Ready,
}

/// Where a piece of a lookup comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PieceSource {
    /// Payload bytes of a durable write record; `read_piece` returns them verified.
    Data { location: PieceLocation },
    /// A zero record: the range reads as zeros.
    Zero,
    /// Not in the log: read the extent store.
    Absent,
    /// Acknowledged contents lost to corruption (found at replay): `read_piece` fails with
    /// [`OplogError::Lost`]; the range reads as an error (EIO), never as data, until it is
    /// drained (marked lost in the extent store) or overwritten.
    Lost { location: LostLocation },
}

/// Opaque position of a piece's bytes in the log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PieceLocation {
    seq: Seq,
    segment: SegmentId,
    data: DataLoc,
}

/// Opaque position of a lost range's rotted record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LostLocation {
    segment: SegmentId,
    lost: LostLoc,
}

/// A part of a looked-up range, with one source.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LogPiece {
    pub offset: u64,
    pub length: u64,
    pub source: PieceSource,
}

/// What a drain item asks of the extent store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DrainKind {
    /// Copy the bytes `read_drain_item` returns.
    Data,
    /// Make the range read as zeros (punch a hole).
    Zero,
    /// The range was lost to corruption: record it lost (`ExtentStore::mark_lost`), so it
    /// reads as EIO until overwritten. `read_drain_item` returns [`OplogError::Lost`].
    Lost,
}

/// One live index entry handed to the drain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DrainItem {
    pub offset: u64,
    pub length: u64,
    pub kind: DrainKind,
    /// The record the entry pointed to, so `complete_drain` leaves parts that newer records
    /// overwrote meanwhile.
    target: Target,
}

/// What replay found besides the records it indexed, for the engine to log and count.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReplayReport {
    /// Acknowledged ranges lost to corruption. They read as [`PieceSource::Lost`] until a
    /// drain records them lost in the extent store (or they are overwritten).
    pub lost: Vec<LostRange>,
    /// Damage found and worked around without losing data: a rotted copy of a segment header
    /// (rewritten from the other copy), a rotted batch header whose records were recovered
    /// from their own headers, a rotted zero/barrier record header the batch table stood in
    /// for.
    pub repaired: Vec<Damage>,
    /// Batches discarded as a torn tail: written in the last in-flight window before a crash,
    /// never acknowledged. Normal after a crash.
    pub torn: Vec<TornTail>,
    /// Set when the log is in an older format (1 or 2) and was opened read-only.
    pub legacy_version: Option<u8>,
}

/// A range whose acknowledged contents were lost, and where.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LostRange {
    pub offset: u64,
    pub length: u64,
    pub path: PathBuf,
    pub file_offset: u64,
    pub reason: String,
}

/// Damage replay worked around.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Damage {
    pub path: PathBuf,
    pub file_offset: u64,
    pub reason: String,
}

/// Where a torn tail was cut off (a seal was written there) and how much went with it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TornTail {
    pub path: PathBuf,
    pub file_offset: u64,
    /// Batches with a readable header that were discarded (others may have left nothing).
    pub batches: u64,
}

/// The write log of one shard. Cheap to clone: clones share the same log.
pub struct Oplog<F: Filesystem> {
    inner: Rc<Inner<F>>,
}

impl<F: Filesystem> Clone for Oplog<F> {
    fn clone(&self) -> Self {
        Oplog {
            inner: self.inner.clone(),
        }
    }
}

struct Inner<F: Filesystem> {
    fs: F,
    config: OplogConfig,
    state: RefCell<State<F::File>>,
    /// I/O under way: polled by `next_event`.
    jobs: RefCell<Vec<driver::Job<F::File>>>,
    /// Tasks polling `next_event`: every one is woken when the log's state changes.
    wakers: Arc<WakerSet>,
    /// Woken when `needs_drain()` may have become true.
    drain: Notify,
}

impl<F: Filesystem> Oplog<F> {
    /// Opens the log in `config.dir` (created if missing) and replays it. The report lists
    /// lost ranges, repaired damage and torn tails. A directory holding an older (version 1 or
    /// 2) log is opened read-only: it can be read and drained, then destroyed.
    pub async fn open(fs: F, config: OplogConfig) -> Result<(Self, ReplayReport), OplogError> {
        config.validate()?;
        fs.create_dir_all(&config.dir)
            .await
            .map_err(|e| error::io_error(&config.dir, e))?;
        let listing = files::list(&fs, &config.dir).await?;
        let (state, report) = if !listing.legacy.is_empty() {
            if !listing.segments.is_empty() {
                return Err(OplogError::Corrupt {
                    path: config.dir.clone(),
                    file_offset: 0,
                    reason: "the directory holds both version 3 segment files and older ones"
                        .into(),
                });
            }
            legacy::replay(&fs, &config, listing.legacy).await?
        } else {
            replay::replay(&fs, &config, listing.segments).await?
        };
        // Every file operation replay made (a removal, a new seal) is durable before the log
        // is used.
        fs.sync_dir(&config.dir)
            .await
            .map_err(|e| error::io_error(&config.dir, e))?;
        log_report(&config.dir, &report);
        let inner = Inner {
            fs,
            config,
            state: RefCell::new(state),
            jobs: RefCell::new(Vec::new()),
            wakers: Arc::new(WakerSet::default()),
            drain: Notify::new(),
        };
        Ok((
            Oplog {
                inner: Rc::new(inner),
            },
            report,
        ))
    }

    /// Appends one record to the pending batch without waiting. The record is durable and
    /// indexed once a [`OplogEvent::Durable`] event passes its sequence number (or failed, if
    /// a [`OplogEvent::Failed`] event names it). Never awaits and does no I/O: the pending
    /// batch is written by `next_event`.
    pub fn try_append(&self, append: Append) -> Result<Seq, TryAppendError> {
        let seq = self.inner.try_append(&append)?;
        self.inner.wakers.wake_all();
        Ok(seq)
    }

    /// Drives the log's I/O and returns its next event. Cancel-safe: I/O under way belongs
    /// to the log, not to this future, so dropping it (in a `select!`) loses nothing. Several
    /// tasks may await it; each event goes to one of them.
    pub async fn next_event(&self) -> OplogEvent {
        poll_fn(|cx| self.inner.poll_event(cx)).await
    }

    /// Appends `data` at vdisk `offset` (split into records of at most `max_write_bytes`) and
    /// returns once it is durable and indexed; waits while the log is full. Built on
    /// `try_append` and `next_event` for tests and tools (it consumes events).
    pub async fn write(&self, offset: u64, data: Bytes) -> Result<(), OplogError> {
        if data.is_empty() {
            return Ok(());
        }
        check_range(offset, data.len() as u64)?;
        let max = self.max_write_bytes() as usize;
        let mut seqs = Vec::new();
        let mut done = 0;
        while done < data.len() {
            let part = data.slice(done..(done + max).min(data.len()));
            let append = Append::Write {
                offset: offset + done as u64,
                data: part.clone(),
            };
            done += part.len();
            seqs.push(self.append_waiting(append).await?);
        }
        for seq in seqs {
            self.wait_for(seq).await?;
        }
        Ok(())
    }

    /// Makes `[offset, offset+length)` read as zeros; returns once durable.
    pub async fn write_zeroes(&self, offset: u64, length: u64) -> Result<(), OplogError> {
        let seq = self.append_waiting(Append::Zero { offset, length }).await?;
        self.wait_for(seq).await
    }

    /// Records that the extent store holds newer, synced data for the range than any record
    /// in the log; returns once durable.
    pub async fn barrier(&self, offset: u64, length: u64) -> Result<(), OplogError> {
        let seq = self
            .append_waiting(Append::Barrier { offset, length })
            .await?;
        self.wait_for(seq).await
    }

    /// Drives the log until no I/O is under way or startable (pending batches written,
    /// segments freed and prepared). For tests, tools and shutdown; consumes events.
    pub async fn idle(&self) {
        poll_fn(|cx| loop {
            if self.inner.is_idle() {
                return Poll::Ready(());
            }
            match self.inner.poll_event(cx) {
                Poll::Ready(_) => continue,
                Poll::Pending => return Poll::Pending,
            }
        })
        .await
    }

    /// The outcome of record `seq`: `None` while it is pending or in flight.
    pub fn outcome(&self, seq: Seq) -> Option<Result<(), OplogError>> {
        self.inner.state.borrow().outcome(seq)
    }

    async fn append_waiting(&self, append: Append) -> Result<Seq, OplogError> {
        poll_fn(|cx| loop {
            match self.inner.try_append(&append) {
                Ok(seq) => {
                    self.inner.wakers.wake_all();
                    return Poll::Ready(Ok(seq));
                }
                Err(TryAppendError::Rejected(error)) => return Poll::Ready(Err(error)),
                Err(TryAppendError::Backpressure(_)) => {}
            }
            match self.inner.poll_event(cx) {
                Poll::Ready(_) => continue,
                Poll::Pending => return Poll::Pending,
            }
        })
        .await
    }

    async fn wait_for(&self, seq: Seq) -> Result<(), OplogError> {
        poll_fn(|cx| loop {
            if let Some(outcome) = self.inner.state.borrow().outcome(seq) {
                return Poll::Ready(outcome);
            }
            match self.inner.poll_event(cx) {
                Poll::Ready(_) => continue,
                Poll::Pending => return Poll::Pending,
            }
        })
        .await
    }

    /// The largest write payload one record may carry (`try_append` refuses larger ones with
    /// `TooLarge`; `write` splits them).
    pub fn max_write_bytes(&self) -> u64 {
        self.inner.config.max_write_bytes()
    }

    /// Whether the log holds anything of `[offset, offset+length)` (data, zeros or lost
    /// blocks): `lookup` would then return more than one `Absent` piece. Allocates nothing,
    /// for the reads that find the range in the extent store or the cache.
    pub fn holds_any_of(&self, offset: u64, length: u64) -> bool {
        let end = offset.saturating_add(length);
        self.inner.state.borrow().index.overlaps(offset, end)
    }

    /// Whether a replay of the log (after a crash, now) could bring back a write or zero
    /// record overlapping `[offset, offset+length)`: one pending, in flight, or in a segment
    /// whose freeing is not yet durable, drained or not. A write that went straight to the
    /// extent store needs a barrier record (`barrier`) only while this is true; otherwise
    /// nothing older than it can be replayed over it. Conservative: it may say yes for a
    /// range no record touches (granules of `replay_reach_granule_bytes`), never no for one
    /// that a record does.
    pub fn replay_may_reach(&self, offset: u64, length: u64) -> bool {
        let end = offset.saturating_add(length);
        self.inner.state.borrow().replay_may_reach(offset, end)
    }

    /// The pieces covering `[offset, offset+length)` exactly, in offset order.
    pub fn lookup(&self, offset: u64, length: u64) -> Vec<LogPiece> {
        let end = offset.saturating_add(length);
        let state = self.inner.state.borrow();
        let mut pieces = Vec::new();
        let mut at = offset;
        for span in state.index.overlapping(offset, end) {
            if span.start > at {
                pieces.push(LogPiece {
                    offset: at,
                    length: span.start - at,
                    source: PieceSource::Absent,
                });
            }
            let source = match span.target.kind {
                TargetKind::Data(data) => PieceSource::Data {
                    location: PieceLocation {
                        seq: span.target.seq,
                        segment: span.target.segment,
                        data,
                    },
                },
                TargetKind::Zero => PieceSource::Zero,
                TargetKind::Lost(lost) => PieceSource::Lost {
                    location: LostLocation {
                        segment: span.target.segment,
                        lost,
                    },
                },
            };
            pieces.push(LogPiece {
                offset: span.start,
                length: span.end - span.start,
                source,
            });
            at = span.end;
        }
        if end > at {
            pieces.push(LogPiece {
                offset: at,
                length: end - at,
                source: PieceSource::Absent,
            });
        }
        pieces
    }

    /// Fills `buf` (exactly `piece.length` bytes) with the piece's contents: checksum-verified
    /// log bytes for `Data`, zeros for `Zero`; `Absent` leaves it untouched; `Lost` fails with
    /// [`OplogError::Lost`]. `Stale` means a drain freed the record since the lookup: look up
    /// again. A chunk failing its CRC is [`OplogError::ChecksumMismatch`].
    pub async fn read_piece(&self, piece: &LogPiece, buf: &mut [u8]) -> Result<(), OplogError> {
        if buf.len() as u64 != piece.length {
            return Err(OplogError::InvalidRange {
                offset: piece.offset,
                length: buf.len() as u64,
            });
        }
        match piece.source {
            PieceSource::Absent => Ok(()),
            PieceSource::Zero => {
                buf.fill(0);
                Ok(())
            }
            PieceSource::Data { location } => {
                self.inner
                    .read_data(
                        location.segment,
                        location.seq,
                        &location.data,
                        piece.offset,
                        buf,
                    )
                    .await
            }
            PieceSource::Lost { location } => Err(self.inner.lost_error(
                location.segment,
                &location.lost,
                piece.offset,
                piece.length,
            )),
        }
    }

    /// Live entries to move to the extent store: those of the oldest segments first (so
    /// space is freed oldest-first), about `max_bytes` of data (at least one entry), sorted by
    /// offset. Zero and lost entries cost nothing towards `max_bytes`. Records written while
    /// it runs are left to the next batch ([`index::DrainCursor`]).
    ///
    /// A batch can hold tens of thousands of entries: they are gathered
    /// [`OplogConfig::drain_index_entries_per_turn`] at a time, letting the thread's other
    /// tasks run in between, so a drain does not hold up the clients of the reactor it shares.
    pub async fn drain_batch(&self, max_bytes: u64) -> Vec<DrainItem> {
        let mut cursor = {
            let mut state = self.inner.state.borrow_mut();
            state.retired.clear();
            state.drain_pinned.clear();
            index::DrainCursor::new(max_bytes, Seq(state.durable_through))
        };
        let mut spans = Vec::new();
        loop {
            let done = {
                let mut state = self.inner.state.borrow_mut();
                let state = &mut *state;
                let pinned = &mut state.drain_pinned;
                state.index.gather_drain(
                    &mut cursor,
                    self.inner.config.drain_index_entries_per_turn,
                    |segment| {
                        pinned.insert(segment);
                    },
                    &mut spans,
                )
            };
            if done {
                break;
            }
            tokio::task::yield_now().await;
        }
        let mut items: Vec<DrainItem> = spans
            .into_iter()
            .map(|span| DrainItem {
                offset: span.start,
                length: span.end - span.start,
                kind: match span.target.kind {
                    TargetKind::Data(_) => DrainKind::Data,
                    TargetKind::Zero => DrainKind::Zero,
                    TargetKind::Lost(_) => DrainKind::Lost,
                },
                target: span.target,
            })
            .collect();
        // No two items overlap, so an unstable sort gives the one order there is.
        items.sort_unstable_by_key(|item| item.offset);
        items
    }

    /// The bytes of a drain item (zeros for a zero item), checksum-verified. A lost item
    /// fails with [`OplogError::Lost`], a rotted chunk with
    /// [`OplogError::ChecksumMismatch`]; both carry the range ([`OplogError::lost_range`]):
    /// record it lost in the extent store, then complete the item like a copied one.
    pub async fn read_drain_item(&self, item: &DrainItem) -> Result<Bytes, OplogError> {
        let length = usize::try_from(item.length).map_err(|_| OplogError::InvalidRange {
            offset: item.offset,
            length: item.length,
        })?;
        let mut data = self
            .read_drain_data(std::slice::from_ref(item), DrainReadLimits::default())
            .await?;
        match data.pop().expect("one result per item") {
            DrainData::Data(bytes) => Ok(bytes),
            DrainData::Zero => Ok(Bytes::from(vec![0u8; length])),
            DrainData::Lost(error) => Err(error),
            DrainData::Rotted { mut lost, .. } => Err(lost.swap_remove(0)),
        }
    }

    /// The content of every item of a drain batch, in order, read with few large reads (see
    /// `drain_read.rs`). Fails only if the disk fails a read (or a segment is gone); an item
    /// whose bytes are lost or fail their CRC is [`DrainData::Lost`], and only that item.
    pub async fn read_drain_data(
        &self,
        items: &[DrainItem],
        limits: DrainReadLimits,
    ) -> Result<Vec<DrainData>, OplogError> {
        self.inner.read_drain_data(items, limits).await
    }

    /// Called once every item is represented in the extent store, durably: its data copied
    /// and synced, or (a lost or rotted item) its range recorded lost there. Drops the index
    /// entries still pointing at the same records (parts overwritten meanwhile stay),
    /// [`OplogConfig::drain_index_entries_per_turn`] at a time with the thread's other tasks
    /// running in between; segments left with nothing live are then freed, oldest first, by the log's own
    /// I/O ([`OplogEvent::SpaceFreed`] tells refused writers).
    pub async fn complete_drain(&self, items: &[DrainItem]) {
        let per_turn = self.inner.config.drain_index_entries_per_turn;
        let mut chunks = items.chunks(per_turn).peekable();
        while let Some(chunk) = chunks.next() {
            self.inner.forget_drained(chunk);
            if chunks.peek().is_some() {
                tokio::task::yield_now().await;
            }
        }
        self.inner.end_drain();
        self.inner.wakers.wake_all();
    }

    /// Bytes of the log's segments in use: headers and batches written or in flight, plus the
    /// pending batch.
    pub fn usage_bytes(&self) -> u64 {
        self.inner.state.borrow().usage_bytes()
    }

    pub fn capacity_bytes(&self) -> u64 {
        self.inner.config.capacity_bytes
    }

    /// Segments holding (or ready to hold) batches, and segment files in all.
    pub fn segment_counts(&self) -> (usize, usize) {
        let state = self.inner.state.borrow();
        (state.segments.len(), state.files)
    }

    /// Bytes of vdisk address space the index maps to the log (data, zero and lost entries).
    pub fn live_bytes(&self) -> u64 {
        self.inner.state.borrow().index.live_bytes()
    }

    /// No live entry: every acknowledged write is in the extent store.
    pub fn is_empty(&self) -> bool {
        self.inner.state.borrow().index.is_empty()
    }

    /// A drain would help now: the segments in use hold more than half the capacity, or
    /// appends were refused for lack of space. Never true for an empty log, where a drain
    /// could not free anything.
    pub fn needs_drain(&self) -> bool {
        self.inner.needs_drain()
    }

    /// Resolves when `needs_drain()` becomes true (at once if it is).
    pub async fn drain_wanted(&self) {
        loop {
            let notified = self.inner.drain.notified();
            if self.needs_drain() {
                return;
            }
            notified.await;
        }
    }

    /// Deletes every file of the log and the directory, after finishing the I/O under way.
    /// Only for an empty log with no pending write (else `NotEmpty`); other clones of this
    /// handle must not be used afterwards.
    pub async fn destroy(self) -> Result<(), OplogError> {
        self.idle().await;
        self.inner.destroy().await
    }

    /// The log directory.
    pub fn dir(&self) -> &Path {
        &self.inner.config.dir
    }
}

impl<F: Filesystem> Inner<F> {
    fn needs_drain(&self) -> bool {
        let state = self.state.borrow();
        !state.index.is_empty()
            && (state.usage_bytes() > self.config.capacity_bytes / 2 || state.wants_space)
    }

    /// The error a read of a lost range returns (`Stale` if its record was freed meanwhile).
    fn lost_error(
        &self,
        segment: SegmentId,
        lost: &LostLoc,
        offset: u64,
        length: u64,
    ) -> OplogError {
        let Some(handle) = self.state.borrow().handle(segment) else {
            return OplogError::Stale { offset, length };
        };
        OplogError::Lost {
            offset,
            length,
            path: handle.path.clone(),
            file_offset: lost.file_offset,
            reason: lost.cause.describe().into(),
        }
    }
}

fn log_report(dir: &Path, report: &ReplayReport) {
    for lost in &report.lost {
        tracing::error!(dir = %dir.display(), path = %lost.path.display(), file_offset = lost.file_offset,
            offset = lost.offset, length = lost.length, reason = %lost.reason,
            "oplog replay: acknowledged range lost to corruption; it reads as an error until drained or overwritten");
    }
    for damage in &report.repaired {
        tracing::warn!(dir = %dir.display(), path = %damage.path.display(), file_offset = damage.file_offset,
            reason = %damage.reason, "oplog replay: damage worked around without loss");
    }
    for torn in &report.torn {
        tracing::info!(dir = %dir.display(), path = %torn.path.display(), file_offset = torn.file_offset,
            batches = torn.batches, "oplog replay: torn tail of unacknowledged batches discarded");
    }
    if let Some(version) = report.legacy_version {
        tracing::warn!(dir = %dir.display(), version, "oplog in an older format opened read-only: drain it and destroy it");
    }
}

/// Ranges must stay inside the 64-bit address space and not be empty.
fn check_range(offset: u64, length: u64) -> Result<(), OplogError> {
    match offset.checked_add(length) {
        Some(_) if length > 0 => Ok(()),
        _ => Err(OplogError::InvalidRange { offset, length }),
    }
}

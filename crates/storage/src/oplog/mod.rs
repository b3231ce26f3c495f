//! The oplog: a vdisk shard's durable write log on the fast tier (see docs/oplog-format.md).
//!
//! Writes append records to segment files and are acknowledged after a group commit (one
//! `sync_data` for every record that arrived meanwhile). An in-memory index maps vdisk byte
//! ranges to the newest durable record covering them. The engine's drain loop moves live
//! entries to the extent store and tells the log, which then frees segments oldest-first.
//!
//! An `Oplog` belongs to one shard controller on one reactor thread: it is `!Send`, uses
//! `Rc`/`RefCell` inside and never holds a borrow across an `.await`.
//!
//! Module map: `format` (bytes on disk), `index` (ranges -> records), `commit` (admission,
//! pending batches, group commit, failure), `replay` (rebuilding the index at open), `read`
//! (checksum-verified reads), `files` (directory operations and segment freeing).

mod commit;
mod error;
mod files;
mod format;
mod index;
mod read;
mod replay;

pub use error::OplogError;

use crate::disk::FileOpener;
use bytes::Bytes;
use commit::Batch;
use format::{Header, RecordKind};
use index::{DataLoc, Index, Target};
use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use tokio::sync::Notify;

/// Zero and barrier records larger than this are split: the header's length field is a u32.
/// Kept 4 KiB-aligned so the split points stay block-aligned.
const MAX_RANGE_RECORD_BYTES: u64 = 0xFFFF_F000;
/// Smallest default segment: keeps the number of files (and opens at replay) small.
const MIN_DEFAULT_SEGMENT_BYTES: u64 = 1 << 20;
const DEFAULT_MAX_COMMIT_BATCH_BYTES: usize = 4 << 20;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OplogConfig {
    /// Directory of the segment files; created if missing.
    pub dir: PathBuf,
    /// Total bytes of the segment files. Writers wait (backpressure) while appending would
    /// exceed it; a record larger than this is refused with `TooLarge`.
    pub capacity_bytes: u64,
    /// A segment is closed when the next record would make it larger than this. A record
    /// larger than this by itself gets a segment of its own.
    pub segment_bytes: u64,
    /// Upper bound on the records waiting for the next group commit (memory and latency).
    pub max_commit_batch_bytes: usize,
}

impl OplogConfig {
    /// The defaults: segments of capacity/8 (at least 1 MiB), commit batches of 4 MiB.
    pub fn new(dir: impl Into<PathBuf>, capacity_bytes: u64) -> Self {
        OplogConfig {
            dir: dir.into(),
            capacity_bytes,
            segment_bytes: (capacity_bytes / 8).max(MIN_DEFAULT_SEGMENT_BYTES),
            max_commit_batch_bytes: DEFAULT_MAX_COMMIT_BATCH_BYTES,
        }
    }
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
}

/// Opaque position of a piece's bytes in the log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PieceLocation {
    seq: u64,
    segment: u64,
    data: DataLoc,
}

/// A part of a looked-up range, with one source.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LogPiece {
    pub offset: u64,
    pub length: u64,
    pub source: PieceSource,
}

/// One live index entry handed to the drain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DrainItem {
    pub offset: u64,
    pub length: u64,
    /// A zero record: punch a hole rather than copy bytes.
    pub zero: bool,
    /// The record the entry pointed to, so `complete_drain` leaves parts that newer records
    /// overwrote meanwhile.
    target: Target,
}

/// The write log of one shard. Cheap to clone: clones share the same log.
pub struct Oplog<O: FileOpener> {
    inner: Rc<Inner<O>>,
}

impl<O: FileOpener> Clone for Oplog<O> {
    fn clone(&self) -> Self {
        Oplog {
            inner: self.inner.clone(),
        }
    }
}

struct Inner<O: FileOpener> {
    opener: O,
    config: OplogConfig,
    state: RefCell<State<O::File>>,
    /// Woken when segments are freed, when the log fails, and after commits while writers
    /// wait for space (a commit can supersede every entry of an old segment).
    space: Notify,
    /// Woken when a commit takes the pending records, leaving room for new ones.
    batch_room: Notify,
    /// Woken when `needs_drain()` may have become true.
    drain: Notify,
}

struct Segment<F> {
    path: PathBuf,
    /// Open once the file exists: replayed segments at open, new ones by their first commit.
    file: Option<Rc<F>>,
    /// Bytes given to records, including those of batches not yet committed.
    bytes: u64,
    /// Batches for this segment that are pending or committing: it may not be freed.
    batches: u32,
}

impl<F> Segment<F> {
    fn new(path: PathBuf) -> Self {
        Segment {
            path,
            file: None,
            bytes: 0,
            batches: 0,
        }
    }
}

struct State<F> {
    /// By id (the first sequence number): iteration order is age order.
    segments: BTreeMap<u64, Segment<F>>,
    /// The segment new records go to; `None` makes the next record open a new one.
    active: Option<u64>,
    next_seq: u64,
    index: Index,
    /// Sum of `Segment::bytes`: what the capacity limits.
    usage: u64,
    /// Records appended but not yet committing, in batches of one segment each.
    pending: VecDeque<Batch>,
    pending_bytes: u64,
    committing: bool,
    /// Set when a commit or a segment deletion failed: no more records are taken.
    failed: Option<String>,
    space_waiters: usize,
    /// One task frees segments at a time, so deletions stay strictly in age order.
    freeing: bool,
    /// Segments holding the entries of the latest `drain_batch`: if one is freed before the
    /// drain reads it, its handle moves to `retired` so `read_drain_item` can still read the
    /// (unlinked) file.
    drain_pinned: BTreeSet<u64>,
    retired: BTreeMap<u64, (Rc<F>, PathBuf)>,
    /// Files of freed segments kept for reuse (at most `files::MAX_SPARE_SEGMENTS`).
    spares: Vec<PathBuf>,
    /// Highest serial given to a spare file so far.
    spare_serial: u64,
}

impl<F> State<F> {
    /// The segment a record of `bytes` goes to: the active one if it has room (or is empty),
    /// else a new one named after the record's sequence number.
    fn segment_for(
        &mut self,
        bytes: u64,
        seq: u64,
        dir: &Path,
        segment_bytes: u64,
    ) -> (u64, &mut Segment<F>) {
        let fits = |s: &Segment<F>| s.bytes == 0 || s.bytes.saturating_add(bytes) <= segment_bytes;
        let current = self
            .active
            .filter(|id| self.segments.get(id).is_some_and(fits));
        let id = current.unwrap_or(seq);
        self.active = Some(id);
        let segment = self
            .segments
            .entry(id)
            .or_insert_with(|| Segment::new(format::segment_path(dir, id)));
        (id, segment)
    }

    fn file(&self, segment: u64) -> Option<(Rc<F>, PathBuf)> {
        if let Some(s) = self.segments.get(&segment) {
            return s.file.clone().map(|f| (f, s.path.clone()));
        }
        self.retired.get(&segment).cloned()
    }
}

/// How a durable record changes the index: `[start, end)` now reads from the target, or from
/// the extent store (`None`, a barrier). Shared by commit and replay, so both build the same
/// index from the same records.
#[derive(Clone, Copy, Debug)]
struct IndexUpdate {
    start: u64,
    end: u64,
    target: Option<Target>,
}

impl IndexUpdate {
    fn for_record(header: &Header, segment: u64, file_offset: u64) -> Self {
        let start = header.offset;
        let end = header.offset + u64::from(header.length);
        let data = DataLoc {
            file_offset,
            record_offset: header.offset,
            record_length: u64::from(header.length),
            chunks: header.chunks,
        };
        let target = match header.kind {
            RecordKind::Write => Some(Target {
                seq: header.seq,
                segment,
                data: Some(data),
            }),
            RecordKind::Zero => Some(Target {
                seq: header.seq,
                segment,
                data: None,
            }),
            RecordKind::Barrier => None,
        };
        IndexUpdate { start, end, target }
    }

    fn apply(&self, index: &mut Index) {
        index.apply(self.start, self.end, self.target);
    }
}

impl<O: FileOpener + 'static> Oplog<O> {
    /// Opens the log in `config.dir` (created if missing), replays its segments and appends
    /// after them. A torn tail left by a crash is cut off.
    pub async fn open(opener: O, config: OplogConfig) -> Result<Self, OplogError> {
        files::create_dir(&config.dir).await?;
        let replayed = replay::replay(&opener, &config.dir).await?;
        // The directory entries of the replayed files (a reused empty segment among them) and
        // a truncation must be durable before records in them are acknowledged.
        files::sync_dir(&config.dir).await?;
        let state = State {
            segments: replayed.segments,
            active: replayed.active,
            next_seq: replayed.next_seq,
            index: replayed.index,
            usage: replayed.usage,
            pending: VecDeque::new(),
            pending_bytes: 0,
            committing: false,
            failed: None,
            space_waiters: 0,
            freeing: false,
            drain_pinned: BTreeSet::new(),
            retired: BTreeMap::new(),
            spare_serial: replayed
                .spares
                .iter()
                .map(|(serial, _)| *serial)
                .max()
                .unwrap_or(0),
            spares: replayed.spares.into_iter().map(|(_, path)| path).collect(),
        };
        let inner = Inner {
            opener,
            config,
            state: RefCell::new(state),
            space: Notify::new(),
            batch_room: Notify::new(),
            drain: Notify::new(),
        };
        let oplog = Oplog {
            inner: Rc::new(inner),
        };
        // Segments whose records were all superseded before the crash hold nothing useful.
        oplog.inner.free_segments().await?;
        Ok(oplog)
    }

    /// Appends `data` at vdisk `offset`. Returns once the record is durable and indexed;
    /// waits for space while the log is full.
    pub async fn write(&self, offset: u64, data: Bytes) -> Result<(), OplogError> {
        let length = data.len() as u64;
        if length == 0 {
            return Ok(());
        }
        check_range(offset, length)?;
        let record_bytes = format::write_record_bytes(length);
        if record_bytes > self.inner.config.capacity_bytes {
            return Err(OplogError::TooLarge {
                length: record_bytes,
                capacity: self.inner.config.capacity_bytes,
            });
        }
        let length =
            u32::try_from(length).map_err(|_| OplogError::InvalidRange { offset, length })?;
        self.inner
            .submit(RecordKind::Write, offset, length, &data)
            .await
    }

    /// Makes `[offset, offset+length)` read as zeros.
    pub async fn write_zeroes(&self, offset: u64, length: u64) -> Result<(), OplogError> {
        self.submit_range(RecordKind::Zero, offset, length).await
    }

    /// Records that the extent store holds newer, synced data for the range than any record
    /// in the log: the range leaves the index, and replay will not resurrect older records.
    pub async fn barrier(&self, offset: u64, length: u64) -> Result<(), OplogError> {
        self.submit_range(RecordKind::Barrier, offset, length).await
    }

    async fn submit_range(
        &self,
        kind: RecordKind,
        offset: u64,
        length: u64,
    ) -> Result<(), OplogError> {
        check_range(offset, length)?;
        let mut done = 0;
        while done < length {
            let part = (length - done).min(MAX_RANGE_RECORD_BYTES);
            // `part` is at most MAX_RANGE_RECORD_BYTES, which fits in a u32.
            let part32 =
                u32::try_from(part).map_err(|_| OplogError::InvalidRange { offset, length })?;
            self.inner.submit(kind, offset + done, part32, &[]).await?;
            done += part;
        }
        Ok(())
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
            let source = match span.target.data {
                Some(data) => PieceSource::Data {
                    location: PieceLocation {
                        seq: span.target.seq,
                        segment: span.target.segment,
                        data,
                    },
                },
                None => PieceSource::Zero,
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
    /// log bytes for `Data`, zeros for `Zero`; `Absent` leaves it untouched. `Stale` means a
    /// drain freed the record since the lookup: look up again.
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
        }
    }

    /// Live entries to move to the extent store: those of the oldest segments first (so
    /// space is freed oldest-first), about `max_bytes` of data (at least one entry), sorted by
    /// offset. Zero entries cost nothing towards `max_bytes`.
    pub fn drain_batch(&self, max_bytes: u64) -> Vec<DrainItem> {
        let mut state = self.inner.state.borrow_mut();
        let state = &mut *state;
        state.retired.clear();
        state.drain_pinned.clear();
        let mut items = Vec::new();
        let mut bytes = 0u64;
        'segments: for (segment, spans) in state.index.segments() {
            state.drain_pinned.insert(segment);
            for span in spans {
                let cost = if span.target.data.is_some() {
                    span.end - span.start
                } else {
                    0
                };
                if !items.is_empty() && bytes.saturating_add(cost) > max_bytes {
                    break 'segments;
                }
                bytes += cost;
                items.push(DrainItem {
                    offset: span.start,
                    length: span.end - span.start,
                    zero: span.target.data.is_none(),
                    target: span.target,
                });
            }
            if bytes >= max_bytes {
                break;
            }
        }
        items.sort_by_key(|item| item.offset);
        items
    }

    /// The bytes of a drain item (zeros for a zero item), checksum-verified.
    pub async fn read_drain_item(&self, item: &DrainItem) -> Result<Bytes, OplogError> {
        let length = usize::try_from(item.length).map_err(|_| OplogError::InvalidRange {
            offset: item.offset,
            length: item.length,
        })?;
        let mut buf = vec![0u8; length];
        if let Some(data) = &item.target.data {
            self.inner
                .read_data(
                    item.target.segment,
                    item.target.seq,
                    data,
                    item.offset,
                    &mut buf,
                )
                .await?;
        }
        Ok(Bytes::from(buf))
    }

    /// Called once the items' data is durable in the extent store: drops the index entries
    /// still pointing at the same records (parts overwritten meanwhile stay), frees segments
    /// that hold nothing live any more (oldest first) and wakes writers waiting for space.
    pub async fn complete_drain(&self, items: &[DrainItem]) -> Result<(), OplogError> {
        {
            let mut state = self.inner.state.borrow_mut();
            for item in items {
                let end = item.offset.saturating_add(item.length);
                state
                    .index
                    .remove_if_record(item.offset, end, item.target.seq);
            }
            state.drain_pinned.clear();
            state.retired.clear();
        }
        self.inner.free_segments().await?;
        Ok(())
    }

    /// Bytes of the segment files, including records waiting for their commit.
    pub fn usage_bytes(&self) -> u64 {
        self.inner.state.borrow().usage
    }

    pub fn capacity_bytes(&self) -> u64 {
        self.inner.config.capacity_bytes
    }

    /// Bytes of vdisk address space the index maps to the log (data and zero entries).
    pub fn live_bytes(&self) -> u64 {
        self.inner.state.borrow().index.live_bytes()
    }

    /// No live entry: every acknowledged write is in the extent store.
    pub fn is_empty(&self) -> bool {
        self.inner.state.borrow().index.is_empty()
    }

    /// A drain would help now: live data is above half the capacity, or writers wait for
    /// space. Never true for an empty log, where a drain could not free anything (segments
    /// holding only superseded records are freed by the waiting writers themselves).
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

    /// Deletes every segment and the directory. Only for an empty log with no write under
    /// way (else `NotEmpty`); other clones of this handle must not be used afterwards.
    pub async fn destroy(self) -> Result<(), OplogError> {
        self.inner.destroy().await
    }

    /// The log directory.
    pub fn dir(&self) -> &Path {
        &self.inner.config.dir
    }
}

impl<O: FileOpener> Inner<O> {
    fn needs_drain(&self) -> bool {
        let state = self.state.borrow();
        !state.index.is_empty()
            && (state.index.live_data_bytes() > self.config.capacity_bytes / 2
                || state.space_waiters > 0)
    }

    fn failed_error(&self, reason: &str) -> OplogError {
        OplogError::Failed {
            path: self.config.dir.clone(),
            reason: reason.to_string(),
        }
    }
}

/// Ranges must stay inside the 64-bit address space.
fn check_range(offset: u64, length: u64) -> Result<(), OplogError> {
    match offset.checked_add(length) {
        Some(_) => Ok(()),
        None => Err(OplogError::InvalidRange { offset, length }),
    }
}

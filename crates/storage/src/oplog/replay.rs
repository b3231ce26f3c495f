//! Rebuilding the index at open (format version 3), telling a torn tail from corruption.
//!
//! 1. Every segment file is synced (what a process that died left in the page cache must not
//!    be trusted before it is durable), then its header is read: of its two copies, a valid
//!    one with the highest generation wins (a damaged copy is rewritten from the other). Active segments are
//!    replayed in id (age) order; spares are never read beyond their header.
//! 2. Each active segment is scanned from its first batch: a batch whose header checks out
//!    (CRC, this log, this incarnation, a number above the previous one) is read whole and its
//!    records checked (record header against the table, payload CRCs). Where no such batch
//!    starts, the scan looks at every later block for the next one (`resync`), leaving a gap.
//! 3. The batches are walked in order, as one chain of batch numbers. A batch below the
//!    expected number is void (cut off by an earlier seal). Batches missing from the chain
//!    (a gap) and batches with a bad record are *anomalies*. A batch numbered `m` was durable
//!    for sure if a later batch vouches for it (`BatchHeader::vouches_through`: a batch
//!    written with `w` batches in flight proves every batch up to `number - w` was durable);
//!    then the anomaly is corruption of acknowledged data: the rotted records' ranges become
//!    lost entries, a missing batch is recovered from its records' own headers, and replay
//!    goes on. Otherwise the anomaly lies in the last in-flight window before a crash: a torn
//!    tail, and it and everything after it are discarded.
//! 4. A torn tail is made explicit before the log is used: a seal is written where the torn
//!    part starts (so the log never again reads what lies behind it, and later batches do not
//!    turn it into "corruption"), and segments holding nothing of the chain are freed.
//!
//! Sequence numbers, batch numbers and segment ids continue above everything seen in any
//! header (segment headers of spares included), so they never go back.

use super::error::{io_error, OplogError};
use super::files;
use super::format::{
    bad_chunks, batch_header_bytes, pad_to_block, payload_start, BatchHeader, RecordHeader,
    RecordKind, SegmentHeader, SegmentState, TableEntry, BATCH_FIXED_BYTES, BATCH_MAGIC,
    BLOCK_BYTES, CHUNK_BYTES, RECORD_HEADER_BYTES, SEGMENT_HEADER_BYTES,
};
use super::index::{Index, LostCause, LostLoc};
use super::reach::ReplayReach;
use super::state::{FileHandle, Handle, IndexUpdate, Segment, SegmentKind, Spare, State};
use super::{Damage, LostRange, OplogConfig, ReplayReport, SegmentId, TornTail};
use crate::fs::{DiskFile, Filesystem};
use std::collections::BTreeSet;
use std::io;
use std::path::{Path, PathBuf};

/// Segments are read through a window of this size.
const WINDOW_BYTES: u64 = 1 << 20;

/// Next numbers: above everything seen.
#[derive(Clone, Copy, Debug)]
struct Floors {
    seq: u64,
    batch: u64,
    segment: u64,
}

impl Floors {
    fn header(&mut self, h: &SegmentHeader) {
        self.seq = self.seq.max(h.seq_floor);
        self.batch = self.batch.max(h.batch_floor);
        self.segment = self.segment.max(h.segment_id.saturating_add(1));
    }

    fn batch(&mut self, h: &BatchHeader) {
        let next_seq = if h.seal {
            h.first_seq
        } else {
            h.first_seq + u64::from(h.count)
        };
        self.seq = self.seq.max(next_seq);
        self.batch = self.batch.max(h.number.saturating_add(1));
        self.segment = self.segment.max(h.segment_id.saturating_add(1));
    }

    fn record(&mut self, h: &RecordHeader) {
        self.seq = self.seq.max(h.seq.saturating_add(1));
    }
}

/// A segment file whose header was read.
struct FileInfo<F> {
    handle: Handle<F>,
    len: u64,
    header: SegmentHeader,
    /// A header slot to rewrite from the chosen header.
    repair: Option<u64>,
}

/// An active segment after its scan.
struct Scan<F> {
    id: SegmentId,
    info: FileInfo<F>,
    units: Vec<Unit>,
}

enum Unit {
    Batch(Scanned),
    /// No batch of this incarnation starts in `[start, end)`.
    Gap {
        start: u64,
        end: u64,
    },
}

/// A batch whose header checked out.
struct Scanned {
    pos: u64,
    header: BatchHeader,
    records: Vec<ScannedRecord>,
}

impl Scanned {
    fn is_bad(&self) -> bool {
        self.records
            .iter()
            .any(|r| !matches!(r.status, RecordStatus::Good(_)))
    }
}

struct ScannedRecord {
    /// What the table says (for a record recovered without a table: what its header says).
    entry: TableEntry,
    seq: u64,
    /// File offset of the record header.
    at: u64,
    status: RecordStatus,
}

enum RecordStatus {
    Good(RecordHeader),
    /// The header fails its checks or disagrees with the table.
    BadHeader(String),
    /// Good header; these payload chunks fail their CRCs.
    BadChunks(RecordHeader, Vec<u64>),
}

pub(super) async fn replay<F: Filesystem>(
    fs: &F,
    config: &OplogConfig,
    listed: Vec<(u64, PathBuf)>,
) -> Result<(State<F::File>, ReplayReport), OplogError> {
    let mut report = ReplayReport::default();
    let mut floors = Floors {
        seq: 1,
        batch: 1,
        segment: 1,
    };
    let next_serial = listed.last().map_or(1, |(serial, _)| serial + 1);
    let headers = read_headers(fs, config, listed, &mut report, &mut floors).await?;
    let mut scans = Vec::with_capacity(headers.actives.len());
    for info in headers.actives {
        let id = SegmentId(info.header.segment_id);
        let units = scan_segment(&info, id, config.log_id, &mut floors)
            .await
            .map_err(|e| io_error(&info.handle.path, e))?;
        scans.push(Scan { id, info, units });
    }

    let mut walk = Walk::new(&scans, ReplayReach::new(config.replay_reach_granule_bytes));
    walk.run(&mut floors).await?;
    report.lost.append(&mut walk.lost);
    report.repaired.append(&mut walk.repaired);
    let chain = Chain {
        segments: std::mem::take(&mut walk.chain),
        last_number: walk.last_number,
        end: walk.chain_end,
        tear: walk.tear,
    };
    let (index, reach) = (walk.index, walk.reach);
    if let Some((tsi, pos, batches)) = chain.tear {
        report.torn.push(TornTail {
            path: scans[tsi].info.handle.path.clone(),
            file_offset: pos,
            batches,
        });
    }

    let mut state = State::new(
        floors.seq,
        chain.last_number.map_or(floors.batch, |n| n + 1),
        floors.segment,
        next_serial,
        reach,
    );
    state.index = index;
    state.last_batch = chain.last_number.unwrap_or(state.last_batch);
    let (to_free, seal_at) = assign_segments(&mut state, scans, &chain, config).await?;
    // Free what holds nothing of the chain first, then seal: a crash in between leaves the
    // torn tail as it was, to be found again.
    let mut spares = headers.spares;
    spares.extend(free_at_open(config, to_free, &floors).await?);
    if let Some((id, pos, first_batch)) = seal_at {
        seal_torn_tail(&mut state, config, id, pos, first_batch).await?;
    }
    keep_spares(fs, config, &mut state, spares, &headers.unusable).await?;
    Ok((state, report))
}

/// The segment files by what their headers say.
struct Headers<F> {
    /// Active segments, by segment id.
    actives: Vec<FileInfo<F>>,
    spares: Vec<FileInfo<F>>,
    /// Files with no readable header and no batch: deleted.
    unusable: Vec<PathBuf>,
}

async fn read_headers<F: Filesystem>(
    fs: &F,
    config: &OplogConfig,
    listed: Vec<(u64, PathBuf)>,
    report: &mut ReplayReport,
    floors: &mut Floors,
) -> Result<Headers<F::File>, OplogError> {
    let mut headers = Headers {
        actives: Vec::new(),
        spares: Vec::new(),
        unusable: Vec::new(),
    };
    for (_, path) in listed {
        match read_file_header(fs, config, &path, report).await? {
            Some(info) => {
                floors.header(&info.header);
                match info.header.state {
                    SegmentState::Active => headers.actives.push(info),
                    SegmentState::Spare => headers.spares.push(info),
                }
            }
            None => headers.unusable.push(path),
        }
    }
    headers.actives.sort_by_key(|info| info.header.segment_id);
    if let Some(pair) = headers
        .actives
        .windows(2)
        .find(|w| w[0].header.segment_id == w[1].header.segment_id)
    {
        return Err(OplogError::Corrupt {
            path: pair[1].handle.path.clone(),
            file_offset: 0,
            reason: format!(
                "segment id {} is also claimed by {}",
                pair[1].header.segment_id,
                pair[0].handle.path.display()
            ),
        });
    }
    Ok(headers)
}

/// What the walk found: the segments (scan indices) holding its chain, its last batch number,
/// where it ends (segment, position, ends with a seal), and a torn tail (segment, position,
/// batches discarded).
struct Chain {
    segments: BTreeSet<usize>,
    last_number: Option<u64>,
    end: Option<(usize, u64, bool)>,
    tear: Option<(usize, u64, u64)>,
}

/// Gives each active segment its role: kept (it holds part of the chain; the tail if the
/// chain ended cleanly in it), `next` (the first empty one after the chain), or to be freed
/// (void, torn, or extra empty ones). Repairs the header slots of those kept. Returns those to
/// free and where to seal a torn tail (segment, position, its first batch).
#[allow(clippy::type_complexity)]
async fn assign_segments<F: DiskFile>(
    state: &mut State<F>,
    scans: Vec<Scan<F>>,
    chain: &Chain,
    config: &OplogConfig,
) -> Result<(Vec<Scan<F>>, Option<(SegmentId, u64, Option<u64>)>), OplogError> {
    let chain_last_segment = chain.segments.iter().next_back().copied();
    let mut to_free = Vec::new();
    let mut seal_at = None;
    for (si, scan) in scans.into_iter().enumerate() {
        let empty = scan.units.iter().all(|u| matches!(u, Unit::Gap { .. }));
        let after_chain = chain_last_segment.is_none_or(|last| si > last);
        let full_size = scan.info.len == config.segment_bytes;
        let mut segment = Segment {
            handle: scan.info.handle.clone(),
            kind: SegmentKind::V3,
            len: scan.info.len,
            end: SEGMENT_HEADER_BYTES,
            closed: false,
            inflight: 0,
            first_batch: None,
        };
        if chain.segments.contains(&si) {
            segment.end = match chain.end {
                Some((csi, end, _)) if csi == si => end,
                _ => last_unit_end(&scan.units),
            };
            segment.first_batch = scan.units.iter().find_map(|u| match u {
                Unit::Batch(b) => Some(b.header.segment_first_batch),
                Unit::Gap { .. } => None,
            });
            segment.closed = true;
            match (chain.tear, chain.end) {
                (Some((tsi, pos, _)), _) if tsi == si => {
                    seal_at = Some((scan.id, pos, segment.first_batch))
                }
                (None, Some((csi, _, false))) if csi == si && full_size => {
                    // A clean end: appends continue right after it.
                    segment.closed = false;
                    state.tail = Some(scan.id);
                }
                _ => {}
            }
        } else if empty && after_chain && state.next.is_none() && full_size {
            state.next = Some(scan.id);
        } else {
            to_free.push(scan);
            continue;
        }
        if let Some(slot) = scan.info.repair {
            repair_slot(&scan.info, slot).await?;
        }
        state.segments.insert(scan.id, segment);
    }
    Ok((to_free, seal_at))
}

/// Frees segments holding nothing of the chain: their headers become spare headers.
async fn free_at_open<F: DiskFile>(
    config: &OplogConfig,
    to_free: Vec<Scan<F>>,
    floors: &Floors,
) -> Result<Vec<FileInfo<F>>, OplogError> {
    let mut freed = Vec::with_capacity(to_free.len());
    for scan in to_free {
        let generation = scan.info.handle.generation.get() + 1;
        let header = files::spare_header(config, generation, scan.id.0, floors.seq, floors.batch);
        files::write_header(&scan.info.handle.file, &header)
            .await
            .map_err(|e| io_error(&scan.info.handle.path, e))?;
        scan.info.handle.generation.set(generation);
        tracing::info!(path = %scan.info.handle.path.display(), "oplog segment holding nothing of the log freed at open");
        freed.push(FileInfo {
            header,
            repair: None,
            ..scan.info
        });
    }
    Ok(freed)
}

/// Writes a seal where a torn tail starts, in a segment that holds the chain before it.
async fn seal_torn_tail<F: DiskFile>(
    state: &mut State<F>,
    config: &OplogConfig,
    id: SegmentId,
    pos: u64,
    first_batch: Option<u64>,
) -> Result<(), OplogError> {
    let number = state.next_batch;
    state.next_batch += 1;
    let header = BatchHeader {
        seal: true,
        log_id: config.log_id,
        segment_id: id.0,
        segment_first_batch: first_batch.unwrap_or(number),
        number,
        prev: state.last_batch,
        first_seq: state.next_seq,
        count: 0,
        bytes: BLOCK_BYTES as u32,
        window: 1,
    };
    let segment = state.segments.get(&id).expect("the sealed segment is kept");
    let block = files::seal_block(&header);
    segment
        .handle
        .file
        .write_durable_at(block.as_slice(), pos)
        .await
        .map_err(|e| io_error(&segment.handle.path, e))?;
    state.last_batch = number;
    Ok(())
}

/// Keeps the spare files the configuration allows (repairing their headers), deletes the
/// others and the unusable files. At least one file is always kept (its floors).
async fn keep_spares<F: Filesystem>(
    fs: &F,
    config: &OplogConfig,
    state: &mut State<F::File>,
    spares: Vec<FileInfo<F::File>>,
    unusable: &[PathBuf],
) -> Result<(), OplogError> {
    for path in unusable {
        files::remove_durably(fs, &config.dir, path)
            .await
            .map_err(|e| io_error(path, e))?;
    }
    let mut kept = Vec::new();
    for info in spares {
        let files_now = state.segments.len() + kept.len();
        let wrong_size = info.len != config.segment_bytes;
        let too_many =
            kept.len() >= config.max_spare_segments || files_now >= config.max_segments();
        if (wrong_size || too_many) && files_now > 0 {
            tracing::info!(path = %info.handle.path.display(), wrong_size, "deleting a spare oplog segment file");
            files::remove_durably(fs, &config.dir, &info.handle.path)
                .await
                .map_err(|e| io_error(&info.handle.path, e))?;
            continue;
        }
        if let Some(slot) = info.repair {
            repair_slot(&info, slot).await?;
        }
        kept.push(Spare {
            last_id: SegmentId(info.header.segment_id),
            len: info.len,
            handle: info.handle,
        });
    }
    state.files = state.segments.len() + kept.len();
    for spare in kept {
        state.add_spare(spare);
    }
    Ok(())
}

fn last_unit_end(units: &[Unit]) -> u64 {
    units
        .iter()
        .rev()
        .find_map(|u| match u {
            Unit::Batch(b) => Some(b.pos + u64::from(b.header.bytes)),
            Unit::Gap { .. } => None,
        })
        .unwrap_or(SEGMENT_HEADER_BYTES)
}

async fn repair_slot<F: DiskFile>(info: &FileInfo<F>, slot: u64) -> Result<(), OplogError> {
    files::write_header_slot(&info.handle.file, slot, &info.header)
        .await
        .map_err(|e| io_error(&info.handle.path, e))
}

/// Opens a segment file and picks its header. `None` for a file both of whose header copies
/// are unreadable and that holds no batch of this log (a file whose preparation was cut
/// short): it is deleted.
async fn read_file_header<F: Filesystem>(
    fs: &F,
    config: &OplogConfig,
    path: &Path,
    report: &mut ReplayReport,
) -> Result<Option<FileInfo<F::File>>, OplogError> {
    let file = fs.open(path, false).await.map_err(|e| io_error(path, e))?;
    // What replay reads may be writes of a process that died before they were durable (they
    // survive in the page cache): make them durable before anything is built on them.
    file.sync_data().await.map_err(|e| io_error(path, e))?;
    let len = file.len().await.map_err(|e| io_error(path, e))?;
    let mut head = vec![0u8; SEGMENT_HEADER_BYTES as usize];
    file.read_at(&mut head, 0)
        .await
        .map_err(|e| io_error(path, e))?;
    let slot0 = SegmentHeader::decode(&head[..BLOCK_BYTES as usize]);
    let slot1 = SegmentHeader::decode(&head[BLOCK_BYTES as usize..]);
    let mut damaged = |slot: u64, reason: &str| {
        report.repaired.push(Damage {
            path: path.to_path_buf(),
            file_offset: slot * BLOCK_BYTES,
            reason: format!(
                "copy {slot} of the segment header is unreadable ({reason}): torn by a crash or \
                 corrupt; rewritten from the other copy"
            ),
        })
    };
    let (header, repair) = match (slot0, slot1) {
        // Slot 1 is written first: a newer slot 1 is a header change cut short.
        (Ok(a), Ok(b)) if b.generation > a.generation => (b, Some(0)),
        (Ok(a), Ok(b)) => (a, (a != b).then_some(1)),
        (Ok(a), Err(e)) => {
            damaged(1, &e);
            (a, Some(1))
        }
        (Err(e), Ok(b)) => {
            damaged(0, &e);
            (b, Some(0))
        }
        (Err(e0), Err(e1)) => {
            let mut reader = Reader::new(&file, len);
            if holds_batches(&mut reader, config.log_id)
                .await
                .map_err(|e| io_error(path, e))?
            {
                return Err(OplogError::LostUnknownRanges {
                    path: path.to_path_buf(),
                    file_offset: 0,
                    reason: format!(
                        "both copies of the segment header are unreadable ({e0}; {e1}) and the \
                         file holds batches of this log: whether they are live is unknown"
                    ),
                });
            }
            tracing::info!(path = %path.display(), "deleting a segment file with no readable header and no batch (its preparation was cut short)");
            return Ok(None);
        }
    };
    if header.log_id != config.log_id {
        return Err(OplogError::ForeignFile {
            path: path.to_path_buf(),
            found: header.log_id,
            expected: config.log_id,
        });
    }
    Ok(Some(FileInfo {
        handle: FileHandle::new(file, path.to_path_buf(), header.generation),
        len,
        header,
        repair,
    }))
}

/// Whether any block of the file starts a valid batch header of this log.
async fn holds_batches<D: DiskFile>(reader: &mut Reader<'_, D>, log_id: u64) -> io::Result<bool> {
    let mut pos = SEGMENT_HEADER_BYTES;
    while pos + BLOCK_BYTES <= reader.len {
        if let Parsed::Batch(b) = read_batch(reader, pos, false).await? {
            if b.header.log_id == log_id {
                return Ok(true);
            }
        }
        pos += BLOCK_BYTES;
    }
    Ok(false)
}

/// Reads the batches of one active segment into units.
async fn scan_segment<D: DiskFile>(
    info: &FileInfo<D>,
    id: SegmentId,
    log_id: u64,
    floors: &mut Floors,
) -> io::Result<Vec<Unit>> {
    let mut reader = Reader::new(&info.handle.file, info.len);
    let mut units = Vec::new();
    let mut pos = SEGMENT_HEADER_BYTES;
    let mut last: Option<u64> = None;
    let ours = |b: &Scanned, last: Option<u64>| {
        b.header.log_id == log_id
            && b.header.segment_id == id.0
            && last.is_none_or(|l| b.header.number > l)
    };
    while pos + BLOCK_BYTES <= info.len {
        let parsed = read_batch(&mut reader, pos, true).await?;
        if let Parsed::Batch(b) = &parsed {
            if b.header.log_id == log_id {
                floors.batch(&b.header);
            }
        }
        match parsed {
            Parsed::Batch(b) if ours(&b, last) => {
                last = Some(b.header.number);
                pos += u64::from(b.header.bytes);
                let seal = b.header.seal;
                units.push(Unit::Batch(b));
                if seal {
                    break;
                }
            }
            _ => {
                // Look for the next batch of this incarnation in the rest of the file.
                let mut next = None;
                let mut at = pos + BLOCK_BYTES;
                while at + BLOCK_BYTES <= info.len {
                    if reader.get(at, 4).await? == BATCH_MAGIC.to_le_bytes() {
                        if let Parsed::Batch(b) = read_batch(&mut reader, at, false).await? {
                            if b.header.log_id == log_id {
                                floors.batch(&b.header);
                            }
                            if ours(&b, last) {
                                next = Some(at);
                                break;
                            }
                        }
                    }
                    at += BLOCK_BYTES;
                }
                let end = next.unwrap_or(info.len);
                units.push(Unit::Gap { start: pos, end });
                match next {
                    Some(at) => pos = at,
                    None => break,
                }
            }
        }
    }
    Ok(units)
}

enum Parsed {
    Batch(Scanned),
    Invalid,
}

/// Reads the batch at `pos`: its header and table, and (with `records`) its records, each
/// checked against the table and its payload CRCs.
async fn read_batch<D: DiskFile>(
    reader: &mut Reader<'_, D>,
    pos: u64,
    records: bool,
) -> io::Result<Parsed> {
    let len = reader.len;
    if pos + BATCH_FIXED_BYTES > len {
        return Ok(Parsed::Invalid);
    }
    let Some(count) = BatchHeader::claimed_count(reader.get(pos, BATCH_FIXED_BYTES).await?) else {
        return Ok(Parsed::Invalid);
    };
    let header_len = batch_header_bytes(u64::from(count));
    if header_len > len - pos {
        return Ok(Parsed::Invalid);
    }
    let Ok((header, table)) = BatchHeader::decode(reader.get(pos, header_len).await?) else {
        return Ok(Parsed::Invalid);
    };
    if u64::from(header.bytes) > len - pos {
        return Ok(Parsed::Invalid);
    }
    let mut scanned = Scanned {
        pos,
        header,
        records: Vec::new(),
    };
    if !records {
        return Ok(Parsed::Batch(scanned));
    }
    let body = reader.get(pos, u64::from(header.bytes)).await?;
    let mut at = header_len as usize;
    for (i, entry) in table.into_iter().enumerate() {
        let seq = header.first_seq + i as u64;
        let bytes = entry.record_bytes() as usize;
        let record = &body[at..at + bytes];
        let status = match RecordHeader::decode(record) {
            Ok(h) if h.matches(&entry, seq) => check_payload(h, record),
            Ok(h) => RecordStatus::BadHeader(format!(
                "the record header ({:?} {}+{} seq {}) disagrees with the batch table ({:?} \
                 {}+{} seq {seq})",
                h.kind, h.offset, h.length, h.seq, entry.kind, entry.offset, entry.length
            )),
            Err(reason) => RecordStatus::BadHeader(reason),
        };
        scanned.records.push(ScannedRecord {
            entry,
            seq,
            at: pos + at as u64,
            status,
        });
        at += bytes;
    }
    Ok(Parsed::Batch(scanned))
}

fn check_payload(header: RecordHeader, record: &[u8]) -> RecordStatus {
    if header.kind != RecordKind::Write {
        return RecordStatus::Good(header);
    }
    let split = payload_start(header.chunks) as usize;
    let bad = bad_chunks(
        &record[RECORD_HEADER_BYTES as usize..split],
        &record[split..],
    );
    if bad.is_empty() {
        RecordStatus::Good(header)
    } else {
        RecordStatus::BadChunks(header, bad)
    }
}

/// The walk over all batches, in order (step 3 of the module comment).
struct Walk<'a, F> {
    scans: &'a [Scan<F>],
    /// Flattened (segment, unit) positions.
    flat: Vec<(usize, usize)>,
    /// The highest batch number vouched for by a batch after each flat position.
    vouch_after: Vec<Option<u64>>,
    index: Index,
    /// Segments holding the write, zero and lost records applied.
    reach: ReplayReach,
    lost: Vec<LostRange>,
    repaired: Vec<Damage>,
    /// The batch number the chain expects next.
    expected: Option<u64>,
    /// The next batch's first sequence number must be at least this.
    min_seq: u64,
    last_number: Option<u64>,
    /// Segments (scan indices) holding applied batches.
    chain: BTreeSet<usize>,
    /// Where the chain's last batch ends: (segment, position, is a seal).
    chain_end: Option<(usize, u64, bool)>,
    /// Where a torn tail starts: (segment, position, batches discarded).
    tear: Option<(usize, u64, u64)>,
}

impl<'a, F: DiskFile> Walk<'a, F> {
    fn new(scans: &'a [Scan<F>], reach: ReplayReach) -> Self {
        let flat: Vec<(usize, usize)> = scans
            .iter()
            .enumerate()
            .flat_map(|(si, s)| (0..s.units.len()).map(move |ui| (si, ui)))
            .collect();
        let mut vouch_after = vec![None; flat.len()];
        let mut best: Option<u64> = None;
        for k in (0..flat.len()).rev() {
            vouch_after[k] = best;
            let (si, ui) = flat[k];
            if let Unit::Batch(b) = &scans[si].units[ui] {
                let v = b.header.vouches_through();
                best = Some(best.map_or(v, |x| x.max(v)));
            }
        }
        Walk {
            scans,
            flat,
            vouch_after,
            index: Index::default(),
            reach,
            lost: Vec::new(),
            repaired: Vec::new(),
            expected: None,
            min_seq: 0,
            last_number: None,
            chain: BTreeSet::new(),
            chain_end: None,
            tear: None,
        }
    }

    fn unit(&self, k: usize) -> &'a Unit {
        let (si, ui) = self.flat[k];
        &self.scans[si].units[ui]
    }

    async fn run(&mut self, floors: &mut Floors) -> Result<(), OplogError> {
        let mut gaps: Vec<usize> = Vec::new();
        for k in 0..self.flat.len() {
            let b = match self.unit(k) {
                Unit::Gap { .. } => {
                    gaps.push(k);
                    continue;
                }
                Unit::Batch(b) => b,
            };
            let si = self.flat[k].0;
            let h = &b.header;
            if self.expected.is_some_and(|e| h.number < e) {
                // Cut off by a seal before it (a torn tail that was sealed at a later open).
                continue;
            }
            if h.last_before() >= self.expected.unwrap_or(h.segment_first_batch)
                && !self.missing_before(k, &gaps, floors).await?
            {
                return Ok(());
            }
            gaps.clear();
            if !h.seal && h.first_seq < self.min_seq {
                return Err(OplogError::Corrupt {
                    path: self.scans[si].info.handle.path.clone(),
                    file_offset: b.pos,
                    reason: format!(
                        "batch {} starts at sequence number {}, below {} of the batches before it",
                        h.number, h.first_seq, self.min_seq
                    ),
                });
            }
            if b.is_bad() && self.vouch_after[k].is_none_or(|v| v < h.number) {
                // Nothing after it proves it was durable: a torn write.
                self.tear_at(k, si, b.pos);
                return Ok(());
            }
            for record in &b.records {
                self.apply(si, record);
            }
            self.expected = Some(h.number + 1);
            self.min_seq = if h.seal {
                h.first_seq
            } else {
                h.first_seq + u64::from(h.count)
            };
            self.last_number = Some(h.number);
            self.chain.insert(si);
            self.chain_end = Some((si, b.pos + u64::from(h.bytes), h.seal));
        }
        Ok(())
    }

    /// Batch `k` follows missing batches (their headers unreadable, or never written). Those
    /// a later batch vouches for were acknowledged: they are recovered from the gaps before
    /// `k`, using their records' own headers. The first one nobody vouches for starts a torn
    /// tail: returns `false` after marking it.
    ///
    /// Missing batches numbered below the segment's first batch lie in the gaps at the end of
    /// earlier segments; the others in the gap at the start of batch `k`'s segment (written in
    /// this incarnation, so records there are never stale ones).
    async fn missing_before(
        &mut self,
        k: usize,
        gaps: &[usize],
        floors: &mut Floors,
    ) -> Result<bool, OplogError> {
        let Unit::Batch(b) = self.unit(k) else {
            unreachable!("missing_before is called for a batch");
        };
        let si = self.flat[k].0;
        let h = &b.header;
        let sfb = h.segment_first_batch;
        let last_missing = h.last_before();
        let vouched = [self.vouch_after[k], Some(h.vouches_through())]
            .into_iter()
            .flatten()
            .max()
            .unwrap_or(0)
            .min(last_missing);
        let earlier: Vec<usize> = gaps
            .iter()
            .copied()
            .filter(|&g| self.flat[g].0 < si)
            .collect();
        let own: Vec<usize> = gaps
            .iter()
            .copied()
            .filter(|&g| self.flat[g].0 == si)
            .collect();
        let mut next = self.expected.unwrap_or(sfb);
        let mut stop = None;
        if next < sfb {
            let through = vouched.min(sfb - 1);
            if through >= next {
                stop = self
                    .recover(
                        &earlier,
                        next,
                        through,
                        self.min_seq,
                        h.first_seq,
                        (si, b.pos),
                        floors,
                    )
                    .await?;
                next = through + 1;
            }
            if next < sfb {
                let at = stop
                    .or_else(|| earlier.first().map(|&g| self.gap_start(g)))
                    .or_else(|| own.first().map(|&g| self.gap_start(g)))
                    .unwrap_or((si, b.pos));
                self.tear_at(k, at.0, at.1);
                return Ok(false);
            }
        }
        if next <= last_missing {
            let mut own_stop = None;
            if vouched >= next {
                let floor = self.scans[si].info.header.seq_floor.max(self.min_seq);
                own_stop = self
                    .recover(&own, next, vouched, floor, h.first_seq, (si, b.pos), floors)
                    .await?;
                next = vouched + 1;
            }
            if next <= last_missing {
                let at = own_stop
                    .or_else(|| own.first().map(|&g| self.gap_start(g)))
                    .unwrap_or((si, b.pos));
                self.tear_at(k, at.0, at.1);
                return Ok(false);
            }
        }
        Ok(true)
    }

    fn gap_start(&self, k: usize) -> (usize, u64) {
        match self.unit(k) {
            Unit::Gap { start, .. } => (self.flat[k].0, *start),
            Unit::Batch(b) => (self.flat[k].0, b.pos),
        }
    }

    /// Discards everything from flat position `k` on: a torn tail starting at `pos` of
    /// segment `si`.
    fn tear_at(&mut self, k: usize, si: usize, pos: u64) {
        let batches = (k..self.flat.len())
            .filter(|&j| matches!(self.unit(j), Unit::Batch(_)))
            .count() as u64;
        self.tear = Some((si, pos, batches));
    }

    /// Recovers the batches numbered `first..=through`, whose headers are unreadable, from
    /// the gaps before the next valid batch, using their records' own headers. Returns where
    /// the last one recovered ends.
    #[allow(clippy::too_many_arguments)]
    async fn recover(
        &mut self,
        gaps: &[usize],
        first: u64,
        through: u64,
        min_seq: u64,
        below_seq: u64,
        next_batch_at: (usize, u64),
        floors: &mut Floors,
    ) -> Result<Option<(usize, u64)>, OplogError> {
        let mut number = first;
        let mut min_seq = min_seq;
        let mut stop = None;
        let mut failed_at = None;
        for &k in gaps {
            let Unit::Gap { start, end } = *self.unit(k) else {
                continue;
            };
            let si = self.flat[k].0;
            let scan = &self.scans[si];
            let mut reader = Reader::new(&scan.info.handle.file, end);
            let mut pos = start;
            while number <= through && pos + BLOCK_BYTES <= end {
                let found = recover_batch(&mut reader, pos, min_seq, below_seq)
                    .await
                    .map_err(|e| io_error(&scan.info.handle.path, e))?;
                let Some((records, batch_end)) = found else {
                    failed_at = failed_at.or(Some((si, pos)));
                    break;
                };
                self.repaired.push(Damage {
                    path: scan.info.handle.path.clone(),
                    file_offset: pos,
                    reason: format!(
                        "the header of batch {number} is unreadable; its {} records were \
                         recovered from their own headers",
                        records.len()
                    ),
                });
                for record in &records {
                    if let RecordStatus::Good(h) | RecordStatus::BadChunks(h, _) = &record.status {
                        floors.record(h);
                        min_seq = h.seq + 1;
                    }
                    self.apply(si, record);
                }
                self.min_seq = self.min_seq.max(min_seq);
                self.chain.insert(si);
                self.last_number = Some(number);
                self.chain_end = Some((si, batch_end, false));
                pos = batch_end;
                number += 1;
                stop = Some((si, pos));
            }
            if number > through {
                break;
            }
        }
        if number <= through {
            // Where the first batch that could not be located should have been: in the first
            // gap, or (no gap at all) right before the batch after them.
            let (si, pos) = failed_at
                .or_else(|| gaps.first().map(|&g| self.gap_start(g)))
                .unwrap_or(next_batch_at);
            return Err(OplogError::LostUnknownRanges {
                path: self.scans[si].info.handle.path.clone(),
                file_offset: pos,
                reason: format!(
                    "acknowledged batches {number}..={through} cannot be read: their batch \
                     headers and record headers are unreadable"
                ),
            });
        }
        Ok(stop)
    }

    /// Applies one record to the index, turning rotted parts into lost entries.
    fn apply(&mut self, si: usize, record: &ScannedRecord) {
        let scan = &self.scans[si];
        let path = &scan.info.handle.path;
        let segment = scan.id;
        let entry = record.entry;
        match &record.status {
            RecordStatus::Good(h) => {
                self.apply_update(IndexUpdate::for_record(h, segment, record.at))
            }
            RecordStatus::BadChunks(h, bad) => {
                self.apply_update(IndexUpdate::for_record(h, segment, record.at));
                let payload_at = record.at + payload_start(h.chunks);
                // Runs of consecutive bad chunks become one lost range each.
                let mut i = 0;
                while i < bad.len() {
                    let mut j = i;
                    while j + 1 < bad.len() && bad[j + 1] == bad[j] + 1 {
                        j += 1;
                    }
                    let start = h.offset + bad[i] * CHUNK_BYTES;
                    let end = (h.offset + (bad[j] + 1) * CHUNK_BYTES).min(h.offset + h.length);
                    let file_offset = payload_at + bad[i] * CHUNK_BYTES;
                    self.lose(
                        path,
                        segment,
                        h.seq,
                        start,
                        end,
                        file_offset,
                        LostCause::PayloadChunk,
                    );
                    i = j + 1;
                }
            }
            RecordStatus::BadHeader(reason) => {
                let seq = record.seq;
                match entry.kind {
                    RecordKind::Write => {
                        self.lose(
                            path,
                            segment,
                            seq,
                            entry.offset,
                            entry.offset + entry.length,
                            record.at,
                            LostCause::RecordHeader,
                        );
                    }
                    RecordKind::Zero | RecordKind::Barrier => {
                        // No payload: the table says all the record said.
                        let header = RecordHeader::new(entry.kind, seq, entry.offset, entry.length);
                        self.apply_update(IndexUpdate::for_record(&header, segment, record.at));
                        self.repaired.push(Damage {
                            path: path.clone(),
                            file_offset: record.at,
                            reason: format!(
                                "the header of a {:?} record is unreadable ({reason}); the batch \
                                 table gave its range",
                                entry.kind
                            ),
                        });
                    }
                }
            }
        }
    }

    /// Applies a record's update to the index and notes what its segment holds.
    fn apply_update(&mut self, update: IndexUpdate) {
        if let Some(target) = update.target {
            self.reach.note(update.start, update.end, target.segment);
        }
        update.apply(&mut self.index);
    }

    #[allow(clippy::too_many_arguments)]
    fn lose(
        &mut self,
        path: &Path,
        segment: SegmentId,
        seq: u64,
        start: u64,
        end: u64,
        file_offset: u64,
        cause: LostCause,
    ) {
        self.apply_update(IndexUpdate::lost(
            start,
            end,
            seq,
            segment,
            LostLoc { file_offset, cause },
        ));
        self.lost.push(LostRange {
            offset: start,
            length: end - start,
            path: path.to_path_buf(),
            file_offset,
            reason: cause.describe().into(),
        });
    }
}

/// Tries to read a batch with an unreadable header at `pos` from its records' own headers:
/// the table holds `c` entries for some `c`, so the first record header sits at
/// `BATCH_FIXED_BYTES + 24c`; `c` consecutive valid record headers (sequence numbers in
/// `[min_seq, below_seq)`, consecutive) must follow. Returns the records and where the batch
/// ends. `None` if there is no such batch (a valid header of another incarnation, zeros, or
/// records too damaged to locate).
async fn recover_batch<D: DiskFile>(
    reader: &mut Reader<'_, D>,
    pos: u64,
    min_seq: u64,
    below_seq: u64,
) -> io::Result<Option<(Vec<ScannedRecord>, u64)>> {
    let end = reader.len;
    if let Parsed::Batch(_) = read_batch(reader, pos, false).await? {
        // A readable header (of a stale incarnation): not a rotted batch of this one.
        return Ok(None);
    }
    let room = end - pos;
    if room < BATCH_FIXED_BYTES + RECORD_HEADER_BYTES {
        return Ok(None);
    }
    let max_count = (room - BATCH_FIXED_BYTES - RECORD_HEADER_BYTES) / (24 + RECORD_HEADER_BYTES);
    let claimed = u64::from(super::format::le_u32(
        reader.get(pos, BATCH_FIXED_BYTES).await?,
        56,
    ));
    let candidates = std::iter::once(claimed)
        .filter(|&c| (1..=max_count).contains(&c))
        .chain((1..=max_count).filter(|&c| c != claimed));
    for count in candidates {
        let first_at = pos + batch_header_bytes(count);
        // Cheap filter before walking: a record header must start there.
        let Ok(first) = RecordHeader::decode(reader.get(first_at, RECORD_HEADER_BYTES).await?)
        else {
            continue;
        };
        if first.seq < min_seq || first.seq >= below_seq {
            continue;
        }
        if let Some(found) = walk_records(reader, pos, first_at, count, below_seq).await? {
            return Ok(Some(found));
        }
    }
    Ok(None)
}

async fn walk_records<D: DiskFile>(
    reader: &mut Reader<'_, D>,
    pos: u64,
    first_at: u64,
    count: u64,
    below_seq: u64,
) -> io::Result<Option<(Vec<ScannedRecord>, u64)>> {
    let end = reader.len;
    let mut at = first_at;
    let mut records = Vec::new();
    let mut expected_seq = None;
    for _ in 0..count {
        if at + RECORD_HEADER_BYTES > end {
            return Ok(None);
        }
        let Ok(h) = RecordHeader::decode(reader.get(at, RECORD_HEADER_BYTES).await?) else {
            return Ok(None);
        };
        if expected_seq.is_some_and(|s| s != h.seq) || h.seq >= below_seq {
            return Ok(None);
        }
        expected_seq = Some(h.seq + 1);
        let bytes = h.record_bytes();
        if at + bytes > end {
            return Ok(None);
        }
        let record = reader.get(at, bytes).await?;
        records.push(ScannedRecord {
            entry: TableEntry {
                kind: h.kind,
                offset: h.offset,
                length: h.length,
            },
            seq: h.seq,
            at,
            status: check_payload(h, record),
        });
        at += bytes;
    }
    let batch_end = pos + pad_to_block(at - pos);
    Ok((batch_end <= end).then_some((records, batch_end)))
}

/// A read-ahead buffer over a file: serves byte ranges from one larger read.
struct Reader<'a, D> {
    file: &'a D,
    len: u64,
    start: u64,
    data: Vec<u8>,
}

impl<'a, D: DiskFile> Reader<'a, D> {
    fn new(file: &'a D, len: u64) -> Self {
        Reader {
            file,
            len,
            start: 0,
            data: Vec::new(),
        }
    }

    /// `[pos, pos+n)`, which must lie within the first `len` bytes of the file.
    async fn get(&mut self, pos: u64, n: u64) -> io::Result<&[u8]> {
        assert!(
            pos + n <= self.len,
            "read of {n} bytes at {pos} past {}",
            self.len
        );
        let cached_end = self.start + self.data.len() as u64;
        if pos < self.start || pos + n > cached_end {
            let start = pos / BLOCK_BYTES * BLOCK_BYTES;
            let want = (pos + n - start).max(WINDOW_BYTES).min(self.len - start);
            self.data.resize(want as usize, 0);
            self.file.read_at(&mut self.data, start).await?;
            self.start = start;
        }
        let at = (pos - self.start) as usize;
        Ok(&self.data[at..at + n as usize])
    }
}

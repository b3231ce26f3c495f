//! The block log of extent store format 3 (docs/extent-store-log-proposal.md, "Shape" and "The
//! journal"): drained whole blocks are appended, 254 at a time, to segment files instead of
//! being written at home in their egroups, and each chunk's summary is the journal entry that
//! replay turns into checksum-table entries after a crash.
//!
//! On disk, per disk and vdisk: `<disk>/extents/<vdisk>/log/<log id>-<segment seq>.blog`. A
//! segment is 64 chunks of 1 MiB; a chunk is 256 blocks of 4 KiB: the summary (block 0), up to
//! 254 data blocks (1..=254), and a byte-identical copy of the summary (block 255), so that one
//! rotted copy loses nothing. A chunk's [`Position`] (`segment seq × 64 + chunk index`) orders
//! the journal; positions only grow because every process appends to a new segment numbered
//! above every existing one ([`SegmentCounter`], [`highest_segment`]).
//!
//! Decoding never guesses, as for the egroup format: a summary is all zeros (never written),
//! valid, or bad with a reason; nothing read from a disk can make this module panic.

// Not used by the store yet: it is wired in by step 4 of docs/extent-store-log-proposal.md.

use super::format::{
    crc_of, egroup_dir, seal, u32_at, u64_at, Decoded, BLOCK, BLOCKS_PER_EGROUP, BLOCK_LEN, CRC_AT,
};
use super::{io_error, ExtentError};
use crate::fs::{DiskBuf, DiskFile, Filesystem};
use crate::join::{join_all, try_join_all};
use ashlar_core::VdiskId;
use std::io;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

/// Bytes of one segment file: large enough that a step's sync touches one file (two when it
/// fills one), small enough that cleaning frees space in useful steps.
pub const SEGMENT_BYTES: u64 = 64 << 20;
/// Bytes of one chunk: the unit of an append, written with one `O_DIRECT` write when full.
pub(crate) const CHUNK_BYTES: u64 = 1 << 20;
pub(crate) const CHUNKS_PER_SEGMENT: u16 = 64;
/// 4 KiB blocks per chunk, summaries included.
pub(crate) const BLOCKS_PER_CHUNK: u16 = 256;
/// Data blocks per chunk: all but the two copies of the summary.
pub(crate) const DATA_BLOCKS_PER_CHUNK: usize = 254;
/// Block of a chunk holding the first copy of its summary (written with the data).
const SUMMARY_BLOCK: u16 = 0;
/// Block of a chunk holding the second copy: the last one, so that a full chunk (summary, 254
/// data blocks, copy) is one contiguous 1 MiB write.
const SUMMARY_COPY_BLOCK: u16 = BLOCKS_PER_CHUNK - 1;

/// The segment directory's name under a vdisk's extent directory.
const LOG_DIR_NAME: &str = "log";
const SEGMENT_SUFFIX: &str = ".blog";
/// Hex digits of the log id and of the segment seq in a segment file name.
const LOG_ID_DIGITS: usize = 2;
const SEGMENT_DIGITS: usize = 8;

const SUMMARY_MAGIC: &[u8; 8] = b"ASHLARBL";
/// The extent store format the block log belongs to (it first appears in format 3); a
/// summary of any other version is refused, never guessed at.
pub(crate) const SUMMARY_VERSION: u32 = 3;
// Summary block layout (little-endian), docs/extent-store-log-proposal.md "Shape".
const VERSION_AT: usize = 8;
const LOG_ID_AT: usize = 12;
const RESERVED_AFTER_LOG_ID: Range<usize> = 13..16;
const VDISK_AT: usize = 16;
const SEGMENT_AT: usize = 24;
const CHUNK_AT: usize = 28;
const COUNT_AT: usize = 30;
/// The newest position of this log that was durable when the chunk was appended (see
/// [`ChunkSummary::durable_through`]).
const DURABLE_THROUGH_AT: usize = 32;
const ENTRIES_AT: usize = 40;
/// An entry: egroup index (u64), block index in the egroup (u16), CRC32C of the data (u32).
const ENTRY_BYTES: usize = 14;
/// Blocks of an egroup: an entry's block index is below this.
const EGROUP_BLOCKS: u16 = BLOCKS_PER_EGROUP as u16;

const _: () = {
    assert!(SEGMENT_BYTES == CHUNKS_PER_SEGMENT as u64 * CHUNK_BYTES);
    assert!(CHUNK_BYTES == BLOCKS_PER_CHUNK as u64 * BLOCK);
    assert!(DATA_BLOCKS_PER_CHUNK + 2 == BLOCKS_PER_CHUNK as usize);
    assert!(ENTRIES_AT + DATA_BLOCKS_PER_CHUNK * ENTRY_BYTES <= CRC_AT);
    // Every block of a segment has a slot number.
    assert!(CHUNKS_PER_SEGMENT as u32 * BLOCKS_PER_CHUNK as u32 <= u16::MAX as u32 + 1);
    assert!(BLOCKS_PER_EGROUP <= u16::MAX as usize);
};

/// A block log's id: the index of the shard that writes it (its only writer). Public: the
/// engine names a shard's log when it opens the shard's store.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LogId(pub u8);

/// A segment's sequence number, shared by all logs of a vdisk on a disk ([`SegmentCounter`]).
/// Segment 0 is never written: position 0 means "no chunk" (the position a version-2 table, or
/// a table no step touched yet, reflects).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SegmentSeq(pub u32);

/// A chunk's place in the journal: `segment seq × 64 + chunk index`. A checksum table stamped
/// with a position already holds every summary entry at or below it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct Position(pub u64);

impl Position {
    pub(crate) fn of(segment: SegmentSeq, chunk: u16) -> Position {
        Position(u64::from(segment.0) * u64::from(CHUNKS_PER_SEGMENT) + u64::from(chunk))
    }
}

/// Where a block lives in a log: segment file and block index in it (`chunk × 256 + block`;
/// data entry `i` of chunk `c` is at `c × 256 + 1 + i`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct LogSlot {
    pub log: LogId,
    pub segment: SegmentSeq,
    pub slot: u16,
}

impl LogSlot {
    /// Names no block (for entries that are not in the log): slot 0 is a summary, and
    /// segment 0 is never written.
    pub(crate) const NONE: LogSlot = LogSlot {
        log: LogId(0),
        segment: SegmentSeq(0),
        slot: 0,
    };

    /// The slot of data entry `index` (0..254) of `chunk`.
    pub(crate) fn data(log: LogId, segment: SegmentSeq, chunk: u16, index: usize) -> LogSlot {
        debug_assert!(chunk < CHUNKS_PER_SEGMENT && index < DATA_BLOCKS_PER_CHUNK);
        LogSlot {
            log,
            segment,
            slot: chunk * BLOCKS_PER_CHUNK + 1 + index as u16,
        }
    }

    pub(crate) fn chunk(&self) -> u16 {
        self.slot / BLOCKS_PER_CHUNK
    }

    fn block_in_chunk(&self) -> u16 {
        self.slot % BLOCKS_PER_CHUNK
    }

    /// Whether the slot names a data block of a segment (not a summary, not past the end).
    pub(crate) fn is_data_slot(&self) -> bool {
        let block = self.block_in_chunk();
        self.chunk() < CHUNKS_PER_SEGMENT && block != SUMMARY_BLOCK && block != SUMMARY_COPY_BLOCK
    }

    /// The position of the chunk holding the slot.
    #[cfg(test)]
    pub(crate) fn position(&self) -> Position {
        Position::of(self.segment, self.chunk())
    }

    /// Where the slot's block is in its segment file.
    pub(crate) fn file_offset(&self) -> u64 {
        slot_offset(self.slot)
    }
}

/// One data block of a chunk, as its summary describes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SummaryEntry {
    pub egroup: u64,
    /// The block's index within its egroup (0..1024).
    pub block: u16,
    /// CRC32C of the block's 4 KiB of data.
    pub crc: u32,
}

/// File offset of a slot in its segment.
pub(crate) fn slot_offset(slot: u16) -> u64 {
    u64::from(slot) * BLOCK
}

fn chunk_offset(chunk: u16) -> u64 {
    u64::from(chunk) * CHUNK_BYTES
}

fn summary_offset(chunk: u16, copy: u16) -> u64 {
    chunk_offset(chunk) + u64::from(copy) * BLOCK
}

// ---- Paths ----

/// `<disk>/extents/<vdisk>/log`: the segment files of every log of a vdisk on one disk. Inside
/// the egroup directory, so removing a vdisk's data removes its logs.
pub(crate) fn log_dir(disk: &Path, vdisk: VdiskId) -> PathBuf {
    egroup_dir(disk, vdisk).join(LOG_DIR_NAME)
}

pub(crate) fn segment_file_name(log: LogId, segment: SegmentSeq) -> String {
    format!("{:02x}-{:08x}{SEGMENT_SUFFIX}", log.0, segment.0)
}

/// The file of segment `segment` of log `log`, in `log_dir` (the [`log_dir`] of a disk and
/// vdisk).
pub(crate) fn segment_path(log_dir: &Path, log: LogId, segment: SegmentSeq) -> PathBuf {
    log_dir.join(segment_file_name(log, segment))
}

/// The log and segment a file name names, if it is exactly a name [`segment_file_name`]
/// makes (lowercase hex of the right lengths): any other file would never be opened by the
/// reads, which compute the name.
pub(crate) fn parse_segment_file_name(name: &str) -> Option<(LogId, SegmentSeq)> {
    let (log, segment) = name.strip_suffix(SEGMENT_SUFFIX)?.split_once('-')?;
    if log.len() != LOG_ID_DIGITS || segment.len() != SEGMENT_DIGITS {
        return None;
    }
    if !is_lowercase_hex(log) || !is_lowercase_hex(segment) {
        return None;
    }
    let log = u8::from_str_radix(log, 16).ok()?;
    let segment = u32::from_str_radix(segment, 16).ok()?;
    Some((LogId(log), SegmentSeq(segment)))
}

fn is_lowercase_hex(digits: &str) -> bool {
    digits
        .bytes()
        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

// ---- Summaries ----

fn u16_at(bytes: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([bytes[at], bytes[at + 1]])
}

/// Why a chunk's entries cannot be written: a chunk holds 1 to 254 blocks, each naming a
/// block of an egroup, with 4 KiB of data each.
fn check_chunk(entries: &[SummaryEntry], data_len: usize) -> Result<(), String> {
    if !(1..=DATA_BLOCKS_PER_CHUNK).contains(&entries.len()) {
        return Err(format!(
            "a chunk holds 1 to {DATA_BLOCKS_PER_CHUNK} blocks, not {}",
            entries.len()
        ));
    }
    if data_len != entries.len() * BLOCK_LEN {
        return Err(format!(
            "{} entries need {} bytes of data, not {data_len}",
            entries.len(),
            entries.len() * BLOCK_LEN
        ));
    }
    if let Some((index, entry)) = entries
        .iter()
        .enumerate()
        .find(|(_, entry)| entry.block >= EGROUP_BLOCKS)
    {
        return Err(format!(
            "entry {index} names block {} of an egroup (there are {EGROUP_BLOCKS})",
            entry.block
        ));
    }
    Ok(())
}

/// The summary block of a chunk. `entries` must pass `check_chunk` (`BlockLog::append` checks
/// before encoding: a summary replay would refuse must never be written).
pub(crate) fn encode_summary(
    vdisk: VdiskId,
    log: LogId,
    segment: SegmentSeq,
    chunk: u16,
    entries: &[SummaryEntry],
    durable_through: Position,
) -> Vec<u8> {
    assert!(
        (1..=DATA_BLOCKS_PER_CHUNK).contains(&entries.len()),
        "a summary of {} entries",
        entries.len()
    );
    let mut block = vec![0u8; BLOCK_LEN];
    block[..VERSION_AT].copy_from_slice(SUMMARY_MAGIC);
    block[VERSION_AT..VERSION_AT + 4].copy_from_slice(&SUMMARY_VERSION.to_le_bytes());
    block[LOG_ID_AT] = log.0;
    block[VDISK_AT..VDISK_AT + 8].copy_from_slice(&vdisk.0.to_le_bytes());
    block[SEGMENT_AT..SEGMENT_AT + 4].copy_from_slice(&segment.0.to_le_bytes());
    block[CHUNK_AT..CHUNK_AT + 2].copy_from_slice(&chunk.to_le_bytes());
    block[COUNT_AT..COUNT_AT + 2].copy_from_slice(&(entries.len() as u16).to_le_bytes());
    block[DURABLE_THROUGH_AT..DURABLE_THROUGH_AT + 8]
        .copy_from_slice(&durable_through.0.to_le_bytes());
    let table = &mut block[ENTRIES_AT..ENTRIES_AT + entries.len() * ENTRY_BYTES];
    for (entry, out) in entries.iter().zip(table.chunks_exact_mut(ENTRY_BYTES)) {
        out[0..8].copy_from_slice(&entry.egroup.to_le_bytes());
        out[8..10].copy_from_slice(&entry.block.to_le_bytes());
        out[10..14].copy_from_slice(&entry.crc.to_le_bytes());
    }
    seal(&mut block);
    block
}

/// Checks a summary block read from chunk `chunk` of segment `segment` of log `log`: length,
/// magic, version, CRC, identity (a summary copied or written to the wrong place names another
/// chunk), entry count, reserved bytes, and every entry's block index.
pub(crate) fn decode_summary(
    bytes: &[u8],
    vdisk: VdiskId,
    log: LogId,
    segment: SegmentSeq,
    chunk: u16,
) -> Decoded<Vec<SummaryEntry>> {
    if bytes.len() != BLOCK_LEN {
        return Decoded::Bad(format!("summary is {} bytes, not {BLOCK_LEN}", bytes.len()));
    }
    if bytes.iter().all(|&b| b == 0) {
        return Decoded::Zero;
    }
    if &bytes[..VERSION_AT] != SUMMARY_MAGIC {
        return Decoded::Bad("wrong summary magic".into());
    }
    let version = u32_at(bytes, VERSION_AT);
    if version != SUMMARY_VERSION {
        return Decoded::Bad(format!("unsupported summary version {version}"));
    }
    if bytes[CRC_AT..] != crc_of(bytes) {
        return Decoded::Bad("summary checksum mismatch".into());
    }
    if let Err(reason) = check_identity(bytes, vdisk, log, segment, chunk) {
        return Decoded::Bad(reason);
    }
    let count = usize::from(u16_at(bytes, COUNT_AT));
    if !(1..=DATA_BLOCKS_PER_CHUNK).contains(&count) {
        return Decoded::Bad(format!(
            "summary entry count {count} is not 1 to {DATA_BLOCKS_PER_CHUNK}"
        ));
    }
    let entries_end = ENTRIES_AT + count * ENTRY_BYTES;
    let reserved = [RESERVED_AFTER_LOG_ID, entries_end..CRC_AT];
    if reserved
        .into_iter()
        .any(|range| bytes[range].iter().any(|&b| b != 0))
    {
        return Decoded::Bad("reserved summary bytes are not zero".into());
    }
    let mut entries = Vec::with_capacity(count);
    for (index, raw) in bytes[ENTRIES_AT..entries_end]
        .chunks_exact(ENTRY_BYTES)
        .enumerate()
    {
        let entry = SummaryEntry {
            egroup: u64_at(raw, 0),
            block: u16_at(raw, 8),
            crc: u32_at(raw, 10),
        };
        if entry.block >= EGROUP_BLOCKS {
            return Decoded::Bad(format!(
                "summary entry {index} names block {} of an egroup (there are {EGROUP_BLOCKS})",
                entry.block
            ));
        }
        entries.push(entry);
    }
    Decoded::Valid(entries)
}

fn check_identity(
    bytes: &[u8],
    vdisk: VdiskId,
    log: LogId,
    segment: SegmentSeq,
    chunk: u16,
) -> Result<(), String> {
    let named_vdisk = u64_at(bytes, VDISK_AT);
    if named_vdisk != vdisk.0 {
        return Err(format!(
            "summary names vdisk {}, not {vdisk}",
            VdiskId(named_vdisk)
        ));
    }
    let named_log = bytes[LOG_ID_AT];
    if named_log != log.0 {
        return Err(format!(
            "summary names log {named_log:02x}, not {:02x}",
            log.0
        ));
    }
    let named_segment = u32_at(bytes, SEGMENT_AT);
    if named_segment != segment.0 {
        return Err(format!(
            "summary names segment {named_segment:08x}, not {:08x}",
            segment.0
        ));
    }
    let named_chunk = u16_at(bytes, CHUNK_AT);
    if named_chunk != chunk {
        return Err(format!("summary names chunk {named_chunk}, not {chunk}"));
    }
    Ok(())
}

// ---- Segment numbers ----

/// The counter ran out: the next segment would need a sequence number above `u32::MAX - 1`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("block log segment sequence numbers are exhausted (positions may never go back)")]
pub(crate) struct SegmentsExhausted;

/// Hands out segment sequence numbers to every log of one vdisk on one disk (shards on several
/// threads share it). Numbers only grow and never wrap, and a process starts above every
/// segment on the disk ([`SegmentCounter::after`] of [`highest_segment`]): that is what makes
/// positions grow across restarts, so replay can tell newer summaries from older ones.
///
/// Public so that the engine can hand one counter per disk to every shard's store; only this
/// crate makes and uses them.
#[derive(Debug)]
pub struct SegmentCounter {
    /// The next number to hand out; `EXHAUSTED` once none is left.
    next_free: AtomicU32,
}

impl SegmentCounter {
    /// Never handed out: it stands for "none left", so the counter never has to store
    /// `u32::MAX + 1`.
    const EXHAUSTED: u32 = u32::MAX;
    /// Segment 0 is never handed out (see [`SegmentSeq`]).
    const FIRST: u32 = 1;

    /// A counter whose first number is `first_free` (at least 1).
    pub(crate) fn new(first_free: SegmentSeq) -> SegmentCounter {
        SegmentCounter {
            next_free: AtomicU32::new(first_free.0.max(Self::FIRST)),
        }
    }

    /// A counter above `highest`, the highest segment on the disk (`None`: there is none).
    pub(crate) fn after(highest: Option<SegmentSeq>) -> SegmentCounter {
        let first_free = highest.map_or(Self::FIRST, |seq| seq.0.saturating_add(1));
        SegmentCounter::new(SegmentSeq(first_free))
    }

    /// A number no segment of this vdisk on this disk has had.
    pub(crate) fn next(&self) -> Result<SegmentSeq, SegmentsExhausted> {
        // Uniqueness and growth need only the atomicity of the update: nothing else is
        // published through the counter, so `Relaxed` is enough.
        self.next_free
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |next| {
                if next == Self::EXHAUSTED {
                    None
                } else {
                    Some(next + 1)
                }
            })
            .map(SegmentSeq)
            .map_err(|_| SegmentsExhausted)
    }
}

// ---- The writer ----

/// The writer of one block log (one shard's log on one disk), used by one task at a time.
///
/// A **step** is the appends made since the previous `sync` call, closed by a `sync` call.
/// **Contract**: the slots and positions `append` returned in a step may be referenced (put in
/// a checksum table, in memory or on disk) only once the `sync` closing the step returned
/// `Ok`. When an append or a sync fails (or an append or sync future is dropped before it
/// completes), the step failed for good: its `sync` returns an error, and so does every retry
/// of that `sync` until the next `append`, which begins a new step. The caller abandons a
/// failed step's slots and appends its blocks again (the oplog still holds them). Retrying a
/// failed sync proves nothing (after a failed fsync Linux may drop the dirty pages and report
/// success next time), so this log never lets it succeed.
///
/// A segment in which a write or a sync failed is not appended to again: the next append
/// starts a new segment. Every `BlockLog` appends only to segments it created itself, with
/// numbers from the shared [`SegmentCounter`], which starts above every existing segment:
/// positions grow strictly, also across restarts.
pub(crate) struct BlockLog<F: Filesystem> {
    fs: F,
    /// [`log_dir`] of the disk and vdisk.
    dir: PathBuf,
    vdisk: VdiskId,
    log: LogId,
    counter: Arc<SegmentCounter>,
    /// The segment the next append goes to, unless full.
    current: Option<OpenSegment<F::File>>,
    /// Segments that filled up with chunks of the open step: the sync closing it syncs them.
    filled: Vec<OpenSegment<F::File>>,
    health: Health,
    /// Chunks a new segment takes: fewer than `CHUNKS_PER_SEGMENT` makes smaller segments
    /// (positions keep their spacing), which cleaning frees sooner.
    chunks_per_segment: u16,
    /// The position of the newest chunk appended (in this step or before).
    appended_through: Position,
    /// The position of the newest chunk whose step's sync succeeded: written into every
    /// summary, so replay knows which chunks were durable before the last step.
    durable_through: Position,
}

struct OpenSegment<File> {
    seq: SegmentSeq,
    path: PathBuf,
    file: File,
    /// Chunks this segment takes (at most `CHUNKS_PER_SEGMENT`).
    chunks: u16,
    /// The chunk the next append writes.
    next_chunk: u16,
    /// Whether chunks were appended since this file's last successful sync.
    unsynced: bool,
}

impl<File: DiskFile> OpenSegment<File> {
    fn is_full(&self) -> bool {
        self.next_chunk >= self.chunks
    }

    async fn sync(&self) -> Result<(), ExtentError> {
        self.file
            .sync_data()
            .await
            .map_err(|e| io_error(&self.path, None, e))
    }
}

/// Whether the open step can still sync successfully.
enum Health {
    Healthy,
    /// An append of the open step failed (or was dropped): the sync closing it must fail.
    StepFailed(Failure),
    /// The last sync failed (or closed a failed step): every sync fails until the next append
    /// begins a new step.
    SyncFailed(Failure),
}

/// What made a step fail, kept to fail every sync that would otherwise vouch for it.
#[derive(Clone, Debug)]
struct Failure {
    path: PathBuf,
    no_space: bool,
    what: String,
}

impl Failure {
    fn of(error: &ExtentError) -> Failure {
        Failure {
            path: error.path().map(Path::to_path_buf).unwrap_or_default(),
            no_space: matches!(error, ExtentError::NoSpace { .. }),
            what: error.to_string(),
        }
    }

    /// An append or sync whose future was dropped: its outcome is unknown.
    fn interrupted(dir: &Path, what: &str) -> Failure {
        Failure {
            path: dir.to_path_buf(),
            no_space: false,
            what: format!("{what} was interrupted"),
        }
    }

    /// The error a sync of the failed step reports (ENOSPC stays `NoSpace`, so the caller
    /// waits for space as it would have for the original error).
    fn error(&self) -> ExtentError {
        if self.no_space {
            return ExtentError::NoSpace {
                path: self.path.clone(),
            };
        }
        ExtentError::Io {
            path: self.path.clone(),
            file_offset: None,
            source: io::Error::other(format!(
                "the block log chunks appended since the last sync are not durable: {}",
                self.what
            )),
        }
    }
}

fn invalid_input(path: &Path, file_offset: Option<u64>, reason: String) -> ExtentError {
    ExtentError::Io {
        path: path.to_path_buf(),
        file_offset,
        source: io::Error::new(io::ErrorKind::InvalidInput, reason),
    }
}

impl<F: Filesystem> BlockLog<F> {
    /// The writer of log `log` of `vdisk` on the disk at `disk`. No I/O: the first append
    /// creates a segment.
    pub(crate) fn new(
        fs: F,
        disk: &Path,
        vdisk: VdiskId,
        log: LogId,
        counter: Arc<SegmentCounter>,
    ) -> BlockLog<F> {
        BlockLog {
            fs,
            dir: log_dir(disk, vdisk),
            vdisk,
            log,
            counter,
            current: None,
            filled: Vec::new(),
            health: Health::Healthy,
            chunks_per_segment: CHUNKS_PER_SEGMENT,
            appended_through: Position(0),
            durable_through: Position(0),
        }
    }

    /// New segments take `chunks` chunks of 1 MiB (1 to 64; 64 is the default).
    pub(crate) fn with_chunks_per_segment(mut self, chunks: u16) -> Self {
        self.chunks_per_segment = chunks.clamp(1, CHUNKS_PER_SEGMENT);
        self
    }

    /// Appends one chunk: `entries` (1 to 254) describe the 4 KiB blocks of `data`, in order.
    /// Returns the chunk's position and each block's slot, usable once the `sync` closing this
    /// step succeeds (see the type's contract). Not durable until then.
    pub(crate) async fn append(
        &mut self,
        entries: &[SummaryEntry],
        data: &[u8],
    ) -> Result<(Position, Vec<LogSlot>), ExtentError> {
        if matches!(self.health, Health::SyncFailed(_)) {
            // A sync reported the last step's failure: this append begins a new step.
            self.health = Health::Healthy;
        }
        let healthy = matches!(self.health, Health::Healthy);
        if healthy {
            // Fails the step if this future is dropped before the chunk is written.
            self.health = Health::StepFailed(Failure::interrupted(&self.dir, "an append"));
        }
        let result = self.append_chunk(entries, data).await;
        match &result {
            Ok(_) if healthy => self.health = Health::Healthy,
            Err(error) if healthy => self.health = Health::StepFailed(Failure::of(error)),
            // The step had failed already: the first failure is the one reported.
            _ => {}
        }
        result
    }

    async fn append_chunk(
        &mut self,
        entries: &[SummaryEntry],
        data: &[u8],
    ) -> Result<(Position, Vec<LogSlot>), ExtentError> {
        check_chunk(entries, data.len())
            .map_err(|reason| invalid_input(&self.dir, None, reason))?;
        // Out of `self` while it is written: if this future is dropped, the segment is
        // retired with it (what the interrupted write left is unknown).
        let mut segment = match self.current.take() {
            Some(segment) if !segment.is_full() => segment,
            full => {
                self.filled.extend(full.filter(|segment| segment.unsynced));
                self.create_segment().await?
            }
        };
        let (seq, chunk) = (segment.seq, segment.next_chunk);
        segment.next_chunk += 1;
        segment.unsynced = true;
        let summary = encode_summary(
            self.vdisk,
            self.log,
            seq,
            chunk,
            entries,
            self.durable_through,
        );
        // On error the segment is dropped: never append into a segment whose write failed.
        write_chunk(&segment.file, &segment.path, chunk, &summary, data).await?;
        self.current = Some(segment);
        self.appended_through = Position::of(seq, chunk);
        let slots = (0..entries.len())
            .map(|index| LogSlot::data(self.log, seq, chunk, index))
            .collect();
        Ok((Position::of(seq, chunk), slots))
    }

    /// Creates the next segment, durably: its directory entry is synced before any chunk in
    /// it can be referenced, and its space is reserved so that appends into it need none.
    async fn create_segment(&self) -> Result<OpenSegment<F::File>, ExtentError> {
        let seq = self
            .counter
            .next()
            .map_err(|e| io_error(&self.dir, None, io::Error::other(e)))?;
        let path = segment_path(&self.dir, self.log, seq);
        let dir_error = |e| io_error(&self.dir, None, e);
        self.fs.create_dir_all(&self.dir).await.map_err(dir_error)?;
        if self.fs.exists(&path).await.map_err(dir_error)? {
            // Only a counter that did not start above `highest_segment` gets here.
            return Err(io_error(
                &path,
                None,
                io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    "block log segment exists already: appends go to new segments only",
                ),
            ));
        }
        let file = self
            .fs
            .open(&path, true)
            .await
            .map_err(|e| io_error(&path, None, e))?;
        file.allocate(0, SEGMENT_BYTES)
            .await
            .map_err(|e| io_error(&path, Some(0), e))?;
        self.fs.sync_dir(&self.dir).await.map_err(dir_error)?;
        Ok(OpenSegment {
            seq,
            path,
            file,
            chunks: self.chunks_per_segment,
            next_chunk: 0,
            unsynced: false,
        })
    }

    /// Makes every chunk appended in this step durable (syncing each segment written since
    /// the last sync: one, or two when a segment filled) and closes the step. An error means
    /// the step failed (see the type's contract).
    pub(crate) async fn sync(&mut self) -> Result<(), ExtentError> {
        if let Health::StepFailed(failure) | Health::SyncFailed(failure) = &self.health {
            let failure = failure.clone();
            // The full segments hold only this failed step's chunks: nothing will need them.
            self.filled.clear();
            let error = failure.error();
            self.health = Health::SyncFailed(failure);
            return Err(error);
        }
        // Fails the step if this future is dropped before every sync returned.
        self.health = Health::SyncFailed(Failure::interrupted(&self.dir, "a sync"));
        let result = self.sync_segments().await;
        self.health = match &result {
            Ok(()) => {
                self.durable_through = self.appended_through;
                Health::Healthy
            }
            Err(error) => Health::SyncFailed(Failure::of(error)),
        };
        result
    }

    /// Syncs the segments written in this step. They are out of `self` while synced: one
    /// whose sync fails, or whose sync future is dropped, is retired (never appended to again).
    async fn sync_segments(&mut self) -> Result<(), ExtentError> {
        // Full: never appended to again, whether their sync succeeds or not.
        for segment in std::mem::take(&mut self.filled) {
            segment.sync().await?;
        }
        let Some(mut segment) = self.current.take_if(|segment| segment.unsynced) else {
            return Ok(());
        };
        segment.sync().await?;
        segment.unsynced = false;
        self.current = Some(segment);
        Ok(())
    }
}

/// Writes chunk `chunk` of a segment: summary and data as one write, and the summary's copy
/// (in the same write when the chunk is full). The two writes are independent (each copy is
/// valid alone), so both are in flight together.
async fn write_chunk<D: DiskFile>(
    file: &D,
    path: &Path,
    chunk: u16,
    summary: &[u8],
    data: &[u8],
) -> Result<(), ExtentError> {
    let full = data.len() == DATA_BLOCKS_PER_CHUNK * BLOCK_LEN;
    let copy_len = if full { BLOCK_LEN } else { 0 };
    let mut buf = DiskBuf::for_overwrite(BLOCK_LEN + data.len() + copy_len);
    let bytes = buf.as_mut_slice();
    bytes[..BLOCK_LEN].copy_from_slice(summary);
    bytes[BLOCK_LEN..BLOCK_LEN + data.len()].copy_from_slice(data);
    bytes[BLOCK_LEN + data.len()..].copy_from_slice(&summary[..copy_len]);
    let mut writes = vec![write_run(
        file,
        path,
        buf,
        summary_offset(chunk, SUMMARY_BLOCK),
    )];
    if !full {
        let copy = DiskBuf::copy_of(summary);
        writes.push(write_run(
            file,
            path,
            copy,
            summary_offset(chunk, SUMMARY_COPY_BLOCK),
        ));
    }
    try_join_all(writes).await.map(|_| ())
}

async fn write_run<D: DiskFile>(
    file: &D,
    path: &Path,
    buf: DiskBuf,
    at: u64,
) -> Result<(), ExtentError> {
    file.write_from(buf.into_bytes(), at, false)
        .await
        .map_err(|e| io_error(path, Some(at), e))
}

// ---- Reading ----

/// Reads the data block at `slot` into `out` (4096 bytes). Not checked: the caller checks it
/// against the CRC32C in its checksum table, which is what says whether these bytes are the
/// block's (a chunk whose step failed may hold anything).
#[cfg(test)]
pub(crate) async fn read_slot<F: Filesystem>(
    fs: &F,
    disk: &Path,
    vdisk: VdiskId,
    slot: LogSlot,
    out: &mut [u8],
) -> Result<(), ExtentError> {
    let dir = log_dir(disk, vdisk);
    if out.len() != BLOCK_LEN {
        let path = segment_path(&dir, slot.log, slot.segment);
        let reason = format!("a slot is {BLOCK_LEN} bytes, not {}", out.len());
        return Err(invalid_input(&path, Some(slot.file_offset()), reason));
    }
    read_slots(fs, &dir, slot, out).await
}

/// Reads `out.len() / 4096` consecutive data blocks of one chunk, from `first` on, with one
/// read (neighbouring blocks of a step sit together). Unchecked, as [`read_slot`].
/// `log_dir` is the [`log_dir`] of the disk and vdisk.
pub(crate) async fn read_slots<F: Filesystem>(
    fs: &F,
    log_dir: &Path,
    first: LogSlot,
    out: &mut [u8],
) -> Result<(), ExtentError> {
    let path = segment_path(log_dir, first.log, first.segment);
    let at = first.file_offset();
    let count = out.len() / BLOCK_LEN;
    let last_block = usize::from(first.block_in_chunk()) + count.saturating_sub(1);
    if count == 0
        || !out.len().is_multiple_of(BLOCK_LEN)
        || !first.is_data_slot()
        || last_block > DATA_BLOCKS_PER_CHUNK
    {
        let reason = format!(
            "{} bytes from slot {} are not whole data blocks of one chunk",
            out.len(),
            first.slot
        );
        return Err(invalid_input(&path, Some(at), reason));
    }
    let file = fs
        .open(&path, false)
        .await
        .map_err(|e| io_error(&path, None, e))?;
    file.read_at(out, at)
        .await
        .map_err(|e| io_error(&path, Some(at), e))
}

/// One chunk found by [`read_summaries`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ChunkSummary {
    pub log: LogId,
    pub position: Position,
    pub segment: SegmentSeq,
    pub chunk: u16,
    /// The summary's entries (data entry `i` is at [`ChunkSummary::slot`]`(i)`), or why
    /// neither copy could be read: which blocks sit where is then unknown, and the caller
    /// decides what that means (replay: the vdisk is not served).
    pub entries: Result<Vec<SummaryEntry>, String>,
    /// The newest position of this log that was durable when this chunk was appended (zero
    /// when the summary is unreadable or its writer had synced nothing yet). A chunk at or
    /// below the highest such claim of its log was durable: its step completed. Chunks above
    /// it may belong to a step a crash interrupted, whose data may be partly missing.
    pub durable_through: Position,
}

impl ChunkSummary {
    pub(crate) fn slot(&self, index: usize) -> LogSlot {
        LogSlot::data(self.log, self.segment, self.chunk, index)
    }
}

/// A segment file found in a log directory.
pub(crate) struct SegmentFile {
    pub log: LogId,
    pub seq: SegmentSeq,
    pub path: PathBuf,
}

/// The segment files of every log of `vdisk` on the disk at `disk` (none if the directory does
/// not exist). Other names are ignored, with a warning.
pub(crate) async fn list_segments<F: Filesystem>(
    fs: &F,
    disk: &Path,
    vdisk: VdiskId,
) -> Result<Vec<SegmentFile>, ExtentError> {
    let dir = log_dir(disk, vdisk);
    let entries = match fs.list_dir(&dir).await {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_error(&dir, None, e)),
    };
    let mut segments = Vec::with_capacity(entries.len());
    for entry in entries {
        let path = dir.join(&entry.name);
        match parse_segment_file_name(&entry.name).filter(|_| !entry.is_dir) {
            Some((log, seq)) => segments.push(SegmentFile { log, seq, path }),
            None => tracing::warn!(path = %path.display(),
                "not a block log segment: ignored"),
        }
    }
    Ok(segments)
}

/// The highest segment of any log of `vdisk` on the disk at `disk`: a process's
/// [`SegmentCounter`] starts above it ([`SegmentCounter::after`]).
pub(crate) async fn highest_segment<F: Filesystem>(
    fs: &F,
    disk: &Path,
    vdisk: VdiskId,
) -> Result<Option<SegmentSeq>, ExtentError> {
    let segments = list_segments(fs, disk, vdisk).await?;
    Ok(segments.iter().map(|segment| segment.seq).max())
}

/// Every chunk summary of every log of `vdisk` on the disk at `disk`, in position order
/// (replay's input). A chunk whose copies are both all zeros was never written and is left
/// out; one whose copies are neither valid nor both zero comes back with the reason.
pub(crate) async fn read_summaries<F: Filesystem>(
    fs: &F,
    disk: &Path,
    vdisk: VdiskId,
) -> Result<Vec<ChunkSummary>, ExtentError> {
    let mut summaries = Vec::new();
    for segment in list_segments(fs, disk, vdisk).await? {
        summaries.extend(read_segment_summaries(fs, vdisk, &segment).await?);
    }
    summaries.sort_by_key(|summary| (summary.position, summary.log));
    Ok(summaries)
}

/// The written chunks of one segment; the summaries of its chunks are read concurrently.
pub(crate) async fn read_segment_summaries<F: Filesystem>(
    fs: &F,
    vdisk: VdiskId,
    segment: &SegmentFile,
) -> Result<Vec<ChunkSummary>, ExtentError> {
    let file = fs
        .open(&segment.path, false)
        .await
        .map_err(|e| io_error(&segment.path, None, e))?;
    let reads =
        (0..CHUNKS_PER_SEGMENT).map(|chunk| read_chunk_summary(&file, vdisk, segment, chunk));
    let mut summaries = Vec::new();
    for summary in join_all(reads).await {
        summaries.extend(summary?);
    }
    Ok(summaries)
}

/// A chunk's summary from its first copy, else from its second; `None` if both are all zeros
/// (never written: a segment is written front to back, but a power cut may keep a later chunk
/// of an unsynced step and drop an earlier one, so every chunk is looked at).
async fn read_chunk_summary<D: DiskFile>(
    file: &D,
    vdisk: VdiskId,
    segment: &SegmentFile,
    chunk: u16,
) -> Result<Option<ChunkSummary>, ExtentError> {
    let path = &segment.path;
    let decode = |bytes: &[u8]| decode_summary(bytes, vdisk, segment.log, segment.seq, chunk);
    let found = |entries, durable_through| ChunkSummary {
        log: segment.log,
        position: Position::of(segment.seq, chunk),
        segment: segment.seq,
        chunk,
        entries,
        durable_through,
    };
    let first_at = summary_offset(chunk, SUMMARY_BLOCK);
    let first_bytes = read_block(file, path, first_at).await?;
    let first = match decode(&first_bytes) {
        Decoded::Valid(entries) => {
            let durable_through = durable_through_of(&first_bytes);
            return Ok(Some(found(Ok(entries), durable_through)));
        }
        first => first,
    };
    let copy_at = summary_offset(chunk, SUMMARY_COPY_BLOCK);
    let copy_bytes = read_block(file, path, copy_at).await?;
    let mut durable_through = Position(0);
    let entries = match (first, decode(&copy_bytes)) {
        (first, Decoded::Valid(entries)) => {
            if let Decoded::Bad(reason) = first {
                tracing::warn!(path = %path.display(), chunk, %reason,
                    "first copy of a block log summary damaged: using the second");
            }
            durable_through = durable_through_of(&copy_bytes);
            Ok(entries)
        }
        (Decoded::Zero, Decoded::Zero) => return Ok(None),
        (first, copy) => Err(format!(
            "{} chunk {chunk}: no valid copy of the summary (block {SUMMARY_BLOCK}: {}; \
             block {SUMMARY_COPY_BLOCK}: {})",
            path.display(),
            describe(&first),
            describe(&copy)
        )),
    };
    Ok(Some(found(entries, durable_through)))
}

/// The durable-through position of a summary `decode_summary` accepted.
fn durable_through_of(summary: &[u8]) -> Position {
    Position(u64_at(summary, DURABLE_THROUGH_AT))
}

fn describe<T>(decoded: &Decoded<T>) -> &str {
    match decoded {
        Decoded::Zero => "all zeros",
        Decoded::Valid(_) => "valid",
        Decoded::Bad(reason) => reason,
    }
}

async fn read_block<D: DiskFile>(file: &D, path: &Path, at: u64) -> Result<Vec<u8>, ExtentError> {
    let mut block = vec![0u8; BLOCK_LEN];
    file.read_at(&mut block, at)
        .await
        .map_err(|e| io_error(path, Some(at), e))?;
    Ok(block)
}

/// Deletes a segment durably (its directory synced). Cleaning calls it only once a checkpoint
/// no longer references the segment, and never for the highest one (positions must not go
/// back). A segment already gone is not an error: a retry after a failed directory sync
/// syncs again.
pub(crate) async fn remove_segment<F: Filesystem>(
    fs: &F,
    disk: &Path,
    vdisk: VdiskId,
    log: LogId,
    segment: SegmentSeq,
) -> Result<(), ExtentError> {
    let dir = log_dir(disk, vdisk);
    let path = segment_path(&dir, log, segment);
    match fs.remove_file(&path).await {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_error(&path, None, e)),
    }
    match fs.sync_dir(&dir).await {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(io_error(&dir, None, e)),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fs::sim::{CutPolicy, Times};
    use crate::fs::{IoMode, SimFs};
    use proptest::prelude::*;
    use std::time::Duration;

    const VDISK: VdiskId = VdiskId(0x5eed);
    const LOG: LogId = LogId(3);

    fn disk() -> &'static Path {
        Path::new("/disk0")
    }

    fn dir() -> PathBuf {
        log_dir(disk(), VDISK)
    }

    /// 4 KiB that differ for every `seed`.
    fn block_data(seed: u64) -> Vec<u8> {
        let mut out = vec![0u8; BLOCK_LEN];
        for (i, word) in out.chunks_exact_mut(8).enumerate() {
            let value = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (i as u64);
            word.copy_from_slice(&value.to_le_bytes());
        }
        out
    }

    /// A chunk of `count` blocks, distinct for every `seed`.
    fn chunk(seed: u64, count: usize) -> (Vec<SummaryEntry>, Vec<u8>) {
        let mut data = Vec::with_capacity(count * BLOCK_LEN);
        let entries = (0..count)
            .map(|i| {
                let block = block_data(seed << 16 | i as u64);
                data.extend_from_slice(&block);
                SummaryEntry {
                    egroup: seed,
                    block: (i * 3 % BLOCKS_PER_EGROUP) as u16,
                    crc: crc32c::crc32c(&block),
                }
            })
            .collect();
        (entries, data)
    }

    /// A chunk appended: what it holds and where it went.
    struct Appended {
        entries: Vec<SummaryEntry>,
        data: Vec<u8>,
        position: Position,
        slots: Vec<LogSlot>,
    }

    fn new_log(fs: &SimFs, counter: &Arc<SegmentCounter>) -> BlockLog<SimFs> {
        BlockLog::new(fs.clone(), disk(), VDISK, LOG, counter.clone())
    }

    async fn try_append(
        log: &mut BlockLog<SimFs>,
        seed: u64,
        count: usize,
    ) -> Result<Appended, ExtentError> {
        let (entries, data) = chunk(seed, count);
        let (position, slots) = log.append(&entries, &data).await?;
        Ok(Appended {
            entries,
            data,
            position,
            slots,
        })
    }

    async fn append(log: &mut BlockLog<SimFs>, seed: u64, count: usize) -> Appended {
        try_append(log, seed, count).await.expect("append")
    }

    /// Reads every slot of `chunk` back, one by one and all at once.
    async fn assert_reads_back(fs: &SimFs, chunk: &Appended) {
        let mut block = vec![0u8; BLOCK_LEN];
        for (i, slot) in chunk.slots.iter().enumerate() {
            read_slot(fs, disk(), VDISK, *slot, &mut block)
                .await
                .unwrap();
            assert_eq!(block, chunk.data[i * BLOCK_LEN..(i + 1) * BLOCK_LEN]);
            assert_eq!(crc32c::crc32c(&block), chunk.entries[i].crc);
        }
        let mut all = vec![0u8; chunk.data.len()];
        read_slots(fs, &log_dir(disk(), VDISK), chunk.slots[0], &mut all)
            .await
            .unwrap();
        assert_eq!(all, chunk.data);
    }

    /// A change to a summary's bytes.
    type Patch = Box<dyn Fn(&mut [u8])>;

    fn bad_reason(decoded: Decoded<Vec<SummaryEntry>>) -> String {
        match decoded {
            Decoded::Bad(reason) => reason,
            other => panic!("expected Bad, got {other:?}"),
        }
    }

    #[test]
    fn summaries_round_trip_and_reject_damage() {
        let segment = SegmentSeq(0x0a0b_0c0d);
        let entries = vec![
            SummaryEntry {
                egroup: 0x0102_0304_0506_0708,
                block: EGROUP_BLOCKS - 1,
                crc: 0xdead_beef,
            },
            SummaryEntry {
                egroup: 5,
                block: 0,
                crc: 0,
            },
        ];
        let bytes = encode_summary(VDISK, LOG, segment, 63, &entries, Position(0));
        let decode = |bytes: &[u8]| decode_summary(bytes, VDISK, LOG, segment, 63);
        assert!(matches!(decode(&bytes), Decoded::Valid(back) if back == entries));
        let claimed = encode_summary(VDISK, LOG, segment, 63, &entries, Position(77));
        assert!(matches!(decode(&claimed), Decoded::Valid(back) if back == entries));
        assert_eq!(durable_through_of(&claimed), Position(77));
        let (full, _) = chunk(9, DATA_BLOCKS_PER_CHUNK);
        let full_bytes = encode_summary(VDISK, LOG, segment, 0, &full, Position(0));
        assert!(matches!(
            decode_summary(&full_bytes, VDISK, LOG, segment, 0),
            Decoded::Valid(back) if back == full
        ));

        // Identity: each field on its own.
        let identities = [
            (VdiskId(1), LOG, segment, 63, "vdisk"),
            (VDISK, LogId(4), segment, 63, "log"),
            (VDISK, LOG, SegmentSeq(1), 63, "segment"),
            (VDISK, LOG, segment, 62, "chunk"),
        ];
        for (vdisk, log, segment, chunk, field) in identities {
            let reason = bad_reason(decode_summary(&bytes, vdisk, log, segment, chunk));
            assert!(reason.contains(&format!("names {field}")), "{reason}");
        }

        // Damage, with the CRC made to match again where the check is not the CRC's.
        let patched = |patch: &dyn Fn(&mut [u8]), reseal: bool| {
            let mut damaged = bytes.clone();
            patch(&mut damaged);
            if reseal {
                seal(&mut damaged);
            }
            bad_reason(decode(&damaged))
        };
        let set_u16 = |at: usize, value: u16| {
            move |b: &mut [u8]| b[at..at + 2].copy_from_slice(&value.to_le_bytes())
        };
        let entry_block = ENTRIES_AT + ENTRY_BYTES + 8;
        let cases: Vec<(&str, Patch, bool)> = vec![
            ("magic", Box::new(|b| b[0] ^= 1), true),
            ("version 2", Box::new(|b| b[VERSION_AT] = 2), true),
            ("version 4", Box::new(|b| b[VERSION_AT] = 4), true),
            ("checksum", Box::new(|b| b[ENTRIES_AT + 3] ^= 0x40), false),
            ("checksum", Box::new(|b| b[BLOCK_LEN - 1] ^= 1), false),
            ("count 0", Box::new(set_u16(COUNT_AT, 0)), true),
            ("count 255", Box::new(set_u16(COUNT_AT, 255)), true),
            ("count 65535", Box::new(set_u16(COUNT_AT, u16::MAX)), true),
            ("reserved", Box::new(set_u16(COUNT_AT, 1)), true),
            ("block 1024", Box::new(set_u16(entry_block, 1024)), true),
            (
                "block 65535",
                Box::new(set_u16(entry_block, u16::MAX)),
                true,
            ),
            ("reserved", Box::new(|b| b[13] = 1), true),
            ("reserved", Box::new(|b| b[15] = 0x80), true),
            (
                "reserved",
                Box::new(|b| b[ENTRIES_AT + 2 * ENTRY_BYTES] = 1),
                true,
            ),
            ("reserved", Box::new(|b| b[CRC_AT - 1] = 1), true),
        ];
        for (expected, patch, reseal) in cases {
            let reason = patched(&*patch, reseal);
            assert!(reason.contains(expected), "{expected}: {reason}");
        }

        for length in [0, 8, BLOCK_LEN - 1, BLOCK_LEN + 1, 2 * BLOCK_LEN] {
            let mut odd = bytes.clone();
            odd.resize(length, 0);
            assert!(bad_reason(decode(&odd)).contains("bytes"));
        }
        assert!(matches!(decode(&[0u8; BLOCK_LEN]), Decoded::Zero));
    }

    proptest! {
        /// Any one damaged byte (a rotted summary) is caught.
        #[test]
        fn a_damaged_byte_is_never_valid(at in 0..BLOCK_LEN, mask in 1u8..=255) {
            let (entries, _) = chunk(5, 17);
            let mut bytes = encode_summary(VDISK, LOG, SegmentSeq(2), 7, &entries, Position(0));
            bytes[at] ^= mask;
            let decoded = decode_summary(&bytes, VDISK, LOG, SegmentSeq(2), 7);
            prop_assert!(matches!(decoded, Decoded::Bad(_)));
        }

        /// Garbage with a valid CRC never panics, and what passes is within bounds.
        #[test]
        fn garbage_with_a_valid_crc_is_checked(
            at in 0..CRC_AT,
            garbage in proptest::collection::vec(any::<u8>(), 1..64),
        ) {
            let (entries, _) = chunk(5, 3);
            let mut bytes = encode_summary(VDISK, LOG, SegmentSeq(2), 7, &entries, Position(0));
            let end = (at + garbage.len()).min(CRC_AT);
            bytes[at..end].copy_from_slice(&garbage[..end - at]);
            seal(&mut bytes);
            if let Decoded::Valid(back) = decode_summary(&bytes, VDISK, LOG, SegmentSeq(2), 7) {
                prop_assert!((1..=DATA_BLOCKS_PER_CHUNK).contains(&back.len()));
                prop_assert!(back.iter().all(|entry| entry.block < EGROUP_BLOCKS));
            }
        }
    }

    #[test]
    fn segment_file_names_are_strict() {
        let name = segment_file_name(LogId(0x3f), SegmentSeq(0x0000_00a1));
        assert_eq!(name, "3f-000000a1.blog");
        assert_eq!(
            parse_segment_file_name(&name),
            Some((LogId(0x3f), SegmentSeq(0xa1)))
        );
        assert_eq!(
            parse_segment_file_name("00-ffffffff.blog"),
            Some((LogId(0), SegmentSeq(u32::MAX)))
        );
        for name in [
            "3-000000a1.blog",
            "003-000000a1.blog",
            "3f-a1.blog",
            "3f-0000000a1.blog",
            "3f-000000A1.blog",
            "3F-000000a1.blog",
            "3f_000000a1.blog",
            "3f-000000a1.blog.tmp",
            "3f-000000a1.egroup",
            "+f-000000a1.blog",
            "3f-+00000a1.blog",
            "3f-000000g1.blog",
            "3f-000000a1",
            ".blog",
        ] {
            assert_eq!(parse_segment_file_name(name), None, "{name}");
        }
        assert_eq!(
            segment_path(&dir(), LOG, SegmentSeq(1)),
            PathBuf::from("/disk0/extents/0000000000005eed/log/03-00000001.blog")
        );
    }

    #[test]
    fn slots_name_data_blocks_only() {
        let slot = |slot| LogSlot {
            log: LOG,
            segment: SegmentSeq(1),
            slot,
        };
        for data in [1, 254, 257, 63 * 256 + 254] {
            assert!(slot(data).is_data_slot(), "{data}");
        }
        for summary in [0, 255, 256, 511, 64 * 256, u16::MAX] {
            assert!(!slot(summary).is_data_slot(), "{summary}");
        }
        assert!(!LogSlot::NONE.is_data_slot());
        let data = LogSlot::data(LOG, SegmentSeq(7), 2, 253);
        assert_eq!(data.slot, 2 * 256 + 254);
        assert_eq!(data.position(), Position(7 * 64 + 2));
        assert_eq!(slot_offset(data.slot), 2 * CHUNK_BYTES + 254 * BLOCK);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn appends_cross_segments_and_read_back() {
        let fs = SimFs::new(IoMode::Direct);
        let counter = Arc::new(SegmentCounter::after(None));
        let mut log = new_log(&fs, &counter);
        assert!(read_summaries(&fs, disk(), VDISK).await.unwrap().is_empty());
        assert_eq!(highest_segment(&fs, disk(), VDISK).await.unwrap(), None);
        log.sync().await.unwrap();

        // Step 1: a full chunk (one write), a short one (two writes), then chunks 2..=62.
        let mut appended = vec![append(&mut log, 0, DATA_BLOCKS_PER_CHUNK).await];
        let counts = fs.op_counts(Some(&dir()));
        assert_eq!(
            (counts.creates, counts.allocates, counts.dir_syncs),
            (1, 1, 1)
        );
        assert_eq!(counts.writes, 1, "a full chunk is one write");
        appended.push(append(&mut log, 1, 5).await);
        assert_eq!(fs.op_counts(Some(&dir())).writes, 3);
        for seed in 2..63 {
            appended.push(append(&mut log, seed, 1 + seed as usize % 7).await);
        }
        fs.reset_op_counts();
        log.sync().await.unwrap();
        assert_eq!(fs.op_counts(Some(&dir())).syncs, 1);

        // Step 2: the first segment's last chunk, then two chunks of the next segment.
        fs.reset_op_counts();
        appended.push(append(&mut log, 63, DATA_BLOCKS_PER_CHUNK).await);
        appended.push(append(&mut log, 64, 3).await);
        appended.push(append(&mut log, 65, DATA_BLOCKS_PER_CHUNK).await);
        log.sync().await.unwrap();
        let counts = fs.op_counts(Some(&dir()));
        assert_eq!((counts.creates, counts.syncs), (1, 2), "{counts:?}");

        // Step 3 fills the second segment exactly; step 4 syncs only the third.
        for seed in 66..128 {
            appended.push(append(&mut log, seed, 2).await);
        }
        log.sync().await.unwrap();
        fs.reset_op_counts();
        appended.push(append(&mut log, 128, 1).await);
        log.sync().await.unwrap();
        let counts = fs.op_counts(Some(&dir()));
        assert_eq!((counts.creates, counts.syncs), (1, 1), "{counts:?}");

        for (i, chunk) in appended.iter().enumerate() {
            let (segment, index) = (SegmentSeq(1 + i as u32 / 64), (i % 64) as u16);
            assert_eq!(chunk.position, Position::of(segment, index));
            let expected: Vec<LogSlot> = (0..chunk.entries.len())
                .map(|j| LogSlot::data(LOG, segment, index, j))
                .collect();
            assert_eq!(chunk.slots, expected);
            assert_reads_back(&fs, chunk).await;
        }
        assert!(appended.windows(2).all(|w| w[0].position < w[1].position));

        let summaries = read_summaries(&fs, disk(), VDISK).await.unwrap();
        assert_eq!(summaries.len(), appended.len());
        for (summary, chunk) in summaries.iter().zip(&appended) {
            assert_eq!(summary.log, LOG);
            assert_eq!(summary.position, chunk.position);
            assert_eq!(summary.entries.as_ref(), Ok(&chunk.entries));
            assert_eq!(summary.slot(0), chunk.slots[0]);
        }
        assert_eq!(
            highest_segment(&fs, disk(), VDISK).await.unwrap(),
            Some(SegmentSeq(3))
        );

        // Files that are not segments are ignored.
        for junk in ["junk", "03-0000000A.blog"] {
            fs.open(&dir().join(junk), true).await.unwrap();
        }
        fs.create_dir_all(&dir().join("04-00000009.blog"))
            .await
            .unwrap();
        assert_eq!(read_summaries(&fs, disk(), VDISK).await.unwrap(), summaries);
        assert_eq!(
            highest_segment(&fs, disk(), VDISK).await.unwrap(),
            Some(SegmentSeq(3))
        );

        // Reads of anything but whole data blocks of one chunk are refused.
        let first = appended[1].slots[0];
        let mut block = vec![0u8; BLOCK_LEN];
        for bad in [
            LogSlot { slot: 0, ..first },
            LogSlot { slot: 255, ..first },
            LogSlot {
                slot: 64 * 256 + 1,
                ..first
            },
        ] {
            assert!(read_slot(&fs, disk(), VDISK, bad, &mut block)
                .await
                .is_err());
        }
        let mut short = vec![0u8; BLOCK_LEN - 1];
        assert!(read_slot(&fs, disk(), VDISK, first, &mut short)
            .await
            .is_err());
        let mut across = vec![0u8; 2 * BLOCK_LEN];
        let last = LogSlot { slot: 254, ..first };
        assert!(read_slots(&fs, &log_dir(disk(), VDISK), last, &mut across)
            .await
            .is_err());
        let missing = LogSlot {
            segment: SegmentSeq(9),
            ..first
        };
        assert!(read_slot(&fs, disk(), VDISK, missing, &mut block)
            .await
            .is_err());

        // Removing a segment is durable.
        remove_segment(&fs, disk(), VDISK, LOG, SegmentSeq(1))
            .await
            .unwrap();
        remove_segment(&fs, disk(), VDISK, LOG, SegmentSeq(1))
            .await
            .unwrap();
        let removed = segment_path(&dir(), LOG, SegmentSeq(1));
        assert!(!fs.durable_files().contains(&removed));
        let left = read_summaries(&fs, disk(), VDISK).await.unwrap();
        assert_eq!(left[..], summaries[64..]);
    }

    /// Every summary says how far its log was durable when it was appended: a step's chunks
    /// claim the previous step's, and a failed step claims nothing new.
    #[tokio::test(flavor = "current_thread")]
    async fn summaries_claim_what_was_durable_before_them() {
        let fs = SimFs::new(IoMode::Direct);
        let counter = Arc::new(SegmentCounter::after(None));
        let mut log = new_log(&fs, &counter);
        let first = append(&mut log, 1, 3).await;
        let second = append(&mut log, 2, 1).await;
        log.sync().await.unwrap();
        let third = append(&mut log, 3, 2).await;
        fs.fail_syncs(None, Times::Next(1));
        assert!(log.sync().await.is_err());
        let fourth = append(&mut log, 4, 2).await;
        log.sync().await.unwrap();
        let fifth = append(&mut log, 5, 1).await;
        log.sync().await.unwrap();
        let claims: Vec<(Position, Position)> = read_summaries(&fs, disk(), VDISK)
            .await
            .unwrap()
            .iter()
            .map(|summary| (summary.position, summary.durable_through))
            .collect();
        assert_eq!(
            claims,
            vec![
                (first.position, Position(0)),
                (second.position, Position(0)),
                (third.position, second.position),
                (fourth.position, second.position),
                (fifth.position, fourth.position),
            ]
        );
    }

    /// Synced chunks survive a power cut; unsynced ones are gone or (when the disk kept their
    /// summary) name exactly what was appended there; a new writer goes above all of them.
    #[tokio::test(flavor = "current_thread")]
    async fn a_power_cut_keeps_synced_chunks_and_positions_grow() {
        let policies = [CutPolicy::DropAll]
            .into_iter()
            .chain((0..4).map(|seed| CutPolicy::Random { seed }));
        for policy in policies {
            let fs = SimFs::new(IoMode::Direct);
            let counter = Arc::new(SegmentCounter::after(None));
            let mut log = new_log(&fs, &counter);
            let mut synced = Vec::new();
            for seed in 0..62 {
                let count = if seed == 10 {
                    DATA_BLOCKS_PER_CHUNK
                } else {
                    1 + seed as usize % 4
                };
                synced.push(append(&mut log, seed, count).await);
            }
            log.sync().await.unwrap();
            // Chunks 62 and 63 of segment 1, then 0 and 1 of segment 2; never synced.
            let mut unsynced = Vec::new();
            for (seed, count) in [(100, 2), (101, DATA_BLOCKS_PER_CHUNK), (102, 1), (103, 5)] {
                unsynced.push(append(&mut log, seed, count).await);
            }
            fs.power_cut(policy);
            drop(log);

            let summaries = read_summaries(&fs, disk(), VDISK).await.unwrap();
            let mut found = summaries.iter().peekable();
            for chunk in &synced {
                let summary = found.next().expect("a synced chunk is missing");
                assert_eq!(summary.position, chunk.position, "{policy:?}");
                assert_eq!(summary.entries.as_ref(), Ok(&chunk.entries), "{policy:?}");
                assert_reads_back(&fs, chunk).await;
            }
            for summary in found {
                let chunk = unsynced
                    .iter()
                    .find(|chunk| chunk.position == summary.position)
                    .unwrap_or_else(|| panic!("{policy:?}: unexpected {summary:?}"));
                assert_eq!(summary.entries.as_ref(), Ok(&chunk.entries), "{policy:?}");
                assert_ne!(policy, CutPolicy::DropAll, "an unsynced chunk survived");
            }

            // Segment 2's entry was made durable before anything was written into it.
            let highest = highest_segment(&fs, disk(), VDISK).await.unwrap();
            assert_eq!(highest, Some(SegmentSeq(2)), "{policy:?}");
            let counter = Arc::new(SegmentCounter::after(highest));
            let mut log = new_log(&fs, &counter);
            let after = append(&mut log, 200, 4).await;
            log.sync().await.unwrap();
            assert_eq!(after.slots[0].segment, SegmentSeq(3));
            let last = unsynced.last().map(|chunk| chunk.position);
            assert!(Some(after.position) > last);
            assert_reads_back(&fs, &after).await;
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn one_rotted_summary_copy_is_survived_two_are_reported() {
        let fs = SimFs::new(IoMode::Direct);
        let counter = Arc::new(SegmentCounter::after(None));
        let mut log = new_log(&fs, &counter);
        let chunks = [
            append(&mut log, 0, 2).await,
            append(&mut log, 1, DATA_BLOCKS_PER_CHUNK).await,
            append(&mut log, 2, 1).await,
        ];
        log.sync().await.unwrap();
        let path = segment_path(&dir(), LOG, SegmentSeq(1));
        let expect_intact = |summaries: &[ChunkSummary]| {
            assert_eq!(summaries.len(), chunks.len());
            for (summary, chunk) in summaries.iter().zip(&chunks) {
                assert_eq!(summary.entries.as_ref(), Ok(&chunk.entries));
            }
        };

        // The first copy of chunks 0 and 1 rotted, the second copy of chunk 2.
        fs.flip_bits(&path, summary_offset(0, SUMMARY_BLOCK) + 45, 0x10)
            .unwrap();
        fs.flip_bits(&path, summary_offset(1, SUMMARY_BLOCK) + 3000, 0x01)
            .unwrap();
        fs.flip_bits(&path, summary_offset(2, SUMMARY_COPY_BLOCK) + 7, 0x80)
            .unwrap();
        expect_intact(&read_summaries(&fs, disk(), VDISK).await.unwrap());

        // Both copies of chunk 0: reported, naming the file and the chunk.
        fs.flip_bits(&path, summary_offset(0, SUMMARY_COPY_BLOCK) + 3000, 0x04)
            .unwrap();
        let summaries = read_summaries(&fs, disk(), VDISK).await.unwrap();
        assert_eq!(summaries.len(), chunks.len());
        let reason = summaries[0].entries.as_ref().unwrap_err();
        assert!(reason.contains(&path.display().to_string()), "{reason}");
        assert!(reason.contains("chunk 0"), "{reason}");
        assert!(reason.contains("checksum"), "{reason}");
        assert_eq!(summaries[0].position, chunks[0].position);
        for (summary, chunk) in summaries.iter().zip(&chunks).skip(1) {
            assert_eq!(summary.entries.as_ref(), Ok(&chunk.entries));
            assert_reads_back(&fs, chunk).await;
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_failed_write_or_sync_fails_the_step_and_retires_the_segment() {
        let fs = SimFs::new(IoMode::Direct);
        let counter = Arc::new(SegmentCounter::after(None));
        let mut log = new_log(&fs, &counter);
        let first = append(&mut log, 0, 2).await;
        log.sync().await.unwrap();

        // A failed write: the step's sync fails, and keeps failing.
        fs.fail_writes(Some(&dir()), Times::Next(1));
        assert!(try_append(&mut log, 1, 3).await.is_err());
        assert!(log.sync().await.is_err());
        assert!(log.sync().await.is_err(), "a retried sync must not vouch");
        let retried = append(&mut log, 2, 3).await;
        assert_eq!(retried.slots[0].segment, SegmentSeq(2));
        log.sync().await.unwrap();
        assert_reads_back(&fs, &retried).await;
        assert_reads_back(&fs, &first).await;

        // A failed sync: the same, and the next step starts a new segment.
        let doomed = append(&mut log, 3, 1).await;
        assert_eq!(doomed.slots[0].segment, SegmentSeq(2));
        fs.fail_syncs(Some(&dir()), Times::Next(1));
        assert!(log.sync().await.is_err());
        assert!(log.sync().await.is_err(), "a retried sync must not vouch");
        let retried = append(&mut log, 4, 1).await;
        assert_eq!(retried.slots[0].segment, SegmentSeq(3));
        log.sync().await.unwrap();

        // A failed append fails its step even if later appends of the step succeed.
        fs.fail_writes(Some(&dir()), Times::Next(1));
        assert!(try_append(&mut log, 5, 1).await.is_err());
        let later = append(&mut log, 6, 1).await;
        assert_eq!(later.slots[0].segment, SegmentSeq(4));
        assert!(log.sync().await.is_err());
        let next_step = append(&mut log, 7, 1).await;
        assert_eq!(next_step.slots[0].segment, SegmentSeq(4));
        log.sync().await.unwrap();
        log.sync().await.unwrap();

        // Bad arguments are refused without a panic, and fail the step too.
        let (entries, data) = chunk(8, 2);
        assert!(log.append(&entries, &data[..BLOCK_LEN]).await.is_err());
        assert!(log.append(&[], &[]).await.is_err());
        let (many, many_data) = chunk(9, DATA_BLOCKS_PER_CHUNK + 1);
        assert!(log.append(&many, &many_data).await.is_err());
        let mut out_of_egroup = entries.clone();
        out_of_egroup[1].block = EGROUP_BLOCKS;
        assert!(log.append(&out_of_egroup, &data).await.is_err());
        assert!(log.sync().await.is_err());
        append(&mut log, 10, 1).await;
        log.sync().await.unwrap();
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_full_disk_is_no_space_and_passes() {
        let fs = SimFs::new(IoMode::Direct);
        fs.set_capacity(CHUNK_BYTES);
        let counter = Arc::new(SegmentCounter::after(None));
        let mut log = new_log(&fs, &counter);
        let full = try_append(&mut log, 0, 1).await.err().expect("no space");
        assert!(matches!(full, ExtentError::NoSpace { .. }), "{full}");
        let again = log.sync().await.unwrap_err();
        assert!(matches!(again, ExtentError::NoSpace { .. }), "{again}");
        fs.set_capacity(1 << 40);
        let chunk = append(&mut log, 1, 1).await;
        log.sync().await.unwrap();
        assert!(chunk.slots[0].segment > SegmentSeq(1));
        assert_reads_back(&fs, &chunk).await;
    }

    /// An append or a sync dropped before it completed fails its step.
    #[tokio::test(flavor = "current_thread")]
    async fn an_interrupted_append_or_sync_fails_the_step() {
        let fs = SimFs::new(IoMode::Direct);
        let counter = Arc::new(SegmentCounter::after(None));
        let mut log = new_log(&fs, &counter);
        append(&mut log, 0, 1).await;
        log.sync().await.unwrap();
        let (entries, data) = chunk(1, 1);
        fs.set_delay(Some(&dir()), Duration::from_millis(200));
        let wait = Duration::from_millis(5);
        assert!(tokio::time::timeout(wait, log.append(&entries, &data))
            .await
            .is_err());
        fs.clear_delays();
        assert!(log.sync().await.is_err());
        append(&mut log, 2, 1).await;
        fs.set_delay(Some(&dir()), Duration::from_millis(200));
        assert!(tokio::time::timeout(wait, log.sync()).await.is_err());
        fs.clear_delays();
        assert!(log.sync().await.is_err());
        let chunk = append(&mut log, 3, 1).await;
        log.sync().await.unwrap();
        assert_reads_back(&fs, &chunk).await;
    }

    #[test]
    fn segment_numbers_never_wrap_and_never_repeat() {
        let counter = SegmentCounter::new(SegmentSeq(u32::MAX - 1));
        assert_eq!(counter.next(), Ok(SegmentSeq(u32::MAX - 1)));
        assert_eq!(counter.next(), Err(SegmentsExhausted));
        assert_eq!(counter.next(), Err(SegmentsExhausted));
        assert_eq!(
            SegmentCounter::after(Some(SegmentSeq(u32::MAX))).next(),
            Err(SegmentsExhausted)
        );
        assert_eq!(SegmentCounter::after(None).next(), Ok(SegmentSeq(1)));
        assert_eq!(SegmentCounter::new(SegmentSeq(0)).next(), Ok(SegmentSeq(1)));
        assert_eq!(
            SegmentCounter::after(Some(SegmentSeq(41))).next(),
            Ok(SegmentSeq(42))
        );

        let counter = Arc::new(SegmentCounter::after(None));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let counter = counter.clone();
                std::thread::spawn(move || {
                    (0..1000)
                        .map(|_| counter.next().unwrap().0)
                        .collect::<Vec<u32>>()
                })
            })
            .collect();
        let mut all: Vec<u32> = threads
            .into_iter()
            .flat_map(|thread| thread.join().unwrap())
            .collect();
        all.sort_unstable();
        assert_eq!(all, (1..=4000).collect::<Vec<u32>>());
    }
}

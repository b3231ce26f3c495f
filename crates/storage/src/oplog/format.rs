//! Byte layout of the oplog, format version 3. docs/oplog-format.md is the reference; this file
//! is its only implementation, so encode and decode live side by side. (Version 1/2 records,
//! read by the kept read-only reader, are in `legacy.rs`.)
//!
//! A segment file is a two-slot segment header (8 KiB) followed by batches at 4 KiB-aligned
//! offsets, each padded to a multiple of 4 KiB. A batch is a batch header (fixed part and a
//! table of its records) followed by its records, packed; a record is a record header, one
//! CRC32C per 4 KiB payload chunk, and the payload.

use std::path::{Path, PathBuf};

/// Batches start at multiples of this and are padded to it; it is also the payload chunk size
/// that carries one CRC32C.
pub const BLOCK_BYTES: u64 = 4096;
/// Payloads carry one CRC32C per chunk of this size (the last chunk may be shorter), so a 4 KiB
/// read verifies 4 KiB, not the whole record.
pub const CHUNK_BYTES: u64 = BLOCK_BYTES;
/// The segment header: two copies (slots) of one block each, written one after the other.
pub const SEGMENT_HEADER_BYTES: u64 = 2 * BLOCK_BYTES;
pub const VERSION: u8 = 3;

/// "AOPS", "AOPB", "AOPR" read as little-endian u32s.
pub const SEGMENT_MAGIC: u32 = u32::from_le_bytes(*b"AOPS");
pub const BATCH_MAGIC: u32 = u32::from_le_bytes(*b"AOPB");
pub const RECORD_MAGIC: u32 = u32::from_le_bytes(*b"AOPR");

const SLOT_CRC_AT: usize = 60;
pub const BATCH_FIXED_BYTES: u64 = 72;
const BATCH_CRC_AT: usize = 68;
pub const TABLE_ENTRY_BYTES: u64 = 24;
pub const RECORD_HEADER_BYTES: u64 = 40;
const RECORD_CRC_AT: usize = 36;
pub(super) const CRC_BYTES: u64 = 4;

/// Rounds `bytes` up to a multiple of [`BLOCK_BYTES`].
pub fn pad_to_block(bytes: u64) -> u64 {
    bytes.div_ceil(BLOCK_BYTES) * BLOCK_BYTES
}

/// What a record says about its range.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RecordKind {
    /// The range holds the record's payload.
    Write = 1,
    /// The range reads as zeros.
    Zero = 2,
    /// The newest data of the range lives in the extent store.
    Barrier = 3,
}

impl RecordKind {
    pub fn from_byte(byte: u8) -> Option<Self> {
        match byte {
            1 => Some(RecordKind::Write),
            2 => Some(RecordKind::Zero),
            3 => Some(RecordKind::Barrier),
            _ => None,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Segment header

/// What a segment file is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SegmentState {
    /// Holds batches of incarnation `segment_id`.
    Active = 1,
    /// Free for reuse; its body is stale and never read.
    Spare = 2,
}

/// One slot of the segment header (the first 64 bytes of a block; the rest is zero).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SegmentHeader {
    pub state: SegmentState,
    pub log_id: u64,
    /// Counts the header writes of this file: of two valid slots, the higher wins.
    pub generation: u64,
    /// Active: this incarnation's id. Spare: the id of the incarnation it last held (0 if none).
    pub segment_id: u64,
    /// The next sequence number and batch number when this header was written: nothing written
    /// before it used numbers at or above these, so they are floors for new numbers.
    pub seq_floor: u64,
    pub batch_floor: u64,
}

impl SegmentHeader {
    pub fn encode(&self) -> Vec<u8> {
        let mut block = vec![0u8; BLOCK_BYTES as usize];
        block[0..4].copy_from_slice(&SEGMENT_MAGIC.to_le_bytes());
        block[4] = VERSION;
        block[5] = self.state as u8;
        // 6..8 reserved
        block[8..16].copy_from_slice(&self.log_id.to_le_bytes());
        block[16..24].copy_from_slice(&self.generation.to_le_bytes());
        block[24..32].copy_from_slice(&self.segment_id.to_le_bytes());
        block[32..40].copy_from_slice(&self.seq_floor.to_le_bytes());
        block[40..48].copy_from_slice(&self.batch_floor.to_le_bytes());
        // 48..60 reserved
        let crc = crc32c::crc32c(&block[..SLOT_CRC_AT]);
        block[SLOT_CRC_AT..SLOT_CRC_AT + 4].copy_from_slice(&crc.to_le_bytes());
        block
    }

    /// Parses one slot; the error says why the bytes are not a valid slot.
    pub fn decode(bytes: &[u8]) -> Result<SegmentHeader, String> {
        if bytes.len() < 64 {
            return Err(format!(
                "{} bytes, too few for a segment header",
                bytes.len()
            ));
        }
        let magic = le_u32(bytes, 0);
        if magic != SEGMENT_MAGIC {
            return Err(format!("bad segment header magic {magic:#010x}"));
        }
        let stored = le_u32(bytes, SLOT_CRC_AT);
        let crc = crc32c::crc32c(&bytes[..SLOT_CRC_AT]);
        if stored != crc {
            return Err(format!(
                "segment header crc {stored:#010x} != computed {crc:#010x}"
            ));
        }
        if bytes[4] != VERSION {
            return Err(format!("unsupported segment header version {}", bytes[4]));
        }
        let state = match bytes[5] {
            1 => SegmentState::Active,
            2 => SegmentState::Spare,
            other => return Err(format!("unknown segment state {other}")),
        };
        if bytes[6..8] != [0, 0] || bytes[48..60].iter().any(|&b| b != 0) {
            return Err("reserved segment header bytes are not zero".into());
        }
        Ok(SegmentHeader {
            state,
            log_id: le_u64(bytes, 8),
            generation: le_u64(bytes, 16),
            segment_id: le_u64(bytes, 24),
            seq_floor: le_u64(bytes, 32),
            batch_floor: le_u64(bytes, 40),
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Batch header

/// The fixed part of a batch header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchHeader {
    /// A seal: the segment's batches end here (no records; `bytes` is one block). Written over
    /// a torn tail at open and over a failed batch when the log recovers.
    pub seal: bool,
    pub log_id: u64,
    /// The incarnation of the segment it was written into.
    pub segment_id: u64,
    /// The number of the first batch written into this segment incarnation.
    pub segment_first_batch: u64,
    /// Batch numbers increase by one from batch to batch across the whole log; only a seal may
    /// skip numbers (it voids the skipped ones).
    pub number: u64,
    /// The number of the batch before this one in the log: `number - 1`, except for a seal,
    /// where it is the last batch kept before the voided ones.
    pub prev: u64,
    /// Sequence number of the first record (records are numbered consecutively); for a seal,
    /// the next sequence number.
    pub first_seq: u64,
    pub count: u32,
    /// Length of the batch on disk, padding included: a multiple of [`BLOCK_BYTES`].
    pub bytes: u32,
    /// Batches in flight when this one was submitted, itself included: every batch numbered
    /// `number - window` or lower was durable before this one was written.
    pub window: u32,
}

impl BatchHeader {
    /// Every batch numbered at most this was durable when this one was written: proof that a
    /// missing or bad batch at or below it is corruption, not a torn write. A seal (written
    /// with nothing else in flight) vouches for the batches it kept.
    pub fn vouches_through(&self) -> u64 {
        if self.seal {
            self.prev
        } else {
            self.number.saturating_sub(u64::from(self.window))
        }
    }

    /// The last batch number that belongs before this one in the same log.
    pub fn last_before(&self) -> u64 {
        self.prev
    }
}

/// One record as the batch header's table describes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TableEntry {
    pub kind: RecordKind,
    pub offset: u64,
    pub length: u64,
}

impl TableEntry {
    /// Bytes the record occupies in the batch.
    pub fn record_bytes(&self) -> u64 {
        record_bytes(self.kind, self.length)
    }
}

/// Bytes of the header and table of a batch of `count` records.
pub fn batch_header_bytes(count: u64) -> u64 {
    BATCH_FIXED_BYTES + TABLE_ENTRY_BYTES * count
}

impl BatchHeader {
    /// Appends the header and the table to `out`.
    pub fn encode(&self, table: &[TableEntry], out: &mut Vec<u8>) {
        debug_assert_eq!(table.len(), self.count as usize);
        let start = out.len();
        out.extend_from_slice(&BATCH_MAGIC.to_le_bytes());
        out.push(VERSION);
        out.push(u8::from(self.seal));
        out.extend_from_slice(&[0, 0]);
        out.extend_from_slice(&self.log_id.to_le_bytes());
        out.extend_from_slice(&self.segment_id.to_le_bytes());
        out.extend_from_slice(&self.segment_first_batch.to_le_bytes());
        out.extend_from_slice(&self.number.to_le_bytes());
        out.extend_from_slice(&self.prev.to_le_bytes());
        out.extend_from_slice(&self.first_seq.to_le_bytes());
        out.extend_from_slice(&self.count.to_le_bytes());
        out.extend_from_slice(&self.bytes.to_le_bytes());
        out.extend_from_slice(&self.window.to_le_bytes());
        out.extend_from_slice(&[0u8; 4]); // crc, filled below
        for entry in table {
            out.extend_from_slice(&entry.offset.to_le_bytes());
            out.extend_from_slice(&entry.length.to_le_bytes());
            out.push(entry.kind as u8);
            out.extend_from_slice(&[0u8; 7]);
        }
        let crc = batch_crc(&out[start..]);
        out[start + BATCH_CRC_AT..start + BATCH_CRC_AT + 4].copy_from_slice(&crc.to_le_bytes());
    }

    /// The record count the fixed part claims, before any check: how many table bytes to read.
    /// `None` if the bytes do not even start like a batch header of this version.
    pub fn claimed_count(bytes: &[u8]) -> Option<u32> {
        (bytes.len() >= BATCH_FIXED_BYTES as usize
            && le_u32(bytes, 0) == BATCH_MAGIC
            && bytes[4] == VERSION)
            .then(|| le_u32(bytes, 56))
    }

    /// Parses and checks a batch header and its table. `bytes` must hold at least the header
    /// and table (`batch_header_bytes(claimed_count)`); the error says why it is not valid.
    pub fn decode(bytes: &[u8]) -> Result<(BatchHeader, Vec<TableEntry>), String> {
        let Some(count) = Self::claimed_count(bytes) else {
            return Err("no batch header magic".into());
        };
        let header_len = batch_header_bytes(u64::from(count));
        if (bytes.len() as u64) < header_len {
            return Err(format!(
                "a batch header of {count} records needs {header_len} bytes, {} present",
                bytes.len()
            ));
        }
        let stored = le_u32(bytes, BATCH_CRC_AT);
        let crc = batch_crc(&bytes[..header_len as usize]);
        if stored != crc {
            return Err(format!(
                "batch header crc {stored:#010x} != computed {crc:#010x}"
            ));
        }
        let flags = bytes[5];
        if flags > 1 || bytes[6..8] != [0, 0] {
            return Err(format!("unknown batch flags {flags:#x}"));
        }
        let header = BatchHeader {
            seal: flags == 1,
            log_id: le_u64(bytes, 8),
            segment_id: le_u64(bytes, 16),
            segment_first_batch: le_u64(bytes, 24),
            number: le_u64(bytes, 32),
            prev: le_u64(bytes, 40),
            first_seq: le_u64(bytes, 48),
            count,
            bytes: le_u32(bytes, 60),
            window: le_u32(bytes, 64),
        };
        let mut table = Vec::with_capacity(count as usize);
        for i in 0..count as usize {
            let at = BATCH_FIXED_BYTES as usize + i * TABLE_ENTRY_BYTES as usize;
            let kind = RecordKind::from_byte(bytes[at + 16])
                .ok_or_else(|| format!("table entry {i} has unknown kind {}", bytes[at + 16]))?;
            if bytes[at + 17..at + 24].iter().any(|&b| b != 0) {
                return Err(format!("table entry {i} has non-zero reserved bytes"));
            }
            let entry = TableEntry {
                kind,
                offset: le_u64(bytes, at),
                length: le_u64(bytes, at + 8),
            };
            check_range(entry.kind, entry.offset, entry.length)
                .map_err(|e| format!("table entry {i}: {e}"))?;
            table.push(entry);
        }
        header.check_consistency(&table)?;
        Ok((header, table))
    }

    /// Rejects headers this code never writes, so a lucky CRC on garbage indexes nothing.
    fn check_consistency(&self, table: &[TableEntry]) -> Result<(), String> {
        let bytes = u64::from(self.bytes);
        if bytes == 0 || !bytes.is_multiple_of(BLOCK_BYTES) {
            return Err(format!(
                "batch length {bytes} is not a positive multiple of 4 KiB"
            ));
        }
        if self.window == 0 || self.number < self.segment_first_batch {
            return Err(format!(
                "batch {} of a segment starting at batch {} with window {}",
                self.number, self.segment_first_batch, self.window
            ));
        }
        if self.seal && (self.count != 0 || self.prev >= self.number) {
            return Err("a seal holds records or does not follow its previous batch".into());
        }
        if !self.seal && self.number.checked_sub(1) != Some(self.prev) {
            return Err(format!("batch {} follows batch {}", self.number, self.prev));
        }
        let used = batch_header_bytes(u64::from(self.count))
            + table.iter().map(TableEntry::record_bytes).sum::<u64>();
        if pad_to_block(used) != bytes {
            return Err(format!(
                "batch length {bytes} does not match its records ({used} bytes before padding)"
            ));
        }
        if self.first_seq.checked_add(u64::from(self.count)).is_none() {
            return Err("sequence numbers overflow".into());
        }
        Ok(())
    }
}

/// CRC32C of a batch header and table, with the CRC field itself taken as zero.
fn batch_crc(header_and_table: &[u8]) -> u32 {
    let crc = crc32c::crc32c(&header_and_table[..BATCH_CRC_AT]);
    let crc = crc32c::crc32c_append(crc, &[0u8; 4]);
    crc32c::crc32c_append(crc, &header_and_table[BATCH_CRC_AT + 4..])
}

// ---------------------------------------------------------------------------------------------
// Record

/// The fixed 40-byte record header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecordHeader {
    pub kind: RecordKind,
    pub seq: u64,
    pub offset: u64,
    pub length: u64,
    pub chunks: u32,
}

impl RecordHeader {
    pub fn new(kind: RecordKind, seq: u64, offset: u64, length: u64) -> Self {
        RecordHeader {
            kind,
            seq,
            offset,
            length,
            chunks: chunk_count(kind, length),
        }
    }

    pub fn encode(&self) -> [u8; RECORD_HEADER_BYTES as usize] {
        let mut bytes = [0u8; RECORD_HEADER_BYTES as usize];
        bytes[0..4].copy_from_slice(&RECORD_MAGIC.to_le_bytes());
        bytes[4] = VERSION;
        bytes[5] = self.kind as u8;
        // 6..8: flags, zero.
        bytes[8..16].copy_from_slice(&self.seq.to_le_bytes());
        bytes[16..24].copy_from_slice(&self.offset.to_le_bytes());
        bytes[24..32].copy_from_slice(&self.length.to_le_bytes());
        bytes[32..36].copy_from_slice(&self.chunks.to_le_bytes());
        let crc = crc32c::crc32c(&bytes[..RECORD_CRC_AT]);
        bytes[RECORD_CRC_AT..].copy_from_slice(&crc.to_le_bytes());
        bytes
    }

    /// Parses and validates a record header; the error says why the bytes are not one.
    pub fn decode(bytes: &[u8]) -> Result<RecordHeader, String> {
        if bytes.len() < RECORD_HEADER_BYTES as usize {
            return Err(format!(
                "{} bytes, too few for a record header",
                bytes.len()
            ));
        }
        let magic = le_u32(bytes, 0);
        if magic != RECORD_MAGIC {
            return Err(format!("bad record magic {magic:#010x}"));
        }
        let stored = le_u32(bytes, RECORD_CRC_AT);
        let crc = crc32c::crc32c(&bytes[..RECORD_CRC_AT]);
        if stored != crc {
            return Err(format!(
                "record header crc {stored:#010x} != computed {crc:#010x}"
            ));
        }
        if bytes[4] != VERSION {
            return Err(format!("unsupported record version {}", bytes[4]));
        }
        let kind = RecordKind::from_byte(bytes[5])
            .ok_or_else(|| format!("unknown record kind {}", bytes[5]))?;
        if bytes[6..8] != [0, 0] {
            return Err("record flags must be zero".into());
        }
        let header = RecordHeader {
            kind,
            seq: le_u64(bytes, 8),
            offset: le_u64(bytes, 16),
            length: le_u64(bytes, 24),
            chunks: le_u32(bytes, 32),
        };
        check_range(kind, header.offset, header.length)?;
        if header.chunks != chunk_count(kind, header.length) {
            return Err(format!(
                "{} chunks for {} bytes of {:?}",
                header.chunks, header.length, kind
            ));
        }
        Ok(header)
    }

    pub fn record_bytes(&self) -> u64 {
        record_bytes(self.kind, self.length)
    }

    /// Whether this header says what the table entry says.
    pub fn matches(&self, entry: &TableEntry, seq: u64) -> bool {
        self.kind == entry.kind
            && self.offset == entry.offset
            && self.length == entry.length
            && self.seq == seq
    }
}

fn check_range(kind: RecordKind, offset: u64, length: u64) -> Result<(), String> {
    if length == 0 {
        return Err("zero-length record".into());
    }
    if offset.checked_add(length).is_none() {
        return Err(format!("range {offset}+{length} overflows"));
    }
    if kind == RecordKind::Write && length.div_ceil(CHUNK_BYTES) > u64::from(u32::MAX) {
        return Err(format!("write record of {length} bytes is too long"));
    }
    Ok(())
}

/// Payload chunks of a record (write records only).
pub fn chunk_count(kind: RecordKind, length: u64) -> u32 {
    match kind {
        // Writes are bounded by the batch size, far below 16 TiB: the count fits.
        RecordKind::Write => u32::try_from(length.div_ceil(CHUNK_BYTES)).unwrap_or(u32::MAX),
        RecordKind::Zero | RecordKind::Barrier => 0,
    }
}

/// Bytes a record occupies in a batch: header, then (writes) chunk CRCs and payload.
pub fn record_bytes(kind: RecordKind, length: u64) -> u64 {
    match kind {
        RecordKind::Write => payload_start(chunk_count(kind, length)) + length,
        RecordKind::Zero | RecordKind::Barrier => RECORD_HEADER_BYTES,
    }
}

/// Offset of the chunk CRCs, relative to the record start.
pub fn crcs_start() -> u64 {
    RECORD_HEADER_BYTES
}

/// Offset of the payload, relative to the record start.
pub fn payload_start(chunks: u32) -> u64 {
    RECORD_HEADER_BYTES + CRC_BYTES * u64::from(chunks)
}

/// Appends a complete record (header, chunk CRCs, payload) to `out`.
#[cfg(test)]
pub fn encode_record(header: &RecordHeader, payload: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(&header.encode());
    if header.kind == RecordKind::Write {
        for chunk in payload.chunks(CHUNK_BYTES as usize) {
            out.extend_from_slice(&crc32c::crc32c(chunk).to_le_bytes());
        }
        out.extend_from_slice(payload);
    }
}

/// Checks `payload` (consecutive chunks, the first being chunk `first_chunk` of its record)
/// against `crcs` (their stored CRCs, 4 bytes each). Returns the index of the first bad chunk.
pub fn verify_chunks(crcs: &[u8], payload: &[u8], first_chunk: u64) -> Result<(), u64> {
    let stored = crcs.chunks_exact(CRC_BYTES as usize);
    for (i, (chunk, crc)) in payload.chunks(CHUNK_BYTES as usize).zip(stored).enumerate() {
        let stored = u32::from_le_bytes([crc[0], crc[1], crc[2], crc[3]]);
        if crc32c::crc32c(chunk) != stored {
            return Err(first_chunk + i as u64);
        }
    }
    Ok(())
}

/// Every chunk of `payload` that fails its CRC (indices from 0).
pub fn bad_chunks(crcs: &[u8], payload: &[u8]) -> Vec<u64> {
    let stored = crcs.chunks_exact(CRC_BYTES as usize);
    payload
        .chunks(CHUNK_BYTES as usize)
        .zip(stored)
        .enumerate()
        .filter(|(_, (chunk, crc))| {
            crc32c::crc32c(chunk) != u32::from_le_bytes([crc[0], crc[1], crc[2], crc[3]])
        })
        .map(|(i, _)| i as u64)
        .collect()
}

// ---------------------------------------------------------------------------------------------
// File names

/// File name of the segment file with serial `serial` (files keep their name for life: what a
/// file holds is in its header).
pub fn segment_path(dir: &Path, serial: u64) -> PathBuf {
    dir.join(format!("seg-{serial:020}.oplog"))
}

/// Inverse of [`segment_path`]: the serial, if `name` is a version 3 segment file name.
pub fn parse_segment_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("seg-")?.strip_suffix(".oplog")?;
    parse_20_digits(digits)
}

pub fn parse_20_digits(digits: &str) -> Option<u64> {
    if digits.len() != 20 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

pub fn le_u32(bytes: &[u8], at: usize) -> u32 {
    let mut raw = [0u8; 4];
    raw.copy_from_slice(&bytes[at..at + 4]);
    u32::from_le_bytes(raw)
}

pub fn le_u64(bytes: &[u8], at: usize) -> u64 {
    let mut raw = [0u8; 8];
    raw.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(raw)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_header_round_trips_and_has_the_documented_layout() {
        let header = RecordHeader::new(RecordKind::Write, 7, 0x1234, 5000);
        let bytes = header.encode();
        assert_eq!(&bytes[0..4], b"AOPR");
        assert_eq!(bytes[4], 3);
        assert_eq!(bytes[5], 1);
        assert_eq!(u64::from_le_bytes(bytes[24..32].try_into().unwrap()), 5000);
        assert_eq!(u32::from_le_bytes(bytes[32..36].try_into().unwrap()), 2);
        assert_eq!(RecordHeader::decode(&bytes), Ok(header));
        assert_eq!(header.record_bytes(), 40 + 8 + 5000);
        let mut bad = bytes;
        bad[9] ^= 1;
        assert!(RecordHeader::decode(&bad).unwrap_err().contains("crc"));
        // Zero ranges are not limited to 4 GiB any more.
        let zero = RecordHeader::new(RecordKind::Zero, 8, 0, 5 << 30);
        assert_eq!(RecordHeader::decode(&zero.encode()), Ok(zero));
        assert_eq!(zero.record_bytes(), 40);
    }

    #[test]
    fn batch_header_round_trips_and_checks_its_table() {
        let table = vec![
            TableEntry {
                kind: RecordKind::Write,
                offset: 4096,
                length: 4096,
            },
            TableEntry {
                kind: RecordKind::Zero,
                offset: 0,
                length: 1 << 40,
            },
        ];
        let used = batch_header_bytes(2) + 40 + 4 + 4096 + 40;
        let header = BatchHeader {
            seal: false,
            log_id: 99,
            segment_id: 3,
            segment_first_batch: 10,
            number: 12,
            prev: 11,
            first_seq: 100,
            count: 2,
            bytes: pad_to_block(used) as u32,
            window: 2,
        };
        let mut bytes = Vec::new();
        header.encode(&table, &mut bytes);
        assert_eq!(bytes.len() as u64, batch_header_bytes(2));
        assert_eq!(&bytes[0..4], b"AOPB");
        assert_eq!(BatchHeader::claimed_count(&bytes), Some(2));
        assert_eq!(BatchHeader::decode(&bytes), Ok((header, table.clone())));
        // A flipped bit in the table breaks the header CRC.
        let mut bad = bytes.clone();
        bad[64 + 3] ^= 0x10;
        assert!(BatchHeader::decode(&bad).unwrap_err().contains("crc"));
        // A length that does not match the records is refused even with a good CRC.
        let wrong = BatchHeader {
            bytes: 4096,
            ..header
        };
        let mut bytes = Vec::new();
        wrong.encode(&table, &mut bytes);
        assert!(BatchHeader::decode(&bytes).unwrap_err().contains("length"));
    }

    #[test]
    fn segment_header_round_trips() {
        let header = SegmentHeader {
            state: SegmentState::Active,
            log_id: 5,
            generation: 2,
            segment_id: 9,
            seq_floor: 1000,
            batch_floor: 77,
        };
        let block = header.encode();
        assert_eq!(block.len(), 4096);
        assert_eq!(&block[0..4], b"AOPS");
        assert_eq!(SegmentHeader::decode(&block), Ok(header));
        let mut bad = block.clone();
        bad[30] ^= 4;
        assert!(SegmentHeader::decode(&bad).is_err());
        assert!(SegmentHeader::decode(&[0u8; 4096]).is_err());
    }

    #[test]
    fn segment_names_round_trip() {
        let path = segment_path(Path::new("/x"), 42);
        assert_eq!(path, Path::new("/x/seg-00000000000000000042.oplog"));
        assert_eq!(
            parse_segment_name("seg-00000000000000000042.oplog"),
            Some(42)
        );
        assert_eq!(parse_segment_name("00000000000000000042.oplog"), None);
        assert_eq!(parse_segment_name("seg-42.oplog"), None);
    }

    #[test]
    fn chunk_verification_names_the_bad_chunk() {
        let payload = vec![7u8; 9000];
        let header = RecordHeader::new(RecordKind::Write, 1, 0, 9000);
        let mut record = Vec::new();
        encode_record(&header, &payload, &mut record);
        let crcs = &record[40..52];
        assert_eq!(verify_chunks(crcs, &payload, 0), Ok(()));
        let mut bad = payload.clone();
        bad[8500] ^= 0xff;
        assert_eq!(verify_chunks(crcs, &bad, 0), Err(2));
        assert_eq!(verify_chunks(&crcs[8..], &bad[8192..], 2), Err(2));
        assert_eq!(bad_chunks(crcs, &bad), vec![2]);
    }
}

//! Byte layout of oplog records (version 1). docs/oplog-format.md is the reference; this file
//! is its only implementation, so encode and decode live side by side.

use std::path::{Path, PathBuf};

/// "AOPL" read as a little-endian u32.
pub const MAGIC: u32 = 0x4C50_4F41;
pub const VERSION: u8 = 1;
pub const HEADER_BYTES: u64 = 40;
/// Payloads carry one CRC32C per chunk of this size (the last chunk may be shorter), so a
/// 4 KiB read verifies 4 KiB, not the whole record.
pub const CHUNK_BYTES: u64 = 4096;
const CRC_BYTES: u64 = 4;
/// The header CRC covers every header byte before it.
const HEADER_CRC_AT: usize = 36;

/// What a record says about its range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordKind {
    /// The range holds the record's payload.
    Write = 1,
    /// The range reads as zeros.
    Zero = 2,
    /// The newest data of the range lives in the extent store.
    Barrier = 3,
}

impl RecordKind {
    fn from_byte(byte: u8) -> Option<Self> {
        match byte {
            1 => Some(RecordKind::Write),
            2 => Some(RecordKind::Zero),
            3 => Some(RecordKind::Barrier),
            _ => None,
        }
    }
}

/// The fixed 40-byte record header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub kind: RecordKind,
    pub seq: u64,
    pub offset: u64,
    pub length: u32,
    pub chunks: u32,
}

impl Header {
    pub fn new(kind: RecordKind, seq: u64, offset: u64, length: u32) -> Self {
        let chunks = match kind {
            RecordKind::Write => chunk_count(u64::from(length)),
            RecordKind::Zero | RecordKind::Barrier => 0,
        };
        Header {
            kind,
            seq,
            offset,
            length,
            chunks,
        }
    }

    pub fn encode(&self) -> [u8; HEADER_BYTES as usize] {
        let mut bytes = [0u8; HEADER_BYTES as usize];
        bytes[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        bytes[4] = VERSION;
        bytes[5] = self.kind as u8;
        // bytes 6..8: flags, zero in version 1.
        bytes[8..16].copy_from_slice(&self.seq.to_le_bytes());
        bytes[16..24].copy_from_slice(&self.offset.to_le_bytes());
        bytes[24..28].copy_from_slice(&self.length.to_le_bytes());
        bytes[28..32].copy_from_slice(&self.chunks.to_le_bytes());
        // bytes 32..36: reserved, zero.
        let crc = crc32c::crc32c(&bytes[..HEADER_CRC_AT]);
        bytes[HEADER_CRC_AT..].copy_from_slice(&crc.to_le_bytes());
        bytes
    }

    /// Parses and validates a header; the error says why the bytes are not a header.
    pub fn decode(bytes: &[u8]) -> Result<Header, String> {
        if bytes.len() < HEADER_BYTES as usize {
            return Err(format!(
                "header needs {HEADER_BYTES} bytes, {} present",
                bytes.len()
            ));
        }
        let magic = le_u32(bytes, 0);
        if magic != MAGIC {
            return Err(format!("bad magic {magic:#010x}"));
        }
        let stored_crc = le_u32(bytes, HEADER_CRC_AT);
        let crc = crc32c::crc32c(&bytes[..HEADER_CRC_AT]);
        if stored_crc != crc {
            return Err(format!(
                "header crc {stored_crc:#010x} != computed {crc:#010x}"
            ));
        }
        if bytes[4] != VERSION {
            return Err(format!("unsupported version {}", bytes[4]));
        }
        let kind =
            RecordKind::from_byte(bytes[5]).ok_or_else(|| format!("unknown kind {}", bytes[5]))?;
        let flags = u16::from_le_bytes([bytes[6], bytes[7]]);
        let reserved = le_u32(bytes, 32);
        if flags != 0 || reserved != 0 {
            return Err(format!(
                "flags {flags:#x} / reserved {reserved:#x} must be zero"
            ));
        }
        let header = Header {
            kind,
            seq: le_u64(bytes, 8),
            offset: le_u64(bytes, 16),
            length: le_u32(bytes, 24),
            chunks: le_u32(bytes, 28),
        };
        header.check_consistency()?;
        Ok(header)
    }

    /// Rejects headers this code never writes, so a lucky CRC on garbage cannot index nonsense.
    fn check_consistency(&self) -> Result<(), String> {
        if self.length == 0 {
            return Err("zero-length record".into());
        }
        if self.offset.checked_add(u64::from(self.length)).is_none() {
            return Err(format!("range {}+{} overflows", self.offset, self.length));
        }
        let expected = Header::new(self.kind, self.seq, self.offset, self.length).chunks;
        if self.chunks != expected {
            return Err(format!(
                "{} chunks for {} bytes of {:?}",
                self.chunks, self.length, self.kind
            ));
        }
        Ok(())
    }

    /// Bytes after the header: chunk CRCs and payload (write records only).
    pub fn body_bytes(&self) -> u64 {
        match self.kind {
            RecordKind::Write => payload_start(self.chunks) - HEADER_BYTES + u64::from(self.length),
            RecordKind::Zero | RecordKind::Barrier => 0,
        }
    }

    pub fn record_bytes(&self) -> u64 {
        HEADER_BYTES + self.body_bytes()
    }
}

/// Size on disk of a write record with `length` payload bytes.
pub fn write_record_bytes(length: u64) -> u64 {
    payload_start_for_length(length) + length
}

/// Offset of the first chunk CRC, relative to the record start.
pub fn crcs_start() -> u64 {
    HEADER_BYTES
}

/// Offset of the payload, relative to the record start.
pub fn payload_start(chunks: u32) -> u64 {
    HEADER_BYTES + CRC_BYTES * u64::from(chunks)
}

fn payload_start_for_length(length: u64) -> u64 {
    HEADER_BYTES + CRC_BYTES * length.div_ceil(CHUNK_BYTES)
}

pub fn chunk_count(length: u64) -> u32 {
    // Callers bound `length` by u32::MAX, so the count (length / 4096) always fits.
    u32::try_from(length.div_ceil(CHUNK_BYTES)).unwrap_or(u32::MAX)
}

/// Appends a complete record (header, chunk CRCs, payload) to `out`.
pub fn encode_record(header: &Header, payload: &[u8], out: &mut Vec<u8>) {
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

/// File name of the segment whose first record has sequence number `first_seq`.
pub fn segment_path(dir: &Path, first_seq: u64) -> PathBuf {
    dir.join(format!("{first_seq:020}.oplog"))
}

/// Name of a spare segment file: a freed segment kept for reuse, holding stale records.
pub fn spare_path(dir: &Path, serial: u64) -> PathBuf {
    dir.join(format!("spare-{serial:020}.oplog"))
}

/// Inverse of [`spare_path`]: the serial, if `name` is a spare file name.
pub fn parse_spare_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("spare-")?.strip_suffix(".oplog")?;
    if digits.len() != 20 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Inverse of [`segment_path`]: the first sequence number, if `name` is a segment file name.
pub fn parse_segment_name(name: &str) -> Option<u64> {
    let digits = name.strip_suffix(".oplog")?;
    if digits.len() != 20 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

fn le_u32(bytes: &[u8], at: usize) -> u32 {
    let mut raw = [0u8; 4];
    raw.copy_from_slice(&bytes[at..at + 4]);
    u32::from_le_bytes(raw)
}

fn le_u64(bytes: &[u8], at: usize) -> u64 {
    let mut raw = [0u8; 8];
    raw.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(raw)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips_and_has_the_documented_layout() {
        let header = Header::new(RecordKind::Write, 7, 0x1234, 5000);
        let bytes = header.encode();
        assert_eq!(&bytes[0..4], b"AOPL");
        assert_eq!(bytes[4], 1);
        assert_eq!(bytes[5], 1);
        assert_eq!(u32::from_le_bytes(bytes[28..32].try_into().unwrap()), 2);
        assert_eq!(Header::decode(&bytes), Ok(header));
        assert_eq!(header.record_bytes(), 40 + 8 + 5000);
        assert_eq!(write_record_bytes(5000), header.record_bytes());
    }

    #[test]
    fn decode_rejects_flipped_bits_and_inconsistent_headers() {
        let mut bytes = Header::new(RecordKind::Zero, 1, 0, 4096).encode();
        bytes[9] ^= 1;
        assert!(Header::decode(&bytes).unwrap_err().contains("crc"));
        let bad = Header {
            kind: RecordKind::Zero,
            seq: 1,
            offset: 0,
            length: 10,
            chunks: 1,
        };
        assert!(Header::decode(&bad.encode())
            .unwrap_err()
            .contains("chunks"));
    }

    #[test]
    fn segment_names_round_trip() {
        let path = segment_path(Path::new("/x"), 42);
        assert_eq!(path, Path::new("/x/00000000000000000042.oplog"));
        assert_eq!(parse_segment_name("00000000000000000042.oplog"), Some(42));
        assert_eq!(parse_segment_name("42.oplog"), None);
        assert_eq!(parse_segment_name("00000000000000000042.oplog.tmp"), None);
        let spare = spare_path(Path::new("/x"), 7);
        assert_eq!(spare, Path::new("/x/spare-00000000000000000007.oplog"));
        assert_eq!(
            parse_spare_name("spare-00000000000000000007.oplog"),
            Some(7)
        );
        assert_eq!(parse_segment_name("spare-00000000000000000007.oplog"), None);
        assert_eq!(parse_spare_name("00000000000000000007.oplog"), None);
    }

    #[test]
    fn chunk_verification_names_the_bad_chunk() {
        let payload = vec![7u8; 9000];
        let header = Header::new(RecordKind::Write, 1, 0, 9000);
        let mut record = Vec::new();
        encode_record(&header, &payload, &mut record);
        let crcs = &record[40..52];
        assert_eq!(verify_chunks(crcs, &payload, 0), Ok(()));
        let mut bad = payload.clone();
        bad[8500] ^= 0xff;
        assert_eq!(verify_chunks(crcs, &bad, 0), Err(2));
        assert_eq!(verify_chunks(&crcs[8..], &bad[8192..], 2), Err(2));
    }
}

//! Read-only replay of a version 1 or 2 log: upgrade by replay. The old records are applied
//! to the index exactly as the version 2 reader did; the log then serves reads and drains but
//! refuses appends (`OplogError::ReadOnly`). Drained segments are deleted oldest first (rule
//! 2, as in version 2); once empty, the engine destroys the directory and writes to a new one.
//!
//! Version 2 layout (docs/oplog-format.md, "Older versions"): segment files named by their
//! first sequence number (`<20 digits>.oplog`) holding 40-byte-header records back to back
//! from offset 0 (magic "AOPL", version byte 1, u32 length), and stale `spare-<20>.oplog`
//! files. Nothing is written to the old files: a torn tail is ignored, not truncated.

use super::error::{io_error, OplogError};
use super::format::{le_u32, le_u64, parse_20_digits, verify_chunks, RecordKind, CHUNK_BYTES};
use super::index::{DataLoc, Index, Target, TargetKind};
use super::state::{FileHandle, Segment, SegmentKind, State};
use super::{OplogConfig, ReplayReport, SegmentId, Seq};
use crate::fs::{DiskFile, Filesystem};
use std::io;
use std::path::Path;

/// "AOPL" read as a little-endian u32.
const MAGIC: u32 = 0x4C50_4F41;
const VERSION: u8 = 1;
const HEADER_BYTES: u64 = 40;
const HEADER_CRC_AT: usize = 36;
/// The version reported for a log read here (version 1 and 2 records are the same).
const LEGACY_VERSION: u8 = 2;
/// Headers are read through a window of this size.
const WINDOW_BYTES: u64 = 256 << 10;

/// Whether `name` is a version 1/2 segment or spare file name.
pub(super) fn is_legacy_name(name: &str) -> bool {
    legacy_segment(name).is_some() || legacy_spare(name)
}

fn legacy_segment(name: &str) -> Option<u64> {
    parse_20_digits(name.strip_suffix(".oplog")?)
}

fn legacy_spare(name: &str) -> bool {
    name.strip_prefix("spare-")
        .and_then(|n| n.strip_suffix(".oplog"))
        .and_then(parse_20_digits)
        .is_some()
}

/// A version 1 record header.
#[derive(Clone, Copy, Debug)]
struct Header {
    kind: RecordKind,
    seq: u64,
    offset: u64,
    length: u64,
    chunks: u32,
}

impl Header {
    fn decode(bytes: &[u8]) -> Result<Header, String> {
        if bytes.len() < HEADER_BYTES as usize {
            return Err(format!("{} bytes left, too few for a header", bytes.len()));
        }
        let magic = le_u32(bytes, 0);
        if magic != MAGIC {
            return Err(format!("bad magic {magic:#010x}"));
        }
        let stored = le_u32(bytes, HEADER_CRC_AT);
        let crc = crc32c::crc32c(&bytes[..HEADER_CRC_AT]);
        if stored != crc {
            return Err(format!("header crc {stored:#010x} != computed {crc:#010x}"));
        }
        if bytes[4] != VERSION {
            return Err(format!("unsupported version {}", bytes[4]));
        }
        let kind =
            RecordKind::from_byte(bytes[5]).ok_or_else(|| format!("unknown kind {}", bytes[5]))?;
        if bytes[6..8] != [0, 0] || le_u32(bytes, 32) != 0 {
            return Err("flags / reserved must be zero".into());
        }
        let header = Header {
            kind,
            seq: le_u64(bytes, 8),
            offset: le_u64(bytes, 16),
            length: u64::from(le_u32(bytes, 24)),
            chunks: le_u32(bytes, 28),
        };
        let chunks = match kind {
            RecordKind::Write => header.length.div_ceil(CHUNK_BYTES),
            RecordKind::Zero | RecordKind::Barrier => 0,
        };
        if header.length == 0
            || header.offset.checked_add(header.length).is_none()
            || u64::from(header.chunks) != chunks
        {
            return Err("inconsistent header".into());
        }
        Ok(header)
    }

    fn payload_start(&self) -> u64 {
        HEADER_BYTES + 4 * u64::from(self.chunks)
    }

    fn record_bytes(&self) -> u64 {
        match self.kind {
            RecordKind::Write => self.payload_start() + self.length,
            RecordKind::Zero | RecordKind::Barrier => HEADER_BYTES,
        }
    }
}

pub(super) async fn replay<F: Filesystem>(
    fs: &F,
    config: &OplogConfig,
    names: Vec<String>,
) -> Result<(State<F::File>, ReplayReport), OplogError> {
    let dir = &config.dir;
    let mut segments: Vec<(u64, String)> = Vec::new();
    // Appends are refused: no bypass write skips its barrier here (`replay_may_reach`).
    let mut state = State::new(
        1,
        1,
        1,
        1,
        super::reach::ReplayReach::new(config.replay_reach_granule_bytes),
    );
    state.legacy = Some(LEGACY_VERSION);
    for name in names {
        match legacy_segment(&name) {
            Some(seq) => segments.push((seq, name)),
            None => state.other_files.push(dir.join(name)),
        }
    }
    segments.sort_unstable();
    let count = segments.len();
    let mut next_seq = 1;
    // Where the previous segment's records stopped before the end of its file, and why.
    let mut previous_end: Option<(std::path::PathBuf, u64, String)> = None;
    for (i, (id, name)) in segments.into_iter().enumerate() {
        let path = dir.join(&name);
        let last = i + 1 == count;
        if i > 0 && id != next_seq {
            let (path, file_offset, reason) = previous_end.unwrap_or((
                path,
                0,
                String::from("no record reaches this segment's first sequence number"),
            ));
            return Err(OplogError::Corrupt {
                path,
                file_offset,
                reason: format!(
                    "sequence gap: the next segment starts at {id}, records end before {next_seq}: {reason}"
                ),
            });
        }
        let file = fs
            .open(&path, false)
            .await
            .map_err(|e| io_error(&path, e))?;
        let len = file.len().await.map_err(|e| io_error(&path, e))?;
        let segment = SegmentId(id);
        let scanned = scan_segment(&file, &path, segment, len, last, &mut state.index).await?;
        if let Some(reason) = &scanned.stopped {
            tracing::info!(path = %path.display(), valid = scanned.valid, len, %reason,
                "version 2 oplog segment ends before its file (torn write or reused file)");
        }
        previous_end = (!last)
            .then_some(scanned.stopped)
            .flatten()
            .map(|reason| (path.clone(), scanned.valid, reason));
        next_seq = scanned.next_seq;
        state.segments.insert(
            segment,
            Segment {
                handle: FileHandle::new(file, path, 0),
                kind: SegmentKind::Legacy,
                len,
                end: scanned.valid,
                closed: true,
                inflight: 0,
                first_batch: None,
            },
        );
    }
    state.files = state.segments.len();
    state.next_seq = next_seq;
    state.durable_through = next_seq - 1;
    let report = ReplayReport {
        legacy_version: Some(LEGACY_VERSION),
        ..ReplayReport::default()
    };
    Ok((state, report))
}

struct Scanned {
    /// Bytes of whole, valid records.
    valid: u64,
    next_seq: u64,
    /// Why the records stopped before the end of the file.
    stopped: Option<String>,
}

/// Applies every valid record of one segment to the index (the version 2 rules: records end
/// at the first one that is not the next; payload CRCs are checked in the last segment only).
async fn scan_segment<D: DiskFile>(
    file: &D,
    path: &Path,
    segment: SegmentId,
    len: u64,
    last: bool,
    index: &mut Index,
) -> Result<Scanned, OplogError> {
    let mut window = Window::default();
    let mut pos = 0;
    let mut seq = segment.0;
    while pos < len {
        let record = read_record(file, &mut window, pos, len, last)
            .await
            .map_err(|e| io_error(path, e))?;
        match record {
            Ok(header) if header.seq == seq => {
                apply(index, &header, segment, pos);
                pos += header.record_bytes();
                seq += 1;
            }
            Ok(header) if header.seq < segment.0 => {
                return Ok(Scanned {
                    valid: pos,
                    next_seq: seq,
                    stopped: Some(format!("stale record {} of a reused file", header.seq)),
                });
            }
            Ok(header) => {
                return Err(OplogError::Corrupt {
                    path: path.to_path_buf(),
                    file_offset: pos,
                    reason: format!("record has sequence number {}, expected {seq}", header.seq),
                });
            }
            Err(reason) => {
                return Ok(Scanned {
                    valid: pos,
                    next_seq: seq,
                    stopped: Some(reason),
                })
            }
        }
    }
    Ok(Scanned {
        valid: pos,
        next_seq: seq,
        stopped: None,
    })
}

fn apply(index: &mut Index, header: &Header, segment: SegmentId, at: u64) {
    let end = header.offset + header.length;
    let kind = match header.kind {
        RecordKind::Write => TargetKind::Data(DataLoc {
            crcs_at: at + HEADER_BYTES,
            payload_at: at + header.payload_start(),
            record_offset: header.offset,
            record_length: header.length,
        }),
        RecordKind::Zero => TargetKind::Zero,
        RecordKind::Barrier => {
            index.apply(header.offset, end, None);
            return;
        }
    };
    let target = Target {
        seq: Seq(header.seq),
        segment,
        kind,
    };
    index.apply(header.offset, end, Some(target));
}

async fn read_record<D: DiskFile>(
    file: &D,
    window: &mut Window,
    pos: u64,
    len: u64,
    verify_payload: bool,
) -> io::Result<Result<Header, String>> {
    if len - pos < HEADER_BYTES {
        return Ok(Err(format!(
            "{} bytes left, too few for a header",
            len - pos
        )));
    }
    let header = match Header::decode(window.get(file, pos, HEADER_BYTES, len).await?) {
        Ok(header) => header,
        Err(reason) => return Ok(Err(reason)),
    };
    if header.record_bytes() > len - pos {
        return Ok(Err(format!(
            "record of {} bytes runs past the end of the file",
            header.record_bytes()
        )));
    }
    if verify_payload && header.kind == RecordKind::Write {
        let body = window
            .get(
                file,
                pos + HEADER_BYTES,
                header.record_bytes() - HEADER_BYTES,
                len,
            )
            .await?;
        let split = (header.payload_start() - HEADER_BYTES) as usize;
        let (crcs, payload) = body.split_at(split);
        if let Err(bad) = verify_chunks(crcs, payload, 0) {
            return Ok(Err(format!(
                "payload chunk {bad} of record {} fails its CRC32C",
                header.seq
            )));
        }
    }
    Ok(Ok(header))
}

/// A read-ahead buffer over a file: serves byte ranges from one larger read.
#[derive(Default)]
struct Window {
    start: u64,
    data: Vec<u8>,
}

impl Window {
    async fn get<D: DiskFile>(
        &mut self,
        file: &D,
        pos: u64,
        n: u64,
        len: u64,
    ) -> io::Result<&[u8]> {
        let cached_end = self.start + self.data.len() as u64;
        if pos < self.start || pos + n > cached_end {
            let want = n.max(WINDOW_BYTES).min(len - pos);
            self.data.resize(want as usize, 0);
            file.read_at(&mut self.data, pos).await?;
            self.start = pos;
        }
        let at = (pos - self.start) as usize;
        Ok(&self.data[at..at + n as usize])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn legacy_names() {
        assert!(is_legacy_name("00000000000000000001.oplog"));
        assert!(is_legacy_name("spare-00000000000000000003.oplog"));
        assert!(!is_legacy_name("seg-00000000000000000001.oplog"));
        assert!(!is_legacy_name("1.oplog"));
    }
}

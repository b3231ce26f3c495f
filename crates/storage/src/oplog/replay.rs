//! Rebuilding the index from the segment files at open.
//!
//! Segments are read oldest first and their records applied in sequence order, exactly as
//! commits applied them, so the index comes back as it was (plus, possibly, records that were
//! durable but not yet acknowledged when the process died).
//!
//! Only the last segment can have a torn tail: a segment is closed (a newer one gets records)
//! only after its last batch was synced. So in the last segment the first record that is cut
//! short or fails a check (header CRC, or a payload chunk CRC) ends the log and the file is
//! truncated there. Payload CRCs are checked at replay only in the last segment, where a crash
//! can tear a payload behind an intact header; in older segments a bad chunk is reported when
//! it is read, so it costs that range, not the vdisk.
//!
//! Segment files are reused (see `files::MAX_SPARE_SEGMENTS`), so any segment may hold stale
//! bytes after its records: a header with a sequence number below the segment's first, or
//! garbage from the middle of an old record. A segment's records therefore end at the first
//! record that is not the next one. That loses no corruption report: a segment's successor
//! must start with the next sequence number, so records lost to a bad header in an older
//! segment show up as a sequence gap, reported at the place they stopped. A record whose
//! header is intact but whose sequence number is neither the next one nor stale cannot come
//! from a torn write or a reused file and is `Corrupt` in every segment.

use super::error::io_error;
use super::files;
use super::format::{payload_start, verify_chunks, Header, RecordKind, HEADER_BYTES};
use super::index::Index;
use super::{IndexUpdate, OplogError, Segment};
use crate::disk::{FileIo, FileOpener};
use std::collections::BTreeMap;
use std::io;
use std::path::Path;
use std::rc::Rc;

/// Headers are read through a window of this size, so small records cost no syscall each.
const WINDOW_BYTES: u64 = 256 << 10;

pub(super) struct Replayed<F> {
    pub segments: BTreeMap<u64, Segment<F>>,
    /// Spare files found in the directory, by serial (at most `MAX_SPARE_SEGMENTS`).
    pub spares: Vec<(u64, std::path::PathBuf)>,
    pub active: Option<u64>,
    pub next_seq: u64,
    pub index: Index,
    pub usage: u64,
}

/// How a segment scan ended.
struct Scanned {
    /// Bytes of whole, valid records.
    valid: u64,
    /// Sequence number the next record must have.
    next_seq: u64,
    /// Why the scan stopped before the end of the file, in the last segment: a torn write,
    /// or the stale records of a reused file after the last new one. The file is cut there.
    torn: Option<String>,
    /// Why the scan stopped before the end of the file, in an older segment: normally the
    /// stale rest of a reused file; if records are missing, the replay reports it as where
    /// they were lost.
    stopped: Option<String>,
}

pub(super) async fn replay<O: FileOpener>(
    opener: &O,
    dir: &Path,
) -> Result<Replayed<O::File>, OplogError> {
    let listing = files::list_segments(dir)?;
    let listed = listing.segments;
    let mut spares = listing.spares;
    for (_, extra) in spares.split_off(spares.len().min(files::MAX_SPARE_SEGMENTS)) {
        std::fs::remove_file(&extra).map_err(|e| io_error(&extra, e))?;
    }
    let mut replayed = Replayed {
        segments: BTreeMap::new(),
        spares,
        active: None,
        next_seq: 1,
        index: Index::default(),
        usage: 0,
    };
    let count = listed.len();
    // Where the previous segment's records stopped before the end of its file, and why.
    let mut previous_end: Option<(std::path::PathBuf, u64, String)> = None;
    for (i, (id, path)) in listed.into_iter().enumerate() {
        let last = i + 1 == count;
        if i > 0 && id != replayed.next_seq {
            // Records are missing: if the previous segment stopped at a bad header, that is
            // where they went; otherwise a segment file is missing.
            let (path, file_offset, reason) = previous_end.unwrap_or((
                path,
                0,
                String::from("no record reaches this segment's first sequence number"),
            ));
            return Err(OplogError::Corrupt {
                path,
                file_offset,
                reason: format!(
                    "sequence gap: the next segment starts at {id}, records end before {}: {reason}",
                    replayed.next_seq
                ),
            });
        }
        let file = opener.open(&path, false).map_err(|e| io_error(&path, e))?;
        let len = files::file_len(&path)?;
        let scanned = scan_segment(&file, &path, id, len, last, &mut replayed.index).await?;
        if let Some(reason) = &scanned.torn {
            tracing::info!(path = %path.display(), valid = scanned.valid, len, %reason,
                "oplog's last segment ends before its file (torn write or reused file); cutting the rest off");
            files::truncate(&path, scanned.valid).await?;
        }
        // Append after an intact last segment, or into a torn one that is now empty; after a
        // cut-off tail, continue in a new segment.
        if last && (scanned.torn.is_none() || scanned.valid == 0) {
            replayed.active = Some(id);
        }
        previous_end = scanned
            .stopped
            .map(|reason| (path.clone(), scanned.valid, reason));
        replayed.next_seq = scanned.next_seq;
        replayed.usage += scanned.valid;
        let segment = Segment {
            path,
            file: Some(Rc::new(file)),
            bytes: scanned.valid,
            batches: 0,
        };
        replayed.segments.insert(id, segment);
    }
    Ok(replayed)
}

/// Applies every valid record of one segment to the index.
async fn scan_segment<F: FileIo>(
    file: &F,
    path: &Path,
    id: u64,
    len: u64,
    last: bool,
    index: &mut Index,
) -> Result<Scanned, OplogError> {
    let mut window = Window::default();
    let mut pos = 0;
    let mut seq = id;
    while pos < len {
        match read_record(file, &mut window, pos, len, last)
            .await
            .map_err(|e| io_error(path, e))?
        {
            Ok(header) if header.seq == seq => {
                IndexUpdate::for_record(&header, id, pos).apply(index);
                pos += header.record_bytes();
                seq += 1;
            }
            // A reused (spare) file: what follows the new records is older than all of them.
            Ok(header) if header.seq < id => {
                let reason = format!("stale record {} of a reused file", header.seq);
                return Ok(stopped_at(pos, seq, last, reason));
            }
            Ok(header) => {
                let reason = format!("record has sequence number {}, expected {seq}", header.seq);
                return Err(OplogError::Corrupt {
                    path: path.to_path_buf(),
                    file_offset: pos,
                    reason,
                });
            }
            Err(reason) => return Ok(stopped_at(pos, seq, last, reason)),
        }
    }
    Ok(Scanned {
        valid: pos,
        next_seq: seq,
        torn: None,
        stopped: None,
    })
}

fn stopped_at(pos: u64, next_seq: u64, last: bool, reason: String) -> Scanned {
    Scanned {
        valid: pos,
        next_seq,
        torn: last.then(|| reason.clone()),
        stopped: (!last).then_some(reason),
    }
}

/// Reads the record at `pos`: its header, or why there is no valid record there. Payload
/// chunks are checked when `verify_payload` is set.
async fn read_record<F: FileIo>(
    file: &F,
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
            .get(file, pos + HEADER_BYTES, header.body_bytes(), len)
            .await?;
        let split = (payload_start(header.chunks) - HEADER_BYTES) as usize;
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
    /// `[pos, pos+n)`, which must lie within the file's `len` bytes.
    async fn get<F: FileIo>(&mut self, file: &F, pos: u64, n: u64, len: u64) -> io::Result<&[u8]> {
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

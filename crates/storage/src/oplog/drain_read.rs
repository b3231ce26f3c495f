//! Reading a drain batch's data back from the log in few large reads.
//!
//! A drain batch is the live entries of the oldest segments: records written one after the
//! other into the same files. Read one entry at a time, a batch of 4 KiB random writes cost
//! two small disk reads per entry (its chunk CRCs, then its chunks), and the drain could not
//! keep up with the writers it makes room for. Here the byte spans of a segment's entries
//! (CRCs through the last chunk needed: they are contiguous in a record) are merged with their
//! neighbours into reads of at most [`DrainReadLimits::max_read_bytes`], all issued at once;
//! each entry is then verified against its chunk CRCs and sliced out without a copy.

use super::error::io_error;
use super::format::{bad_chunks, CHUNK_BYTES, CRC_BYTES};
use super::index::{DataLoc, TargetKind};
use super::state::ReadGuard;
use super::{DrainItem, Inner, OplogError, SegmentId};
use crate::fs::{DiskFile, Filesystem, DIRECT_IO_ALIGNMENT_BYTES};
use crate::join::join_all;
use bytes::Bytes;
use std::collections::BTreeMap;

/// How a drain batch is read back.
#[derive(Clone, Copy, Debug)]
pub struct DrainReadLimits {
    /// Largest single read. Neighbouring entries are read together up to this size.
    pub max_read_bytes: u64,
    /// Bytes of dead log (overwritten or already drained records) a merged read may carry
    /// between two entries rather than being split in two.
    pub max_gap_bytes: u64,
}

impl Default for DrainReadLimits {
    fn default() -> Self {
        DrainReadLimits {
            max_read_bytes: 1 << 20,
            max_gap_bytes: 64 << 10,
        }
    }
}

/// One drain item's content, as read back from the log.
#[derive(Debug)]
pub enum DrainData {
    /// The item's bytes, verified against their chunk CRCs.
    Data(Bytes),
    /// A zero item: nothing to read.
    Zero,
    /// The item's bytes were lost when replay found them rotted: the error says where.
    /// Record the range lost in the extent store.
    Lost(OplogError),
    /// Some chunks of the item fail their CRC now (rot since replay): write `bytes`, then
    /// record the range of each error in `lost` lost (a rotted chunk costs its own bytes only).
    Rotted { bytes: Bytes, lost: Vec<OplogError> },
}

/// The part of a record one item needs: its chunk CRCs and whole chunks.
struct Want {
    item: usize,
    data: DataLoc,
    first_chunk: u64,
    end_chunk: u64,
}

impl Want {
    fn new(item: usize, offset: u64, length: u64, data: DataLoc) -> Want {
        let start = offset - data.record_offset;
        Want {
            item,
            data,
            first_chunk: start / CHUNK_BYTES,
            end_chunk: (start + length).div_ceil(CHUNK_BYTES),
        }
    }

    fn crcs_start(&self) -> u64 {
        self.data.crcs_at + self.first_chunk * CRC_BYTES
    }

    fn crcs_end(&self) -> u64 {
        self.data.crcs_at + self.end_chunk * CRC_BYTES
    }

    fn chunks_start(&self) -> u64 {
        self.data.payload_at + self.first_chunk * CHUNK_BYTES
    }

    fn chunks_end(&self) -> u64 {
        self.data.payload_at + (self.end_chunk * CHUNK_BYTES).min(self.data.record_length)
    }

    /// File range holding everything the item needs (the CRCs precede the payload).
    /// The error for chunk `chunk` (counted from `first_chunk`) failing its CRC: the part of
    /// the item it covers is lost.
    fn rotted(&self, item: &DrainItem, chunk: u64, path: &std::path::Path) -> OplogError {
        let chunk = self.first_chunk + chunk;
        let start = (self.data.record_offset + chunk * CHUNK_BYTES).max(item.offset);
        let end =
            (self.data.record_offset + (chunk + 1) * CHUNK_BYTES).min(item.offset + item.length);
        OplogError::ChecksumMismatch {
            offset: start,
            length: end - start,
            path: path.to_path_buf(),
            file_offset: self.data.payload_at + chunk * CHUNK_BYTES,
            reason: format!(
                "payload chunk {chunk} of record {} (vdisk offset {}) fails its CRC32C",
                item.target.seq, self.data.record_offset
            ),
        }
    }

    fn span(&self) -> (u64, u64) {
        debug_assert!(self.crcs_end() <= self.chunks_start());
        (self.crcs_start(), self.chunks_end())
    }
}

/// One read of a segment file covering several wants.
struct Read {
    segment: SegmentId,
    start: u64,
    end: u64,
    wants: Vec<Want>,
}

impl<F: Filesystem> Inner<F> {
    pub(super) async fn read_drain_data(
        &self,
        items: &[DrainItem],
        limits: DrainReadLimits,
    ) -> Result<Vec<DrainData>, OplogError> {
        assert!(
            limits.max_read_bytes > 0,
            "drain reads need a positive size"
        );
        let mut out: Vec<Option<DrainData>> = (0..items.len()).map(|_| None).collect();
        let mut wants: BTreeMap<SegmentId, Vec<(SegmentId, Want)>> = BTreeMap::new();
        for (index, item) in items.iter().enumerate() {
            match &item.target.kind {
                TargetKind::Data(data) if item.length > 0 => {
                    let segment = item.target.segment;
                    wants
                        .entry(segment)
                        .or_default()
                        .push((segment, Want::new(index, item.offset, item.length, *data)));
                }
                TargetKind::Data(_) => out[index] = Some(DrainData::Data(Bytes::new())),
                TargetKind::Zero => out[index] = Some(DrainData::Zero),
                TargetKind::Lost(lost) => {
                    let error =
                        self.lost_error(item.target.segment, lost, item.offset, item.length);
                    out[index] = Some(DrainData::Lost(error));
                }
            }
        }
        // A segment at a time, the thread's other tasks running in between: a batch of tens
        // of thousands of wants planned at once held up the reactor for milliseconds.
        let mut reads = Vec::new();
        for (_, segment_wants) in wants {
            reads.extend(plan_reads(segment_wants, limits));
            tokio::task::yield_now().await;
        }
        let results = join_all(reads.into_iter().map(|read| self.run_read(read, items))).await;
        for result in results {
            for (index, data) in result? {
                out[index] = Some(data);
            }
        }
        Ok(out
            .into_iter()
            .map(|data| data.expect("every drain item is answered"))
            .collect())
    }

    async fn run_read(
        &self,
        read: Read,
        items: &[DrainItem],
    ) -> Result<Vec<(usize, DrainData)>, OplogError> {
        let Some(handle) = self.state.borrow().handle(read.segment) else {
            let first = &items[read.wants[0].item];
            return Err(OplogError::Stale {
                offset: first.offset,
                length: first.length,
            });
        };
        // Held across the read: the file is not reused while it runs.
        let guard = ReadGuard::new(handle, self.wakers.clone());
        let (file, path) = (&guard.handle.file, &guard.handle.path);
        // Whole aligned blocks, so the kernel reads straight into a recycled buffer of the
        // node's (`read_new`). A fresh zeroed `Vec` per read, filled by a copy out of a bounce
        // buffer, had the kernel fault in and zero new pages for every drain read: 16 % of
        // the node's time under 4 KiB random writes at QD1.
        let (start, end) = aligned_span(read.start, read.end);
        let buf = file
            .read_new(start, (end - start) as usize)
            .await
            .map_err(|e| io_error(path, e))?
            .into_bytes();
        let at = |offset: u64| (offset - start) as usize;
        let mut out = Vec::with_capacity(read.wants.len());
        for want in read.wants {
            // Checking a read's chunks takes ~0.2 ms per MiB, and many reads can finish at
            // once: the task gives way when its scheduling budget is spent.
            tokio::task::consume_budget().await;
            let item = &items[want.item];
            let crcs = &buf[at(want.crcs_start())..at(want.crcs_end())];
            let chunks = &buf[at(want.chunks_start())..at(want.chunks_end())];
            let first = at(want.data.payload_at + item.offset - want.data.record_offset);
            let bytes = buf.slice(first..first + item.length as usize);
            let bad = bad_chunks(crcs, chunks);
            let data = if bad.is_empty() {
                DrainData::Data(bytes)
            } else {
                let lost = bad
                    .into_iter()
                    .map(|chunk| want.rotted(item, chunk, path))
                    .collect();
                DrainData::Rotted { bytes, lost }
            };
            out.push((want.item, data));
        }
        Ok(out)
    }
}

/// Groups wants into reads: per segment, in file order, neighbours merged while the gap
/// between them is at most `max_gap_bytes` and the read, widened to whole blocks, at most
/// `max_read_bytes` (a single want larger than that is read alone).
fn plan_reads(mut wants: Vec<(SegmentId, Want)>, limits: DrainReadLimits) -> Vec<Read> {
    wants.sort_by_key(|(segment, want)| (*segment, want.span().0));
    let mut reads: Vec<Read> = Vec::new();
    for (segment, want) in wants {
        let (start, end) = want.span();
        if let Some(read) = reads.last_mut() {
            let (aligned_start, aligned_end) = aligned_span(read.start, end.max(read.end));
            let joins = read.segment == segment
                && start <= read.end.saturating_add(limits.max_gap_bytes)
                && aligned_end - aligned_start <= limits.max_read_bytes;
            if joins {
                read.end = read.end.max(end);
                read.wants.push(want);
                continue;
            }
        }
        reads.push(Read {
            segment,
            start,
            end,
            wants: vec![want],
        });
    }
    reads
}

/// `[start, end)` widened to whole direct-I/O blocks: what a read of that range reads.
fn aligned_span(start: u64, end: u64) -> (u64, u64) {
    let align = DIRECT_IO_ALIGNMENT_BYTES;
    (start / align * align, end.div_ceil(align) * align)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn want(item: usize, crcs_at: u64, payload_at: u64, length: u64) -> Want {
        let data = DataLoc {
            crcs_at,
            payload_at,
            record_offset: 0,
            record_length: length,
        };
        Want::new(item, 0, length, data)
    }

    fn limits(max_read_bytes: u64, max_gap_bytes: u64) -> DrainReadLimits {
        DrainReadLimits {
            max_read_bytes,
            max_gap_bytes,
        }
    }

    fn wants_of_two(seg: SegmentId) -> Vec<(SegmentId, Want)> {
        vec![
            (seg, want(1, 8192 + 64, 8192 + 4096, 4096)),
            (seg, want(0, 64, 4096, 4096)),
        ]
    }

    #[test]
    fn neighbours_in_one_segment_share_a_read() {
        let seg = SegmentId(1);
        // The second record's header (64 bytes) lies between the two spans.
        assert_eq!(plan_reads(wants_of_two(seg), limits(1 << 20, 0)).len(), 2);
        let reads = plan_reads(wants_of_two(seg), limits(1 << 20, 64));
        assert_eq!(reads.len(), 1);
        assert_eq!((reads[0].start, reads[0].end), (64, 8192 + 8192));
        let order: Vec<usize> = reads[0].wants.iter().map(|w| w.item).collect();
        assert_eq!(order, vec![0, 1], "wants are kept in file order");
    }

    #[test]
    fn segments_gaps_and_size_split_reads() {
        let (a, b) = (SegmentId(1), SegmentId(2));
        let wants = vec![
            (a, want(0, 64, 4096, 4096)),
            (b, want(1, 64, 4096, 4096)),
            // 1 MiB past the first: more than the gap allowed.
            (a, want(2, (1 << 20) + 64, (1 << 20) + 4096, 4096)),
        ];
        let reads = plan_reads(wants, limits(1 << 30, 64 << 10));
        assert_eq!(reads.len(), 3);
        let wants = (0..4)
            .map(|i| {
                (
                    a,
                    want(i, i as u64 * 8192 + 64, i as u64 * 8192 + 4096, 4096),
                )
            })
            .collect();
        let reads = plan_reads(wants, limits(16384, 1 << 20));
        let sizes: Vec<usize> = reads.iter().map(|r| r.wants.len()).collect();
        assert_eq!(sizes, vec![2, 2], "a read stops at max_read_bytes");
        assert!(reads.iter().all(|r| {
            let (start, end) = aligned_span(r.start, r.end);
            end - start <= 16384
        }));
    }
}

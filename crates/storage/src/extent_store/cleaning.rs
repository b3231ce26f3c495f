//! Cleaning the block log (format 3, docs/extent-store-log-proposal.md, "Reclaiming log
//! space"): the blocks of the picked segments that a checksum table still names there are
//! written home through the two-slot protocol, durably, and only then are the segments
//! removed. A segment that nothing names any more costs only its summaries' reads.
//!
//! One pass cleans every picked segment of a disk together, egroup by egroup: each egroup's
//! tables are loaded once and its live blocks, from however many segments, are written home
//! with one two-slot write (two syncs). Cleaning several segments at once is what makes that
//! cheap: a segment of random writes names nearly every egroup of the vdisk, a few blocks
//! each, and the syncs per egroup, not the bytes, are the cost.
//!
//! Cleaning writes into egroups: nothing else may write the blocks it moves meanwhile (the
//! engine cleans inside a drain step, which runs alone among extent-store writers). Reads may
//! race it: a read that took a block's entry before the move and finds the segment gone reads
//! again (`requests::read_verified`).

use super::block_log::{list_segments, read_segment_summaries, remove_segment};
use super::block_log::{ChunkSummary, LogId, LogSlot, SegmentFile, SegmentSeq};
use super::format::{BLOCK, BLOCK_LEN, EGROUP_SPAN_BYTES};
use super::table::BlockState;
use super::{io_error, ExtentError, ExtentStore, WriteBatch};
use crate::fs::{DiskFile, Filesystem};
use crate::join::{try_run_windowed, AfterError};
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

/// Reads of live blocks one cleaning pass keeps in flight.
const CLEANING_READS_IN_FLIGHT: usize = 32;

/// What a cleaning pass did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CleanReport {
    pub segments_removed: usize,
    /// Blocks still named in a removed segment, written home.
    pub blocks_moved: usize,
    /// Blocks still named there whose data failed its CRC: recorded lost (they read as EIO,
    /// as they did).
    pub blocks_lost: usize,
    /// Segments picked but kept: the highest of its disk (segment numbers must never go
    /// back), or one holding a chunk whose summaries are both unreadable.
    pub segments_kept: usize,
}

/// A block a picked segment holds, as its summary names it.
#[derive(Clone, Copy)]
struct Candidate {
    block: u16,
    slot: LogSlot,
}

/// A live block to move: its vdisk offset, where it is, and its CRC.
struct Live {
    offset: u64,
    slot: LogSlot,
    crc: u32,
}

/// The picked segments of one disk, open for reading.
struct Picked<D> {
    files: HashMap<(LogId, SegmentSeq), (PathBuf, D)>,
}

impl<F: Filesystem> ExtentStore<F> {
    /// Cleans the segments `pick` chooses on every disk, in one pass per disk. The store must
    /// be the only writer of every egroup those segments name (see the module comment).
    ///
    /// Memory: the picked segments' summaries and their blocks grouped by egroup (about 30
    /// bytes a block in them) and, per window of `max_writing_egroups` egroups, their live
    /// blocks' data (at most 4 MiB an egroup).
    pub async fn clean_log(
        &self,
        pick: impl Fn(LogId, SegmentSeq) -> bool,
    ) -> Result<CleanReport, ExtentError> {
        self.ensure_durable_listing().await?;
        let mut report = CleanReport::default();
        for disk in &self.config.disks {
            let segments = list_segments(&self.fs, &disk.path, self.config.vdisk).await?;
            let Some(highest) = segments.iter().map(|s| s.seq).max() else {
                continue;
            };
            // Only the picked segments are read: other shards' logs change meanwhile (their
            // own cleaning removes segments), and are none of this store's business.
            let mut picked = Vec::new();
            for segment in segments.into_iter().filter(|s| pick(s.log, s.seq)) {
                let chunks = read_segment_summaries(&self.fs, self.config.vdisk, &segment).await?;
                if segment.seq == highest || chunks.iter().any(|c| c.entries.is_err()) {
                    report.segments_kept += 1;
                    continue;
                }
                picked.push((segment, chunks));
            }
            if picked.is_empty() {
                continue;
            }
            self.move_live_blocks(&picked, &mut report).await?;
            for (segment, _) in picked {
                remove_segment(
                    &self.fs,
                    &disk.path,
                    self.config.vdisk,
                    segment.log,
                    segment.seq,
                )
                .await?;
                report.segments_removed += 1;
            }
        }
        Ok(report)
    }

    /// Writes home, durably, every block of the picked segments whose entry still names its
    /// slot there, a window of egroups at a time.
    async fn move_live_blocks(
        &self,
        picked: &[(SegmentFile, Vec<ChunkSummary>)],
        report: &mut CleanReport,
    ) -> Result<(), ExtentError> {
        let by_egroup = candidates_by_egroup(picked);
        let mut files = Picked {
            files: HashMap::new(),
        };
        for (segment, _) in picked {
            let file = self
                .fs
                .open(&segment.path, false)
                .await
                .map_err(|e| io_error(&segment.path, None, e))?;
            files
                .files
                .insert((segment.log, segment.seq), (segment.path.clone(), file));
        }
        let egroups: Vec<(&u64, &Vec<Candidate>)> = by_egroup.iter().collect();
        for window in egroups.chunks(self.writing_width()) {
            let mut live = Vec::new();
            for &(&egroup, candidates) in window {
                self.live_blocks(egroup, candidates, &mut live).await?;
            }
            let (moved, lost) = read_live(&files, &mut live).await?;
            let mut batch = WriteBatch::new();
            for (offset, data) in &moved {
                batch.write(*offset, data);
            }
            for &offset in &lost {
                tracing::error!(vdisk = %self.config.vdisk, offset,
                    "a block in the block log failed its checksum while cleaning: recorded lost");
                batch.mark_lost(offset, BLOCK);
            }
            if !batch.is_empty() {
                self.apply(&batch).await?;
            }
            report.blocks_moved += moved.len();
            report.blocks_lost += lost.len();
        }
        Ok(())
    }

    /// Pushes the candidates of `egroup` that its tables still name in the log.
    async fn live_blocks(
        &self,
        egroup: u64,
        candidates: &[Candidate],
        live: &mut Vec<Live>,
    ) -> Result<(), ExtentError> {
        let pin = self.pin(egroup);
        if let Some(open) = self.load(&pin, egroup, false).await? {
            for candidate in candidates {
                let block = usize::from(candidate.block);
                let entry = open.entry(block);
                // Overwritten, zeroed or moved since: dead here.
                if entry.state == BlockState::InLog && entry.log == candidate.slot {
                    live.push(Live {
                        offset: egroup * EGROUP_SPAN_BYTES + block as u64 * BLOCK,
                        slot: candidate.slot,
                        crc: entry.crc[0],
                    });
                }
            }
        }
        drop(pin);
        self.trim();
        Ok(())
    }
}

/// Every block the picked segments name, by egroup.
fn candidates_by_egroup(
    picked: &[(SegmentFile, Vec<ChunkSummary>)],
) -> BTreeMap<u64, Vec<Candidate>> {
    let mut by_egroup: BTreeMap<u64, Vec<Candidate>> = BTreeMap::new();
    for chunk in picked.iter().flat_map(|(_, chunks)| chunks) {
        let Ok(entries) = &chunk.entries else {
            continue;
        };
        for (index, summary) in entries.iter().enumerate() {
            by_egroup
                .entry(summary.egroup)
                .or_default()
                .push(Candidate {
                    block: summary.block,
                    slot: chunk.slot(index),
                });
        }
    }
    by_egroup
}

/// Runs of live blocks in consecutive slots of one chunk (a sequential write drained into the
/// log is read back with one read a chunk), at most `DATA_BLOCKS_PER_CHUNK` each. Sorts
/// `live` by slot.
fn slot_runs(live: &mut [Live]) -> Vec<&[Live]> {
    live.sort_unstable_by_key(|block| (block.slot.log, block.slot.segment, block.slot.slot));
    let mut runs = Vec::new();
    let mut rest = &live[..];
    while !rest.is_empty() {
        let first = rest[0].slot;
        let length = rest
            .iter()
            .enumerate()
            .take_while(|(index, block)| {
                block.slot.log == first.log
                    && block.slot.segment == first.segment
                    && block.slot.chunk() == first.chunk()
                    && usize::from(block.slot.slot) == usize::from(first.slot) + index
            })
            .count();
        let (run, after) = rest.split_at(length);
        runs.push(run);
        rest = after;
    }
    runs
}

/// Reads the live blocks, a run of consecutive slots at a time: `(offset, data)` of those
/// whose data matches, and the offsets of those that do not.
async fn read_live<D: DiskFile>(
    picked: &Picked<D>,
    live: &mut [Live],
) -> Result<(Vec<(u64, Vec<u8>)>, Vec<u64>), ExtentError> {
    let moved = RefCell::new(Vec::with_capacity(live.len()));
    let lost = RefCell::new(Vec::new());
    let reads = slot_runs(live).into_iter().map(|run| {
        let (moved, lost) = (&moved, &lost);
        async move {
            let first = run[0].slot;
            let (path, file) = picked
                .files
                .get(&(first.log, first.segment))
                .expect("a live block names a picked segment");
            let mut data = vec![0u8; run.len() * BLOCK_LEN];
            let at = first.file_offset();
            file.read_at(&mut data, at)
                .await
                .map_err(|e| io_error(path, Some(at), e))?;
            for (block, bytes) in run.iter().zip(data.chunks(BLOCK_LEN)) {
                if crc32c::crc32c(bytes) == block.crc {
                    moved.borrow_mut().push((block.offset, bytes.to_vec()));
                } else {
                    lost.borrow_mut().push(block.offset);
                }
            }
            Ok::<(), ExtentError>(())
        }
    });
    try_run_windowed(reads, CLEANING_READS_IN_FLIGHT, AfterError::StopStarting).await?;
    Ok((moved.into_inner(), lost.into_inner()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn live(segment: u32, slot: u16) -> Live {
        Live {
            offset: u64::from(slot) * BLOCK,
            slot: LogSlot {
                log: LogId(1),
                segment: SegmentSeq(segment),
                slot,
            },
            crc: 0,
        }
    }

    #[test]
    fn consecutive_slots_of_one_chunk_are_read_as_one_run() {
        // Slots 1-3 of chunk 0, then 5 alone; 257-258 are chunk 1's first data slots; slot 6
        // of another segment is a run of its own.
        let mut blocks = vec![
            live(7, 3),
            live(7, 1),
            live(7, 2),
            live(7, 5),
            live(7, 258),
            live(7, 257),
            live(8, 6),
        ];
        let runs: Vec<Vec<u16>> = slot_runs(&mut blocks)
            .iter()
            .map(|run| run.iter().map(|b| b.slot.slot).collect())
            .collect();
        assert_eq!(runs, vec![vec![1, 2, 3], vec![5], vec![257, 258], vec![6]]);
    }
}

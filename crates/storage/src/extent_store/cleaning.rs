//! Cleaning the block log (format 3, docs/extent-store-log-proposal.md, "Reclaiming log
//! space"): the blocks of a segment that a checksum table still names there are written home
//! through the two-slot protocol, durably, and only then is the segment removed. A segment
//! that nothing names any more is removed at once.
//!
//! Cleaning writes into egroups: nothing else may write the blocks it moves meanwhile (the
//! engine cleans inside a drain step, which runs alone among extent-store writers). Reads may
//! race it: a read that took a block's entry before the move and finds the segment gone reads
//! again (`requests::read_verified`).

use super::block_log::{
    list_segments, log_dir, read_segment_summaries, read_slots, remove_segment,
};
use super::block_log::{ChunkSummary, LogId, SegmentSeq};
use super::format::{BLOCK, BLOCK_LEN, EGROUP_SPAN_BYTES};
use super::table::BlockState;
use super::{ExtentError, ExtentStore, WriteBatch};
use crate::fs::Filesystem;
use std::collections::BTreeMap;

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

impl<F: Filesystem> ExtentStore<F> {
    /// Cleans the segments `pick` chooses, oldest first, on every disk. The store must be the
    /// only writer of every egroup those segments name (see the module comment).
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
            let mut chunks: BTreeMap<(SegmentSeq, LogId), Vec<ChunkSummary>> = BTreeMap::new();
            for segment in segments.iter().filter(|s| pick(s.log, s.seq)) {
                let summaries =
                    read_segment_summaries(&self.fs, self.config.vdisk, segment).await?;
                chunks.insert((segment.seq, segment.log), summaries);
            }
            for ((seq, log), chunks) in chunks {
                if seq == highest || chunks.iter().any(|c| c.entries.is_err()) {
                    report.segments_kept += 1;
                    continue;
                }
                self.move_live_blocks(&disk.path, &chunks, &mut report)
                    .await?;
                remove_segment(&self.fs, &disk.path, self.config.vdisk, log, seq).await?;
                report.segments_removed += 1;
            }
        }
        Ok(report)
    }

    /// Writes home, durably, every block of `chunks` whose entry still names its slot there.
    async fn move_live_blocks(
        &self,
        disk: &std::path::Path,
        chunks: &[ChunkSummary],
        report: &mut CleanReport,
    ) -> Result<(), ExtentError> {
        let dir = log_dir(disk, self.config.vdisk);
        let mut moved: Vec<(u64, Vec<u8>)> = Vec::new();
        let mut lost: Vec<u64> = Vec::new();
        for chunk in chunks {
            let Ok(entries) = &chunk.entries else {
                continue;
            };
            for (index, summary) in entries.iter().enumerate() {
                let slot = chunk.slot(index);
                let block = usize::from(summary.block);
                let pin = self.pin(summary.egroup);
                let Some(open) = self.load(&pin, summary.egroup, false).await? else {
                    continue;
                };
                let entry = open.entry(block);
                if entry.state != BlockState::InLog || entry.log != slot {
                    continue; // overwritten, zeroed or moved since: dead here
                }
                let offset = summary.egroup * EGROUP_SPAN_BYTES + block as u64 * BLOCK;
                let mut data = vec![0u8; BLOCK_LEN];
                read_slots(&self.fs, &dir, slot, &mut data).await?;
                if crc32c::crc32c(&data) == entry.crc[0] {
                    moved.push((offset, data));
                } else {
                    tracing::error!(vdisk = %self.config.vdisk, offset, segment = slot.segment.0,
                        "a block in the block log failed its checksum while cleaning: recorded lost");
                    lost.push(offset);
                }
            }
            self.trim();
        }
        if moved.is_empty() && lost.is_empty() {
            return Ok(());
        }
        let mut batch = WriteBatch::new();
        for (offset, data) in &moved {
            batch.write(*offset, data);
        }
        for &offset in &lost {
            batch.mark_lost(offset, BLOCK);
        }
        self.apply(&batch).await?;
        report.blocks_moved += moved.len();
        report.blocks_lost += lost.len();
        Ok(())
    }
}

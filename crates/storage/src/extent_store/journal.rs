//! The journal of format 3 (docs/extent-store-log-proposal.md, "The journal"): a batch
//! applied with [`ExtentStore::apply_journaled`] puts its whole blocks in the block log of
//! their egroup's disk (one 1 MiB write per 254 blocks, one sync per segment written) and
//! records their slots in the overlay; everything else of the batch (zeroing, lost ranges,
//! merges of partial blocks) goes through the two-slot protocol. A checkpoint writes the
//! overlay into the checksum tables, one table write per extent and one sync per egroup.
//! Replay, before any store of the vdisk writes, reads the logs' summaries back into tables.

use super::batch::{plan, BlockOp, WriteBatch};
use super::block_log::{
    highest_segment, list_segments, BlockLog, LogId, Position, SegmentCounter, SegmentSeq,
    SummaryEntry, DATA_BLOCKS_PER_CHUNK,
};
use super::egroup::{is_zero, Egroup};
use super::extent_lock::EVERY_EXTENT;
use super::format::{BLOCK_LEN, EXTENTS};
use super::overlay::{Logged, Overlay};
use super::table::Entry;
use super::{ExtentError, ExtentStore};
use crate::disk::Disk;
use crate::fs::Filesystem;
use crate::join::{try_run_windowed, AfterError};
use ashlar_core::VdiskId;
use std::cell::RefCell;
use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

/// What a store needs to write a block log.
#[derive(Clone, Debug)]
pub struct JournalConfig {
    /// The store's log (its shard's index): one writer per log.
    pub log: LogId,
    /// Per disk of the store (same order), the allocator of segment numbers that every store
    /// of the vdisk on that disk shares ([`segment_counters`]).
    pub counters: Vec<Arc<SegmentCounter>>,
    /// Blocks the overlay may hold before a batch checkpoints: memory (~40 bytes a block),
    /// the log that replay reads after a crash, and how many steps a checkpoint's table
    /// writes and syncs are shared by.
    pub checkpoint_blocks: usize,
    /// Segments the store's log may have on a disk: past it, a batch cleans the oldest (their
    /// blocks still in use written home) before it returns.
    pub max_segments: usize,
    /// Chunks of 1 MiB per segment (1 to 64): smaller segments are cleaned sooner after their
    /// blocks die, at the cost of more files ([`DEFAULT_SEGMENT_CHUNKS`]).
    pub segment_chunks: u16,
}

/// Default of [`JournalConfig::segment_chunks`]: 64 MiB segments.
pub const DEFAULT_SEGMENT_CHUNKS: u16 = 64;

/// Default of [`JournalConfig::checkpoint_blocks`]: 256 MiB of log.
pub const DEFAULT_CHECKPOINT_BLOCKS: usize = 65_536;
/// Default of [`JournalConfig::max_segments`]: 2 GiB of log per store and disk.
pub const DEFAULT_MAX_SEGMENTS: usize = 32;

/// One segment counter per disk, above every segment of the vdisk on that disk: call once
/// per vdisk and process, before any store of the vdisk appends, and share the result.
pub async fn segment_counters<F: Filesystem>(
    fs: &F,
    disks: &[Disk],
    vdisk: VdiskId,
) -> Result<Vec<Arc<SegmentCounter>>, ExtentError> {
    let mut counters = Vec::with_capacity(disks.len());
    for disk in disks {
        let highest = highest_segment(fs, &disk.path, vdisk).await?;
        counters.push(Arc::new(SegmentCounter::after(highest)));
    }
    Ok(counters)
}

/// A store's journal state.
pub(super) struct Journal<F: Filesystem> {
    config: JournalConfig,
    /// Per disk, the writer, created at first use. Taken out while a batch appends (a batch
    /// journals alone); a batch dropped midway leaves `None`, and the next one starts a new
    /// writer, hence a new segment, as a failed step must.
    logs: RefCell<Vec<Option<BlockLog<F>>>>,
    pub(super) overlay: RefCell<Overlay>,
}

impl<F: Filesystem> Journal<F> {
    pub(super) fn new(config: JournalConfig, disks: usize) -> Self {
        assert_eq!(
            config.counters.len(),
            disks,
            "a journal needs one segment counter per disk"
        );
        Journal {
            config,
            logs: RefCell::new((0..disks).map(|_| None).collect()),
            overlay: RefCell::new(Overlay::default()),
        }
    }
}

/// A whole block of a batch bound for the log.
struct LogBlock {
    egroup: u64,
    block: usize,
    bytes: Box<[u8]>,
}

impl<F: Filesystem> ExtentStore<F> {
    /// Applies a batch as [`ExtentStore::apply`] does, durable when it returns `Ok`, with its
    /// whole non-zero blocks put in the block log instead of at home: the drain's batches.
    /// Without a journal configured it is `apply`.
    ///
    /// On error nothing of the batch may be acknowledged and the caller retries the whole
    /// batch (its blocks then go to new slots; the slots of the failed attempt are never
    /// referenced).
    pub async fn apply_journaled(&self, batch: &WriteBatch<'_>) -> Result<(), ExtentError> {
        let Some(journal) = &self.journal else {
            return self.apply(batch).await;
        };
        self.check_ranges(batch)?;
        self.ensure_durable_listing().await?;
        let groups = batch.by_egroup(|first, last| self.known_in(first, last));
        let mut to_log = Vec::new();
        for (&egroup, ops) in &groups {
            let blocks = plan(egroup, ops);
            let whole: Vec<(usize, &[u8])> = blocks
                .iter()
                .filter_map(|(&block, op)| whole_content(op).map(|bytes| (block, bytes)))
                .filter(|(_, bytes)| !is_zero(bytes))
                .collect();
            if whole.is_empty() || !self.prepare_for_log(egroup).await? {
                continue;
            }
            // `plan` borrows the batch's data or owns merged blocks: merged ones are copied
            // here, the batch's own are borrowed.
            for (block, bytes) in whole {
                to_log.push(LogBlock {
                    egroup,
                    block,
                    bytes: bytes.to_vec().into(),
                });
            }
        }
        self.append_and_record(journal, &to_log).await?;
        // The two-slot part: every block not in the log (including every block of an egroup
        // whose damage must be reset first, which that path does). One action per block.
        let in_log: HashSet<(u64, usize)> = to_log.iter().map(|b| (b.egroup, b.block)).collect();
        let width = self.writing_width();
        let in_log = &in_log;
        try_run_windowed(
            groups.into_iter().map(|(egroup, ops)| async move {
                let result = self
                    .apply_egroup_except(egroup, ops, |block| in_log.contains(&(egroup, block)))
                    .await;
                self.trim();
                result
            }),
            width,
            AfterError::StopStarting,
        )
        .await?;
        if journal.overlay.borrow().blocks() > journal.config.checkpoint_blocks {
            self.checkpoint().await?;
        }
        self.clean_over_capacity(journal).await
    }

    /// Cleans the oldest segments of the store's own log once it has more than
    /// `max_segments` on a disk, down to a quarter below it ([`segments_to_clean`]), never the
    /// newest (the log appends there).
    async fn clean_over_capacity(&self, journal: &Journal<F>) -> Result<(), ExtentError> {
        let own = journal.config.log;
        for disk in &self.config.disks {
            let mut own_segments: Vec<SegmentSeq> =
                list_segments(&self.fs, &disk.path, self.config.vdisk)
                    .await?
                    .into_iter()
                    .filter(|segment| segment.log == own)
                    .map(|segment| segment.seq)
                    .collect();
            let excess = segments_to_clean(own_segments.len(), journal.config.max_segments);
            if excess == 0 {
                continue;
            }
            own_segments.sort_unstable();
            let oldest: Vec<SegmentSeq> = own_segments[..excess].to_vec();
            let report = self
                .clean_log(|log, seq| log == own && oldest.contains(&seq))
                .await?;
            tracing::debug!(vdisk = %self.config.vdisk, ?report, "cleaned the block log");
        }
        Ok(())
    }

    /// Cleans every segment of the store's own log (a shard handing its ranges over: the next
    /// owner's log may have the same id and must not find blocks of other shards in it).
    pub async fn clean_own_log(&self) -> Result<(), ExtentError> {
        let Some(journal) = &self.journal else {
            return Ok(());
        };
        let own = journal.config.log;
        // The writer's segment goes too: the next append starts a new one.
        journal
            .logs
            .borrow_mut()
            .iter_mut()
            .for_each(|log| *log = None);
        self.clean_log(|log, _| log == own).await.map(|_| ())
    }

    /// Makes sure `egroup` exists (its tables are where a checkpoint writes its entries) and
    /// says whether its blocks may go to the log: not while its header or a table is damaged
    /// (the two-slot path resets the damage first).
    async fn prepare_for_log(&self, egroup: u64) -> Result<bool, ExtentError> {
        let slot = self.pin(egroup);
        let Some(open) = self.load(&slot, egroup, true).await? else {
            unreachable!("load with create returns the egroup");
        };
        let usable = !open.needs_every_extent(EVERY_EXTENT);
        drop(slot);
        self.trim();
        Ok(usable)
    }

    /// Appends `blocks` (sorted by egroup and block) to the logs of their disks, syncs them,
    /// and only then records the blocks' slots in the overlay and in the open egroups' tables.
    async fn append_and_record(
        &self,
        journal: &Journal<F>,
        blocks: &[LogBlock],
    ) -> Result<(), ExtentError> {
        if blocks.is_empty() {
            return Ok(());
        }
        let mut by_disk: BTreeMap<usize, Vec<&LogBlock>> = BTreeMap::new();
        for block in blocks {
            let disk = self
                .find(block.egroup)
                .expect("an egroup bound for the log was created first");
            by_disk.entry(disk).or_default().push(block);
        }
        let mut records = Vec::with_capacity(blocks.len());
        for (disk, blocks) in by_disk {
            let mut log = journal.logs.borrow_mut()[disk].take().unwrap_or_else(|| {
                BlockLog::new(
                    self.fs.clone(),
                    &self.config.disks[disk].path,
                    self.config.vdisk,
                    journal.config.log,
                    journal.config.counters[disk].clone(),
                )
                .with_chunks_per_segment(journal.config.segment_chunks)
            });
            let appended = append_all(&mut log, &blocks, &mut records).await;
            // A sync closes the step even when an append failed (it then fails too, and the
            // next batch's appends begin a new step).
            let synced = log.sync().await;
            let synced = appended.and(synced);
            journal.logs.borrow_mut()[disk] = Some(log);
            synced?;
        }
        // Durable: from here the slots may be referenced.
        let mut overlay = journal.overlay.borrow_mut();
        for (egroup, block, logged) in &records {
            overlay.insert(*egroup, *block as u16, *logged);
        }
        let touched: HashSet<u64> = records.iter().map(|(egroup, _, _)| *egroup).collect();
        self.for_each_open(&touched, |open| {
            overlay.apply_to(open);
        });
        Ok(())
    }

    /// Writes every overlay entry into its egroup's checksum tables, durably, then forgets
    /// them: one table write per extent with entries and one sync per egroup.
    pub async fn checkpoint(&self) -> Result<(), ExtentError> {
        let Some(journal) = &self.journal else {
            return Ok(());
        };
        let egroups = journal.overlay.borrow().egroups();
        let width = self.writing_width();
        try_run_windowed(
            egroups.into_iter().map(|egroup| async move {
                let result = self.checkpoint_egroup(journal, egroup).await;
                self.trim();
                result
            }),
            width,
            AfterError::StopStarting,
        )
        .await
    }

    async fn checkpoint_egroup(
        &self,
        journal: &Journal<F>,
        egroup: u64,
    ) -> Result<(), ExtentError> {
        let bits = journal.overlay.borrow().extents_of(egroup);
        if bits == 0 {
            return Ok(());
        }
        let slot = self.pin(egroup);
        let _guard = slot.lock.lock(EVERY_EXTENT).await;
        let Some(open) = self.load(&slot, egroup, false).await? else {
            return Err(ExtentError::Io {
                path: self.egroup_path(egroup),
                file_offset: None,
                source: std::io::Error::other(
                    "an extent group with blocks in the block log is missing",
                ),
            });
        };
        open.recover(&self.fs).await?;
        journal.overlay.borrow().apply_to(open);
        let failures = open.failures.get();
        for (first, bytes) in open.table_runs(bits) {
            if let Err(error) = open.write_table_run(first, &bytes).await {
                open.mark_failed();
                return Err(error);
            }
        }
        open.sync_checked(bits, failures).await?;
        let through = newest_position(open, bits);
        journal.overlay.borrow_mut().forget(egroup, through);
        Ok(())
    }
}

/// How many of its `count` segments a log over `max_segments` cleans: down to a quarter
/// below the limit, so that one pass cleans several segments together (each egroup they
/// name is then synced once for all of its blocks in them, see `cleaning.rs`), and none
/// while at or under the limit.
pub(crate) fn segments_to_clean(count: usize, max_segments: usize) -> usize {
    let max_segments = max_segments.max(1);
    if count <= max_segments {
        return 0;
    }
    count - (max_segments - max_segments / 4)
}

/// The newest position the tables of `bits` hold: every overlay entry of those extents is at
/// or below it once they are written.
fn newest_position<D>(open: &Egroup<D>, bits: u8) -> Position {
    let extents = open.extents.borrow();
    (0..EXTENTS)
        .filter(|e| bits & (1 << e) != 0)
        .map(|e| extents[e].position)
        .max()
        .unwrap_or(Position(0))
}

/// The block's bytes if the batch gives it whole content.
fn whole_content<'a>(op: &'a BlockOp<'_>) -> Option<&'a [u8]> {
    match op {
        BlockOp::Data { src, at, .. } => Some(&src[*at..*at + BLOCK_LEN]),
        BlockOp::Owned(buf) => Some(buf),
        _ => None,
    }
}

/// Appends `blocks` in chunks of up to 254; pushes each block's overlay record.
async fn append_all<F: Filesystem>(
    log: &mut BlockLog<F>,
    blocks: &[&LogBlock],
    records: &mut Vec<(u64, usize, Logged)>,
) -> Result<(), ExtentError> {
    for chunk in blocks.chunks(DATA_BLOCKS_PER_CHUNK) {
        let mut entries = Vec::with_capacity(chunk.len());
        let mut data = Vec::with_capacity(chunk.len() * BLOCK_LEN);
        for block in chunk {
            let crc = crc32c::crc32c(&block.bytes);
            entries.push(SummaryEntry {
                egroup: block.egroup,
                block: block.block as u16,
                crc,
            });
            data.extend_from_slice(&block.bytes);
        }
        let (position, slots) = log.append(&entries, &data).await?;
        for ((block, entry), slot) in chunk.iter().zip(&entries).zip(slots) {
            records.push((
                block.egroup,
                block.block,
                Logged {
                    entry: Entry::in_log(slot, entry.crc),
                    position,
                },
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::segments_to_clean;

    #[test]
    fn a_log_over_its_limit_cleans_down_to_a_quarter_below_it() {
        assert_eq!(segments_to_clean(32, 32), 0);
        assert_eq!(segments_to_clean(33, 32), 9);
        assert_eq!(segments_to_clean(3, 2), 1);
        assert_eq!(segments_to_clean(2, 0), 1);
        assert_eq!(segments_to_clean(5, 4), 2);
    }
}

//! Replay of the block logs after a crash (format 3, docs/extent-store-log-proposal.md,
//! "Replay"): the summaries of every chunk are read back into the egroups' checksum tables,
//! and every entry replay meets is settled there for good, so a later replay never decides
//! about it again.
//!
//! An entry of a chunk that no later summary of its log claims durable may lack its data (the
//! step writing it was cut short). If that entry is the newest of its block, the block keeps
//! the content it had before that step when an oplog will drain the step again (`covered`),
//! and is recorded lost otherwise: its previous content would be served as if it were
//! current. Either way the extent's table is stamped at the entry's position, durably, before
//! any oplog drains: a torn chunk that outlives this replay (a disk's highest segment is
//! never removed) is below the stamp at the next one and cannot undo a later write.

use super::block_log::{
    log_dir, read_slots, read_summaries, segment_path, ChunkSummary, LogId, Position, SummaryEntry,
    CHUNK_BYTES,
};
use super::format::{BLOCK, BLOCKS_PER_EXTENT, BLOCK_LEN, EGROUP_SPAN_BYTES};
use super::journal::{segment_counters, JournalConfig, DEFAULT_SEGMENT_CHUNKS};
use super::overlay::Logged;
use super::table::Entry;
use super::{ExtentError, ExtentStore};
use crate::disk::Disk;
use crate::fs::Filesystem;
use ashlar_core::VdiskId;
use std::collections::{BTreeMap, HashMap};

/// What replay found in a vdisk's block logs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReplayReport {
    /// Chunks read (every chunk of every segment that holds one).
    pub chunks: usize,
    /// Entries written into their egroup's table (those the table did not hold yet).
    pub entries: usize,
    /// Vdisk offsets of 4 KiB blocks whose newest entry lacks its data and that the caller's
    /// oplogs cover: each keeps its previous content until the oplog drains it again.
    pub left_out: Vec<u64>,
    /// Vdisk offsets of 4 KiB blocks whose newest entry lacks its data and that no oplog
    /// covers (the step completed and the block rotted since): recorded lost, they read as an
    /// error until rewritten.
    pub lost: Vec<u64>,
}

/// The entries replay met for one block, newer than nothing yet known about its table.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct BlockCandidates {
    /// The newest entry whose data is there (or whose step is known to have completed).
    pub complete: Option<Logged>,
    /// The newest position of an entry whose data is missing.
    pub incomplete: Option<Position>,
}

impl BlockCandidates {
    fn add_complete(&mut self, logged: Logged) {
        if self
            .complete
            .is_none_or(|old| old.position < logged.position)
        {
            self.complete = Some(logged);
        }
    }

    fn add_incomplete(&mut self, position: Position) {
        self.incomplete = Some(self.incomplete.map_or(position, |old| old.max(position)));
    }
}

/// What replay does with one block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Settle {
    /// The table already holds everything replay met for the block.
    Nothing,
    /// Write this entry, stamped at its position.
    Apply(Logged),
    /// The newest entry lacks its data and an oplog covers the block: keep `Logged.entry`
    /// (the block's state before that step), stamped at the missing entry's position.
    Keep(Logged),
    /// The newest entry lacks its data and nothing covers it: lost, stamped there.
    Lose(Position),
}

/// Decides one block: `stamp` is its extent table's position, `current` its table entry.
pub(crate) fn settle(
    candidates: BlockCandidates,
    stamp: Position,
    current: Entry,
    covered: bool,
) -> Settle {
    let complete = candidates.complete.filter(|c| c.position > stamp);
    let incomplete = candidates.incomplete.filter(|&p| p > stamp);
    match (complete, incomplete) {
        (None, None) => Settle::Nothing,
        (Some(complete), None) => Settle::Apply(complete),
        (Some(complete), Some(missing)) if complete.position > missing => Settle::Apply(complete),
        (before, Some(missing)) if covered => Settle::Keep(Logged {
            entry: before.map_or(current, |c| c.entry),
            position: missing,
        }),
        (_, Some(missing)) => Settle::Lose(missing),
    }
}

/// Per log, the newest position its summaries say was durable.
fn durable_through_per_log(chunks: &[ChunkSummary]) -> HashMap<LogId, Position> {
    let mut durable: HashMap<LogId, Position> = HashMap::new();
    for chunk in chunks.iter().filter(|chunk| chunk.entries.is_ok()) {
        let claim = durable.entry(chunk.log).or_insert(Position(0));
        *claim = (*claim).max(chunk.durable_through);
    }
    durable
}

/// Whether entry `index` of `chunk` has its data on disk (a chunk of the last step before a
/// crash may have its summary without all of its data).
async fn data_matches<F: Filesystem>(
    fs: &F,
    disk: &std::path::Path,
    vdisk: VdiskId,
    chunk: &ChunkSummary,
    index: usize,
    entry: &SummaryEntry,
) -> Result<bool, ExtentError> {
    let mut block = vec![0u8; BLOCK_LEN];
    read_slots(fs, &log_dir(disk, vdisk), chunk.slot(index), &mut block).await?;
    Ok(crc32c::crc32c(&block) == entry.crc)
}

/// egroup → block in the egroup → what replay met for it.
type Candidates = BTreeMap<u64, BTreeMap<u16, BlockCandidates>>;

/// Reads every block log summary of `vdisk` on `disks` back into the egroups' checksum tables,
/// durably, and settles every entry there (see the module doc). `covered(offset)` says
/// whether an oplog the caller will drain holds the 4 KiB block at vdisk `offset`. Run before
/// any store of the vdisk writes and before any oplog drains (at startup). A chunk whose two
/// summaries are both unreadable fails it with `BadLogChunk`: which blocks that chunk holds
/// is unknown, and serving the vdisk could return stale data for them.
pub async fn replay_block_logs<F: Filesystem>(
    fs: &F,
    disks: &[Disk],
    vdisk: VdiskId,
    covered: impl Fn(u64) -> bool,
) -> Result<ReplayReport, ExtentError> {
    let counters = segment_counters(fs, disks, vdisk).await?;
    let store = ExtentStore::new(
        fs.clone(),
        super::ExtentStoreConfig {
            vdisk,
            disks: disks.to_vec(),
            max_open_egroups: REPLAY_OPEN_EGROUPS,
            max_writing_egroups: super::DEFAULT_MAX_WRITING_EGROUPS,
            writes_in_flight_per_egroup: super::DEFAULT_WRITES_IN_FLIGHT_PER_EGROUP,
            journal: Some(JournalConfig {
                log: LogId(0),
                counters,
                checkpoint_blocks: usize::MAX,
                max_segments: usize::MAX,
                segment_chunks: DEFAULT_SEGMENT_CHUNKS,
            }),
        },
    );
    store.ensure_listing().await?;
    let mut report = ReplayReport::default();
    for (disk_index, disk) in disks.iter().enumerate() {
        let candidates = read_disk(fs, &store, disk_index, disk, vdisk, &mut report).await?;
        for (egroup, blocks) in candidates {
            store
                .settle_egroup(egroup, &blocks, &covered, &mut report)
                .await?;
        }
    }
    store.checkpoint().await?;
    Ok(report)
}

/// Reads one disk's summaries (and the data of entries whose step may be cut short).
async fn read_disk<F: Filesystem>(
    fs: &F,
    store: &ExtentStore<F>,
    disk_index: usize,
    disk: &Disk,
    vdisk: VdiskId,
    report: &mut ReplayReport,
) -> Result<Candidates, ExtentError> {
    let chunks = read_summaries(fs, &disk.path, vdisk).await?;
    let durable = durable_through_per_log(&chunks);
    let mut candidates = Candidates::new();
    for chunk in chunks {
        let bad_chunk = |reason: String| ExtentError::BadLogChunk {
            path: segment_path(&log_dir(&disk.path, vdisk), chunk.log, chunk.segment),
            file_offset: u64::from(chunk.chunk) * CHUNK_BYTES,
            reason,
        };
        let entries = chunk.entries.as_ref().map_err(|r| bad_chunk(r.clone()))?;
        report.chunks += 1;
        let unsure = chunk.position > durable.get(&chunk.log).copied().unwrap_or(Position(0));
        for (index, entry) in entries.iter().enumerate() {
            if store.find(entry.egroup) != Some(disk_index) {
                return Err(bad_chunk(format!(
                    "names extent group {} that is not on this disk",
                    entry.egroup
                )));
            }
            let block = candidates
                .entry(entry.egroup)
                .or_default()
                .entry(entry.block)
                .or_default();
            if unsure && !data_matches(fs, &disk.path, vdisk, &chunk, index, entry).await? {
                block.add_incomplete(chunk.position);
            } else {
                block.add_complete(Logged {
                    entry: Entry::in_log(chunk.slot(index), entry.crc),
                    position: chunk.position,
                });
            }
        }
    }
    Ok(candidates)
}

impl<F: Filesystem> ExtentStore<F> {
    /// Decides every block of `egroup` replay met against its tables as they are on disk, and
    /// puts the outcome in the overlay (the checkpoint that ends replay writes it).
    async fn settle_egroup(
        &self,
        egroup: u64,
        blocks: &BTreeMap<u16, BlockCandidates>,
        covered: &impl Fn(u64) -> bool,
        report: &mut ReplayReport,
    ) -> Result<(), ExtentError> {
        let journal = self.journal.as_ref().expect("replay's store has a journal");
        let slot = self.pin(egroup);
        let open = self
            .load(&slot, egroup, false)
            .await?
            .expect("replay checked the egroup is listed on its disk");
        let decisions: Vec<(u16, Settle)> = {
            let extents = open.extents.borrow();
            blocks
                .iter()
                .map(|(&block, &candidates)| {
                    let state = &extents[usize::from(block) / BLOCKS_PER_EXTENT];
                    let offset = egroup * EGROUP_SPAN_BYTES + u64::from(block) * BLOCK;
                    let decision = match &state.table {
                        // A damaged table reads as an error until rewritten, log or not.
                        Err(_) => Settle::Nothing,
                        Ok(table) => settle(
                            candidates,
                            state.position,
                            table[usize::from(block) % BLOCKS_PER_EXTENT],
                            candidates.incomplete.is_some() && covered(offset),
                        ),
                    };
                    (block, decision)
                })
                .collect()
        };
        drop(slot);
        self.trim();
        let mut overlay = journal.overlay.borrow_mut();
        for (block, decision) in decisions {
            let offset = egroup * EGROUP_SPAN_BYTES + u64::from(block) * BLOCK;
            let logged = match decision {
                Settle::Nothing => continue,
                Settle::Apply(logged) => {
                    report.entries += 1;
                    logged
                }
                Settle::Keep(logged) => {
                    report.left_out.push(offset);
                    logged
                }
                Settle::Lose(position) => {
                    report.lost.push(offset);
                    Logged {
                        entry: Entry::LOST,
                        position,
                    }
                }
            };
            overlay.insert(egroup, block, logged);
        }
        Ok(())
    }
}

/// Egroups replay keeps open: it writes each once.
const REPLAY_OPEN_EGROUPS: usize = 64;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::extent_store::block_log::LogSlot;

    fn logged(position: u64, crc: u32) -> Logged {
        Logged {
            entry: Entry::in_log(LogSlot::NONE, crc),
            position: Position(position),
        }
    }

    fn candidates(complete: Option<Logged>, incomplete: Option<u64>) -> BlockCandidates {
        BlockCandidates {
            complete,
            incomplete: incomplete.map(Position),
        }
    }

    #[test]
    fn entries_at_or_below_the_stamp_are_settled_already() {
        let both = candidates(Some(logged(5, 1)), Some(7));
        assert_eq!(
            settle(both, Position(7), Entry::HOLE, false),
            Settle::Nothing
        );
        let complete = candidates(Some(logged(5, 1)), None);
        assert_eq!(
            settle(complete, Position(5), Entry::HOLE, true),
            Settle::Nothing
        );
    }

    #[test]
    fn a_newer_complete_entry_wins_over_a_missing_one() {
        let c = candidates(Some(logged(9, 1)), Some(7));
        assert_eq!(
            settle(c, Position(0), Entry::HOLE, false),
            Settle::Apply(logged(9, 1))
        );
    }

    #[test]
    fn a_missing_newest_entry_keeps_the_state_before_it_when_covered() {
        let with_older = candidates(Some(logged(3, 1)), Some(7));
        assert_eq!(
            settle(with_older, Position(0), Entry::HOLE, true),
            Settle::Keep(Logged {
                entry: logged(3, 1).entry,
                position: Position(7)
            })
        );
        // The older log entry is below the stamp: the table's entry is the state before.
        let table_entry = Entry::in_log(LogSlot::NONE, 42);
        assert_eq!(
            settle(with_older, Position(4), table_entry, true),
            Settle::Keep(Logged {
                entry: table_entry,
                position: Position(7)
            })
        );
    }

    #[test]
    fn a_missing_newest_entry_nothing_covers_is_lost() {
        let c = candidates(Some(logged(3, 1)), Some(7));
        assert_eq!(
            settle(c, Position(0), Entry::HOLE, false),
            Settle::Lose(Position(7))
        );
    }
}

//! The overlay: block log entries not yet written into any checksum table (format 3,
//! docs/extent-store-log-proposal.md, "The journal"). A drain step that put blocks in the log
//! records their slots here once the log is durable; an egroup opened later gets them applied
//! to the tables it read; a checkpoint writes them into the tables and drops them.
//!
//! Memory: one map entry per block (its slot, CRC and position, ~40 bytes with the maps'
//! overhead), bounded by the caller's checkpoint limit.

use super::block_log::Position;
use super::egroup::Egroup;
use super::format::{BLOCKS_PER_EXTENT, EXTENTS};
use super::table::Entry;
use std::collections::{BTreeMap, HashMap};

/// A block's entry in the log and the log position of the chunk that holds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Logged {
    pub entry: Entry,
    pub position: Position,
}

#[derive(Default)]
pub(crate) struct Overlay {
    /// egroup → block in the egroup → its newest entry in the log.
    by_egroup: HashMap<u64, BTreeMap<u16, Logged>>,
    blocks: usize,
}

impl Overlay {
    /// Records that block `block` of `egroup` lives at `logged`, unless a newer entry is
    /// recorded for it already (a drain step's entries are always the newest; replay may meet
    /// them in any order).
    pub(crate) fn insert(&mut self, egroup: u64, block: u16, logged: Logged) {
        let blocks = self.by_egroup.entry(egroup).or_default();
        match blocks.get_mut(&block) {
            Some(old) if old.position >= logged.position => {}
            Some(old) => *old = logged,
            None => {
                blocks.insert(block, logged);
                self.blocks += 1;
            }
        }
    }

    /// Blocks recorded.
    pub(crate) fn blocks(&self) -> usize {
        self.blocks
    }

    /// The egroups with entries, sorted.
    pub(crate) fn egroups(&self) -> Vec<u64> {
        let mut egroups: Vec<u64> = self.by_egroup.keys().copied().collect();
        egroups.sort_unstable();
        egroups
    }

    /// Extent bits of `egroup` with entries.
    pub(crate) fn extents_of(&self, egroup: u64) -> u8 {
        self.by_egroup.get(&egroup).map_or(0, |blocks| {
            blocks.keys().fold(0, |bits, &block| {
                bits | 1 << (usize::from(block) / BLOCKS_PER_EXTENT)
            })
        })
    }

    /// Applies `egroup`'s entries to its tables in memory (see [`apply_entries`]); returns the
    /// extent bits it changed.
    pub(crate) fn apply_to<D>(&self, egroup: &Egroup<D>) -> u8 {
        match self.by_egroup.get(&egroup.index) {
            Some(blocks) => apply_entries(
                egroup,
                blocks
                    .iter()
                    .map(|(&block, &logged)| (usize::from(block), logged)),
            ),
            None => 0,
        }
    }

    /// Drops `egroup`'s entries at or below `through`: its tables holding them are durable.
    pub(crate) fn forget(&mut self, egroup: u64, through: Position) {
        let Some(blocks) = self.by_egroup.get_mut(&egroup) else {
            return;
        };
        let before = blocks.len();
        blocks.retain(|_, logged| logged.position > through);
        self.blocks -= before - blocks.len();
        if blocks.is_empty() {
            self.by_egroup.remove(&egroup);
        }
    }
}

/// Sets the entries of `egroup`'s blocks (0..1024) that are newer than what their table holds:
/// a table holds every entry at or below its position (it was written, or replayed, with
/// them), so only newer ones apply, whatever order they come in. Returns the extent bits
/// changed. An extent whose table is damaged is left alone: it reads as `BadChecksumBlock`
/// until rewritten, as without the log.
pub(crate) fn apply_entries<D>(
    egroup: &Egroup<D>,
    entries: impl IntoIterator<Item = (usize, Logged)>,
) -> u8 {
    let mut extents = egroup.extents.borrow_mut();
    let stamps: [Position; EXTENTS] = std::array::from_fn(|e| extents[e].position);
    let mut changed = 0u8;
    for (block, logged) in entries {
        let extent = block / BLOCKS_PER_EXTENT;
        if logged.position <= stamps[extent] {
            continue;
        }
        let state = &mut extents[extent];
        let Ok(table) = &mut state.table else {
            continue;
        };
        table[block % BLOCKS_PER_EXTENT] = logged.entry;
        state.position = state.position.max(logged.position);
        changed |= 1 << extent;
    }
    changed
}

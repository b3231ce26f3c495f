//! File contents as the simulated disk keeps them: a size and sparse 4 KiB blocks, plus the
//! changes that move one copy (durable) towards another (live).

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

/// Allocation unit: space is counted and holes are punched in whole blocks of this size.
pub(crate) const BLOCK_BYTES: u64 = 4096;

/// One allocated block. `Zero` is allocated but never written (fallocate).
#[derive(Clone, Debug)]
enum Block {
    Zero,
    Data(Box<[u8]>),
}

/// One copy of a file: its size and its allocated blocks. Nothing is stored past `len`.
#[derive(Clone, Debug, Default)]
pub(crate) struct Contents {
    len: u64,
    blocks: BTreeMap<u64, Block>,
}

fn block_range(range: &Range<u64>) -> Range<u64> {
    range.start / BLOCK_BYTES..range.end.div_ceil(BLOCK_BYTES)
}

impl Contents {
    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// Bytes allocated (whole blocks).
    pub(crate) fn allocated_bytes(&self) -> u64 {
        self.blocks.len() as u64 * BLOCK_BYTES
    }

    /// Indexes of the allocated blocks meeting `range`.
    pub(crate) fn allocated_in(&self, range: &Range<u64>) -> Vec<u64> {
        if range.start >= range.end {
            return Vec::new();
        }
        self.blocks
            .range(block_range(range))
            .map(|(&index, _)| index)
            .collect()
    }

    /// Blocks of `range` that are not allocated yet.
    pub(crate) fn missing_blocks(&self, range: &Range<u64>) -> u64 {
        let blocks = block_range(range);
        let present = self.blocks.range(blocks.clone()).count() as u64;
        (blocks.end - blocks.start) - present
    }

    /// Fills `buf` from `offset`; holes and bytes past the end read as zeros.
    pub(crate) fn read(&self, buf: &mut [u8], offset: u64) {
        buf.fill(0);
        let end = (offset + buf.len() as u64).min(self.len);
        if offset >= end {
            return;
        }
        for (&index, block) in self.blocks.range(block_range(&(offset..end))) {
            let Block::Data(data) = block else { continue };
            let start = (index * BLOCK_BYTES).max(offset);
            let stop = ((index + 1) * BLOCK_BYTES).min(end);
            let from = (start - index * BLOCK_BYTES) as usize;
            let to = (start - offset) as usize;
            let n = (stop - start) as usize;
            buf[to..to + n].copy_from_slice(&data[from..from + n]);
        }
    }

    /// Copy of `range` (which may extend past the end: zeros there).
    pub(crate) fn snapshot(&self, range: Range<u64>) -> Arc<[u8]> {
        let mut buf = vec![0u8; (range.end - range.start) as usize];
        self.read(&mut buf, range.start);
        buf.into()
    }

    /// Stores `data` at `offset`, allocating blocks, without changing the size.
    fn store(&mut self, data: &[u8], offset: u64) {
        let mut done = 0usize;
        while done < data.len() {
            let at = offset + done as u64;
            let index = at / BLOCK_BYTES;
            let within = (at % BLOCK_BYTES) as usize;
            let n = (BLOCK_BYTES as usize - within).min(data.len() - done);
            let block = self.blocks.entry(index).or_insert(Block::Zero);
            if let Block::Zero = block {
                *block = Block::Data(vec![0u8; BLOCK_BYTES as usize].into_boxed_slice());
            }
            if let Block::Data(bytes) = block {
                bytes[within..within + n].copy_from_slice(&data[done..done + n]);
            }
            done += n;
        }
    }

    /// Writes `data` at `offset`, extending the size if needed.
    pub(crate) fn write(&mut self, data: &[u8], offset: u64) {
        if data.is_empty() {
            return;
        }
        self.store(data, offset);
        self.len = self.len.max(offset + data.len() as u64);
    }

    /// Overwrites the stored bytes of `range` that lie in allocated blocks below the size with
    /// `f(offset, byte)`: bit rot. Holes have no sectors to rot. Returns how many bytes changed.
    pub(crate) fn rot(&mut self, range: Range<u64>, f: impl Fn(u64, u8) -> u8) -> u64 {
        let end = range.end.min(self.len);
        let mut touched = 0;
        for offset in range.start..end {
            let index = offset / BLOCK_BYTES;
            let Some(block) = self.blocks.get_mut(&index) else {
                continue;
            };
            if let Block::Zero = block {
                *block = Block::Data(vec![0u8; BLOCK_BYTES as usize].into_boxed_slice());
            }
            if let Block::Data(bytes) = block {
                let byte = &mut bytes[(offset % BLOCK_BYTES) as usize];
                *byte = f(offset, *byte);
                touched += 1;
            }
        }
        touched
    }

    /// Zeros `range` inside one block (if allocated); the block stays allocated.
    fn zero_within(&mut self, range: Range<u64>) {
        let index = range.start / BLOCK_BYTES;
        if let Some(Block::Data(bytes)) = self.blocks.get_mut(&index) {
            let from = (range.start - index * BLOCK_BYTES) as usize;
            let to = (range.end - index * BLOCK_BYTES) as usize;
            bytes[from..to].fill(0);
        }
    }

    /// Frees the whole blocks of `range` and zeros the partial ones. The size is unchanged.
    pub(crate) fn punch(&mut self, range: Range<u64>) {
        let range = range.start..range.end.min(self.len);
        if range.start >= range.end {
            return;
        }
        let first_full = range.start.div_ceil(BLOCK_BYTES);
        let end_full = range.end / BLOCK_BYTES;
        if first_full < end_full {
            self.dealloc_blocks(first_full..end_full);
            self.zero_within(range.start..first_full * BLOCK_BYTES);
            self.zero_within(end_full * BLOCK_BYTES..range.end);
        } else if range.start / BLOCK_BYTES == (range.end - 1) / BLOCK_BYTES {
            self.zero_within(range);
        } else {
            // Spans a block boundary without covering a whole block.
            let split = range.end / BLOCK_BYTES * BLOCK_BYTES;
            self.zero_within(range.start..split);
            self.zero_within(split..range.end);
        }
    }

    fn dealloc_blocks(&mut self, blocks: Range<u64>) {
        let doomed: Vec<u64> = self.blocks.range(blocks).map(|(&i, _)| i).collect();
        for index in doomed {
            self.blocks.remove(&index);
        }
    }

    /// Allocates the blocks of `range` (fallocate mode 0), extending the size if needed.
    pub(crate) fn allocate(&mut self, range: Range<u64>) {
        for index in block_range(&range) {
            self.blocks.entry(index).or_insert(Block::Zero);
        }
        self.len = self.len.max(range.end);
    }

    /// Allocated block indexes within `range` that are missing: what `allocate` would add.
    pub(crate) fn missing_block_indexes(&self, range: &Range<u64>) -> Vec<u64> {
        block_range(range)
            .filter(|index| !self.blocks.contains_key(index))
            .collect()
    }

    /// Truncates or extends to `len`. Truncation drops the bytes past the new size; extension
    /// keeps whatever is stored past the old size (nothing, except while a power cut applies
    /// changes out of order: then it is data the disk really holds there).
    pub(crate) fn set_len(&mut self, len: u64) {
        if len < self.len {
            self.clear_past(len);
        }
        self.len = len;
    }

    fn clear_past(&mut self, len: u64) {
        let first_gone = len.div_ceil(BLOCK_BYTES);
        let doomed: Vec<u64> = self.blocks.range(first_gone..).map(|(&i, _)| i).collect();
        for index in doomed {
            self.blocks.remove(&index);
        }
        if !len.is_multiple_of(BLOCK_BYTES) {
            self.zero_within(len..first_gone * BLOCK_BYTES);
        }
    }

    /// A size change as the disk sees it: growing just sets the size (exposing whatever the
    /// disk holds there); shrinking frees the blocks wholly past the new size, but the block
    /// it falls in keeps its bytes: the kernel zeros that tail in the page cache, and the
    /// zeros reach the disk as sector writes of their own.
    pub(crate) fn resize_on_disk(&mut self, len: u64) {
        if len < self.len {
            let first_gone = len.div_ceil(BLOCK_BYTES);
            self.dealloc_blocks(first_gone..u64::MAX);
        }
        self.len = len;
    }

    /// Drops anything stored past the size (after changes were applied out of order).
    pub(crate) fn normalize(&mut self) {
        self.clear_past(self.len);
    }

    /// Every byte up to the size.
    pub(crate) fn to_vec(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.len as usize];
        self.read(&mut out, 0);
        out
    }

    /// Marks block `index` allocated (no data change).
    fn alloc_block(&mut self, index: u64) {
        self.blocks.entry(index).or_insert(Block::Zero);
    }
}

/// One step from a file's durable copy towards its live copy. A write is recorded as the
/// whole contents of each sector it touched, as they were just after the write, so keeping
/// any subset of changes in any order leaves every sector at one value it really had.
#[derive(Clone, Debug)]
pub(crate) enum Change {
    /// A sector's contents (`bytes.len()` is the sector size).
    Sector { offset: u64, bytes: Arc<[u8]> },
    /// A block allocated without data (fallocate).
    Alloc { block: u64 },
    /// A whole block punched out: it reads as zeros and is free.
    Dealloc { block: u64 },
    /// The file size grown (by a write, fallocate or set_len). Size changes are journaled
    /// metadata: they reach the disk in order.
    Len(u64),
    /// The file size cut (set_len): blocks wholly past it are freed. The zeros the kernel
    /// puts in the rest of the last block are `Sector` changes recorded after it.
    Truncate(u64),
}

impl Change {
    pub(crate) fn is_size(&self) -> bool {
        matches!(self, Change::Len(_) | Change::Truncate(_))
    }

    pub(crate) fn apply(&self, contents: &mut Contents) {
        match self {
            Change::Sector { offset, bytes } => contents.store(bytes, *offset),
            Change::Alloc { block } => contents.alloc_block(*block),
            Change::Dealloc { block } => contents.dealloc_blocks(*block..*block + 1),
            Change::Len(len) | Change::Truncate(len) => contents.resize_on_disk(*len),
        }
    }

    /// What becomes of `self`, an older pending change, once the `newer` change is durable.
    /// The disk cannot apply an older change over a newer one any more (it never writes an old
    /// version of a sector over a newer one it holds, and the journal never replays an older
    /// size), so what of `self` could undo `newer` goes; the rest stays pending.
    pub(crate) fn fate_after(&self, newer: &Change) -> Fate {
        match newer {
            Change::Len(_) | Change::Truncate(_) if self.is_size() => Fate::Drop,
            Change::Truncate(len) => self.truncated(*len),
            Change::Sector { offset, bytes } => {
                let end = offset + bytes.len() as u64;
                self.overwritten(*offset..end, Some(bytes.len() as u64))
            }
            Change::Dealloc { block } => {
                self.overwritten(block * BLOCK_BYTES..(block + 1) * BLOCK_BYTES, None)
            }
            Change::Alloc { .. } | Change::Len(_) => Fate::Keep,
        }
    }

    /// Fate of `self` after a newer write of `range` (sectors of `sector` bytes, or a freed
    /// block when `None`).
    fn overwritten(&self, range: Range<u64>, sector: Option<u64>) -> Fate {
        match self {
            Change::Sector { offset, bytes } => {
                match *offset < range.end && range.start < offset + bytes.len() as u64 {
                    true => Fate::Drop,
                    false => Fate::Keep,
                }
            }
            Change::Dealloc { block } => {
                let whole = block * BLOCK_BYTES..(block + 1) * BLOCK_BYTES;
                match (whole.start < range.end && range.start < whole.end, sector) {
                    (false, _) => Fate::Keep,
                    (true, None) => Fate::Drop,
                    // The rest of the block was still punched: zeros, sector by sector.
                    (true, Some(sector)) => Fate::Replace(
                        whole
                            .step_by(sector as usize)
                            .filter(|at| !(range.start < at + sector && *at < range.end))
                            .map(|at| Change::Sector {
                                offset: at,
                                bytes: vec![0u8; sector as usize].into(),
                            })
                            .collect(),
                    ),
                }
            }
            Change::Alloc { .. } | Change::Len(_) | Change::Truncate(_) => Fate::Keep,
        }
    }

    /// Fate of `self` after a newer truncation to `len`: the kernel drops the pages wholly
    /// past it instead of writing them. (The sector the new end falls in may still reach the
    /// disk with its old tail; the truncation's own zeroing of that tail is a newer change.)
    fn truncated(&self, len: u64) -> Fate {
        match self {
            Change::Sector { offset, .. } if *offset >= len => Fate::Drop,
            Change::Alloc { block } if block * BLOCK_BYTES >= len => Fate::Drop,
            _ => Fate::Keep,
        }
    }
}

/// What becomes of an older pending change once a newer one is durable.
#[derive(Debug)]
pub(crate) enum Fate {
    Keep,
    Drop,
    /// Only part of it can still reach the disk: these changes.
    Replace(Vec<Change>),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_read_punch_truncate() {
        let mut c = Contents::default();
        c.write(&[7u8; 10_000], 100);
        assert_eq!(c.len(), 10_100);
        assert_eq!(c.allocated_bytes(), 3 * BLOCK_BYTES);
        c.punch(50..9000);
        let all = c.to_vec();
        assert!(all[..9000].iter().all(|&b| b == 0));
        assert!(all[9000..].iter().all(|&b| b == 7));
        assert_eq!(c.allocated_bytes(), 2 * BLOCK_BYTES);
        c.set_len(9001);
        c.set_len(20_000);
        let all = c.to_vec();
        assert_eq!(all[9000], 7);
        assert!(all[9001..].iter().all(|&b| b == 0));
        assert_eq!(c.allocated_bytes(), 2 * BLOCK_BYTES);
    }

    #[test]
    fn punch_across_a_boundary_within_two_blocks() {
        let mut c = Contents::default();
        c.write(&[1u8; 8192], 0);
        c.punch(4000..4200);
        let all = c.to_vec();
        assert!(all[4000..4200].iter().all(|&b| b == 0));
        assert_eq!(all[3999], 1);
        assert_eq!(all[4200], 1);
        assert_eq!(c.allocated_bytes(), 2 * BLOCK_BYTES);
    }
}

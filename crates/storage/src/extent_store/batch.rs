//! A write batch and its per-egroup plan: the batch's operations folded, in order, into at
//! most one action per 4 KiB block, so each block is overwritten at most once per batch (the
//! two-slot protocol allows one unsynced overwrite per block, not two).

use super::format::{BLOCK, BLOCKS_PER_EGROUP, BLOCK_LEN, EGROUP_SPAN_BYTES};
use bytes::Bytes;
use std::collections::BTreeMap;

/// Writes, zeroings and lost ranges applied together by [`super::ExtentStore::apply`], which
/// returns once all of them are durable. Borrows the written data: nothing is copied until a
/// block needs merging.
#[derive(Clone, Debug, Default)]
pub struct WriteBatch<'a> {
    ops: Vec<Op<'a>>,
}

#[derive(Clone, Copy, Debug)]
pub(crate) enum Op<'a> {
    /// `shared`: the `Bytes` that `data` is a slice of, when the caller has one: whole
    /// blocks are then written from it without a copy (`DiskFile::write_from`).
    Write {
        offset: u64,
        data: &'a [u8],
        shared: Option<&'a Bytes>,
    },
    Zero {
        offset: u64,
        length: u64,
    },
    Lost {
        offset: u64,
        length: u64,
    },
}

impl<'a> WriteBatch<'a> {
    pub fn new() -> Self {
        WriteBatch::default()
    }

    /// Writes `data` at vdisk `offset` (any alignment).
    pub fn write(&mut self, offset: u64, data: &'a [u8]) -> &mut Self {
        self.push_write(offset, data, None)
    }

    /// Writes `data` at vdisk `offset` like [`WriteBatch::write`]; runs of whole blocks go to
    /// the disk from `data` itself where the disk can take it (a 4 KiB-aligned buffer, such as
    /// a front-end's `DiskBuf` payload, and O_DIRECT), not from a copy.
    pub fn write_shared(&mut self, offset: u64, data: &'a Bytes) -> &mut Self {
        self.push_write(offset, data, Some(data))
    }

    fn push_write(&mut self, offset: u64, data: &'a [u8], shared: Option<&'a Bytes>) -> &mut Self {
        if !data.is_empty() {
            self.ops.push(Op::Write {
                offset,
                data,
                shared,
            });
        }
        self
    }

    /// Makes `[offset, offset + length)` read as zeros; whole blocks become holes.
    pub fn write_zeroes(&mut self, offset: u64, length: u64) -> &mut Self {
        if length > 0 {
            self.ops.push(Op::Zero { offset, length });
        }
        self
    }

    /// Makes every block overlapping `[offset, offset + length)` read as
    /// [`super::ExtentError::Lost`] until it is fully overwritten or zeroed.
    pub fn mark_lost(&mut self, offset: u64, length: u64) -> &mut Self {
        if length > 0 {
            self.ops.push(Op::Lost { offset, length });
        }
        self
    }

    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// Number of operations.
    pub fn len(&self) -> usize {
        self.ops.len()
    }

    /// `(offset, length)` of every operation.
    pub(crate) fn ranges(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.ops.iter().map(Op::range)
    }

    /// The operations clipped to each egroup they touch, in batch order. Zeroing only visits
    /// egroups that exist (`known_in` lists those in an egroup range) or that an earlier
    /// operation of the batch touches: a hole needs no zeroing.
    pub(crate) fn by_egroup(
        &self,
        known_in: impl Fn(u64, u64) -> Vec<u64>,
    ) -> BTreeMap<u64, Vec<Op<'a>>> {
        let mut groups: BTreeMap<u64, Vec<Op<'a>>> = BTreeMap::new();
        for op in &self.ops {
            let (offset, length) = op.range();
            let Some(end) = offset.checked_add(length) else {
                continue;
            };
            let (first, last) = (offset / EGROUP_SPAN_BYTES, (end - 1) / EGROUP_SPAN_BYTES);
            let targets: Vec<u64> = match op {
                Op::Zero { .. } => {
                    let mut targets = known_in(first, last);
                    targets.extend(groups.range(first..=last).map(|(&g, _)| g));
                    targets.sort_unstable();
                    targets.dedup();
                    targets
                }
                _ => (first..=last).collect(),
            };
            for egroup in targets {
                let start = offset.max(egroup * EGROUP_SPAN_BYTES);
                let stop = end.min((egroup + 1) * EGROUP_SPAN_BYTES);
                groups
                    .entry(egroup)
                    .or_default()
                    .push(op.clip(start, stop - start));
            }
        }
        groups
    }
}

impl<'a> Op<'a> {
    fn range(&self) -> (u64, u64) {
        match *self {
            Op::Write { offset, data, .. } => (offset, data.len() as u64),
            Op::Zero { offset, length } | Op::Lost { offset, length } => (offset, length),
        }
    }

    fn clip(&self, offset: u64, length: u64) -> Op<'a> {
        match *self {
            Op::Write {
                offset: at,
                data,
                shared,
            } => {
                let skip = (offset - at) as usize;
                Op::Write {
                    offset,
                    data: &data[skip..skip + length as usize],
                    shared,
                }
            }
            Op::Zero { .. } => Op::Zero { offset, length },
            Op::Lost { .. } => Op::Lost { offset, length },
        }
    }

    /// Whether applying it needs the egroup to exist (writing zeros into a hole does not).
    pub(crate) fn needs_egroup(&self) -> bool {
        match self {
            Op::Write { data, .. } => data.iter().any(|&b| b != 0),
            Op::Zero { .. } => false,
            Op::Lost { .. } => true,
        }
    }
}

/// The new content of one block, or what happens to it.
#[derive(Debug)]
pub(crate) enum BlockOp<'a> {
    /// The whole block is `src[at..at + 4096]` (borrowed from the batch; `shared` is the
    /// `Bytes` that `src` is a slice of, if the batch has one).
    Data {
        src: &'a [u8],
        at: usize,
        shared: Option<&'a Bytes>,
    },
    /// The whole block, merged from several operations.
    Owned(Box<[u8]>),
    /// Some bytes of the block: `buf` holds them at their place, `ranges` says which; the rest
    /// comes from the block's current content.
    Patch {
        buf: Box<[u8]>,
        ranges: Vec<(u16, u16)>,
    },
    Zero,
    Lost,
}

impl BlockOp<'_> {
    /// Lays `bytes` at `at` over this block's planned content.
    fn overlay(self, at: usize, bytes: &[u8]) -> Self {
        let end = at + bytes.len();
        match self {
            BlockOp::Lost => BlockOp::Lost,
            BlockOp::Data { src, at: from, .. } => {
                let mut buf: Box<[u8]> = src[from..from + BLOCK_LEN].into();
                buf[at..end].copy_from_slice(bytes);
                BlockOp::Owned(buf)
            }
            BlockOp::Owned(mut buf) => {
                buf[at..end].copy_from_slice(bytes);
                BlockOp::Owned(buf)
            }
            BlockOp::Zero => {
                let mut buf: Box<[u8]> = vec![0u8; BLOCK_LEN].into();
                buf[at..end].copy_from_slice(bytes);
                BlockOp::Owned(buf)
            }
            BlockOp::Patch {
                mut buf,
                mut ranges,
            } => {
                buf[at..end].copy_from_slice(bytes);
                ranges.push((at as u16, end as u16));
                if covers_block(&mut ranges) {
                    BlockOp::Owned(buf)
                } else {
                    BlockOp::Patch { buf, ranges }
                }
            }
        }
    }
}

/// Sorts and merges `ranges`; true if they cover the whole block.
fn covers_block(ranges: &mut Vec<(u16, u16)>) -> bool {
    ranges.sort_unstable();
    let mut merged: Vec<(u16, u16)> = Vec::with_capacity(ranges.len());
    for &(start, end) in ranges.iter() {
        match merged.last_mut() {
            Some(last) if start <= last.1 => last.1 = last.1.max(end),
            _ => merged.push((start, end)),
        }
    }
    *ranges = merged;
    ranges.len() == 1 && ranges[0] == (0, BLOCK_LEN as u16)
}

/// Lays the patch's bytes over `base` (the block's current content).
pub(crate) fn merge_patch(base: &mut [u8], buf: &[u8], ranges: &[(u16, u16)]) {
    for &(start, end) in ranges {
        base[start as usize..end as usize].copy_from_slice(&buf[start as usize..end as usize]);
    }
}

/// One egroup's blocks (0..1024) and what the batch does to each, in block order.
pub(crate) fn plan<'a>(egroup: u64, ops: &[Op<'a>]) -> BTreeMap<usize, BlockOp<'a>> {
    let base = egroup * EGROUP_SPAN_BYTES;
    let mut blocks: BTreeMap<usize, BlockOp<'a>> = BTreeMap::new();
    for op in ops {
        let (offset, length) = op.range();
        let mut at = offset;
        while at < offset + length {
            let block = ((at - base) / BLOCK) as usize;
            let in_block = (at % BLOCK) as usize;
            let take = (BLOCK_LEN - in_block).min((offset + length - at) as usize);
            debug_assert!(block < BLOCKS_PER_EGROUP);
            let whole = take == BLOCK_LEN;
            let previous = blocks.remove(&block);
            let next = match (op, whole) {
                (Op::Lost { .. }, _) => BlockOp::Lost,
                (Op::Zero { .. }, true) => BlockOp::Zero,
                (Op::Write { data, shared, .. }, true) => BlockOp::Data {
                    src: data,
                    at: (at - offset) as usize,
                    shared: *shared,
                },
                (Op::Zero { .. }, false) => overlay(previous, in_block, &vec![0u8; take]),
                (Op::Write { data, .. }, false) => {
                    let from = (at - offset) as usize;
                    overlay(previous, in_block, &data[from..from + take])
                }
            };
            blocks.insert(block, next);
            at += take as u64;
        }
    }
    blocks
}

fn overlay<'a>(previous: Option<BlockOp<'a>>, at: usize, bytes: &[u8]) -> BlockOp<'a> {
    let start = previous.unwrap_or_else(|| BlockOp::Patch {
        buf: vec![0u8; BLOCK_LEN].into(),
        ranges: Vec::new(),
    });
    start.overlay(at, bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn later_operations_win_and_patches_become_whole_blocks() {
        let a = vec![1u8; 8192];
        let b = vec![2u8; 100];
        let c = vec![3u8; 4096 - 100];
        let mut batch = WriteBatch::new();
        batch
            .write(0, &a)
            .write(10, &b)
            .write(4096, &b)
            .write(4096 + 100, &c)
            .write(EGROUP_SPAN_BYTES + 5, &b)
            .write_zeroes(8 * EGROUP_SPAN_BYTES, 4096)
            .mark_lost(EGROUP_SPAN_BYTES + 4000, 200);
        let groups = batch.by_egroup(|_, _| Vec::new());
        assert_eq!(groups.keys().copied().collect::<Vec<_>>(), vec![0, 1]);
        let blocks = plan(0, &groups[&0]);
        match &blocks[&0] {
            BlockOp::Owned(buf) => {
                assert_eq!(buf[9], 1);
                assert_eq!(buf[10], 2);
                assert_eq!(buf[110], 1);
            }
            other => panic!("{other:?}"),
        }
        match &blocks[&1] {
            BlockOp::Owned(buf) => assert!(buf[..100] == b[..] && buf[100..] == c[..]),
            other => panic!("{other:?}"),
        }
        let blocks = plan(1, &groups[&1]);
        assert!(matches!(blocks[&0], BlockOp::Lost));
        assert!(matches!(blocks[&1], BlockOp::Lost));
        assert_eq!(blocks.len(), 2);
    }
}

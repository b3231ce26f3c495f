//! Applies one egroup's share of a write batch with the crash-safe ordering of
//! docs/extent-store-format.md ("Writes"):
//!
//! - phase A: new CRCs of overwritten blocks into the slot the on-disk data does not match,
//!   removals (zeroed blocks become holes), data of blocks whose on-disk bytes are unknown
//!   (lost, poisoned, holes not known to be zero); checksum blocks written; file synced;
//! - phase B: data of overwrites and of holes known to be zero, hole punching, checksum
//!   blocks of newly written, lost and poisoned blocks; file synced.
//!
//! After a power cut at any point every block reads its old or its new content.

use super::batch::{merge_patch, BlockOp};
use super::block_log::LogSlot;
use super::egroup::{is_zero, Egroup};
use super::extent_lock::{ExtentMask, EVERY_EXTENT};
use super::format::{data_offset, BLOCKS_PER_EXTENT, BLOCK_LEN, EXTENTS};
use super::table::{zero_block_crc, BlockState, Entry};
use super::{io_error, ExtentError};
use crate::fs::{DiskFile, Filesystem};
use crate::join::{try_run_windowed, AfterError};
use bytes::Bytes;
use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;

/// A block's new content: borrowed from the batch (`src[at..at + 4096]`, with the `Bytes`
/// that `src` is a slice of when the batch has one) or merged.
enum Content<'a> {
    Borrowed(&'a [u8], usize, Option<&'a Bytes>),
    Owned(Box<[u8]>),
}

impl Content<'_> {
    fn bytes(&self) -> &[u8] {
        match self {
            Content::Borrowed(src, at, _) => &src[*at..*at + BLOCK_LEN],
            Content::Owned(buf) => buf,
        }
    }
}

/// A run of consecutive blocks' data, as `write_all` hands it to the disk.
enum RunData<'c> {
    /// A slice of the batch's own `Bytes`: written from that memory where the disk can.
    Shared(Bytes),
    Borrowed(&'c [u8]),
    Joined(Vec<u8>),
}

/// What becomes true of a block once the batch is durable.
enum After {
    Current(u8),
    ZeroKnown,
}

#[derive(Default)]
struct Actions<'a> {
    a_entries: Vec<(usize, Entry)>,
    a_data: Vec<(usize, Content<'a>)>,
    b_entries: Vec<(usize, Entry)>,
    b_data: Vec<(usize, Content<'a>)>,
    b_punch: Vec<usize>,
    after: Vec<(usize, After)>,
}

/// The extents `blocks` touch.
pub(crate) fn extents_touched(blocks: &BTreeMap<usize, BlockOp<'_>>) -> ExtentMask {
    blocks
        .keys()
        .fold(0, |mask, block| mask | 1 << (block / BLOCKS_PER_EXTENT))
}

/// Applies `blocks` (egroup block index → action) durably, keeping at most
/// `writes_in_flight` disk writes of a phase in flight; on error the egroup is left for
/// `recover` and every block still reads its old or its new content. The caller holds the
/// extents of `locked`: at least those `blocks` touch, and every extent when
/// `Egroup::needs_every_extent` says so.
pub(crate) async fn apply_plan<F: Filesystem>(
    fs: &F,
    egroup: &Egroup<F::File>,
    blocks: BTreeMap<usize, BlockOp<'_>>,
    writes_in_flight: usize,
    locked: ExtentMask,
) -> Result<(), ExtentError> {
    let touched = extents_touched(&blocks);
    assert_eq!(
        touched & locked,
        touched,
        "a batch writes only extents it holds"
    );
    assert!(
        locked == EVERY_EXTENT || !egroup.needs_every_extent(touched),
        "recovery and damage resets run with every extent held"
    );
    let mut with_content = 0u8;
    for (&block, op) in &blocks {
        if !matches!(op, BlockOp::Zero | BlockOp::Lost) {
            with_content |= 1 << (block / BLOCKS_PER_EXTENT);
        }
    }
    egroup.reset_damage(touched);
    egroup.recover(fs).await?;
    let failures_at_start = egroup.failures.get();
    let mut views: [Option<Vec<u8>>; EXTENTS] = Default::default();
    for (extent, view) in views.iter_mut().enumerate() {
        if with_content & (1 << extent) != 0 {
            *view = egroup.normalize(extent).await?;
        }
    }
    let actions = decide(fs, egroup, blocks, &views).await?;
    drop(views);
    let result = run(
        egroup,
        &actions,
        writes_in_flight,
        locked,
        failures_at_start,
    )
    .await;
    if result.is_err() {
        egroup.mark_failed();
    }
    result
}

async fn decide<'a, F: Filesystem>(
    fs: &F,
    egroup: &Egroup<F::File>,
    blocks: BTreeMap<usize, BlockOp<'a>>,
    views: &[Option<Vec<u8>>; EXTENTS],
) -> Result<Actions<'a>, ExtentError> {
    let mut acts = Actions::default();
    for (block, op) in blocks {
        let entry = egroup.entry(block);
        match op {
            BlockOp::Zero => {
                if entry.state != BlockState::Hole {
                    acts.a_entries.push((block, Entry::HOLE));
                    acts.b_punch.push(block);
                    acts.after.push((block, After::ZeroKnown));
                }
            }
            BlockOp::Lost => {
                if entry.state != BlockState::Lost {
                    acts.b_entries.push((block, Entry::LOST));
                }
            }
            BlockOp::Data { src, at, shared } => {
                acts.content(block, entry, Content::Borrowed(src, at, shared))
            }
            BlockOp::Owned(buf) => acts.content(block, entry, Content::Owned(buf)),
            BlockOp::Patch { buf, ranges } => match entry.state {
                BlockState::Hole => {
                    let mut merged: Box<[u8]> = vec![0u8; BLOCK_LEN].into();
                    merge_patch(&mut merged, &buf, &ranges);
                    acts.content(block, entry, Content::Owned(merged));
                }
                BlockState::Written => {
                    let mut merged = old_block(egroup, block, views).await?;
                    let readable = entry.slot_of(crc32c::crc32c(&merged)).is_some();
                    merge_patch(&mut merged, &buf, &ranges);
                    if readable || entry.slot_of(crc32c::crc32c(&merged)).is_some() {
                        if !readable {
                            tracing::info!(path = %egroup.path.display(), offset = egroup.vdisk_offset(block),
                                "a partial write completed a block torn by an interrupted write: healed");
                        }
                        acts.content(block, entry, Content::Owned(merged));
                    } else {
                        tracing::error!(vdisk = %egroup.vdisk, offset = egroup.vdisk_offset(block),
                            path = %egroup.path.display(), file_offset = data_offset(block),
                            "partial write into a corrupt block: the block stays unreadable until fully rewritten");
                        let poisoned = Entry {
                            state: BlockState::Poisoned,
                            current: None,
                            ..entry
                        };
                        acts.b_entries.push((block, poisoned));
                    }
                }
                BlockState::InLog => match egroup.read_log_block(fs, block, entry).await {
                    Ok(mut merged) => {
                        merge_patch(&mut merged, &buf, &ranges);
                        acts.content(block, entry, Content::Owned(merged));
                    }
                    Err(error) if error.is_corruption() => {
                        tracing::error!(%error,
                            "partial write into a corrupt block in the block log: the block stays unreadable until fully rewritten");
                        let poisoned = Entry {
                            state: BlockState::Poisoned,
                            crc: [0, 0],
                            current: None,
                            zero_known: false,
                            log: LogSlot::NONE,
                        };
                        acts.b_entries.push((block, poisoned));
                    }
                    Err(error) => return Err(error),
                },
                // The rest of the block is unknown: it stays unreadable.
                BlockState::Poisoned | BlockState::Lost => {}
            },
        }
    }
    Ok(acts)
}

impl<'a> Actions<'a> {
    fn content(&mut self, block: usize, entry: Entry, content: Content<'a>) {
        let bytes = content.bytes();
        let crc = crc32c::crc32c(bytes);
        let written = |crc: [u32; 2]| Entry {
            state: BlockState::Written,
            crc,
            current: None,
            zero_known: false,
            log: LogSlot::NONE,
        };
        match entry.state {
            BlockState::Hole if is_zero(bytes) => {}
            BlockState::Hole if entry.zero_known => {
                // Data on disk is zeros or the new bytes, the table a hole or both CRCs.
                self.b_entries
                    .push((block, written([zero_block_crc(), crc])));
                self.b_data.push((block, content));
                self.after.push((block, After::Current(1)));
            }
            BlockState::Hole | BlockState::Poisoned | BlockState::Lost | BlockState::InLog => {
                // The bytes at home are unknown (for a block in the log they mean nothing):
                // the data is durable before the entry says so.
                self.a_data.push((block, content));
                self.b_entries.push((block, written([crc, crc])));
                self.after.push((block, After::Current(0)));
            }
            BlockState::Written => {
                if entry.current.is_some_and(|k| entry.crc[k as usize] == crc) {
                    return; // already on disk
                }
                let slot = match entry.slot_of(crc) {
                    Some(slot) => slot,
                    None => {
                        let slot = entry.current.map_or(1, |k| 1 - k);
                        let mut next = entry;
                        next.crc[slot as usize] = crc;
                        self.a_entries.push((block, next));
                        slot
                    }
                };
                self.b_data.push((block, content));
                self.after.push((block, After::Current(slot)));
            }
        }
    }
}

/// The block's bytes as they are on disk (from the normalization read if there was one).
async fn old_block<D: DiskFile>(
    egroup: &Egroup<D>,
    block: usize,
    views: &[Option<Vec<u8>>; EXTENTS],
) -> Result<Box<[u8]>, ExtentError> {
    if let Some(view) = &views[block / BLOCKS_PER_EXTENT] {
        let at = (block % BLOCKS_PER_EXTENT) * BLOCK_LEN;
        return Ok(view[at..at + BLOCK_LEN].into());
    }
    let mut buf: Box<[u8]> = vec![0u8; BLOCK_LEN].into();
    let at = data_offset(block);
    egroup
        .file
        .read_at(&mut buf, at)
        .await
        .map_err(|e| io_error(&egroup.path, Some(at), e))?;
    Ok(buf)
}

async fn run<D: DiskFile>(
    egroup: &Egroup<D>,
    acts: &Actions<'_>,
    writes_in_flight: usize,
    locked: ExtentMask,
    failures_at_start: u64,
) -> Result<(), ExtentError> {
    if !acts.a_entries.is_empty() || !acts.a_data.is_empty() {
        for &(block, entry) in &acts.a_entries {
            egroup.set_entry(block, entry);
        }
        let tables = table_bits(&acts.a_entries);
        write_all(egroup, &acts.a_data, &[], tables, writes_in_flight).await?;
        egroup.sync_checked(locked, failures_at_start).await?;
    }
    for &(block, entry) in &acts.b_entries {
        egroup.set_entry(block, entry);
    }
    write_all(
        egroup,
        &acts.b_data,
        &acts.b_punch,
        table_bits(&acts.b_entries),
        writes_in_flight,
    )
    .await?;
    if egroup.unsynced.get() & locked != 0 {
        egroup.sync_checked(locked, failures_at_start).await?;
    }
    for (block, after) in &acts.after {
        let mut entry = egroup.entry(*block);
        match after {
            After::Current(slot) => entry.current = Some(*slot),
            After::ZeroKnown => entry.zero_known = true,
        }
        egroup.set_entry(*block, entry);
    }
    Ok(())
}

fn table_bits(entries: &[(usize, Entry)]) -> u8 {
    entries.iter().fold(0, |bits, (block, _)| {
        bits | 1 << (block / BLOCKS_PER_EXTENT)
    })
}

type IoFuture<'f> = Pin<Box<dyn Future<Output = Result<(), ExtentError>> + 'f>>;

/// Issues every data run, hole punch and run of checksum blocks of a phase, at most
/// `writes_in_flight` at a time. Every one is issued even after one fails, as when all went
/// out at once: a window that stopped at the first error lost acknowledged blocks after
/// ENOSPC in `full_disk.rs` (docs/extent-store-format.md, "Writes").
async fn write_all<D: DiskFile>(
    egroup: &Egroup<D>,
    data: &[(usize, Content<'_>)],
    punch: &[usize],
    tables: u8,
    writes_in_flight: usize,
) -> Result<(), ExtentError> {
    let table_runs = egroup.table_runs(tables);
    let mut ios: Vec<IoFuture<'_>> = Vec::new();
    for (first, run) in data_runs(data) {
        ios.push(Box::pin(async move {
            match run {
                RunData::Shared(bytes) => egroup.write_data_from(first, bytes).await,
                RunData::Borrowed(bytes) => egroup.write_data(first, bytes).await,
                RunData::Joined(bytes) => egroup.write_data(first, &bytes).await,
            }
        }));
    }
    for (first, count) in block_runs(punch) {
        ios.push(Box::pin(egroup.punch(first, count)));
    }
    for (first, bytes) in &table_runs {
        ios.push(Box::pin(egroup.write_table_run(*first, bytes)));
    }
    try_run_windowed(ios, writes_in_flight, AfterError::StartTheRest).await
}

/// Runs of consecutive blocks; a run borrowed from one contiguous batch buffer is not copied.
fn data_runs<'c>(items: &'c [(usize, Content<'_>)]) -> Vec<(usize, RunData<'c>)> {
    let mut runs = Vec::new();
    let mut i = 0;
    while i < items.len() {
        let mut j = i + 1;
        while j < items.len() && items[j].0 == items[j - 1].0 + 1 {
            j += 1;
        }
        let run = &items[i..j];
        let contiguous = run.windows(2).all(|w| match (&w[0].1, &w[1].1) {
            (Content::Borrowed(a, at_a, _), Content::Borrowed(b, at_b, _)) => {
                std::ptr::eq(*a, *b) && *at_b == at_a + BLOCK_LEN
            }
            _ => false,
        });
        let bytes = match (&run[0].1, contiguous) {
            (Content::Borrowed(src, at, shared), true) => {
                let slice = &src[*at..*at + run.len() * BLOCK_LEN];
                match shared {
                    Some(shared) => RunData::Shared(shared.slice_ref(slice)),
                    None => RunData::Borrowed(slice),
                }
            }
            _ => {
                let mut joined = Vec::with_capacity(run.len() * BLOCK_LEN);
                for (_, content) in run {
                    joined.extend_from_slice(content.bytes());
                }
                RunData::Joined(joined)
            }
        };
        runs.push((run[0].0, bytes));
        i = j;
    }
    runs
}

fn block_runs(blocks: &[usize]) -> Vec<(usize, usize)> {
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for &block in blocks {
        match runs.last_mut() {
            Some((first, count)) if *first + *count == block => *count += 1,
            _ => runs.push((block, 1)),
        }
    }
    runs
}

//! The block log (extent store format 3) through the store's public API, on the in-memory
//! `TestFs`: journaled batches read back, survive a restart only through replay until a
//! checkpoint wrote them into the tables, and after a power cut at any point every block reads
//! its old or its new content; replay never brings back a state a later write replaced, and
//! damage in the log is reported, never guessed around.

mod extent_store_support;

use ashlar_core::VdiskId;
use ashlar_storage::disk::{Disk, Tier};
use ashlar_storage::extent_store::{
    replay_block_logs, segment_counters, ExtentError, ExtentStore, ExtentStoreConfig,
    JournalConfig, LogId, WriteBatch, EGROUP_SPAN_BYTES,
};
use extent_store_support::{apply_model, pattern, run_local, write_batch, Rng, TestFs, TestOp};
use std::path::PathBuf;

const SPAN: u64 = EGROUP_SPAN_BYTES;
const BLOCK: usize = 4096;
/// Four egroups.
const SPACE: usize = 4 * SPAN as usize;
const VDISK: VdiskId = VdiskId(9);

fn disks(count: usize) -> Vec<Disk> {
    (0..count)
        .map(|i| Disk {
            path: PathBuf::from(format!("/disk{i}")),
            tier: Tier::Fast,
        })
        .collect()
}

/// A store that journals (counters read from `fs`), checkpointing above `checkpoint_blocks`.
async fn journaled(
    fs: &TestFs,
    disk_count: usize,
    checkpoint_blocks: usize,
) -> ExtentStore<TestFs> {
    journaled_with_segments(fs, disk_count, checkpoint_blocks, usize::MAX).await
}

/// `journaled`, cleaning past `max_segments` segments per disk.
async fn journaled_with_segments(
    fs: &TestFs,
    disk_count: usize,
    checkpoint_blocks: usize,
    max_segments: usize,
) -> ExtentStore<TestFs> {
    let disks = disks(disk_count);
    let counters = segment_counters(fs, &disks, VDISK).await.unwrap();
    ExtentStore::new(
        fs.clone(),
        ExtentStoreConfig {
            vdisk: VDISK,
            disks,
            max_open_egroups: 2,
            max_writing_egroups: ashlar_storage::extent_store::DEFAULT_MAX_WRITING_EGROUPS,
            writes_in_flight_per_egroup:
                ashlar_storage::extent_store::DEFAULT_WRITES_IN_FLIGHT_PER_EGROUP,
            journal: Some(JournalConfig {
                log: LogId(3),
                counters,
                checkpoint_blocks,
                max_segments,
                // Small segments (254 blocks each) so that workloads of a few hundred blocks
                // fill several and cleaning runs.
                segment_chunks: 1,
            }),
        },
    )
}

/// A store that writes no log (reads understand one).
fn plain(fs: &TestFs, disk_count: usize) -> ExtentStore<TestFs> {
    ExtentStore::new(
        fs.clone(),
        ExtentStoreConfig {
            vdisk: VDISK,
            disks: disks(disk_count),
            max_open_egroups: 2,
            max_writing_egroups: ashlar_storage::extent_store::DEFAULT_MAX_WRITING_EGROUPS,
            writes_in_flight_per_egroup:
                ashlar_storage::extent_store::DEFAULT_WRITES_IN_FLIGHT_PER_EGROUP,
            journal: None,
        },
    )
}

/// Batches of a drain's mix: many whole blocks spread over the egroups (overwriting one
/// another often), some partial writes and zeroings.
fn workload(seed: u64, batches: usize) -> Vec<Vec<TestOp>> {
    let mut rng = Rng::new(seed);
    let mut data_seed = seed * 1_000_003;
    let mut data = |length: usize| {
        data_seed += 1;
        pattern(data_seed, length)
    };
    let hot = |rng: &mut Rng| rng.below(SPACE as u64 / BLOCK as u64 / 16) * 16 * BLOCK as u64;
    (0..batches)
        .map(|_| {
            (0..2 + rng.below(12))
                .map(|_| match rng.below(10) {
                    0..=6 => {
                        let blocks = 1 + rng.below(4) as usize;
                        let at = hot(&mut rng) + rng.below(8) * BLOCK as u64;
                        TestOp::Write(at, data(blocks * BLOCK))
                    }
                    7 | 8 => {
                        let at = hot(&mut rng) + rng.below(3 * BLOCK as u64);
                        TestOp::Write(at, data(1 + rng.below(5000) as usize))
                    }
                    _ => {
                        let at = hot(&mut rng) + rng.below(2) * rng.below(BLOCK as u64);
                        TestOp::Zero(at, 1 + rng.below(3 * BLOCK as u64))
                    }
                })
                .filter(|op| {
                    let (at, length) = op.range();
                    at + length <= SPACE as u64
                })
                .collect()
        })
        .collect()
}

/// Journals each `(offset, data)` write as a step of its own through a fresh journaled store
/// on one disk (a new writer: its first step starts a new segment).
async fn journal_steps(fs: &TestFs, steps: &[(u64, &[u8])]) {
    let store = journaled(fs, 1, usize::MAX).await;
    for &(at, data) in steps {
        store
            .apply_journaled(WriteBatch::new().write(at, data))
            .await
            .unwrap();
    }
}

async fn read_all(store: &ExtentStore<TestFs>) -> Result<Vec<u8>, ExtentError> {
    let mut image = vec![0u8; SPACE];
    store.read(0, &mut image).await.map(|()| image)
}

fn segments(fs: &TestFs) -> Vec<PathBuf> {
    fs.files()
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "blog"))
        .collect()
}

fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter().zip(b).position(|(x, y)| x != y)
}

#[test]
fn journaled_blocks_read_back_and_need_replay_until_a_checkpoint() {
    run_local(async {
        let fs = TestFs::new();
        let store = journaled(&fs, 1, usize::MAX).await;
        let mut model = vec![0u8; SPACE];
        for ops in workload(7, 12) {
            store.apply_journaled(&write_batch(&ops)).await.unwrap();
            apply_model(&mut model, &ops);
        }
        assert!(read_all(&store).await.unwrap() == model);
        assert!(!segments(&fs).is_empty(), "whole blocks went to the log");
        drop(store);

        // The tables do not name the blocks in the log yet: only the log does.
        let unreplayed = read_all(&plain(&fs, 1)).await.unwrap();
        assert!(
            first_difference(&unreplayed, &model).is_some(),
            "without replay or checkpoint the tables cannot know the logged blocks"
        );
        let report = replay_block_logs(&fs, &disks(1), VDISK, |_| false)
            .await
            .unwrap();
        assert!(
            report.entries > 0 && report.left_out.is_empty() && report.lost.is_empty(),
            "{report:?}"
        );
        assert!(
            read_all(&plain(&fs, 1)).await.unwrap() == model,
            "after replay"
        );

        // A checkpoint writes them into the tables: no replay needed after it.
        let store = journaled(&fs, 1, usize::MAX).await;
        for ops in workload(8, 6) {
            store.apply_journaled(&write_batch(&ops)).await.unwrap();
            apply_model(&mut model, &ops);
        }
        store.checkpoint().await.unwrap();
        drop(store);
        assert!(
            read_all(&plain(&fs, 1)).await.unwrap() == model,
            "after a checkpoint"
        );
    });
}

/// Replay must not bring back a block's logged content once a later write (zeroing, a write
/// home by the two-slot path) replaced it, checkpointed or not.
#[test]
fn replay_does_not_undo_later_writes() {
    run_local(async {
        let fs = TestFs::new();
        let store = journaled(&fs, 1, usize::MAX).await;
        let a = pattern(1, 3 * BLOCK);
        let b = pattern(2, BLOCK);
        let patch = pattern(3, 100);
        store
            .apply_journaled(WriteBatch::new().write(0, &a))
            .await
            .unwrap();
        // Later, through the two-slot path: zero the first block, overwrite the second, patch
        // the third (merging over its content in the log).
        store.write_zeroes(0, BLOCK as u64).await.unwrap();
        store.write(BLOCK as u64, &b).await.unwrap();
        store.write(2 * BLOCK as u64 + 10, &patch).await.unwrap();
        let mut model = vec![0u8; SPACE];
        apply_model(
            &mut model,
            &[
                TestOp::Write(0, a.clone()),
                TestOp::Zero(0, BLOCK as u64),
                TestOp::Write(BLOCK as u64, b.clone()),
                TestOp::Write(2 * BLOCK as u64 + 10, patch.clone()),
            ],
        );
        assert!(read_all(&store).await.unwrap() == model);
        drop(store);
        let disk = fs.power_cut(1);
        replay_block_logs(&disk, &disks(1), VDISK, |_| false)
            .await
            .unwrap();
        assert!(
            read_all(&plain(&disk, 1)).await.unwrap() == model,
            "replay undid a later write"
        );
    });
}

/// A step cut short leaves a chunk whose summary is there and whose data is not. Replay settles
/// it once: the blocks keep their previous content while an oplog still covers them, and the
/// torn chunk, which stays on disk (the highest segment is never removed), must not undo the
/// writes that came after it at the next replay, whether they went home or to the log.
#[test]
fn a_torn_chunk_is_settled_once_and_never_undoes_later_writes() {
    run_local(async {
        let fs = TestFs::new();
        let old = pattern(21, 4 * BLOCK);
        let torn = pattern(22, 4 * BLOCK);
        journal_steps(&fs, &[(0, &old)]).await;
        // The torn step: a new writer (a new segment), its data then damaged as if it never
        // reached the disk. Nothing later claims that chunk durable.
        journal_steps(&fs, &[(0, &torn)]).await;
        let torn_segment = segments(&fs).pop().expect("the torn step's segment");
        for block in 0..4u64 {
            fs.xor_byte(&torn_segment, (1 + block) * BLOCK as u64 + 7, 0x40);
        }
        let covered = |offset: u64| offset < 4 * BLOCK as u64;
        let report = replay_block_logs(&fs, &disks(1), VDISK, covered)
            .await
            .unwrap();
        let first_four: Vec<u64> = (0..4).map(|b| b * BLOCK as u64).collect();
        assert_eq!(report.left_out, first_four, "{report:?}");
        assert!(report.lost.is_empty(), "{report:?}");
        let mut model = vec![0u8; SPACE];
        model[..old.len()].copy_from_slice(&old);
        assert!(
            read_all(&plain(&fs, 1)).await.unwrap() == model,
            "the blocks keep their content from before the torn step"
        );
        // The oplog drains the step again, home (recovery has no journal); a later step of a
        // new run puts two of the blocks in the log.
        let newer = pattern(23, 2 * BLOCK);
        plain(&fs, 1).write(0, &torn).await.unwrap();
        journal_steps(&fs, &[(2 * BLOCK as u64, &newer)]).await;
        model[..torn.len()].copy_from_slice(&torn);
        model[2 * BLOCK..4 * BLOCK].copy_from_slice(&newer);
        assert!(
            segments(&fs).contains(&torn_segment),
            "the torn chunk is still there"
        );
        // The next replay, with no oplog left: nothing lost, nothing undone.
        let disk = fs.power_cut(5);
        let report = replay_block_logs(&disk, &disks(1), VDISK, |_| false)
            .await
            .unwrap();
        assert!(
            report.left_out.is_empty() && report.lost.is_empty(),
            "{report:?}"
        );
        assert!(
            read_all(&plain(&disk, 1)).await.unwrap() == model,
            "a torn chunk replayed a second time undid later writes"
        );
    });
}

/// A block whose newest log entry lost its data and that no oplog covers (the step completed,
/// the block rotted since) is recorded lost: it reads as an error, never as its old content.
#[test]
fn a_missing_block_no_oplog_covers_is_recorded_lost() {
    run_local(async {
        let fs = TestFs::new();
        journal_steps(
            &fs,
            &[(0, &pattern(31, 2 * BLOCK)), (0, &pattern(32, 2 * BLOCK))],
        )
        .await;
        // Segments of one chunk: the second step's is the newest, its first data block
        // right after the summary.
        let newest = segments(&fs).pop().expect("a segment");
        fs.xor_byte(&newest, BLOCK as u64 + 3, 0x01);
        let report = replay_block_logs(&fs, &disks(1), VDISK, |_| false)
            .await
            .unwrap();
        assert_eq!(report.lost, vec![0], "{report:?}");
        let mut first = vec![0u8; BLOCK];
        let store = plain(&fs, 1);
        let error = store.read(0, &mut first).await.unwrap_err();
        assert!(error.to_string().contains("lost"), "{error}");
        let mut second = vec![0u8; BLOCK];
        store.read(BLOCK as u64, &mut second).await.unwrap();
        assert!(second[..] == pattern(32, 2 * BLOCK)[BLOCK..]);
    });
}

/// One seed: a dry run counts the disk operations; then the workload is cut at a random one,
/// the disk comes back with a random subset of the unsynced writes, replay runs, and every
/// block must be old or new. Blocks replay left out must belong to the interrupted batch (the
/// oplog would drain them again). Then the interrupted batch is applied again, as the oplog
/// does, the rest of the workload runs, and a second cut must lose nothing acknowledged.
async fn crash_run(seed: u64) {
    let batches = workload(seed, 14);
    let disk_count = 1 + (seed % 2) as usize;
    let checkpoint_blocks = [8, 40, usize::MAX][(seed % 3) as usize];
    // Two thirds of the seeds clean as they go (one segment a pass, or two: a log over five
    // cleans down to four): cuts land inside cleaning too.
    let max_segments = [2, 5, usize::MAX][(seed / 2 % 3) as usize];
    let mut final_model = vec![0u8; SPACE];
    for ops in &batches {
        apply_model(&mut final_model, ops);
    }
    let dry = TestFs::new();
    let store = journaled_with_segments(&dry, disk_count, checkpoint_blocks, max_segments).await;
    for ops in &batches {
        store.apply_journaled(&write_batch(ops)).await.unwrap();
    }
    assert!(
        read_all(&store).await.unwrap() == final_model,
        "seed {seed}: dry run"
    );
    let total = dry.ops_done();

    let mut rng = Rng::new(seed ^ 0x5eed);
    let fs = TestFs::new();
    let store = journaled_with_segments(&fs, disk_count, checkpoint_blocks, max_segments).await;
    let cut = rng.below(total + 1);
    fs.cut_after(cut);
    let mut acked = vec![0u8; SPACE];
    let mut interrupted = None;
    for (index, ops) in batches.iter().enumerate() {
        if store.apply_journaled(&write_batch(ops)).await.is_err() {
            assert!(fs.is_cut(), "seed {seed}: a batch failed without a cut");
            interrupted = Some(index);
            break;
        }
        apply_model(&mut acked, ops);
    }
    let mut attempted = acked.clone();
    if let Some(index) = interrupted {
        apply_model(&mut attempted, &batches[index]);
    }
    drop(store);

    let disk = fs.power_cut(seed);
    let context = format!("seed {seed}, cut after {cut} of {total} operations");
    let in_interrupted = |offset: u64| {
        interrupted.is_some_and(|index| {
            batches[index].iter().any(|op| {
                let (at, length) = op.range();
                offset + BLOCK as u64 > at && offset < at + length
            })
        })
    };
    // The interrupted batch is what an oplog would drain again.
    let report = replay_block_logs(&disk, &disks(disk_count), VDISK, in_interrupted)
        .await
        .unwrap_or_else(|e| panic!("{context}: replay failed: {e}"));
    assert!(
        report.lost.is_empty(),
        "{context}: replay recorded lost blocks that no interrupted batch wrote: {:?}",
        report.lost
    );
    let store = journaled_with_segments(&disk, disk_count, checkpoint_blocks, max_segments).await;
    let got = read_all(&store)
        .await
        .unwrap_or_else(|e| panic!("{context}: read after the cut failed: {e}"));
    for (block, piece) in got.chunks(BLOCK).enumerate() {
        let range = block * BLOCK..(block + 1) * BLOCK;
        assert!(
            piece == &acked[range.clone()] || piece == &attempted[range],
            "{context}: block {block} holds neither its old nor its new content"
        );
    }
    let resume = interrupted.unwrap_or(batches.len());
    for ops in &batches[resume..] {
        store
            .apply_journaled(&write_batch(ops))
            .await
            .unwrap_or_else(|e| panic!("{context}: batch after the cut failed: {e}"));
    }
    assert!(
        read_all(&store).await.unwrap() == final_model,
        "{context}: final image"
    );
    drop(store);
    let again = disk.power_cut(seed + 1);
    // Nothing was in flight at this cut: whatever the first one tore is settled already.
    let report = replay_block_logs(&again, &disks(disk_count), VDISK, |_| false)
        .await
        .unwrap_or_else(|e| panic!("{context}: second replay failed: {e}"));
    assert!(
        report.left_out.is_empty() && report.lost.is_empty(),
        "{context}: second replay found blocks without data: {report:?}"
    );
    assert!(
        read_all(&plain(&again, disk_count)).await.unwrap() == final_model,
        "{context}: acknowledged data lost by a second power cut"
    );
}

#[test]
fn power_cuts_during_journaled_batches_leave_every_block_old_or_new() {
    run_local(async {
        for seed in 0..120 {
            crash_run(seed).await;
        }
    });
}

#[test]
fn a_rotted_block_in_the_log_is_corrupt_alone() {
    run_local(async {
        let fs = TestFs::new();
        let store = journaled(&fs, 1, usize::MAX).await;
        let data = pattern(5, 3 * BLOCK);
        store
            .apply_journaled(WriteBatch::new().write(0, &data))
            .await
            .unwrap();
        store.checkpoint().await.unwrap();
        let segment = segments(&fs).pop().expect("a segment");
        // Data entry 1 of chunk 0 (slot 2, after the summary): vdisk offset 4096.
        fs.xor_byte(&segment, 2 * BLOCK as u64 + 7, 0x10);
        let mut block = vec![0u8; BLOCK];
        store.read(0, &mut block).await.unwrap();
        assert!(block == data[..BLOCK]);
        match store.read(BLOCK as u64, &mut block).await {
            Err(ExtentError::Corrupt { path, offset, .. }) => {
                assert_eq!(path, segment);
                assert_eq!(offset, BLOCK as u64);
            }
            other => panic!("expected Corrupt naming the segment, got {other:?}"),
        }
        store.read(2 * BLOCK as u64, &mut block).await.unwrap();
        assert!(block == data[2 * BLOCK..]);
        // A full rewrite heals it (through the log again).
        store
            .apply_journaled(WriteBatch::new().write(BLOCK as u64, &data[..BLOCK]))
            .await
            .unwrap();
        store.read(BLOCK as u64, &mut block).await.unwrap();
        assert!(block == data[..BLOCK]);
    });
}

#[test]
fn replay_refuses_a_chunk_whose_two_summaries_rotted() {
    run_local(async {
        let fs = TestFs::new();
        journal_steps(&fs, &[(0, &pattern(6, 2 * BLOCK))]).await;
        let segment = segments(&fs).pop().expect("a segment");
        fs.xor_byte(&segment, 20, 1); // the summary
        fs.xor_byte(&segment, 255 * BLOCK as u64 + 20, 1); // its copy
        match replay_block_logs(&fs, &disks(1), VDISK, |_| false).await {
            Err(error @ ExtentError::BadLogChunk { .. }) => {
                assert!(error.is_corruption());
                assert_eq!(error.path(), Some(segment.as_path()));
            }
            other => panic!("expected BadLogChunk, got {other:?}"),
        }
        // One copy is enough.
        fs.xor_byte(&segment, 20, 1);
        let report = replay_block_logs(&fs, &disks(1), VDISK, |_| false)
            .await
            .unwrap();
        assert_eq!(report.entries, 2);
    });
}

/// Cleaning writes home the blocks a segment still holds, leaves the ones overwritten since,
/// removes the segment, and changes no block's content, also for replay after a crash.
#[test]
fn cleaning_moves_live_blocks_home_and_removes_the_segment() {
    run_local(async {
        let fs = TestFs::new();
        let store = journaled(&fs, 1, usize::MAX).await;
        let first = pattern(11, 20 * BLOCK);
        let second = pattern(12, 5 * BLOCK);
        store
            .apply_journaled(WriteBatch::new().write(0, &first))
            .await
            .unwrap();
        // Five of the twenty blocks overwritten: in a newer segment.
        store
            .apply_journaled(WriteBatch::new().write(3 * BLOCK as u64, &second))
            .await
            .unwrap();
        let mut model = vec![0u8; SPACE];
        apply_model(
            &mut model,
            &[
                TestOp::Write(0, first.clone()),
                TestOp::Write(3 * BLOCK as u64, second.clone()),
            ],
        );
        let before = segments(&fs);
        assert_eq!(before.len(), 2, "{before:?}");
        let report = store
            .clean_log(|_, seq| seq == ashlar_storage::extent_store::SegmentSeq(1))
            .await
            .unwrap();
        assert_eq!(report.segments_removed, 1, "{report:?}");
        assert_eq!(report.blocks_moved, 15, "{report:?}");
        assert_eq!(segments(&fs), before[1..].to_vec());
        assert!(read_all(&store).await.unwrap() == model);
        // The highest segment of a disk stays (its number keeps positions from going back).
        let report = store.clean_log(|_, _| true).await.unwrap();
        assert_eq!((report.segments_removed, report.segments_kept), (0, 1));
        drop(store);
        let disk = fs.power_cut(3);
        replay_block_logs(&disk, &disks(1), VDISK, |_| false)
            .await
            .unwrap();
        assert!(
            read_all(&plain(&disk, 1)).await.unwrap() == model,
            "after replay"
        );
    });
}

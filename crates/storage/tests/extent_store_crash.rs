//! Extent store under power cuts, failed syncs, full disks and an asynchronous disk, on the
//! in-memory `TestFs`: after a cut at any point every block reads its old or its new content
//! (never EIO), and what was acknowledged survives.

mod extent_store_support;

use ashlar_core::VdiskId;
use ashlar_storage::disk::{Disk, Tier};
use ashlar_storage::extent_store::{
    ExtentError, ExtentStore, ExtentStoreConfig, EGROUP_SPAN_BYTES,
};
use extent_store_support::{apply_model, pattern, run_local, write_batch, Rng, TestFs, TestOp};
use std::path::PathBuf;

const SPAN: u64 = EGROUP_SPAN_BYTES;
const MIB: u64 = 1 << 20;
const BLOCK: usize = 4096;
/// The workload's address space: four egroups, twice `max_open_egroups`.
const SPACE: usize = 4 * SPAN as usize;

fn config(disks: usize, max_open_egroups: usize) -> ExtentStoreConfig {
    ExtentStoreConfig {
        vdisk: VdiskId(3),
        disks: (0..disks)
            .map(|i| Disk {
                path: PathBuf::from(format!("/disk{i}")),
                tier: Tier::Fast,
            })
            .collect(),
        max_open_egroups,
        max_writing_egroups: ashlar_storage::extent_store::DEFAULT_MAX_WRITING_EGROUPS,
        writes_in_flight_per_egroup:
            ashlar_storage::extent_store::DEFAULT_WRITES_IN_FLIGHT_PER_EGROUP,
        journal: None,
    }
}

/// A hot offset: the first or last blocks of some extent, so blocks are overwritten often.
fn hot_offset(rng: &mut Rng) -> u64 {
    let extent = rng.below(SPACE as u64 / MIB);
    let block = if rng.chance(3) {
        256 - 1 - rng.below(6)
    } else {
        rng.below(8)
    };
    extent * MIB + block * BLOCK as u64
}

fn workload(seed: u64) -> Vec<Vec<TestOp>> {
    let mut rng = Rng::new(seed);
    let mut data_seed = seed * 1000;
    let mut data = |len: usize| {
        data_seed += 1;
        pattern(data_seed, len)
    };
    (0..10)
        .map(|_| {
            (0..1 + rng.below(4))
                .map(|_| match rng.below(10) {
                    0..=3 | 9 => {
                        let blocks = 1 + rng.below(6) as usize;
                        TestOp::Write(hot_offset(&mut rng), data(blocks * BLOCK))
                    }
                    4..=6 => {
                        let at = hot_offset(&mut rng) + rng.below(BLOCK as u64);
                        TestOp::Write(at, data(1 + rng.below(6000) as usize))
                    }
                    7 => {
                        let at = hot_offset(&mut rng) + rng.below(2) * rng.below(BLOCK as u64);
                        TestOp::Zero(at, 1 + rng.below(3 * BLOCK as u64))
                    }
                    _ => {
                        let boundary = (1 + rng.below(SPACE as u64 / MIB - 1)) * MIB;
                        TestOp::Write(boundary - rng.below(20_000), data(40_000))
                    }
                })
                .filter(|op| match op {
                    TestOp::Write(at, d) => *at as usize + d.len() <= SPACE,
                    TestOp::Zero(at, len) => at + len <= SPACE as u64,
                })
                .collect()
        })
        .collect()
}

async fn read_all(store: &ExtentStore<TestFs>) -> Result<Vec<u8>, ExtentError> {
    let mut image = vec![0u8; SPACE];
    store.read(0, &mut image).await.map(|()| image)
}

/// Every block is one of the allowed versions.
fn assert_old_or_new(got: &[u8], allowed: &[&[u8]], context: &str) {
    for (block, piece) in got.chunks(BLOCK).enumerate() {
        let range = block * BLOCK..(block + 1) * BLOCK;
        assert!(
            allowed.iter().any(|image| image[range.clone()] == *piece),
            "{context}: block {block} (offset {}) holds neither old nor new content",
            block * BLOCK
        );
    }
}

/// One seed: a dry run counts the disk operations; then the same workload is cut at a random
/// operation (with a failed sync injected on some seeds), the disk comes back with a random
/// subset of the unsynced writes, and every block must be old or new; the interrupted batch
/// is retried (as the oplog does) and the rest of the workload must complete.
async fn crash_run(seed: u64) {
    let batches = workload(seed);
    let mut final_model = vec![0u8; SPACE];
    for batch in &batches {
        apply_model(&mut final_model, batch);
    }
    let disks = 1 + (seed % 2) as usize;
    let dry = TestFs::new();
    let store = ExtentStore::new(dry.clone(), config(disks, 2));
    for batch in &batches {
        store.apply(&write_batch(batch)).await.unwrap();
    }
    assert!(
        read_all(&store).await.unwrap() == final_model,
        "seed {seed}: dry run"
    );
    let total = dry.ops_done();

    let mut rng = Rng::new(seed ^ 0xc0ffee);
    let fs = TestFs::new();
    let cut = rng.below(total + 1);
    fs.cut_after(cut);
    if seed.is_multiple_of(3) {
        fs.fail_nth_sync(1 + rng.below(20) as usize);
    }
    let store = ExtentStore::new(fs.clone(), config(disks, 2));
    let mut acked = vec![0u8; SPACE];
    let mut interrupted = None;
    'batches: for (index, batch) in batches.iter().enumerate() {
        let mut attempts = 0;
        loop {
            match store.apply(&write_batch(batch)).await {
                Ok(()) => break,
                Err(_) if fs.is_cut() => {
                    interrupted = Some(index);
                    break 'batches;
                }
                Err(error) => {
                    // A failed sync: the caller retries the batch.
                    attempts += 1;
                    assert!(attempts < 3, "seed {seed}: retry keeps failing: {error}");
                }
            }
        }
        apply_model(&mut acked, batch);
    }
    let mut attempted = acked.clone();
    if let Some(index) = interrupted {
        apply_model(&mut attempted, &batches[index]);
    }
    drop(store);

    let disk = fs.power_cut(seed);
    let store = ExtentStore::new(disk.clone(), config(disks, 2));
    let context = format!("seed {seed}, cut after {cut} of {total} operations");
    let got = read_all(&store)
        .await
        .unwrap_or_else(|e| panic!("{context}: read after the cut failed: {e}"));
    assert_old_or_new(&got, &[&acked, &attempted], &context);
    let resume = interrupted.unwrap_or(batches.len());
    for batch in &batches[resume..] {
        store
            .apply(&write_batch(batch))
            .await
            .unwrap_or_else(|e| panic!("{context}: batch after the cut failed: {e}"));
    }
    assert!(
        read_all(&store).await.unwrap() == final_model,
        "{context}: final image"
    );
    drop(store);
    let again = disk.power_cut(seed + 1);
    let store = ExtentStore::new(again, config(disks, 2));
    assert!(
        read_all(&store).await.unwrap() == final_model,
        "{context}: acknowledged data lost by a second power cut"
    );
}

#[test]
fn power_cuts_at_random_points_leave_every_block_old_or_new() {
    run_local(async {
        for seed in 0..150 {
            crash_run(seed).await;
        }
    });
}

/// Builds a state, then applies `last` with a power cut after each possible number of disk
/// operations; `check` sees the store on the disk as it comes back.
async fn every_cut_point<S, C>(setup: S, last: &[TestOp], allowed_versions: usize, check: C)
where
    S: AsyncFn(&ExtentStore<TestFs>, &TestFs) -> Vec<Vec<u8>>,
    C: Fn(&[u8], &[Vec<u8>], &str),
{
    let mut cut = 0;
    loop {
        let fs = TestFs::new();
        let store = ExtentStore::new(fs.clone(), config(1, 2));
        let mut versions = setup(&store, &fs).await;
        assert_eq!(versions.len(), allowed_versions);
        let mut new = versions.last().unwrap().clone();
        apply_model(&mut new, last);
        versions.push(new);
        let start = fs.ops_done();
        fs.cut_after(cut);
        let finished = store.apply(&write_batch(last)).await.is_ok();
        let used = fs.ops_done() - start;
        drop(store);
        for seed in 0..8 {
            let disk = fs.power_cut(seed * 31 + cut);
            let store = ExtentStore::new(disk, config(1, 2));
            let context = format!("cut after {cut} of the last batch's operations, seed {seed}");
            let got = read_all(&store)
                .await
                .unwrap_or_else(|e| panic!("{context}: read failed: {e}"));
            check(&got, &versions, &context);
        }
        if finished && used <= cut {
            break;
        }
        cut += 1;
    }
}

#[test]
fn eviction_between_overwrites_then_a_power_cut_keeps_old_or_new() {
    // Review 4.1 b: the slot an overwrite may replace must be known again after the egroup
    // was evicted and reopened, or a cut between checksum and data write loses the old data.
    let x = pattern(1, 3 * BLOCK);
    let y = pattern(2, 3 * BLOCK);
    let z = pattern(3, 3 * BLOCK);
    let patch = pattern(4, 1000);
    let last = vec![
        TestOp::Write(BLOCK as u64, z.clone()),
        TestOp::Write(MIB + 100, patch.clone()),
    ];
    let setup = async |store: &ExtentStore<TestFs>, _fs: &TestFs| {
        let mut image = vec![0u8; SPACE];
        let mut step = |ops: Vec<TestOp>| {
            apply_model(&mut image, &ops);
            ops
        };
        for ops in [
            step(vec![
                TestOp::Write(BLOCK as u64, x.clone()),
                TestOp::Write(MIB, x.clone()),
            ]),
            step(vec![TestOp::Write(SPAN, x.clone())]),
            step(vec![TestOp::Write(2 * SPAN, x.clone())]),
            step(vec![
                TestOp::Write(BLOCK as u64, y.clone()),
                TestOp::Write(MIB + 50, y.clone()),
            ]),
            step(vec![TestOp::Write(3 * SPAN + 5, y.clone())]),
            step(vec![TestOp::Write(SPAN + 7, y.clone())]),
        ] {
            store.apply(&write_batch(&ops)).await.unwrap();
        }
        assert!(store.open_egroups() <= 2);
        vec![image]
    };
    run_local(every_cut_point(
        setup,
        &last,
        1,
        |got, versions, context| {
            let allowed: Vec<&[u8]> = versions.iter().map(Vec::as_slice).collect();
            assert_old_or_new(got, &allowed, context);
        },
    ));
}

#[test]
fn after_a_failed_sync_a_different_rewrite_is_still_crash_safe() {
    // fsyncgate: the failed sync dropped the new data from the disk while reads still return
    // it. The next batch writes other content into the block; a cut anywhere in it must leave
    // the acknowledged data, the failed write's data or the new data, never an error.
    let d = pattern(1, 2 * BLOCK);
    let n = pattern(2, 2 * BLOCK);
    let last = vec![TestOp::Write(0, pattern(3, 2 * BLOCK))];
    for failing_sync in [1, 2] {
        let setup = async |store: &ExtentStore<TestFs>, fs: &TestFs| {
            let mut image = vec![0u8; SPACE];
            store.write(0, &d).await.unwrap();
            image[..d.len()].copy_from_slice(&d);
            let acked = image.clone();
            fs.fail_nth_sync(failing_sync);
            assert!(store.write(0, &n).await.is_err());
            image[..n.len()].copy_from_slice(&n);
            // Other egroups push it towards eviction: reopened, it would trust the page cache.
            for egroup in 1..4 {
                store.write(egroup * SPAN, &d).await.unwrap();
                image[(egroup * SPAN) as usize..][..d.len()].copy_from_slice(&d);
            }
            let mut acked = acked;
            acked[SPAN as usize..].copy_from_slice(&image[SPAN as usize..]);
            vec![acked, image]
        };
        run_local(every_cut_point(
            setup,
            &last,
            2,
            |got, versions, context| {
                let allowed: Vec<&[u8]> = versions.iter().map(Vec::as_slice).collect();
                assert_old_or_new(got, &allowed, context);
            },
        ));
    }
}

#[test]
fn sync_rewrites_what_a_failed_sync_dropped() {
    run_local(async {
        let fs = TestFs::new();
        let store = ExtentStore::new(fs.clone(), config(1, 2));
        let d = pattern(1, 8 * BLOCK);
        let n = pattern(2, 8 * BLOCK);
        store.write(0, &d).await.unwrap();
        fs.fail_nth_sync(2);
        assert!(matches!(
            store.write(0, &n).await,
            Err(ExtentError::Io { .. })
        ));
        // The egroup stays open (it must be rewritten), even past max_open_egroups.
        for egroup in 1..4 {
            store.write(egroup * SPAN, &d).await.unwrap();
        }
        store.sync().await.unwrap();
        store.sync().await.unwrap(); // nothing left to do
        let got = {
            let disk = fs.power_cut(7);
            let store = ExtentStore::new(disk, config(1, 2));
            read_all(&store).await.unwrap()
        };
        assert!(
            got[..n.len()] == n[..],
            "the failed write's data was made durable by sync"
        );
        // Retrying the same batch is what the contract asks; it is cheap and durable.
        store.write(0, &n).await.unwrap();
        let disk = fs.power_cut(8);
        let store = ExtentStore::new(disk, config(1, 2));
        assert!(read_all(&store).await.unwrap()[..n.len()] == n[..]);
    });
}

#[test]
fn a_full_disk_fails_the_write_cleanly_and_a_retry_succeeds() {
    run_local(async {
        let fs = TestFs::new();
        let store = ExtentStore::new(fs.clone(), config(1, 2));
        let a = pattern(1, MIB as usize);
        let b = pattern(2, 2 * MIB as usize);
        store.write(0, &a).await.unwrap();
        fs.set_space_limit(Some(fs.allocated_bytes() + 100 * BLOCK as u64));
        assert!(matches!(
            store.write(MIB, &b).await,
            Err(ExtentError::NoSpace { .. })
        ));
        // Nothing half-done: old data intact, each new block old (zeros) or new.
        let mut acked = vec![0u8; SPACE];
        acked[..a.len()].copy_from_slice(&a);
        let mut attempted = acked.clone();
        attempted[MIB as usize..3 * MIB as usize].copy_from_slice(&b);
        assert_old_or_new(
            &read_all(&store).await.unwrap(),
            &[&acked, &attempted],
            "after ENOSPC",
        );
        {
            let disk = fs.power_cut(1);
            let store = ExtentStore::new(disk, config(1, 2));
            let got = read_all(&store).await.unwrap();
            assert_old_or_new(&got, &[&acked, &attempted], "power cut after ENOSPC");
        }
        // Overwriting allocated blocks needs no space.
        let a2 = pattern(3, MIB as usize);
        store.write(0, &a2).await.unwrap();
        acked[..a2.len()].copy_from_slice(&a2);
        // A new egroup cannot even be created.
        fs.set_space_limit(Some(fs.allocated_bytes()));
        assert!(matches!(
            store.write(2 * SPAN, &a).await,
            Err(ExtentError::NoSpace { .. })
        ));
        // Space comes back: the retries succeed and are durable.
        fs.set_space_limit(None);
        store.write(MIB, &b).await.unwrap();
        store.write(2 * SPAN, &a).await.unwrap();
        acked[MIB as usize..3 * MIB as usize].copy_from_slice(&b);
        acked[2 * SPAN as usize..][..a.len()].copy_from_slice(&a);
        assert!(read_all(&store).await.unwrap() == acked);
        let disk = fs.power_cut(2);
        let store = ExtentStore::new(disk, config(1, 2));
        assert!(read_all(&store).await.unwrap() == acked);
    });
}

#[test]
fn concurrent_operations_on_an_asynchronous_disk_stay_consistent() {
    run_local(async {
        let fs = TestFs::new();
        fs.set_yield(true);
        let store = ExtentStore::new(fs.clone(), config(1, 2));
        let base = pattern(1, SPAN as usize);
        store.write(0, &base).await.unwrap();
        // One 4 MiB read keeps the I/Os of its four extents in flight together.
        fs.reset_max_in_flight();
        let mut got = vec![0u8; SPAN as usize];
        store.read(0, &mut got).await.unwrap();
        assert!(got == base);
        assert!(fs.max_in_flight() >= 4, "in flight: {}", fs.max_in_flight());
        // Writers over more egroups than stay open, readers of a block being overwritten.
        let store = &store;
        let writer = |egroup: u64| async move {
            let mut last = Vec::new();
            for round in 0..6u64 {
                last = pattern(egroup * 100 + round, 3 * BLOCK + 17);
                let at = egroup * SPAN + round % 3 * MIB + 9;
                store.write(at, &last).await.unwrap();
                let mut back = vec![0u8; last.len()];
                store.read(at, &mut back).await.unwrap();
                assert!(back == last, "egroup {egroup} round {round}");
            }
            last
        };
        let versions: Vec<Vec<u8>> = (0..4).map(|v| pattern(50 + v, BLOCK)).collect();
        let overwriter = async {
            for round in 0..12 {
                store
                    .write(8 * BLOCK as u64, &versions[round % 4])
                    .await
                    .unwrap();
            }
        };
        let reader = async {
            for _ in 0..40 {
                let mut block = vec![0u8; BLOCK];
                store.read(8 * BLOCK as u64, &mut block).await.unwrap();
                assert!(
                    block == base[8 * BLOCK..9 * BLOCK] || versions.contains(&block),
                    "a read during overwrites saw other bytes"
                );
                tokio::task::yield_now().await;
            }
        };
        let writers = futures_join(vec![
            Box::pin(writer(1)),
            Box::pin(writer(2)),
            Box::pin(writer(3)),
            Box::pin(writer(5)),
        ]);
        let (_, (), ()) = tokio::join!(writers, overwriter, reader);
        assert!(store.open_egroups() <= 2, "open: {}", store.open_egroups());
        let disk = fs.power_cut(3);
        let reopened = ExtentStore::new(disk, config(1, 2));
        let mut block = vec![0u8; BLOCK];
        reopened.read(8 * BLOCK as u64, &mut block).await.unwrap();
        assert_eq!(block, versions[11 % 4]);
    });
}

/// Joins boxed futures of one type (the tests do not depend on the `futures` crate).
async fn futures_join<T>(
    mut futures: Vec<std::pin::Pin<Box<dyn std::future::Future<Output = T> + '_>>>,
) -> Vec<T> {
    let mut out: Vec<Option<T>> = futures.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        for (future, slot) in futures.iter_mut().zip(out.iter_mut()) {
            if slot.is_none() {
                if let std::task::Poll::Ready(value) = future.as_mut().poll(cx) {
                    *slot = Some(value);
                }
            }
        }
        if out.iter().all(Option::is_some) {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await;
    out.into_iter().flatten().collect()
}

#[test]
fn looking_up_absent_egroups_costs_no_memory() {
    run_local(async {
        let fs = TestFs::new();
        let store = ExtentStore::new(fs.clone(), config(1, 2));
        for egroup in [0, 7, 100] {
            store.write(egroup * SPAN + 5, b"data").await.unwrap();
        }
        assert_eq!(store.cached_egroups(), 3);
        let ops = fs.ops_done();
        let mut buf = vec![1u8; BLOCK];
        for egroup in 1000..1_001_000u64 {
            store.read(egroup * SPAN, &mut buf).await.unwrap();
        }
        assert!(buf.iter().all(|&b| b == 0));
        // A map of a sparse 64 TiB vdisk.
        let runs = store.allocation(0, 64 << 40).await.unwrap();
        assert_eq!(runs.iter().map(|r| r.0).sum::<u64>(), 64 << 40);
        assert_eq!(runs.iter().filter(|r| r.1).count(), 3);
        assert_eq!(store.cached_egroups(), 3, "absent egroups were remembered");
        assert!(store.open_egroups() <= 2);
        assert_eq!(fs.ops_done(), ops, "absent egroups cost disk operations");
        // After a hand-over the set is listed again, still only what exists.
        store.close_all();
        assert_eq!(store.cached_egroups(), 0);
        store.read(7 * SPAN + 5, &mut buf[..4]).await.unwrap();
        assert_eq!(&buf[..4], b"data");
        assert_eq!(store.cached_egroups(), 3);
    });
}

/// Four whole-extent overwrites of one egroup, issued at once on an asynchronous disk (the
/// shape of a 1 MiB sequential write stream): cut after `cut` operations and fail the
/// `fail_sync`-th sync if given. Failed writes are retried (as the oplog does) unless the
/// disk is cut. Returns (which writes were acknowledged, most disk I/Os in flight at once).
async fn concurrent_extent_writes(
    store: &ExtentStore<TestFs>,
    fs: &TestFs,
    news: &[Vec<u8>],
    cut: Option<u64>,
    fail_sync: Option<usize>,
) -> (Vec<bool>, usize) {
    if let Some(cut) = cut {
        fs.cut_after(cut);
    }
    if let Some(nth) = fail_sync {
        fs.fail_nth_sync(nth);
    }
    fs.reset_max_in_flight();
    let writes = news
        .iter()
        .enumerate()
        .map(|(extent, new)| {
            Box::pin(async move {
                for _attempt in 0..3 {
                    match store.write(extent as u64 * MIB, new).await {
                        Ok(()) => return true,
                        Err(_) if fs.is_cut() => return false,
                        Err(_) => tokio::task::yield_now().await,
                    }
                }
                panic!("extent {extent}: the retried write kept failing");
            }) as std::pin::Pin<Box<dyn std::future::Future<Output = bool>>>
        })
        .collect();
    let acked = futures_join(writes).await;
    (acked, fs.max_in_flight())
}

#[test]
fn concurrent_writes_to_the_extents_of_one_egroup_overlap_and_stay_crash_safe() {
    run_local(async {
        let old = pattern(1, SPAN as usize);
        let mut old_image = vec![0u8; SPACE];
        old_image[..old.len()].copy_from_slice(&old);
        let news: Vec<Vec<u8>> = (0..4).map(|e| pattern(10 + e, MIB as usize)).collect();
        let mut new_image = old_image.clone();
        for (extent, new) in news.iter().enumerate() {
            new_image[extent * MIB as usize..][..new.len()].copy_from_slice(new);
        }
        let prepared = async || {
            let fs = TestFs::new();
            fs.set_yield(true);
            let store = ExtentStore::new(fs.clone(), config(1, 2));
            store.write(0, &old).await.unwrap();
            (fs, store)
        };
        // Dry run: the writes of different extents are in flight together.
        let (fs, store) = prepared().await;
        let start = fs.ops_done();
        let (acked, in_flight) = concurrent_extent_writes(&store, &fs, &news, None, None).await;
        assert!(acked.iter().all(|&a| a));
        assert!(
            in_flight >= 4,
            "whole-extent writes of one egroup ran one after another ({in_flight} in flight)"
        );
        assert!(read_all(&store).await.unwrap() == new_image);
        let total = fs.ops_done() - start;

        let mut rng = Rng::new(77);
        for seed in 0..120u64 {
            let (fs, store) = prepared().await;
            let cut = (seed % 4 != 3).then(|| rng.below(total + 1));
            let fail_sync = (seed % 2 == 1).then(|| 1 + rng.below(8) as usize);
            let (acked, _) = concurrent_extent_writes(&store, &fs, &news, cut, fail_sync).await;
            drop(store);
            let context = format!("seed {seed}, cut {cut:?}, failed sync {fail_sync:?}");
            let disk = fs.power_cut(seed);
            let store = ExtentStore::new(disk, config(1, 2));
            let got = read_all(&store)
                .await
                .unwrap_or_else(|e| panic!("{context}: read after the cut failed: {e}"));
            assert_old_or_new(&got, &[&old_image, &new_image], &context);
            for (extent, _) in acked.iter().enumerate().filter(|(_, &a)| a) {
                assert!(
                    got[extent * MIB as usize..][..MIB as usize] == news[extent][..],
                    "{context}: the acknowledged write of extent {extent} was lost"
                );
            }
        }
    });
}

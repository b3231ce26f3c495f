//! Extent store on real files (`StdFs`): round trips at any alignment, batches, holes,
//! persistence across reopen, several disks, and the vdisk-level helpers.

mod extent_store_support;

use ashlar_core::VdiskId;
use ashlar_storage::disk::{Disk, Tier};
use ashlar_storage::extent_store::{
    remove_vdisk_data, vdisk_bytes_used, ExtentError, ExtentStore, ExtentStoreConfig, WriteBatch,
    EGROUP_SPAN_BYTES,
};
use ashlar_storage::fs::StdFs;
use extent_store_support::{pattern, run_local};
use std::path::{Path, PathBuf};

fn disk(path: &Path) -> Disk {
    Disk {
        path: path.to_path_buf(),
        tier: Tier::Fast,
    }
}

fn config(dirs: &[&Path]) -> ExtentStoreConfig {
    ExtentStoreConfig {
        vdisk: VdiskId(7),
        disks: dirs.iter().map(|d| disk(d)).collect(),
        max_open_egroups: 2,
        max_writing_egroups: ashlar_storage::extent_store::DEFAULT_MAX_WRITING_EGROUPS,
        writes_in_flight_per_egroup:
            ashlar_storage::extent_store::DEFAULT_WRITES_IN_FLIGHT_PER_EGROUP,
        journal: None,
    }
}

fn egroup_path(dir: &Path, egroup: u64) -> PathBuf {
    dir.join("extents")
        .join(VdiskId(7).to_string())
        .join(format!("{egroup:016x}.egroup"))
}

#[test]
fn unaligned_writes_round_trip_across_boundaries_and_survive_reopen() {
    let dir = tempfile::tempdir().unwrap();
    run_local(async {
        let size = 12usize << 20;
        let mut model = vec![0u8; size];
        let store = ExtentStore::new(StdFs, config(&[dir.path()]));
        let writes = [
            (0usize, 4096usize),
            (4095, 3),
            ((1 << 20) - 100, 300),
            ((4 << 20) - 5000, 10_000),
            (9 << 20, 1 << 20),
            (100, 1),
        ];
        for (i, (offset, length)) in writes.iter().enumerate() {
            let data = pattern(i as u64 + 1, *length);
            store.write(*offset as u64, &data).await.unwrap();
            model[*offset..offset + length].copy_from_slice(&data);
        }
        store.write_zeroes((9 << 20) + 10, 8192 * 3).await.unwrap();
        model[(9 << 20) + 10..(9 << 20) + 10 + 8192 * 3].fill(0);
        let mut all = vec![0u8; size];
        store.read(0, &mut all).await.unwrap();
        assert!(all == model, "read after write differs from the model");
        assert_eq!(store.cached_egroups(), 3);
        drop(store);
        let reopened = ExtentStore::new(StdFs, config(&[dir.path()]));
        let mut again = vec![0u8; size];
        reopened.read(0, &mut again).await.unwrap();
        assert!(again == model, "read after reopen differs from the model");
        // Reads within one extent (read without a list of pieces), aligned or not, and reads
        // of nothing, at an extent boundary and inside one.
        let pieces = [
            (4095usize, 3usize),
            ((1 << 20) - 100, 100),
            (9 << 20, 1 << 20),
            (100, 0),
            (1 << 20, 0),
        ];
        for (offset, length) in pieces {
            let mut piece = vec![0xA5u8; length];
            reopened.read(offset as u64, &mut piece).await.unwrap();
            assert!(
                piece == model[offset..offset + length],
                "[{offset}, +{length})"
            );
        }
        assert_eq!(
            reopened.cached_egroups(),
            3,
            "the listing finds every egroup"
        );
        // Holes: an untouched egroup and the zeroed middle are unallocated.
        let runs = reopened.allocation(0, size as u64).await.unwrap();
        assert_eq!(runs.iter().map(|r| r.0).sum::<u64>(), size as u64);
        assert!(runs.iter().any(|r| !r.1) && runs.iter().any(|r| r.1));
        let untouched = reopened.allocation(5 << 20, 1 << 20).await.unwrap();
        assert_eq!(untouched, vec![(1 << 20, false)]);
        let zeroed = reopened
            .allocation((9 << 20) + 4096, 8192 * 2)
            .await
            .unwrap();
        assert_eq!(zeroed, vec![(8192 * 2, false)]);
        let written = reopened.allocation(0, 4096).await.unwrap();
        assert_eq!(written, vec![(4096, true)]);
    });
}

#[test]
fn a_batch_applies_overlapping_operations_in_order() {
    let dir = tempfile::tempdir().unwrap();
    run_local(async {
        let store = ExtentStore::new(StdFs, config(&[dir.path()]));
        let size = 3 * EGROUP_SPAN_BYTES as usize;
        let mut model = vec![0u8; size];
        let a = pattern(1, 3 << 20);
        let b = pattern(2, 5000);
        let c = pattern(3, 70_000);
        let start_b = EGROUP_SPAN_BYTES as usize - 2000;
        let mut batch = WriteBatch::new();
        batch
            .write(1000, &a)
            .write(start_b as u64, &b)
            .write_zeroes(5000, 9000)
            .write(2 << 20, &c);
        store.apply(&batch).await.unwrap();
        model[1000..1000 + a.len()].copy_from_slice(&a);
        model[start_b..start_b + b.len()].copy_from_slice(&b);
        model[5000..14_000].fill(0);
        model[2 << 20..(2 << 20) + c.len()].copy_from_slice(&c);
        let mut all = vec![0u8; size];
        store.read(0, &mut all).await.unwrap();
        assert!(all == model, "batch result differs from the model");
        // Unaligned reads of every size see the same bytes.
        for (offset, length) in [(1, 1), (4095, 2), (999, 70_001), (start_b - 3, 6000)] {
            let mut piece = vec![0u8; length];
            store.read(offset as u64, &mut piece).await.unwrap();
            assert!(piece == model[offset..offset + length], "read at {offset}");
        }
        // `read_bytes` (whole blocks of one extent read into their own buffer, anything else
        // through `read`) sees them too: data, zeroed blocks, never-written blocks, a range
        // across extents and an unaligned one.
        let mib = 1 << 20;
        for (offset, length) in [
            (0, 4096),
            (4096, 12_288),
            (0, mib),
            (mib, mib),
            (2 * mib, 128 << 10),
            (mib - 8192, 16_384),
            (start_b / 4096 * 4096, 8192),
            (size - 4096, 4096),
            (999, 5000),
        ] {
            let got = store
                .read_bytes(offset as u64, length as u64)
                .await
                .unwrap();
            assert!(
                got[..] == model[offset..offset + length],
                "read_bytes at {offset}"
            );
        }
    });
}

#[test]
fn zeros_written_into_absent_egroups_create_nothing() {
    let dir = tempfile::tempdir().unwrap();
    run_local(async {
        let store = ExtentStore::new(StdFs, config(&[dir.path()]));
        store.write(0, &vec![0u8; 1 << 20]).await.unwrap();
        store
            .write_zeroes(EGROUP_SPAN_BYTES, 3 << 20)
            .await
            .unwrap();
        assert_eq!(store.cached_egroups(), 0);
        assert!(!dir.path().join("extents").exists());
        let mut buf = vec![1u8; 8192];
        store.read(0, &mut buf).await.unwrap();
        assert!(buf.iter().all(|&b| b == 0));
        // Offsets beyond the largest vdisk are refused, not wrapped or panicked on.
        let far = u64::MAX - 10;
        assert!(matches!(
            store.read(far, &mut buf[..5]).await,
            Err(ExtentError::OutOfRange { .. })
        ));
        assert!(matches!(
            store.write(1 << 50, b"x").await,
            Err(ExtentError::OutOfRange { .. })
        ));
        assert!(matches!(
            store.allocation(far, 5).await,
            Err(ExtentError::OutOfRange { .. })
        ));
    });
}

#[test]
fn a_flipped_data_byte_is_reported_with_vdisk_offset_and_file() {
    let dir = tempfile::tempdir().unwrap();
    run_local(async {
        let data = pattern(3, 1 << 20);
        let store = ExtentStore::new(StdFs, config(&[dir.path()]));
        store.write(0, &data).await.unwrap();
        drop(store);
        let file = egroup_path(dir.path(), 0);
        let mut bytes = std::fs::read(&file).unwrap();
        let file_offset = 5 * 4096 + 4096 * 2;
        bytes[file_offset + 17] ^= 0x40; // data block 2 of extent 0
        std::fs::write(&file, bytes).unwrap();
        let store = ExtentStore::new(StdFs, config(&[dir.path()]));
        let mut block = vec![0u8; 4096];
        match store.read(8192, &mut block).await {
            Err(ExtentError::Corrupt {
                vdisk,
                offset,
                path,
                file_offset: at,
                ..
            }) => {
                assert_eq!(vdisk, VdiskId(7));
                assert_eq!(offset, 8192);
                assert_eq!(path, file);
                assert_eq!(at, file_offset as u64);
            }
            other => panic!("expected Corrupt, got {other:?}"),
        }
        store.read(4096, &mut block).await.unwrap();
        assert_eq!(block, data[4096..8192]);
        // A full overwrite replaces the corrupt block.
        let fresh = pattern(4, 4096);
        store.write(8192, &fresh).await.unwrap();
        store.read(8192, &mut block).await.unwrap();
        assert_eq!(block, fresh);
    });
}

#[test]
fn egroups_spread_over_disks_are_found_again_and_removed() {
    let one = tempfile::tempdir().unwrap();
    let two = tempfile::tempdir().unwrap();
    run_local(async {
        let disks = [one.path(), two.path()];
        let store = ExtentStore::new(StdFs, config(&disks));
        let data = pattern(9, 4096 * 3);
        for egroup in 0..6u64 {
            store
                .write(egroup * EGROUP_SPAN_BYTES + 4096, &data)
                .await
                .unwrap();
        }
        drop(store);
        let store = ExtentStore::new(StdFs, config(&disks));
        let mut got = vec![0u8; data.len()];
        for egroup in 0..6u64 {
            store
                .read(egroup * EGROUP_SPAN_BYTES + 4096, &mut got)
                .await
                .unwrap();
            assert_eq!(got, data, "egroup {egroup}");
        }
        assert_eq!(store.cached_egroups(), 6);
        let all: Vec<Disk> = disks.iter().map(|d| disk(d)).collect();
        let used = vdisk_bytes_used(&StdFs, &all, VdiskId(7)).await.unwrap();
        assert_eq!(used, 6 * (5 * 4096 + 3 * 4096));
        drop(store);
        remove_vdisk_data(&StdFs, &all, VdiskId(7)).await.unwrap();
        assert_eq!(vdisk_bytes_used(&StdFs, &all, VdiskId(7)).await.unwrap(), 0);
        let store = ExtentStore::new(StdFs, config(&disks));
        store.read(4096, &mut got).await.unwrap();
        assert!(got.iter().all(|&b| b == 0));
        assert_eq!(store.cached_egroups(), 0);
    });
}

/// A disk that fails every sync (a dying disk) must still serve reads of what it holds: a
/// fresh store's listing tries to sync its directories, and that failure is the writes'
/// business, not the reads'. Writes fail with EIO, then succeed once the disk is healthy.
#[test]
fn reads_survive_a_disk_whose_syncs_fail_and_writes_resume_after() {
    use ashlar_storage::fs::sim::Times;
    use ashlar_storage::fs::{Filesystem, IoMode, SimFs};
    run_local(async {
        let fs = SimFs::new(IoMode::Buffered);
        let root = Path::new("/disk0");
        fs.create_dir_all(root).await.unwrap();
        let data = pattern(3, 64 << 10);
        let store = ExtentStore::new(fs.clone(), config(&[root]));
        store.write(1 << 20, &data).await.unwrap();
        drop(store);

        fs.fail_syncs(None, Times::Always);
        let fresh = ExtentStore::new(fs.clone(), config(&[root]));
        let mut back = vec![0u8; data.len()];
        fresh.read(1 << 20, &mut back).await.unwrap();
        assert!(back == data, "read through a disk failing syncs differs");
        let error = fresh.write(0, &data).await.unwrap_err();
        assert!(
            error.to_string().contains("Input/output error"),
            "a write on a disk failing syncs reports EIO: {error}"
        );

        fs.clear_failures();
        fresh.write(0, &data).await.unwrap();
        let mut first = vec![0u8; data.len()];
        fresh.read(0, &mut first).await.unwrap();
        assert!(first == data, "a write after the disk recovered reads back");
    });
}

//! Extent store corruption handling on real files: damaged checksum blocks, block states,
//! headers and data blocks are typed errors naming the file and offset, never zeros; the rest
//! of the store keeps serving; poisoned blocks, torn-block healing and lost ranges.

mod extent_store_support;

use ashlar_core::VdiskId;
use ashlar_storage::disk::{Disk, Tier};
use ashlar_storage::extent_store::{
    ExtentError, ExtentStore, ExtentStoreConfig, EGROUP_SPAN_BYTES, READ_NEW_MIN_BYTES,
};
use ashlar_storage::fs::StdFs;
use extent_store_support::{pattern, run_local};
use std::path::{Path, PathBuf};

const MIB: u64 = 1 << 20;
const ENTRY_BYTES: usize = 12;

fn config(dir: &Path) -> ExtentStoreConfig {
    ExtentStoreConfig {
        vdisk: VdiskId(7),
        disks: vec![Disk {
            path: dir.to_path_buf(),
            tier: Tier::Fast,
        }],
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

fn table_offset(extent: usize) -> usize {
    4096 * (1 + extent)
}

fn data_offset(extent: usize, block: usize) -> usize {
    4096 * (5 + 256 * extent + block)
}

fn edit(path: &Path, f: impl FnOnce(&mut Vec<u8>)) {
    let mut bytes = std::fs::read(path).unwrap();
    f(&mut bytes);
    std::fs::write(path, bytes).unwrap();
}

/// Recomputes a metadata block's CRC (its last 4 bytes) after an edit.
fn reseal(bytes: &mut [u8], block_at: usize) {
    let crc = crc32c::crc32c(&bytes[block_at..block_at + 4092]);
    bytes[block_at + 4092..block_at + 4096].copy_from_slice(&crc.to_le_bytes());
}

/// Reads through both of the store's read paths, which must agree: `read` into the caller's
/// buffer and `read_bytes` (the data path's). The range is also read whole, widened to the
/// `READ_NEW_MIN_BYTES`-aligned span around it, where `read_bytes` has the disk read land in
/// a buffer of its own: the same damage must give the same error there.
async fn read(
    store: &ExtentStore<StdFs>,
    offset: u64,
    length: usize,
) -> Result<Vec<u8>, ExtentError> {
    let wide_start = offset / READ_NEW_MIN_BYTES * READ_NEW_MIN_BYTES;
    let wide_end = (offset + length as u64).div_ceil(READ_NEW_MIN_BYTES) * READ_NEW_MIN_BYTES;
    for (at, len) in [(wide_start, wide_end - wide_start), (offset, length as u64)] {
        let mut buf = vec![0u8; len as usize];
        let copied = store.read(at, &mut buf).await.map(|()| buf);
        let owned = store.read_bytes(at, len).await;
        match (&copied, &owned) {
            (Ok(a), Ok(b)) => assert!(a[..] == b[..], "read and read_bytes differ at {at}"),
            (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string()),
            _ => panic!("read and read_bytes disagree at {at}: {copied:?} against {owned:?}"),
        }
    }
    let mut buf = vec![0u8; length];
    store.read(offset, &mut buf).await.map(|()| buf)
}

/// Three egroups with data in every extent of egroup 0.
async fn populate(dir: &Path) -> Vec<u8> {
    let store = ExtentStore::new(StdFs, config(dir));
    let data = pattern(1, 3 * EGROUP_SPAN_BYTES as usize);
    store.write(0, &data).await.unwrap();
    data
}

#[test]
fn a_flipped_checksum_block_byte_fails_only_its_extent() {
    let dir = tempfile::tempdir().unwrap();
    run_local(async {
        let data = populate(dir.path()).await;
        let file = egroup_path(dir.path(), 0);
        edit(&file, |b| b[table_offset(1) + 5 * ENTRY_BYTES + 6] ^= 0x01); // a CRC slot
        let store = ExtentStore::new(StdFs, config(dir.path()));
        match read(&store, MIB + 8192, 4096).await {
            Err(ExtentError::BadChecksumBlock {
                path,
                file_offset,
                offset,
                reason,
                ..
            }) => {
                assert_eq!(path, file);
                assert_eq!(file_offset, table_offset(1) as u64);
                assert_eq!(offset, MIB + 8192);
                assert!(reason.contains("checksum"), "{reason}");
            }
            other => panic!("expected BadChecksumBlock, got {other:?}"),
        }
        // The other extents of the egroup and the other egroups are served.
        for (offset, length) in [(0, MIB), (2 * MIB, 2 * MIB), (EGROUP_SPAN_BYTES, MIB)] {
            let got = read(&store, offset, length as usize).await.unwrap();
            assert!(got == data[offset as usize..(offset + length) as usize]);
        }
        assert!(store.allocation(MIB, 4096).await.unwrap() == vec![(4096, true)]);
    });
}

#[test]
fn a_flipped_block_state_is_an_error_never_zeros() {
    let dir = tempfile::tempdir().unwrap();
    run_local(async {
        populate(dir.path()).await;
        let file = egroup_path(dir.path(), 0);
        // Written (1) -> hole (0): v1 served zeros for this block.
        edit(&file, |b| b[table_offset(0) + 3 * ENTRY_BYTES] = 0);
        let store = ExtentStore::new(StdFs, config(dir.path()));
        let err = read(&store, 3 * 4096, 4096).await.unwrap_err();
        assert!(
            matches!(&err, ExtentError::BadChecksumBlock { path, file_offset, .. }
                if *path == file && *file_offset == table_offset(0) as u64),
            "{err:?}"
        );
        assert!(err.is_corruption());
    });
}

#[test]
fn an_unknown_block_state_with_a_valid_checksum_is_still_rejected() {
    let dir = tempfile::tempdir().unwrap();
    run_local(async {
        populate(dir.path()).await;
        let file = egroup_path(dir.path(), 0);
        edit(&file, |b| {
            b[table_offset(2) + 7 * ENTRY_BYTES] = 9;
            reseal(b, table_offset(2));
        });
        let store = ExtentStore::new(StdFs, config(dir.path()));
        match read(&store, 2 * MIB, 4096).await {
            Err(ExtentError::BadChecksumBlock { reason, .. }) => {
                assert!(reason.contains("block 7 has unknown state 9"), "{reason}")
            }
            other => panic!("expected BadChecksumBlock, got {other:?}"),
        }
    });
}

#[test]
fn writing_into_a_damaged_extent_keeps_its_other_blocks_unreadable() {
    let dir = tempfile::tempdir().unwrap();
    run_local(async {
        let data = populate(dir.path()).await;
        let file = egroup_path(dir.path(), 0);
        edit(&file, |b| b[table_offset(0) + 100] ^= 0xff);
        let store = ExtentStore::new(StdFs, config(dir.path()));
        // A write (the oplog draining) is not wedged by the damage...
        let fresh = pattern(2, 4096);
        store.write(4096, &fresh).await.unwrap();
        assert_eq!(read(&store, 4096, 4096).await.unwrap(), fresh);
        // ...and the blocks whose checksums were lost stay errors, now durably "lost".
        drop(store);
        let store = ExtentStore::new(StdFs, config(dir.path()));
        assert_eq!(read(&store, 4096, 4096).await.unwrap(), fresh);
        assert!(matches!(
            read(&store, 0, 4096).await,
            Err(ExtentError::Lost { offset: 0, .. })
        ));
        let other = read(&store, MIB, MIB as usize).await.unwrap();
        assert!(other == data[MIB as usize..2 * MIB as usize]);
    });
}

#[test]
fn a_bad_header_fails_its_egroup_only() {
    let dir = tempfile::tempdir().unwrap();
    run_local(async {
        let data = populate(dir.path()).await;
        let file = egroup_path(dir.path(), 1);
        edit(&file, |b| b[30] ^= 0x10);
        let store = ExtentStore::new(StdFs, config(dir.path()));
        for offset in [EGROUP_SPAN_BYTES, EGROUP_SPAN_BYTES + 3 * MIB + 5] {
            match read(&store, offset, 10).await {
                Err(ExtentError::BadHeader { path, reason, .. }) => {
                    assert_eq!(path, file);
                    assert!(reason.contains("checksum"), "{reason}");
                }
                other => panic!("expected BadHeader, got {other:?}"),
            }
        }
        let first = read(&store, 0, EGROUP_SPAN_BYTES as usize).await.unwrap();
        assert!(first == data[..EGROUP_SPAN_BYTES as usize]);
        let third = read(&store, 2 * EGROUP_SPAN_BYTES, MIB as usize)
            .await
            .unwrap();
        assert!(third == data[2 * EGROUP_SPAN_BYTES as usize..][..MIB as usize]);
        // Writing into it rewrites the header; the rest of it reads as lost, not as data.
        let fresh = pattern(5, 4096);
        store.write(EGROUP_SPAN_BYTES, &fresh).await.unwrap();
        drop(store);
        let store = ExtentStore::new(StdFs, config(dir.path()));
        assert_eq!(read(&store, EGROUP_SPAN_BYTES, 4096).await.unwrap(), fresh);
        assert!(matches!(
            read(&store, EGROUP_SPAN_BYTES + 4096, 4096).await,
            Err(ExtentError::Lost { .. })
        ));
    });
}

#[test]
fn a_torn_creation_is_reinitialized_not_an_error() {
    let dir = tempfile::tempdir().unwrap();
    run_local(async {
        populate(dir.path()).await;
        // A creation cut short: the file exists, its metadata never reached the disk.
        let file = egroup_path(dir.path(), 5);
        std::fs::write(&file, vec![0u8; 5 * 4096]).unwrap();
        let half = egroup_path(dir.path(), 6);
        std::fs::write(&half, vec![0u8; 4096]).unwrap();
        let store = ExtentStore::new(StdFs, config(dir.path()));
        assert!(read(&store, 5 * EGROUP_SPAN_BYTES, 8192)
            .await
            .unwrap()
            .iter()
            .all(|&b| b == 0));
        let fresh = pattern(6, 8192);
        store
            .write(5 * EGROUP_SPAN_BYTES + 4096, &fresh)
            .await
            .unwrap();
        store.write(6 * EGROUP_SPAN_BYTES, &fresh).await.unwrap();
        drop(store);
        let store = ExtentStore::new(StdFs, config(dir.path()));
        assert_eq!(
            read(&store, 5 * EGROUP_SPAN_BYTES + 4096, 8192)
                .await
                .unwrap(),
            fresh
        );
        assert_eq!(
            read(&store, 6 * EGROUP_SPAN_BYTES, 8192).await.unwrap(),
            fresh
        );
        assert!(read(&store, 5 * EGROUP_SPAN_BYTES, 4096)
            .await
            .unwrap()
            .iter()
            .all(|&b| b == 0));
    });
}

#[test]
fn a_partial_write_into_a_corrupt_block_poisons_it_until_fully_rewritten() {
    let dir = tempfile::tempdir().unwrap();
    run_local(async {
        populate(dir.path()).await;
        let file = egroup_path(dir.path(), 0);
        edit(&file, |b| b[data_offset(0, 4) + 3000] ^= 0x08);
        let store = ExtentStore::new(StdFs, config(dir.path()));
        store.write(4 * 4096 + 10, b"partial").await.unwrap();
        for _ in 0..2 {
            match read(&store, 4 * 4096, 4096).await {
                Err(ExtentError::Poisoned {
                    offset,
                    path,
                    file_offset,
                    ..
                }) => {
                    assert_eq!(offset, 4 * 4096);
                    assert_eq!(path, file);
                    assert_eq!(file_offset, data_offset(0, 4) as u64);
                }
                other => panic!("expected Poisoned, got {other:?}"),
            }
            // Another partial write does not make it readable either, across a reopen.
            store.write(4 * 4096 + 100, b"more").await.unwrap();
        }
        drop(store);
        let store = ExtentStore::new(StdFs, config(dir.path()));
        assert!(matches!(
            read(&store, 4 * 4096, 1).await,
            Err(ExtentError::Poisoned { .. })
        ));
        let fresh = pattern(7, 4096);
        store.write(4 * 4096, &fresh).await.unwrap();
        assert_eq!(read(&store, 4 * 4096, 4096).await.unwrap(), fresh);
    });
}

#[test]
fn a_torn_block_is_healed_by_rewriting_the_interrupted_partial_write() {
    let dir = tempfile::tempdir().unwrap();
    run_local(async {
        let old = pattern(1, 4096);
        let patch = pattern(2, 900);
        let mut new = old.clone();
        new[100..1000].copy_from_slice(&patch);
        let store = ExtentStore::new(StdFs, config(dir.path()));
        store.write(0, &old).await.unwrap();
        store.write(100, &patch).await.unwrap(); // the slots now hold CRC(old) and CRC(new)
        drop(store);
        // The interrupted write tore the block: its first sector is still the old one.
        let file = egroup_path(dir.path(), 0);
        let at = data_offset(0, 0);
        edit(&file, |b| b[at..at + 512].copy_from_slice(&old[..512]));
        let store = ExtentStore::new(StdFs, config(dir.path()));
        assert!(matches!(
            read(&store, 0, 4096).await,
            Err(ExtentError::Corrupt { .. })
        ));
        // The oplog re-drains the record: merged over the torn bytes it is exactly `new`.
        store.write(100, &patch).await.unwrap();
        assert_eq!(read(&store, 0, 4096).await.unwrap(), new);
        drop(store);
        let store = ExtentStore::new(StdFs, config(dir.path()));
        assert_eq!(read(&store, 0, 4096).await.unwrap(), new);
        // A partial write elsewhere in a torn block cannot be checked: the block is poisoned.
        edit(&file, |b| b[at..at + 512].copy_from_slice(&old[..512]));
        let store = ExtentStore::new(StdFs, config(dir.path()));
        store.write(3000, b"elsewhere").await.unwrap();
        assert!(matches!(
            read(&store, 0, 4096).await,
            Err(ExtentError::Poisoned { .. })
        ));
    });
}

#[test]
fn lost_ranges_read_as_lost_until_rewritten() {
    let dir = tempfile::tempdir().unwrap();
    run_local(async {
        let data = populate(dir.path()).await;
        let store = ExtentStore::new(StdFs, config(dir.path()));
        // Partial blocks at both edges are lost too; an absent egroup records the loss.
        store.mark_lost(4096 + 100, 3 * 4096).await.unwrap();
        store
            .mark_lost(9 * EGROUP_SPAN_BYTES + 10, 10)
            .await
            .unwrap();
        drop(store);
        let store = ExtentStore::new(StdFs, config(dir.path()));
        let file = egroup_path(dir.path(), 0);
        for block in 1..=4u64 {
            match read(&store, block * 4096 + 7, 1).await {
                Err(ExtentError::Lost {
                    offset,
                    path,
                    file_offset,
                    ..
                }) => {
                    assert_eq!(offset, block * 4096);
                    assert_eq!(path, file);
                    assert_eq!(file_offset, data_offset(0, block as usize) as u64);
                }
                other => panic!("block {block}: expected Lost, got {other:?}"),
            }
        }
        assert_eq!(read(&store, 0, 4096).await.unwrap(), data[..4096]);
        assert_eq!(
            read(&store, 5 * 4096, 4096).await.unwrap(),
            data[5 * 4096..6 * 4096]
        );
        assert!(matches!(
            read(&store, 9 * EGROUP_SPAN_BYTES, 4096).await,
            Err(ExtentError::Lost { .. })
        ));
        assert_eq!(
            store.allocation(9 * EGROUP_SPAN_BYTES, 4096).await.unwrap(),
            vec![(4096, true)]
        );
        // A partial write keeps it lost; a full write or a zeroing clears it.
        store.write(4096 + 5, b"xx").await.unwrap();
        assert!(matches!(
            read(&store, 4096, 4096).await,
            Err(ExtentError::Lost { .. })
        ));
        let fresh = pattern(8, 4096);
        store.write(4096, &fresh).await.unwrap();
        store.write_zeroes(2 * 4096, 4096).await.unwrap();
        assert_eq!(read(&store, 4096, 4096).await.unwrap(), fresh);
        assert!(read(&store, 2 * 4096, 4096)
            .await
            .unwrap()
            .iter()
            .all(|&b| b == 0));
        assert!(matches!(
            read(&store, 3 * 4096, 1).await,
            Err(ExtentError::Lost { .. })
        ));
    });
}

/// Bit rot under an open store (the data changed on disk after the store learnt which slot it
/// matches): rewriting the same content must really write it, or the damage would stay on
/// disk while the store believed the block intact (a repair from another copy does this).
#[test]
fn rewriting_a_block_damaged_under_an_open_store_repairs_it_on_disk() {
    let dir = tempfile::tempdir().unwrap();
    run_local(async {
        let store = ExtentStore::new(StdFs, config(dir.path()));
        let data = pattern(5, 16 * 4096);
        store.write(0, &data).await.unwrap();
        // Overwrite once, so the extent is normalized and its slots known to the store.
        store.write(0, &data).await.unwrap();
        let file = egroup_path(dir.path(), 0);
        edit(&file, |b| b[data_offset(0, 3) + 17] ^= 0x40);
        assert!(matches!(
            read(&store, 3 * 4096, 4096).await,
            Err(ExtentError::Corrupt { .. })
        ));
        store
            .write(3 * 4096, &data[3 * 4096..4 * 4096])
            .await
            .unwrap();
        assert_eq!(read(&store, 0, data.len()).await.unwrap(), data);
        let on_disk = std::fs::read(&file).unwrap();
        assert_eq!(
            on_disk[data_offset(0, 3)..data_offset(0, 4)],
            data[3 * 4096..4 * 4096],
            "the rewrite reached the disk"
        );
        drop(store);
        let store = ExtentStore::new(StdFs, config(dir.path()));
        assert_eq!(read(&store, 0, data.len()).await.unwrap(), data);
    });
}

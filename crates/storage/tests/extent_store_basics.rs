//! Extent store: round trips at any alignment, holes, persistence, corruption and torn writes.

use ashlar_core::VdiskId;
use ashlar_storage::disk::{Disk, FileIo, FileOpener, StdFile, StdOpener, Tier};
use ashlar_storage::extent_store::{ExtentError, ExtentStore, ExtentStoreConfig};
use std::cell::Cell;
use std::io;
use std::path::Path;
use std::rc::Rc;

fn config(dir: &Path) -> ExtentStoreConfig {
    ExtentStoreConfig {
        vdisk: VdiskId(7),
        disks: vec![Disk {
            path: dir.to_path_buf(),
            tier: Tier::Fast,
        }],
        max_open_egroups: 2,
    }
}

fn pattern(seed: u64, length: usize) -> Vec<u8> {
    (0..length)
        .map(|i| ((i as u64 * 31 + seed * 7) % 251) as u8)
        .collect()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn unaligned_writes_round_trip_across_boundaries_and_survive_reopen() {
    let dir = tempfile::tempdir().unwrap();
    runtime().block_on(async {
        let size = 12usize << 20;
        let mut model = vec![0u8; size];
        let store = ExtentStore::new(StdOpener, config(dir.path()));
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
        store.sync().await.unwrap();
        drop(store);
        let reopened = ExtentStore::new(StdOpener, config(dir.path()));
        let mut again = vec![0u8; size];
        reopened.read(0, &mut again).await.unwrap();
        assert!(again == model, "read after reopen differs from the model");
        // Holes: an untouched egroup and the zeroed middle are unallocated.
        let runs = reopened.allocation(0, size as u64).await.unwrap();
        assert_eq!(runs.iter().map(|r| r.0).sum::<u64>(), size as u64);
        assert!(runs.iter().any(|r| !r.1) && runs.iter().any(|r| r.1));
        let untouched = reopened.allocation(5 << 20, 1 << 20).await.unwrap();
        assert_eq!(untouched, vec![(1 << 20, false)]);
    });
}

#[test]
fn a_flipped_byte_is_reported_with_vdisk_offset_and_file() {
    let dir = tempfile::tempdir().unwrap();
    runtime().block_on(async {
        let store = ExtentStore::new(StdOpener, config(dir.path()));
        store.write(0, &pattern(3, 1 << 20)).await.unwrap();
        store.sync().await.unwrap();
        drop(store);
        let file = dir
            .path()
            .join("extents")
            .join(VdiskId(7).to_string())
            .join(format!("{:016x}.egroup", 0));
        let mut bytes = std::fs::read(&file).unwrap();
        bytes[5 * 4096 + 4096 * 2 + 17] ^= 0x40; // data block 2 of extent 0
        std::fs::write(&file, bytes).unwrap();
        let store = ExtentStore::new(StdOpener, config(dir.path()));
        let mut block = vec![0u8; 4096];
        match store.read(8192, &mut block).await {
            Err(ExtentError::Corrupt {
                vdisk,
                offset,
                path,
                ..
            }) => {
                assert_eq!(vdisk, VdiskId(7));
                assert_eq!(offset, 8192);
                assert_eq!(path, file);
            }
            other => panic!("expected Corrupt, got {other:?}"),
        }
        store.read(4096, &mut block).await.unwrap();
        assert_eq!(block, pattern(3, 1 << 20)[4096..8192]);
    });
}

/// Lets a fixed number of writes through, then fails the rest: a crash between two writes.
#[derive(Clone)]
struct CrashAfter {
    writes_left: Rc<Cell<usize>>,
}

struct CrashFile {
    inner: StdFile,
    writes_left: Rc<Cell<usize>>,
}

impl FileIo for CrashFile {
    async fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.inner.read_at(buf, offset).await
    }
    async fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        if self.writes_left.get() == 0 {
            return Err(io::Error::other("simulated crash"));
        }
        self.writes_left.set(self.writes_left.get() - 1);
        self.inner.write_at(buf, offset).await
    }
    async fn sync_data(&self) -> io::Result<()> {
        self.inner.sync_data().await
    }
    async fn punch_hole(&self, offset: u64, length: u64) -> io::Result<()> {
        self.inner.punch_hole(offset, length).await
    }
    fn path(&self) -> &Path {
        self.inner.path()
    }
}

impl FileOpener for CrashAfter {
    type File = CrashFile;
    fn open(&self, path: &Path, create: bool) -> io::Result<CrashFile> {
        Ok(CrashFile {
            inner: StdFile::open(path, create)?,
            writes_left: self.writes_left.clone(),
        })
    }
}

#[test]
fn a_crash_between_checksum_and_data_writes_leaves_the_old_data_readable() {
    let dir = tempfile::tempdir().unwrap();
    runtime().block_on(async {
        let old = pattern(1, 8192);
        let store = ExtentStore::new(StdOpener, config(dir.path()));
        store.write(0, &old).await.unwrap();
        store.sync().await.unwrap();
        drop(store);
        // Only the checksum-block write gets through; the data write "crashes".
        let crashing = ExtentStore::new(
            CrashAfter {
                writes_left: Rc::new(Cell::new(1)),
            },
            config(dir.path()),
        );
        assert!(crashing.write(0, &pattern(2, 8192)).await.is_err());
        drop(crashing);
        let store = ExtentStore::new(StdOpener, config(dir.path()));
        let mut got = vec![0u8; 8192];
        store.read(0, &mut got).await.unwrap();
        assert_eq!(got, old, "the torn write must leave the old data readable");
        // Later writes work (normalization picks the slot the data matches).
        let newer = pattern(3, 8192);
        store.write(0, &newer).await.unwrap();
        store.read(0, &mut got).await.unwrap();
        assert_eq!(got, newer);
        // And a second torn write after that still leaves `newer` readable.
        store.sync().await.unwrap();
        drop(store);
        let crashing = ExtentStore::new(
            CrashAfter {
                writes_left: Rc::new(Cell::new(1)),
            },
            config(dir.path()),
        );
        assert!(crashing.write(0, &pattern(4, 8192)).await.is_err());
        drop(crashing);
        let store = ExtentStore::new(StdOpener, config(dir.path()));
        store.read(0, &mut got).await.unwrap();
        assert_eq!(got, newer);
    });
}

//! Helpers shared by the oplog integration tests.
#![allow(dead_code)]

use ashlar_storage::disk::{FileIo, FileOpener, StdFile};
use ashlar_storage::oplog::{LogPiece, Oplog, OplogConfig, OplogError, PieceSource};
use bytes::Bytes;
use std::cell::Cell;
use std::future::Future;
use std::io;
use std::path::{Path, PathBuf};
use std::rc::Rc;

/// Runs a future on a current-thread runtime inside a `LocalSet`, as a reactor does.
pub fn run_local<F: Future>(future: F) -> F::Output {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    tokio::task::LocalSet::new().block_on(&runtime, future)
}

/// Deterministic bytes: different seeds give different contents.
pub fn pattern(seed: u64, length: usize) -> Bytes {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let bytes: Vec<u8> = (0..length)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 24) as u8
        })
        .collect();
    Bytes::from(bytes)
}

/// A file that counts `sync_data` calls and can be told to fail the next ones.
pub struct CountingFile {
    inner: StdFile,
    faults: Faults,
}

/// Shared counters and fault switches of a [`CountingOpener`].
#[derive(Clone, Default)]
pub struct Faults {
    pub syncs: Rc<Cell<usize>>,
    /// Number of upcoming `sync_data` calls that fail with EIO.
    pub fail_syncs: Rc<Cell<usize>>,
}

impl FileIo for CountingFile {
    async fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.inner.read_at(buf, offset).await
    }
    async fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.inner.write_at(buf, offset).await
    }
    async fn sync_data(&self) -> io::Result<()> {
        self.faults.syncs.set(self.faults.syncs.get() + 1);
        let fail = self.faults.fail_syncs.get();
        if fail > 0 {
            self.faults.fail_syncs.set(fail - 1);
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        self.inner.sync_data().await
    }
    async fn punch_hole(&self, offset: u64, length: u64) -> io::Result<()> {
        self.inner.punch_hole(offset, length).await
    }
    fn path(&self) -> &Path {
        self.inner.path()
    }
}

#[derive(Clone, Default)]
pub struct CountingOpener {
    pub faults: Faults,
}

impl FileOpener for CountingOpener {
    type File = CountingFile;
    fn open(&self, path: &Path, create: bool) -> io::Result<CountingFile> {
        Ok(CountingFile {
            inner: StdFile::open(path, create)?,
            faults: self.faults.clone(),
        })
    }
}

pub fn config(dir: &Path, capacity: u64, segment: u64) -> OplogConfig {
    OplogConfig {
        dir: dir.to_path_buf(),
        capacity_bytes: capacity,
        segment_bytes: segment,
        max_commit_batch_bytes: 4 << 20,
    }
}

/// Bytes of a 4 KiB write record: header, one CRC, payload.
pub const RECORD_4K: u64 = 40 + 4 + 4096;

/// What one byte of the vdisk reads as, according to the oplog.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogByte {
    Absent,
    Zero,
    Data(u8),
}

/// Looks up and reads `[offset, offset+length)`, byte by byte.
pub async fn read_log<O: FileOpener + 'static>(
    oplog: &Oplog<O>,
    offset: u64,
    length: u64,
) -> Result<Vec<LogByte>, OplogError> {
    let pieces = oplog.lookup(offset, length);
    check_exact_cover(&pieces, offset, length);
    let mut out = Vec::with_capacity(length as usize);
    for piece in &pieces {
        let mut buf = vec![0xA5u8; piece.length as usize];
        oplog.read_piece(piece, &mut buf).await?;
        match piece.source {
            PieceSource::Data { .. } => out.extend(buf.iter().map(|&b| LogByte::Data(b))),
            PieceSource::Zero => {
                assert!(buf.iter().all(|&b| b == 0), "zero piece not zeroed");
                out.extend(std::iter::repeat_n(LogByte::Zero, buf.len()));
            }
            PieceSource::Absent => {
                assert!(
                    buf.iter().all(|&b| b == 0xA5),
                    "absent piece touched the buffer"
                );
                out.extend(std::iter::repeat_n(LogByte::Absent, buf.len()));
            }
        }
    }
    Ok(out)
}

/// Reads `[offset, offset+length)` and expects it all to be data.
pub async fn read_data<O: FileOpener + 'static>(
    oplog: &Oplog<O>,
    offset: u64,
    length: u64,
) -> Vec<u8> {
    read_log(oplog, offset, length)
        .await
        .expect("read")
        .into_iter()
        .map(|b| match b {
            LogByte::Data(b) => b,
            other => panic!("expected data, found {other:?}"),
        })
        .collect()
}

/// Lookups return pieces covering the range exactly, in order, none empty.
pub fn check_exact_cover(pieces: &[LogPiece], offset: u64, length: u64) {
    let mut at = offset;
    for piece in pieces {
        assert_eq!(piece.offset, at, "pieces must be contiguous: {pieces:?}");
        assert!(piece.length > 0, "empty piece: {pieces:?}");
        at += piece.length;
    }
    assert_eq!(
        at,
        offset + length,
        "pieces must cover the range: {pieces:?}"
    );
}

/// Segment files in the directory, oldest first (spare files not included).
pub fn segment_files(dir: &Path) -> Vec<PathBuf> {
    oplog_files(dir, false)
}

/// Spare files (freed segments kept for reuse) in the directory.
pub fn spare_files(dir: &Path) -> Vec<PathBuf> {
    oplog_files(dir, true)
}

fn oplog_files(dir: &Path, spares: bool) -> Vec<PathBuf> {
    let is_spare = |p: &Path| {
        p.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("spare-"))
    };
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("read dir")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "oplog") && is_spare(p) == spares)
        .collect();
    files.sort();
    files
}

/// First sequence numbers of the segment files.
pub fn segment_ids(dir: &Path) -> Vec<u64> {
    segment_files(dir)
        .iter()
        .map(|p| {
            p.file_stem()
                .and_then(|s| s.to_str())
                .and_then(|s| s.parse().ok())
                .expect("segment name")
        })
        .collect()
}

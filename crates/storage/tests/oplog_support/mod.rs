//! Helpers shared by the oplog integration tests.
#![allow(dead_code)]

pub mod memfs;

#[allow(unused_imports)]
pub use memfs::{FaultOp, MemFs, OpKind, Rng};

use ashlar_storage::fs::Filesystem;
use ashlar_storage::oplog::{
    DrainKind, LogPiece, Oplog, OplogConfig, OplogError, PieceSource, ReplayReport,
};
use bytes::Bytes;
use std::collections::BTreeMap;
use std::future::Future;
use std::path::{Path, PathBuf};

/// The fault-injecting filesystem the tests run on. (`fs::sim::SimFs` replaces `MemFs` here
/// once it lands.)
pub type TestFs = MemFs;

/// The log directory the tests use on a `TestFs`.
pub fn log_dir() -> PathBuf {
    PathBuf::from("/fast/oplog/log")
}

pub const LOG_ID: u64 = 0x0A51_A400_0000_0001;

/// Runs a future on a current-thread runtime inside a `LocalSet`, as a reactor does.
pub fn run_local<F: Future>(future: F) -> F::Output {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    tokio::task::LocalSet::new().block_on(&runtime, future)
}

/// Polls `future` once: its output if it is ready, else `None` (the future is dropped).
pub async fn poll_once<F: Future>(future: F) -> Option<F::Output> {
    let mut future = std::pin::pin!(future);
    std::future::poll_fn(|cx| {
        std::task::Poll::Ready(match future.as_mut().poll(cx) {
            std::task::Poll::Ready(output) => Some(output),
            std::task::Poll::Pending => None,
        })
    })
    .await
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

/// Bytes of a segment holding `batches` batches of one 4 KiB write each (8 KiB per batch),
/// beside its 8 KiB header and the 4 KiB kept free for a seal.
pub fn segment_for_batches(batches: u64) -> u64 {
    8192 + batches * 8192 + 4096
}

/// A small configuration: `segment` bytes per segment, room for `capacity / segment`
/// segments, batches of up to 64 KiB (or what the segment allows), 4 in flight, drains that
/// gather and forget their entries two per turn (so every drain runs across several turns).
pub fn config(dir: &Path, capacity: u64, segment: u64) -> OplogConfig {
    OplogConfig {
        dir: dir.to_path_buf(),
        log_id: LOG_ID,
        capacity_bytes: capacity,
        segment_bytes: segment,
        max_batch_bytes: (64 << 10).min(segment - 12 * 1024),
        max_batches_in_flight: 4,
        max_spare_segments: usize::MAX,
        replay_reach_granule_bytes: 4096,
        drain_index_entries_per_turn: 2,
    }
}

/// Opens a log and expects a clean replay (nothing lost, nothing repaired).
pub async fn open_clean<F: Filesystem>(fs: &F, config: OplogConfig) -> Oplog<F> {
    let (oplog, report) = Oplog::open(fs.clone(), config).await.expect("open");
    assert!(report.lost.is_empty(), "unexpected losses: {report:?}");
    assert!(report.repaired.is_empty(), "unexpected damage: {report:?}");
    oplog
}

/// Opens a log and returns its replay report.
pub async fn open_report<F: Filesystem>(fs: &F, config: OplogConfig) -> (Oplog<F>, ReplayReport) {
    Oplog::open(fs.clone(), config).await.expect("open")
}

/// What one byte of the vdisk reads as, according to the oplog.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogByte {
    Absent,
    Zero,
    Data(u8),
    Lost,
}

/// Looks up and reads `[offset, offset+length)`, byte by byte (lost pieces as `Lost`).
pub async fn read_log<F: Filesystem>(
    oplog: &Oplog<F>,
    offset: u64,
    length: u64,
) -> Result<Vec<LogByte>, OplogError> {
    let pieces = oplog.lookup(offset, length);
    check_exact_cover(&pieces, offset, length);
    // The allocation-free question every read asks first must agree with the full answer.
    assert_eq!(
        oplog.holds_any_of(offset, length),
        pieces
            .iter()
            .any(|p| !matches!(p.source, PieceSource::Absent)),
        "holds_any_of disagrees with lookup over [{offset}, +{length})"
    );
    let mut out = Vec::with_capacity(length as usize);
    for piece in &pieces {
        let mut buf = vec![0xA5u8; piece.length as usize];
        let result = oplog.read_piece(piece, &mut buf).await;
        match piece.source {
            PieceSource::Data { .. } => {
                result?;
                out.extend(buf.iter().map(|&b| LogByte::Data(b)));
            }
            PieceSource::Zero => {
                result?;
                assert!(buf.iter().all(|&b| b == 0), "zero piece not zeroed");
                out.extend(std::iter::repeat_n(LogByte::Zero, buf.len()));
            }
            PieceSource::Absent => {
                result?;
                assert!(
                    buf.iter().all(|&b| b == 0xA5),
                    "absent piece touched the buffer"
                );
                out.extend(std::iter::repeat_n(LogByte::Absent, buf.len()));
            }
            PieceSource::Lost { .. } => {
                match result {
                    Err(OplogError::Lost { offset, length, .. }) => {
                        assert_eq!((offset, length), (piece.offset, piece.length));
                    }
                    other => panic!("a lost piece read as {other:?}"),
                }
                out.extend(std::iter::repeat_n(LogByte::Lost, buf.len()));
            }
        }
    }
    Ok(out)
}

/// Reads `[offset, offset+length)` and expects it all to be data.
pub async fn read_data<F: Filesystem>(oplog: &Oplog<F>, offset: u64, length: u64) -> Vec<u8> {
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

/// What the drains moved to the "extent store": byte values, or lost bytes.
#[derive(Default)]
pub struct Store {
    pub bytes: BTreeMap<u64, u8>,
    pub lost: BTreeMap<u64, ()>,
}

impl Store {
    pub fn get(&self, at: u64) -> Option<u8> {
        self.bytes.get(&at).copied()
    }
}

/// Simulates the engine's drain into a byte-map "extent store": copies data and zero items,
/// records lost ones. Returns how many items it drained.
pub async fn drain_into<F: Filesystem>(
    oplog: &Oplog<F>,
    store: &mut Store,
    max_bytes: u64,
) -> usize {
    let items = oplog.drain_batch(max_bytes).await;
    for item in &items {
        match oplog.read_drain_item(item).await {
            Ok(data) => {
                assert_ne!(item.kind, DrainKind::Lost);
                assert_eq!(data.len() as u64, item.length);
                if item.kind == DrainKind::Zero {
                    assert!(data.iter().all(|&b| b == 0));
                }
                for (i, b) in data.iter().enumerate() {
                    store.bytes.insert(item.offset + i as u64, *b);
                    store.lost.remove(&(item.offset + i as u64));
                }
            }
            Err(error) => {
                let (offset, length) = error.lost_range().expect("only lost ranges fail");
                assert_eq!((offset, length), (item.offset, item.length));
                for at in offset..offset + length {
                    store.bytes.remove(&at);
                    store.lost.insert(at, ());
                }
            }
        }
    }
    oplog.complete_drain(&items).await;
    items.len()
}

/// Drains until the log is empty, then lets it free what it can.
pub async fn drain_all<F: Filesystem>(oplog: &Oplog<F>, store: &mut Store) {
    while drain_into(oplog, store, u64::MAX).await > 0 {}
    oplog.idle().await;
}

//! `AckedWriter`: a verifying NBD writer for cluster scenarios. Worker threads write
//! self-describing blocks (`writes::pattern`: offset and sequence number in every 16 bytes) at
//! random offsets of a region, one request in flight each, and record every acknowledged
//! write. A write whose reply never came (node killed, link cut, error) is recorded as
//! uncertain; the worker then reconnects, to whatever address the test points the writer at
//! now (`retarget`), and goes on. `finish` stops the workers; `AckLog::verify` reads the
//! region back and checks that every block holds its newest acknowledged write or a write
//! issued after it that was never acknowledged, and nothing else.
//!
//! Each worker owns a slice of the region, so no two requests in flight overlap and the
//! outcome never depends on how the server orders concurrent writes.

use crate::common::nbd::NbdConn;
use crate::common::writes::{describe_block, pattern, BLOCK};
use crate::common::{Rng, MIB};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Socket deadline of the writer's connections: a request to a cut-off node fails after this.
const IO_DEADLINE: Duration = Duration::from_secs(5);

/// What is known of one 4 KiB block.
#[derive(Clone, Debug, Default)]
pub struct BlockRecord {
    /// The newest acknowledged write (its sequence number).
    pub acked: Option<u64>,
    /// Writes issued after `acked` whose reply never came: any of them may have landed.
    pub uncertain: Vec<u64>,
}

/// Everything the writer did, for `verify`.
pub struct AckLog {
    pub blocks: Vec<BlockRecord>,
    pub acked_writes: u64,
    /// Writes that failed or got no reply (each followed by a reconnect).
    pub uncertain_writes: u64,
    pub reconnects: u64,
}

struct Shared {
    target: Mutex<SocketAddr>,
    stop: AtomicBool,
    blocks: Mutex<Vec<BlockRecord>>,
    acked: AtomicU64,
    uncertain: AtomicU64,
    reconnects: AtomicU64,
    /// The latest connection or write error, for messages.
    last_error: Mutex<String>,
}

pub struct AckedWriter {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
}

impl AckedWriter {
    /// Starts `workers` threads writing to `vdisk` at `target` over `[0, region)` (a multiple
    /// of `workers` × 64 KiB), with writes of 4, 16 or 64 KiB aligned to their size.
    pub fn start(target: SocketAddr, vdisk: &str, region: u64, workers: u64) -> AckedWriter {
        let slice = region / workers;
        assert!(
            slice > 0 && slice.is_multiple_of(64 * 1024) && slice * workers == region,
            "region {region} must split into {workers} slices of whole 64 KiB"
        );
        let shared = Arc::new(Shared {
            target: Mutex::new(target),
            stop: AtomicBool::new(false),
            blocks: Mutex::new(vec![BlockRecord::default(); (region / BLOCK) as usize]),
            acked: AtomicU64::new(0),
            uncertain: AtomicU64::new(0),
            reconnects: AtomicU64::new(0),
            last_error: Mutex::new(String::new()),
        });
        let workers = (0..workers)
            .map(|w| {
                let shared = shared.clone();
                let vdisk = vdisk.to_string();
                std::thread::spawn(move || worker(&shared, &vdisk, w, w * slice, slice))
            })
            .collect();
        AckedWriter { shared, workers }
    }

    /// Points the reconnects of the workers at another node.
    pub fn retarget(&self, target: SocketAddr) {
        *self.shared.target.lock().unwrap() = target;
    }

    pub fn acked_writes(&self) -> u64 {
        self.shared.acked.load(Ordering::SeqCst)
    }

    pub fn uncertain_writes(&self) -> u64 {
        self.shared.uncertain.load(Ordering::SeqCst)
    }

    /// Waits until `more` writes beyond those acknowledged now are acknowledged; panics with
    /// the writer's latest error after `limit`.
    pub fn wait_for_acks(&self, more: u64, limit: Duration) {
        let goal = self.acked_writes() + more;
        let start = Instant::now();
        while self.acked_writes() < goal {
            assert!(
                start.elapsed() < limit,
                "the writer got {} of {goal} acknowledgements within {limit:?}; last error: {}",
                self.acked_writes(),
                self.shared.last_error.lock().unwrap()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops the workers (a request in flight completes or times out first) and returns the
    /// record.
    pub fn finish(mut self) -> AckLog {
        self.shared.stop.store(true, Ordering::SeqCst);
        for worker in self.workers.drain(..) {
            worker.join().expect("a writer thread panicked");
        }
        AckLog {
            blocks: self.shared.blocks.lock().unwrap().clone(),
            acked_writes: self.acked_writes(),
            uncertain_writes: self.uncertain_writes(),
            reconnects: self.shared.reconnects.load(Ordering::SeqCst),
        }
    }
}

impl Drop for AckedWriter {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

fn connect(shared: &Shared, vdisk: &str) -> Option<NbdConn> {
    while !shared.stop.load(Ordering::SeqCst) {
        let target = *shared.target.lock().unwrap();
        match NbdConn::connect(target, vdisk) {
            Ok(conn) => {
                let _ = conn.stream.set_read_timeout(Some(IO_DEADLINE));
                let _ = conn.stream.set_write_timeout(Some(IO_DEADLINE));
                return Some(conn);
            }
            Err(e) => {
                *shared.last_error.lock().unwrap() = format!("connecting to {target}: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
    None
}

/// One worker: writes to `[base, base + len)` until told to stop.
fn worker(shared: &Shared, vdisk: &str, seed: u64, base: u64, len: u64) {
    const SIZES: [u64; 3] = [4096, 16384, 65536];
    let mut rng = Rng::new(seed + 1);
    // Sequence numbers are unique across workers: worker w uses w, w + 2^48, ...
    let mut seq = seed << 48;
    let mut conn = None;
    while !shared.stop.load(Ordering::SeqCst) {
        if conn.is_none() {
            conn = connect(shared, vdisk);
            if conn.is_none() {
                return;
            }
        }
        let size = SIZES[rng.below(3) as usize];
        let offset = base + rng.below(len / size) * size;
        let (first, count) = ((offset / BLOCK) as usize, (size / BLOCK) as usize);
        seq += 1;
        let data = pattern(offset, seq, size as usize);
        let result = conn.as_mut().unwrap().write(offset, &data);
        let mut blocks = shared.blocks.lock().unwrap();
        for block in &mut blocks[first..first + count] {
            if let Ok(0) = result {
                block.acked = Some(seq);
                block.uncertain.clear();
            } else {
                block.uncertain.push(seq);
            }
        }
        drop(blocks);
        match result {
            Ok(0) => {
                shared.acked.fetch_add(1, Ordering::SeqCst);
            }
            failed => {
                *shared.last_error.lock().unwrap() =
                    format!("write [{offset}, +{size}) seq {seq}: {failed:?}");
                shared.uncertain.fetch_add(1, Ordering::SeqCst);
                shared.reconnects.fetch_add(1, Ordering::SeqCst);
                conn = None;
            }
        }
    }
}

impl AckLog {
    /// Reads the region back from `vdisk` at `addr` and panics, naming the first bad blocks,
    /// unless every block holds its newest acknowledged write (zeros if none) or one of the
    /// unacknowledged writes issued after it.
    pub fn verify(&self, addr: SocketAddr, vdisk: &str) {
        let mut conn = NbdConn::connect(addr, vdisk)
            .unwrap_or_else(|e| panic!("connecting to {addr} to verify {vdisk}: {e}"));
        let region = self.blocks.len() as u64 * BLOCK;
        let data = conn
            .read_range(0, region, MIB as u32)
            .unwrap_or_else(|e| panic!("reading {vdisk} back from {addr}: {e}"));
        let bad: Vec<String> = data
            .chunks(BLOCK as usize)
            .zip(&self.blocks)
            .enumerate()
            .filter_map(|(i, (got, record))| {
                let offset = i as u64 * BLOCK;
                let holds = |seq: u64| got == pattern(offset, seq, BLOCK as usize).as_slice();
                let fine = match record.acked {
                    Some(seq) => holds(seq),
                    None => got.iter().all(|&b| b == 0),
                } || record.uncertain.iter().any(|&seq| holds(seq));
                (!fine).then(|| {
                    format!(
                        "block at {offset}: acknowledged {:?}, unacknowledged {:?}, found {}",
                        record.acked,
                        record.uncertain,
                        describe_block(got)
                    )
                })
            })
            .collect();
        assert!(
            bad.is_empty(),
            "{} of {} blocks of {vdisk} read from {addr} lost an acknowledged write or hold \
             garbage ({} writes acknowledged, {} uncertain); first ones:\n{}",
            bad.len(),
            self.blocks.len(),
            self.acked_writes,
            self.uncertain_writes,
            bad[..bad.len().min(20)].join("\n")
        );
    }
}

//! The engine under disk faults, through the simulated disk (`SimFs`): power cuts at random
//! points (during mixed I/O, drains, re-shards, and with a small open-egroup limit), a full
//! disk, failing writes and syncs, bit rot in every kind of on-disk structure, and a slow
//! disk.
//!
//! Every test starts `Engine`s in-process with `fs: NodeFs::Sim`, the data under the virtual
//! root `/sim/disk0`, the metadata store (redb) in a real tempdir, and drives I/O through
//! `VdiskHandle`s on the engine's reactors. Data is written in 4 KiB blocks whose bytes name
//! their offset and the write that produced them, so a block from another write, another
//! offset, or a mix of two writes is recognised. Seeds are fixed and named in every failure
//! message.

use ashlar_core::{BlockDevice, IoError, IoResult, VdiskId};
use ashlar_engine::config::BlockLogSettings;
use ashlar_engine::{Engine, EngineConfig, VdiskHandle, VdiskState};
use ashlar_meta::EmbeddedMetaStore;
use ashlar_storage::disk::{Disk, Tier};
use ashlar_storage::fs::sim::{CutPolicy, CutReport, Times};
use ashlar_storage::fs::{Filesystem, IoMode, NodeFs, SimFs};
use bytes::Bytes;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::RwLock;

type TestEngine = Engine<EmbeddedMetaStore>;

const BLOCK: u64 = 4096;
const MIB: u64 = 1 << 20;
/// Where the simulated disk is mounted, as the engine sees it.
const DISK: &str = "/sim/disk0";
/// Longest a single client request may take in these tests before it counts as a hang.
const REQUEST_LIMIT: Duration = Duration::from_secs(15);

/// The timing test takes this exclusively, every other test shares it: the timing test then
/// never runs beside this binary's CPU-heavy tests (it still shares the machine with whatever
/// else runs).
static CPU: RwLock<()> = RwLock::const_new(());

// ---------------------------------------------------------------------------------------------
// Data patterns and the per-block model
// ---------------------------------------------------------------------------------------------

/// The data of write `seq` at `offset`: 16-byte records (vdisk byte offset of the record,
/// sequence number).
fn pattern(offset: u64, seq: u64, len: usize) -> Vec<u8> {
    let mut data = Vec::with_capacity(len);
    for i in 0..(len / 16) as u64 {
        data.extend_from_slice(&(offset + i * 16).to_le_bytes());
        data.extend_from_slice(&seq.to_le_bytes());
    }
    data
}

/// What a block holds, for failure messages.
fn describe(block: &[u8]) -> String {
    if block.iter().all(|&b| b == 0) {
        return "zeros".into();
    }
    let word = |at: usize| u64::from_le_bytes(block[at..at + 8].try_into().unwrap());
    let last = block.len() - 16;
    format!(
        "first record (offset {}, seq {}), last record (offset {}, seq {})",
        word(0),
        word(8),
        word(last),
        word(last + 8)
    )
}

/// What a 4 KiB block should hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Content {
    Zeros,
    /// `pattern(block offset, seq)`.
    Data(u64),
}

impl Content {
    fn matches(self, offset: u64, block: &[u8]) -> bool {
        match self {
            Content::Zeros => block.iter().all(|&b| b == 0),
            Content::Data(seq) => block.chunks_exact(16).enumerate().all(|(i, record)| {
                record[..8] == (offset + i as u64 * 16).to_le_bytes()
                    && record[8..] == seq.to_le_bytes()
            }),
        }
    }
}

/// One block of the model.
#[derive(Clone, Debug)]
struct Slot {
    /// The newest acknowledged write (zeros if none).
    acked: Content,
    /// The write covering the block whose reply has not arrived: at most one at a time, so the
    /// outcome never depends on how the engine orders concurrent overlapping writes.
    in_flight: Option<Content>,
    /// Reads in flight over the block (no write starts under them).
    readers: u32,
    /// Writes that failed since the last acknowledged one: the block may hold any of them.
    maybe: Vec<Content>,
}

impl Default for Slot {
    fn default() -> Self {
        Slot {
            acked: Content::Zeros,
            in_flight: None,
            readers: 0,
            maybe: Vec::new(),
        }
    }
}

impl Slot {
    fn allowed(&self) -> impl Iterator<Item = Content> + '_ {
        std::iter::once(self.acked)
            .chain(self.in_flight)
            .chain(self.maybe.iter().copied())
    }
}

#[derive(Clone, Copy, Debug)]
enum Begin {
    Write,
    Zero,
    Read,
}

/// The model of one vdisk: what every block may hold.
struct Tracker {
    slots: Vec<Slot>,
    next_seq: u64,
    acked_ops: u64,
    /// Requests issued and not answered.
    outstanding: u64,
    failures: Vec<String>,
    /// Set at a power cut: later replies change nothing (the snapshot counts those writes as
    /// in flight).
    frozen: bool,
    /// Set once faults are injected: failed writes are expected (they may or may not have
    /// reached the disk), no longer test failures.
    errors_expected: bool,
}

impl Tracker {
    fn new(bytes: u64, first_seq: u64) -> Self {
        Tracker {
            slots: vec![Slot::default(); (bytes / BLOCK) as usize],
            next_seq: first_seq,
            acked_ops: 0,
            outstanding: 0,
            failures: Vec::new(),
            frozen: false,
            errors_expected: false,
        }
    }

    /// Reserves `[first, first+count)` for a request if no write (or, for a write, no read)
    /// is in flight there; returns the content a write will give it.
    fn try_begin(&mut self, first: usize, count: usize, kind: Begin) -> Option<Content> {
        let slots = &mut self.slots[first..first + count];
        let free = match kind {
            Begin::Read => slots.iter().all(|s| s.in_flight.is_none()),
            Begin::Write | Begin::Zero => slots
                .iter()
                .all(|s| s.in_flight.is_none() && s.readers == 0),
        };
        if !free {
            return None;
        }
        self.outstanding += 1;
        let content = match kind {
            Begin::Read => {
                for slot in slots {
                    slot.readers += 1;
                }
                return Some(Content::Zeros);
            }
            Begin::Zero => Content::Zeros,
            Begin::Write => {
                self.next_seq += 1;
                Content::Data(self.next_seq)
            }
        };
        for slot in slots {
            slot.in_flight = Some(content);
        }
        Some(content)
    }

    /// Records a write's reply. A failed write may or may not have reached the disk.
    fn finish_write(&mut self, first: usize, count: usize, content: Content, ok: bool) {
        self.outstanding -= 1;
        if self.frozen {
            return;
        }
        for slot in &mut self.slots[first..first + count] {
            slot.in_flight = None;
            if ok {
                slot.acked = content;
                slot.maybe.clear();
            } else {
                slot.maybe.push(content);
            }
        }
        if ok {
            self.acked_ops += 1;
        }
    }

    /// Checks a read's data against the model and releases its blocks.
    fn finish_read(&mut self, first: usize, count: usize, result: &IoResult<Bytes>, what: &str) {
        self.outstanding -= 1;
        for slot in &mut self.slots[first..first + count] {
            slot.readers -= 1;
        }
        if self.frozen {
            return;
        }
        match result {
            Err(error) => self.failures.push(format!("{what}: read failed: {error}")),
            Ok(data) => {
                for (i, block) in data.chunks(BLOCK as usize).enumerate() {
                    let index = first + i;
                    let offset = index as u64 * BLOCK;
                    let slot = &self.slots[index];
                    if !slot.allowed().any(|c| c.matches(offset, block)) {
                        self.failures.push(format!(
                            "{what}: read of block at {offset}: expected {:?} (or {:?}), found {}",
                            slot.acked,
                            slot.maybe,
                            describe(block)
                        ));
                    }
                }
                self.acked_ops += 1;
            }
        }
    }

    /// The model at a power cut: from now on replies change nothing.
    fn freeze(&mut self) -> Vec<Slot> {
        self.frozen = true;
        self.slots.clone()
    }

    /// After a check: every block holds what was found, nothing is in flight.
    fn rebase(&mut self, found: Vec<Content>) {
        assert_eq!(found.len(), self.slots.len());
        for (slot, content) in self.slots.iter_mut().zip(found) {
            *slot = Slot {
                acked: content,
                ..Slot::default()
            };
        }
        self.frozen = false;
        self.errors_expected = false;
        self.outstanding = 0;
    }

    fn in_flight_blocks(&self) -> usize {
        self.slots.iter().filter(|s| s.in_flight.is_some()).count()
    }
}

/// SplitMix64.
#[derive(Clone)]
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x5DEE_CE66_D1CE_4E5B)
    }
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n`.
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    /// Uniform in `lo..=hi`.
    fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }
}

// ---------------------------------------------------------------------------------------------
// A node: an engine on a simulated disk, restartable
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Debug)]
struct Settings {
    reactors: usize,
    cache_bytes: u64,
    oplog_bytes_per_vdisk: u64,
    drain_batch_bytes: u64,
    drain_idle: Duration,
    max_open_egroups_per_shard: usize,
    block_log: Option<BlockLogSettings>,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            reactors: 2,
            cache_bytes: 16 * MIB,
            oplog_bytes_per_vdisk: 32 * MIB,
            drain_batch_bytes: MIB,
            drain_idle: Duration::from_millis(20),
            max_open_egroups_per_shard: 8,
            block_log: None,
        }
    }
}

struct Node {
    sim: SimFs,
    meta: EmbeddedMetaStore,
    settings: Settings,
    engine: Option<Arc<TestEngine>>,
    _meta_dir: tempfile::TempDir,
}

fn extents_dir(id: VdiskId) -> PathBuf {
    Path::new(DISK).join("extents").join(id.to_string())
}

fn oplog_dir(id: VdiskId) -> PathBuf {
    Path::new(DISK).join("oplog").join(id.to_string())
}

impl Node {
    async fn start(settings: Settings) -> Node {
        let meta_dir = tempfile::tempdir().unwrap();
        let meta = EmbeddedMetaStore::open(&meta_dir.path().join("meta.redb")).expect("meta");
        let mut node = Node {
            sim: SimFs::new(IoMode::Direct),
            meta,
            settings,
            engine: None,
            _meta_dir: meta_dir,
        };
        node.restart("first start").await;
        node
    }

    /// A node whose shards never drain on their own (only a re-shard or a full log does):
    /// the data stays in the oplogs.
    async fn start_without_background_drain() -> Node {
        Node::start(Settings {
            drain_idle: Duration::from_secs(3600),
            ..Settings::default()
        })
        .await
    }

    fn config(&self) -> EngineConfig {
        let s = &self.settings;
        EngineConfig {
            data_dir: self._meta_dir.path().to_path_buf(),
            disks: vec![Disk {
                path: PathBuf::from(DISK),
                tier: Tier::Fast,
            }],
            reactors: s.reactors,
            poll_window: Duration::ZERO,
            reactor_cpus: Vec::new(),
            cache_bytes: s.cache_bytes,
            oplog_bytes_per_vdisk: s.oplog_bytes_per_vdisk,
            shard_queue_limit: 64,
            shard_requests_in_flight_limit:
                ashlar_engine::config::DEFAULT_SHARD_REQUESTS_IN_FLIGHT_LIMIT,
            drain_batch_bytes: s.drain_batch_bytes,
            drain_memory_bytes: ashlar_engine::drain_budget::DEFAULT_DRAIN_MEMORY_BYTES,
            drain_idle: s.drain_idle,
            max_open_egroups_per_shard: s.max_open_egroups_per_shard,
            max_writing_egroups_per_shard:
                ashlar_storage::extent_store::DEFAULT_MAX_WRITING_EGROUPS,
            writes_in_flight_per_egroup:
                ashlar_storage::extent_store::DEFAULT_WRITES_IN_FLIGHT_PER_EGROUP,
            default_shards: 1,
            fs: NodeFs::Sim(self.sim.clone()),
            block_log: s.block_log,
        }
    }

    /// Starts a new engine on the same disk and metadata (the old one must be stopped). The
    /// node must come up, with every vdisk online.
    async fn restart(&mut self, label: &str) {
        assert!(self.engine.is_none(), "{label}: the old engine still runs");
        let engine = bounded(
            format!("{label}: engine start"),
            Duration::from_secs(60),
            Engine::start(self.config(), self.meta.clone()),
        )
        .await
        .unwrap_or_else(|e| panic!("{label}: the node did not come up: {e}"));
        for vdisk in engine.list_vdisks() {
            assert_eq!(
                vdisk.state,
                VdiskState::Online,
                "{label}: vdisk {} did not come up: {:?}",
                vdisk.name,
                vdisk.status
            );
        }
        self.engine = Some(engine);
    }

    fn engine(&self) -> &Arc<TestEngine> {
        self.engine.as_ref().expect("engine running")
    }

    /// Stops the engine: its reactor threads end and every task on them is dropped.
    async fn stop(&mut self) {
        let mut engine = self.engine.take().expect("engine running");
        // Jobs sent to the reactors hold a clone until they have opened their handle.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match Arc::try_unwrap(engine) {
                Ok(engine) => {
                    drop(engine);
                    return;
                }
                Err(again) => {
                    assert!(
                        Instant::now() < deadline,
                        "the engine is still referenced 10 s after it was asked to stop"
                    );
                    engine = again;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
        }
    }

    /// The process dies with the power: from now on the engine cannot change the disk (every
    /// call sleeps until the engine is dropped). Calls already under way finish first (each
    /// acts atomically under the disk's lock; 20 ms covers those that read no delay just
    /// before this one was set).
    ///
    /// Why not cut first and stop the engine after: the cut kills the handles opened before
    /// it, but namespace calls and files opened after it work, so an engine left running
    /// would go on creating, writing and removing files in the next life (a new oplog
    /// segment, say, written and acknowledged after the power went), which no dead process
    /// can do. Freezing first makes the cut instantaneous for the process; every write it
    /// issued before is in flight at the cut, and one whose sync returned before is
    /// acknowledged.
    async fn freeze_disk(&self) {
        self.sim.set_delay(None, Duration::from_secs(3600));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    /// Cuts the power of a frozen disk, stops the engine and starts a new one.
    async fn cut_and_restart(&mut self, policy: CutPolicy, label: &str) -> CutReport {
        let report = self.sim.power_cut(policy);
        self.stop().await;
        self.sim.clear_delays();
        self.restart(label).await;
        report
    }

    async fn create(&self, name: &str, size: u64, shards: u32) -> VdiskId {
        self.engine()
            .create_vdisk(name, size, Some(shards))
            .await
            .unwrap_or_else(|e| panic!("creating {name}: {e}"))
            .id
    }

    fn stats(&self, name: &str) -> ashlar_engine::VdiskStats {
        self.engine()
            .vdisk_stats()
            .into_iter()
            .find(|s| s.name == name)
            .expect("stats of the vdisk")
    }

    /// Runs `body` with a fresh handle of `vdisk` on reactor `reactor`, bounded in time.
    async fn on_reactor<T, Fut>(
        &self,
        reactor: usize,
        vdisk: &str,
        limit: Duration,
        body: impl FnOnce(VdiskHandle) -> Fut + Send + 'static,
    ) -> T
    where
        T: Send + 'static,
        Fut: Future<Output = T> + 'static,
    {
        let engine = self.engine().clone();
        let name = vdisk.to_string();
        let what = format!("I/O on {vdisk} (reactor {reactor})");
        let reactor_handle = self.engine().reactors().handles()[reactor].clone();
        let job = reactor_handle.run(move || async move {
            let handle = engine.open(&name).expect("open the vdisk");
            drop(engine);
            body(handle).await
        });
        bounded(what, limit, job).await.expect("reactor running")
    }

    async fn write(&self, vdisk: &str, offset: u64, data: Vec<u8>) -> IoResult<()> {
        self.on_reactor(0, vdisk, REQUEST_LIMIT, move |h| async move {
            h.write(offset, Bytes::from(data), false).await
        })
        .await
    }

    async fn zero(&self, vdisk: &str, offset: u64, length: u64, punch: bool) -> IoResult<()> {
        self.on_reactor(0, vdisk, REQUEST_LIMIT, move |h| async move {
            h.write_zeroes(offset, length as u32, punch).await
        })
        .await
    }

    async fn read(&self, vdisk: &str, offset: u64, length: u64) -> IoResult<Bytes> {
        self.on_reactor(0, vdisk, REQUEST_LIMIT, move |h| async move {
            h.read(offset, length as u32).await
        })
        .await
    }

    /// Every block of `[0, blocks)`: its bytes or the error reading it gave. Reads in large
    /// pieces and, where a piece fails, block by block.
    async fn read_blocks(&self, vdisk: &str, blocks: usize) -> Vec<IoResult<Vec<u8>>> {
        self.on_reactor(0, vdisk, Duration::from_secs(120), move |h| async move {
            const PIECE_BLOCKS: usize = 64;
            let mut out = Vec::with_capacity(blocks);
            let mut first = 0;
            while first < blocks {
                let count = PIECE_BLOCKS.min(blocks - first);
                let offset = first as u64 * BLOCK;
                match h.read(offset, (count as u64 * BLOCK) as u32).await {
                    Ok(data) => {
                        out.extend(data.chunks(BLOCK as usize).map(|b| Ok(b.to_vec())));
                    }
                    Err(_) => {
                        for i in 0..count {
                            let at = offset + i as u64 * BLOCK;
                            out.push(h.read(at, BLOCK as u32).await.map(|b| b.to_vec()));
                        }
                    }
                }
                first += count;
            }
            out
        })
        .await
    }

    /// A write through the model: reserved, issued, and recorded (acknowledged or not).
    async fn tracked_write(
        &self,
        vdisk: &str,
        tracker: &mut Tracker,
        offset: u64,
        length: u64,
    ) -> IoResult<()> {
        let (first, count) = ((offset / BLOCK) as usize, (length / BLOCK) as usize);
        let content = tracker
            .try_begin(first, count, Begin::Write)
            .expect("nothing in flight");
        let Content::Data(seq) = content else {
            unreachable!()
        };
        let result = self
            .write(vdisk, offset, pattern(offset, seq, length as usize))
            .await;
        tracker.finish_write(first, count, content, result.is_ok());
        result
    }

    async fn tracked_zero(
        &self,
        vdisk: &str,
        tracker: &mut Tracker,
        offset: u64,
        length: u64,
        punch: bool,
    ) -> IoResult<()> {
        let (first, count) = ((offset / BLOCK) as usize, (length / BLOCK) as usize);
        let content = tracker
            .try_begin(first, count, Begin::Zero)
            .expect("nothing in flight");
        let result = self.zero(vdisk, offset, length, punch).await;
        tracker.finish_write(first, count, content, result.is_ok());
        result
    }

    /// Every block reads back as the model says (acknowledged data, or the data of a write
    /// that failed since); no read fails.
    async fn verify(&self, vdisk: &str, tracker: &Tracker, label: &str) {
        let got = self.read_blocks(vdisk, tracker.slots.len()).await;
        let bad = check_blocks(&tracker.slots, &got).1;
        assert!(
            bad.is_empty(),
            "{label}: {} of {} blocks of {vdisk} read back wrong; first ones:\n{}",
            bad.len(),
            got.len(),
            bad.iter().take(20).cloned().collect::<Vec<_>>().join("\n")
        );
    }
}

/// Awaits `future`, failing the test if it takes longer than `limit` (a hang).
async fn bounded<T>(
    what: impl std::fmt::Display,
    limit: Duration,
    future: impl Future<Output = T>,
) -> T {
    match tokio::time::timeout(limit, future).await {
        Ok(value) => value,
        Err(_) => panic!("{what}: no answer within {limit:?} (hung)"),
    }
}

/// Compares every block with what the model allows: returns what each block was found to
/// hold and the blocks that hold anything else or failed to read.
fn check_blocks(slots: &[Slot], got: &[IoResult<Vec<u8>>]) -> (Vec<Content>, Vec<String>) {
    assert_eq!(slots.len(), got.len());
    let mut found = Vec::with_capacity(slots.len());
    let mut bad = Vec::new();
    for (index, (slot, result)) in slots.iter().zip(got).enumerate() {
        let offset = index as u64 * BLOCK;
        match result {
            Err(error) => {
                bad.push(format!(
                    "block at {offset}: read failed ({error}); expected {:?} or in flight {:?}",
                    slot.acked, slot.in_flight
                ));
                found.push(slot.acked);
            }
            Ok(block) => match slot.allowed().find(|c| c.matches(offset, block)) {
                Some(content) => found.push(content),
                None => {
                    bad.push(format!(
                        "block at {offset}: expected {:?}, in flight {:?} or failed {:?}; found {}",
                        slot.acked,
                        slot.in_flight,
                        slot.maybe,
                        describe(block)
                    ));
                    found.push(slot.acked);
                }
            },
        }
    }
    (found, bad)
}

// ---------------------------------------------------------------------------------------------
// A concurrent workload for power cuts
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug)]
enum Op {
    Write {
        offset: u64,
        length: u64,
    },
    Zero {
        offset: u64,
        length: u64,
        punch: bool,
    },
    Read {
        offset: u64,
        length: u64,
    },
    Flush,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mix {
    /// Small overlapping writes (oplog), whole-extent writes (bypass), write-zeroes (punched
    /// and allocated), flushes and checked reads.
    Mixed,
    /// Small writes and zeroings only (everything goes through the oplog and its drains).
    SmallOnly,
    /// Small overwrites of a few hot spots in every extent, and whole-extent writes: many
    /// egroups touched by every drain.
    HotSpots,
}

impl Mix {
    fn pick(self, rng: &mut Rng, region: u64) -> Op {
        let small = |rng: &mut Rng, max_blocks: u64| {
            let length = rng.between(1, max_blocks) * BLOCK;
            let offset = rng.below((region - length) / BLOCK + 1) * BLOCK;
            (offset, length)
        };
        let extents = region / MIB;
        let roll = rng.below(100);
        match self {
            Mix::Mixed => match roll {
                0..=39 => {
                    let (offset, length) = small(rng, 16);
                    Op::Write { offset, length }
                }
                40..=51 => {
                    let count = if rng.below(4) == 0 { 2 } else { 1 };
                    let offset = rng.below(extents - count + 1) * MIB;
                    Op::Write {
                        offset,
                        length: count * MIB,
                    }
                }
                52..=61 => {
                    let (offset, length) = small(rng, 32);
                    Op::Zero {
                        offset,
                        length,
                        punch: true,
                    }
                }
                62..=65 => Op::Zero {
                    offset: rng.below(extents) * MIB,
                    length: MIB,
                    punch: true,
                },
                66..=71 => {
                    let (offset, length) = small(rng, 8);
                    Op::Zero {
                        offset,
                        length,
                        punch: false,
                    }
                }
                72..=79 => Op::Flush,
                _ => {
                    let (offset, length) = small(rng, 32);
                    Op::Read { offset, length }
                }
            },
            Mix::SmallOnly => match roll {
                0..=84 => {
                    let (offset, length) = small(rng, 16);
                    Op::Write { offset, length }
                }
                _ => {
                    let (offset, length) = small(rng, 16);
                    Op::Zero {
                        offset,
                        length,
                        punch: true,
                    }
                }
            },
            Mix::HotSpots => match roll {
                0..=79 => {
                    // One of 8 spots per extent, each 128 KiB apart.
                    let length = rng.between(1, 8) * BLOCK;
                    let offset = rng.below(extents) * MIB + rng.below(8) * 128 * 1024;
                    Op::Write { offset, length }
                }
                80..=89 => Op::Write {
                    offset: rng.below(extents) * MIB,
                    length: MIB,
                },
                _ => {
                    let length = rng.between(1, 8) * BLOCK;
                    let offset = rng.below(extents) * MIB + rng.below(8) * 128 * 1024;
                    Op::Read { offset, length }
                }
            },
        }
    }
}

/// What the workers of a power-cut run do.
#[derive(Clone, Copy, Debug)]
struct Workload {
    mix: Mix,
    /// Bytes of the vdisk, all of them written.
    region: u64,
    workers_per_reactor: usize,
}

/// Issues requests from the workload's mix until `stop`, at most one request in flight per
/// block.
async fn worker(
    handle: VdiskHandle,
    tracker: Arc<Mutex<Tracker>>,
    stop: Arc<AtomicBool>,
    mut rng: Rng,
    workload: Workload,
) {
    while !stop.load(Ordering::Relaxed) {
        let op = workload.mix.pick(&mut rng, workload.region);
        let (offset, length, begin) = match op {
            Op::Write { offset, length } => (offset, length, Begin::Write),
            Op::Zero { offset, length, .. } => (offset, length, Begin::Zero),
            Op::Read { offset, length } => (offset, length, Begin::Read),
            Op::Flush => {
                if let Err(error) = handle.flush().await {
                    lock(&tracker)
                        .failures
                        .push(format!("flush failed: {error}"));
                }
                continue;
            }
        };
        let (first, count) = ((offset / BLOCK) as usize, (length / BLOCK) as usize);
        let Some(content) = lock(&tracker).try_begin(first, count, begin) else {
            tokio::time::sleep(Duration::from_millis(1)).await;
            continue;
        };
        match op {
            Op::Write { .. } => {
                let Content::Data(seq) = content else {
                    unreachable!()
                };
                let data = Bytes::from(pattern(offset, seq, length as usize));
                let result = handle.write(offset, data, false).await;
                let mut t = lock(&tracker);
                if let Err(error) = &result {
                    if !t.frozen && !t.errors_expected {
                        t.failures.push(format!(
                            "write seq {seq} [{offset}, +{length}) failed: {error}"
                        ));
                    }
                }
                t.finish_write(first, count, content, result.is_ok());
            }
            Op::Zero { punch, .. } => {
                let result = handle.write_zeroes(offset, length as u32, punch).await;
                let mut t = lock(&tracker);
                if let Err(error) = &result {
                    if !t.frozen && !t.errors_expected {
                        t.failures.push(format!(
                            "write-zeroes [{offset}, +{length}) (punch {punch}) failed: {error}"
                        ));
                    }
                }
                t.finish_write(first, count, content, result.is_ok());
            }
            Op::Read { .. } => {
                let result = handle.read(offset, length as u32).await;
                lock(&tracker).finish_read(
                    first,
                    count,
                    &result,
                    &format!("read [{offset}, +{length})"),
                );
            }
            Op::Flush => unreachable!(),
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Starts the workload's workers on every reactor of the node.
fn spawn_workers(
    node: &Node,
    vdisk: &str,
    tracker: &Arc<Mutex<Tracker>>,
    stop: &Arc<AtomicBool>,
    seed: u64,
    workload: Workload,
) {
    for (r, reactor) in node.engine().reactors().handles().iter().enumerate() {
        let engine = node.engine().clone();
        let name = vdisk.to_string();
        let tracker = tracker.clone();
        let stop = stop.clone();
        reactor
            .spawn_detached(move || async move {
                let handle = engine.open(&name).expect("open");
                drop(engine);
                for w in 0..workload.workers_per_reactor {
                    let rng = Rng::new(seed.wrapping_mul(1000) + (r * 100 + w) as u64);
                    tokio::task::spawn_local(worker(
                        handle.clone(),
                        tracker.clone(),
                        stop.clone(),
                        rng,
                        workload,
                    ));
                }
            })
            .expect("reactor running");
    }
}

/// Waits until the workload has `target` acknowledged requests; fails on any error.
async fn wait_for_acks(tracker: &Mutex<Tracker>, target: u64, label: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        {
            let t = lock(tracker);
            assert!(
                t.failures.is_empty(),
                "{label}: requests failed with no fault injected: {:?}",
                t.failures
            );
            if t.acked_ops >= target {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{label}: workload stalled at {} of {target} requests answered",
                t.acked_ops
            );
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Waits (polling from this thread, which is not a reactor) until the engine has made `k`
/// more write calls (writes, punches) into the vdisk's extent store, or none for 200 ms.
async fn wait_for_store_writes(sim: &SimFs, id: VdiskId, k: u64) {
    let dir = extents_dir(id);
    let count = || {
        let c = sim.op_counts(Some(&dir));
        c.writes + c.durable_writes + c.punches
    };
    let target = count() + k;
    let mut last = (count(), Instant::now());
    loop {
        let now = count();
        if now >= target {
            return;
        }
        if now != last.0 {
            last = (now, Instant::now());
        } else if last.1.elapsed() > Duration::from_millis(200) {
            return;
        }
        // Blocks the test's thread only; the reactors run on their own.
        std::thread::sleep(Duration::from_micros(20));
    }
}

/// Where a power cut lands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CutDuring {
    /// The workload itself.
    Io,
    /// Drains: the writers stop, the cut comes while idle drains move the oplog out.
    Drain,
    /// A change of the shard count while the workload runs.
    Reshard,
}

#[derive(Default, Debug)]
struct CutStats {
    cuts: u64,
    acked_ops: u64,
    in_flight_blocks: u64,
    /// Cuts that found unsynced extent-store changes (a drain or bypass write half done).
    cuts_with_unsynced_egroups: u64,
    reshards_finished_before_cut: u64,
    changes_dropped: u64,
    changes_kept: u64,
}

/// Runs the workload on a fresh node, cuts the power at a random point `lives` times
/// (restarting each time) and checks every block after each restart.
async fn power_cut_run(
    seed: u64,
    during: CutDuring,
    settings: Settings,
    shards: u32,
    workload: Workload,
    lives: u64,
    stats: &mut CutStats,
) {
    let Workload { mix, region, .. } = workload;
    let mut rng = Rng::new(seed);
    let mut node = Node::start(settings).await;
    let id = node.create("v", region, shards).await;
    let tracker = Arc::new(Mutex::new(Tracker::new(region, seed << 32)));
    for life in 0..lives {
        let label = format!(
            "seed {seed}, life {life}, cut during {during:?}, mix {mix:?}, slow disk {}, \
             dying disk {}",
            seed.is_multiple_of(2),
            during == CutDuring::Io && seed % 4 == 1
        );
        // Every other seed, each disk call takes 1 ms: the engine's storage futures then
        // really wait between a write and its sync (the simulated disk answers at once
        // otherwise), so many more cuts land with writes half done.
        let slow = seed.is_multiple_of(2);
        if slow {
            node.sim
                .set_delay(Some(Path::new(DISK)), Duration::from_millis(1));
        }
        let stop = Arc::new(AtomicBool::new(false));
        spawn_workers(&node, "v", &tracker, &stop, seed * 10 + life, workload);
        let target = lock(&tracker).acked_ops + rng.between(10, 400);
        wait_for_acks(&tracker, target, &label).await;
        // Some cuts come after the disk has been failing every write and sync for a few
        // milliseconds: the engine's error handling runs before the power goes, and its
        // recovery after.
        let dying = during == CutDuring::Io && seed % 4 == 1;
        if dying {
            lock(&tracker).errors_expected = true;
            node.sim.fail_writes(None, Times::Always);
            node.sim.fail_syncs(None, Times::Always);
            tokio::time::sleep(Duration::from_millis(rng.between(1, 20))).await;
        }
        match during {
            CutDuring::Io => {}
            CutDuring::Drain => {
                // Writers stop; the cut lands while idle drains run.
                stop.store(true, Ordering::Relaxed);
                let deadline = Instant::now() + REQUEST_LIMIT;
                while lock(&tracker).outstanding > 0 {
                    assert!(
                        Instant::now() < deadline,
                        "{label}: requests never answered"
                    );
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
            CutDuring::Reshard => {
                let current = node.engine().vdisk("v").unwrap().shards;
                let to = if current == 1 {
                    rng.between(2, 3) as u32
                } else {
                    1
                };
                let wait = Duration::from_millis(rng.between(0, 40));
                let reshard = node.engine().set_shards("v", to);
                tokio::select! {
                    result = reshard => {
                        result.unwrap_or_else(|e| panic!("{label}: re-shard failed: {e}"));
                        stats.reshards_finished_before_cut += 1;
                    }
                    () = tokio::time::sleep(wait) => {}
                }
            }
        }
        // Drain cuts, and half the others, land just after the engine's k-th next write call
        // into the extent store: a drain step or bypass write is then almost surely half done.
        if during == CutDuring::Drain || rng.below(2) == 0 {
            let k = rng.between(1, 24);
            wait_for_store_writes(&node.sim, id, k).await;
        }
        node.freeze_disk().await;
        let unsynced_egroups = node
            .sim
            .files()
            .iter()
            .filter(|f| f.path.starts_with(extents_dir(id)) && f.pending_changes > 0)
            .count();
        let slots = {
            let mut t = lock(&tracker);
            assert!(
                t.failures.is_empty(),
                "{label}: requests failed with no fault injected: {:?}",
                t.failures
            );
            stats.acked_ops += t.acked_ops;
            stats.in_flight_blocks += t.in_flight_blocks() as u64;
            t.freeze()
        };
        stop.store(true, Ordering::Relaxed);
        let cut_seed = seed * 1000 + life;
        // Faults outlive power cuts; the disk is healthy again after this one.
        node.sim.clear_failures();
        let report = node
            .cut_and_restart(CutPolicy::Random { seed: cut_seed }, &label)
            .await;
        stats.cuts += 1;
        stats.cuts_with_unsynced_egroups += u64::from(unsynced_egroups > 0);
        stats.changes_dropped += report.changes_dropped;
        stats.changes_kept += report.changes_kept;
        let got = node.read_blocks("v", slots.len()).await;
        let (found, bad) = check_blocks(&slots, &got);
        assert!(
            bad.is_empty(),
            "{label}: after a power cut (policy Random {{ seed: {cut_seed} }}, {report:?}) and \
             restart, {} of {} blocks hold neither the newest acknowledged write nor one in \
             flight at the cut; first ones:\n{}",
            bad.len(),
            slots.len(),
            bad.iter().take(20).cloned().collect::<Vec<_>>().join("\n")
        );
        lock(&tracker).rebase(found);
    }
    // The node keeps working after its last restart: a fresh write reads back.
    let fresh = pattern(0, u64::MAX, 8192);
    node.write("v", 0, fresh.clone())
        .await
        .unwrap_or_else(|e| panic!("seed {seed}: write after the last restart failed: {e}"));
    let back = node.read("v", 0, 8192).await.expect("read after restart");
    assert!(
        back[..] == fresh[..],
        "seed {seed}: fresh write did not read back"
    );
    node.stop().await;
}

fn power_cut_settings() -> Settings {
    Settings {
        reactors: 2,
        cache_bytes: 8 * MIB,
        // The smallest oplog the engine makes (16 MiB per shard): drains start at half.
        oplog_bytes_per_vdisk: 16 * MIB,
        drain_batch_bytes: 256 * 1024,
        drain_idle: Duration::from_millis(2),
        max_open_egroups_per_shard: 8,
        block_log: None,
    }
}

/// `power_cut_settings` with drains into the block log, checkpointing every 64 blocks.
fn block_log_settings() -> Settings {
    Settings {
        block_log: Some(BlockLogSettings {
            checkpoint_bytes: 256 * 1024,
            // Segments of 1 MiB, two per shard: drain steps clean as they go.
            capacity_bytes: 2 * MIB,
            segment_chunks: 1,
        }),
        ..power_cut_settings()
    }
}

// ---------------------------------------------------------------------------------------------
// 1. Power cuts at random points
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "current_thread")]
async fn power_cuts_during_mixed_io_keep_acknowledged_writes() {
    let _cpu = CPU.read().await;
    let started = Instant::now();
    let mut stats = CutStats::default();
    for seed in 1..=48 {
        power_cut_run(
            seed,
            CutDuring::Io,
            power_cut_settings(),
            2,
            Workload {
                mix: Mix::Mixed,
                region: 8 * MIB,
                workers_per_reactor: 4,
            },
            2,
            &mut stats,
        )
        .await;
    }
    eprintln!("mixed I/O: {stats:?} in {:?}", started.elapsed());
    assert!(stats.in_flight_blocks > 0, "no cut found a write in flight");
    assert!(
        stats.cuts_with_unsynced_egroups > 0,
        "no cut found unsynced extent-store writes: the cuts never landed mid-write"
    );
}

/// Power cuts while drain steps run (only small writes: the data goes through the oplog).
async fn cuts_during_drains(seeds: std::ops::RangeInclusive<u64>, settings: Settings, what: &str) {
    let _cpu = CPU.read().await;
    let started = Instant::now();
    let mut stats = CutStats::default();
    for seed in seeds {
        power_cut_run(
            seed,
            CutDuring::Drain,
            settings.clone(),
            2,
            Workload {
                mix: Mix::SmallOnly,
                region: 8 * MIB,
                workers_per_reactor: 4,
            },
            2,
            &mut stats,
        )
        .await;
    }
    eprintln!("{what}: {stats:?} in {:?}", started.elapsed());
    // With only oplog writes, unsynced extent-store changes at the cut mean a drain step was
    // cut half done.
    assert!(
        stats.cuts_with_unsynced_egroups >= stats.cuts / 4,
        "only {} of {} cuts landed during a drain step",
        stats.cuts_with_unsynced_egroups,
        stats.cuts
    );
}

/// Power cuts while the shard count changes under mixed I/O.
async fn cuts_during_reshards(
    seeds: std::ops::RangeInclusive<u64>,
    settings: Settings,
    what: &str,
) {
    let _cpu = CPU.read().await;
    let started = Instant::now();
    let mut stats = CutStats::default();
    for seed in seeds {
        power_cut_run(
            seed,
            CutDuring::Reshard,
            settings.clone(),
            2,
            Workload {
                mix: Mix::Mixed,
                region: 16 * MIB,
                workers_per_reactor: 4,
            },
            2,
            &mut stats,
        )
        .await;
    }
    eprintln!("{what}: {stats:?} in {:?}", started.elapsed());
    assert!(
        stats.reshards_finished_before_cut < stats.cuts,
        "every re-shard finished before its cut: none was cut half done"
    );
}

#[tokio::test(flavor = "current_thread")]
async fn power_cuts_during_drains_keep_acknowledged_writes() {
    cuts_during_drains(101..=124, power_cut_settings(), "drains").await;
}

#[tokio::test(flavor = "current_thread")]
async fn power_cuts_during_reshards_keep_acknowledged_writes() {
    cuts_during_reshards(201..=216, power_cut_settings(), "re-shards").await;
}

/// The drains above, into the block log: cuts inside appends, between an append and its
/// overlay, inside checkpoints; replay at restart restores what no table names.
#[tokio::test(flavor = "current_thread")]
async fn power_cuts_during_drains_into_the_block_log_keep_acknowledged_writes() {
    cuts_during_drains(401..=424, block_log_settings(), "drains into the block log").await;
}

/// Re-shards with the block log: a hand-over checkpoints its shard's log.
#[tokio::test(flavor = "current_thread")]
async fn power_cuts_during_reshards_with_the_block_log_keep_acknowledged_writes() {
    cuts_during_reshards(
        501..=516,
        block_log_settings(),
        "re-shards with the block log",
    )
    .await;
}

// ---------------------------------------------------------------------------------------------
// 5. Eviction with a small open-egroup limit, then power cuts
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "current_thread")]
async fn power_cuts_with_two_open_egroups_keep_acknowledged_writes() {
    let _cpu = CPU.read().await;
    let started = Instant::now();
    let mut stats = CutStats::default();
    let settings = Settings {
        max_open_egroups_per_shard: 2,
        ..power_cut_settings()
    };
    for seed in 301..=316 {
        // 64 MiB: 16 egroups, 8 per shard, four times the open limit.
        power_cut_run(
            seed,
            CutDuring::Io,
            settings.clone(),
            2,
            Workload {
                mix: Mix::HotSpots,
                region: 64 * MIB,
                workers_per_reactor: 4,
            },
            2,
            &mut stats,
        )
        .await;
    }
    eprintln!("two open egroups: {stats:?} in {:?}", started.elapsed());
    assert!(stats.in_flight_blocks > 0, "no cut found a write in flight");
}

/// A re-shard whose caller stops waiting (an HTTP client that hangs up drops the request's
/// future) must still keep the new shards closed until the old ones have drained: reads in
/// between would miss data still in the old oplogs, and an old shard's drain could land over
/// newer writes.
#[tokio::test(flavor = "current_thread")]
async fn a_reshard_whose_caller_gives_up_serves_no_stale_data() {
    let _cpu = CPU.read().await;
    let mut node = Node::start_without_background_drain().await;
    let id = node.create("v", 8 * MIB, 2).await;
    let mut tracker = Tracker::new(8 * MIB, 0);
    for i in 0..64 {
        node.tracked_write("v", &mut tracker, i * 128 * 1024, 8192)
            .await
            .expect("write");
    }
    // Every disk call takes 5 ms: the old shards' hand-over drains take a while.
    node.sim
        .set_delay(Some(Path::new(DISK)), Duration::from_millis(5));
    {
        // Given up on as soon as the new shard map is published: the old shards are then
        // draining, which takes hundreds of disk calls.
        let reshard = node.engine().set_shards("v", 1);
        tokio::pin!(reshard);
        let deadline = Instant::now() + Duration::from_secs(30);
        while node.engine().vdisk("v").unwrap().shards != 1 {
            assert!(
                Instant::now() < deadline,
                "the new shard map was never published"
            );
            tokio::select! {
                result = &mut reshard => panic!("the re-shard finished at once: {result:?}"),
                () = tokio::time::sleep(Duration::from_millis(1)) => {}
            }
        }
    }
    // The re-shard's future is gone. Reads (which wait for the new shard) must see every
    // acknowledged write.
    node.verify("v", &tracker, "reads after an abandoned re-shard")
        .await;
    // The hand-over still completes: the old oplogs are drained and removed.
    let deadline = Instant::now() + Duration::from_secs(60);
    while node
        .sim
        .files()
        .iter()
        .any(|f| f.path.starts_with(oplog_dir(id).join("e0000000001-s0000")))
    {
        assert!(
            Instant::now() < deadline,
            "the old shards never handed over: {:#?}",
            node.sim.files()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    node.sim.clear_delays();
    for i in 0..64 {
        node.tracked_write("v", &mut tracker, i * 128 * 1024 + 4096, 8192)
            .await
            .expect("write after the re-shard");
    }
    node.verify("v", &tracker, "after the hand-over").await;
    node.stop().await;
    node.restart("restart after an abandoned re-shard").await;
    node.verify("v", &tracker, "after a restart").await;
}

// ---------------------------------------------------------------------------------------------
// 2. A full disk
// ---------------------------------------------------------------------------------------------

/// Writes fresh data into `vdisk` from `*cursor` on, a whole extent (straight to the extent
/// store) and a run of 64 KiB writes (through the oplog) in turn, until a write fails for
/// want of space. Every request is bounded in time; an error other than `NoSpace` fails the
/// test. Returns the bytes acknowledged.
async fn write_until_no_space(
    node: &Node,
    vdisk: &str,
    tracker: &mut Tracker,
    cursor: &mut u64,
    label: &str,
) -> u64 {
    let limit = tracker.slots.len() as u64 * BLOCK;
    let mut acked = 0;
    for turn in 0.. {
        assert!(
            *cursor + MIB <= limit,
            "{label}: {acked} bytes acknowledged and still no ENOSPC"
        );
        let at = *cursor;
        *cursor += MIB;
        let writes: Vec<(u64, u64)> = if turn % 2 == 0 {
            vec![(at, MIB)]
        } else {
            (0..16).map(|j| (at + j * 64 * 1024, 64 * 1024)).collect()
        };
        for (offset, length) in writes {
            match node.tracked_write(vdisk, tracker, offset, length).await {
                Ok(()) => acked += length,
                Err(IoError::NoSpace) => return acked,
                Err(other) => {
                    panic!("{label}: a write at {offset} failed with {other:?}, not NoSpace")
                }
            }
        }
    }
    unreachable!()
}

/// Retries a write of `length` at `offset` until it is acknowledged; only `NoSpace` (or,
/// with `io_too`, EIO) may fail it meanwhile. Fails the test after 20 s.
async fn write_until_ok(
    node: &Node,
    vdisk: &str,
    tracker: &mut Tracker,
    offset: u64,
    length: u64,
    io_too: bool,
    label: &str,
) -> Duration {
    let limit = Duration::from_secs(20);
    let started = Instant::now();
    loop {
        match node.tracked_write(vdisk, tracker, offset, length).await {
            Ok(()) => return started.elapsed(),
            Err(IoError::NoSpace) => {}
            Err(IoError::Io(_)) if io_too => {}
            Err(other) => panic!("{label}: write at {offset} failed with {other:?}"),
        }
        assert!(
            started.elapsed() < limit,
            "{label}: a write at {offset} still fails after {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "current_thread")]
async fn a_full_disk_fails_writes_and_they_succeed_once_space_returns() {
    let _cpu = CPU.read().await;
    let started = Instant::now();
    let mut node = Node::start(Settings {
        drain_idle: Duration::from_millis(10),
        ..Settings::default()
    })
    .await;
    node.create("a", 256 * MIB, 1).await;
    node.create("b", 64 * MIB, 1).await;
    let mut a = Tracker::new(256 * MIB, 0);
    let mut b = Tracker::new(64 * MIB, 1 << 40);
    // b holds 16 MiB: deleting it frees at least that much.
    for i in 0..16 {
        node.tracked_write("b", &mut b, i * MIB, MIB)
            .await
            .expect("write b");
    }
    let mut cursor = 0;
    for _ in 0..4 {
        node.tracked_write("a", &mut a, cursor, MIB)
            .await
            .expect("write a");
        cursor += MIB;
    }
    node.sim.set_capacity(node.sim.used_bytes() + 24 * MIB);

    let label = "first fill";
    let acked = write_until_no_space(&node, "a", &mut a, &mut cursor, label).await;
    eprintln!("{label}: {acked} bytes acknowledged before ENOSPC");
    // More writes of both kinds keep failing (or succeed), never hang.
    for i in 0..6u64 {
        let (offset, length) = if i % 2 == 0 {
            (cursor, MIB)
        } else {
            (cursor, 64 * 1024)
        };
        cursor += MIB;
        match node.tracked_write("a", &mut a, offset, length).await {
            Ok(()) | Err(IoError::NoSpace) => {}
            Err(other) => panic!("{label}: a write on a full disk failed with {other:?}"),
        }
    }
    // Acknowledged data still reads back, on both vdisks.
    node.verify("a", &a, "reads on a full disk").await;
    node.verify("b", &b, "reads on a full disk").await;

    // Deleting another vdisk frees space: writes succeed again, within a bounded time.
    bounded(
        "deleting b",
        REQUEST_LIMIT,
        node.engine().delete_vdisk("b", false),
    )
    .await
    .expect("delete b");
    let label = "after deleting b";
    let took = write_until_ok(&node, "a", &mut a, cursor, MIB, false, label).await;
    cursor += MIB;
    write_until_ok(&node, "a", &mut a, cursor, 64 * 1024, false, label).await;
    cursor += MIB;
    eprintln!("{label}: writes succeed again after {took:?}");
    node.verify("a", &a, label).await;

    // Full again; then the disk grows and writes succeed again.
    let label = "second fill";
    let acked = write_until_no_space(&node, "a", &mut a, &mut cursor, label).await;
    eprintln!("{label}: {acked} bytes acknowledged before ENOSPC");
    node.sim.set_capacity(1 << 40);
    let label = "after the disk grew";
    let took = write_until_ok(&node, "a", &mut a, cursor, 64 * 1024, false, label).await;
    cursor += MIB;
    write_until_ok(&node, "a", &mut a, cursor, MIB, false, label).await;
    eprintln!("{label}: writes succeed again after {took:?}");
    node.verify("a", &a, label).await;

    // Everything acknowledged is durable: a power cut (nothing in flight) and a restart keep it.
    node.freeze_disk().await;
    node.cut_and_restart(
        CutPolicy::Random { seed: 2 },
        "ENOSPC test, power cut seed 2",
    )
    .await;
    node.verify("a", &a, "after ENOSPC episodes, a power cut and a restart")
        .await;
    node.stop().await;
    eprintln!("ENOSPC test took {:?}", started.elapsed());
}

// ---------------------------------------------------------------------------------------------
// 3. EIO
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug)]
enum Fault {
    Writes,
    Syncs,
}

fn inject(sim: &SimFs, fault: Fault, prefix: &Path) {
    match fault {
        Fault::Writes => sim.fail_writes(Some(prefix), Times::Always),
        Fault::Syncs => sim.fail_syncs(Some(prefix), Times::Always),
    }
}

fn expect_eio(result: IoResult<()>, what: &str) {
    match result {
        Err(IoError::Io(_)) => {}
        other => panic!("{what}: expected EIO, got {other:?}"),
    }
}

/// The other vdisk is served meanwhile: writes of both kinds and reads.
async fn other_vdisk_is_served(node: &Node, tracker: &mut Tracker, round: u64, label: &str) {
    let base = (round % 4) * 2 * MIB;
    node.tracked_write("y", tracker, base, MIB)
        .await
        .unwrap_or_else(|e| panic!("{label}: whole-extent write to y failed: {e}"));
    for i in 0..8 {
        node.tracked_write("y", tracker, base + MIB + i * 8192, 4096)
            .await
            .unwrap_or_else(|e| panic!("{label}: small write to y failed: {e}"));
    }
    node.verify("y", tracker, label).await;
}

/// Two vdisks with data in the extent store and in the oplog.
async fn two_vdisks(node: &Node) -> (VdiskId, Tracker, Tracker) {
    let x = node.create("x", 64 * MIB, 1).await;
    node.create("y", 16 * MIB, 1).await;
    let mut tx = Tracker::new(64 * MIB, 0);
    let mut ty = Tracker::new(16 * MIB, 1 << 40);
    for (name, t) in [("x", &mut tx), ("y", &mut ty)] {
        for i in 0..4 {
            node.tracked_write(name, t, i * MIB, MIB)
                .await
                .expect("write");
        }
        for i in 0..32 {
            node.tracked_write(name, t, 4 * MIB + i * 64 * 1024, 16 * 1024)
                .await
                .expect("write");
        }
    }
    (x, tx, ty)
}

#[tokio::test(flavor = "current_thread")]
async fn failing_extent_store_writes_and_syncs_fail_requests_and_heal() {
    let _cpu = CPU.read().await;
    let started = Instant::now();
    let mut node = Node::start(Settings {
        drain_idle: Duration::from_millis(10),
        ..Settings::default()
    })
    .await;
    let (x, mut tx, mut ty) = two_vdisks(&node).await;
    let store = extents_dir(x);
    for (round, fault) in [Fault::Writes, Fault::Syncs].into_iter().enumerate() {
        let round = round as u64;
        let label = format!("failing {fault:?} in x's extent store");
        inject(&node.sim, fault, &store);
        // A whole-extent write goes straight to the store: it fails, at once.
        let bypass_at = 8 * MIB + round * MIB;
        expect_eio(
            node.tracked_write("x", &mut tx, bypass_at, MIB).await,
            &format!("{label}: whole-extent write"),
        );
        // Small writes are durable in the oplog and acknowledged; nothing drains, so once the
        // log is full they fail with the drain's error instead of waiting for it.
        let mut acknowledged = 0;
        let mut failed = None;
        for i in 0..128 {
            let offset = 16 * MIB + i * 256 * 1024;
            match node.tracked_write("x", &mut tx, offset, 256 * 1024).await {
                Ok(()) => acknowledged += 1,
                Err(IoError::Io(e)) => {
                    failed = Some(e);
                    break;
                }
                Err(other) => panic!("{label}: small write failed with {other:?}, not EIO"),
            }
        }
        let failed = failed.unwrap_or_else(|| {
            panic!("{label}: 32 MiB of small writes acknowledged into a 16 MiB oplog that cannot drain")
        });
        eprintln!("{label}: {acknowledged} small writes acknowledged, then: {failed}");
        // Later writes are answered too, never left waiting: acknowledged if the log still
        // has room for them (a smaller record may fit where a larger one did not), else EIO.
        for i in 0..4 {
            match node
                .tracked_write("x", &mut tx, 56 * MIB + i * 256 * 1024, 256 * 1024)
                .await
            {
                Ok(()) | Err(IoError::Io(_)) => {}
                Err(other) => panic!("{label}: write into a full oplog failed with {other:?}"),
            }
        }
        other_vdisk_is_served(&node, &mut ty, round, &label).await;
        node.verify("x", &tx, &format!("{label}: reads of x")).await;

        node.sim.clear_failures();
        let label = format!("{label}, then healed");
        let took = write_until_ok(&node, "x", &mut tx, 60 * MIB, 8192, true, &label).await;
        write_until_ok(&node, "x", &mut tx, bypass_at, MIB, true, &label).await;
        eprintln!("{label}: writes succeed again after {took:?}");
        node.verify("x", &tx, &label).await;
        node.verify("y", &ty, &label).await;
    }
    // Failing reads: each block of x reads as its data (cached) or EIO, never as other
    // bytes; y is served; once healed, x reads back whole.
    node.sim.fail_reads(Some(&store), Times::Always);
    let got = node.read_blocks("x", tx.slots.len()).await;
    let mut eio = 0;
    for (index, result) in got.iter().enumerate() {
        let offset = index as u64 * BLOCK;
        match result {
            Err(IoError::Io(_)) => eio += 1,
            Ok(block) if tx.slots[index].allowed().any(|c| c.matches(offset, block)) => {}
            other => panic!("failing reads: block at {offset} of x read as {other:?}"),
        }
    }
    assert!(eio > 0, "failing reads: every read of x succeeded");
    other_vdisk_is_served(&node, &mut ty, 2, "failing reads in x's extent store").await;
    node.sim.clear_failures();
    node.verify("x", &tx, "failing reads, then healed").await;

    // Everything acknowledged is durable, also what was rewritten after failed syncs.
    node.freeze_disk().await;
    node.cut_and_restart(
        CutPolicy::Random { seed: 3 },
        "extent-store EIO test, power cut seed 3",
    )
    .await;
    node.verify(
        "x",
        &tx,
        "after extent-store faults, a power cut and a restart",
    )
    .await;
    node.verify(
        "y",
        &ty,
        "after extent-store faults, a power cut and a restart",
    )
    .await;
    node.stop().await;
    eprintln!("extent-store EIO test took {:?}", started.elapsed());
}

#[tokio::test(flavor = "current_thread")]
async fn failing_oplog_writes_and_syncs_fail_requests_and_heal() {
    let _cpu = CPU.read().await;
    let started = Instant::now();
    let mut node = Node::start(Settings {
        drain_idle: Duration::from_millis(10),
        ..Settings::default()
    })
    .await;
    let (x, mut tx, mut ty) = two_vdisks(&node).await;
    let log = oplog_dir(x);
    for (round, fault) in [Fault::Writes, Fault::Syncs].into_iter().enumerate() {
        let round = round as u64;
        let label = format!("failing {fault:?} in x's oplog");
        // An older record of the range the whole-extent write below covers: in the log, or
        // drained but still in a segment a replay would read.
        let bypass_at = 8 * MIB + round * MIB;
        node.tracked_write("x", &mut tx, bypass_at + 4096, 8192)
            .await
            .unwrap_or_else(|e| panic!("{label}: write before the fault: {e}"));
        inject(&node.sim, fault, &log);
        for i in 0..4 {
            expect_eio(
                node.tracked_write("x", &mut tx, 20 * MIB + i * 8192, 8192)
                    .await,
                &format!("{label}: small write"),
            );
        }
        expect_eio(
            node.tracked_zero("x", &mut tx, 21 * MIB, 16384, true).await,
            &format!("{label}: write-zeroes"),
        );
        // A whole-extent write over that record lands in the store, but its barrier record
        // cannot be logged (or, not yet drained, the record makes it go through the log).
        expect_eio(
            node.tracked_write("x", &mut tx, bypass_at, MIB).await,
            &format!("{label}: whole-extent write over an older record"),
        );
        // Where no record of the range is left for a replay, a whole-extent write needs no
        // barrier: it succeeds while the log fails.
        node.tracked_write("x", &mut tx, 40 * MIB + round * MIB, MIB)
            .await
            .unwrap_or_else(|e| {
                panic!("{label}: whole-extent write where the log holds nothing failed: {e}")
            });
        other_vdisk_is_served(&node, &mut ty, round, &label).await;
        node.verify("x", &tx, &format!("{label}: reads of x")).await;

        node.sim.clear_failures();
        let label = format!("{label}, then healed");
        let took = write_until_ok(&node, "x", &mut tx, 20 * MIB, 8192, true, &label).await;
        write_until_ok(&node, "x", &mut tx, bypass_at, MIB, true, &label).await;
        node.tracked_zero("x", &mut tx, 21 * MIB, 16384, true)
            .await
            .unwrap_or_else(|e| panic!("{label}: write-zeroes failed: {e}"));
        eprintln!("{label}: writes succeed again after {took:?}");
        node.verify("x", &tx, &label).await;
        node.verify("y", &ty, &label).await;
    }
    node.freeze_disk().await;
    node.cut_and_restart(
        CutPolicy::Random { seed: 4 },
        "oplog EIO test, power cut seed 4",
    )
    .await;
    node.verify("x", &tx, "after oplog faults, a power cut and a restart")
        .await;
    node.verify("y", &ty, "after oplog faults, a power cut and a restart")
        .await;
    node.stop().await;
    eprintln!("oplog EIO test took {:?}", started.elapsed());
}

// ---------------------------------------------------------------------------------------------
// 4. Corruption on disk
// ---------------------------------------------------------------------------------------------

fn u32_at(data: &[u8], at: u64) -> u32 {
    u32::from_le_bytes(data[at as usize..at as usize + 4].try_into().unwrap())
}

fn u64_at(data: &[u8], at: u64) -> u64 {
    u64::from_le_bytes(data[at as usize..at as usize + 8].try_into().unwrap())
}

/// One record of an oplog segment file, located by reading the file as docs/oplog-format.md
/// describes it.
#[derive(Clone, Debug)]
struct LogRecord {
    file: PathBuf,
    /// File offset of the batch holding it, and of the record itself.
    batch_at: u64,
    record_at: u64,
    kind: u8,
    offset: u64,
    length: u64,
    chunks: u64,
}

/// Every record of every batch of the active segment files under `dir`, in file order.
fn oplog_records(sim: &SimFs, dir: &Path) -> Vec<LogRecord> {
    let mut records = Vec::new();
    for file in sim.files() {
        let name = file.path.file_name().unwrap().to_string_lossy().to_string();
        if !file.path.starts_with(dir) || !name.starts_with("seg-") {
            continue;
        }
        let data = sim.read_live(&file.path).expect("segment file");
        // Segment header, slot 0: magic "AOPS", version 3, state 1 = active, segment id.
        if data.len() < 8192 || &data[0..4] != b"AOPS" || data[4] != 3 || data[5] != 1 {
            continue;
        }
        let segment_id = u64_at(&data, 24);
        let mut at = 8192u64;
        while at + 72 <= data.len() as u64 {
            // Batch header: magic "AOPB", version, flags (bit 0: seal), segment id at 16,
            // record count at 56, batch bytes at 60, then 24-byte table entries from 72.
            let batch = &data[at as usize..];
            if &batch[0..4] != b"AOPB" || batch[4] != 3 || u64_at(batch, 16) != segment_id {
                break;
            }
            if batch[5] & 1 == 1 {
                break;
            }
            let count = u64::from(u32_at(batch, 56));
            let bytes = u64::from(u32_at(batch, 60));
            let mut record_at = at + 72 + 24 * count;
            for i in 0..count {
                let entry = 72 + 24 * i;
                let (offset, length, kind) = (
                    u64_at(batch, entry),
                    u64_at(batch, entry + 8),
                    batch[entry as usize + 16],
                );
                assert_eq!(
                    &data[record_at as usize..record_at as usize + 4],
                    b"AOPR",
                    "record {i} of the batch at {at} of {}",
                    file.path.display()
                );
                let chunks = if kind == 1 { length.div_ceil(4096) } else { 0 };
                records.push(LogRecord {
                    file: file.path.clone(),
                    batch_at: at,
                    record_at,
                    kind,
                    offset,
                    length,
                    chunks,
                });
                // Record: 40-byte header, 4-byte CRC per chunk, payload (writes only).
                record_at += 40 + 4 * chunks + if kind == 1 { length } else { 0 };
            }
            at += bytes;
        }
    }
    records
}

/// Reads every block of `vdisk`: blocks in `damaged` must fail with EIO, every other block
/// must read exactly as the model says. Returns how many reads failed.
async fn check_damage(node: &Node, vdisk: &str, tracker: &Tracker, damaged: &[usize], label: &str) {
    let got = node.read_blocks(vdisk, tracker.slots.len()).await;
    let mut bad = Vec::new();
    for (index, result) in got.iter().enumerate() {
        let offset = index as u64 * BLOCK;
        let slot = &tracker.slots[index];
        match (damaged.contains(&index), result) {
            (true, Err(IoError::Io(_))) => {}
            (true, other) => bad.push(format!(
                "damaged block at {offset}: expected EIO, got {}",
                match other {
                    Ok(block) => format!("data: {}", describe(block)),
                    Err(e) => format!("{e:?}"),
                }
            )),
            (false, Ok(block)) if slot.allowed().any(|c| c.matches(offset, block)) => {}
            (false, other) => bad.push(format!(
                "block at {offset}: expected {:?}, got {}",
                slot.acked,
                match other {
                    Ok(block) => describe(block),
                    Err(e) => format!("{e:?}"),
                }
            )),
        }
    }
    assert!(
        bad.is_empty(),
        "{label}: {} of {} blocks of {vdisk} wrong; first ones:\n{}",
        bad.len(),
        got.len(),
        bad.iter().take(20).cloned().collect::<Vec<_>>().join("\n")
    );
}

/// Rewrites the damaged blocks with new data: writing into damage works, and they read
/// back.
async fn rewrite_damage(
    node: &Node,
    vdisk: &str,
    tracker: &mut Tracker,
    damaged: &[usize],
    label: &str,
) {
    for &index in damaged {
        node.tracked_write(vdisk, tracker, index as u64 * BLOCK, BLOCK)
            .await
            .unwrap_or_else(|e| panic!("{label}: rewriting a damaged block failed: {e}"));
    }
    node.verify(
        vdisk,
        tracker,
        &format!("{label}: after rewriting the damage"),
    )
    .await;
}

/// Where bytes are flipped in an oplog, and what that damages.
#[derive(Clone, Copy, Debug)]
enum LogRot {
    /// A byte of the first payload chunk of a record: that chunk's 4 KiB are lost.
    Payload,
    /// A byte of a record's header: the record's whole range is lost.
    RecordHeader,
    /// A byte of a batch header: the batch is recovered from its records' own headers.
    BatchHeader,
}

/// One 8 KiB write per batch (one at a time), at distinct offsets of vdisk "c".
async fn write_200_records(node: &Node, tc: &mut Tracker) {
    for i in 0..200 {
        node.tracked_write("c", tc, i * 64 * 1024, 8192)
            .await
            .expect("write c");
    }
}

/// The middle one of the 8 KiB write records `write_200_records` left in the oplog of `c`.
fn middle_of_200_writes(sim: &SimFs, c: VdiskId, label: &str) -> LogRecord {
    let records: Vec<LogRecord> = oplog_records(sim, &oplog_dir(c))
        .into_iter()
        .filter(|r| r.kind == 1)
        .collect();
    assert!(
        records.len() >= 200,
        "{label}: found {} write records in c's oplog, expected 200",
        records.len()
    );
    let victim = records[records.len() / 2].clone();
    assert_eq!(victim.length, 8192, "{label}: {victim:?}");
    victim
}

async fn oplog_rot(rot: LogRot) {
    let _cpu = CPU.read().await;
    let label = format!("oplog rot in a {rot:?}");
    let mut node = Node::start_without_background_drain().await;
    let c = node.create("c", 16 * MIB, 1).await;
    node.create("d", 8 * MIB, 1).await;
    let mut tc = Tracker::new(16 * MIB, 0);
    let mut td = Tracker::new(8 * MIB, 1 << 40);
    write_200_records(&node, &mut tc).await;
    node.tracked_write("d", &mut td, 0, MIB)
        .await
        .expect("write d");
    for i in 0..50 {
        node.tracked_write("d", &mut td, MIB + i * 32 * 1024, 8192)
            .await
            .expect("write d");
    }
    node.stop().await;

    let victim = middle_of_200_writes(&node.sim, c, &label);
    let first_block = (victim.offset / BLOCK) as usize;
    let (at, damaged, lost_ranges) = match rot {
        LogRot::Payload => (
            victim.record_at + 40 + 4 * victim.chunks + 100,
            vec![first_block],
            1,
        ),
        // The low byte of the record's vdisk offset.
        LogRot::RecordHeader => (victim.record_at + 16, vec![first_block, first_block + 1], 1),
        // The low byte of the batch's first sequence number.
        LogRot::BatchHeader => (victim.batch_at + 48, vec![], 0),
    };
    eprintln!(
        "{label}: flipping byte {at} of {} ({victim:?}), damaging blocks {damaged:?}",
        victim.file.display()
    );
    node.sim.flip_bits(&victim.file, at, 0x5a).expect("flip");

    node.restart(&format!("{label}: restart over the damage"))
        .await;
    let lost = node.stats("c").oplog_lost_ranges;
    assert_eq!(lost, lost_ranges, "{label}: oplog_lost_ranges of c");
    assert_eq!(
        node.stats("d").oplog_lost_ranges,
        0,
        "{label}: d lost nothing"
    );
    check_damage(&node, "c", &tc, &damaged, &label).await;
    node.verify("d", &td, &format!("{label}: the other vdisk"))
        .await;
    if !damaged.is_empty() {
        assert!(
            node.stats("c").errors > 0,
            "{label}: failed reads are not counted"
        );
    }
    // The loss is durable (the extent store marked the blocks lost): still EIO after another
    // restart, until rewritten.
    node.stop().await;
    node.restart(&format!("{label}: second restart")).await;
    check_damage(
        &node,
        "c",
        &tc,
        &damaged,
        &format!("{label}, second restart"),
    )
    .await;
    rewrite_damage(&node, "c", &mut tc, &damaged, &label).await;
    node.stop().await;
}

/// Rot the running node's drain finds (not replay): the drain records the rotted block lost
/// and goes on; before, it failed and retried forever, and the re-shard waiting for it never
/// finished.
#[tokio::test(flavor = "current_thread")]
async fn rot_found_by_a_running_drain_costs_its_own_block_only() {
    let _cpu = CPU.read().await;
    let label = "rot found by a running drain";
    let mut node = Node::start_without_background_drain().await;
    let c = node.create("c", 16 * MIB, 1).await;
    let mut tc = Tracker::new(16 * MIB, 0);
    write_200_records(&node, &mut tc).await;
    let victim = middle_of_200_writes(&node.sim, c, label);
    let damaged = [(victim.offset / BLOCK) as usize];
    let at = victim.record_at + 40 + 4 * victim.chunks + 100;
    node.sim.flip_bits(&victim.file, at, 0x5a).expect("flip");
    // A re-shard drains the old shard's whole oplog before the new shards serve.
    tokio::time::timeout(Duration::from_secs(60), node.engine().set_shards("c", 2))
        .await
        .expect("the re-shard's drain finishes")
        .expect("re-shard");
    check_damage(&node, "c", &tc, &damaged, label).await;
    node.stop().await;
    node.restart(&format!("{label}: restart")).await;
    check_damage(&node, "c", &tc, &damaged, &format!("{label}, restart")).await;
    rewrite_damage(&node, "c", &mut tc, &damaged, label).await;
    node.stop().await;
}

#[tokio::test(flavor = "current_thread")]
async fn rot_in_an_oplog_payload_costs_its_own_block_only() {
    oplog_rot(LogRot::Payload).await;
}

#[tokio::test(flavor = "current_thread")]
async fn rot_in_an_oplog_record_header_costs_its_record_only() {
    oplog_rot(LogRot::RecordHeader).await;
}

#[tokio::test(flavor = "current_thread")]
async fn rot_in_an_oplog_batch_header_loses_nothing() {
    oplog_rot(LogRot::BatchHeader).await;
}

/// Where bytes are flipped in an egroup file (docs/extent-store-format.md), and what that
/// damages.
#[derive(Clone, Copy, Debug)]
enum StoreRot {
    /// The checksum block of extent 1: every block of that extent.
    ChecksumBlock,
    /// The egroup header: every block of the egroup.
    Header,
    /// Data block 9 of extent 2: that block.
    DataBlock,
}

async fn extent_store_rot(rot: StoreRot) {
    let _cpu = CPU.read().await;
    let label = format!("extent-store rot in a {rot:?}");
    let mut node = Node::start(Settings::default()).await;
    let c = node.create("c", 8 * MIB, 1).await;
    node.create("d", 8 * MIB, 1).await;
    let mut tc = Tracker::new(8 * MIB, 0);
    let mut td = Tracker::new(8 * MIB, 1 << 40);
    // Every block of c written (whole extents), then small overwrites through the oplog.
    for (name, t) in [("c", &mut tc), ("d", &mut td)] {
        for i in 0..8 {
            node.tracked_write(name, t, i * MIB, MIB)
                .await
                .expect("write");
        }
        for i in 0..40 {
            node.tracked_write(name, t, i * 200 * 1024, 8192)
                .await
                .expect("write");
        }
    }
    // A restart drains every oplog into the extent store.
    node.stop().await;
    node.restart(&format!("{label}: restart that drains")).await;
    node.verify("c", &tc, &label).await;
    node.stop().await;

    let egroup = extents_dir(c).join(format!("{:016x}.egroup", 0));
    let blocks_per_extent = (MIB / BLOCK) as usize;
    let (at, damaged): (u64, Vec<usize>) = match rot {
        // Extent 1's checksum block is at 4096 × (1 + 1); flip the CRC slot 0 of its entry 7.
        StoreRot::ChecksumBlock => (
            4096 * 2 + 12 * 7 + 4,
            (blocks_per_extent..2 * blocks_per_extent).collect(),
        ),
        // The header's vdisk id field.
        StoreRot::Header => (24, (0..4 * blocks_per_extent).collect()),
        // Data block b of extent e is at 4096 × (5 + 256·e + b).
        StoreRot::DataBlock => (
            4096 * (5 + 256 * 2 + 9) + 123,
            vec![2 * blocks_per_extent + 9],
        ),
    };
    eprintln!(
        "{label}: flipping byte {at} of {}, damaging {} blocks",
        egroup.display(),
        damaged.len()
    );
    node.sim.flip_bits(&egroup, at, 0x5a).expect("flip");

    node.restart(&format!("{label}: restart over the damage"))
        .await;
    check_damage(&node, "c", &tc, &damaged, &label).await;
    node.verify("d", &td, &format!("{label}: the other vdisk"))
        .await;
    assert!(
        node.stats("c").errors > 0,
        "{label}: failed reads are not counted"
    );
    assert_eq!(
        node.stats("d").errors,
        0,
        "{label}: the other vdisk had errors"
    );
    rewrite_damage(&node, "c", &mut tc, &damaged, &label).await;
    node.stop().await;
    node.restart(&format!("{label}: restart after the rewrite"))
        .await;
    node.verify("c", &tc, &format!("{label}: after rewrite and restart"))
        .await;
    node.stop().await;
}

#[tokio::test(flavor = "current_thread")]
async fn rot_in_a_checksum_block_costs_its_extent_only() {
    extent_store_rot(StoreRot::ChecksumBlock).await;
}

#[tokio::test(flavor = "current_thread")]
async fn rot_in_an_egroup_header_costs_its_egroup_only() {
    extent_store_rot(StoreRot::Header).await;
}

#[tokio::test(flavor = "current_thread")]
async fn rot_in_a_data_block_costs_that_block_only() {
    extent_store_rot(StoreRot::DataBlock).await;
}

// ---------------------------------------------------------------------------------------------
// 6. A slow disk does not stall other vdisks on the same reactor
// ---------------------------------------------------------------------------------------------

/// Two vdisks whose shards both live on reactor 0 (the only one). Vdisk b's files answer
/// after 50 ms; 32 reads of b stay in flight while a reads cached blocks one at a time. If the
/// reactor ever waited for b's disk, a's reads would take about as long as b's. This is a
/// functional check that disk I/O never blocks the reactor, with a wide margin (p99 under
/// 10 ms against a 50 ms disk), not a benchmark.
#[tokio::test(flavor = "current_thread")]
async fn a_slow_disk_does_not_stall_cached_reads_of_another_vdisk() {
    // Alone: no CPU-heavy test of this binary runs beside it.
    let _cpu = CPU.write().await;
    const DISK_DELAY: Duration = Duration::from_millis(50);
    let mut node = Node::start(Settings {
        reactors: 1,
        cache_bytes: 64 * MIB,
        ..Settings::default()
    })
    .await;
    node.create("a", 4 * MIB, 1).await;
    let b = node.create("b", 64 * MIB, 1).await;
    let mut ta = Tracker::new(4 * MIB, 0);
    let mut tb = Tracker::new(64 * MIB, 1 << 40);
    node.tracked_write("a", &mut ta, 0, MIB)
        .await
        .expect("write a");
    for i in 0..64 {
        node.tracked_write("b", &mut tb, i * MIB, MIB)
            .await
            .expect("write b");
    }
    // a's blocks go into the cache (read twice: the multi-touch pool).
    node.verify("a", &ta, "filling the cache").await;
    node.verify("a", &ta, "filling the cache").await;
    let hits_before = node.engine().cache_stats().0;
    let hits_before = hits_before.single_touch_hits + hits_before.multi_touch_hits;

    for area in [extents_dir(b), oplog_dir(b)] {
        node.sim.set_delay(Some(&area), DISK_DELAY);
    }
    let expected_a: Vec<Vec<u8>> = (0..256u64)
        .map(|block| match ta.slots[block as usize].acked {
            Content::Data(seq) => pattern(block * BLOCK, seq, BLOCK as usize),
            Content::Zeros => vec![0; BLOCK as usize],
        })
        .collect();
    let engine = node.engine().clone();
    let (a_latencies, b_latencies, b_in_flight_min) = node
        .on_reactor(0, "a", Duration::from_secs(120), move |a| async move {
            let b = engine.open("b").expect("open b");
            drop(engine);
            let stop = std::rc::Rc::new(std::cell::Cell::new(false));
            let in_flight = std::rc::Rc::new(std::cell::Cell::new(0u32));
            let next_block = std::rc::Rc::new(std::cell::Cell::new(0u64));
            let mut readers = Vec::new();
            for _ in 0..32 {
                let (b, stop, in_flight, next_block) = (
                    b.clone(),
                    stop.clone(),
                    in_flight.clone(),
                    next_block.clone(),
                );
                readers.push(tokio::task::spawn_local(async move {
                    let mut latencies = Vec::new();
                    while !stop.get() {
                        // Every block of b read once: never a cache hit.
                        let block = next_block.get();
                        next_block.set(block + 1);
                        in_flight.set(in_flight.get() + 1);
                        let started = Instant::now();
                        let result = b.read(block * BLOCK, BLOCK as u32).await;
                        latencies.push(started.elapsed());
                        in_flight.set(in_flight.get() - 1);
                        result.expect("read of b");
                    }
                    latencies
                }));
            }
            // Let b's reads reach its disk.
            tokio::time::sleep(Duration::from_millis(100)).await;
            let mut a_latencies = Vec::new();
            let mut b_in_flight_min = u32::MAX;
            let mut rng = Rng::new(6);
            for _ in 0..400 {
                let block = rng.below(256);
                b_in_flight_min = b_in_flight_min.min(in_flight.get());
                let started = Instant::now();
                let data = a
                    .read(block * BLOCK, BLOCK as u32)
                    .await
                    .expect("read of a");
                a_latencies.push(started.elapsed());
                assert!(
                    data[..] == expected_a[block as usize][..],
                    "a's block {block} read back wrong"
                );
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            stop.set(true);
            let mut b_latencies = Vec::new();
            for reader in readers {
                b_latencies.extend(reader.await.expect("reader of b"));
            }
            (a_latencies, b_latencies, b_in_flight_min)
        })
        .await;
    node.sim.clear_delays();
    let hits_after = node.engine().cache_stats().0;
    let hits_after = hits_after.single_touch_hits + hits_after.multi_touch_hits;

    let percentile = |latencies: &[Duration], p: f64| {
        let mut sorted = latencies.to_vec();
        sorted.sort();
        sorted[((sorted.len() - 1) as f64 * p) as usize]
    };
    let (a_p50, a_p99, a_max) = (
        percentile(&a_latencies, 0.5),
        percentile(&a_latencies, 0.99),
        percentile(&a_latencies, 1.0),
    );
    let b_min = percentile(&b_latencies, 0.0);
    eprintln!(
        "a (cached, QD1): {} reads, p50 {a_p50:?}, p99 {a_p99:?}, max {a_max:?}; \
         b (disk {DISK_DELAY:?}, QD32): {} reads, fastest {b_min:?}, p50 {:?}; \
         b reads in flight while a read: at least {b_in_flight_min}",
        a_latencies.len(),
        b_latencies.len(),
        percentile(&b_latencies, 0.5)
    );
    // The setting is what it claims: b's reads went to its slow disk, 32 at a time, all
    // along, and a's came from the cache.
    assert!(
        b_min >= DISK_DELAY,
        "b's reads did not wait for the disk: {b_min:?}"
    );
    assert!(
        b_latencies.len() >= 64,
        "b made no progress: {} reads",
        b_latencies.len()
    );
    assert!(
        b_in_flight_min >= 16,
        "only {b_in_flight_min} of b's reads were in flight during a's reads"
    );
    assert!(
        hits_after - hits_before >= 400,
        "a's reads were not served from the cache ({} hits)",
        hits_after - hits_before
    );
    assert!(
        a_p99 < Duration::from_millis(10),
        "cached reads of a stalled behind b's slow disk: p99 {a_p99:?} (p50 {a_p50:?}, max {a_max:?})"
    );
    node.stop().await;
}

/// A vdisk whose copy identity must be renewed at a start (its file gone) on a disk that
/// refuses writes comes up all the same, with an identity that matches no earlier one; once
/// the disk takes writes again, the next start writes a new identity and keeps it after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_identity_that_cannot_be_written_never_keeps_a_vdisk_offline() {
    let mut node = Node::start(Settings::default()).await;
    let id = node.create("x", 8 * MIB, 1).await;
    node.write("x", 0, pattern(0, 1, BLOCK as usize))
        .await
        .unwrap();
    let identity_of = |node: &Node| {
        node.engine()
            .shared_by_id(id)
            .unwrap()
            .expect("x is served")
            .copy_identity
    };
    let first = identity_of(&node);
    node.stop().await;
    node.restart("unchanged").await;
    assert_eq!(identity_of(&node), first, "kept across a clean restart");
    node.stop().await;

    let file = extents_dir(id).join(ashlar_storage::copy_identity::COPY_IDENTITY_FILE);
    node.sim.remove_file(&file).await.unwrap();
    node.sim.fail_writes(Some(&extents_dir(id)), Times::Always);
    node.restart("identity file gone, writes failing").await;
    let unwritten = identity_of(&node);
    assert_ne!(unwritten, first);
    assert_eq!(
        node.read("x", 0, BLOCK).await.unwrap()[..],
        pattern(0, 1, BLOCK as usize)[..]
    );
    node.stop().await;

    node.sim.clear_failures();
    node.restart("writes work again").await;
    let renewed = identity_of(&node);
    assert_ne!(renewed, unwritten, "the files disagreed: a new identity");
    node.stop().await;
    node.restart("after the renewal").await;
    assert_eq!(identity_of(&node), renewed);
}

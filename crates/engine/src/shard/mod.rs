//! A shard controller: the single-threaded owner of some offset ranges of one vdisk on one
//! reactor. It owns its oplog and its view of the extent store for its ranges, and uses its
//! reactor's read cache.
//!
//! The controller is one event loop (`controller`): it selects the next event (a client
//! request, a finished piece of storage work, a control command, the drain's triggers),
//! applies it to its state, and checks its invariants. Storage work (disk reads, oplog
//! appends, extent-store writes, drain steps) runs as futures the loop owns (`work`); they
//! hold handles to the oplog and extent store but never touch controller state: what they
//! produce is applied by the loop when they finish. Connections on the same reactor may also
//! read cached blocks directly (`inline`), synchronously, between two events.
//!
//! All state is touched only from this reactor thread.

mod appends;
mod controller;
mod holds;
mod inline;
mod unreplicated;
mod work;

pub use inline::read_cached_now;
pub use unreplicated::{MAX_UNREPLICATED_CHUNKS, UNREPLICATED_CHUNK_BYTES};
pub use work::{drain_all, remove_oplog_dir};

use crate::cache::BlockCache;
use crate::drain_budget::DrainBudget;
use crate::reactor::{ReactorId, ReplyRoute};
use crate::replication::ReplicationSlot;
use ashlar_core::{BlockStatusRun, Epoch, IoError, VdiskId};
use ashlar_storage::disk::Disk;
use ashlar_storage::extent_store::{ExtentStore, ExtentStoreConfig, JournalConfig};
use ashlar_storage::fs::NodeFs;
use ashlar_storage::oplog::{Oplog, OplogConfig};
use bytes::Bytes;
use std::cell::RefCell;
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, watch};

/// What a shard is asked to do. Ranges never cross the shard's range boundaries: the vdisk
/// handle splits requests before sending them.
#[derive(Debug)]
pub enum ShardOp {
    Read {
        offset: u64,
        length: u64,
    },
    Write {
        offset: u64,
        data: Bytes,
    },
    /// Reads back as zeros; `punch_hole` lets storage be freed.
    WriteZeroes {
        offset: u64,
        length: u64,
        punch_hole: bool,
    },
    BlockStatus {
        offset: u64,
        length: u64,
    },
    /// Answered (`Done`) once every write the shard took before it has finished: durable, or
    /// failed. The node sends it with the vdisk's gate shut, before reading the vdisk to
    /// resynchronize its copies, so that no write still on its way is missed by the read.
    /// `offset` only picks the shard.
    Settle {
        offset: u64,
    },
    /// Online resync of one chunk of a replicated vdisk that serves: new writes overlapping
    /// `[offset, offset + length)` are held back, the ones in flight finish, the chunk is read
    /// and handed to the replicator (`Replicator::resync`), then the held writes go on.
    /// Answered `Resynced` with what the replicator did.
    ResyncChunk {
        offset: u64,
        length: u64,
    },
    /// Answered `Unreplicated` at once with the chunks failed writes touched since the last
    /// take (`None`: not known), starting a new set. Sent with the gate shut and the shard
    /// settled, when this node claims the vdisk again. `offset` only picks the shard.
    TakeUnreplicated {
        offset: u64,
    },
}

#[derive(Debug)]
pub enum ShardReply {
    Data(Bytes),
    Done,
    Status(Vec<BlockStatusRun>),
    Resynced(crate::replication::ChunkResync),
    /// Chunk indexes (of `UNREPLICATED_CHUNK_BYTES`), `None` when not known.
    Unreplicated(Option<Vec<u64>>),
}

#[derive(Debug)]
pub enum ShardError {
    /// This shard no longer serves the range (the shard map changed): resend on the new map.
    Retired,
    Io(IoError),
}

pub struct ShardRequest {
    pub op: ShardOp,
    pub reply: oneshot::Sender<Result<ShardReply, ShardError>>,
    /// How the reply gets back to the requester's reactor cheaply; `None` off the reactors.
    pub route: Option<ReplyRoute>,
}

impl ShardRequest {
    /// Sends the outcome back to the requester, through its reactor's reply route if any.
    fn answer(self, result: Result<ShardReply, ShardError>) {
        send_reply(self.reply, self.route, result);
    }
}

pub(crate) fn send_reply(
    reply: oneshot::Sender<Result<ShardReply, ShardError>>,
    route: Option<ReplyRoute>,
    result: Result<ShardReply, ShardError>,
) {
    match route {
        Some(route) => route.deliver(move || {
            let _ = reply.send(result);
        }),
        None => {
            let _ = reply.send(result);
        }
    }
}

pub enum ShardControl {
    /// Stop serving: answer queued requests with `Retired`, finish in-flight ones, then either
    /// drain the oplog into the extent store (`discard == false`) or drop it (vdisk deleted).
    Retire {
        discard: bool,
        done: oneshot::Sender<Result<(), String>>,
    },
}

/// Control commands queued per shard. Only the engine sends them, one at a time per shard.
pub const SHARD_CONTROL_QUEUE_LIMIT: usize = 4;

/// Everything needed to start a shard controller.
#[derive(Clone, Debug)]
pub struct ShardSpec {
    pub vdisk: VdiskId,
    pub epoch: Epoch,
    pub index: u32,
    pub oplog_dir: PathBuf,
    pub oplog_capacity_bytes: u64,
    pub disks: Vec<Disk>,
    pub max_open_egroups: usize,
    pub max_writing_egroups: usize,
    pub writes_in_flight_per_egroup: usize,
    pub drain_batch_bytes: u64,
    /// The node-wide budget every drain step takes its memory from.
    pub drain_budget: DrainBudget,
    pub drain_idle: Duration,
    pub request_queue_limit: usize,
    /// Client requests a controller works on at once (reads in flight, writes waiting for
    /// their commit); more wait in the request queue.
    pub max_requests_in_flight: usize,
    /// The filesystem of the node's disks (oplog and extent store).
    pub fs: NodeFs,
    /// The vdisk's replicator, when the node replicates its writes.
    pub replication: Arc<ReplicationSlot>,
    /// Where drain steps put whole blocks: the shard's block log (`None`: home).
    pub journal: Option<JournalConfig>,
}

/// Names one shard controller among those of its reactor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ShardKey {
    pub vdisk: VdiskId,
    pub epoch: Epoch,
    pub index: u32,
}

/// How other threads reach a running shard.
#[derive(Clone)]
pub struct ShardLink {
    pub requests: mpsc::Sender<ShardRequest>,
    pub control: mpsc::Sender<ShardControl>,
    pub oplog_gauges: Arc<OplogGauges>,
    pub key: ShardKey,
    /// The reactor the controller runs on; `None` when started off the reactors (tests).
    pub reactor: Option<ReactorId>,
}

/// What a shard's oplog holds, published by its controller for the stats.
#[derive(Default, Debug)]
pub struct OplogGauges {
    /// Bytes of segment space in use (batches written and not yet freed). A drained log
    /// keeps its tail segment until it fills, so this need not return to zero.
    pub usage_bytes: AtomicU64,
    /// Bytes of vdisk address space whose newest data is only in the log (not yet drained
    /// into the extent store): zero once everything acknowledged was drained.
    pub live_bytes: AtomicU64,
}

impl OplogGauges {
    pub(crate) fn publish(&self, oplog: &Oplog<NodeFs>) {
        self.usage_bytes
            .store(oplog.usage_bytes(), Ordering::Relaxed);
        self.live_bytes.store(oplog.live_bytes(), Ordering::Relaxed);
    }
}

/// The oplog and extent store of one shard, shared by the controller and its storage work.
pub(crate) struct Storage {
    pub oplog: Oplog<NodeFs>,
    pub store: ExtentStore<NodeFs>,
}

/// The id written into every file of a shard's oplog, so a file of another log is refused.
pub fn oplog_id(vdisk: VdiskId, epoch: Epoch, shard: u32) -> u64 {
    (vdisk.0 << 32) ^ (epoch.0 << 12) ^ u64::from(shard)
}

/// Starts a shard controller on the current reactor. It serves nothing until `gate` is true,
/// so a new shard map can be published before the old shards have handed over.
pub async fn start_shard(
    spec: ShardSpec,
    cache: Rc<RefCell<BlockCache>>,
    gate: watch::Receiver<bool>,
) -> Result<ShardLink, String> {
    let config = OplogConfig::new(
        spec.oplog_dir.clone(),
        oplog_id(spec.vdisk, spec.epoch, spec.index),
        spec.oplog_capacity_bytes,
    );
    // A shard's log directory is new (older logs were drained at startup or hand-over), so
    // there is nothing to report from its replay.
    let (oplog, _report) = Oplog::open(spec.fs.clone(), config)
        .await
        .map_err(|e| format!("cannot open oplog {}: {e}", spec.oplog_dir.display()))?;
    let store = ExtentStore::new(
        spec.fs.clone(),
        ExtentStoreConfig {
            vdisk: spec.vdisk,
            disks: spec.disks.clone(),
            max_open_egroups: spec.max_open_egroups,
            max_writing_egroups: spec.max_writing_egroups,
            writes_in_flight_per_egroup: spec.writes_in_flight_per_egroup,
            journal: spec.journal.clone(),
        },
    );
    let (request_tx, request_rx) = mpsc::channel(spec.request_queue_limit);
    let (control_tx, control_rx) = mpsc::channel(SHARD_CONTROL_QUEUE_LIMIT);
    let oplog_gauges = Arc::new(OplogGauges::default());
    oplog_gauges.publish(&oplog);
    let key = ShardKey {
        vdisk: spec.vdisk,
        epoch: spec.epoch,
        index: spec.index,
    };
    let storage = Rc::new(Storage { oplog, store });
    let registration = inline::register(key, storage.clone(), cache.clone());
    let controller =
        controller::Controller::new(spec, storage, cache, registration, oplog_gauges.clone());
    tokio::task::spawn_local(controller.run(request_rx, control_rx, gate));
    Ok(ShardLink {
        requests: request_tx,
        control: control_tx,
        oplog_gauges,
        key,
        reactor: crate::reactor::current_reactor(),
    })
}

/// Whether two half-open byte ranges overlap.
fn overlaps(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < b.1 && b.0 < a.1
}

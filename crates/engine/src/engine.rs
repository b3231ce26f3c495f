//! The engine: owns the reactors, the vdisk catalog and every vdisk's control state. This is
//! the control half of each vdisk's primary controller: it creates, resizes, re-shards and
//! deletes vdisks. Control operations are serialized by one async mutex; none runs per I/O.

use crate::cache::{BlockCache, CacheCounters};
use crate::catalog::{self, CatalogError, VdiskRecord};
use crate::config::{EngineConfig, MAX_SHARDS, MIN_OPLOG_BYTES_PER_SHARD};
use crate::drain_budget::DrainBudget;
use crate::gate::ServeGate;
use crate::reactor::{ReactorId, ReactorPool};
use crate::replication::{ReplicationSlot, Replicator};
use crate::shard::{
    drain_all, oplog_id, remove_oplog_dir, start_shard, ShardControl, ShardLink, ShardSpec,
};
use crate::startup;
use crate::stats::{CounterSnapshot, IoRates};
use crate::vdisk::{ShardMap, VdiskHandle, VdiskShared, SHARD_RANGE_BYTES};
use ashlar_core::{Epoch, VdiskId, BLOCK_SIZE_BYTES, MAX_VDISK_SIZE_BYTES};
use ashlar_meta::MetaStore;
use ashlar_storage::copy_identity::{self, CopyIdentity};
use ashlar_storage::extent_store::{
    self, ExtentStore, ExtentStoreConfig, JournalConfig, LogId, SegmentCounter,
};
use ashlar_storage::fs::{Filesystem, NodeFs};
use ashlar_storage::oplog::{Oplog, OplogConfig, ReplayReport};
use serde::Serialize;
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};
use tokio::sync::{oneshot, watch};

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("vdisk '{0}' not found")]
    NotFound(String),
    #[error("vdisk '{0}' already exists")]
    AlreadyExists(String),
    #[error("invalid vdisk name '{name}': {reason}")]
    InvalidName { name: String, reason: String },
    #[error("invalid size: {0}")]
    InvalidSize(String),
    #[error("invalid shard count {0}: must be between 1 and {MAX_SHARDS}")]
    InvalidShards(u32),
    #[error("invalid replication factor {0}: a vdisk keeps 1, 2 or 3 copies")]
    InvalidReplicationFactor(u8),
    #[error("refusing to shrink vdisk '{name}' from {current} to {requested} bytes: data past the new end would be discarded (use --allow-shrink)")]
    ShrinkRefused {
        name: String,
        current: u64,
        requested: u64,
    },
    #[error(
        "vdisk '{name}' has {connections} connected client(s); disconnect them or use --force"
    )]
    InUse { name: String, connections: usize },
    #[error("metadata: {0}")]
    Meta(String),
    #[error("storage: {0}")]
    Storage(String),
    #[error("the node is stopping")]
    Stopping,
    #[error("vdisk '{name}' is offline: {reason}")]
    Offline { name: String, reason: String },
}

impl From<CatalogError> for EngineError {
    fn from(error: CatalogError) -> Self {
        match error {
            CatalogError::AlreadyExists(name) => EngineError::AlreadyExists(name),
            other => EngineError::Meta(other.to_string()),
        }
    }
}

/// Copies of a vdisk's data a cluster can keep.
pub const MAX_REPLICATION_FACTOR: u8 = 3;

/// A vdisk as the API shows it.
#[derive(Clone, Debug, Serialize)]
pub struct VdiskInfo {
    pub name: String,
    pub id: VdiskId,
    pub size_bytes: u64,
    pub shards: u32,
    pub replication_factor: u8,
    pub block_size_bytes: u32,
    pub created_unix_seconds: u64,
    pub connections: usize,
    pub state: VdiskState,
    /// Why the vdisk is not online, when it is not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status: Option<String>,
}

/// Whether a vdisk serves I/O.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum VdiskState {
    Online,
    /// Could not start (its oplog or data could not be recovered); its data is kept.
    Offline,
}

#[derive(Clone, Debug, Serialize)]
pub struct VdiskStats {
    pub name: String,
    pub id: VdiskId,
    pub size_bytes: u64,
    pub shards: u32,
    pub connections: usize,
    pub read_ops: u64,
    pub write_ops: u64,
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub errors: u64,
    /// Segment space the oplogs use (a drained log keeps its tail segment until it fills).
    pub oplog_usage_bytes: u64,
    /// Bytes of the vdisk whose newest data is only in the oplogs: 0 once all is drained.
    pub oplog_live_bytes: u64,
    pub oplog_capacity_bytes: u64,
    /// Ranges the last startup found lost to corruption in the vdisk's oplog (they read as
    /// EIO until rewritten).
    pub oplog_lost_ranges: u64,
    /// Records of another node's replication applied to this node's copy.
    pub replica_records: u64,
    /// Rates over the interval since the previous stats request (at least 1 s).
    #[serde(flatten)]
    pub rates: IoRates,
}

#[derive(Clone, Debug, Serialize, Default)]
pub struct CacheStats {
    pub capacity_bytes: u64,
    pub single_touch_bytes: u64,
    pub multi_touch_bytes: u64,
    pub single_touch_hits: u64,
    pub multi_touch_hits: u64,
    pub misses: u64,
    pub hit_rate: f64,
    pub single_touch_hit_rate: f64,
    pub multi_touch_hit_rate: f64,
}

struct VdiskEntry {
    record: VdiskRecord,
    shared: Arc<VdiskShared>,
    /// Why the vdisk cannot be served (its data is kept as it was); `None` while it serves.
    offline: Option<String>,
}

impl VdiskEntry {
    /// A vdisk that could not start: no shards, every open refused with `reason`.
    fn offline(record: VdiskRecord, reason: String) -> Self {
        let map = ShardMap {
            epoch: Epoch(0),
            shards: Vec::new(),
        };
        let shared = Arc::new(VdiskShared::new(
            record.id,
            record.name.clone(),
            record.size_bytes,
            map,
            ReplicationSlot::new(record.replication_factor),
            // Never answered: an offline vdisk refuses fences.
            CopyIdentity(0),
        ));
        shared.closing.store(true, Ordering::Relaxed);
        VdiskEntry {
            record,
            shared,
            offline: Some(reason),
        }
    }

    fn info(&self) -> VdiskInfo {
        let mut info = info_of(&self.record, &self.shared);
        if let Some(reason) = &self.offline {
            info.state = VdiskState::Offline;
            info.status = Some(reason.clone());
        }
        info
    }
}

struct RateSample {
    at: Instant,
    snapshot: CounterSnapshot,
    rates: IoRates,
}

pub struct Engine<M: MetaStore> {
    config: EngineConfig,
    meta: M,
    reactors: ReactorPool,
    vdisks: Mutex<BTreeMap<String, VdiskEntry>>,
    control: tokio::sync::Mutex<()>,
    cache_counters: Vec<Arc<CacheCounters>>,
    rate_samples: Mutex<HashMap<VdiskId, RateSample>>,
    /// Per vdisk, the block log segment counters of its disks, shared by every shard of every
    /// epoch of this process (`EngineConfig::block_log`): made once, above what is on disk.
    block_log_counters: Mutex<HashMap<VdiskId, Vec<Arc<SegmentCounter>>>>,
    started_at: Instant,
    quarantined: Mutex<Vec<PathBuf>>,
    /// In a cluster: every vdisk's serving gate starts closed, and only the node's
    /// ownership layer opens it (after claiming the vdisk). See [`Engine::require_ownership`].
    ownership_required: AtomicBool,
    /// Memory of every drain step of the node (shards, recovery, hand-overs).
    drain_budget: DrainBudget,
}

thread_local! {
    /// The reactor's read cache; set once when the reactor starts.
    static REACTOR_CACHE: RefCell<Option<Rc<RefCell<BlockCache>>>> = const { RefCell::new(None) };
}

fn reactor_cache() -> Rc<RefCell<BlockCache>> {
    REACTOR_CACHE.with(|slot| {
        slot.borrow_mut()
            .get_or_insert_with(|| Rc::new(RefCell::new(BlockCache::new(0, BLOCK_SIZE_BYTES))))
            .clone()
    })
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Control-plane maps hold no invariant a panic could break half-way; keep serving.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn now_unix_seconds() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl<M: MetaStore> Engine<M> {
    /// Starts reactors, recovers every vdisk's oplogs left by a previous run, and starts the
    /// shard controllers. Returns once every vdisk is ready to serve.
    pub async fn start(config: EngineConfig, meta: M) -> Result<Arc<Self>, EngineError> {
        assert!(!config.disks.is_empty(), "the node needs at least one disk");
        let reactors =
            ReactorPool::start(config.reactors, config.poll_window, &config.reactor_cpus)
                .map_err(|e| EngineError::Storage(format!("cannot start reactor threads: {e}")))?;
        let per_reactor_cache = config.cache_bytes / reactors.len() as u64;
        let mut cache_counters = Vec::new();
        for reactor in reactors.handles() {
            let counters = reactor
                .run(move || async move {
                    let cache = BlockCache::new(per_reactor_cache, BLOCK_SIZE_BYTES);
                    let counters = cache.counters();
                    REACTOR_CACHE
                        .with(|slot| *slot.borrow_mut() = Some(Rc::new(RefCell::new(cache))));
                    counters
                })
                .await
                .map_err(|e| EngineError::Storage(e.to_string()))?;
            cache_counters.push(counters);
        }
        let drain_budget = DrainBudget::new(config.drain_memory_bytes);
        let engine = Arc::new(Engine {
            config,
            meta,
            reactors,
            vdisks: Mutex::new(BTreeMap::new()),
            control: tokio::sync::Mutex::new(()),
            cache_counters,
            rate_samples: Mutex::new(HashMap::new()),
            block_log_counters: Mutex::new(HashMap::new()),
            started_at: Instant::now(),
            quarantined: Mutex::new(Vec::new()),
            ownership_required: AtomicBool::new(false),
            drain_budget,
        });
        let records = catalog::list(&engine.meta).await?;
        engine.account_for_data(&records).await?;
        for record in records {
            let started = match engine.recover_oplogs(record.id).await {
                Ok((epoch, lost_ranges)) => {
                    engine.start_vdisk(&record, epoch.next(), lost_ranges).await
                }
                Err(error) => Err(error),
            };
            let entry = match started {
                Ok(shared) => {
                    tracing::info!(vdisk = %record.name, id = %record.id, size_bytes = record.size_bytes,
                        shards = record.shards, "vdisk ready");
                    VdiskEntry {
                        record,
                        shared,
                        offline: None,
                    }
                }
                Err(error) => {
                    // One vdisk's damage never stops the node: the others are served and
                    // this one is named, with why, in every listing.
                    tracing::error!(vdisk = %record.name, id = %record.id, %error,
                        "vdisk cannot be served; it stays offline, its data untouched");
                    VdiskEntry::offline(record, error.to_string())
                }
            };
            lock(&engine.vdisks).insert(entry.record.name.clone(), entry);
        }
        Ok(engine)
    }

    /// Keeps data the catalog names, removes data of deleted vdisks, sets anything else aside.
    async fn account_for_data(&self, records: &[VdiskRecord]) -> Result<(), EngineError> {
        let storage = |e: std::io::Error| EngineError::Storage(e.to_string());
        let fs = self.config.fs.clone();
        startup::prepare_disks(&fs, &self.config.disks)
            .await
            .map_err(storage)?;
        let known = records.iter().map(|r| r.id).collect();
        let deleted = catalog::tombstones(&self.meta).await?;
        let account = startup::account_for_data(
            &fs,
            &self.config.disks,
            &known,
            &deleted,
            now_unix_seconds(),
        )
        .await
        .map_err(storage)?;
        // A tombstone whose data is gone everywhere (removed now or before) has done its job.
        for id in deleted.difference(&account.failed) {
            catalog::remove_tombstone(&self.meta, *id).await?;
        }
        *lock(&self.quarantined) = account.quarantined.into_iter().map(|(_, to)| to).collect();
        Ok(())
    }

    /// Directories startup moved aside because no vdisk accounts for them.
    pub fn quarantined(&self) -> Vec<PathBuf> {
        lock(&self.quarantined).clone()
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    fn oplog_root(&self, vdisk: VdiskId) -> PathBuf {
        self.config
            .oplog_disk()
            .path
            .join("oplog")
            .join(vdisk.to_string())
    }

    fn oplog_dir(&self, vdisk: VdiskId, epoch: Epoch, shard: u32) -> PathBuf {
        self.oplog_root(vdisk)
            .join(format!("e{:010}-s{:04}", epoch.0, shard))
    }

    /// Replays and drains every oplog a previous run left for the vdisk, oldest shard-map
    /// epoch first, so the extent store holds every acknowledged write. Returns the newest
    /// epoch seen (0 if none).
    /// Also returns how many ranges the replays found lost to corruption.
    async fn recover_oplogs(&self, vdisk: VdiskId) -> Result<(Epoch, u64), EngineError> {
        let root = self.oplog_root(vdisk);
        let mut logs = list_oplog_dirs(&self.config.fs, &root)
            .await
            .map_err(|e| EngineError::Storage(format!("listing {}: {e}", root.display())))?;
        logs.sort();
        let newest = logs.last().map(|(epoch, _, _)| *epoch).unwrap_or(Epoch(0));
        let disks = self.config.disks.clone();
        let fs = self.config.fs.clone();
        let capacity = self
            .config
            .oplog_bytes_per_vdisk
            .max(MIN_OPLOG_BYTES_PER_SHARD);
        let max_open_egroups = self.config.max_open_egroups_per_shard;
        let max_writing_egroups = self.config.max_writing_egroups_per_shard;
        let writes_in_flight_per_egroup = self.config.writes_in_flight_per_egroup;
        let drain_budget = self.drain_budget.clone();
        let drain_step_bytes = self.config.drain_batch_bytes;
        let reactor = self.reactors.get(ReactorId(vdisk.0 as usize));
        let lost_ranges = reactor
            .run(move || async move {
                // Every oplog is opened (replayed) first: the block log's replay must know
                // which blocks an oplog will drain again.
                let mut oplogs = Vec::with_capacity(logs.len());
                let mut lost_ranges = 0;
                for (epoch, shard, dir) in logs {
                    let config =
                        OplogConfig::new(dir.clone(), oplog_id(vdisk, epoch, shard), capacity);
                    let (oplog, report) = Oplog::open(fs.clone(), config)
                        .await
                        .map_err(|e| format!("replaying {}: {e}", dir.display()))?;
                    log_replay_report(vdisk, &report);
                    lost_ranges += report.lost.len() as u64;
                    oplogs.push((epoch, shard, dir, oplog));
                }
                // Before any drain: the tables must name every block a drain step put in the
                // block log before the crash (a node whose block log is off now replays too,
                // so turning it off loses nothing).
                let covered = |offset: u64| {
                    oplogs
                        .iter()
                        .any(|(_, _, _, oplog)| oplog.holds_any_of(offset, BLOCK_SIZE_BYTES))
                };
                let replay = extent_store::replay_block_logs(&fs, &disks, vdisk, covered)
                    .await
                    .map_err(|e| format!("replaying the block log: {e}"))?;
                if replay.entries > 0 || !replay.left_out.is_empty() {
                    tracing::info!(vdisk = %vdisk, chunks = replay.chunks, entries = replay.entries,
                        left_out = replay.left_out.len(), "replayed the block log into the checksum tables");
                }
                // Blocks whose newest data in the block log is missing and that no oplog
                // will drain again: a step that completed, whose data rotted since.
                for offset in &replay.lost {
                    tracing::error!(vdisk = %vdisk, offset,
                        "a block in the block log failed its checksum at replay and no oplog holds it: recorded lost");
                }
                lost_ranges += replay.lost.len() as u64;
                let store = ExtentStore::new(
                    fs.clone(),
                    ExtentStoreConfig {
                        vdisk,
                        disks,
                        max_open_egroups,
                        max_writing_egroups,
                        writes_in_flight_per_egroup,
                        journal: None,
                    },
                );
                for (epoch, shard, dir, oplog) in oplogs {
                    let live = oplog.live_bytes();
                    drain_all(&oplog, &store, &drain_budget, drain_step_bytes).await?;
                    drop(oplog);
                    remove_oplog_dir(&fs, &dir).await?;
                    if live > 0 {
                        tracing::info!(vdisk = %vdisk, epoch = epoch.0, shard, live_bytes = live,
                            "replayed oplog into the extent store");
                    }
                }
                // Every block in the log goes home and the segments go: the shards of this
                // run start with logs of their own, and no log id of an earlier shard map
                // holds blocks another shard now owns.
                let cleaned = store
                    .clean_log(|_, _| true)
                    .await
                    .map_err(|e| format!("cleaning the block log: {e}"))?;
                if cleaned.segments_removed > 0 {
                    tracing::info!(vdisk = %vdisk, ?cleaned, "moved the block log home");
                }
                Ok::<u64, String>(lost_ranges)
            })
            .await
            .map_err(|e| EngineError::Storage(e.to_string()))?
            .map_err(EngineError::Storage)?;
        Ok((newest, lost_ranges))
    }

    /// The vdisk's block log segment counters (made on first use), if shards use the log.
    async fn block_log_counters(
        &self,
        vdisk: VdiskId,
    ) -> Result<Option<Vec<Arc<SegmentCounter>>>, EngineError> {
        if self.config.block_log.is_none() {
            return Ok(None);
        }
        if let Some(counters) = lock(&self.block_log_counters).get(&vdisk) {
            return Ok(Some(counters.clone()));
        }
        let (fs, disks) = (self.config.fs.clone(), self.config.disks.clone());
        let counters = self
            .reactors
            .get(ReactorId(vdisk.0 as usize))
            .run(move || async move { extent_store::segment_counters(&fs, &disks, vdisk).await })
            .await
            .map_err(|e| EngineError::Storage(e.to_string()))?
            .map_err(|e| EngineError::Storage(format!("listing the block log: {e}")))?;
        // Made under the control lock: nobody else made them meanwhile.
        lock(&self.block_log_counters).insert(vdisk, counters.clone());
        Ok(Some(counters))
    }

    /// Starts `count` gated shard controllers for `epoch`, spread over reactors.
    async fn start_shards(
        &self,
        vdisk: VdiskId,
        epoch: Epoch,
        count: u32,
        replication: &Arc<ReplicationSlot>,
    ) -> Result<(Vec<ShardLink>, watch::Sender<bool>), EngineError> {
        let (gate, gate_receiver) = watch::channel(false);
        let mut links = Vec::with_capacity(count as usize);
        let counters = self.block_log_counters(vdisk).await?;
        for index in 0..count {
            let journal = match (&counters, self.config.block_log) {
                (Some(counters), Some(settings)) => Some(JournalConfig {
                    log: LogId(u8::try_from(index).expect("at most MAX_SHARDS shards")),
                    counters: counters.clone(),
                    checkpoint_blocks: (settings.checkpoint_bytes / BLOCK_SIZE_BYTES).max(1)
                        as usize,
                    max_segments: (settings.capacity_bytes
                        / (u64::from(settings.segment_chunks.max(1)) << 20))
                        .max(2) as usize,
                    segment_chunks: settings.segment_chunks,
                }),
                _ => None,
            };
            let spec = ShardSpec {
                vdisk,
                epoch,
                index,
                oplog_dir: self.oplog_dir(vdisk, epoch, index),
                oplog_capacity_bytes: self.config.oplog_bytes_per_shard(count),
                disks: self.config.disks.clone(),
                max_open_egroups: self.config.max_open_egroups_per_shard,
                max_writing_egroups: self.config.max_writing_egroups_per_shard,
                writes_in_flight_per_egroup: self.config.writes_in_flight_per_egroup,
                drain_batch_bytes: self.config.drain_batch_bytes,
                drain_budget: self.drain_budget.clone(),
                drain_idle: self.config.drain_idle,
                request_queue_limit: self.config.shard_queue_limit,
                max_requests_in_flight: self.config.shard_requests_in_flight_limit,
                fs: self.config.fs.clone(),
                replication: replication.clone(),
                journal,
            };
            let reactor = self.reactors.get(self.shard_reactor(vdisk, index));
            let gate = gate_receiver.clone();
            let link = reactor
                .run(move || async move { start_shard(spec, reactor_cache(), gate).await })
                .await
                .map_err(|e| EngineError::Storage(e.to_string()))?
                .map_err(EngineError::Storage)?;
            links.push(link);
        }
        Ok((links, gate))
    }

    /// Starts the vdisk's shards at `epoch` over the data on disk, whose oplog replay lost
    /// `lost_ranges` ranges to corruption.
    async fn start_vdisk(
        &self,
        record: &VdiskRecord,
        epoch: Epoch,
        lost_ranges: u64,
    ) -> Result<Arc<VdiskShared>, EngineError> {
        let copy_identity = self.establish_copy_identity(record, lost_ranges).await?;
        let replication = ReplicationSlot::new(record.replication_factor);
        let (shards, gate) = self
            .start_shards(record.id, epoch, record.shards, &replication)
            .await?;
        let map = ShardMap { epoch, shards };
        let shared = Arc::new(VdiskShared::new(
            record.id,
            record.name.clone(),
            record.size_bytes,
            map,
            replication,
            copy_identity,
        ));
        shared
            .oplog_lost_ranges
            .store(lost_ranges, Ordering::Relaxed);
        if self.ownership_required.load(Ordering::Acquire) {
            shared.gate.close();
        }
        let _ = gate.send(true);
        Ok(shared)
    }

    /// The identity of this node's copy of the vdisk (`ashlar_storage::copy_identity`): kept
    /// from the files in its directories unless the replay lost records or a file is missing
    /// or differs, else drawn anew (and said so: a claimant then compares the whole copy).
    async fn establish_copy_identity(
        &self,
        record: &VdiskRecord,
        lost_ranges: u64,
    ) -> Result<CopyIdentity, EngineError> {
        let mut dirs = vec![self.oplog_root(record.id)];
        dirs.extend(extent_store::vdisk_extent_dirs(
            &self.config.disks,
            record.id,
        ));
        let renew = (lost_ranges > 0)
            .then(|| format!("the oplog replay lost {lost_ranges} ranges to corruption"));
        let mut fresh = [0u8; 16];
        getrandom::fill(&mut fresh)
            .map_err(|e| EngineError::Storage(format!("drawing a copy identity: {e}")))?;
        let fresh = CopyIdentity(u128::from_le_bytes(fresh));
        // On a reactor: the data path's filesystem does its file I/O on the thread's ring.
        let fs = self.config.fs.clone();
        let established = self
            .reactors
            .get(ReactorId(record.id.0 as usize))
            .run(move || async move { copy_identity::establish(&fs, &dirs, renew, fresh).await })
            .await
            .map_err(|e| EngineError::Storage(e.to_string()))?;
        let established = match established {
            Ok(established) => established,
            Err(error) => {
                // The vdisk serves all the same (a full disk must not take it offline): a
                // fresh identity matches no earlier answer, so a claimant compares this
                // copy in full, now and after the next start (whose files then disagree).
                tracing::warn!(vdisk = %record.name, id = %record.id, %error,
                    "cannot write the copy identity; using a new one for this run only");
                return Ok(fresh);
            }
        };
        if let Some(why) = &established.renewed {
            tracing::info!(vdisk = %record.name, id = %record.id, identity = %established.identity,
                why = %why, "new copy identity");
        }
        Ok(established.identity)
    }

    fn validate_size(size_bytes: u64) -> Result<(), EngineError> {
        if size_bytes == 0 {
            return Err(EngineError::InvalidSize(
                "a vdisk must be larger than 0 bytes".into(),
            ));
        }
        if !size_bytes.is_multiple_of(512) {
            return Err(EngineError::InvalidSize(format!(
                "{size_bytes} is not a multiple of 512 bytes"
            )));
        }
        if size_bytes > MAX_VDISK_SIZE_BYTES {
            return Err(EngineError::InvalidSize(format!(
                "{size_bytes} bytes is larger than the maximum vdisk size ({MAX_VDISK_SIZE_BYTES} bytes)"
            )));
        }
        Ok(())
    }

    fn validate_shards(&self, shards: u32) -> Result<(), EngineError> {
        if shards == 0 || shards > MAX_SHARDS {
            return Err(EngineError::InvalidShards(shards));
        }
        Ok(())
    }

    pub async fn create_vdisk(
        &self,
        name: &str,
        size_bytes: u64,
        shards: Option<u32>,
    ) -> Result<VdiskInfo, EngineError> {
        self.create_replicated_vdisk(name, size_bytes, shards, 1)
            .await
    }

    /// Creates a vdisk whose writes are kept on `replication_factor` nodes (1 to
    /// [`MAX_REPLICATION_FACTOR`]; more than 1 only means something in a cluster, which the
    /// node checks before asking).
    pub async fn create_replicated_vdisk(
        &self,
        name: &str,
        size_bytes: u64,
        shards: Option<u32>,
        replication_factor: u8,
    ) -> Result<VdiskInfo, EngineError> {
        catalog::validate_name(name).map_err(|reason| EngineError::InvalidName {
            name: name.into(),
            reason,
        })?;
        Self::validate_size(size_bytes)?;
        let shards = shards.unwrap_or(self.config.default_shards);
        self.validate_shards(shards)?;
        if !(1..=MAX_REPLICATION_FACTOR).contains(&replication_factor) {
            return Err(EngineError::InvalidReplicationFactor(replication_factor));
        }
        let _control = self.control.lock().await;
        if lock(&self.vdisks).contains_key(name) {
            return Err(EngineError::AlreadyExists(name.into()));
        }
        let record = VdiskRecord {
            id: VdiskId(0),
            name: name.into(),
            size_bytes,
            shards,
            replication_factor,
            block_size_bytes: BLOCK_SIZE_BYTES as u32,
            created_unix_seconds: now_unix_seconds(),
        };
        let record = catalog::create(&self.meta, record).await?;
        let shared = self.start_vdisk(&record, Epoch(1), 0).await?;
        tracing::info!(vdisk = %record.name, id = %record.id, size_bytes, shards, "vdisk created");
        let info = info_of(&record, &shared);
        let entry = VdiskEntry {
            record,
            shared,
            offline: None,
        };
        lock(&self.vdisks).insert(entry.record.name.clone(), entry);
        Ok(info)
    }

    pub fn list_vdisks(&self) -> Vec<VdiskInfo> {
        lock(&self.vdisks).values().map(VdiskEntry::info).collect()
    }

    pub fn vdisk(&self, name: &str) -> Result<VdiskInfo, EngineError> {
        lock(&self.vdisks)
            .get(name)
            .map(VdiskEntry::info)
            .ok_or_else(|| EngineError::NotFound(name.into()))
    }

    /// The record and shared state of an online vdisk.
    fn shared(&self, name: &str) -> Result<(VdiskRecord, Arc<VdiskShared>), EngineError> {
        let vdisks = lock(&self.vdisks);
        let entry = vdisks
            .get(name)
            .ok_or_else(|| EngineError::NotFound(name.into()))?;
        if let Some(reason) = &entry.offline {
            return Err(EngineError::Offline {
                name: name.into(),
                reason: reason.clone(),
            });
        }
        Ok((entry.record.clone(), entry.shared.clone()))
    }

    /// A handle for one client connection.
    pub fn open(&self, name: &str) -> Result<VdiskHandle, EngineError> {
        let (_, shared) = self.shared(name)?;
        if shared.closing.load(Ordering::Relaxed) {
            return Err(EngineError::Stopping);
        }
        Ok(VdiskHandle::new(shared))
    }

    pub async fn resize(
        &self,
        name: &str,
        size_bytes: u64,
        allow_shrink: bool,
    ) -> Result<VdiskInfo, EngineError> {
        Self::validate_size(size_bytes)?;
        let _control = self.control.lock().await;
        let (mut record, shared) = self.shared(name)?;
        let current = record.size_bytes;
        if size_bytes < current {
            if !allow_shrink {
                return Err(EngineError::ShrinkRefused {
                    name: name.into(),
                    current,
                    requested: size_bytes,
                });
            }
            // Clients lose the tail first, then its data is freed, then the catalog follows:
            // a crash in between leaves a larger vdisk whose tail reads as zeros.
            shared.size_bytes.store(size_bytes, Ordering::Relaxed);
            discard_range(&shared, size_bytes, current).await?;
        }
        record.size_bytes = size_bytes;
        catalog::update(&self.meta, &record).await?;
        shared.size_bytes.store(size_bytes, Ordering::Relaxed);
        self.replace_record(record.clone());
        tracing::info!(
            vdisk = name,
            from = current,
            to = size_bytes,
            "vdisk resized"
        );
        Ok(info_of(&record, &shared))
    }

    fn replace_record(&self, record: VdiskRecord) {
        if let Some(entry) = lock(&self.vdisks).get_mut(&record.name) {
            entry.record = record;
        }
    }

    /// Changes the shard count while clients run. New controllers start gated, the new map is
    /// published, old controllers finish in-flight I/O and drain their oplogs into the extent
    /// store, then the gate opens. Requests that reach an old shard meanwhile are re-sent on
    /// the new map; none fails.
    pub async fn set_shards(&self, name: &str, shards: u32) -> Result<VdiskInfo, EngineError> {
        self.validate_shards(shards)?;
        let _control = self.control.lock().await;
        let (mut record, shared) = self.shared(name)?;
        let old_map = shared.map.load_full();
        if shards as usize == old_map.shards.len() {
            return Ok(info_of(&record, &shared));
        }
        let epoch = old_map.epoch.next();
        let (links, gate) = self
            .start_shards(record.id, epoch, shards, &shared.replication)
            .await?;
        shared.map.store(Arc::new(ShardMap {
            epoch,
            shards: links,
        }));
        let started = Instant::now();
        // The hand-over and the opening of the gate run in a task of their own: a caller that
        // stops waiting (an HTTP client that hangs up drops this future) must not drop the
        // gate unopened while the old shards still hold data in their oplogs. If it does stop
        // waiting, the catalog keeps the old shard count; a restart replays every epoch's
        // oplog, oldest first, so no data depends on it.
        let hand_over = tokio::spawn(open_after_hand_over(old_map.clone(), gate, shared.clone()));
        let handed_over = hand_over
            .await
            .unwrap_or_else(|e| Err(format!("the hand-over task ended: {e}")));
        if let Err(error) = handed_over {
            return Err(EngineError::Storage(format!(
                "re-sharding '{name}' failed: {error}; vdisk taken offline"
            )));
        }
        record.shards = shards;
        catalog::update(&self.meta, &record).await?;
        self.replace_record(record.clone());
        tracing::info!(
            vdisk = name,
            from = old_map.shards.len(),
            to = shards,
            epoch = epoch.0,
            pause_ms = started.elapsed().as_millis() as u64,
            "shard count changed"
        );
        Ok(info_of(&record, &shared))
    }

    pub async fn delete_vdisk(&self, name: &str, force: bool) -> Result<(), EngineError> {
        let _control = self.control.lock().await;
        let (record, shared) = {
            let vdisks = lock(&self.vdisks);
            let entry = vdisks
                .get(name)
                .ok_or_else(|| EngineError::NotFound(name.into()))?;
            (entry.record.clone(), entry.shared.clone())
        };
        let connections = shared.connections.load(Ordering::Relaxed);
        if connections > 0 && !force {
            return Err(EngineError::InUse {
                name: name.into(),
                connections,
            });
        }
        shared.closing.store(true, Ordering::Relaxed);
        // Catalog first, leaving a tombstone: a crash after this leaves data that startup
        // removes (the tombstone says it may), never a catalog entry whose data is half gone.
        if let Err(error) = catalog::delete(&self.meta, &record).await {
            // Nothing was deleted: the vdisk is served again rather than left refusing
            // every request and connection until a restart.
            shared.closing.store(false, Ordering::Relaxed);
            return Err(error.into());
        }
        lock(&self.vdisks).remove(name);
        self.remove_local_data(&record, &shared).await?;
        catalog::remove_tombstone(&self.meta, record.id).await?;
        tracing::info!(vdisk = name, id = %record.id, "vdisk deleted");
        Ok(())
    }

    /// Another node deleted vdisk `id` (its tombstone appeared): this node drops its own
    /// copy of it, if it has one, whatever its connections (they fail from now on). The
    /// tombstone is left to the node that wrote it. True if there was something to drop.
    pub async fn forget_deleted(&self, id: VdiskId) -> Result<bool, EngineError> {
        let _control = self.control.lock().await;
        let Some(entry) = self.take_entry(id, |_| true) else {
            return Ok(false);
        };
        entry.shared.closing.store(true, Ordering::Relaxed);
        self.remove_local_data(&entry.record, &entry.shared).await?;
        tracing::info!(vdisk = %entry.record.name, %id,
            "vdisk deleted on another node; this node's copy removed");
        Ok(true)
    }

    /// This node's data of vdisk `id` is no longer one of its copies (cluster mode; the
    /// caller checked the copy set): its oplog and extent files are removed and the vdisk is
    /// started again empty, as on a node that never held a copy. False, and nothing
    /// removed, while a client has it open here or it is offline (its data is kept for an
    /// operator).
    pub async fn trim_copy(&self, id: VdiskId) -> Result<bool, EngineError> {
        let _control = self.control.lock().await;
        let unused_online = |e: &VdiskEntry| {
            e.offline.is_none() && e.shared.connections.load(Ordering::Relaxed) == 0
        };
        let Some(entry) = self.take_entry(id, unused_online) else {
            return Ok(false);
        };
        entry.shared.closing.store(true, Ordering::Relaxed);
        self.remove_local_data(&entry.record, &entry.shared).await?;
        tracing::info!(vdisk = %entry.record.name, %id,
            "this node's data of the vdisk removed: it is not one of the vdisk's copies any more");
        self.start_learned(entry.record).await?;
        Ok(true)
    }

    /// Removes vdisk `id`'s entry from the served set if `removable` says it may go.
    fn take_entry(
        &self,
        id: VdiskId,
        removable: impl Fn(&VdiskEntry) -> bool,
    ) -> Option<VdiskEntry> {
        let mut vdisks = lock(&self.vdisks);
        let name = vdisks
            .iter()
            .find(|(_, e)| e.record.id == id && removable(e))
            .map(|(name, _)| name.clone())?;
        vdisks.remove(&name)
    }

    /// Stops the vdisk's shards (dropping their oplogs) and removes its files on every disk.
    async fn remove_local_data(
        &self,
        record: &VdiskRecord,
        shared: &VdiskShared,
    ) -> Result<(), EngineError> {
        let name = &record.name;
        let map = shared.map.load_full();
        if let Err(error) = retire_all(&map.shards, true).await {
            tracing::warn!(vdisk = name, %error, "shards did not stop cleanly during delete");
        }
        let oplog_root = self.oplog_root(record.id);
        ashlar_storage::fs::remove_tree(&self.config.fs, &oplog_root)
            .await
            .map_err(|e| EngineError::Storage(format!("removing {}: {e}", oplog_root.display())))?;
        extent_store::remove_vdisk_data(&self.config.fs, &self.config.disks, record.id)
            .await
            .map_err(|e| EngineError::Storage(format!("removing data of '{name}': {e}")))?;
        Ok(())
    }

    pub fn vdisk_stats(&self) -> Vec<VdiskStats> {
        let entries: Vec<(VdiskRecord, Arc<VdiskShared>)> = lock(&self.vdisks)
            .values()
            .map(|e| (e.record.clone(), e.shared.clone()))
            .collect();
        let mut samples = lock(&self.rate_samples);
        let now = Instant::now();
        entries
            .into_iter()
            .map(|(record, shared)| {
                let snapshot = shared.counters.snapshot();
                // The first request sees the average since the node started.
                let sample = samples.entry(record.id).or_insert_with(|| RateSample {
                    at: self.started_at,
                    snapshot: CounterSnapshot::default(),
                    rates: IoRates::default(),
                });
                let elapsed = now.duration_since(sample.at);
                if elapsed >= Duration::from_secs(1) || sample.snapshot.read_latency.is_empty() {
                    sample.rates = snapshot
                        .rates_since(&sample.snapshot, elapsed.max(Duration::from_millis(1)));
                    sample.snapshot = snapshot.clone();
                    sample.at = now;
                }
                VdiskStats {
                    name: record.name.clone(),
                    id: record.id,
                    size_bytes: shared.size_bytes.load(Ordering::Relaxed),
                    shards: shared.shard_count() as u32,
                    connections: shared.connections.load(Ordering::Relaxed),
                    read_ops: snapshot.read_ops,
                    write_ops: snapshot.write_ops,
                    read_bytes: snapshot.read_bytes,
                    write_bytes: snapshot.write_bytes,
                    errors: snapshot.errors,
                    oplog_usage_bytes: shared.oplog_usage_bytes(),
                    oplog_live_bytes: shared.oplog_live_bytes(),
                    oplog_capacity_bytes: self.config.oplog_bytes_per_shard(record.shards)
                        * record.shards as u64,
                    oplog_lost_ranges: shared.oplog_lost_ranges.load(Ordering::Relaxed),
                    replica_records: shared.replica_records.load(Ordering::Relaxed),
                    rates: sample.rates.clone(),
                }
            })
            .collect()
    }

    /// Cache statistics summed over reactors, and per reactor.
    pub fn cache_stats(&self) -> (CacheStats, Vec<CacheStats>) {
        let per_reactor: Vec<CacheStats> = self
            .cache_counters
            .iter()
            .map(|c| cache_stats_of(c))
            .collect();
        let mut total = CacheStats::default();
        for s in &per_reactor {
            total.capacity_bytes += s.capacity_bytes;
            total.single_touch_bytes += s.single_touch_bytes;
            total.multi_touch_bytes += s.multi_touch_bytes;
            total.single_touch_hits += s.single_touch_hits;
            total.multi_touch_hits += s.multi_touch_hits;
            total.misses += s.misses;
        }
        fill_hit_rates(&mut total);
        (total, per_reactor)
    }

    /// The reactors, for front-ends that place connections on them.
    pub fn reactors(&self) -> &ReactorPool {
        &self.reactors
    }

    /// The reactor shard `index` of `vdisk` runs on: consecutive shards on consecutive
    /// reactors, and each vdisk's first shard on a different one, so one-shard vdisks
    /// spread over the reactors.
    pub fn shard_reactor(&self, vdisk: VdiskId, index: u32) -> ReactorId {
        self.reactors
            .get(ReactorId(vdisk.0 as usize + index as usize))
            .id
    }

    /// Fails further I/O on every vdisk. Acknowledged writes are already durable; oplogs are
    /// replayed at the next start.
    /// Cluster mode: from now on no vdisk serves I/O until the node's ownership layer opens
    /// its gate ([`Engine::serve_gate`]). Closes the gates of the vdisks started so far and
    /// makes later ones (created while the node runs) start closed. Call before serving.
    pub fn require_ownership(&self) {
        self.ownership_required.store(true, Ordering::Release);
        for entry in lock(&self.vdisks).values() {
            entry.shared.gate.close();
        }
    }

    /// The id and serving gate of an online vdisk, for the node's ownership layer.
    pub fn serve_gate(&self, name: &str) -> Result<(VdiskId, Arc<ServeGate>), EngineError> {
        let (record, shared) = self.shared(name)?;
        Ok((record.id, shared.gate.clone()))
    }

    /// The shared state of vdisk `id` for the node's replica receiver, starting it from the
    /// catalog if this node has not seen it yet (it was created after the node started).
    pub async fn replica_target(&self, id: VdiskId) -> Result<Arc<VdiskShared>, EngineError> {
        if let Some(shared) = self.shared_by_id(id)? {
            return Ok(shared);
        }
        let _control = self.control.lock().await;
        if let Some(shared) = self.shared_by_id(id)? {
            return Ok(shared);
        }
        let record = catalog::list(&self.meta)
            .await?
            .into_iter()
            .find(|r| r.id == id)
            .ok_or_else(|| EngineError::NotFound(format!("vdisk id {id}")))?;
        self.start_learned(record).await
    }

    /// Starts vdisk `name` from the shared catalog if this node has not seen it yet (another
    /// node created it after this one started); true if it is known now.
    pub async fn learn(&self, name: &str) -> Result<bool, EngineError> {
        if lock(&self.vdisks).contains_key(name) {
            return Ok(true);
        }
        let _control = self.control.lock().await;
        if lock(&self.vdisks).contains_key(name) {
            return Ok(true);
        }
        let Some(record) = catalog::list(&self.meta)
            .await?
            .into_iter()
            .find(|r| r.name == name)
        else {
            return Ok(false);
        };
        self.start_learned(record).await?;
        Ok(true)
    }

    /// Starts a vdisk of the catalog this node did not start with; the control lock is held.
    async fn start_learned(&self, record: VdiskRecord) -> Result<Arc<VdiskShared>, EngineError> {
        let (epoch, lost_ranges) = self.recover_oplogs(record.id).await?;
        let shared = self.start_vdisk(&record, epoch.next(), lost_ranges).await?;
        tracing::info!(vdisk = %record.name, id = %record.id, "vdisk learnt from the catalog");
        let entry = VdiskEntry {
            record,
            shared: shared.clone(),
            offline: None,
        };
        lock(&self.vdisks).insert(entry.record.name.clone(), entry);
        Ok(shared)
    }

    /// The shared state of vdisk `id` if this node runs it (`None` if it has not started it).
    pub fn shared_by_id(&self, id: VdiskId) -> Result<Option<Arc<VdiskShared>>, EngineError> {
        let vdisks = lock(&self.vdisks);
        let Some(entry) = vdisks.values().find(|e| e.record.id == id) else {
            return Ok(None);
        };
        if let Some(reason) = &entry.offline {
            return Err(EngineError::Offline {
                name: entry.record.name.clone(),
                reason: reason.clone(),
            });
        }
        Ok(Some(entry.shared.clone()))
    }

    /// The shared state of an online vdisk, whose shards a resync reads below the serving
    /// gate (the node's replication copies the vdisk to its other copies before serving it).
    pub fn vdisk_shared(&self, name: &str) -> Result<Arc<VdiskShared>, EngineError> {
        Ok(self.shared(name)?.1)
    }

    /// Installs (or removes) the replicator of an online vdisk: its writes from now on are
    /// acknowledged only once every replica holds them.
    pub fn set_replicator(
        &self,
        name: &str,
        replicator: Option<Box<dyn Replicator>>,
    ) -> Result<(), EngineError> {
        let (_, shared) = self.shared(name)?;
        shared.replication.set(replicator);
        Ok(())
    }

    pub fn begin_shutdown(&self) {
        for entry in lock(&self.vdisks).values() {
            entry.shared.closing.store(true, Ordering::Relaxed);
        }
    }
}

fn info_of(record: &VdiskRecord, shared: &VdiskShared) -> VdiskInfo {
    VdiskInfo {
        name: record.name.clone(),
        id: record.id,
        size_bytes: shared.size_bytes.load(Ordering::Relaxed),
        shards: shared.shard_count() as u32,
        replication_factor: record.replication_factor,
        block_size_bytes: record.block_size_bytes,
        created_unix_seconds: record.created_unix_seconds,
        connections: shared.connections.load(Ordering::Relaxed),
        state: VdiskState::Online,
        status: None,
    }
}

fn cache_stats_of(counters: &CacheCounters) -> CacheStats {
    let mut stats = CacheStats {
        capacity_bytes: counters.capacity_bytes.load(Ordering::Relaxed),
        single_touch_bytes: counters.single_touch_bytes.load(Ordering::Relaxed),
        multi_touch_bytes: counters.multi_touch_bytes.load(Ordering::Relaxed),
        single_touch_hits: counters.single_touch_hits.load(Ordering::Relaxed),
        multi_touch_hits: counters.multi_touch_hits.load(Ordering::Relaxed),
        misses: counters.misses.load(Ordering::Relaxed),
        ..CacheStats::default()
    };
    fill_hit_rates(&mut stats);
    stats
}

fn fill_hit_rates(stats: &mut CacheStats) {
    let lookups = (stats.single_touch_hits + stats.multi_touch_hits + stats.misses).max(1) as f64;
    stats.hit_rate = (stats.single_touch_hits + stats.multi_touch_hits) as f64 / lookups;
    stats.single_touch_hit_rate = stats.single_touch_hits as f64 / lookups;
    stats.multi_touch_hit_rate = stats.multi_touch_hits as f64 / lookups;
}

/// Oplog directories of a vdisk: `e<epoch>-s<shard>`, as (epoch, shard, path).
async fn list_oplog_dirs(fs: &NodeFs, root: &Path) -> std::io::Result<Vec<(Epoch, u32, PathBuf)>> {
    let entries = match fs.list_dir(root).await {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut dirs = Vec::new();
    for entry in entries {
        let parsed = entry
            .name
            .strip_prefix('e')
            .and_then(|rest| rest.split_once("-s"))
            .and_then(|(epoch, shard)| {
                Some((epoch.parse::<u64>().ok()?, shard.parse::<u32>().ok()?))
            });
        let path = root.join(&entry.name);
        match parsed {
            Some((epoch, shard)) if entry.is_dir => dirs.push((Epoch(epoch), shard, path)),
            None if entry.name.starts_with(copy_identity::COPY_IDENTITY_FILE) => {}
            _ => {
                tracing::warn!(path = %path.display(), "ignoring unexpected entry in oplog directory")
            }
        }
    }
    Ok(dirs)
}

/// Says what an oplog's replay found beyond its records: ranges lost to corruption (they
/// read as EIO until overwritten), damage repaired, a torn tail cut off.
fn log_replay_report(vdisk: VdiskId, report: &ReplayReport) {
    for lost in &report.lost {
        tracing::error!(vdisk = %vdisk, offset = lost.offset, length = lost.length,
            file = %lost.path.display(), file_offset = lost.file_offset, reason = %lost.reason,
            "acknowledged data lost to corruption in the oplog; these blocks read as EIO until rewritten");
    }
    for damage in &report.repaired {
        tracing::warn!(vdisk = %vdisk, file = %damage.path.display(),
            file_offset = damage.file_offset, reason = %damage.reason,
            "oplog damage worked around (a second header copy, or the record headers or batch table); no data lost");
    }
    for torn in &report.torn {
        tracing::info!(vdisk = %vdisk, file = %torn.path.display(), file_offset = torn.file_offset,
            batches = torn.batches, "oplog tail torn by a crash cut off (never acknowledged)");
    }
    if let Some(version) = report.legacy_version {
        tracing::info!(vdisk = %vdisk, version, "upgrading an oplog of an older format by replay");
    }
}

/// Retires the shards of an old map, then opens the gate of the new one. If the hand-over
/// fails, the old oplogs stay on disk and are replayed (oldest epoch first) on restart;
/// serving the new map now could expose older data, so the vdisk stops serving and the gate
/// is dropped unopened (the new shards then end without serving).
async fn open_after_hand_over(
    old_map: Arc<ShardMap>,
    gate: watch::Sender<bool>,
    shared: Arc<VdiskShared>,
) -> Result<(), String> {
    if let Err(error) = retire_all(&old_map.shards, false).await {
        shared.closing.store(true, Ordering::Relaxed);
        return Err(error);
    }
    let _ = gate.send(true);
    Ok(())
}

async fn retire_all(shards: &[ShardLink], discard: bool) -> Result<(), String> {
    let mut waiting = Vec::new();
    for link in shards {
        let (done, result) = oneshot::channel();
        if link
            .control
            .send(ShardControl::Retire { discard, done })
            .await
            .is_ok()
        {
            waiting.push(result);
        }
    }
    let mut first_error = None;
    for result in waiting {
        match result.await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => {
                first_error.get_or_insert(error);
            }
            Err(_) => {
                first_error
                    .get_or_insert_with(|| "a shard stopped before handing over".to_string());
            }
        }
    }
    first_error.map_or(Ok(()), Err)
}

/// Frees `[from, to)` through the shards, one bounded chunk at a time.
async fn discard_range(shared: &VdiskShared, from: u64, to: u64) -> Result<(), EngineError> {
    const CHUNK_BYTES: u64 = 256 * SHARD_RANGE_BYTES;
    let mut at = from;
    while at < to {
        let length = (to - at).min(CHUNK_BYTES);
        shared
            .call_split(at, length, |o, l| crate::shard::ShardOp::WriteZeroes {
                offset: o,
                length: l,
                punch_hole: true,
            })
            .await
            .map_err(|e| EngineError::Storage(format!("discarding the tail: {e}")))?;
        at += length;
    }
    Ok(())
}

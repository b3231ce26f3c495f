//! Engine configuration: every limit that bounds memory or queues is named here.

use ashlar_storage::disk::Disk;
use ashlar_storage::fs::NodeFs;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Where the metadata store lives (and, without `--disk`, the data).
    pub data_dir: PathBuf,
    /// Directories holding oplogs (first fast disk) and extent groups.
    pub disks: Vec<Disk>,
    /// Reactor threads, one per core.
    pub reactors: usize,
    /// After client I/O a reactor keeps polling this long before it sleeps.
    pub poll_window: Duration,
    /// CPUs the reactors are pinned to, reactor `i` to `reactor_cpus[i % len]`; empty: the
    /// CPUs this process may run on (its affinity, e.g. from `taskset`), in ascending order.
    pub reactor_cpus: Vec<usize>,
    /// Read cache of the whole node, split evenly across reactors.
    pub cache_bytes: u64,
    /// Oplog capacity of each vdisk, split evenly across its shards.
    pub oplog_bytes_per_vdisk: u64,
    /// Requests queued per shard controller before senders wait.
    pub shard_queue_limit: usize,
    /// Client requests a shard controller works on at once; more wait in its queue.
    pub shard_requests_in_flight_limit: usize,
    /// Largest amount of oplog data one drain step moves to the extent store.
    pub drain_batch_bytes: u64,
    /// Oplog data all the node's drain steps may hold in memory at once (see
    /// [`crate::drain_budget`]): a step takes less than `drain_batch_bytes` when less is free.
    pub drain_memory_bytes: u64,
    /// A shard drains its oplog when it has seen no write for this long.
    pub drain_idle: Duration,
    /// Extent groups a shard keeps open (fds and checksum blocks, 16 KiB each).
    pub max_open_egroups_per_shard: usize,
    /// Extent groups one write batch of a shard (a drain step, a bypass write) writes at once
    /// (see `ExtentStoreConfig::max_writing_egroups`).
    pub max_writing_egroups_per_shard: usize,
    /// Disk writes one extent group's write phase keeps in flight (see
    /// `ExtentStoreConfig::writes_in_flight_per_egroup`).
    pub writes_in_flight_per_egroup: usize,
    /// Shard count of a new vdisk when the user does not choose one.
    pub default_shards: u32,
    /// How the engine reaches its disks (io_uring, blocking calls, or a simulated disk).
    pub fs: NodeFs,
    /// Drain steps put whole blocks in a block log per shard (extent store format 3) instead
    /// of at home; `None`: they write home, as before. Experimental until the log's capacity
    /// has a sizing rule (docs/extent-store-log-proposal.md, status).
    pub block_log: Option<BlockLogSettings>,
}

/// How shards use their block logs (`EngineConfig::block_log`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockLogSettings {
    /// Log bytes a shard may hold that no checksum table names yet: a drain step that leaves
    /// more checkpoints (writes and syncs the tables). Memory (~40 bytes per 4 KiB block)
    /// and the log that replay reads after a crash follow from it.
    pub checkpoint_bytes: u64,
    /// Log bytes a shard may keep on a disk: past it, a drain step cleans the oldest
    /// segments down to a quarter below it (their blocks still in use written home).
    pub capacity_bytes: u64,
    /// Chunks of 1 MiB per segment (1 to 64; `extent_store::DEFAULT_SEGMENT_CHUNKS`).
    pub segment_chunks: u16,
}

/// Default of `BlockLogSettings::checkpoint_bytes`.
pub const DEFAULT_BLOCK_LOG_CHECKPOINT_BYTES: u64 = 256 << 20;
/// Default of `BlockLogSettings::capacity_bytes`.
pub const DEFAULT_BLOCK_LOG_CAPACITY_BYTES: u64 = 2 << 30;

/// Default of `EngineConfig::poll_window` (the node's `--poll-window-us`).
pub const DEFAULT_POLL_WINDOW: Duration = Duration::from_micros(50);

/// Default of `EngineConfig::shard_requests_in_flight_limit`: enough for a few clients at
/// queue depth 32 or more, with each request's payload already bounded by the front-end.
pub const DEFAULT_SHARD_REQUESTS_IN_FLIGHT_LIMIT: usize = 256;

/// Upper bound on shards per vdisk; more would only add queues, not parallelism.
pub const MAX_SHARDS: u32 = 64;
/// Each shard's oplog gets at least this much, whatever the per-vdisk setting.
pub const MIN_OPLOG_BYTES_PER_SHARD: u64 = 16 << 20;

impl EngineConfig {
    pub fn oplog_bytes_per_shard(&self, shards: u32) -> u64 {
        (self.oplog_bytes_per_vdisk / shards.max(1) as u64).max(MIN_OPLOG_BYTES_PER_SHARD)
    }

    /// The oplog lives on the first fast-tier disk (or the first disk if none is fast).
    pub fn oplog_disk(&self) -> &Disk {
        self.disks
            .iter()
            .find(|d| d.tier == ashlar_storage::disk::Tier::Fast)
            .unwrap_or(&self.disks[0])
    }
}

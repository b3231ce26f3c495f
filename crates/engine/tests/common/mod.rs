//! What the engine's integration tests share: a small node's configuration and data
//! patterns.

use ashlar_engine::EngineConfig;
use ashlar_storage::disk::{Disk, Tier};
use std::path::Path;
use std::time::Duration;

/// A two-reactor engine on one disk in `dir`, with small caches and an oplog of
/// `oplog_bytes_per_vdisk`.
pub fn config(dir: &Path, oplog_bytes_per_vdisk: u64) -> EngineConfig {
    EngineConfig {
        data_dir: dir.to_path_buf(),
        disks: vec![Disk {
            path: dir.join("disk0"),
            tier: Tier::Fast,
        }],
        reactors: 2,
        poll_window: Duration::ZERO,
        reactor_cpus: Vec::new(),
        cache_bytes: 16 << 20,
        oplog_bytes_per_vdisk,
        shard_queue_limit: 64,
        shard_requests_in_flight_limit:
            ashlar_engine::config::DEFAULT_SHARD_REQUESTS_IN_FLIGHT_LIMIT,
        drain_batch_bytes: 1 << 20,
        // Two shards' steps share it: a step sometimes takes less than it wants.
        drain_memory_bytes: 3 << 19,
        drain_idle: Duration::from_millis(50),
        max_open_egroups_per_shard: 8,
        max_writing_egroups_per_shard: ashlar_storage::extent_store::DEFAULT_MAX_WRITING_EGROUPS,
        writes_in_flight_per_egroup:
            ashlar_storage::extent_store::DEFAULT_WRITES_IN_FLIGHT_PER_EGROUP,
        default_shards: 2,
        fs: ashlar_storage::fs::NodeFs::detect(Default::default()).unwrap(),
        block_log: None,
    }
}

/// Reproducible pseudo-random bytes.
pub fn pattern(seed: u64, length: usize) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..length)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

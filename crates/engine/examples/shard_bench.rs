//! In-process sharding benchmark (no network): 4 KiB random reads of cached data through
//! `VdiskHandle`s, with client tasks on every reactor, first with 1 shard, then with 2.
//! Prints IOPS for each and the ratio. Run: `cargo run --release --example shard_bench`.
//!
//! Knobs (environment): SHARD_BENCH_SECONDS (default 5), SHARD_BENCH_CLIENTS_PER_REACTOR (16),
//! SHARD_BENCH_REACTORS (2), SHARD_BENCH_SIZE_MIB (256).

use ashlar_core::BlockDevice;
use ashlar_engine::{Engine, EngineConfig};
use ashlar_meta::EmbeddedMetaStore;
use ashlar_storage::disk::{Disk, Tier};
use bytes::Bytes;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

type BenchEngine = Engine<EmbeddedMetaStore>;

async fn fill_and_warm(engine: &Arc<BenchEngine>, size: u64) {
    let reactor = engine.reactors().handles()[0].clone();
    let engine = engine.clone();
    reactor
        .run(move || async move {
            let handle = engine.open("bench").expect("open");
            let chunk = Bytes::from(vec![0x5a; 1 << 20]);
            for offset in (0..size).step_by(1 << 20) {
                handle
                    .write(offset, chunk.clone(), false)
                    .await
                    .expect("fill");
            }
            // Two passes: the second promotes every block to the multi-touch pool.
            for _ in 0..2 {
                for offset in (0..size).step_by(4096) {
                    handle.read(offset, 4096).await.expect("warm");
                }
            }
        })
        .await
        .expect("reactor");
}

async fn measure(engine: &Arc<BenchEngine>, size: u64, seconds: u64, clients: u64) -> f64 {
    let stop = Arc::new(AtomicBool::new(false));
    let mut waits = Vec::new();
    let started = Instant::now();
    for reactor in engine.reactors().handles() {
        for client in 0..clients {
            let engine = engine.clone();
            let stop = stop.clone();
            let seed = 0x9e3779b97f4a7c15u64 ^ (reactor.id.0 as u64 * 1000 + client);
            let reactor = reactor.clone();
            waits.push(tokio::spawn(async move {
                reactor
                    .run(move || async move {
                        let handle = engine.open("bench").expect("open");
                        let blocks = size / 4096;
                        let mut state = seed | 1;
                        let mut ops = 0u64;
                        while !stop.load(Ordering::Relaxed) {
                            state ^= state << 13;
                            state ^= state >> 7;
                            state ^= state << 17;
                            handle
                                .read((state % blocks) * 4096, 4096)
                                .await
                                .expect("read");
                            ops += 1;
                        }
                        ops
                    })
                    .await
                    .expect("reactor")
            }));
        }
    }
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    stop.store(true, Ordering::Relaxed);
    let mut total = 0;
    for wait in waits {
        total += wait.await.expect("client");
    }
    total as f64 / started.elapsed().as_secs_f64()
}

fn main() {
    let seconds = env_or("SHARD_BENCH_SECONDS", 5);
    let clients = env_or("SHARD_BENCH_CLIENTS_PER_REACTOR", 16);
    let reactors = env_or("SHARD_BENCH_REACTORS", 2) as usize;
    let size = env_or("SHARD_BENCH_SIZE_MIB", 256) << 20;
    let dir = tempfile::tempdir().expect("tempdir");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let config = EngineConfig {
            data_dir: dir.path().to_path_buf(),
            disks: vec![Disk {
                path: dir.path().join("disk0"),
                tier: Tier::Fast,
            }],
            reactors,
            poll_window: ashlar_engine::config::DEFAULT_POLL_WINDOW,
            reactor_cpus: Vec::new(),
            cache_bytes: 4 * size,
            oplog_bytes_per_vdisk: 256 << 20,
            shard_queue_limit: 1024,
            shard_requests_in_flight_limit:
                ashlar_engine::config::DEFAULT_SHARD_REQUESTS_IN_FLIGHT_LIMIT,
            drain_batch_bytes: ashlar_engine::drain_budget::DEFAULT_DRAIN_BATCH_BYTES,
            drain_memory_bytes: ashlar_engine::drain_budget::DEFAULT_DRAIN_MEMORY_BYTES,
            drain_idle: Duration::from_millis(500),
            max_open_egroups_per_shard: 256,
            max_writing_egroups_per_shard:
                ashlar_storage::extent_store::DEFAULT_MAX_WRITING_EGROUPS,
            writes_in_flight_per_egroup:
                ashlar_storage::extent_store::DEFAULT_WRITES_IN_FLIGHT_PER_EGROUP,
            default_shards: 1,
            fs: ashlar_storage::fs::NodeFs::Std(ashlar_storage::fs::StdFs),
            block_log: None,
        };
        let meta = EmbeddedMetaStore::open(&dir.path().join("meta.redb")).expect("meta");
        let engine = Engine::start(config, meta).await.expect("engine");
        engine
            .create_vdisk("bench", size, Some(1))
            .await
            .expect("create");
        fill_and_warm(&engine, size).await;
        let one = measure(&engine, size, seconds, clients).await;
        engine.set_shards("bench", 2).await.expect("re-shard");
        fill_and_warm(&engine, size).await;
        let two = measure(&engine, size, seconds, clients).await;
        println!();
        println!(
            "## In-process sharding benchmark (4 KiB random reads of cached data, no network)"
        );
        println!();
        println!(
            "{reactors} reactors, {} client tasks per reactor, {} MiB vdisk, {seconds} s per run",
            clients,
            size >> 20
        );
        println!();
        println!("| shards | IOPS |");
        println!("|---:|---:|");
        println!("| 1 | {one:.0} |");
        println!("| 2 | {two:.0} |");
        println!();
        println!("2 shards / 1 shard = {:.2}x (target ≥ 1.7x)", two / one);
    });
}

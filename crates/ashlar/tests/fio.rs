//! fio through the NBD engine against a real node, every job verifying its data (crc32c
//! headers, verify_fatal): random 4 KiB writes, a random 70/30 mix, sequential 1 MiB writes
//! (the oplog-bypass path) and four concurrent connections (multi-conn).

mod common;

use common::{fio_args, run_fio, Node, StatsWatcher, MIB};
use std::time::Duration;

#[test]
fn random_4k_writes_then_verify() {
    let node = Node::start();
    node.create_vdisk("rand4k", "256M");
    let watcher = StatsWatcher::start(&node, "rand4k");
    let fio = run_fio(&fio_args(
        &node.uri("rand4k"),
        "rand4k",
        &[
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=32",
            "--size=256M",
            "--do_verify=1",
        ],
    ));
    let (_, max_oplog) = watcher.finish();
    fio.assert_ok("4k randwrite + verify");
    assert!(
        max_oplog > 4 * MIB,
        "small random writes go through the oplog (max usage seen {max_oplog})"
    );
    // Every block was written once (random map) and read back once by the verify phase.
    assert_eq!(fio.io_bytes("write"), 256 * MIB, "{}", fio.json);
    assert_eq!(
        fio.io_bytes("read"),
        256 * MIB,
        "verify read everything back"
    );
    let stats = node.vdisk_stats("rand4k");
    assert_eq!(stats["errors"], 0, "{stats}");
}

#[test]
fn random_8k_mix_70_30_verifies_what_it_wrote() {
    let node = Node::start();
    node.create_vdisk("mix", "256M");
    let size = 128 * MIB;
    let fio = run_fio(&fio_args(
        &node.uri("mix"),
        "mix",
        &[
            "--rw=randrw",
            "--rwmixread=70",
            "--bs=8k",
            "--iodepth=16",
            "--size=128M",
            "--do_verify=1",
        ],
    ));
    fio.assert_ok("8k randrw 70/30 + verify");
    let written = fio.io_bytes("write");
    let read = fio.io_bytes("read");
    // With the random map each block is either read or written once in the mix; the verify
    // phase then reads back every written block. So reads = (size - written) + written: if
    // nothing had been verified, reads would be only size - written.
    assert!(
        written > size / 5 && written < size / 2,
        "about 30% writes: {written}"
    );
    assert_eq!(
        read,
        size,
        "mix reads ({}) + verify reads ({written}) must cover the job",
        size - written
    );
}

#[test]
fn sequential_1m_writes_then_verify() {
    let node = Node::start();
    node.create_vdisk("seq1m", "256M");
    let watcher = StatsWatcher::start(&node, "seq1m");
    let fio = run_fio(&fio_args(
        &node.uri("seq1m"),
        "seq1m",
        &[
            "--rw=write",
            "--bs=1M",
            "--iodepth=8",
            "--size=256M",
            "--do_verify=1",
        ],
    ));
    let (_, max_oplog) = watcher.finish();
    fio.assert_ok("1M sequential write + verify");
    assert_eq!(fio.io_bytes("write"), 256 * MIB);
    assert_eq!(fio.io_bytes("read"), 256 * MIB);
    // Aligned 1 MiB writes bypass the oplog...
    assert!(
        max_oplog < MIB,
        "aligned 1 MiB writes should bypass the oplog, but its usage reached {max_oplog}"
    );
    // ...straight to the extent store: every egroup file exists.
    let dir = node
        .data_dir
        .join("disk0/extents")
        .join(node.vdisk_dir_name("seq1m"));
    let egroups = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter(|e| {
            let name = e.as_ref().unwrap().file_name();
            name.to_string_lossy().ends_with(".egroup")
        })
        .count();
    assert_eq!(
        egroups,
        64,
        "256 MiB = 64 egroups of 4 MiB in {}",
        dir.display()
    );
}

#[test]
fn four_connections_at_once_each_verifying_its_region() {
    let node = Node::start();
    node.create_vdisk("multi", "256M");
    let watcher = StatsWatcher::start(&node, "multi");
    let fio = run_fio(&fio_args(
        &node.uri("multi"),
        "multi",
        &[
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=16",
            "--size=64M",
            "--numjobs=4",
            "--offset_increment=64M",
            "--do_verify=1",
        ],
    ));
    let (max_connections, _) = watcher.finish();
    fio.assert_ok("4 jobs x 64M randwrite + verify");
    let jobs = fio.jobs();
    assert_eq!(jobs.len(), 4, "one report per job: {}", fio.json);
    for job in &jobs {
        assert_eq!(job["write"]["io_bytes"].as_u64(), Some(64 * MIB), "{job}");
        assert_eq!(job["read"]["io_bytes"].as_u64(), Some(64 * MIB), "{job}");
    }
    assert_eq!(
        max_connections, 4,
        "the four jobs should be four concurrent NBD connections"
    );
    let stats = node.vdisk_stats("multi");
    let write_bytes = stats["write_bytes"].as_u64().unwrap();
    let write_ops = stats["write_ops"].as_u64().unwrap();
    let read_bytes = stats["read_bytes"].as_u64().unwrap();
    assert!(
        write_bytes >= 256 * MIB,
        "/stats/vdisks write_bytes {write_bytes} < 256 MiB written: {stats}"
    );
    assert!(
        write_ops >= 65536,
        "/stats/vdisks write_ops {write_ops}: {stats}"
    );
    assert!(read_bytes >= 256 * MIB, "{stats}");
    assert_eq!(stats["errors"], 0, "{stats}");
    assert!(
        common::wait_until(Duration::from_secs(5), || node.vdisk_stats("multi")
            ["connections"]
            == 0),
        "fio has disconnected, the node should count 0 connections"
    );
}

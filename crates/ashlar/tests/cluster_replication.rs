//! Replicated writes, end to end with a real etcd and three `ashlar node --etcd` processes on
//! loopback: a vdisk created with `--rf 2` is claimed by the node a client opens it on, which
//! records the copy set (itself and the storage-only node) and fences the other copy at its
//! epoch; every write the client makes reaches the copy node's own oplog and, after it drains,
//! its extent store, byte for byte; with the copy node down, writes fail with a clear error
//! instead of being acknowledged with one copy, and succeed again once it is back.

mod common;
// Shared with other test binaries, each of which uses a part of it.
#[allow(dead_code)]
#[path = "../../meta/tests/common/etcd_server.rs"]
mod etcd_server;

use common::{cluster_node, node_id, run_bounded_env, Node};
use etcd_server::EtcdServer;
use serde_json::Value;
use std::path::{Path, PathBuf};

const VDISK: &str = "replicated";
const PATTERN_BYTES: usize = 4 << 20;

fn pattern(dir: &Path, seed: u8) -> (PathBuf, Vec<u8>) {
    let path = dir.join(format!("pattern-{seed}"));
    let data: Vec<u8> = (0..PATTERN_BYTES as u32)
        .map(|i| ((i % 251) as u8 ^ seed).wrapping_add((i >> 12) as u8))
        .collect();
    std::fs::write(&path, &data).unwrap();
    (path, data)
}

/// nbdcopy from `from` to `to`: whether it succeeded, and what it printed.
fn nbdcopy(from: &str, to: &str) -> (bool, String) {
    let out = run_bounded_env("nbdcopy", &[from, to], &[("LIBNBD_DEBUG", "1")], 60);
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `replica_records` of the vdisk in `node`'s /stats/vdisks (0 if the node does not list it).
fn replica_records(node: &Node) -> u64 {
    let (status, body) = node.http_get("/stats/vdisks");
    assert_eq!(status, 200, "{body}");
    let stats: Value = serde_json::from_str(&body).unwrap();
    stats["vdisks"]
        .as_array()
        .unwrap_or_else(|| panic!("{stats}"))
        .iter()
        .find(|v| v["name"] == VDISK)
        .map(|v| v["replica_records"].as_u64().unwrap())
        .unwrap_or(0)
}

/// The highest owner epoch the node's replica fence file for the vdisk holds.
fn fence_epoch(node: &Node, vdisk_dir_name: &str) -> u64 {
    let path = node.data_dir.join("replica-fences").join(vdisk_dir_name);
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(&bytes[..4], b"AFEN");
    u64::from_le_bytes(bytes[4..12].try_into().unwrap())
}

/// The 4 MiB of data blocks of egroup 0 in the node's extent store (format version 2:
/// header and four checksum blocks, then the data of extents 0..3).
fn egroup0_data(node: &Node, vdisk_dir_name: &str) -> Vec<u8> {
    let path = node
        .data_dir
        .join("disk0/extents")
        .join(vdisk_dir_name)
        .join(format!("{:016x}.egroup", 0));
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let start = 5 * 4096;
    assert!(
        bytes.len() >= start + PATTERN_BYTES,
        "{} is short",
        path.display()
    );
    bytes[start..start + PATTERN_BYTES].to_vec()
}

#[test]
fn rf2_writes_reach_the_copy_node_and_wait_for_it() {
    let etcd = EtcdServer::start();
    let a = cluster_node(&etcd.url, &[]);
    let b = cluster_node(&etcd.url, &[]);
    let mut c = cluster_node(&etcd.url, &["--storage-only"]);
    // Created after B and C started: C learns of it from the catalog when its first
    // replicated record arrives.
    let out = a.cli(&["vdisk", "create", VDISK, "--size", "64M", "--rf", "2"]);
    out.assert_ok("vdisk create --rf 2");
    assert!(out.stdout.contains("rf 2"), "{}", out.stdout);
    let dir = tempfile::tempdir().unwrap();
    let (first, first_data) = pattern(dir.path(), 1);

    let (ok, text) = nbdcopy(first.to_str().unwrap(), &a.uri(VDISK));
    assert!(
        ok,
        "write through A: {text}\nA:\n{}\nC:\n{}",
        a.log(),
        c.log()
    );
    let shown = a.show(VDISK);
    assert_eq!(shown["replication_factor"], 2, "{shown}");
    let ownership = &shown["ownership"];
    // The claimant first, then the storage-only node (preferred for replicas).
    assert_eq!(
        ownership["copies"],
        serde_json::json!([node_id(&a), node_id(&c)]),
        "{ownership}"
    );
    let epoch = ownership["owner_epoch"].as_u64().unwrap();
    let vdisk_dir = a.vdisk_dir_name(VDISK);
    assert!(replica_records(&c) > 0, "C applied no record");
    assert_eq!(replica_records(&b), 0, "B holds no copy");
    assert_eq!(fence_epoch(&c, &vdisk_dir), epoch);
    // The pattern reads back through the owner.
    let back = dir.path().join("back");
    let (ok, text) = nbdcopy(&a.uri(VDISK), back.to_str().unwrap());
    assert!(ok, "read through A: {text}");
    assert!(std::fs::read(&back).unwrap()[..PATTERN_BYTES] == first_data[..]);

    // C's copy is complete: stopped, restarted (its oplog drains into its extent store at
    // start) and stopped again, its extent store holds the pattern byte for byte.
    c.sigterm_and_wait();
    c.restart();
    c.sigterm_and_wait();
    assert!(
        egroup0_data(&c, &vdisk_dir) == first_data,
        "C's extent store does not hold what the client wrote"
    );

    // With the copy node down, a write cannot reach every copy: it fails, clearly, and the
    // owner stays up for everything else.
    let (second, second_data) = pattern(dir.path(), 2);
    let (ok, text) = nbdcopy(second.to_str().unwrap(), &a.uri(VDISK));
    assert!(!ok, "a write with the copy node down was acknowledged");
    assert!(
        a.log().contains("replica node did not take the write"),
        "the owner's log does not say why:\n{}\n{text}",
        a.log()
    );
    let (status, _) = a.http_get("/healthz");
    assert_eq!(status, 200);

    // Back, but its copy missed what the owner tried to write meanwhile (failed writes may
    // have reached the owner's own copy): it refuses to take records as if nothing happened,
    // so writes keep failing, with the reason in the log, rather than diverge silently.
    c.restart();
    let (ok, _) = nbdcopy(second.to_str().unwrap(), &a.uri(VDISK));
    assert!(
        !ok,
        "a write was acknowledged by a copy that missed records"
    );
    assert!(
        c.log().contains("must be resynchronized") || a.log().contains("must be resynchronized"),
        "nobody says the copy is stale:\nA:\n{}\nC:\n{}",
        a.log(),
        c.log()
    );
    // Reads are still served by the owner, and the data C took is still there.
    let (ok, text) = nbdcopy(&a.uri(VDISK), back.to_str().unwrap());
    assert!(ok, "read through A: {text}");
    drop(second_data);
}

#[test]
fn rf_above_one_needs_a_cluster_and_at_most_three() {
    let node = Node::start_with(&[]);
    let out = node.cli(&["vdisk", "create", "x", "--size", "16M", "--rf", "2"]);
    assert!(!out.status.success());
    assert!(out.stderr.contains("needs a cluster"), "{}", out.stderr);
    let etcd = EtcdServer::start();
    let clustered = cluster_node(&etcd.url, &[]);
    let out = clustered.cli(&["vdisk", "create", "x", "--size", "16M", "--rf", "4"]);
    assert!(!out.status.success());
    assert!(out.stderr.contains("1, 2 or 3 copies"), "{}", out.stderr);
    // RF 2 with one node up: the vdisk exists, but a client cannot open it, and is told why.
    clustered
        .cli(&["vdisk", "create", "x", "--size", "16M", "--rf", "2"])
        .assert_ok("create");
    let out = run_bounded_env(
        "nbdinfo",
        &[clustered.uri("x")],
        &[("LIBNBD_DEBUG", "1")],
        30,
    );
    assert!(!out.status.success());
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(text.contains("only 1 node(s) are up"), "{text}");
}

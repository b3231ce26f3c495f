//! Any node serves a client of any vdisk (docs/forwarding.md), end to end with a real etcd
//! and `ashlar node --etcd` processes on loopback, through real clients (nbdcopy, fio): a
//! node that does not own the vdisk forwards every request to the owner; after sustained
//! forwarded I/O (`--migrate-after-s`) ownership moves to that node, with every write intact
//! and no client request failing; a vdisk with one copy stays with its data; when the owner
//! dies, the forwarding node's clients go on once a surviving copy takes the vdisk over.

mod common;
// Shared with other test binaries, each of which uses a part of it.
#[allow(dead_code)]
#[path = "../../meta/tests/common/etcd_server.rs"]
mod etcd_server;

use common::cluster::acked::AckedWriter;
use common::nbd::NbdConn;
use common::{cluster_node, node_id, ownership, run_bounded_env, wait_until, Node};
use etcd_server::EtcdServer;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const PATTERN_BYTES: usize = 4 << 20;
const EINVAL: u32 = 22;

fn pattern(dir: &Path, seed: u8) -> (PathBuf, Vec<u8>) {
    let path = dir.join(format!("pattern-{seed}"));
    let data: Vec<u8> = (0..PATTERN_BYTES as u32)
        .map(|i| ((i % 253) as u8 ^ seed).wrapping_add((i >> 12) as u8))
        .collect();
    std::fs::write(&path, &data).unwrap();
    (path, data)
}

/// nbdcopy from `from` to `to`, which must succeed.
fn nbdcopy(from: &str, to: &str, what: &str, nodes: &[&Node]) {
    let out = run_bounded_env("nbdcopy", &[from, to], &[("LIBNBD_DEBUG", "1")], 60);
    if !out.status.success() {
        for node in nodes {
            node.dump_log();
        }
        panic!("{what}: {}", String::from_utf8_lossy(&out.stderr));
    }
}

/// The first `PATTERN_BYTES` of `vdisk` read through `node`.
fn read_back(node: &Node, vdisk: &str, dir: &Path, nodes: &[&Node]) -> Vec<u8> {
    let out = dir.join("back");
    let _ = std::fs::remove_file(&out);
    nbdcopy(&node.uri(vdisk), out.to_str().unwrap(), "read back", nodes);
    let mut data = std::fs::read(&out).unwrap();
    data.truncate(PATTERN_BYTES);
    data
}

/// fio through the NBD URI: 4 KiB random writes over 8 MiB from offset 8 MiB, verified.
fn fio_verified_writes(uri: &str, seconds: u64) -> std::process::Output {
    let runtime = format!("--runtime={seconds}");
    run_bounded_env(
        "fio",
        &[
            "--name=forwarded",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=4",
            "--offset=8M",
            "--size=8M",
            "--time_based",
            &runtime,
            "--verify=crc32c",
            "--verify_backlog=64",
            "--do_verify=1",
            // No verify state file in the working directory (the crate's source tree).
            "--verify_state_save=0",
        ],
        &[],
        seconds + 60,
    )
}

/// Serving nodes A and B (with `a_args`, `b_args`), a storage-only C, and an RF 2 `vdisk`
/// written through A with pattern `seed`: the nodes, the scratch directory and the pattern.
fn written_through_a(
    etcd: &EtcdServer,
    a_args: &[&str],
    b_args: &[&str],
    vdisk: &str,
    seed: u8,
) -> (Node, Node, Node, tempfile::TempDir, Vec<u8>) {
    let a = cluster_node(&etcd.url, a_args);
    let b = cluster_node(&etcd.url, b_args);
    let c = cluster_node(&etcd.url, &["--storage-only"]);
    a.cli(&["vdisk", "create", vdisk, "--size", "64M", "--rf", "2"])
        .assert_ok("vdisk create --rf 2");
    let dir = tempfile::tempdir().unwrap();
    let (first, first_data) = pattern(dir.path(), seed);
    nbdcopy(
        first.to_str().unwrap(),
        &a.uri(vdisk),
        "write through A",
        &[&a, &b, &c],
    );
    (a, b, c, dir, first_data)
}

#[test]
fn a_client_of_another_node_is_forwarded_and_ownership_follows_sustained_io() {
    let etcd = EtcdServer::start();
    let vdisk = "moving";
    let (a, b, c, dir, first_data) = written_through_a(
        &etcd,
        &["--migrate-after-s", "3"],
        &["--migrate-after-s", "3"],
        vdisk,
        1,
    );
    let nodes = [&a, &b, &c];
    let (id_a, id_b) = (node_id(&a), node_id(&b));
    assert_eq!(ownership(&b, vdisk)["owner"], id_a.as_str());

    // A short client of B: forwarded to A, which keeps the vdisk.
    let (second, second_data) = pattern(dir.path(), 2);
    nbdcopy(
        second.to_str().unwrap(),
        &b.uri(vdisk),
        "write through B",
        &nodes,
    );
    assert_eq!(ownership(&b, vdisk)["owner"], id_a.as_str());
    assert!(read_back(&a, vdisk, dir.path(), &nodes) == second_data);
    assert!(read_back(&b, vdisk, dir.path(), &nodes) == second_data);
    assert_ne!(first_data, second_data);

    // Sustained I/O through B: the vdisk moves to B while fio runs, and no request fails.
    // 20 s: two asks 3 s apart (the first adds B to the copy set, a later one finds its
    // copy complete) fit with room on a loaded machine.
    let out = fio_verified_writes(&b.uri(vdisk), 20);
    assert!(
        out.status.success(),
        "fio through B failed while ownership moved:\n{}\n{}\nB:\n{}\nA:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        b.log(),
        a.log()
    );
    let moved = ownership(&b, vdisk);
    assert_eq!(moved["owner"], id_b.as_str(), "{moved}\n{}", b.log());
    assert!(
        b.log().contains("vdisk ownership moved here"),
        "{}",
        b.log()
    );
    assert!(a.log().contains("handed the vdisk over"), "{}", a.log());
    // B held no copy: A first added it to the copy set and filled it while it served (one
    // short re-claim), so B took the vdisk over with a complete copy and pulled nothing with
    // its gate shut.
    assert!(
        a.log()
            .contains("wants a copy; claiming the vdisk again to add it"),
        "{}",
        a.log()
    );
    assert!(
        !b.log()
            .contains("got a copy of the vdisk from a node holding one"),
        "B pulled a copy before serving: {}",
        b.log()
    );
    // A settled its writes and released the vdisk with every copy in sync; B found each
    // copy as A left it, so its resync compared nothing.
    assert!(
        a.log().contains("released with every copy in sync"),
        "{}",
        a.log()
    );
    assert!(
        b.log()
            .contains("every copy is as it left them: nothing to compare"),
        "{}",
        b.log()
    );
    assert!(
        b.log()
            .lines()
            .any(|line| line.contains("copies resynchronized")
                && line.contains("chunks_sent=0 chunks_same=0")
                && line.contains("caught_up=true")),
        "{}",
        b.log()
    );
    let copies = moved["copies"].as_array().unwrap().clone();
    assert_eq!(copies.len(), 2, "{moved}");
    assert_eq!(copies[0], id_b.as_str(), "{moved}");
    // Every earlier write is there, through the new owner and through the old one (which
    // now forwards to B).
    assert!(read_back(&b, vdisk, dir.path(), &nodes) == second_data);
    assert!(read_back(&a, vdisk, dir.path(), &nodes) == second_data);
    assert_eq!(ownership(&a, vdisk)["owner"], id_b.as_str());
}

/// A client of B long enough for one ask (B is added to the copy set, one copy more than
/// RF, and filled) that then leaves: once B has not asked for --hand-over-copy-keep-s, A's
/// curator claims the vdisk again and the set is back to RF copies, A first.
#[test]
fn a_copy_added_for_a_hand_over_nobody_takes_is_dropped_again() {
    let etcd = EtcdServer::start();
    let vdisk = "visited";
    let (a, b, c, dir, first_data) = written_through_a(
        &etcd,
        &["--hand-over-copy-keep-s", "4"],
        &["--migrate-after-s", "3"],
        vdisk,
        7,
    );
    let nodes = [&a, &b, &c];
    let id_a = node_id(&a);
    assert_eq!(ownership(&a, vdisk)["copies"].as_array().unwrap().len(), 2);

    // 4 s of forwarded I/O: B asks once after 3 s (a second ask would need 3 s more).
    let out = fio_verified_writes(&b.uri(vdisk), 4);
    assert!(
        out.status.success(),
        "fio through B failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        a.log()
            .contains("wants a copy; claiming the vdisk again to add it"),
        "B did not ask: {}",
        a.log()
    );
    assert_eq!(ownership(&a, vdisk)["owner"], id_a.as_str());

    let mut shrunk = serde_json::Value::Null;
    let dropped = wait_until(Duration::from_secs(60), || {
        shrunk = ownership(&a, vdisk);
        shrunk["copies"].as_array().unwrap().len() == 2 && a.log().contains("no longer asked for")
    });
    assert!(
        dropped,
        "the copy set kept its extra copy: {shrunk}\n{}",
        a.log()
    );
    assert_eq!(shrunk["owner"], id_a.as_str(), "{shrunk}");
    assert_eq!(shrunk["copies"][0], id_a.as_str(), "{shrunk}");
    // fio wrote past the pattern: it is intact.
    assert!(read_back(&a, vdisk, dir.path(), &nodes) == first_data);
}

#[test]
fn a_vdisk_with_one_copy_is_forwarded_but_stays_with_its_data() {
    let etcd = EtcdServer::start();
    let a = cluster_node(&etcd.url, &["--migrate-after-s", "2"]);
    let b = cluster_node(&etcd.url, &["--migrate-after-s", "2"]);
    let nodes = [&a, &b];
    let vdisk = "local";
    a.cli(&["vdisk", "create", vdisk, "--size", "32M"])
        .assert_ok("vdisk create");
    let dir = tempfile::tempdir().unwrap();
    let (first, first_data) = pattern(dir.path(), 5);
    nbdcopy(
        first.to_str().unwrap(),
        &a.uri(vdisk),
        "write through A",
        &nodes,
    );
    let id_a = node_id(&a);
    let out = fio_verified_writes(&b.uri(vdisk), 5);
    assert!(
        out.status.success(),
        "fio through B failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(ownership(&b, vdisk)["owner"], id_a.as_str());
    assert!(read_back(&b, vdisk, dir.path(), &nodes) == first_data);
    let (second, second_data) = pattern(dir.path(), 6);
    nbdcopy(
        second.to_str().unwrap(),
        &b.uri(vdisk),
        "write through B",
        &nodes,
    );
    assert!(read_back(&a, vdisk, dir.path(), &nodes) == second_data);
    assert_eq!(ownership(&a, vdisk)["owner"], id_a.as_str());
    assert!(!a.log().contains("handed the vdisk over"), "{}", a.log());
    // A request past the end gets the protocol's error through a forwarding node, and its
    // connection goes on.
    let mut conn = NbdConn::connect(b.nbd_addr(), vdisk).unwrap();
    assert_eq!(conn.read(32 << 20, 4096).unwrap(), Err(EINVAL));
    assert!(conn.read_ok(0, 4096)[..] == second_data[..4096]);
    conn.disconnect();
}

#[test]
fn a_forwarding_nodes_clients_go_on_when_the_owner_dies() {
    let etcd = EtcdServer::start();
    // Migration off: B keeps forwarding until A dies.
    let mut a = cluster_node(&etcd.url, &["--migrate-after-s", "0"]);
    let b = cluster_node(&etcd.url, &["--migrate-after-s", "0"]);
    let c = cluster_node(&etcd.url, &["--storage-only"]);
    let vdisk = "survivor";
    a.cli(&["vdisk", "create", vdisk, "--size", "64M", "--rf", "2"])
        .assert_ok("vdisk create --rf 2");
    // A claims it (its first client), then B's writer is forwarded to A.
    let out = run_bounded_env("nbdinfo", &[a.uri(vdisk)], &[], 30);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let writer = AckedWriter::start(b.nbd_addr(), vdisk, 8 << 20, 4);
    writer.wait_for_acks(200, Duration::from_secs(30));
    assert_eq!(ownership(&b, vdisk)["owner"], node_id(&a).as_str());
    a.kill9();
    let killed = Instant::now();
    // Once A is listed down, B's requests find no owner and B takes the vdisk over with a
    // copy from the storage-only node.
    writer.wait_for_acks(200, Duration::from_secs(60));
    let log = writer.finish();
    assert_eq!(ownership(&b, vdisk)["owner"], node_id(&b).as_str());
    log.verify(b.nbd_addr(), vdisk);
    eprintln!(
        "acked {} writes, {} uncertain, back within {:?}",
        log.acked_writes,
        log.uncertain_writes,
        killed.elapsed()
    );
    drop(c);
}

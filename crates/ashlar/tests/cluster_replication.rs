//! Replicated writes, end to end with a real etcd and three `ashlar node --etcd` processes on
//! loopback: a vdisk created with `--rf 2` is claimed by the node a client opens it on, which
//! records the copy set (itself and the storage-only node) and fences the other copy at its
//! epoch; every write the client makes reaches the copy node's own oplog and, after it drains,
//! its extent store, byte for byte. A copy that restarted is resynchronized, one that is down
//! replaced (writes fail meanwhile, never acknowledged with one copy); when the owner dies, a
//! surviving copy takes over with every acknowledged write and a new copy is filled.

mod common;
// Shared with other test binaries, each of which uses a part of it.
#[allow(dead_code)]
#[path = "../../meta/tests/common/etcd_server.rs"]
mod etcd_server;

use ashlar_powercut_fs::{CutPolicy, PowercutFs};
use common::nbd::NbdConn;
use common::writes::{self, Slot, BLOCK};
use common::{
    cluster_node, cluster_node_with_lease, mount_powercut, node_id, run_bounded, run_bounded_env,
    wait_until, Node,
};
use etcd_server::EtcdServer;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const VDISK: &str = "replicated";
const PATTERN_BYTES: usize = 4 << 20;
const FILLED_BYTES: usize = 32 << 20;

fn pattern(dir: &Path, seed: u8) -> (PathBuf, Vec<u8>) {
    let path = dir.join(format!("pattern-{seed}"));
    let data: Vec<u8> = (0..PATTERN_BYTES as u32)
        .map(|i| ((i % 251) as u8 ^ seed).wrapping_add((i >> 12) as u8))
        .collect();
    std::fs::write(&path, &data).unwrap();
    (path, data)
}

/// A file of 32 MiB: pattern 1, then other non-zero data, so a resync that sent everything
/// is told apart from one that sends what differs. Its path, the pattern and all of it.
fn filled_pattern(dir: &Path) -> (PathBuf, Vec<u8>, Vec<u8>) {
    let (path, pattern_data) = pattern(dir, 1);
    let mut filled = pattern_data.clone();
    filled.extend((0..FILLED_BYTES - PATTERN_BYTES).map(|i| (i % 253) as u8 | 1));
    std::fs::write(&path, &filled).unwrap();
    (path, pattern_data, filled)
}

/// An owner A (flags `a_args`) and its copy B, whose lease (60 s) outlives the faults a test
/// puts between them, so B stays a member that is up and stays the copy; an RF 2 vdisk
/// written through A with `filled_pattern` (returned, with B and the vdisk's directory name).
fn owner_and_steady_copy(
    etcd_url: &str,
    dir: &Path,
    a_args: &[&str],
    b_args: &[&str],
) -> (Node, Node, Vec<u8>, String) {
    let a = cluster_node(etcd_url, a_args);
    let b = cluster_node_with_lease(etcd_url, 60_000, b_args);
    a.cli(&["vdisk", "create", VDISK, "--size", "64M", "--rf", "2"])
        .assert_ok("vdisk create --rf 2");
    let (first, _, filled) = filled_pattern(dir);
    let (ok, text) = nbdcopy(first.to_str().unwrap(), &a.uri(VDISK));
    assert!(ok, "write through A: {text}\n{}", a.log());
    let copies = a.show(VDISK)["ownership"]["copies"].clone();
    assert_eq!(copies, serde_json::json!([node_id(&a), node_id(&b)]));
    let vdisk_dir = a.vdisk_dir_name(VDISK);
    (a, b, filled, vdisk_dir)
}

/// Writes `file` through `uri` in a thread until a write is acknowledged (within 90 s): how
/// long that took, and how many attempts failed first.
fn write_in_background(uri: String, file: PathBuf) -> std::thread::JoinHandle<(Duration, u32)> {
    std::thread::spawn(move || {
        let start = Instant::now();
        let mut failures = 0;
        loop {
            let (ok, _) = nbdcopy(file.to_str().unwrap(), &uri);
            if ok {
                return (start.elapsed(), failures);
            }
            failures += 1;
            assert!(
                start.elapsed() < Duration::from_secs(90),
                "no write acknowledged"
            );
            std::thread::sleep(Duration::from_millis(500));
        }
    })
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

/// `ashlar cluster status --json` as `node` answers it.
fn cluster_status(node: &Node) -> Value {
    let out = node.cli(&["cluster", "status", "--json"]);
    out.assert_ok("cluster status --json");
    serde_json::from_str(&out.stdout).unwrap()
}

/// The health `cluster status` gives the test's vdisk.
fn vdisk_health(status: &Value) -> String {
    status["vdisks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == VDISK)
        .map(|v| v["health"].as_str().unwrap().to_string())
        .unwrap_or_else(|| panic!("{status}"))
}

/// Waits up to 120 s until `cluster status` (asked of `node`) calls the test's vdisk "ok"
/// (every copy up, no resync running); that status.
fn wait_healthy(node: &Node) -> Value {
    let mut status = Value::Null;
    let ok = wait_until(Duration::from_secs(120), || {
        status = cluster_status(node);
        vdisk_health(&status) == "ok"
    });
    assert!(ok, "still not ok: {status}");
    status
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
    let path = node.egroup_path(vdisk_dir_name, 0);
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let start = 5 * 4096;
    assert!(
        bytes.len() >= start + PATTERN_BYTES,
        "{} is short",
        path.display()
    );
    bytes[start..start + PATTERN_BYTES].to_vec()
}

/// The vdisk reads back through owner `a` as `written` over the rest of `filled`, and copy
/// `c`'s extent store holds `written` (checked with `assert_copy_holds`).
fn assert_both_hold(
    a: &Node,
    c: &mut Node,
    dir: &Path,
    vdisk_dir: &str,
    written: &[u8],
    filled: &[u8],
) {
    let back = dir.join("back");
    let (ok, text) = nbdcopy(&a.uri(VDISK), back.to_str().unwrap());
    assert!(ok, "read through A: {text}");
    let read = std::fs::read(&back).unwrap();
    assert!(read[..PATTERN_BYTES] == written[..]);
    assert!(read[PATTERN_BYTES..FILLED_BYTES] == filled[PATTERN_BYTES..]);
    assert_copy_holds(
        c,
        vdisk_dir,
        written,
        "the copy's extent store does not hold the last write after its catch-up",
    );
}

/// Stops `node`, starts it again (its oplog drains into its extent store at start) and stops
/// it, then checks that its extent store holds `data` in egroup 0, byte for byte.
fn assert_copy_holds(node: &mut Node, vdisk_dir_name: &str, data: &[u8], what: &str) {
    node.sigterm_and_wait();
    node.restart();
    node.sigterm_and_wait();
    assert!(egroup0_data(node, vdisk_dir_name) == data, "{what}");
}

#[test]
fn rf2_writes_reach_the_copy_node_which_is_resynced_or_replaced_when_it_fails() {
    let etcd = EtcdServer::start();
    let a = cluster_node(&etcd.url, &[]);
    let mut b = cluster_node(&etcd.url, &[]);
    let mut c = cluster_node(&etcd.url, &["--storage-only", "--trim-copies-after-s", "0"]);
    // Created after B and C started: C learns of it from the catalog when its first
    // replicated record arrives.
    let out = a.cli(&["vdisk", "create", VDISK, "--size", "64M", "--rf", "2"]);
    out.assert_ok("vdisk create --rf 2");
    assert!(out.stdout.contains("rf 2"), "{}", out.stdout);
    let dir = tempfile::tempdir().unwrap();
    let (first, first_data, _) = filled_pattern(dir.path());

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
    let back = dir.path().join("back");
    let (ok, text) = nbdcopy(&a.uri(VDISK), back.to_str().unwrap());
    assert!(ok, "read through A: {text}");
    assert!(std::fs::read(&back).unwrap()[..PATTERN_BYTES] == first_data[..]);

    // C's copy is complete: stopped, restarted (its oplog drains into its extent store at
    // start) and stopped again, its extent store holds the pattern byte for byte.
    assert_copy_holds(
        &mut c,
        &vdisk_dir,
        &first_data,
        "C's extent store does not hold what the client wrote",
    );

    // C restarted: it may have missed records, so it refuses A's stream; A claims the vdisk
    // again (epoch + 1), resynchronizes C and writes go on at RF 2.
    c.restart();
    let (second, second_data) = pattern(dir.path(), 2);
    write_until_acknowledged(&a, &second);
    assert!(
        c.log().contains("restarted after the owner claimed"),
        "{}",
        c.log()
    );
    assert!(a.log().contains("claiming the vdisk again"), "{}", a.log());
    let ownership = a.show(VDISK)["ownership"].clone();
    assert!(
        ownership["owner_epoch"].as_u64().unwrap() > epoch,
        "{ownership}"
    );
    assert_eq!(
        ownership["copies"],
        serde_json::json!([node_id(&a), node_id(&c)]),
        "{ownership}"
    );
    // C held everything but what A wrote while C was away (the second pattern, 4 chunks),
    // and its restart lost nothing (its copy identity is the same): the claims since
    // compared only the chunks of the failed writes, never the 32 MiB C held. (The resync
    // runs while the vdisk serves: its end is awaited.)
    let resyncs = wait_for_resyncs(&a, |resyncs| !resyncs.is_empty());
    let pattern_chunks = (PATTERN_BYTES >> 20) as u64;
    for (sent, same) in &resyncs {
        assert!(
            sent + same <= pattern_chunks,
            "a resync of C after its restart compared {} chunks of 64 ({resyncs:?})",
            sent + same
        );
    }
    assert_copy_holds(
        &mut c,
        &vdisk_dir,
        &second_data,
        "C's extent store does not hold the second pattern",
    );
    let resyncs_before_b = resync_counts(&a.log()).len();

    // C down for good: A replaces it by B (the only other node up), copies everything to B,
    // and writes go on at RF 2; the owner stayed up throughout.
    let (third, third_data) = pattern(dir.path(), 3);
    write_until_acknowledged(&a, &third);
    let ownership = a.show(VDISK)["ownership"].clone();
    assert_eq!(
        ownership["copies"],
        serde_json::json!([node_id(&a), node_id(&b)]),
        "{ownership}"
    );
    assert!(replica_records(&b) > 0, "B applied no record");
    // B held nothing: it got every chunk of data it did not get from the client's writes
    // meanwhile (at least the 28 that only the first write filled), and none of zeros.
    let data_chunks = (FILLED_BYTES >> 20) as u64;
    wait_for_resyncs(&a, |resyncs| {
        resyncs[resyncs_before_b.min(resyncs.len())..]
            .iter()
            .any(|(sent, same)| {
                (data_chunks - pattern_chunks..=data_chunks).contains(sent) && sent + same == 64
            })
    });
    let (ok, text) = nbdcopy(&a.uri(VDISK), back.to_str().unwrap());
    assert!(ok, "read through A: {text}");
    assert!(std::fs::read(&back).unwrap()[..PATTERN_BYTES] == third_data[..]);

    // C back (with --trim-copies-after-s 0): its old copy is no longer needed (A and B hold
    // everything and are up), so C removes it; the vdisk still reads the same through A.
    let c_egroup = c.egroup_path(&vdisk_dir, 0);
    assert!(c_egroup.exists(), "C's old copy is on disk");
    c.restart();
    let start = Instant::now();
    // The data goes first, then the node logs it.
    while c_egroup.exists() || !c.log().contains("trimmed this node's copy") {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "C kept its dropped copy: {}",
            c.log()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    let (ok, text) = nbdcopy(&a.uri(VDISK), back.to_str().unwrap());
    assert!(ok, "read through A after C trimmed: {text}");
    assert!(std::fs::read(&back).unwrap()[..PATTERN_BYTES] == third_data[..]);
    assert_copy_holds(
        &mut b,
        &vdisk_dir,
        &third_data,
        "B's extent store does not hold the third pattern",
    );
}

/// A copy node that does not answer for a while (stopped with SIGSTOP, longer than the
/// replica timeout, shorter than its lease) but keeps running: writes fail meanwhile, and once
/// it answers again the owner's claim compares and sends only the chunks those failed writes
/// touched (a catch-up), not the whole vdisk; the copy then holds every acknowledged write.
#[test]
fn a_copy_that_stopped_answering_for_a_while_catches_up_on_the_chunks_failed_writes_touched() {
    let etcd = EtcdServer::start();
    let dir = tempfile::tempdir().unwrap();
    let (a, mut c, filled, vdisk_dir) = owner_and_steady_copy(&etcd.url, dir.path(), &[], &[]);
    let signal = |name: &str| send_signal(&c, name);
    signal("-STOP");
    let (second, second_data) = pattern(dir.path(), 2);
    let writer = write_in_background(a.uri(VDISK), second);
    // Longer than the replica timeout (5 s): the owner's writes to C fail.
    std::thread::sleep(Duration::from_secs(8));
    signal("-CONT");
    let (_, failures) = writer.join().unwrap();
    assert!(failures > 0, "a write succeeded while C was stopped");

    // The claim after C answered again compared only the 4 chunks of the second pattern
    // (the failed writes' chunks), not the 64 of the vdisk.
    let mut caught_up = String::new();
    let found = wait_until(Duration::from_secs(60), || {
        let log = a.log();
        let line = log.lines().rfind(|line| {
            line.contains("copies resynchronized") && line.contains("caught_up=true")
        });
        caught_up = line.unwrap_or_default().to_string();
        line.is_some()
    });
    assert!(found, "no catch-up: {}", a.log());
    let counts = resync_counts(&caught_up);
    let (sent, same) = counts[0];
    let pattern_chunks = (PATTERN_BYTES >> 20) as u64;
    assert!(
        sent + same >= 1 && sent + same <= pattern_chunks,
        "the catch-up compared {} chunks: {caught_up}",
        sent + same
    );
    assert!(
        !a.log()
            .lines()
            .any(|line| line.contains("copies resynchronized") && line.contains("caught_up=false")),
        "a claim compared the whole vdisk: {}",
        a.log()
    );
    assert_both_hold(&a, &mut c, dir.path(), &vdisk_dir, &second_data, &filled);
}

/// Sends signal `name` (`-STOP`, `-CONT`) to `node`'s process.
fn send_signal(node: &Node, name: &str) {
    let status = std::process::Command::new("kill")
        .args([name, &node.pid().to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill {name}");
}

/// The number of resync records in etcd (its JSON gateway, through curl).
fn resync_records(etcd_url: &str) -> u64 {
    // etcd's gateway takes keys in base64 (standard alphabet, padded).
    let b64 = |text: &str| -> String {
        const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        let mut out = String::new();
        for group in text.as_bytes().chunks(3) {
            let bits = group
                .iter()
                .enumerate()
                .fold(0u32, |acc, (i, b)| acc | u32::from(*b) << (16 - 8 * i));
            for i in 0..4 {
                if i <= group.len() {
                    out.push(ALPHABET[(bits >> (18 - 6 * i) & 63) as usize] as char);
                } else {
                    out.push('=');
                }
            }
        }
        out
    };
    let prefix = ashlar_cluster::keys::RESYNC_PREFIX;
    let mut end = prefix.as_bytes().to_vec();
    *end.last_mut().unwrap() += 1;
    let body = serde_json::json!({
        "key": b64(prefix),
        "range_end": b64(std::str::from_utf8(&end).unwrap()),
        "count_only": true,
    });
    let url = format!("{etcd_url}/v3/kv/range");
    let out = run_bounded(
        "curl",
        &["-sf", "-X", "POST", "-d", &body.to_string(), &url],
        30,
    );
    assert!(out.status.success(), "curl {url}");
    let answer: Value = serde_json::from_slice(&out.stdout).unwrap();
    answer["count"]
        .as_str()
        .map_or(0, |count| count.parse().unwrap())
}

/// A resync that fails (its copy stopped answering) leaves the vdisk under-replicated in
/// `cluster status` until a claim sees a resync through, not "ok" with copies that may lack
/// writes; deleting the vdisk removes its resync record.
#[test]
fn a_failed_resync_leaves_the_vdisk_under_replicated_until_one_completes() {
    let etcd = EtcdServer::start();
    let dir = tempfile::tempdir().unwrap();
    let slow = ["--resync-max-mib-s", "1", "--resync-latency-percent", "0"];
    let (mut a, b, _filled, _) = owner_and_steady_copy(&etcd.url, dir.path(), &slow, &[]);
    let signal = |name: &str| send_signal(&b, name);
    // A restarted knows nothing of its earlier claims: its next claim compares the whole
    // vdisk, at 1 MiB/s while a client reads (without client I/O a resync goes as fast as
    // it can, and this one would be over before B stops).
    a.kill9();
    a.restart();
    let mut reader = std::process::Command::new("fio")
        .args([
            "--name=reader",
            "--ioengine=nbd",
            &format!("--uri={}", a.uri(VDISK)),
            "--rw=randread",
            "--bs=4k",
            "--time_based",
            "--runtime=60",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("fio");
    let rebuilding = wait_until(Duration::from_secs(30), || {
        vdisk_health(&cluster_status(&a)) == "rebuilding"
    });
    assert!(rebuilding, "{}", cluster_status(&a));
    assert_eq!(resync_records(&etcd.url), 1);
    // B stops answering (its 60 s lease keeps it listed up): the resync fails, and so do
    // A's claims until B answers again.
    signal("-STOP");
    let failed = wait_until(Duration::from_secs(60), || {
        a.log().contains("resynchronizing the copies failed")
    });
    assert!(failed, "{}", a.log());
    // Rebuilding until A's claim at that epoch ends (its next claim cannot fence B).
    let mut status = Value::Null;
    let judged = wait_until(Duration::from_secs(30), || {
        status = cluster_status(&a);
        vdisk_health(&status) != "rebuilding"
    });
    assert!(judged, "{status}");
    assert_eq!(vdisk_health(&status), "under-replicated", "{status}");
    assert!(status["vdisks"][0]["resync"].is_null(), "{status}");
    assert_eq!(status["fault_tolerance"], 0, "{status}");
    assert_eq!(status["nodes_down"], 0, "{status}");
    signal("-CONT");
    let _ = reader.kill();
    let _ = reader.wait();
    a.cli(&["vdisk", "delete", VDISK]).assert_ok("vdisk delete");
    let removed = wait_until(Duration::from_secs(10), || resync_records(&etcd.url) == 0);
    assert!(removed, "the deleted vdisk's resync record stayed");
}

/// A copy node killed (-9) while a client writes, then started again: its restart lost
/// nothing it acknowledged, so its copy identity (`ashlar_storage::copy_identity`) is the
/// one it had, and the owner's claim catches it up on the chunks the failed writes touched.
/// Then the copy's disk comes back empty (its extent directory removed while it was
/// stopped): its identity is new, and the claim compares and sends the whole vdisk.
#[test]
fn a_copy_killed_mid_write_catches_up_after_its_restart_unless_it_lost_data() {
    let etcd = EtcdServer::start();
    let dir = tempfile::tempdir().unwrap();
    let (a, mut c, filled, vdisk_dir) = owner_and_steady_copy(&etcd.url, dir.path(), &[], &[]);
    let renewals = |node: &Node| node.log().matches("new copy identity").count();
    let renewals_before = renewals(&c);
    let resyncs_before = resync_lines(&a.log()).len();
    let (second, second_data) = pattern(dir.path(), 2);
    let writer = write_in_background(a.uri(VDISK), second.clone());
    std::thread::sleep(Duration::from_millis(50));
    c.kill9();
    std::thread::sleep(Duration::from_secs(2));
    c.restart();
    writer.join().unwrap();
    // Once more, in case the first write was through before C died: C refuses A's records
    // until A claims again.
    write_until_acknowledged(&a, &second);
    let pattern_chunks = (PATTERN_BYTES >> 20) as u64;
    let (sent, same, caught_up) = wait_for_resync_after(&a, resyncs_before);
    assert!(
        caught_up && sent + same <= pattern_chunks,
        "the claim after C's restart compared {} chunks (caught up: {caught_up})\n{}",
        sent + same,
        a.log()
    );
    assert_eq!(
        renewals(&c),
        renewals_before,
        "C's restart lost nothing, yet its identity changed: {}",
        c.log()
    );
    wait_healthy(&a);
    assert_both_hold(&a, &mut c, dir.path(), &vdisk_dir, &second_data, &filled);

    // C stopped (by assert_copy_holds) and its disk emptied of the vdisk's extents.
    let resyncs_before = resync_lines(&a.log()).len();
    let renewals_before = renewals(&c);
    let extents = c.egroup_path(&vdisk_dir, 0).parent().unwrap().to_path_buf();
    std::fs::remove_dir_all(&extents).unwrap();
    c.restart();
    let (third, third_data) = pattern(dir.path(), 3);
    write_until_acknowledged(&a, &third);
    let data_chunks = (FILLED_BYTES >> 20) as u64;
    let (sent, same, caught_up) = wait_for_resync_after(&a, resyncs_before);
    assert!(
        !caught_up && sent + same == 64 && sent >= data_chunks - pattern_chunks,
        "the claim after C lost its extents sent {sent} chunks and found {same} the same \
         (caught up: {caught_up})"
    );
    assert!(
        renewals(&c) > renewals_before,
        "C did not renew its identity: {}",
        c.log()
    );
    assert_copy_holds(
        &mut c,
        &vdisk_dir,
        &third_data,
        "C's extent store does not hold the third pattern after its full resync",
    );
}

/// A copy's power is cut (its data directory on powercut-fs, which drops every write it had
/// not made durable) while a client writes through the owner. The copy's identity files were
/// durable, so the restarted copy answers with the same identity and the owner's claim only
/// catches it up on the chunks its failed writes touched. That must be enough: afterwards
/// every block of the copy equals the owner's, which holds the newest acknowledged write
/// (or the write that failed at the cut).
#[test]
fn a_copy_whose_power_was_cut_catches_up_to_every_acknowledged_write() {
    // Cut at different points: while writes arrive, and in the client's pauses (600 ms
    // after every 150 writes), in which the copy drains its oplog (after 500 ms idle).
    for (seed, cut_after_ms) in [(7, 1500), (8, 2300), (9, 3100)] {
        power_cut_of_the_copy_during_writes(seed, cut_after_ms);
    }
}

fn power_cut_of_the_copy_during_writes(seed: u64, cut_after_ms: u64) {
    let etcd = EtcdServer::start();
    let dir = tempfile::tempdir().unwrap();
    let a = cluster_node(&etcd.url, &[]);
    let (mut c, fs, backing, mountpoint) = cluster_node_on_powercut(&etcd.url, 60_000, dir.path());
    let mut fs = Some(fs);
    a.cli(&["vdisk", "create", VDISK, "--size", "64M", "--rf", "2"])
        .assert_ok("vdisk create --rf 2");
    let (first, _, filled) = filled_pattern(dir.path());
    let (ok, text) = nbdcopy(first.to_str().unwrap(), &a.uri(VDISK));
    assert!(ok, "write through A: {text}\n{}", a.log());
    let copies = a.show(VDISK)["ownership"]["copies"].clone();
    assert_eq!(copies, serde_json::json!([node_id(&a), node_id(&c)]));
    let vdisk_dir = a.vdisk_dir_name(VDISK);
    let resyncs_before = resync_lines(&a.log()).len();

    let writer = tracked_writes_until_one_fails(a.nbd_addr());
    std::thread::sleep(Duration::from_millis(cut_after_ms));
    c.kill9();
    let report = fs
        .take()
        .unwrap()
        .cut(CutPolicy::RandomSubset { seed })
        .expect("cutting C's power");
    eprintln!("power cut of C: {report:?}");
    let (slots, writes) = writer.join().unwrap();
    eprintln!("{writes} writes until the cut");
    assert!(writes > 10, "only {writes} writes before the cut");
    let _remounted = mount_powercut(&backing, &mountpoint);
    c.restart();

    // A write elsewhere (past egroup 0) makes A claim again; C's identity is unchanged, so the
    // claim catches C up.
    let start = Instant::now();
    let mut conn = loop {
        // Opens are refused while a claim that failed is retried.
        if let Ok(mut conn) = NbdConn::connect(a.nbd_addr(), VDISK) {
            if matches!(conn.write(8 << 20, &[7u8; 4096]), Ok(0)) {
                break conn;
            }
        }
        assert!(start.elapsed() < Duration::from_secs(60), "{}", a.log());
        std::thread::sleep(Duration::from_millis(300));
    };
    let (sent, same, caught_up) = wait_for_resync_after(&a, resyncs_before);
    assert!(
        caught_up,
        "the claim after C's power cut compared everything ({sent} sent, {same} the same)"
    );
    wait_healthy(&a);

    // A holds, block by block, the newest acknowledged write or the failed one...
    let owner = conn.read_range(0, PATTERN_BYTES as u64, 1 << 20).unwrap();
    assert_tracked_blocks(&owner, &slots, &filled, "A");
    // ...and C's copy is the same, byte for byte.
    conn.disconnect();
    assert_copy_holds(
        &mut c,
        &vdisk_dir,
        &owner,
        "C's copy differs from A's after its power cut and catch-up",
    );
}

/// A cluster node (lease `lease_ms`) whose data directory sits on powercut-fs in `dir`:
/// the node, the mounted filesystem, and the backing directory and mount point (to mount it
/// again after a cut).
fn cluster_node_on_powercut(
    etcd_url: &str,
    lease_ms: u64,
    dir: &Path,
) -> (Node, PowercutFs, PathBuf, PathBuf) {
    let backing = dir.join("backing");
    let mountpoint = dir.join("mnt");
    std::fs::create_dir_all(backing.join("data")).unwrap();
    std::fs::create_dir_all(&mountpoint).unwrap();
    let fs = mount_powercut(&backing, &mountpoint);
    let lease = lease_ms.to_string();
    let node = Node::start_in(
        Some(mountpoint.join("data")),
        &[
            "--etcd",
            etcd_url,
            "--advertise",
            "127.0.0.1",
            "--node-lease-ttl-ms",
            &lease,
        ],
    );
    (node, fs, backing, mountpoint)
}

/// Writes of 4 to 64 KiB into the first 4 MiB of the vdisk through `nbd`, one at a time
/// (a pause of 600 ms after every 150), until one fails: each 4 KiB block's newest
/// acknowledged write and the failed one, and how many writes were made.
fn tracked_writes_until_one_fails(
    nbd: std::net::SocketAddr,
) -> std::thread::JoinHandle<(Vec<Slot>, u64)> {
    std::thread::spawn(move || {
        let mut conn = NbdConn::connect(nbd, VDISK).unwrap();
        let mut slots = vec![Slot::default(); PATTERN_BYTES / BLOCK as usize];
        let mut random = 0x9e37_79b9_7f4a_7c15u64;
        for seq in 1.. {
            random ^= random << 13;
            random ^= random >> 7;
            random ^= random << 17;
            let count = 1usize << (random % 5);
            let first = (random >> 8) as usize % (slots.len() / count) * count;
            let offset = first as u64 * BLOCK;
            for slot in &mut slots[first..first + count] {
                slot.in_flight = Some(seq);
            }
            let data = writes::pattern(offset, seq, count * BLOCK as usize);
            if !matches!(conn.write(offset, &data), Ok(0)) {
                return (slots, seq);
            }
            for slot in &mut slots[first..first + count] {
                slot.in_flight = None;
                slot.acked = Some(seq);
            }
            if seq % 150 == 0 {
                std::thread::sleep(Duration::from_millis(600));
            }
        }
        unreachable!()
    })
}

/// Each 4 KiB block of `read` (the first 4 MiB, as `who` serves it) holds its newest
/// acknowledged write, the write that failed, or (never written) `filled`'s bytes.
fn assert_tracked_blocks(read: &[u8], slots: &[Slot], filled: &[u8], who: &str) {
    for (i, slot) in slots.iter().enumerate() {
        let offset = i as u64 * BLOCK;
        let got = &read[offset as usize..(offset + BLOCK) as usize];
        let acked = match slot.acked {
            Some(seq) => writes::pattern(offset, seq, BLOCK as usize),
            None => filled[offset as usize..(offset + BLOCK) as usize].to_vec(),
        };
        let failed = slot
            .in_flight
            .map(|seq| writes::pattern(offset, seq, BLOCK as usize));
        assert!(
            got == acked.as_slice() || failed.as_deref() == Some(got),
            "{who}'s block at {offset}: {} (acknowledged: {:?}, failed: {:?})",
            writes::describe_block(got),
            slot.acked,
            slot.in_flight
        );
    }
}

/// The owner's power is cut (its data on powercut-fs) while a client writes through it:
/// once it is listed down, the client's node B takes the vdisk over from the storage-only
/// copy C, and every block holds the newest acknowledged write (or the failed one). An
/// acknowledged write survives the power loss of RF - 1 nodes.
#[test]
fn every_acknowledged_write_survives_a_power_cut_of_the_owner() {
    let etcd = EtcdServer::start();
    let dir = tempfile::tempdir().unwrap();
    let (mut a, fs, _, _) =
        cluster_node_on_powercut(&etcd.url, common::CLUSTER_LEASE_TTL_MS, dir.path());
    let b = cluster_node(&etcd.url, &[]);
    let c = cluster_node(&etcd.url, &["--storage-only"]);
    a.cli(&["vdisk", "create", VDISK, "--size", "64M", "--rf", "2"])
        .assert_ok("vdisk create --rf 2");
    let (first, _, filled) = filled_pattern(dir.path());
    let (ok, text) = nbdcopy(first.to_str().unwrap(), &a.uri(VDISK));
    assert!(ok, "write through A: {text}\n{}", a.log());
    assert_eq!(
        a.show(VDISK)["ownership"]["copies"],
        serde_json::json!([node_id(&a), node_id(&c)])
    );

    let id_a = node_id(&a);
    let writer = tracked_writes_until_one_fails(a.nbd_addr());
    std::thread::sleep(Duration::from_millis(2000));
    a.kill9();
    let report = fs
        .cut(CutPolicy::RandomSubset { seed: 11 })
        .expect("cutting A's power");
    eprintln!("power cut of A: {report:?}");
    let (slots, writes) = writer.join().unwrap();
    assert!(writes > 10, "only {writes} writes before the cut");

    wait_listed_down(&b, &id_a, "A");
    let back = dir.path().join("back");
    let (ok, text) = nbdcopy(&b.uri(VDISK), back.to_str().unwrap());
    assert!(ok, "read through B: {text}\n{}", b.log());
    let read = std::fs::read(&back).unwrap();
    assert_tracked_blocks(&read[..PATTERN_BYTES], &slots, &filled, "B");
    assert!(read[PATTERN_BYTES..FILLED_BYTES] == filled[PATTERN_BYTES..]);
    assert_eq!(b.show(VDISK)["ownership"]["owner"], node_id(&b).as_str());
}

/// Waits up to 30 s until `asked` lists node `id` (called `name` in failures) as down.
fn wait_listed_down(asked: &Node, id: &str, name: &str) {
    let down = wait_until(Duration::from_secs(30), || {
        common::node_state(asked, id) == "down"
    });
    assert!(down, "{name} never listed down");
}

/// The first resync (chunks sent, chunks the same, whether it caught up) an owner finished
/// after its first `before` ones, waiting up to 60 s.
fn wait_for_resync_after(owner: &Node, before: usize) -> (u64, u64, bool) {
    let mut found = None;
    wait_until(Duration::from_secs(60), || {
        found = resync_lines(&owner.log()).get(before).copied();
        found.is_some()
    });
    found.unwrap_or_else(|| panic!("no resync: {}", owner.log()))
}

/// The replication path under in-process network faults (`--test-net-faults`: this
/// machine's kernel has no netem), between an owner A and its copy B that both keep etcd:
/// a delayed link (writes go on, slower), a lossy one (lost records time out, A claims again
/// and catches B up; the client's retry goes through once the loss ends), and a partition
/// both ways (no write is acknowledged while it lasts; after the heal A catches B up, which
/// never restarted), and B's copy holds the last write.
#[test]
fn replication_survives_delay_loss_and_a_partition_between_owner_and_copy() {
    let etcd = EtcdServer::start();
    let dir = tempfile::tempdir().unwrap();
    let (a_faults, b_faults) = (dir.path().join("a-faults"), dir.path().join("b-faults"));
    std::fs::write(&a_faults, "").unwrap();
    std::fs::write(&b_faults, "").unwrap();
    let (a, mut b, filled, vdisk_dir) = owner_and_steady_copy(
        &etcd.url,
        dir.path(),
        &["--test-net-faults", a_faults.to_str().unwrap()],
        &["--test-net-faults", b_faults.to_str().unwrap()],
    );
    let to_b = format!("127.0.0.1:{}", b.node_port);
    let to_a = format!("127.0.0.1:{}", a.node_port);
    // The nodes read their files every 100 ms.
    let set = |file: &Path, text: String| {
        std::fs::write(file, text).unwrap();
        std::thread::sleep(Duration::from_millis(300));
    };

    // 30 ms (+ up to 10) on every segment A sends B: the write is acknowledged, later.
    set(&a_faults, format!("{to_b} delay_ms=30 jitter_ms=10\n"));
    let (second, second_data) = pattern(dir.path(), 2);
    let start = Instant::now();
    let (ok, text) = nbdcopy(second.to_str().unwrap(), &a.uri(VDISK));
    assert!(ok, "write over a delayed link: {text}\n{}", a.log());
    assert!(start.elapsed() >= Duration::from_millis(30));

    // Half of A's segments to B lost: lost records time out and fail the write; once the
    // loss ends, the client's retries go through.
    set(&a_faults, format!("{to_b} loss_ppm=500000\n"));
    let (third, _) = pattern(dir.path(), 3);
    let (ok, _) = nbdcopy(third.to_str().unwrap(), &a.uri(VDISK));
    assert!(
        !ok,
        "a 4 MiB write went through a link losing half of its segments"
    );
    set(&a_faults, String::new());
    write_until_acknowledged(&a, &third);
    // The claims' resyncs end (a catch-up that itself met the loss made the next claim
    // compare everything).
    wait_healthy(&a);

    // Both directions cut for 8 s: no write is acknowledged meanwhile; after the heal the
    // client's retries go through.
    set(&a_faults, format!("{to_b} cut=1\n"));
    set(&b_faults, format!("{to_a} cut=1\n"));
    let (fourth, fourth_data) = pattern(dir.path(), 4);
    let writer = write_in_background(a.uri(VDISK), fourth);
    std::thread::sleep(Duration::from_secs(8));
    set(&a_faults, String::new());
    set(&b_faults, String::new());
    let (took, _) = writer.join().unwrap();
    assert!(
        took >= Duration::from_secs(8),
        "a write was acknowledged across the partition after {took:?}"
    );

    wait_healthy(&a);
    let log = a.log();
    assert!(
        log.matches("a copy failed; claiming the vdisk again")
            .count()
            >= 2,
        "the loss and the partition each made A claim again: {log}"
    );
    // B never restarted and the last resync before the partition completed: the claim after
    // the partition caught B up.
    let last_resync = log
        .lines()
        .rfind(|line| line.contains("copies resynchronized"))
        .unwrap_or_else(|| panic!("no resync: {log}"));
    assert!(
        last_resync.contains("caught_up=true"),
        "the claim after the partition compared everything: {last_resync}"
    );
    let back = dir.path().join("back");
    let (ok, text) = nbdcopy(&a.uri(VDISK), back.to_str().unwrap());
    assert!(ok, "read through A: {text}");
    let read = std::fs::read(&back).unwrap();
    assert!(read[..PATTERN_BYTES] == fourth_data[..]);
    assert!(read[PATTERN_BYTES..FILLED_BYTES] == filled[PATTERN_BYTES..]);
    assert_ne!(second_data, fourth_data);
    assert_copy_holds(
        &mut b,
        &vdisk_dir,
        &fourth_data,
        "B's extent store does not hold the last write after the faults",
    );
}

/// A copy that is up (it keeps its etcd lease) but cut off from its owner: writes fail, and
/// once A's claims have failed to reach it for --replace-unreachable-copy-after-s, A's claim
/// replaces it by the third node (which answers), fills that one while serving, and writes
/// go on at RF 2 before the cut heals. The old copy, outside the set now, is trimmed.
#[test]
fn a_copy_cut_off_from_its_owner_is_replaced_once_unreachable_for_long() {
    let etcd = EtcdServer::start();
    let dir = tempfile::tempdir().unwrap();
    let (a_faults, b_faults) = (dir.path().join("a-faults"), dir.path().join("b-faults"));
    std::fs::write(&a_faults, "").unwrap();
    std::fs::write(&b_faults, "").unwrap();
    let (a, b, filled, vdisk_dir) = owner_and_steady_copy(
        &etcd.url,
        dir.path(),
        &[
            "--test-net-faults",
            a_faults.to_str().unwrap(),
            "--replace-unreachable-copy-after-s",
            "4",
        ],
        &[
            "--test-net-faults",
            b_faults.to_str().unwrap(),
            "--trim-copies-after-s",
            "0",
        ],
    );
    let mut c = cluster_node_with_lease(&etcd.url, 60_000, &[]);
    std::fs::write(&a_faults, format!("127.0.0.1:{} cut=1\n", b.node_port)).unwrap();
    std::fs::write(&b_faults, format!("127.0.0.1:{} cut=1\n", a.node_port)).unwrap();
    std::thread::sleep(Duration::from_millis(300));

    let (second, second_data) = pattern(dir.path(), 2);
    let (took, failures) = write_in_background(a.uri(VDISK), second).join().unwrap();
    assert!(
        failures > 0 && took >= Duration::from_secs(4),
        "a write was acknowledged after {took:?} with B cut off"
    );
    assert!(
        a.log()
            .contains("replacing copies on nodes that are up but have not answered"),
        "{}",
        a.log()
    );
    let copies = a.show(VDISK)["ownership"]["copies"].clone();
    assert_eq!(copies, serde_json::json!([node_id(&a), node_id(&c)]));
    wait_healthy(&a);
    std::fs::write(&a_faults, "").unwrap();
    std::fs::write(&b_faults, "").unwrap();

    let b_egroup = b.egroup_path(&vdisk_dir, 0);
    let trimmed = wait_until(Duration::from_secs(60), || !b_egroup.exists());
    assert!(trimmed, "B kept its replaced copy: {}", b.log());
    assert_both_hold(&a, &mut c, dir.path(), &vdisk_dir, &second_data, &filled);
}

/// Waits up to 60 s until the owner's finished resyncs satisfy `enough`; returns them.
fn wait_for_resyncs(owner: &Node, enough: impl Fn(&[(u64, u64)]) -> bool) -> Vec<(u64, u64)> {
    let start = Instant::now();
    loop {
        let resyncs = resync_counts(&owner.log());
        if enough(&resyncs) {
            return resyncs;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "resyncs so far {resyncs:?}\n{}",
            owner.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// (chunks sent, chunks the copies already held) of each claim's resync in an owner's log.
fn resync_counts(log: &str) -> Vec<(u64, u64)> {
    resync_lines(log)
        .into_iter()
        .map(|(sent, same, _)| (sent, same))
        .collect()
}

/// (chunks sent, chunks the copies already held, whether it caught up) of each claim's
/// resync in an owner's log.
fn resync_lines(log: &str) -> Vec<(u64, u64, bool)> {
    let field = |line: &str, name: &str| -> u64 {
        let at = line
            .find(&format!("{name}="))
            .unwrap_or_else(|| panic!("{line}"));
        let digits: String = line[at + name.len() + 1..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect();
        digits.parse().unwrap()
    };
    log.lines()
        .filter(|line| line.contains("copies resynchronized"))
        .map(|line| {
            (
                field(line, "chunks_sent"),
                field(line, "chunks_same"),
                line.contains("caught_up=true"),
            )
        })
        .collect()
}

/// Writes `file` through `node` until a write is acknowledged (a failed copy makes writes
/// fail until the owner resynchronized or replaced it).
fn write_until_acknowledged(node: &Node, file: &Path) {
    let start = Instant::now();
    loop {
        let (ok, text) = nbdcopy(file.to_str().unwrap(), &node.uri(VDISK));
        if ok {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "no write acknowledged within 60 s: {text}\n{}",
            node.log()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

#[test]
fn rf_above_one_needs_a_cluster_and_at_most_three() {
    let node = Node::start_with(&[]);
    let out = node.cli(&["vdisk", "create", "x", "--size", "16M", "--rf", "2"]);
    assert!(!out.status.success());
    assert!(out.stderr.contains("needs a cluster"), "{}", out.stderr);
    let out = node.cli(&["cluster", "status"]);
    assert!(!out.status.success());
    assert!(out.stderr.contains("runs alone"), "{}", out.stderr);
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

/// Nodes A and B and a storage-only node C, and an RF 2 vdisk written through A with
/// pattern `seed` (returned), whose copies are on A and C.
fn written_with_storage_only_copy(
    etcd_url: &str,
    dir: &Path,
    seed: u8,
) -> (Node, Node, Node, Vec<u8>) {
    let a = cluster_node(etcd_url, &[]);
    let b = cluster_node(etcd_url, &[]);
    let c = cluster_node(etcd_url, &["--storage-only"]);
    a.cli(&["vdisk", "create", VDISK, "--size", "64M", "--rf", "2"])
        .assert_ok("vdisk create --rf 2");
    let (first, first_data) = pattern(dir, seed);
    let (ok, text) = nbdcopy(first.to_str().unwrap(), &a.uri(VDISK));
    assert!(ok, "write through A: {text}");
    // The default placement: the owner and the storage-only node, which never serves.
    assert_eq!(
        a.show(VDISK)["ownership"]["copies"],
        serde_json::json!([node_id(&a), node_id(&c)])
    );
    (a, b, c, first_data)
}

#[test]
fn a_node_without_a_copy_takes_over_a_dead_owner_from_the_storage_only_copy() {
    let etcd = EtcdServer::start();
    let dir = tempfile::tempdir().unwrap();
    let (mut a, b, mut c, first_data) = written_with_storage_only_copy(&etcd.url, dir.path(), 3);
    let (id_a, id_b) = (node_id(&a), node_id(&b));
    let healthy = cluster_status(&b);
    assert_eq!(healthy["fault_tolerance"], 1, "{healthy}");
    assert_eq!(vdisk_health(&healthy), "ok", "{healthy}");
    let report = b.cli(&["cluster", "status"]);
    report.assert_ok("cluster status");
    assert!(
        report.stdout.contains("fault tolerance: 1 node failure(s)"),
        "{}",
        report.stdout
    );

    a.kill9();
    wait_listed_down(&b, &id_a, "A");
    // One copy left: the status says so before anyone takes the vdisk over.
    let degraded = cluster_status(&b);
    assert_eq!(degraded["nodes_down"], 1, "{degraded}");
    assert_eq!(degraded["fault_tolerance"], 0, "{degraded}");
    assert_eq!(vdisk_health(&degraded), "under-replicated", "{degraded}");

    // The client reconnects to B, which holds no copy: B gets one from the storage-only
    // node, then serves every acknowledged write.
    let back = dir.path().join("back");
    let (ok, text) = nbdcopy(&b.uri(VDISK), back.to_str().unwrap());
    assert!(ok, "read through B: {text}\n{}", b.log());
    assert_b_took_over_from_c(&b, &c, &back, &first_data);
    // The online resync of C (which held everything) ends soon after the takeover.
    let restored = wait_healthy(&b);
    assert_eq!(restored["fault_tolerance"], 1, "{restored}");
    assert_eq!(restored["rebuilding"], 0, "{restored}");

    // Writes go on at RF 2, onto the storage-only copy.
    let records_before = replica_records(&c);
    let (second, second_data) = pattern(dir.path(), 4);
    let (ok, text) = nbdcopy(second.to_str().unwrap(), &b.uri(VDISK));
    assert!(ok, "write through B: {text}\n{}", b.log());
    assert!(
        replica_records(&c) > records_before,
        "C got none of B's writes"
    );
    let vdisk_dir = b.vdisk_dir_name(VDISK);
    assert_copy_holds(
        &mut c,
        &vdisk_dir,
        &second_data,
        "C's extent store does not hold the second pattern",
    );
    // The old owner, restarted, finds the vdisk owned by B: its clients are forwarded to B
    // and read B's data, never A's stale copy, and B keeps the vdisk.
    a.restart();
    let through_a = dir.path().join("through-a");
    let (ok, text) = nbdcopy(&a.uri(VDISK), through_a.to_str().unwrap());
    assert!(ok, "read through A: {text}\n{}", a.log());
    assert!(std::fs::read(&through_a).unwrap()[..PATTERN_BYTES] == second_data[..]);
    assert_eq!(a.show(VDISK)["ownership"]["owner"], id_b.as_str());
}

#[test]
fn a_vdisk_whose_every_copy_is_down_stays_offline_and_serves_again_once_they_are_back() {
    let etcd = EtcdServer::start();
    let dir = tempfile::tempdir().unwrap();
    let (mut a, b, mut c, first_data) = written_with_storage_only_copy(&etcd.url, dir.path(), 5);
    let d = cluster_node(&etcd.url, &[]);
    let (id_a, id_c) = (node_id(&a), node_id(&c));
    let placed = serde_json::json!([id_a, id_c]);

    a.kill9();
    c.kill9();
    wait_listed_down(&b, &id_a, "A");
    wait_listed_down(&b, &id_c, "C");
    // B and D are up, enough for RF 2, but neither holds the data: the vdisk stays offline
    // and the record keeps naming the nodes that hold it.
    let refused = dir.path().join("refused");
    for attempt in 0..3 {
        let (ok, text) = nbdcopy(&b.uri(VDISK), refused.to_str().unwrap());
        assert!(
            !ok,
            "read through B with every copy down (attempt {attempt}): {text}"
        );
        std::thread::sleep(Duration::from_millis(700));
    }
    assert!(
        b.log().contains("no node holding a complete copy is up"),
        "{}",
        b.log()
    );
    assert_eq!(b.show(VDISK)["ownership"]["copies"], placed);
    assert_eq!(d.show(VDISK)["ownership"]["copies"], placed);

    // Both come back: the next client of B gets B a copy from one of them, and reads
    // every acknowledged write.
    a.restart();
    c.restart();
    let back = dir.path().join("back");
    let served = wait_until(Duration::from_secs(60), || {
        nbdcopy(&b.uri(VDISK), back.to_str().unwrap()).0
    });
    assert!(served, "B never served the vdisk again\n{}", b.log());
    assert_b_took_over_from_c(&b, &c, &back, &first_data);
}

/// B read `data` back into `back` after it got a copy (from storage-only C), and serves the
/// vdisk with copies on B and C.
fn assert_b_took_over_from_c(b: &Node, c: &Node, back: &Path, data: &[u8]) {
    assert!(std::fs::read(back).unwrap()[..PATTERN_BYTES] == data[..]);
    assert!(b.log().contains("got a copy of the vdisk"), "{}", b.log());
    let ownership = b.show(VDISK)["ownership"].clone();
    assert_eq!(ownership["owner"], node_id(b).as_str(), "{ownership}");
    assert_eq!(
        ownership["copies"],
        serde_json::json!([node_id(b), node_id(c)]),
        "{ownership}"
    );
}

#[test]
fn deleting_a_replicated_vdisk_removes_every_copy() {
    let etcd = EtcdServer::start();
    let a = cluster_node(&etcd.url, &[]);
    let c = cluster_node(&etcd.url, &["--storage-only"]);
    a.cli(&["vdisk", "create", VDISK, "--size", "64M", "--rf", "2"])
        .assert_ok("vdisk create --rf 2");
    let dir = tempfile::tempdir().unwrap();
    let (first, _) = pattern(dir.path(), 7);
    let (ok, text) = nbdcopy(first.to_str().unwrap(), &a.uri(VDISK));
    assert!(ok, "write through A: {text}");
    let vdisk_dir = a.vdisk_dir_name(VDISK);
    let copy_data = [
        c.data_dir.join("disk0/extents").join(&vdisk_dir),
        c.data_dir.join("disk0/oplog").join(&vdisk_dir),
    ];
    assert!(copy_data.iter().any(|p| p.exists()), "C holds no data");
    assert!(replica_records(&c) > 0);

    a.cli(&["vdisk", "delete", VDISK]).assert_ok("vdisk delete");
    let start = Instant::now();
    while copy_data.iter().any(|p| p.exists()) {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "C still holds the deleted vdisk's data:\n{}",
            c.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let listed = c.cli(&["vdisk", "list", "--json"]);
    listed.assert_ok("vdisk list");
    assert!(!listed.stdout.contains(VDISK), "{}", listed.stdout);
    assert!(c.log().contains("deleted on another node"), "{}", c.log());
}

/// The curator: a vdisk nobody writes to, whose owner died, gets its second copy back from
/// the survivor within `--rereplicate-after-s`, so a second failure later loses nothing.
#[test]
fn the_curator_restores_a_lost_copy_before_the_next_failure() {
    let etcd = EtcdServer::start();
    let curator = ["--rereplicate-after-s", "1"];
    let mut a = cluster_node(&etcd.url, &curator);
    let b = cluster_node(&etcd.url, &curator);
    let d = cluster_node(&etcd.url, &curator);
    let mut c = cluster_node(&etcd.url, &["--storage-only"]);
    a.cli(&["vdisk", "create", VDISK, "--size", "64M", "--rf", "2"])
        .assert_ok("vdisk create --rf 2");
    let dir = tempfile::tempdir().unwrap();
    let (first, first_data) = pattern(dir.path(), 7);
    let (ok, text) = nbdcopy(first.to_str().unwrap(), &a.uri(VDISK));
    assert!(ok, "write through A: {text}");
    let (id_a, id_c) = (node_id(&a), node_id(&c));
    assert_eq!(
        a.show(VDISK)["ownership"]["copies"],
        serde_json::json!([id_a, id_c])
    );

    // The owner dies and no client comes back: the curator leader (B or D) restores the
    // second copy from the storage-only node's, then leaves the vdisk unowned.
    a.kill9();
    let start = Instant::now();
    let restored = loop {
        let ownership = b.show(VDISK)["ownership"].clone();
        let copies = ownership["copies"].as_array().cloned().unwrap_or_default();
        if copies.len() == 2 && !copies.contains(&serde_json::json!(id_a)) {
            break ownership;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the copy on the dead owner was never replaced: {ownership}\nB:\n{}\nD:\n{}",
            b.log(),
            d.log()
        );
        std::thread::sleep(Duration::from_millis(300));
    };
    assert!(
        restored["copies"]
            .as_array()
            .unwrap()
            .contains(&serde_json::json!(id_c)),
        "the storage-only copy stays: {restored}"
    );
    // The placement changes before the resync ends and the claim is released: wait for
    // the curator to say it is done.
    let done = common::wait_until(Duration::from_secs(30), || {
        b.log().contains("curator: copies restored") || d.log().contains("curator: copies restored")
    });
    assert!(done, "B:\n{}\nD:\n{}", b.log(), d.log());
    let start = Instant::now();
    while !b.show(VDISK)["ownership"]["owner"].is_null() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the curator kept the vdisk it restored: {}",
            b.show(VDISK)["ownership"]
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let status = cluster_status(&b);
    assert_eq!(vdisk_health(&status), "ok", "{status}");

    // Now the storage-only node dies too: the restored copy holds every write.
    c.kill9();
    wait_listed_down(&b, &id_c, "C");
    let back = dir.path().join("back");
    let (ok, text) = nbdcopy(&b.uri(VDISK), back.to_str().unwrap());
    assert!(ok, "read through B after A and C died: {text}\n{}", b.log());
    assert!(std::fs::read(&back).unwrap()[..PATTERN_BYTES] == first_data[..]);
}

/// Read repair: blocks of the owner's extent store that fail their checksums (bytes flipped
/// on disk under the running node) are read from the other copy, served intact to the client
/// and rewritten on the owner, whose extent store then holds the right bytes again.
#[test]
fn a_damaged_block_on_the_owner_is_read_from_the_copy_and_repaired() {
    use std::os::unix::fs::FileExt;
    let etcd = EtcdServer::start();
    let a = cluster_node(&etcd.url, &[]);
    let _c = cluster_node(&etcd.url, &["--storage-only"]);
    a.cli(&["vdisk", "create", VDISK, "--size", "64M", "--rf", "2"])
        .assert_ok("vdisk create --rf 2");
    let dir = tempfile::tempdir().unwrap();
    let (first, first_data) = pattern(dir.path(), 9);
    let (ok, text) = nbdcopy(first.to_str().unwrap(), &a.uri(VDISK));
    assert!(ok, "write through A: {text}");
    let drained = common::wait_until(Duration::from_secs(30), || {
        a.vdisk_stats(VDISK)["oplog_live_bytes"].as_u64() == Some(0)
    });
    assert!(drained, "A's oplog never drained: {}", a.vdisk_stats(VDISK));
    // Flip bytes in three data blocks of A's egroup 0 (vdisk offsets 40 KiB, 1 MiB + 8 KiB
    // and 3 MiB): nothing has read them yet, so no cache holds them.
    let vdisk_dir = a.vdisk_dir_name(VDISK);
    let file = a.open_egroup(&vdisk_dir, 0);
    let damaged = [40u64 << 10, (1 << 20) + (8 << 10), 3 << 20];
    for at in damaged {
        let file_offset = 5 * 4096 + at + 100;
        let mut byte = [0u8; 1];
        file.read_exact_at(&mut byte, file_offset).unwrap();
        file.write_all_at(&[!byte[0]], file_offset).unwrap();
        file.sync_all().unwrap();
    }
    // Every byte reads back right, through A.
    let back = dir.path().join("back");
    let (ok, text) = nbdcopy(&a.uri(VDISK), back.to_str().unwrap());
    assert!(ok, "read through A: {text}\n{}", a.log());
    assert!(std::fs::read(&back).unwrap()[..PATTERN_BYTES] == first_data[..]);
    assert!(
        a.log()
            .contains("were read from another copy and are rewritten here"),
        "{}",
        a.log()
    );
    // The rewrite drains into A's extent store: the damage is gone from the disk.
    let repaired = common::wait_until(Duration::from_secs(30), || {
        a.vdisk_stats(VDISK)["oplog_live_bytes"].as_u64() == Some(0)
            && egroup0_data(&a, &vdisk_dir) == first_data
    });
    let now = egroup0_data(&a, &vdisk_dir);
    let differing: Vec<usize> = (0..PATTERN_BYTES)
        .filter(|i| now[*i] != first_data[*i])
        .take(8)
        .collect();
    assert!(
        repaired,
        "A's extent store still holds the damage at {differing:?}: {}\n{}",
        a.vdisk_stats(VDISK),
        a.log()
    );
}

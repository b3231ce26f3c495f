//! Ownership gates serving, end to end with a real etcd and two `ashlar node --etcd`
//! processes on loopback: the first node a client opens a vdisk on claims it (epoch 1); the
//! other node refuses it, naming the owner; once the owner is killed the other node still
//! refuses (the data is only on the dead node); the owner restarted claims it again at epoch
//! 2 and the data reads back; an owner cut off from etcd stops serving once its lease is no
//! longer surely valid and claims again (higher epoch) when etcd answers; and steady client
//! I/O makes no etcd requests, on the owner or (replicated) on the copy.

mod common;
// Shared with other test binaries, each of which uses a part of it.
#[allow(dead_code)]
#[path = "../../meta/tests/common/etcd_server.rs"]
mod etcd_server;

use common::{
    cluster_node, node_id, node_state, run_bounded, run_bounded_env, run_fio, Node,
    CLUSTER_LEASE_TTL_MS,
};
use etcd_server::EtcdServer;
use serde_json::Value;
use std::path::Path;
use std::time::{Duration, Instant};

const VDISK: &str = "shared";

fn ownership(node: &Node) -> Value {
    common::ownership(node, VDISK)
}

/// `nbdinfo` on the vdisk through `node`: (succeeded, everything it printed).
fn nbdinfo(node: &Node) -> (bool, String) {
    // libnbd reports a refused export as "no export named"; the server's own reason is in
    // its debug output.
    let out = run_bounded_env("nbdinfo", &[node.uri(VDISK)], &[("LIBNBD_DEBUG", "1")], 30);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// nbdcopy from `from` to `to` (files or NBD URIs): whether it succeeded, and its stderr.
fn nbdcopy(from: &str, to: &str) -> (bool, String) {
    let out = run_bounded_env("nbdcopy", &[from, to], &[("LIBNBD_DEBUG", "1")], 60);
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn wait_until(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn pattern_file(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("pattern");
    let data: Vec<u8> = (0..4u32 << 20).map(|i| (i % 251) as u8 ^ 0x5a).collect();
    std::fs::write(&path, data).unwrap();
    path
}

#[test]
fn the_first_opener_owns_a_vdisk_and_other_nodes_forward_to_it() {
    let etcd = EtcdServer::start();
    let mut a = cluster_node(&etcd.url, &[]);
    // Created before B starts: a node loads the shared catalog when it starts.
    a.create_vdisk(VDISK, "4M");
    let b = cluster_node(&etcd.url, &[]);
    let (id_a, id_b) = (node_id(&a), node_id(&b));
    // Listed everywhere (shared catalog), owned by nobody before any client opens it.
    assert!(ownership(&b)["owner"].is_null(), "{}", ownership(&b));

    let (ok, text) = nbdinfo(&a);
    assert!(ok, "open on A: {text}");
    let owned = ownership(&b);
    assert_eq!(owned["owner"], id_a.as_str(), "{owned}");
    assert_eq!(owned["owner_epoch"], 1, "{owned}");
    assert_eq!(owned["last_owner"], id_a.as_str(), "{owned}");
    // The plain table (not only --json) names the owner and its epoch, from either node.
    let table = b.cli(&["vdisk", "list"]);
    table.assert_ok("vdisk list on B");
    let header = table.stdout.lines().next().unwrap_or("");
    assert!(
        header.contains("OWNER") && header.contains("EPOCH"),
        "{}",
        table.stdout
    );
    let row = table.stdout.lines().find(|line| line.starts_with(VDISK));
    let fields: Vec<&str> = row
        .map(|r| r.split_whitespace().collect())
        .unwrap_or_default();
    assert_eq!(
        fields.iter().rev().take(2).copied().collect::<Vec<_>>(),
        ["1", id_a.as_str()],
        "{}",
        table.stdout
    );
    let shown = a.cli(&["vdisk", "show", VDISK]);
    assert!(
        shown
            .stdout
            .contains(&format!("owner:        {id_a} (epoch 1)")),
        "{}",
        shown.stdout
    );

    // A client of B is forwarded to A (docs/forwarding.md); B does not take the vdisk.
    let (ok, text) = nbdinfo(&b);
    assert!(ok, "B forwards a vdisk A owns: {text}");
    assert_eq!(ownership(&b)["owner"], id_a.as_str());
    let table = a.cli(&["node", "list", "--json"]);
    let nodes: Value = serde_json::from_str(&table.stdout).unwrap();
    for node in nodes.as_array().unwrap() {
        let expected = if node["node_id"] == id_a.as_str() {
            1
        } else {
            0
        };
        assert_eq!(node["vdisks_owned"], expected, "{node}");
    }

    // Data written through A lives on A only.
    let pattern = pattern_file(a.root.path());
    let (ok, err) = nbdcopy(pattern.to_str().unwrap(), &a.uri(VDISK));
    assert!(ok, "write through A: {err}");

    // A dies: B still refuses, because the data is on A.
    a.kill9();
    wait_until("A listed down", Duration::from_secs(20), || {
        node_state(&b, &id_a) == "down"
    });
    let (ok, text) = nbdinfo(&b);
    assert!(!ok, "B must not serve A's vdisk from its own disks: {text}");
    assert!(
        text.contains(&format!("data is on node {id_a}")) && text.contains("which is down"),
        "{text}"
    );
    assert!(ownership(&b)["owner"].is_null());
    assert_eq!(node_state(&b, &id_b), "up");

    // A comes back: it claims again at epoch 2, and the data is intact.
    a.restart();
    assert_reads_back(&a, &pattern);
    let owned = ownership(&b);
    assert_eq!(owned["owner"], id_a.as_str(), "{owned}");
    assert_eq!(owned["owner_epoch"], 2, "{owned}");
}

#[test]
fn an_owner_cut_off_from_etcd_stops_serving_and_claims_again_later() {
    let etcd = EtcdServer::start();
    let a = cluster_node(&etcd.url, &[]);
    a.create_vdisk(VDISK, "4M");
    let pattern = pattern_file(a.root.path());
    let (ok, err) = nbdcopy(pattern.to_str().unwrap(), &a.uri(VDISK));
    assert!(ok, "write through A: {err}");
    assert_eq!(ownership(&a)["owner_epoch"], 1);

    // Freeze etcd: no keep-alive answers, so A's lease is no longer surely valid after
    // one TTL. Writes must fail from then on.
    let pid = etcd.pid().to_string();
    assert!(run_bounded("kill", &["-STOP", pid.as_str()], 5)
        .status
        .success());
    std::thread::sleep(Duration::from_millis(CLUSTER_LEASE_TTL_MS + 1500));
    let (ok, err) = nbdcopy(pattern.to_str().unwrap(), &a.uri(VDISK));
    assert!(!ok, "a cut-off owner acknowledged writes: {err}");
    // A new connection is refused at open (the lapsed gate needs a claim, which needs
    // etcd); a connection already open gets EIO (the gate's own unit tests, and the log).
    assert!(
        err.contains("no export named") || a.log().contains("refusing I/O"),
        "stderr: {err}\nlog: {}",
        a.log()
    );
    assert!(run_bounded("kill", &["-CONT", pid.as_str()], 5)
        .status
        .success());

    // etcd answers again: A claims again, at a higher epoch, and serves.
    wait_until("A serves again", Duration::from_secs(30), || {
        nbdcopy(pattern.to_str().unwrap(), &a.uri(VDISK)).0
    });
    let owned = ownership(&a);
    assert!(owned["owner_epoch"].as_u64() > Some(1), "{owned}");
    assert_reads_back(&a, &pattern);
}

/// The vdisk read through `node` (nbdcopy) holds exactly the bytes of `pattern`.
fn assert_reads_back(node: &Node, pattern: &Path) {
    let back = node.root.path().join("back");
    let (ok, err) = nbdcopy(&node.uri(VDISK), back.to_str().unwrap());
    assert!(ok, "read through the node: {err}");
    assert_eq!(
        std::fs::read(&back).unwrap(),
        std::fs::read(pattern).unwrap()
    );
}

fn etcd_requests(node: &Node) -> u64 {
    node.http_json("/api/v1/node")["etcd_requests"]["total"]
        .as_u64()
        .expect("etcd request count")
}

#[test]
fn steady_client_io_makes_no_etcd_requests() {
    let etcd = EtcdServer::start();
    let a = cluster_node(&etcd.url, &[]);
    a.create_vdisk(VDISK, "64M");
    steady_io_without_etcd(&a, &[&a]);
}

#[test]
fn steady_replicated_io_makes_no_etcd_requests_on_either_copy() {
    let etcd = EtcdServer::start();
    let a = cluster_node(&etcd.url, &[]);
    let c = cluster_node(&etcd.url, &["--storage-only"]);
    a.cli(&["vdisk", "create", VDISK, "--size", "64M", "--rf", "2"])
        .assert_ok("vdisk create --rf 2");
    steady_io_without_etcd(&a, &[&a, &c]);
}

/// Opens the vdisk on `owner`, then runs fio for 2 s and for 6 s and checks that the etcd
/// requests each of `nodes` makes meanwhile do not grow with the I/O count.
fn steady_io_without_etcd(owner: &Node, nodes: &[&Node]) {
    let (ok, text) = nbdinfo(owner);
    assert!(ok, "{text}");
    let fio = |secs: &str| {
        let run = run_fio(&[
            "--name=steady".to_string(),
            "--ioengine=nbd".to_string(),
            format!("--uri={}", owner.uri(VDISK)),
            "--rw=randrw".to_string(),
            "--bs=4k".to_string(),
            "--iodepth=8".to_string(),
            "--size=64M".to_string(),
            "--time_based".to_string(),
            format!("--runtime={secs}"),
        ]);
        run.assert_ok("steady fio");
        let job = &run.jobs()[0];
        job["read"]["total_ios"].as_u64().unwrap() + job["write"]["total_ios"].as_u64().unwrap()
    };
    let requests = || nodes.iter().map(|n| etcd_requests(n)).collect::<Vec<u64>>();
    let before = requests();
    let short = fio("2");
    let middle = requests();
    let long = fio("6");
    let after = requests();
    assert!(short > 1000 && long > short, "ios {short} then {long}");
    // Keep-alives (every TTL/3) and one open's lookup are all there is: a few per second,
    // however many I/Os ran.
    let per_second = |requests: u64, secs: u64| requests as f64 / secs as f64;
    for i in 0..nodes.len() {
        assert!(
            per_second(middle[i] - before[i], 2) < 10.0
                && per_second(after[i] - middle[i], 6) < 10.0,
            "node {i}: etcd requests {} -> {} -> {} for {short} and {long} I/Os",
            before[i],
            middle[i],
            after[i]
        );
        assert!(after[i] - middle[i] < long / 100, "requests scale with I/O");
    }
}

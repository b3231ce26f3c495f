//! `ashlar node drain`, end to end with a real etcd and four `ashlar node --etcd` processes on
//! loopback: draining the storage-only copy holder moves its copy to another node (the owner
//! claims again); draining the owner releases its claim and the curator leader moves its copy;
//! the drained nodes can then die without any data lost. The only copy of a vdisk
//! (replication factor 1) moves too.

mod common;
// Shared with other test binaries, each of which uses a part of it.
#[allow(dead_code)]
#[path = "../../meta/tests/common/etcd_server.rs"]
mod etcd_server;

use common::{cluster_node, node_id, run_bounded_env, Node};
use etcd_server::EtcdServer;
use serde_json::Value;

const VDISK: &str = "drained";

fn nbdcopy(from: &str, to: &str, what: &str, node: &Node) {
    let out = run_bounded_env("nbdcopy", &[from, to], &[("LIBNBD_DEBUG", "1")], 60);
    assert!(
        out.status.success(),
        "{what}: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        node.log()
    );
}

fn copies(node: &Node) -> Vec<String> {
    node.show(VDISK)["ownership"]["copies"]
        .as_array()
        .unwrap_or(&Vec::new())
        .iter()
        .map(|c| c.as_str().unwrap().to_string())
        .collect()
}

fn draining(asked: &Node, id: &str) -> bool {
    let out = asked.cli(&["node", "list", "--json"]);
    out.assert_ok("node list");
    let nodes: Value = serde_json::from_str(&out.stdout).unwrap();
    nodes
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["node_id"] == id)
        .map(|n| n["draining"] == true)
        .unwrap_or(false)
}

#[test]
fn draining_moves_claims_and_copies_off_a_node_including_single_copies() {
    let etcd = EtcdServer::start();
    let mut a = cluster_node(&etcd.url, &[]);
    let b = cluster_node(&etcd.url, &[]);
    let d = cluster_node(&etcd.url, &[]);
    let mut c = cluster_node(&etcd.url, &["--storage-only"]);
    let (id_a, id_c) = (node_id(&a), node_id(&c));
    a.cli(&["vdisk", "create", VDISK, "--size", "64M", "--rf", "2"])
        .assert_ok("vdisk create --rf 2");
    a.cli(&["vdisk", "create", "single", "--size", "16M"])
        .assert_ok("vdisk create");
    let dir = tempfile::tempdir().unwrap();
    let data: Vec<u8> = (0..4u32 << 20).map(|i| (i % 249) as u8 ^ 0x3c).collect();
    let pattern = dir.path().join("pattern");
    std::fs::write(&pattern, &data).unwrap();
    nbdcopy(
        pattern.to_str().unwrap(),
        &a.uri(VDISK),
        "write through A",
        &a,
    );
    nbdcopy(
        pattern.to_str().unwrap(),
        &a.uri("single"),
        "write single",
        &a,
    );
    assert_eq!(copies(&a), vec![id_a.clone(), id_c.clone()]);

    // Drain the storage-only copy holder: the owner claims again and moves the copy.
    let out = b.cli(&["node", "drain", &id_c, "--timeout-s", "90"]);
    out.assert_ok("node drain C");
    assert!(
        out.stdout.contains("holds no vdisk's data"),
        "{}",
        out.stdout
    );
    assert!(draining(&b, &id_c));
    let after_c = copies(&b);
    assert_eq!(after_c.len(), 2, "{after_c:?}");
    assert!(
        after_c.contains(&id_a) && !after_c.contains(&id_c),
        "{after_c:?}"
    );
    assert!(a.log().contains("curator"), "{}", a.log());

    // Drain the owner, which also holds the only copy of "single" (RF 1): it gives its
    // claims up, and the curator leader moves both copies (the RF 1 one offline: the
    // leader copies it before it serves it).
    let out = b.cli(&["node", "drain", &id_a, "--timeout-s", "90"]);
    out.assert_ok("node drain A");
    let after_a = copies(&b);
    assert_eq!(after_a.len(), 2, "{after_a:?}");
    assert!(
        !after_a.contains(&id_a) && !after_a.contains(&id_c),
        "{after_a:?}"
    );
    assert_ne!(b.show(VDISK)["ownership"]["owner"], id_a.as_str());
    let single = b.show("single")["ownership"].clone();
    let single_copies = single["copies"].as_array().cloned().unwrap_or_default();
    assert_eq!(single_copies.len(), 1, "{single}");
    assert_ne!(single_copies[0], id_a.as_str(), "{single}");
    assert_ne!(single["owner"], id_a.as_str(), "{single}");
    assert!(
        a.log().contains("holds the vdisk's one copy"),
        "A recorded no copy set for single:\n{}",
        a.log()
    );
    let status: Value = serde_json::from_str(&b.cli(&["cluster", "status", "--json"]).stdout)
        .expect("cluster status --json");
    let listed = status["vdisks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "single")
        .cloned()
        .unwrap();
    assert_eq!(listed["copies"], single["copies"], "{status}");

    // Both drained nodes die: every byte of both vdisks is still there.
    a.kill9();
    c.kill9();
    let back = dir.path().join("back");
    nbdcopy(&b.uri(VDISK), back.to_str().unwrap(), "read through B", &b);
    assert!(std::fs::read(&back).unwrap()[..data.len()] == data[..]);
    let single_back = dir.path().join("single-back");
    nbdcopy(
        &b.uri("single"),
        single_back.to_str().unwrap(),
        "read single through B",
        &b,
    );
    assert!(std::fs::read(&single_back).unwrap()[..data.len()] == data[..]);

    // A cancelled drain lets the node take copies again.
    let out = b.cli(&["node", "drain", &id_c, "--cancel"]);
    out.assert_ok("drain --cancel");
    assert!(out.stdout.contains("cancelled"), "{}", out.stdout);
    assert!(!draining(&b, &id_c));
    drop(d);
}

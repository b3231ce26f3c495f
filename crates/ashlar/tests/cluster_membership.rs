//! Cluster membership end to end: `ashlar node --etcd` processes register in a real etcd and
//! `ashlar node list` shows them up, down after kill -9 (once their lease TTL passed) and down
//! at once after a clean stop; a node started before etcd says so in one line and registers
//! once etcd runs; a node without `--etcd` lists itself.

mod common;
#[path = "../../meta/tests/common/etcd_server.rs"]
mod etcd_server;

use common::{ashlar, cluster_node, free_port, node_id, Node, CLUSTER_LEASE_TTL_MS};
use etcd_server::EtcdServer;
use serde_json::Value;
use std::time::{Duration, Instant};

/// `ashlar node list --json` as the node `asked` sees it.
fn list(asked: &Node) -> Vec<Value> {
    let out = asked.cli(&["node", "list", "--json"]);
    out.assert_ok("ashlar node list --json");
    let nodes: Value = serde_json::from_str(&out.stdout).expect("JSON node list");
    nodes.as_array().expect("an array of nodes").clone()
}

fn entry<'a>(nodes: &'a [Value], id: &str) -> &'a Value {
    nodes
        .iter()
        .find(|n| n["node_id"] == id)
        .unwrap_or_else(|| panic!("node {id} not listed: {nodes:#?}"))
}

/// Polls the list until node `id` is in `state`; returns how long that took.
fn wait_for_state(asked: &Node, id: &str, state: &str, limit: Duration) -> Duration {
    let start = Instant::now();
    loop {
        let nodes = list(asked);
        if entry(&nodes, id)["state"] == state {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < limit,
            "node {id} not {state} within {limit:?}: {nodes:#?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn nodes_register_in_etcd_and_go_down_after_kill9_or_stop() {
    let etcd = EtcdServer::start();
    let mut nodes = vec![
        cluster_node(&etcd.url, &[]),
        cluster_node(&etcd.url, &[]),
        cluster_node(&etcd.url, &["--storage-only"]),
    ];
    let ids: Vec<String> = nodes.iter().map(node_id).collect();
    assert_eq!(
        ids.iter().collect::<std::collections::BTreeSet<_>>().len(),
        3,
        "every data directory is a node of its own: {ids:?}"
    );
    // A node serves HTTP only once registered, so all three are up now, seen from any node.
    for asked in &nodes {
        let listed = list(asked);
        assert_eq!(listed.len(), 3, "{listed:#?}");
        for (node, id) in nodes.iter().zip(&ids) {
            let e = entry(&listed, id);
            assert_eq!(e["state"], "up");
            assert_eq!(
                e["addresses"]["http"],
                format!("127.0.0.1:{}", node.http_port)
            );
            assert_eq!(
                e["addresses"]["nbd"],
                format!("127.0.0.1:{}", node.nbd_port)
            );
            assert_eq!(e["storage_only"], *id == ids[2]);
            assert_eq!(e["disks"].as_array().map(Vec::len), Some(1));
            assert!(e["capacity_bytes"].as_u64() > Some(0));
            assert!(e["free_bytes"].as_u64() <= e["capacity_bytes"].as_u64());
            // No vdisk is claimed yet in a cluster (ownership comes with replication).
            assert_eq!(e["vdisks_owned"], 0);
            assert_eq!(e["local"], node.http_port == asked.http_port);
        }
    }
    let table = nodes[0].cli(&["node", "list"]);
    table.assert_ok("ashlar node list");
    let lines: Vec<&str> = table.stdout.lines().collect();
    assert!(
        lines[0].starts_with("ID") && lines[0].contains("STATE"),
        "{}",
        table.stdout
    );
    assert_eq!(lines.len(), 4, "a header and three nodes: {}", table.stdout);
    for id in &ids {
        let line = lines.iter().find(|l| l.starts_with(id.as_str())).unwrap();
        assert!(line.contains(" up "), "{line}");
    }
    assert!(lines
        .iter()
        .any(|l| l.starts_with(ids[0].as_str()) && l.ends_with("(this node)")));

    // kill -9: the node cannot end its lease, so it is down once the lease TTL has passed.
    nodes[2].kill9();
    let took = wait_for_state(&nodes[0], &ids[2], "down", Duration::from_secs(20));
    assert!(
        took <= Duration::from_millis(CLUSTER_LEASE_TTL_MS) + Duration::from_secs(8),
        "down only after {took:?}"
    );
    let listed = list(&nodes[1]);
    assert_eq!(entry(&listed, &ids[2])["state"], "down");
    assert_eq!(
        entry(&listed, &ids[2])["storage_only"],
        true,
        "a down node keeps its record"
    );
    assert_eq!(entry(&listed, &ids[0])["state"], "up");
    assert_eq!(entry(&listed, &ids[1])["state"], "up");

    // A clean stop ends the lease: down at once, no TTL to wait for.
    assert!(nodes[1].sigterm_and_wait().success());
    let listed = list(&nodes[0]);
    assert_eq!(entry(&listed, &ids[1])["state"], "down", "{listed:#?}");
    assert_eq!(entry(&listed, &ids[0])["state"], "up");

    // The killed node comes back under the same id.
    nodes[2].restart();
    assert_eq!(node_id(&nodes[2]), ids[2]);
    assert_eq!(entry(&list(&nodes[0]), &ids[2])["state"], "up");
    assert_eq!(list(&nodes[0]).len(), 3);
}

#[test]
fn a_node_started_before_etcd_says_so_once_and_registers_when_etcd_starts() {
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}");
    let starter = {
        let url = url.clone();
        // Node::start_with returns once the node serves HTTP, which it does only after
        // reaching etcd and registering.
        std::thread::spawn(move || cluster_node(&url, &[]))
    };
    // Long enough for several retries (every 2 s).
    std::thread::sleep(Duration::from_secs(5));
    let _etcd = EtcdServer::start_on_port(port);
    let node = starter.join().expect("the node starts once etcd runs");
    let log = node.log();
    let complaints: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("cannot reach etcd"))
        .collect();
    assert_eq!(complaints.len(), 1, "one line, not one per retry:\n{log}");
    assert!(
        complaints[0].contains(&url) && complaints[0].contains("retrying every 2s"),
        "{}",
        complaints[0]
    );
    assert!(!log.contains("panicked"), "{log}");
    let listed = list(&node);
    assert_eq!(listed.len(), 1);
    assert_eq!(entry(&listed, &node_id(&node))["state"], "up");
}

#[test]
fn a_single_node_lists_itself_and_etcd_needs_advertise() {
    let node = Node::start_with(&["--ensure-vdisk", "demo:64M"]);
    let listed = list(&node);
    assert_eq!(listed.len(), 1, "{listed:#?}");
    let me = entry(&listed, &node_id(&node));
    assert_eq!(me["state"], "up");
    assert_eq!(me["local"], true);
    assert_eq!(
        me["addresses"]["http"],
        format!("127.0.0.1:{}", node.http_port)
    );
    assert_eq!(
        me["vdisks_owned"], 1,
        "a single node owns every vdisk it serves"
    );
    assert!(
        node.log().lines().all(|l| !l.contains("etcd")),
        "{}",
        node.log()
    );

    let out = ashlar(&["node", "--etcd", "http://127.0.0.1:1"]);
    assert_eq!(out.code(), Some(2), "clap usage error: {out:?}");
    assert!(out.stderr.contains("--advertise"), "{}", out.stderr);
}

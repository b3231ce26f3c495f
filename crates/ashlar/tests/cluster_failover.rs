//! Failover of a replicated vdisk, on three hosts of their own (network namespaces) with a
//! verifying writer that records every acknowledged write: the owner killed mid-write, and
//! the owner cut off from etcd and the other nodes (split brain). Afterwards every
//! acknowledged write reads back from the node that serves the vdisk now.

mod common;

use common::cluster::acked::AckedWriter;
use common::cluster::Cluster;
use serde_json::Value;
use std::time::Duration;

const VDISK: &str = "vd";
const REGION: u64 = 16 << 20;

/// `vdisk show --json` of the vdisk as node `asked` sees it.
fn show(cluster: &Cluster, asked: usize) -> Value {
    let out = cluster.cli(asked, &["vdisk", "show", VDISK, "--json"]);
    out.assert_ok("vdisk show");
    serde_json::from_str(&out.stdout).expect("JSON")
}

/// The index of the node with this id.
fn index_of(cluster: &Cluster, id: &str) -> usize {
    (0..cluster.len())
        .find(|&i| cluster.node_id(i) == id)
        .unwrap_or_else(|| panic!("no node {id}"))
}

/// Starts three nodes and an RF 2 vdisk owned by node 0 with a writer on it; returns the
/// cluster, the writer and the index of the node holding the other copy.
fn owned_and_written() -> (Cluster, AckedWriter, usize) {
    let cluster = Cluster::start(3);
    cluster
        .cli(
            0,
            &["vdisk", "create", VDISK, "--size", "256M", "--rf", "2"],
        )
        .assert_ok("vdisk create --rf 2");
    let writer = AckedWriter::start(cluster.nbd_addr(0), VDISK, REGION, 4);
    writer.wait_for_acks(300, Duration::from_secs(60));
    let ownership = show(&cluster, 0)["ownership"].clone();
    assert_eq!(
        ownership["owner"],
        cluster.node_id(0).as_str(),
        "{ownership}"
    );
    let copy = ownership["copies"][1]
        .as_str()
        .unwrap_or_else(|| panic!("no second copy: {ownership}"));
    let copy = index_of(&cluster, copy);
    assert_ne!(copy, 0);
    (cluster, writer, copy)
}

#[test]
fn killing_the_owner_mid_write_loses_no_acknowledged_write() {
    let (mut cluster, writer, copy) = owned_and_written();
    let third = 3 - copy; // nodes are 0, 1, 2
    cluster.kill9(0);
    let acked_at_kill = writer.acked_writes();
    // The client reconnects to the node holding the other copy, which takes over once the
    // dead owner is listed down.
    writer.retarget(cluster.nbd_addr(copy));
    writer.wait_for_acks(300, Duration::from_secs(90));
    let ownership = show(&cluster, copy)["ownership"].clone();
    assert_eq!(
        ownership["owner"],
        cluster.node_id(copy).as_str(),
        "{ownership}"
    );
    // The dead node's copy is replaced by the third node: writes are at RF 2 again.
    assert_eq!(
        ownership["copies"],
        serde_json::json!([cluster.node_id(copy), cluster.node_id(third)]),
        "{ownership}"
    );
    let log = writer.finish();
    eprintln!(
        "{} writes acknowledged ({acked_at_kill} before the kill), {} cut off, {} reconnects",
        log.acked_writes, log.uncertain_writes, log.reconnects
    );
    assert!(log.acked_writes > acked_at_kill);
    log.verify(cluster.nbd_addr(copy), VDISK);
}

#[test]
fn an_owner_cut_off_acknowledges_nothing_once_another_node_took_over() {
    let (mut cluster, writer, copy) = owned_and_written();
    // Split brain: node 0 reaches neither etcd nor the other nodes, but the client still
    // reaches it. Its lease runs out: from then on its writes fail.
    cluster.isolate(0);
    cluster.wait_down(0);
    let acked_while_cut = writer.acked_writes();
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(
        writer.acked_writes(),
        acked_while_cut,
        "the cut-off owner acknowledged writes after its lease ended"
    );
    // The client moves to the other copy, which takes the vdisk over.
    writer.retarget(cluster.nbd_addr(copy));
    writer.wait_for_acks(300, Duration::from_secs(90));
    // The old owner comes back: it finds the vdisk owned elsewhere and serves nothing of its
    // own copy: its clients are forwarded to the new owner and read every acknowledged write.
    cluster.heal(0);
    cluster.wait_up(0);
    let log = writer.finish();
    log.verify(cluster.nbd_addr(copy), VDISK);
    log.verify(cluster.nbd_addr(0), VDISK);
    let ownership = show(&cluster, copy)["ownership"].clone();
    assert_eq!(
        ownership["owner"],
        cluster.node_id(copy).as_str(),
        "{ownership}"
    );
}

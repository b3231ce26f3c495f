//! The multi-host harness proves itself: etcd and three `ashlar node` processes, each in a
//! network namespace of its own with its own address (common/netns.rs, common/cluster.rs),
//! listed up with those addresses and reachable there only; a partitioned node listed down
//! after its lease TTL and up again once healed; a killed node down, then up under the same id
//! after a restart; data written through NBD intact after kill -9 and restart; and every
//! namespace, veth and bridge gone after each test, also after a panic.
//!
//! Runs as root (namespaces); panics with what is missing otherwise, never skips.

mod common;

use common::cluster::acked::AckedWriter;
use common::cluster::netns::{names_with_prefix, NetLab};
use common::cluster::{Cluster, ClusterOptions, NBD_PORT};
use common::nbd::NbdConn;
use common::{fio_args, run_bounded, run_fio, CmdOut};
use std::collections::BTreeSet;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Drops the cluster and asserts that nothing of its lab is left: no namespace, no link.
fn drop_and_check_cleanup(cluster: Cluster) {
    let prefix = cluster.lab().name_prefix();
    let pids: Vec<u32> = (0..cluster.len())
        .filter_map(|i| cluster.pid_if_running(i))
        .collect();
    drop(cluster);
    assert_no_leftovers(&prefix);
    for pid in pids {
        assert!(
            !Path::new(&format!("/proc/{pid}")).exists(),
            "node process {pid} outlived its cluster"
        );
    }
}

fn assert_no_leftovers(prefix: &str) {
    let (netns, links) = names_with_prefix(prefix);
    assert!(
        netns.is_empty() && links.is_empty(),
        "left behind: namespaces {netns:?}, links {links:?}"
    );
    let listed = CmdOut::from_output(run_bounded("ip", &["netns", "list"], 20));
    assert!(!listed.stdout.contains(prefix), "{}", listed.stdout);
    let links = CmdOut::from_output(run_bounded("ip", &["link"], 20));
    assert!(!links.stdout.contains(prefix), "{}", links.stdout);
}

/// The inodes of the sockets process `pid` holds open.
fn socket_inodes(pid: u32) -> BTreeSet<String> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("reading the node's fds")
        .flatten()
        .filter_map(|fd| std::fs::read_link(fd.path()).ok())
        .filter_map(|target| {
            let text = target.to_string_lossy().into_owned();
            Some(
                text.strip_prefix("socket:[")?
                    .strip_suffix(']')?
                    .to_string(),
            )
        })
        .collect()
}

/// LISTEN sockets of a `/proc/.../net/tcp` table: (local "HEXIP:HEXPORT", inode).
fn listeners(table: &str) -> Vec<(String, String)> {
    std::fs::read_to_string(table)
        .unwrap_or_else(|e| panic!("reading {table}: {e}"))
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // sl local rem st tx:rx tr:when retrnsmt uid timeout inode; 0A = LISTEN.
            (fields.get(3) == Some(&"0A")).then(|| (fields[1].to_string(), fields[9].to_string()))
        })
        .collect()
}

/// `/proc/net/tcp`'s form of an IPv4 socket address (little-endian address, hex port).
fn proc_tcp_addr(ip: std::net::Ipv4Addr, port: u16) -> String {
    format!("{:08X}:{port:04X}", u32::from_le_bytes(ip.octets()))
}

#[test]
fn three_nodes_in_their_own_namespaces_are_listed_up_with_their_own_addresses() {
    let cluster = Cluster::start(3);
    let ids: Vec<String> = (0..3).map(|i| cluster.node_id(i)).collect();
    let ips: BTreeSet<_> = (0..3).map(|i| cluster.ip(i)).collect();
    assert_eq!(ips.len(), 3, "every node has its own address: {ips:?}");
    assert!(!ips.contains(&cluster.etcd_ip()));
    for asked in 0..3 {
        let nodes = cluster.nodes_seen_by(asked);
        assert_eq!(nodes.len(), 3, "node {asked} lists: {nodes:#?}");
        for (i, id) in ids.iter().enumerate() {
            let e = cluster
                .entry_of(&nodes, i)
                .unwrap_or_else(|| panic!("node {i} ({id}) not listed: {nodes:#?}"));
            assert_eq!(e["state"], "up", "{e}");
            let ip = cluster.ip(i);
            assert_eq!(e["addresses"]["http"], format!("{ip}:10810"), "{e}");
            assert_eq!(e["addresses"]["nbd"], format!("{ip}:10809"), "{e}");
            assert_eq!(e["local"], i == asked, "{e}");
        }
    }
    // The nodes listen beyond loopback: without the cluster's API token, 401.
    let url = format!("{}/api/v1/nodes", cluster.http(0));
    let (status, body) = common::cluster::http_get_url(&url, 5).unwrap();
    assert_eq!(status, 401, "GET {url} without a token: {body}");

    // The NBD port of node 0 serves at its namespace address, reached from the test process.
    cluster.create_vdisk(0, "vd", "64M");
    let info = CmdOut::from_output(run_bounded(
        "nbdinfo",
        &["--size", &cluster.nbd_uri(0, "vd")],
        30,
    ));
    info.assert_ok("nbdinfo --size at node 0's address");
    assert_eq!(info.stdout.trim(), (64u64 << 20).to_string());
    // ... and from another host (node 1's namespace) over the bridge.
    let across = cluster.lab().output_in(
        cluster.host_of(1),
        "nbdinfo",
        &["--size", &cluster.nbd_uri(0, "vd")],
        30,
    );
    across.assert_ok("nbdinfo from node 1's namespace");
    assert_eq!(across.stdout.trim(), (64u64 << 20).to_string());
    // Its listening socket is in its own namespace, on its address: not in the root
    // namespace's table (so not on the root's 127.0.0.1), not on its namespace's loopback.
    let pid = cluster.pid(0);
    let inodes = socket_inodes(pid);
    let own = listeners(&format!("/proc/{pid}/net/tcp"));
    let nbd_listener = own
        .iter()
        .find(|(addr, inode)| {
            *addr == proc_tcp_addr(cluster.ip(0), NBD_PORT) && inodes.contains(inode)
        })
        .unwrap_or_else(|| panic!("node 0 listens on no {}:{NBD_PORT}: {own:?}", cluster.ip(0)));
    let in_root: Vec<_> = listeners("/proc/self/net/tcp")
        .into_iter()
        .filter(|(_, inode)| inodes.contains(inode))
        .collect();
    assert!(
        in_root.is_empty(),
        "node 0 has listeners in the root namespace: {in_root:?}"
    );
    assert!(
        !own.iter()
            .any(|(addr, _)| *addr == proc_tcp_addr([127, 0, 0, 1].into(), NBD_PORT)),
        "something listens on 127.0.0.1:{NBD_PORT} in node 0's namespace: {own:?} (NBD: {nbd_listener:?})"
    );
    let loopback = cluster.lab().output_in(
        cluster.host_of(0),
        "nbdinfo",
        &["--size", &format!("nbd://127.0.0.1:{NBD_PORT}/vd")],
        30,
    );
    assert!(
        !loopback.status.success(),
        "NBD answered on 127.0.0.1 inside node 0's namespace: {loopback:?}"
    );
    drop_and_check_cleanup(cluster);
}

#[test]
fn a_partitioned_node_is_listed_down_after_its_lease_ttl_and_up_again_when_healed() {
    let mut cluster = Cluster::start_with(ClusterOptions {
        nodes: 3,
        lease_ttl_ms: 3000,
        ..ClusterOptions::default()
    });
    let id = cluster.node_id(2);
    let cut_at = Instant::now();
    cluster.partition(2);
    assert!(!cluster.lab().is_up(cluster.host_of(2)));
    // Within the lease TTL + 10 s (wait_down's limit), and not before its lease could expire.
    cluster.wait_down(2);
    let since_cut = cut_at.elapsed();
    assert!(
        since_cut >= Duration::from_millis(1000),
        "listed down {since_cut:?} after the cut: sooner than its lease could expire"
    );
    // Cut off, not dead: the process runs, and the test process cannot reach it.
    assert!(cluster.is_running(2), "{}", cluster.log(2));
    assert!(
        cluster.try_nodes(2).is_err(),
        "node 2 answered through a cut link"
    );
    for i in [0, 1] {
        let nodes = cluster.nodes_seen_by(i);
        assert_eq!(cluster.entry_of(&nodes, i).unwrap()["state"], "up");
        assert_eq!(cluster.entry_of(&nodes, 2).unwrap()["state"], "down");
    }

    cluster.heal(2);
    let took = cluster.wait_up(2);
    eprintln!("node 2 up again {took:?} after the heal");
    assert_eq!(cluster.node_id(2), id, "the same node came back");
    // Node 2 sees everyone up again, itself included.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let nodes = cluster.try_nodes(2);
        let all_up = nodes.as_ref().is_ok_and(|nodes| {
            nodes.len() == 3
                && (0..3).all(|i| {
                    cluster
                        .entry_of(nodes, i)
                        .is_some_and(|e| e["state"] == "up")
                })
        });
        if all_up {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "node 2 does not list all three up: {nodes:#?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    drop_and_check_cleanup(cluster);
}

#[test]
fn a_killed_node_is_listed_down_and_restarts_under_the_same_id() {
    let mut cluster = Cluster::start(3);
    let id = cluster.node_id(1);
    let pid = cluster.pid(1);
    cluster.kill9(1);
    assert!(!cluster.is_running(1));
    assert!(
        !Path::new(&format!("/proc/{pid}")).exists(),
        "kill9 reaps the process"
    );
    let took = cluster.wait_down(1);
    eprintln!("node 1 listed down {took:?} after kill -9");
    cluster.restart(1);
    assert_ne!(cluster.pid(1), pid);
    cluster.wait_up(1);
    assert_eq!(cluster.node_id(1), id);
    let nodes = cluster.nodes_seen_by(0);
    assert_eq!(
        nodes.len(),
        3,
        "the restarted node is the same member: {nodes:#?}"
    );
    let e = cluster.entry_of(&nodes, 1).unwrap();
    assert_eq!(e["state"], "up");
    assert_eq!(e["addresses"]["nbd"], format!("{}:10809", cluster.ip(1)));
    let log = cluster.log(1);
    assert_eq!(
        log.matches("----- test harness: start #").count(),
        2,
        "one log across both starts:\n{log}"
    );
    drop_and_check_cleanup(cluster);
}

#[test]
fn data_written_through_nbd_reads_back_after_kill9_and_restart() {
    let mut cluster = Cluster::start(3);
    cluster.create_vdisk(0, "vd", "256M");
    let uri = cluster.nbd_uri(0, "vd");
    let job = [
        "--rw=randwrite",
        "--bs=64k",
        "--size=32M",
        "--iodepth=8",
        "--randrepeat=1",
    ];
    let written = run_fio(&fio_args(
        &uri,
        "pattern",
        &[&job[..], &["--do_verify=0"]].concat(),
    ));
    written.assert_ok("writing the pattern");
    assert_eq!(written.io_bytes("write"), 32 << 20);

    cluster.kill9(0);
    cluster.wait_down(0);
    cluster.restart(0);
    cluster.wait_up(0);

    let verified = run_fio(&fio_args(
        &uri,
        "pattern",
        &[&job[..], &["--verify_only=1", "--do_verify=1"]].concat(),
    ));
    verified.assert_ok("verifying the pattern after kill -9 and restart");
    assert_eq!(verified.io_bytes("read"), 32 << 20, "every block verified");
    drop_and_check_cleanup(cluster);
}

#[test]
fn a_lab_is_removed_and_its_processes_killed_even_when_the_test_panics() {
    let lab = NetLab::new(2);
    let (tx, rx) = std::sync::mpsc::channel();
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
        let lab = lab;
        let mut sleeper = Command::new("sleep");
        sleeper.arg("600").stdin(Stdio::null());
        let child = lab.run_in(1, sleeper);
        // The process is in host 1's namespace, not in ours.
        let ns = |pid: &str| std::fs::read_link(format!("/proc/{pid}/ns/net")).unwrap();
        assert_ne!(ns(&child.id().to_string()), ns("self"));
        tx.send((lab.name_prefix(), child.id())).unwrap();
        std::mem::forget(child);
        panic!("a test failing while its lab runs");
    }));
    assert!(outcome.is_err());
    let (prefix, pid) = rx.recv().unwrap();
    assert_no_leftovers(&prefix);
    // Killed: gone, or a zombie nobody reaped (its Child handle was forgotten).
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    assert!(
        stat.is_empty() || stat.split_whitespace().nth(2) == Some("Z"),
        "the lab's process still runs: {stat}"
    );
}

#[test]
fn a_new_lab_removes_what_labs_of_dead_test_processes_left() {
    // Names as a lab of a process with pid 50,000,000 + ours (above any pid_max, so surely
    // dead; distinct for every test process) would have made them, as if that test binary
    // had been SIGKILLed.
    let dead_pid = 50_000_000 + std::process::id() as u64;
    let tag = format!("{}zz", common::cluster::netns::base36(dead_pid, 5));
    let prefix = format!("{}{tag}", common::cluster::netns::PREFIX);
    let netns = format!("{prefix}h0");
    let bridge = format!("{prefix}b");
    let ip = |args: &[&str]| CmdOut::from_output(run_bounded("ip", args, 20));
    ip(&["netns", "add", &netns]).assert_ok("ip netns add");
    ip(&["link", "add", &bridge, "type", "bridge"]).assert_ok("ip link add");
    // (A lab created meanwhile by another test process may already have swept them.)
    let lab = NetLab::new(1);
    assert_no_leftovers(&prefix);
    // The live lab itself is untouched by its own sweep.
    let (ours, links) = names_with_prefix(&lab.name_prefix());
    assert_eq!((ours.len(), links.len()), (1, 2), "{ours:?} {links:?}");
    let prefix = lab.name_prefix();
    drop(lab);
    assert_no_leftovers(&prefix);
}

#[test]
fn a_verifying_writer_records_acknowledged_writes_across_kill9_and_restart_of_its_node() {
    let mut cluster = Cluster::start(3);
    cluster.create_vdisk(0, "vd", "256M");
    let region = 16 << 20;
    let writer = AckedWriter::start(cluster.nbd_addr(0), "vd", region, 4);
    writer.wait_for_acks(300, Duration::from_secs(60));
    // Mid-write: four workers have a request in flight nearly all the time.
    cluster.kill9(0);
    let before_restart = writer.acked_writes();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        writer.acked_writes(),
        before_restart,
        "writes acknowledged by a killed node"
    );
    assert!(
        writer.uncertain_writes() >= 1,
        "no write was cut off by the kill"
    );
    cluster.restart(0);
    // The workers reconnect by themselves and go on.
    writer.wait_for_acks(300, Duration::from_secs(60));
    let log = writer.finish();
    eprintln!(
        "{} writes acknowledged, {} cut off, {} reconnects",
        log.acked_writes, log.uncertain_writes, log.reconnects
    );
    assert!(
        log.reconnects >= 4,
        "every worker reconnected: {}",
        log.reconnects
    );
    log.verify(cluster.nbd_addr(0), "vd");
    // The check is not vacuous: a block overwritten behind the writer's back is found.
    let written = log.blocks.iter().position(|b| b.acked.is_some()).unwrap();
    let mut conn = NbdConn::connect(cluster.nbd_addr(0), "vd").unwrap();
    conn.write_ok(written as u64 * 4096, &[0xa5; 4096]);
    let addr = cluster.nbd_addr(0);
    eprintln!("(a panic message of verify follows: expected)");
    let caught = std::panic::catch_unwind(|| log.verify(addr, "vd"));
    let message = caught.expect_err("verify accepted a foreign block");
    let message = message.downcast_ref::<String>().unwrap();
    assert!(
        message.contains("1 of 4096 blocks")
            && message.contains(&format!("block at {}", written * 4096)),
        "{message}"
    );
    drop_and_check_cleanup(cluster);
}

#[test]
fn an_isolated_node_is_listed_down_and_fenced_until_healed() {
    let mut cluster = Cluster::start(3);
    cluster.create_vdisk(2, "vd", "64M");
    let size = (64u64 << 20).to_string();
    let nbdinfo_from_node0 = |cluster: &Cluster| {
        cluster.lab().output_in(
            cluster.host_of(0),
            "nbdinfo",
            &["--size", &cluster.nbd_uri(2, "vd")],
            5,
        )
    };
    // Reading the whole vdisk from the test process, which the isolation does not cut.
    let read_from_test_process = |cluster: &Cluster| {
        CmdOut::from_output(run_bounded(
            "nbdcopy",
            &[&cluster.nbd_uri(2, "vd"), "null:"],
            30,
        ))
    };
    nbdinfo_from_node0(&cluster).assert_ok("nbdinfo from node 0 to node 2");

    // Cut from etcd and the other nodes, not from the test process: a split brain's old side.
    cluster.isolate(2);
    let took = cluster.wait_down(2);
    eprintln!("isolated node 2 listed down after {took:?}");
    assert!(cluster.is_running(2));
    let (status, body) = common::cluster::http_get_url(&format!("{}/healthz", cluster.http(2)), 5)
        .expect("the test process still reaches the isolated node");
    assert_eq!((status, body.trim()), (200, "ok"));
    // Its lease has ended: it can no longer prove it owns the vdisk, so it serves nothing
    // (the open is refused or the I/O fails), even to a client that still reaches it.
    let read = read_from_test_process(&cluster);
    assert!(
        !read.status.success(),
        "the isolated node served its vdisk after its lease ended: {read:?}"
    );
    let across = nbdinfo_from_node0(&cluster);
    assert!(
        !across.status.success(),
        "node 0 reached the isolated node 2: {across:?}"
    );

    cluster.heal(2);
    cluster.wait_up(2);
    let across = nbdinfo_from_node0(&cluster);
    across.assert_ok("nbdinfo from node 0 to node 2 after the heal");
    assert_eq!(across.stdout.trim(), size);
    read_from_test_process(&cluster).assert_ok("reading from node 2 after the heal");
    for host in 0..4 {
        let routes = cluster.lab().output_in(host, "ip", &["route"], 10);
        assert!(
            !routes.stdout.contains("blackhole"),
            "host {host}: {}",
            routes.stdout
        );
    }
    drop_and_check_cleanup(cluster);
}

#[test]
fn five_nodes_are_listed_up_again_after_etcd_is_killed_and_restarted() {
    let mut cluster = Cluster::start(5);
    let all_up = |cluster: &Cluster| {
        cluster.try_nodes(0).is_ok_and(|nodes| {
            nodes.len() == 5
                && (0..5).all(|i| {
                    cluster
                        .entry_of(&nodes, i)
                        .is_some_and(|e| e["state"] == "up")
                })
        })
    };
    assert!(all_up(&cluster), "{:#?}", cluster.try_nodes(0));
    cluster.kill9_etcd();
    let answer = cluster.try_nodes(0);
    assert!(
        answer.as_ref().is_err_and(|e| e.contains("503")),
        "a node lists nodes without etcd: {answer:?}"
    );
    cluster.restart_etcd();
    let back = Instant::now();
    while !all_up(&cluster) {
        assert!(
            back.elapsed() < Duration::from_secs(30),
            "not all five up 30 s after etcd came back: {:#?}",
            cluster.try_nodes(0)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!(
        "all five listed up {:?} after etcd came back",
        back.elapsed()
    );
    for i in 0..5 {
        assert!(
            cluster.is_running(i),
            "node {i} died with etcd:\n{}",
            cluster.log(i)
        );
    }
    drop_and_check_cleanup(cluster);
}

//! Durability across crashes and restarts.
//!
//! kill -9 in the middle of pipelined writes: after a restart every block must hold the newest
//! write that was acknowledged, or the newer write that was still in flight at the kill, and
//! nothing else (no older data, no torn or foreign data). Small random writes exercise the
//! oplog (and its replay); 1 MiB aligned writes exercise the bypass to the extent store.
//! Then a clean SIGTERM stop and restart keeps everything fio wrote.

mod common;

use common::nbd::{request_bytes, NbdConn};
use common::writes::{check_after_restart, write_until_killed, write_until_stopped};
use common::{describe, fio_args, run_fio, Node, MIB};
use std::io::Write;
use std::time::{Duration, Instant};

#[test]
fn kill9_during_small_random_writes_keeps_acknowledged_data() {
    let mut node = Node::start();
    node.create_vdisk("crash4k", "256M");
    let run = write_until_killed(&mut node, "crash4k", &[4096], 32 * MIB, |_| {});
    assert!(
        run.acked_writes > 1000,
        "too few writes to mean anything: {}",
        run.acked_writes
    );
    node.restart();
    check_after_restart(&node, "crash4k", &run);
}

#[test]
fn kill9_during_aligned_1m_writes_keeps_acknowledged_data() {
    let mut node = Node::start();
    node.create_vdisk("crash1m", "256M");
    let run = write_until_killed(&mut node, "crash1m", &[MIB], 128 * MIB, |_| {});
    assert!(
        run.acked_writes > 20,
        "too few writes to mean anything: {}",
        run.acked_writes
    );
    node.restart();
    check_after_restart(&node, "crash1m", &run);
}

#[test]
fn kill9_during_mixed_size_overwrites_keeps_acknowledged_data() {
    // 4 KiB and 64 KiB writes (oplog) and 1 MiB aligned writes (bypass, or oplog when the
    // extent has oplog data) overwriting each other in a small region.
    let mut node = Node::start();
    node.create_vdisk("crashmix", "256M");
    let run = write_until_killed(
        &mut node,
        "crashmix",
        &[4096, 4096, 65536, MIB],
        16 * MIB,
        |_| {},
    );
    assert!(
        run.acked_writes > 200,
        "too few writes: {}",
        run.acked_writes
    );
    node.restart();
    check_after_restart(&node, "crashmix", &run);
}

#[test]
fn kill9_with_constant_egroup_eviction_keeps_acknowledged_data() {
    // Each shard keeps at most two extent groups open while writes (and the drain) spread
    // over 16 egroups (64 MiB): every few operations an egroup is evicted and reopened, which
    // must re-normalize it (docs/extent-store-format.md) before overwriting its blocks.
    let mut node = Node::start_with(&["--max-open-egroups", "2"]);
    node.create_vdisk("evict", "256M");
    let run = write_until_killed(&mut node, "evict", &[4096, 65536, MIB], 64 * MIB, |_| {});
    assert!(
        run.acked_writes > 200,
        "too few writes: {}",
        run.acked_writes
    );
    node.restart();
    check_after_restart(&node, "evict", &run);
}

#[test]
fn kill9_right_after_shard_changes_keeps_acknowledged_data() {
    let mut node = Node::start();
    node.create_vdisk_shards("crashresh", "256M", 2);
    let run = write_until_killed(&mut node, "crashresh", &[4096, MIB], 64 * MIB, |node| {
        for shards in ["4", "1", "3"] {
            std::thread::sleep(Duration::from_millis(500));
            node.cli(&["vdisk", "set", "crashresh", "--shards", shards])
                .assert_ok("vdisk set --shards");
        }
    });
    assert!(
        run.acked_writes > 200,
        "too few writes: {}",
        run.acked_writes
    );
    node.restart();
    assert_eq!(
        node.show("crashresh")["shards"],
        3,
        "the last shard count persists"
    );
    check_after_restart(&node, "crashresh", &run);
}

#[test]
fn sigterm_under_write_load_exits_cleanly_and_keeps_acknowledged_data() {
    let mut node = Node::start();
    node.create_vdisk("termload", "256M");
    let mut took = Duration::ZERO;
    let mut status = None;
    let run = write_until_stopped(
        &mut node,
        "termload",
        &[4096, MIB],
        64 * MIB,
        |_| {},
        |node| {
            let started = Instant::now();
            status = Some(node.sigterm_and_wait_for(Duration::from_secs(10)));
            took = started.elapsed();
        },
    );
    let status = status.unwrap();
    assert!(
        status.success(),
        "SIGTERM with clients writing: {}",
        describe(&status)
    );
    eprintln!("stopped {took:?} after SIGTERM with writes in flight");
    assert!(
        run.acked_writes > 200,
        "too few writes: {}",
        run.acked_writes
    );
    node.restart();
    check_after_restart(&node, "termload", &run);
}

#[test]
fn sigterm_then_restart_keeps_everything_fio_wrote() {
    let mut node = Node::start();
    node.create_vdisk("persist", "256M");
    node.create_vdisk("empty", "256M");
    let small = [
        "--rw=randwrite",
        "--bs=4k",
        "--iodepth=32",
        "--size=64M",
        "--randseed=77",
    ];
    let large = [
        "--rw=write",
        "--bs=1M",
        "--iodepth=8",
        "--offset=64M",
        "--size=64M",
    ];
    let uri = node.uri("persist");
    for (name, job) in [("small", &small[..]), ("large", &large[..])] {
        let fio = run_fio(&fio_args(&uri, name, &[job, &["--do_verify=0"]].concat()));
        fio.assert_ok(&format!("{name} write"));
        assert_eq!(fio.io_bytes("write"), 64 * MIB);
    }
    // The verifier itself must notice missing data: the same verify-only job fails on a
    // vdisk that was never written.
    let control = run_fio(&fio_args(
        &node.uri("empty"),
        "small",
        &[&small[..], &["--verify_only=1", "--do_verify=1"]].concat(),
    ));
    assert!(
        !control.out.status.success(),
        "fio verify_only passed on an empty vdisk, so it verifies nothing:\n{}",
        control.out.stderr
    );

    let stopping = Instant::now();
    let status = node.sigterm_and_wait_for(Duration::from_secs(10));
    assert!(
        status.success(),
        "SIGTERM must stop the node with exit status 0, got {}",
        describe(&status)
    );
    eprintln!("node stopped {:?} after SIGTERM", stopping.elapsed());
    assert!(
        node.log().contains("stopped"),
        "the node logs its clean stop:\n{}",
        node.log()
    );

    node.restart();
    for (name, job) in [("small", &small[..]), ("large", &large[..])] {
        let fio = run_fio(&fio_args(
            &uri,
            name,
            &[job, &["--verify_only=1", "--do_verify=1"]].concat(),
        ));
        fio.assert_ok(&format!("{name} verify_only after restart"));
        assert_eq!(fio.io_bytes("read"), 64 * MIB, "{}", fio.json);
    }
}

#[test]
fn sigterm_with_idle_and_stuck_clients_still_exits_cleanly() {
    let mut node = Node::start();
    node.create_vdisk("stuck", "64M");
    // An idle client in transmission, one stuck in the handshake, and one that pipelines
    // reads but never reads a reply (its socket buffers fill up).
    let _idle = NbdConn::connect(node.nbd_addr(), "stuck").unwrap();
    let _handshaking = common::nbd::greet(node.nbd_addr()).unwrap();
    let mut greedy = NbdConn::connect(node.nbd_addr(), "stuck").unwrap();
    greedy
        .stream
        .set_write_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    for cookie in 0..512u64 {
        let request = request_bytes(
            common::nbd::CMD_READ,
            0,
            cookie,
            (cookie % 64) * MIB,
            MIB as u32,
            &[],
        );
        if greedy.stream.write_all(&request).is_err() {
            break; // the server stopped reading: backpressure
        }
    }
    let started = Instant::now();
    let status = node.sigterm_and_wait_for(Duration::from_secs(20));
    let took = started.elapsed();
    assert!(status.success(), "{}", describe(&status));
    assert!(
        took < Duration::from_secs(12),
        "SIGTERM took {took:?}: the node waits at most its 10 s grace for clients"
    );
    eprintln!("stopped {took:?} after SIGTERM");
    node.restart();
    let mut conn = NbdConn::connect(node.nbd_addr(), "stuck").unwrap();
    conn.write_ok(0, &[1u8; 4096]);
}

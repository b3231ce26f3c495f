//! Changing a vdisk's shard count while a verifying fio job writes to it: no I/O may fail and
//! no data may be lost or misplaced, during the changes (verify_backlog) and after them
//! (a verify_only pass over everything written).

mod common;

use common::{fio_args, parse_fio_json, require_tool, run_fio, CmdOut, Node, MIB};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn shard_count_changes_under_verifying_load() {
    require_tool("fio");
    require_tool("timeout");
    let node = Node::start();
    node.create_vdisk_shards("resh", "256M", 2);
    let uri = node.uri("resh");
    // Random 4 KiB writes over 96 MiB, each block written once and re-read by the backlog
    // verifier soon after; the rate cap makes the job last ~25 s so every change below
    // happens while it runs.
    let job = [
        "--rw=randwrite",
        "--bs=4k",
        "--iodepth=16",
        "--size=96M",
        "--randseed=4242",
    ];
    let mut args = fio_args(&uri, "resh", &job);
    args.extend(
        [
            "--do_verify=1",
            "--verify_backlog=256",
            "--rate_iops=1000",
            "--output-format=json",
        ]
        .map(String::from),
    );
    let report = node.root.path().join("fio-reshard.json");
    args.push(format!("--output={}", report.display()));
    let fio_stderr = node.root.path().join("fio-reshard.stderr");
    let mut fio = Command::new("timeout")
        .args(["-k", "5", "120", "fio"])
        .args(&args)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(node.root.path().join("fio-reshard.stdout")).unwrap())
        .stderr(std::fs::File::create(&fio_stderr).unwrap())
        .spawn()
        .expect("starting fio");
    let started = Instant::now();

    std::thread::sleep(Duration::from_secs(2));
    for shards in [1u32, 2, 4, 3, 1, 4, 2] {
        assert!(
            fio.try_wait().unwrap().is_none(),
            "fio ended before the shard change to {shards} ({:?} in): the change would not \
             be tested under load",
            started.elapsed()
        );
        let out = node.cli(&["vdisk", "set", "resh", "--shards", &shards.to_string()]);
        out.assert_ok(&format!("vdisk set --shards {shards}"));
        assert!(
            out.stdout.contains(&format!("now has {shards} shards")),
            "{}",
            out.stdout
        );
        assert_eq!(node.show("resh")["shards"], shards);
        assert_eq!(node.vdisk_stats("resh")["shards"], shards);
        std::thread::sleep(Duration::from_millis(1500));
    }
    assert!(
        fio.try_wait().unwrap().is_none(),
        "fio ended before the last shard change had been in effect for a while"
    );
    let status = loop {
        if let Some(status) = fio.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > Duration::from_secs(130) {
            let _ = fio.kill();
            panic!("fio did not finish");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let result = common::Fio {
        out: CmdOut {
            status,
            stdout: std::fs::read_to_string(node.root.path().join("fio-reshard.stdout"))
                .unwrap_or_default(),
            stderr: std::fs::read_to_string(&fio_stderr).unwrap_or_default(),
        },
        json: parse_fio_json(&std::fs::read_to_string(&report).unwrap_or_default()),
    };
    result.assert_ok("randwrite with verify_backlog during re-sharding");
    assert_eq!(result.io_bytes("write"), 96 * MIB);
    assert!(
        result.io_bytes("read") >= 96 * MIB,
        "every written block verified: {}",
        result.json
    );
    let stats = node.vdisk_stats("resh");
    assert_eq!(stats["errors"], 0, "{stats}");

    // After all the changes, and on a shard count different from the one it was written
    // with, everything must still read back: a verify-only pass of the same job.
    let verify = run_fio(&fio_args(
        &uri,
        "resh",
        &[&job[..], &["--verify_only=1", "--do_verify=1"]].concat(),
    ));
    verify.assert_ok("verify_only pass after re-sharding");
    assert_eq!(verify.io_bytes("read"), 96 * MIB, "{}", verify.json);
}

/// Every read sees the latest acknowledged write, whichever connection (and so reactor) wrote
/// it, and across shard changes that move blocks between shard controllers and their caches.
#[test]
fn reads_see_the_latest_write_across_connections_and_shard_changes() {
    use common::nbd::NbdConn;
    let node = Node::start();
    node.create_vdisk_shards("coherent", "64M", 2);
    // Connections are spread over the reactors round-robin: three cover both of them.
    let mut conns: Vec<NbdConn> = (0..3)
        .map(|_| NbdConn::connect(node.nbd_addr(), "coherent").unwrap())
        .collect();
    // Blocks in different 4 MiB shard ranges, some in the same extent, some sub-block.
    let blocks: Vec<u64> = (0..16u64)
        .map(|i| i * 4 * MIB + (i % 4) * 4096)
        .chain([4096, 8192, 63 * MIB])
        .collect();
    let payload = |round: u64, offset: u64| -> Vec<u8> {
        let mut data = Vec::with_capacity(4096);
        for i in 0..512u64 {
            data.extend_from_slice(&((round << 48) | (offset + i * 8)).to_le_bytes());
        }
        data
    };
    let shard_plan = [1u32, 3, 2, 4, 1, 2];
    for (round, shards) in shard_plan.iter().enumerate() {
        let round = round as u64 + 1;
        // Warm every reader's cache with the previous contents (read twice: multi-touch).
        for conn in conns.iter_mut() {
            for &offset in &blocks {
                conn.read_ok(offset, 4096);
                conn.read_ok(offset, 4096);
            }
        }
        // One connection writes; the writer rotates.
        let writer = (round as usize) % conns.len();
        for &offset in &blocks {
            conns[writer].write_ok(offset, &payload(round, offset));
        }
        for (i, conn) in conns.iter_mut().enumerate() {
            for &offset in &blocks {
                assert!(
                    conn.read_ok(offset, 4096) == payload(round, offset),
                    "round {round}: connection {i} reads stale data at {offset} after \
                     connection {writer} wrote it"
                );
            }
        }
        // Change the shard count under the open connections; the data stays visible.
        node.cli(&["vdisk", "set", "coherent", "--shards", &shards.to_string()])
            .assert_ok("vdisk set --shards");
        for (i, conn) in conns.iter_mut().enumerate() {
            for &offset in &blocks {
                assert!(
                    conn.read_ok(offset, 4096) == payload(round, offset),
                    "round {round}: connection {i} reads wrong data at {offset} after the \
                     change to {shards} shards"
                );
            }
        }
    }
    for conn in conns {
        conn.disconnect();
    }
}

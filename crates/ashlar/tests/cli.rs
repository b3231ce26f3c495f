//! The `ashlar vdisk ...` command line against a real node: happy paths, every error case (exit
//! 1, one `error:` line), where `--server` may be given, `--help`, and thin provisioning.

mod common;

use common::nbd::NbdConn;
use common::{allocated_bytes, ashlar, ashlar_env, free_port, Node, GIB, MIB};
use serde_json::Value;
use std::time::{Duration, Instant};

fn list_json(node: &Node) -> Vec<Value> {
    let out = node.cli(&["vdisk", "list", "--json"]);
    out.assert_ok("vdisk list --json");
    serde_json::from_str::<Value>(&out.stdout)
        .unwrap_or_else(|e| panic!("vdisk list --json ({e}): {}", out.stdout))
        .as_array()
        .expect("an array")
        .clone()
}

fn names(node: &Node) -> Vec<String> {
    common::vdisk_names(&node.cli(&["vdisk", "list", "--json"]))
}

#[test]
fn create_list_show_resize_set_delete() {
    let node = Node::start();
    assert!(names(&node).is_empty());

    let out = node.cli(&["vdisk", "create", "db1", "--size", "1G", "--shards", "3"]);
    out.assert_ok("create db1");
    assert_eq!(out.stdout.trim(), "created vdisk db1 (1G, 3 shards, rf 1)");
    let out = node.cli(&["vdisk", "create", "web.logs_2", "--size", "512M"]);
    out.assert_ok("create web.logs_2");
    assert_eq!(
        out.stdout.trim(),
        "created vdisk web.logs_2 (512M, 2 shards, rf 1)",
        "default shards = reactors (2)"
    );
    assert_eq!(names(&node), ["db1", "web.logs_2"]);

    // The table has a header and one row per vdisk with size and shards.
    let out = node.cli(&["vdisk", "list"]);
    out.assert_ok("vdisk list");
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(lines.len(), 3, "{}", out.stdout);
    assert!(lines[0].contains("NAME") && lines[0].contains("SIZE") && lines[0].contains("SHARDS"));
    let row: Vec<&str> = lines
        .iter()
        .find(|l| l.starts_with("db1 "))
        .unwrap()
        .split_whitespace()
        .collect();
    assert_eq!(&row[..3], ["db1", "1G", "3"], "{}", out.stdout);

    // show, as text and JSON.
    let out = node.cli(&["vdisk", "show", "db1"]);
    out.assert_ok("vdisk show");
    assert!(out.stdout.contains("name:         db1"), "{}", out.stdout);
    assert!(
        out.stdout.contains("1G (1073741824 bytes)"),
        "{}",
        out.stdout
    );
    assert!(
        out.stdout
            .contains(&format!("nbd://127.0.0.1:{}/db1", node.nbd_port)),
        "{}",
        out.stdout
    );
    let db1 = node.show("db1");
    assert_eq!(db1["name"], "db1");
    assert_eq!(db1["size_bytes"], GIB);
    assert_eq!(db1["shards"], 3);
    assert_eq!(db1["connections"], 0);
    assert_eq!(db1["nbd_uri"], node.uri("db1"));

    // The HTTP API agrees.
    let api = node.http_json("/api/v1/vdisks");
    assert_eq!(api.as_array().unwrap().len(), 2, "{api}");

    // resize: grow, then shrink with --allow-shrink.
    let out = node.cli(&["vdisk", "resize", "db1", "--size", "2G"]);
    out.assert_ok("grow");
    assert_eq!(out.stdout.trim(), "resized vdisk db1 to 2G");
    assert_eq!(node.show("db1")["size_bytes"], 2 * GIB);
    node.cli(&["vdisk", "resize", "db1", "--size", "256M", "--allow-shrink"])
        .assert_ok("shrink with --allow-shrink");
    assert_eq!(node.show("db1")["size_bytes"], 256 * MIB);

    // set shards.
    let out = node.cli(&["vdisk", "set", "db1", "--shards", "5"]);
    out.assert_ok("set shards");
    assert_eq!(out.stdout.trim(), "vdisk db1 now has 5 shards");
    assert_eq!(node.show("db1")["shards"], 5);

    // delete: the vdisk and its data go away.
    {
        let mut conn = NbdConn::connect(node.nbd_addr(), "db1").unwrap();
        conn.write_ok(0, &vec![1u8; MIB as usize]);
        conn.disconnect();
    }
    let extents = node
        .data_dir
        .join("disk0/extents")
        .join(node.vdisk_dir_name("db1"));
    assert!(extents.exists(), "{} after a write", extents.display());
    assert!(common::wait_until(Duration::from_secs(5), || node
        .show("db1")["connections"]
        == 0));
    let out = node.cli(&["vdisk", "delete", "db1"]);
    out.assert_ok("delete");
    assert_eq!(out.stdout.trim(), "deleted vdisk db1");
    assert_eq!(names(&node), ["web.logs_2"]);
    assert!(
        common::wait_until(Duration::from_secs(10), || !extents.exists()),
        "the data of a deleted vdisk is removed: {} still exists",
        extents.display()
    );
    assert!(NbdConn::connect(node.nbd_addr(), "db1").is_err());
    // The name can be used again, for a new (empty) vdisk.
    node.create_vdisk("db1", "64M");
    let mut conn = NbdConn::connect(node.nbd_addr(), "db1").unwrap();
    assert_eq!(conn.read_ok(0, 4096), vec![0u8; 4096]);
    conn.disconnect();
}

#[test]
fn error_cases_exit_1_with_one_error_line() {
    let node = Node::start();
    node.create_vdisk("dup", "1G");

    node.cli(&["vdisk", "create", "dup", "--size", "1G"])
        .assert_cli_error("already exists");
    node.cli(&["vdisk", "create", "x", "--size", "12X"])
        .assert_cli_error("12X");
    node.cli(&["vdisk", "create", "x", "--size", "0"])
        .assert_cli_error("larger than 0");
    node.cli(&["vdisk", "create", "x", "--size", "1000"])
        .assert_cli_error("512");
    node.cli(&["vdisk", "create", "x", "--size", "1G", "--shards", "0"])
        .assert_cli_error("shard");
    node.cli(&["vdisk", "create", "x", "--size", "1G", "--shards", "65"])
        .assert_cli_error("shard");
    for bad in ["a/b", "has space", ".hidden", &"n".repeat(65), "ü"] {
        node.cli(&["vdisk", "create", bad, "--size", "1G"])
            .assert_cli_error("invalid vdisk name");
    }
    for args in [
        &["vdisk", "show", "nope"][..],
        &["vdisk", "show", "nope", "--json"],
        &["vdisk", "resize", "nope", "--size", "2G"],
        &["vdisk", "set", "nope", "--shards", "2"],
        &["vdisk", "delete", "nope"],
        &["vdisk", "delete", "nope", "--force"],
    ] {
        node.cli(args).assert_cli_error("'nope' not found");
    }
    node.cli(&["vdisk", "resize", "dup", "--size", "512M"])
        .assert_cli_error("--allow-shrink");
    node.cli(&["vdisk", "resize", "dup", "--size", "0", "--allow-shrink"])
        .assert_cli_error("larger than 0");
    node.cli(&["vdisk", "set", "dup", "--shards", "0"])
        .assert_cli_error("between 1 and 64");
    // Nothing changed.
    let dup = node.show("dup");
    assert_eq!(dup["size_bytes"], GIB);
    assert_eq!(dup["shards"], 2);
    assert_eq!(names_len(&node), 1);
}

fn names_len(node: &Node) -> usize {
    list_json(node).len()
}

#[test]
fn delete_is_refused_while_a_client_is_connected_unless_forced() {
    let node = Node::start();
    node.create_vdisk("busy", "64M");
    let mut conn = NbdConn::connect(node.nbd_addr(), "busy").unwrap();
    conn.write_ok(0, &[3u8; 4096]);
    assert_eq!(node.show("busy")["connections"], 1);
    node.cli(&["vdisk", "delete", "busy"])
        .assert_cli_error("connected client");
    // Still there and usable.
    assert_eq!(conn.read_ok(0, 4096), vec![3u8; 4096]);
    let out = node.cli(&["vdisk", "delete", "busy", "--force"]);
    out.assert_ok("delete --force");
    assert!(list_json(&node).is_empty());
    // The connected client's I/O now fails (an error reply or a closed connection).
    conn.stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    match conn.read(0, 4096) {
        Ok(Ok(data)) => panic!(
            "a read of a deleted vdisk succeeded (first byte {})",
            data[0]
        ),
        Ok(Err(errno)) => assert_ne!(errno, 0),
        Err(_) => {}
    }
    assert!(NbdConn::connect(node.nbd_addr(), "busy").is_err());
}

#[test]
fn server_flag_position_env_and_unreachable_server() {
    let node = Node::start();
    let url = node.server_url();
    // --server before the subcommand (the usual place), after it, and via ASHLAR_SERVER.
    node.create_vdisk("first", "1G");
    ashlar(&[
        "vdisk", "create", "second", "--size", "1G", "--server", &url,
    ])
    .assert_ok("--server after the subcommand");
    ashlar(&["vdisk", "list", "--server", &url]).assert_ok("list --server after");
    let out = ashlar_env(
        &["vdisk", "show", "second", "--json"],
        &[("ASHLAR_SERVER", &url)],
    );
    out.assert_ok("ASHLAR_SERVER");
    let second: Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(second["size_bytes"], GIB);
    let out = ashlar_env(&["vdisk", "list"], &[("ASHLAR_SERVER", &url)]);
    out.assert_ok("list via ASHLAR_SERVER");
    assert!(out.stdout.contains("first") && out.stdout.contains("second"));
    // --server wins over ASHLAR_SERVER.
    let dead = format!("http://127.0.0.1:{}", free_port());
    ashlar_env(
        &["--server", &url, "vdisk", "list"],
        &[("ASHLAR_SERVER", &dead)],
    )
    .assert_ok("--server overrides ASHLAR_SERVER");

    // Nothing listening: a clear message, quickly.
    let started = Instant::now();
    ashlar(&["--server", &dead, "vdisk", "list"]).assert_cli_error("cannot reach");
    ashlar_env(&["vdisk", "show", "first"], &[("ASHLAR_SERVER", &dead)])
        .assert_cli_error("cannot reach");
    ashlar(&["vdisk", "create", "x", "--size", "1G", "--server", &dead])
        .assert_cli_error("cannot reach");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "refused connections should fail fast"
    );
}

#[test]
fn help_mentions_every_flag() {
    let top = ashlar(&["--help"]);
    top.assert_ok("ashlar --help");
    for word in [
        "node",
        "vdisk",
        "--server",
        "ASHLAR_SERVER",
        "--api-token-file",
        "ASHLAR_API_TOKEN",
        "--help",
        "--version",
    ] {
        assert!(
            top.stdout.contains(word),
            "ashlar --help lacks {word}:\n{}",
            top.stdout
        );
    }
    let cases: [(&[&str], &[&str]); 8] = [
        (
            &["node", "--help"],
            &[
                "--data-dir",
                "--disk",
                "--nbd-listen",
                "--http-listen",
                "--reactors",
                "--cache-size",
                "--oplog-size",
                "--shard-queue-limit",
                "--max-open-egroups",
                "--default-shards",
                "--poll-window-us",
                "--nbd-max-request",
                "--nbd-max-in-flight",
                "--nbd-request-budget",
                "--max-connections",
                "--ensure-vdisk",
                "--api-token-file",
            ],
        ),
        (
            &["vdisk", "--help"],
            &[
                "create", "list", "show", "resize", "set", "delete", "--server",
            ],
        ),
        (
            &["vdisk", "create", "--help"],
            &["--size", "--shards", "--server", "--help", "<NAME>"],
        ),
        (&["vdisk", "list", "--help"], &["--json", "--server"]),
        (
            &["vdisk", "show", "--help"],
            &["--json", "--server", "<NAME>"],
        ),
        (
            &["vdisk", "resize", "--help"],
            &["--size", "--allow-shrink", "--server"],
        ),
        (&["vdisk", "set", "--help"], &["--shards", "--server"]),
        (&["vdisk", "delete", "--help"], &["--force", "--server"]),
    ];
    for (args, flags) in cases {
        let out = ashlar(args);
        out.assert_ok(&format!("ashlar {}", args.join(" ")));
        for flag in flags {
            assert!(
                out.stdout.contains(flag),
                "`ashlar {}` does not mention {flag}:\n{}",
                args.join(" "),
                out.stdout
            );
        }
    }
    // A usage error is not a crash: exit 2 with clap's message.
    let out = ashlar(&["vdisk", "create", "x"]);
    assert_eq!(out.code(), Some(2), "{out:?}");
    assert!(out.stderr.contains("--size"), "{}", out.stderr);
}

#[test]
fn huge_thin_vdisk_is_instant_and_costs_only_its_oplog() {
    let node = Node::start();
    // Let startup writes settle before measuring.
    node.create_vdisk("warmup", "1G");
    let extents = node.data_dir.join("disk0").join("extents");
    let before = allocated_bytes(&node.data_dir);
    let extents_before = allocated_bytes(&extents);
    let started = Instant::now();
    let out = node.cli(&["vdisk", "create", "huge", "--size", "64T"]);
    let took = started.elapsed();
    out.assert_ok("create 64T");
    assert!(out.stdout.contains("64T"), "{}", out.stdout);
    assert!(took < Duration::from_secs(2), "creating 64T took {took:?}");
    // Thin: no data space at all (its extent directory holds only its 4 KiB copy identity
    // file: one block for it and one for the directory). The only other cost is the oplog's
    // preallocated segment files (written once ahead of need so durable appends change no
    // filesystem metadata), bounded by the oplog size the suite's nodes run with
    // (--oplog-size 64M).
    let after = allocated_bytes(&node.data_dir);
    assert!(
        allocated_bytes(&extents) <= extents_before + 2 * 4096,
        "the extent store grew by {} bytes for an empty 64T vdisk",
        allocated_bytes(&extents).saturating_sub(extents_before)
    );
    assert!(
        after <= before + 64 * MIB,
        "the data dir grew by {} bytes for an empty 64T vdisk (more than its oplog)",
        after.saturating_sub(before)
    );
    assert_eq!(node.show("huge")["size_bytes"], 64u64 << 40);
    // Its last block works.
    let mut conn = NbdConn::connect(node.nbd_addr(), "huge").unwrap();
    assert_eq!(conn.size, 64u64 << 40);
    let last = (64u64 << 40) - 4096;
    conn.write_ok(last, &[0x42u8; 4096]);
    assert_eq!(conn.read_ok(last, 4096), vec![0x42u8; 4096]);
    conn.disconnect();
}

#[test]
fn shrink_discards_the_tail_and_delete_discards_the_data() {
    let mut node = Node::start();
    node.create_vdisk("shrinky", "64M");
    let mut rng = common::Rng::new(11);
    let big = rng.bytes(MIB as usize);
    let small = rng.bytes(8192);
    {
        let mut conn = NbdConn::connect(node.nbd_addr(), "shrinky").unwrap();
        conn.write_ok(0, &small); // kept
        conn.write_ok(40 * MIB, &big); // extent store, past the new end
        conn.write_ok(50 * MIB + 4096, &small); // oplog, past the new end
        conn.write_ok(32 * MIB - 4096, &small[..4096]); // the last kept block
        conn.disconnect();
    }
    assert!(common::wait_until(Duration::from_secs(5), || node
        .show("shrinky")["connections"]
        == 0));
    node.cli(&[
        "vdisk",
        "resize",
        "shrinky",
        "--size",
        "32M",
        "--allow-shrink",
    ])
    .assert_ok("shrink");
    {
        let mut conn = NbdConn::connect(node.nbd_addr(), "shrinky").unwrap();
        assert_eq!(conn.size, 32 * MIB);
        assert_eq!(conn.read(40 * MIB, 4096).unwrap(), Err(common::nbd::EINVAL));
        conn.disconnect();
    }
    assert!(common::wait_until(Duration::from_secs(5), || node
        .show("shrinky")["connections"]
        == 0));
    node.cli(&["vdisk", "resize", "shrinky", "--size", "64M"])
        .assert_ok("grow back");
    let check = |node: &Node| {
        let mut conn = NbdConn::connect(node.nbd_addr(), "shrinky").unwrap();
        assert_eq!(conn.size, 64 * MIB);
        assert_eq!(conn.read_ok(0, 8192), small, "data before the cut is kept");
        assert_eq!(conn.read_ok(32 * MIB - 4096, 4096), &small[..4096]);
        assert!(
            conn.read_ok(40 * MIB, MIB as u32) == vec![0u8; MIB as usize],
            "data past the cut must be gone after shrinking and growing back"
        );
        assert!(
            conn.read_ok(50 * MIB, MIB as u32) == vec![0u8; MIB as usize],
            "oplog data past the cut must be gone after shrinking and growing back"
        );
        conn.disconnect();
    };
    check(&node);
    // Also after a crash (kill -9: the oplog is replayed) and a restart.
    node.kill9();
    node.restart();
    check(&node);

    // Delete with data in the oplog and the extent store, then crash, restart, and reuse the
    // name: nothing of the old vdisk comes back.
    {
        let mut conn = NbdConn::connect(node.nbd_addr(), "shrinky").unwrap();
        conn.write_ok(8 * MIB, &big);
        conn.write_ok(20 * MIB + 512, &small);
        conn.disconnect();
    }
    assert!(common::wait_until(Duration::from_secs(5), || node
        .show("shrinky")["connections"]
        == 0));
    node.cli(&["vdisk", "delete", "shrinky"])
        .assert_ok("delete");
    node.kill9();
    node.restart();
    assert!(names(&node).is_empty(), "a deleted vdisk stays deleted");
    node.create_vdisk("shrinky", "64M");
    let mut conn = NbdConn::connect(node.nbd_addr(), "shrinky").unwrap();
    let all = conn.read_range(0, 64 * MIB, MIB as u32).unwrap();
    assert!(
        all.iter().all(|&b| b == 0),
        "a new vdisk with a deleted one's name reads old data at {:?}",
        all.iter().position(|&b| b != 0)
    );
    conn.disconnect();
}

#[test]
fn acknowledged_metadata_changes_survive_kill9() {
    let mut node = Node::start();
    node.create_vdisk("meta-a", "1G");
    node.create_vdisk_shards("meta-b", "2G", 3);
    node.create_vdisk("meta-gone", "1G");
    node.cli(&["vdisk", "resize", "meta-a", "--size", "3G"])
        .assert_ok("resize");
    node.cli(&["vdisk", "set", "meta-b", "--shards", "5"])
        .assert_ok("set shards");
    node.cli(&["vdisk", "delete", "meta-gone"])
        .assert_ok("delete");
    // No grace: every change was acknowledged, so it must be on disk.
    node.kill9();
    node.restart();
    assert_eq!(names(&node), ["meta-a", "meta-b"]);
    assert_eq!(node.show("meta-a")["size_bytes"], 3 * GIB);
    let b = node.show("meta-b");
    assert_eq!(b["size_bytes"], 2 * GIB);
    assert_eq!(b["shards"], 5);
    // Ids are not reused after a restart either.
    let ids: Vec<u64> = list_json(&node)
        .iter()
        .map(|v| v["id"].as_u64().unwrap())
        .collect();
    node.create_vdisk("meta-c", "1G");
    let c = node.show("meta-c")["id"].as_u64().unwrap();
    assert!(ids.iter().all(|&id| id < c), "new id {c} after {ids:?}");
    assert!(c > 3, "id {c} reuses the deleted vdisk's id");
}

/// The CPUs each reactor thread of the node may run on (`Cpus_allowed_list` of the threads
/// named `reactor-N`), by reactor index.
fn reactor_affinity(node: &Node) -> Vec<(usize, String)> {
    let mut found = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{}/task", node.pid())).unwrap() {
        let task = task.unwrap().path();
        let name = std::fs::read_to_string(task.join("comm")).unwrap_or_default();
        let Some(index) = name.trim().strip_prefix("reactor-") else {
            continue;
        };
        let status = std::fs::read_to_string(task.join("status")).unwrap();
        let allowed = status
            .lines()
            .find_map(|line| line.strip_prefix("Cpus_allowed_list:"))
            .unwrap()
            .trim()
            .to_string();
        found.push((index.parse().unwrap(), allowed));
    }
    found.sort();
    found
}

/// The CPUs this (test) process may run on, which the node it starts inherits.
fn allowed_cpus() -> Vec<usize> {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let list = status
        .lines()
        .find_map(|line| line.strip_prefix("Cpus_allowed_list:"))
        .unwrap()
        .trim();
    let mut cpus = Vec::new();
    for part in list.split(',') {
        match part.split_once('-') {
            Some((first, last)) => {
                cpus.extend(first.parse::<usize>().unwrap()..=last.parse().unwrap())
            }
            None => cpus.push(part.parse().unwrap()),
        }
    }
    cpus
}

#[test]
fn reactors_are_pinned_to_the_listed_cpus_in_order() {
    let allowed = allowed_cpus();
    // The allowed CPUs in reverse order (on a two-CPU machine: "1,0").
    let reversed: Vec<usize> = allowed.iter().rev().copied().take(2).collect();
    let list = reversed
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(",");
    // The harness starts every node with --reactors 2.
    let node = Node::start_with(&["--reactor-cpus", &list]);
    let expected: Vec<(usize, String)> = (0..2)
        .map(|i| (i, reversed[i % reversed.len()].to_string()))
        .collect();
    assert_eq!(reactor_affinity(&node), expected, "--reactor-cpus {list}");
    // By default the reactors take the allowed CPUs in ascending order.
    let default = Node::start();
    let pinned: Vec<String> = reactor_affinity(&default)
        .into_iter()
        .map(|(_, cpus)| cpus)
        .collect();
    assert_eq!(
        pinned.first(),
        Some(&allowed[0].to_string()),
        "{pinned:?} (allowed: {allowed:?})"
    );

    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().join("data");
    let out = ashlar(&[
        "node",
        "--data-dir",
        data_dir.to_str().unwrap(),
        "--reactor-cpus",
        "4096",
    ]);
    assert_eq!(out.code(), Some(1), "{out:?}");
    assert!(out.stderr.contains("--reactor-cpus 4096"), "{}", out.stderr);
    assert!(
        !data_dir.exists(),
        "a refused node created its data directory"
    );
}

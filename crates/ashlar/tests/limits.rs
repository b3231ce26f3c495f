//! Node-wide limits against hostile numbers of clients, through real sockets:
//!
//! - `--nbd-request-budget`: connections that each send a maximal (32 MiB) write and stall one
//!   byte short of its end hold at most the budget in memory; the rest wait, unread, while
//!   well-behaved clients' small I/O goes on; once the stallers leave, large writes work.
//! - `--max-connections`: a connection over the limit is closed at once; the others are
//!   unaffected, and a slot freed by any kind of connection end is usable again.
//! - `--drain-batch`, `--drain-memory` and `--writes-in-flight-per-egroup`: a node whose
//!   drain steps must share a budget smaller than two steps, each extent group written two
//!   writes at a time, drains all it was given, and every byte reads back.
//! - `--cache-size`: a read cache filled by fio's cold 4 KiB reads grows the node's RSS by
//!   about what it holds (at most a quarter more, plus slack).
//! - `--io-read-buffers`: the buffers of large cold reads are reused, so reading a vdisk over
//!   and over in 1 MiB reads grows the RSS by at most the cache, the kept buffers and the
//!   reads in flight.

mod common;

use common::nbd::{request_bytes, NbdConn, CMD_WRITE};
use common::{ashlar, run_bounded, wait_until, CmdOut, Node, Rng, MIB};
use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const VDISK: &str = "limits";

/// The resident set size of a process, from /proc/PID/status.
fn rss_bytes(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("read status");
    let line = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .expect("VmRSS in /proc/PID/status");
    let kib: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .expect("VmRSS value");
    kib * 1024
}

/// A client that sends a 32 MiB write and all of its payload but the last byte, from its own
/// thread (the write blocks once the node stops reading). `sent` counts clients whose whole
/// partial payload left their socket; `control` is a handle to shut the socket down.
struct Staller {
    control: TcpStream,
    thread: std::thread::JoinHandle<()>,
}

const WRITE_BYTES: u32 = 32 << 20;

fn stall(node: &Node, offset: u64, payload: Arc<Vec<u8>>, sent: Arc<AtomicUsize>) -> Staller {
    let mut conn = NbdConn::connect(node.nbd_addr(), VDISK).expect("staller connects");
    // A backstop only: the test shuts the socket down long before.
    conn.stream
        .set_write_timeout(Some(Duration::from_secs(120)))
        .unwrap();
    conn.stream
        .set_read_timeout(Some(Duration::from_secs(120)))
        .unwrap();
    let control = conn.stream.try_clone().unwrap();
    let thread = std::thread::spawn(move || {
        let header = request_bytes(CMD_WRITE, 0, 1, offset, WRITE_BYTES, &[]);
        if conn.stream.write_all(&header).is_ok() && conn.stream.write_all(&payload[..]).is_ok() {
            sent.fetch_add(1, Ordering::SeqCst);
        }
        // Stall: hold the connection (and whatever the node reserved for it) until shut down.
        let _ = conn.stream.read(&mut [0u8; 1]);
    });
    Staller { control, thread }
}

#[test]
fn stalled_maximal_writes_hold_no_more_than_the_request_budget() {
    const BUDGET: u64 = 64 * MIB;
    const STALLERS: usize = 40;
    let mut node = Node::start_with(&[
        "--ensure-vdisk",
        "limits:256M",
        "--nbd-request-budget",
        "64M",
    ]);
    let pid = node.pid();
    // A well-behaved client, warmed up before the baseline is taken.
    let mut good = NbdConn::connect(node.nbd_addr(), VDISK).expect("connect");
    let block = Rng::new(1).bytes(4096);
    good.write_ok(200 * MIB, &block);
    assert_eq!(good.read_ok(200 * MIB, 4096), block);
    let baseline = rss_bytes(pid);

    // 40 clients each start a 32 MiB write and stop one byte short of its end. Without a
    // node-wide budget each would hold its 32 MiB: 1.25 GiB. With 64 MiB of budget, two get
    // theirs reserved and read; the others wait, their payloads unread in the kernel.
    let payload = Arc::new(vec![0xabu8; WRITE_BYTES as usize - 1]);
    let sent = Arc::new(AtomicUsize::new(0));
    let stallers: Vec<Staller> = (0..STALLERS)
        .map(|i| {
            stall(
                &node,
                (i as u64 % 4) * 32 * MIB,
                payload.clone(),
                sent.clone(),
            )
        })
        .collect();
    assert!(
        wait_until(Duration::from_secs(60), || sent.load(Ordering::SeqCst) >= 2),
        "the node should read the payloads the budget has room for"
    );

    // Meanwhile: RSS stays within the budget, and small I/O of other clients is served (it
    // fits in each connection's allowance, so clients holding the budget cannot starve it).
    let bound = baseline + BUDGET + 64 * MIB;
    let mut peak = rss_bytes(pid);
    let deadline = Instant::now() + Duration::from_secs(2);
    let mut round = 0u64;
    while Instant::now() < deadline {
        round += 1;
        let data = Rng::new(round).bytes(4096);
        let offset = 192 * MIB + (round % 256) * 4096;
        good.write_ok(offset, &data);
        assert_eq!(good.read_ok(offset, 4096), data);
        peak = peak.max(rss_bytes(pid));
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut fresh = NbdConn::connect(node.nbd_addr(), VDISK).expect("a new client connects");
    assert_eq!(fresh.read_ok(200 * MIB, 4096), block);
    fresh.disconnect();
    let qemu = CmdOut::from_output(run_bounded(
        "qemu-io",
        &["-r", "-f", "raw", "-c", "read -P 0 0 64k", &node.uri(VDISK)],
        30,
    ));
    qemu.assert_ok("qemu-io reads 64 KiB while stalled writers hold the budget");
    peak = peak.max(rss_bytes(pid));
    assert_eq!(
        sent.load(Ordering::SeqCst),
        2,
        "only the writes the 64 MiB budget holds may have been read"
    );
    assert!(
        peak < bound,
        "RSS peaked at {} MiB: baseline {} MiB + budget 64 MiB + 64 MiB slack = {} MiB",
        peak / MIB,
        baseline / MIB,
        bound / MIB
    );
    eprintln!(
        "RSS baseline {} MiB, peak with {STALLERS} stalled 32 MiB writes {} MiB",
        baseline / MIB,
        peak / MIB
    );

    // The stallers leave: their reservations return, none of their writes was applied, and a
    // maximal write (which needs the shared budget) succeeds.
    for staller in &stallers {
        let _ = staller.control.shutdown(Shutdown::Both);
    }
    for staller in stallers {
        staller.thread.join().unwrap();
    }
    let big = Rng::new(99).bytes(WRITE_BYTES as usize);
    good.write_ok(128 * MIB, &big);
    assert!(
        good.read_ok(128 * MIB, WRITE_BYTES) == big,
        "32 MiB read back"
    );
    for i in 0..4 {
        assert_eq!(
            good.read_ok(i * 32 * MIB + 32 * MIB - 4096, 4096),
            vec![0u8; 4096],
            "a write missing its last byte must not be applied"
        );
    }
    good.disconnect();
    node.assert_alive();
    assert!(!node.log().contains("panicked"), "{}", node.log());
}

/// True if the peer closed `stream` (EOF or reset) within `limit` without sending a byte.
fn closed_without_greeting(stream: &mut TcpStream, limit: Duration) -> bool {
    stream.set_read_timeout(Some(limit)).unwrap();
    let mut buf = [0u8; 64];
    match stream.read(&mut buf) {
        Ok(0) => true,
        Ok(n) => panic!("a refused connection got {n} bytes: {:02x?}", &buf[..n]),
        Err(e) => !matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ),
    }
}

fn assert_works(conn: &mut NbdConn, seed: u64) {
    let data = Rng::new(seed).bytes(4096);
    let offset = (seed % 64) * 64 * 1024;
    conn.write_ok(offset, &data);
    assert_eq!(conn.read_ok(offset, 4096), data);
}

/// Connects until the node accepts (a slot is freed only once the node has seen the end of
/// the connection that held it), bounded.
fn connect_when_free(node: &Node) -> NbdConn {
    let mut conn = None;
    assert!(
        wait_until(Duration::from_secs(10), || {
            conn = NbdConn::connect(node.nbd_addr(), VDISK).ok();
            conn.is_some()
        }),
        "a freed connection slot should be usable again"
    );
    conn.unwrap()
}

#[test]
fn connections_over_the_limit_are_closed_at_once() {
    // One shard on two reactors: every other connection moves after its handshake, so the
    // count is checked across hand-overs too.
    let mut node = Node::start_with(&[
        "--ensure-vdisk",
        "limits:64M",
        "--default-shards",
        "1",
        "--max-connections",
        "4",
    ]);
    node.sigterm_and_wait();
    node.rust_log = "info,ashlar=debug".to_string();
    node.restart();

    let mut conns: Vec<NbdConn> = (0..4)
        .map(|_| NbdConn::connect(node.nbd_addr(), VDISK).expect("connect"))
        .collect();
    for (i, conn) in conns.iter_mut().enumerate() {
        assert_works(conn, i as u64);
    }
    assert!(
        node.log().contains("moved next to its shards"),
        "some of the connections should have moved reactors"
    );

    // The fifth, and a burst after it: closed at once, one warning for all of them.
    let started = Instant::now();
    for _ in 0..10 {
        let mut extra = TcpStream::connect(node.nbd_addr()).unwrap();
        assert!(
            closed_without_greeting(&mut extra, Duration::from_secs(5)),
            "a connection over the limit must be closed at once"
        );
    }
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "refusals took {:?}",
        started.elapsed()
    );
    let warnings = node
        .log()
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("connection limit reached"))
        .count();
    assert_eq!(warnings, 1, "one rate-limited warning:\n{}", node.log());
    assert!(
        node.log().contains("limit=4"),
        "the warning names the limit:\n{}",
        node.log()
    );

    // The four are unaffected.
    for (i, conn) in conns.iter_mut().enumerate() {
        assert_works(conn, 10 + i as u64);
    }

    // Every way a connection ends frees its slot, moved or not: NBD_CMD_DISC, the client
    // vanishing, a protocol violation, and a connection that never finishes its handshake.
    let disc = conns.remove(0);
    disc.disconnect();
    conns.push(connect_when_free(&node));
    drop(conns.remove(0));
    conns.push(connect_when_free(&node));
    let mut violator = conns.remove(0);
    let mut request = request_bytes(CMD_WRITE, 0, 1, 0, 4096, &[]);
    request[0..4].copy_from_slice(&0xdead_beef_u32.to_be_bytes());
    violator.stream.write_all(&request).unwrap();
    assert!(common::nbd::closed_by_peer(
        &mut violator.stream,
        Duration::from_secs(10)
    ));
    conns.push(connect_when_free(&node));
    // A raw connection in its handshake holds a slot too; closing it frees the slot.
    let mut last = conns.remove(0);
    assert_works(&mut last, 20);
    last.disconnect();
    let raw = connect_raw_when_free(&node);
    let mut over = TcpStream::connect(node.nbd_addr()).unwrap();
    assert!(
        closed_without_greeting(&mut over, Duration::from_secs(5)),
        "the raw connection holds the fourth slot"
    );
    drop(raw);
    conns.push(connect_when_free(&node));
    for (i, conn) in conns.iter_mut().enumerate() {
        assert_works(conn, 30 + i as u64);
    }
    assert_eq!(conns.len(), 4);
    for conn in conns {
        conn.disconnect();
    }
    assert!(node.sigterm_and_wait().success());
}

/// A TCP connection that got the NBD greeting (so the node counts it), bounded.
fn connect_raw_when_free(node: &Node) -> TcpStream {
    let mut raw = None;
    assert!(
        wait_until(Duration::from_secs(10), || {
            let mut stream = TcpStream::connect(node.nbd_addr()).unwrap();
            stream
                .set_read_timeout(Some(Duration::from_secs(5)))
                .unwrap();
            let mut greeting = [0u8; 18];
            if stream.read_exact(&mut greeting).is_ok() {
                raw = Some(stream);
            }
            raw.is_some()
        }),
        "a freed slot should take a raw connection"
    );
    raw.unwrap()
}

#[test]
fn limit_flags_are_explained_and_checked() {
    let help = ashlar(&["node", "--help"]);
    help.assert_ok("ashlar node --help");
    let text = help.stdout.split_whitespace().collect::<Vec<_>>().join(" ");
    for needle in [
        "--nbd-request-budget <SIZE>",
        "whole node holds in memory",
        "[default: 256M]",
        "--max-connections <N>",
        "closed at once",
        "[default: 1024]",
        "--io-bounce-pool <SIZE>",
        "bounce buffers each reactor keeps",
        "[default: 16M]",
        "--io-max-in-flight <N>",
        "[default: 256]",
        "--io-read-buffers <SIZE>",
        "whole node keeps for reuse",
        "[default: 64M]",
        "--drain-batch <SIZE>",
        "[default: 128M]",
        "--drain-memory <SIZE>",
        "drain steps of the whole node hold in memory",
        "--writes-in-flight-per-egroup <N>",
        "[default: 8]",
    ] {
        assert!(
            text.contains(needle),
            "node --help lacks {needle:?}:\n{}",
            help.stdout
        );
    }
    // Refused before anything is started: one error line, exit 1.
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().to_str().unwrap();
    let node = |flags: &[&str]| {
        let mut args = vec!["node", "--data-dir", data, "--nbd-listen", "127.0.0.1:0"];
        args.extend_from_slice(flags);
        ashlar(&args)
    };
    node(&["--max-connections", "0"]).assert_cli_error("--max-connections must be at least 1");
    node(&["--nbd-request-budget", "512K"]).assert_cli_error("between 1M and 1T");
    node(&["--nbd-request-budget", "2T"]).assert_cli_error("between 1M and 1T");
    node(&["--nbd-request-budget", "lots"]).assert_cli_error("--nbd-request-budget");
    node(&["--io-bounce-pool", "512K"])
        .assert_cli_error("--io-bounce-pool must be between 1M and 1G");
    node(&["--io-max-in-flight", "0"])
        .assert_cli_error("--io-max-in-flight must be between 1 and 32768");
    node(&["--io-read-buffers", "17G"])
        .assert_cli_error("--io-read-buffers must be between 0 and 16G");
    node(&["--drain-memory", "512K"]).assert_cli_error("--drain-memory must be between 1M and 1T");
    node(&["--drain-memory", "2T"]).assert_cli_error("--drain-memory must be between 1M and 1T");
    node(&["--drain-batch", "2G"]).assert_cli_error("--drain-batch must be between 1M and 1G");
    for bad in ["0", "5000"] {
        node(&["--writes-in-flight-per-egroup", bad])
            .assert_cli_error("--writes-in-flight-per-egroup must be between 1 and 4096");
    }
}

/// Two vdisks (four shards) whose logs take more than they hold, with a drain budget smaller
/// than two steps: every drain completes and all the data reads back. (That steps shrink
/// to what is free, or wait, is shown by the unit tests of `drain_budget.rs`; this test
/// shows the node's flags reach the engine and a tight budget loses nothing.)
#[test]
fn drains_share_a_budget_smaller_than_their_steps() {
    // The harness gives each vdisk 64M of oplog over two shards.
    let node = Node::start_with(&[
        "--drain-batch",
        "2M",
        "--drain-memory",
        "3M",
        "--writes-in-flight-per-egroup",
        "2",
        "--ensure-vdisk",
        "one:256M",
        "--ensure-vdisk",
        "two:256M",
    ]);
    let info = node.http_json("/api/v1/node");
    let submitted_before = disk_io_submissions(&info);
    assert_eq!(info["drain_batch_bytes"], 2 << 20, "{info}");
    assert_eq!(info["drain_memory_bytes"], 3 << 20, "{info}");
    assert_eq!(info["writes_in_flight_per_egroup"], 2, "{info}");
    let mut rng = Rng::new(11);
    let chunk = 64 * 1024;
    // 48 MiB per vdisk, more than its log holds, at scattered chunk-aligned offsets.
    let offsets: Vec<u64> = (0..768u64)
        .map(|i| (i * 2_654_435_761) % 4096 * chunk as u64)
        .collect();
    let writers: Vec<_> = ["one", "two"]
        .into_iter()
        .map(|name| {
            let (addr, offsets) = (node.nbd_addr(), offsets.clone());
            let data = rng.bytes(offsets.len() * chunk);
            std::thread::spawn(move || {
                let mut conn = NbdConn::connect(addr, name).expect("connect");
                for (i, offset) in offsets.iter().enumerate() {
                    conn.write_ok(*offset, &data[i * chunk..(i + 1) * chunk]);
                }
                conn.disconnect();
                (name, data)
            })
        })
        .collect();
    let written: Vec<_> = writers.into_iter().map(|w| w.join().unwrap()).collect();
    for (name, data) in written {
        assert!(
            wait_until(Duration::from_secs(60), || {
                node.vdisk_stats(name)["oplog_live_bytes"].as_u64() == Some(0)
            }),
            "vdisk {name} did not drain: {}",
            node.vdisk_stats(name)
        );
        // Later writes of an offset win (the offsets repeat).
        let mut expected = std::collections::BTreeMap::new();
        for (i, offset) in offsets.iter().enumerate() {
            expected.insert(*offset, &data[i * chunk..(i + 1) * chunk]);
        }
        let mut conn = NbdConn::connect(node.nbd_addr(), name).expect("connect");
        for (offset, bytes) in expected {
            assert!(
                conn.read_ok(offset, chunk as u32) == bytes,
                "vdisk {name}: 64 KiB at {offset} read back wrong"
            );
        }
        conn.disconnect();
    }
    // The drain steps' writes went to the kernel in batches: more than one operation per
    // `io_uring_enter` on average (each one alone would make the two counts equal).
    let (calls, entries) = disk_io_submissions(&node.http_json("/api/v1/node"));
    let (calls, entries) = (calls - submitted_before.0, entries - submitted_before.1);
    assert!(
        entries > calls + calls / 4,
        "{entries} disk operations in {calls} submissions"
    );
}

/// The node's io_uring submission counters summed over its reactors: (calls, entries).
fn disk_io_submissions(info: &serde_json::Value) -> (u64, u64) {
    let reactors = info["disk_io_submissions"].as_array().expect("per reactor");
    reactors.iter().fold((0, 0), |(calls, entries), reactor| {
        (
            calls + reactor["submit_calls"].as_u64().unwrap_or(0),
            entries + reactor["entries_submitted"].as_u64().unwrap_or(0),
        )
    })
}

/// The disk I/O limits reach the node's io_uring configuration, and it serves with them.
#[test]
fn disk_io_limits_are_the_ones_asked_for() {
    let node = Node::start_with(&[
        "--io-bounce-pool",
        "4M",
        "--io-max-in-flight",
        "300",
        "--ensure-vdisk",
        "small:16M",
    ]);
    let info = node.http_json("/api/v1/node");
    assert_eq!(info["disk_io"], "io_uring", "{info}");
    assert_eq!(
        info["disk_io_limits"]["bounce_pool_bytes"],
        4 << 20,
        "{info}"
    );
    assert_eq!(info["disk_io_limits"]["max_in_flight_ops"], 300, "{info}");
    let data = Rng::new(5).bytes(1 << 20);
    let mut conn = NbdConn::connect(node.nbd_addr(), "small").expect("connect");
    conn.write_ok(0, &data);
    assert_eq!(conn.read_ok(0, data.len() as u32), data);
    conn.disconnect();
}

/// The bytes the node's read caches hold, over every reactor (GET /stats/cache).
fn cached_bytes(node: &Node) -> u64 {
    let stats = node.http_json("/stats/cache");
    stats["per_reactor"]
        .as_array()
        .expect("/stats/cache has per_reactor")
        .iter()
        .map(|r| {
            r["single_touch_bytes"].as_u64().unwrap() + r["multi_touch_bytes"].as_u64().unwrap()
        })
        .sum()
}

/// One fio pass over the first 256 MiB of the NBD export `uri`, QD 16, without verification.
fn fio_unverified(uri: &str, name: &str, rw: &str, block_size: &str) {
    fio_pass(uri, name, rw, block_size, "256M");
}

/// One fio pass over the first `size` of the NBD export `uri`, QD 16, without verification.
fn fio_pass(uri: &str, name: &str, rw: &str, block_size: &str, size: &str) {
    let output = run_bounded(
        "fio",
        &[
            &format!("--name={name}"),
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            &format!("--rw={rw}"),
            &format!("--bs={block_size}"),
            "--iodepth=16",
            &format!("--size={size}"),
        ],
        120,
    );
    assert!(
        output.status.success(),
        "fio {name}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// The harness's node (64 MiB of read cache over 2 reactors, 2 shards, one per reactor) with
/// vdisk `limits` of 256 MiB written by fio and not read back, so the cache starts empty, and
/// its oplog drained, so reads come from the extent store (the oplog's data is never cached).
fn node_with_written_vdisk() -> (Node, String) {
    let node = Node::start_with(&["--ensure-vdisk", "limits:256M"]);
    let uri = node.uri(VDISK);
    fio_unverified(&uri, "fill", "write", "1M");
    let drained = wait_until(Duration::from_secs(60), || {
        node.vdisk_stats(VDISK)["oplog_live_bytes"].as_u64() == Some(0)
    });
    assert!(drained, "oplog never drained: {}", node.vdisk_stats(VDISK));
    (node, uri)
}

/// One counter of GET /stats/cache, summed over the reactors.
fn cache_total(node: &Node, counter: &str) -> u64 {
    node.http_json("/stats/cache")["total"][counter]
        .as_u64()
        .unwrap_or_else(|| panic!("/stats/cache has no total {counter}"))
}

/// A scan with reads too large for the cache lookup (a backup, `qemu-img convert`) reads hot
/// blocks from disk too: the hot blocks must stay in the multi-touch pool, and the scan's
/// 1 MiB reads fill nothing (over `MAX_FILLING_READ_BYTES`), while 256 KiB reads still do.
#[test]
fn a_scan_with_large_reads_keeps_the_hot_blocks_cached_and_fills_nothing() {
    // 64 MiB of read cache over 2 reactors: a multi-touch share of 16 MiB each.
    let (node, uri) = node_with_written_vdisk();
    // 8 MiB read twice in 4 KiB reads: cached, then promoted.
    fio_pass(&uri, "hot-1", "read", "4k", "8M");
    fio_pass(&uri, "hot-2", "read", "4k", "8M");
    let hot = cache_total(&node, "multi_touch_bytes");
    assert!(
        hot >= 8 * MIB,
        "the hot 8 MiB are not all promoted: {hot} bytes"
    );
    let single_touch_before_scan = cache_total(&node, "single_touch_bytes");
    // 256 MiB in 1 MiB reads, four times the cache.
    fio_pass(&uri, "scan", "read", "1M", "256M");
    let after_scan = cache_total(&node, "multi_touch_bytes");
    assert!(
        after_scan >= 8 * MIB,
        "the scan took the hot blocks out of the multi-touch pool: {after_scan} bytes left"
    );
    assert_eq!(
        cache_total(&node, "single_touch_bytes"),
        single_touch_before_scan,
        "the scan's 1 MiB reads filled the cache"
    );
    let misses = cache_total(&node, "misses");
    fio_pass(&uri, "hot-3", "read", "4k", "8M");
    assert_eq!(
        cache_total(&node, "misses"),
        misses,
        "re-reading the hot 8 MiB after the scan missed the cache"
    );
    // 256 KiB reads of 8 MiB more than the hot blocks still fill the cache with them.
    fio_pass(&uri, "medium", "read", "256k", "16M");
    let filled = cache_total(&node, "single_touch_bytes").saturating_sub(single_touch_before_scan);
    assert!(
        filled >= 8 * MIB,
        "256 KiB reads of 8 MiB not cached before filled only {filled} bytes"
    );
}

/// A read cache filled by fio's cold 4 KiB random reads costs the node about what it holds,
/// not more: each cached block is its read's buffer, a 4 KiB slot of the node's small buffers
/// (4 KiB-aligned 4 KiB buffers from the heap once doubled it). Writes that drop the cached
/// blocks free their slots, and the next reads take those slots again instead of new memory
/// (freed heap blocks once made every allocation search long free lists).
#[test]
fn a_full_read_cache_costs_about_its_size_in_memory() {
    let (node, uri) = node_with_written_vdisk();
    let before = rss_bytes(node.pid());
    let cached_before = cached_bytes(&node);
    // Not verified (data is checked everywhere else): this is about memory.
    fio_unverified(&uri, "cold-reads", "randread", "4k");
    let cached = cached_bytes(&node) - cached_before;
    let grown = rss_bytes(node.pid()).saturating_sub(before);
    assert!(
        cached >= 48 * MIB,
        "4 KiB reads of all 256 MiB should fill most of the 64 MiB cache, cached {} MiB",
        cached / MIB
    );
    assert!(
        grown <= cached + cached / 4 + 16 * MIB,
        "RSS grew {} MiB for {} MiB cached (bound: cached + 25 % + 16 MiB)",
        grown / MIB,
        cached / MIB
    );
    let mapped = small_buffers_mapped(&node);
    assert!(
        mapped >= cached,
        "{cached} bytes cached in 4 KiB reads, but only {mapped} bytes of small buffers mapped"
    );
    // Overwrite everything (every cached block dropped), drain, and read it all again.
    fio_unverified(&uri, "overwrite", "write", "1M");
    let drained = wait_until(Duration::from_secs(60), || {
        node.vdisk_stats(VDISK)["oplog_live_bytes"].as_u64() == Some(0)
    });
    assert!(drained, "oplog never drained: {}", node.vdisk_stats(VDISK));
    fio_unverified(&uri, "cold-reads-again", "randread", "4k");
    let mapped_again = small_buffers_mapped(&node);
    assert!(
        mapped_again <= mapped + 8 * MIB,
        "small buffers grew from {mapped} to {mapped_again} bytes for a cache of the same size"
    );
}

/// Bytes mapped for small read buffers (`/api/v1/node`), checked against their limit.
fn small_buffers_mapped(node: &Node) -> u64 {
    let info = node.http_json("/api/v1/node");
    let mapped = info["small_read_buffers_mapped_bytes"]
        .as_u64()
        .expect("small_read_buffers_mapped_bytes");
    let limit = info["small_read_buffers_limit_bytes"]
        .as_u64()
        .expect("small_read_buffers_limit_bytes");
    assert!(
        mapped <= limit,
        "{mapped} bytes mapped over the limit {limit}: {info}"
    );
    mapped
}

/// Large cold reads land in buffers that are reused afterwards. A node restarted on written
/// data has no freed memory to reuse: before the buffers were kept, the allocator did not
/// reuse freed 4 KiB-aligned 1 MiB read buffers while a large read cache held slices of
/// others, and such a scan grew the RSS by hundreds of MiB a second (2.9 GiB after 6 s of
/// a 4 GiB vdisk with a 256 MiB cache) and spent most of a core zeroing fresh pages.
#[test]
fn large_reads_reuse_their_buffers() {
    // One shard, so one reactor's cache (128 MiB of the 256) holds the scan's blocks.
    let mut node = Node::start_with(&[
        "--ensure-vdisk",
        "scanned:1G",
        "--cache-size",
        "256M",
        "--default-shards",
        "1",
    ]);
    let uri = node.uri("scanned");
    fio_pass(&uri, "fill", "write", "1M", "1G");
    let drained = wait_until(Duration::from_secs(120), || {
        node.vdisk_stats("scanned")["oplog_live_bytes"].as_u64() == Some(0)
    });
    assert!(
        drained,
        "oplog never drained: {}",
        node.vdisk_stats("scanned")
    );
    node.sigterm_and_wait();
    node.restart();
    let before = rss_bytes(node.pid());
    // 2 GiB read in 1 MiB reads: two passes over the vdisk, eight times the cache.
    for pass in 0..2 {
        fio_pass(&uri, &format!("scan-{pass}"), "read", "1M", "1G");
    }
    let grown = rss_bytes(node.pid()).saturating_sub(before);
    let info = node.http_json("/api/v1/node");
    let kept = info["read_buffers_kept_bytes"]
        .as_u64()
        .expect("kept bytes");
    let kept_limit = info["read_buffers_kept_limit_bytes"]
        .as_u64()
        .expect("kept limit");
    assert_eq!(
        kept_limit,
        64 * MIB,
        "the default --io-read-buffers: {info}"
    );
    assert!(kept > 0 && kept <= kept_limit, "buffers kept: {kept} bytes");
    // The 256 MiB cache, the kept buffers, fio's 16 reads in flight, and slack.
    let bound = 256 * MIB + kept_limit + 16 * MIB + 32 * MIB;
    assert!(
        grown <= bound,
        "RSS grew {} MiB over two 1 GiB scans in 1 MiB reads (bound {} MiB)",
        grown / MIB,
        bound / MIB
    );
}

//! Hostile and broken NBD clients against a running node. After each one, the node process
//! is alive, a well-behaved client (ours and nbdinfo) still reads and writes, and GET /healthz
//! still answers.

mod common;

use common::nbd::{
    closed_by_peer, greet, option_bytes, request_bytes, NbdConn, CMD_READ, CMD_WRITE, EINVAL,
    ENOSPC, OPT_GO,
};
use common::{run_bounded, CmdOut, Node, Rng, MIB};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

const VDISK: &str = "target";
const SIZE: u64 = 64 * MIB;

fn node() -> Node {
    let node = Node::start_with(&["--ensure-vdisk", "target:64M"]);
    assert_eq!(node.show(VDISK)["size_bytes"], SIZE);
    node
}

/// The node survived: process alive, /healthz ok, our client round-trips a block, nbdinfo
/// sees the export.
fn assert_healthy(node: &mut Node, round: u64) {
    node.assert_alive();
    let (status, body) = node.http_get("/healthz");
    assert_eq!((status, body.trim()), (200, "ok"));
    let mut conn = NbdConn::connect(node.nbd_addr(), VDISK).expect("well-behaved client");
    assert_eq!(conn.size, SIZE);
    let data = Rng::new(round).bytes(4096);
    let offset = (round % 16) * MIB + 8192;
    conn.write_ok(offset, &data);
    assert_eq!(conn.read_ok(offset, 4096), data);
    conn.disconnect();
    let info = CmdOut::from_output(run_bounded("nbdinfo", &["--size", &node.uri(VDISK)], 30));
    info.assert_ok("nbdinfo --size");
    assert_eq!(info.stdout.trim(), SIZE.to_string());
    node.assert_alive();
    assert!(
        !node.log().contains("panicked"),
        "the node panicked:\n{}",
        node.log()
    );
}

fn raw_connect(node: &Node) -> TcpStream {
    let stream = TcpStream::connect(node.nbd_addr()).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    stream
        .set_write_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    stream
}

#[test]
fn random_garbage_bytes() {
    let mut node = node();
    // Garbage right away, without reading the greeting.
    for seed in 0..8 {
        let mut stream = raw_connect(&node);
        let garbage = Rng::new(seed).bytes(64 * 1024);
        let _ = stream.write_all(&garbage);
        assert!(
            closed_by_peer(&mut stream, Duration::from_secs(15)),
            "the server must drop a client that sends garbage"
        );
    }
    assert_healthy(&mut node, 1);
    // Garbage after a correct greeting and client flags, in place of an option.
    let mut stream = greet(node.nbd_addr()).unwrap();
    let _ = stream.write_all(&Rng::new(42).bytes(64 * 1024));
    assert!(closed_by_peer(&mut stream, Duration::from_secs(15)));
    // Garbage in the transmission phase, in place of a request.
    let mut conn = NbdConn::connect(node.nbd_addr(), VDISK).unwrap();
    let _ = conn.stream.write_all(&Rng::new(43).bytes(64 * 1024));
    assert!(closed_by_peer(&mut conn.stream, Duration::from_secs(15)));
    assert_healthy(&mut node, 2);
}

#[test]
fn truncated_handshakes() {
    let mut node = node();
    // Connect and close at once; close after the greeting; send half the client flags; send
    // half an option header; send an option that announces more data than comes.
    drop(raw_connect(&node));
    {
        let mut stream = raw_connect(&node);
        let mut greeting = [0u8; 18];
        stream.read_exact(&mut greeting).unwrap();
    }
    {
        let mut stream = raw_connect(&node);
        let mut greeting = [0u8; 18];
        stream.read_exact(&mut greeting).unwrap();
        stream.write_all(&[0, 0]).unwrap();
    }
    {
        let mut stream = greet(node.nbd_addr()).unwrap();
        stream.write_all(&option_bytes(OPT_GO, b"")[..10]).unwrap();
    }
    {
        let mut stream = greet(node.nbd_addr()).unwrap();
        let mut option = option_bytes(OPT_GO, &[0u8; 100]);
        option.truncate(16 + 30);
        stream.write_all(&option).unwrap();
    }
    assert_healthy(&mut node, 3);
    // Clients that connect and then say nothing must not block anyone else.
    let idle: Vec<TcpStream> = (0..20).map(|_| raw_connect(&node)).collect();
    let mut half = greet(node.nbd_addr()).unwrap();
    half.write_all(&option_bytes(OPT_GO, b"")[..8]).unwrap();
    assert_healthy(&mut node, 4);
    drop(idle);
    drop(half);
    assert_healthy(&mut node, 5);
}

#[test]
fn request_with_bad_magic_closes_only_that_connection() {
    let mut node = node();
    let mut bystander = NbdConn::connect(node.nbd_addr(), VDISK).unwrap();
    let mut conn = NbdConn::connect(node.nbd_addr(), VDISK).unwrap();
    let mut request = request_bytes(CMD_READ, 0, 1, 0, 4096, &[]);
    request[0..4].copy_from_slice(&0xdead_beef_u32.to_be_bytes());
    conn.stream.write_all(&request).unwrap();
    assert!(
        closed_by_peer(&mut conn.stream, Duration::from_secs(15)),
        "a request with a bad magic must close the connection"
    );
    // Another connection to the same vdisk is unaffected.
    bystander.write_ok(0, &[7u8; 4096]);
    assert_eq!(bystander.read_ok(0, 4096), vec![7u8; 4096]);
    bystander.disconnect();
    assert_healthy(&mut node, 6);
}

#[test]
fn write_request_of_3_gib() {
    let mut node = node();
    let mut conn = NbdConn::connect(node.nbd_addr(), VDISK).unwrap();
    let header = request_bytes(CMD_WRITE, 0, 1, 0, 3 << 30, &[]);
    conn.stream.write_all(&header).unwrap();
    // Some payload follows, as a client would start sending it.
    let _ = conn.stream.write_all(&vec![0xabu8; 1 << 20]);
    // The server must neither allocate 3 GiB nor wait for it: it drops the connection (or
    // answers an error), promptly.
    let mut reply = [0u8; 16];
    conn.stream
        .set_read_timeout(Some(Duration::from_secs(15)))
        .unwrap();
    match conn.stream.read(&mut reply) {
        Ok(0) | Err(_) => {} // closed or reset
        Ok(n) => {
            assert!(n >= 8, "partial reply {reply:02x?}");
            let error = u32::from_be_bytes(reply[4..8].try_into().unwrap());
            assert_ne!(error, 0, "a 3 GiB write cannot succeed");
        }
    }
    node.assert_alive();
    // Nothing was written.
    let mut check = NbdConn::connect(node.nbd_addr(), VDISK).unwrap();
    assert_eq!(check.read_ok(0, 4096), vec![0u8; 4096]);
    check.disconnect();
    assert_healthy(&mut node, 7);
}

#[test]
fn out_of_range_requests_fail_and_the_connection_goes_on() {
    let mut node = node();
    let mut conn = NbdConn::connect(node.nbd_addr(), VDISK).unwrap();
    assert_eq!(conn.read(SIZE, 4096).unwrap(), Err(EINVAL));
    assert_eq!(conn.read(SIZE - 4096, 8192).unwrap(), Err(EINVAL));
    assert_eq!(conn.read(u64::MAX - 4095, 4096).unwrap(), Err(EINVAL));
    assert_eq!(conn.write(SIZE, &[1u8; 4096]).unwrap(), ENOSPC);
    assert_eq!(conn.write(SIZE - 512, &[1u8; 4096]).unwrap(), ENOSPC);
    // The last block is fine, and the connection is still in sync.
    conn.write_ok(SIZE - 4096, &[9u8; 4096]);
    assert_eq!(conn.read_ok(SIZE - 4096, 4096), vec![9u8; 4096]);
    // The refused write did not touch the end of the disk either.
    assert_eq!(conn.read_ok(SIZE - 8192, 4096), vec![0u8; 4096]);
    conn.disconnect();
    assert_healthy(&mut node, 8);
}

#[test]
fn disconnect_in_the_middle_of_a_write_payload() {
    let mut node = node();
    let old = Rng::new(10).bytes(MIB as usize);
    let mut conn = NbdConn::connect(node.nbd_addr(), VDISK).unwrap();
    conn.write_ok(4 * MIB, &old); // aligned 1 MiB: extent store
    conn.write_ok(9 * MIB + 4096, &old[..64 * 1024]); // small: oplog
    conn.disconnect();
    for (offset, length) in [(4 * MIB, MIB), (9 * MIB + 4096, 64 * 1024)] {
        let mut conn = NbdConn::connect(node.nbd_addr(), VDISK).unwrap();
        let header = request_bytes(CMD_WRITE, 0, 1, offset, length as u32, &[]);
        conn.stream.write_all(&header).unwrap();
        conn.stream
            .write_all(&vec![0xeeu8; (length / 2) as usize])
            .unwrap();
        drop(conn); // half the payload, then gone
    }
    std::thread::sleep(Duration::from_millis(200));
    node.assert_alive();
    // The half-received writes were not applied, not even partly.
    let mut conn = NbdConn::connect(node.nbd_addr(), VDISK).unwrap();
    assert!(
        conn.read_ok(4 * MIB, MIB as u32) == old,
        "1 MiB write half applied"
    );
    assert!(
        conn.read_ok(9 * MIB + 4096, 64 * 1024) == old[..64 * 1024],
        "64 KiB write half applied"
    );
    conn.disconnect();
    assert_healthy(&mut node, 9);
}

#[test]
fn many_connections_opened_and_dropped() {
    let mut node = node();
    // 200 clients that complete the handshake and vanish without NBD_CMD_DISC, some with a
    // request in flight.
    for i in 0..200u64 {
        let mut conn = NbdConn::connect(node.nbd_addr(), VDISK).unwrap();
        if i % 2 == 0 {
            let request = request_bytes(CMD_READ, 0, i, (i % 64) * MIB, 65536, &[]);
            conn.stream.write_all(&request).unwrap();
        }
    }
    assert_healthy(&mut node, 10);
    assert!(
        common::wait_until(Duration::from_secs(10), || node.vdisk_stats(VDISK)
            ["connections"]
            == 0),
        "connections are released: {}",
        node.vdisk_stats(VDISK)
    );
}

/// Sends raw bytes to the HTTP port and returns (status, body) of the answer, if any.
/// With `end`, the write side is shut down after the request, so a truncated request is not
/// waited for (the server may then drop the connection without answering: HTTP/1 servers
/// need not support half-closed connections).
fn http_raw(node: &Node, request: &[u8], end: bool) -> Option<(u16, String)> {
    let mut stream = TcpStream::connect(("127.0.0.1", node.http_port)).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let _ = stream.write_all(request);
    if end {
        let _ = stream.shutdown(std::net::Shutdown::Write);
    }
    let mut response = Vec::new();
    let _ = stream.read_to_end(&mut response);
    let text = String::from_utf8_lossy(&response).into_owned();
    let status = text.split_whitespace().nth(1)?.parse().ok()?;
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string())?;
    Some((status, body))
}

fn post(node: &Node, method: &str, path: &str, body: &str) -> (u16, String) {
    let request = format!(
        "{method} {path} HTTP/1.0\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    http_raw(node, request.as_bytes(), false).expect("an HTTP answer")
}

#[test]
fn http_api_rejects_bad_requests_and_keeps_serving() {
    let mut node = node();
    // Garbage and a truncated request on the HTTP port.
    for seed in 0..4 {
        let _ = http_raw(&node, &Rng::new(seed).bytes(10_000), true);
    }
    let _ = http_raw(&node, b"GET /api/v1/vd", true);
    // Bad JSON, wrong fields, wrong types: 400 with a JSON error, nothing created.
    for body in [
        "{",
        "not json",
        r#"{"name": "x"}"#,
        r#"{"name": "x", "size_bytes": "big"}"#,
        r#"{"name": "x", "size_bytes": 1048576, "colour": "red"}"#,
        r#"{"name": "x", "size_bytes": -1}"#,
    ] {
        let (status, answer) = post(&node, "POST", "/api/v1/vdisks", body);
        assert!(
            (400..500).contains(&status),
            "POST {body:?} answered {status}: {answer}"
        );
    }
    let (status, answer) = post(
        &node,
        "POST",
        "/api/v1/vdisks",
        r#"{"name": "x", "size_bytes": 4611686018427387904}"#,
    );
    assert_eq!(status, 400, "a 4 EiB vdisk: {answer}");
    let json: serde_json::Value = serde_json::from_str(&answer).unwrap();
    assert!(json["error"].as_str().unwrap().contains("size"), "{answer}");
    let (status, answer) = post(
        &node,
        "PATCH",
        "/api/v1/vdisks/target",
        r#"{"shards": 1000}"#,
    );
    assert_eq!(status, 400, "{answer}");
    let (status, _) = post(&node, "PATCH", "/api/v1/vdisks/target", "{");
    assert_eq!(status, 400);
    let (status, answer) = node.http_get("/no/such/page");
    assert_eq!(status, 404);
    assert!(answer.contains("error"), "{answer}");
    // Only the vdisk of the start exists, unchanged.
    let list = node.http_json("/api/v1/vdisks");
    assert_eq!(list.as_array().unwrap().len(), 1, "{list}");
    assert_eq!(list[0]["size_bytes"], SIZE);
    assert_eq!(list[0]["shards"], 2);
    // The read-only endpoints still answer.
    let cache = node.http_json("/stats/cache");
    assert!(
        cache["total"]["capacity_bytes"].as_u64().unwrap() > 0,
        "{cache}"
    );
    let (status, metrics) = node.http_get("/metrics");
    assert_eq!(status, 200);
    assert!(
        metrics.contains("ashlar_vdisk_size_bytes{vdisk=\"target\"} 67108864"),
        "{metrics}"
    );
    assert_healthy(&mut node, 11);
}

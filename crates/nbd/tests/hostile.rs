//! Hostile and broken clients: the server must not panic, must answer the right error or
//! close, and must keep serving a well-behaved connection afterwards.

mod common;

use ashlar_nbd::NbdLimits;
use common::client::*;
use common::{assert_healthy, noise, registry, run, TestServer, MEM_SIZE};
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

/// Sends raw bytes, ignoring errors (the server may already have hung up).
async fn send_raw(stream: &mut TcpStream, bytes: &[u8]) {
    let _ = stream.write_all(bytes).await;
}

fn request(command: u16, flags: u16, offset: u64, length: u32) -> Vec<u8> {
    let mut out = REQUEST_MAGIC.to_be_bytes().to_vec();
    out.extend_from_slice(&flags.to_be_bytes());
    out.extend_from_slice(&command.to_be_bytes());
    out.extend_from_slice(&77u64.to_be_bytes());
    out.extend_from_slice(&offset.to_be_bytes());
    out.extend_from_slice(&length.to_be_bytes());
    out
}

#[test]
fn random_garbage_in_the_handshake_is_dropped() {
    run(async {
        let server = TestServer::default().await;
        for seed in 1..=20u64 {
            let mut stream = TcpStream::connect(server.addr).await.unwrap();
            send_raw(&mut stream, &noise(seed, 20 + seed as usize * 97)).await;
            assert!(is_closed(&mut stream).await, "seed {seed}");
        }
        let outcomes = server.ended(20).await;
        assert!(outcomes.iter().all(|o| o.is_err()), "{outcomes:?}");
        assert_healthy(server.addr).await;
        server.stop().await;
    });
}

#[test]
fn random_garbage_in_transmission_is_dropped() {
    run(async {
        let server = TestServer::default().await;
        for seed in 1..=10u64 {
            let (mut c, _) = Client::connect(server.addr, "mem", STRUCTURED).await;
            send_raw(&mut c.stream, &noise(seed, 100 + seed as usize * 500)).await;
            assert!(c.closed_by_server().await, "seed {seed}");
        }
        assert_eq!(
            server.device("mem").calls(),
            0,
            "garbage never reached the device"
        );
        assert_healthy(server.addr).await;
        server.stop().await;
    });
}

#[test]
fn bad_client_flags_and_option_magic_close_the_connection() {
    run(async {
        let server = TestServer::default().await;
        for flags in [0u32, 1 | 4, 0x8000_0000] {
            let mut c = Client::greet(server.addr, flags).await;
            assert!(c.closed_by_server().await, "flags {flags:#x}");
        }
        let mut c = Client::greet(server.addr, 1).await;
        let mut option = 0x1234_5678_9abc_def0u64.to_be_bytes().to_vec();
        option.extend_from_slice(&[0, 0, 0, 7, 0, 0, 0, 0]);
        send_raw(&mut c.stream, &option).await;
        assert!(c.closed_by_server().await);
        let outcomes = server.ended(4).await;
        assert!(
            outcomes[3].as_ref().unwrap_err().contains("magic"),
            "{outcomes:?}"
        );
        assert_healthy(server.addr).await;
        server.stop().await;
    });
}

#[test]
fn oversized_option_is_refused_and_closed() {
    run(async {
        let server = TestServer::default().await;
        let mut c = Client::greet(server.addr, 1).await;
        let mut header = IHAVEOPT.to_be_bytes().to_vec();
        header.extend_from_slice(&OPT_GO.to_be_bytes());
        header.extend_from_slice(&(1u32 << 20).to_be_bytes());
        send_raw(&mut c.stream, &header).await;
        let reply = c.option_reply().await;
        assert_eq!((reply.option, reply.kind), (OPT_GO, REP_ERR_TOO_BIG));
        assert!(c.closed_by_server().await);
        assert_healthy(server.addr).await;
        server.stop().await;
    });
}

#[test]
fn malformed_go_is_invalid_and_the_session_continues() {
    run(async {
        let server = TestServer::default().await;
        let mut c = Client::greet(server.addr, 1).await;
        let mut lying = 4000u32.to_be_bytes().to_vec(); // name longer than the payload
        lying.extend_from_slice(b"mem\0\0");
        for payload in [lying, vec![], vec![0, 0, 0, 3, b'm', b'e', b'm', 0, 1]] {
            c.send_option(OPT_GO, &payload).await;
            assert_eq!(c.option_reply().await.kind, REP_ERR_INVALID, "{payload:?}");
        }
        assert_eq!(c.go(OPT_GO, "mem", &[]).await.unwrap().size, MEM_SIZE);
        server.stop().await;
    });
}

#[test]
fn truncated_messages_end_the_connection_cleanly() {
    run(async {
        let server = TestServer::default().await;
        // Half an option header, then the client leaves.
        let mut c = Client::greet(server.addr, 1).await;
        send_raw(&mut c.stream, &IHAVEOPT.to_be_bytes()[..6]).await;
        drop(c);
        // Half a request header.
        let (mut c, _) = Client::connect(server.addr, "mem", SIMPLE).await;
        send_raw(&mut c.stream, &request(CMD_READ, 0, 0, 4096)[..10]).await;
        drop(c);
        // Half a write payload: nothing may be written.
        let (mut c, _) = Client::connect(server.addr, "mem", SIMPLE).await;
        let mut write = request(CMD_WRITE, 0, 0, 65536);
        write.extend_from_slice(&[0xaa; 1000]);
        send_raw(&mut c.stream, &write).await;
        drop(c);
        let outcomes = server.ended(3).await;
        for outcome in &outcomes {
            assert!(
                outcome.as_ref().unwrap_err().contains("middle of"),
                "{outcomes:?}"
            );
        }
        let device = server.device("mem");
        assert_eq!((device.calls(), device.allocated_blocks()), (0, 0));
        assert_healthy(server.addr).await;
        server.stop().await;
    });
}

#[test]
fn bad_request_magic_closes_the_connection() {
    run(async {
        let server = TestServer::default().await;
        let (mut c, _) = Client::connect(server.addr, "mem", SIMPLE).await;
        let mut bad = request(CMD_READ, 0, 0, 512);
        bad[3] ^= 0xff;
        send_raw(&mut c.stream, &bad).await;
        assert!(c.closed_by_server().await);
        assert!(server.ended(1).await[0]
            .as_ref()
            .unwrap_err()
            .contains("magic"));
        assert_healthy(server.addr).await;
        server.stop().await;
    });
}

#[test]
fn huge_write_closes_without_reading_the_payload() {
    run(async {
        let server = TestServer::default().await;
        let (mut c, _) = Client::connect(server.addr, "mem", SIMPLE).await;
        send_raw(&mut c.stream, &request(CMD_WRITE, 0, 0, u32::MAX)).await;
        send_raw(&mut c.stream, &[0u8; 4096]).await;
        assert!(c.closed_by_server().await);
        assert!(server.ended(1).await[0]
            .as_ref()
            .unwrap_err()
            .contains("larger than"));
        assert_eq!(server.device("mem").calls(), 0);
        assert_healthy(server.addr).await;
        server.stop().await;
    });
}

#[test]
fn oversized_requests_within_the_skip_cap_get_errors() {
    run(async {
        let limits = NbdLimits {
            max_request_bytes: 65536,
            ..NbdLimits::default()
        };
        let server = TestServer::start(registry(), limits).await;
        let device = server.device("mem");
        let (mut c, _) = Client::connect(server.addr, "mem", SIMPLE).await;
        assert_eq!(c.write(0, &vec![1u8; 131072], 0).await, EINVAL);
        assert_eq!(c.read(0, 131072).await.error, EINVAL);
        assert_eq!(device.calls(), 0);
        // Commands without payload may exceed the maximum.
        assert_eq!(c.call(CMD_TRIM, 0, 0, 1 << 20, &[]).await.error, 0);
        assert_eq!(c.call(CMD_WRITE_ZEROES, 0, 0, 1 << 20, &[]).await.error, 0);
        assert_eq!(
            c.read(0, 65536).await.data,
            vec![0u8; 65536],
            "stream still in sync"
        );

        let (mut s, _) = Client::connect(server.addr, "mem", STRUCTURED).await;
        assert_eq!(s.read(0, 131072).await.error, EOVERFLOW);
        assert_eq!(s.read(0, 4096).await.error, 0);
        server.stop().await;
    });
}

#[test]
fn out_of_range_requests_fail_without_touching_the_device() {
    run(async {
        let server = TestServer::default().await;
        let device = server.device("mem");
        let (mut c, _) = Client::connect(server.addr, "mem", STRUCTURED).await;
        let end = MEM_SIZE;
        assert_eq!(c.read(end - 512, 1024).await.error, EINVAL);
        assert_eq!(
            c.read(end + 4096, 0).await.error,
            EINVAL,
            "zero length past the end"
        );
        assert_eq!(c.write(end - 512, &[1; 1024], 0).await, ENOSPC);
        assert_eq!(c.call(CMD_TRIM, 0, end, 1, &[]).await.error, EINVAL);
        assert_eq!(
            c.call(CMD_WRITE_ZEROES, 0, end, 4096, &[]).await.error,
            ENOSPC
        );
        assert_eq!(
            c.call(CMD_BLOCK_STATUS, 0, end - 1, 2, &[]).await.error,
            EINVAL
        );
        // offset + length overflows 64 bits.
        assert_eq!(c.read(u64::MAX - 10, 4096).await.error, EINVAL);
        assert_eq!(c.write(u64::MAX - 10, &[1; 4096], 0).await, ENOSPC);
        assert_eq!(device.calls(), 0);
        assert_eq!(
            c.read(end - 512, 512).await.error,
            0,
            "the last bytes are readable"
        );
        server.stop().await;
    });
}

#[test]
fn unknown_commands_flags_and_unnegotiated_features_are_einval() {
    run(async {
        let server = TestServer::default().await;
        let (mut c, _) = Client::connect(server.addr, "mem", SIMPLE).await;
        assert_eq!(c.call(42, 0, 0, 4096, &[]).await.error, EINVAL);
        assert_eq!(c.call(CMD_READ, 0x40, 0, 4096, &[]).await.error, EINVAL);
        assert_eq!(
            c.call(CMD_READ, FLAG_NO_HOLE, 0, 4096, &[]).await.error,
            EINVAL
        );
        assert_eq!(
            c.call(CMD_WRITE_ZEROES, 16, 0, 4096, &[]).await.error,
            EINVAL,
            "FAST_ZERO"
        );
        assert_eq!(c.call(CMD_FLUSH, 0, 4096, 0, &[]).await.error, EINVAL);
        assert_eq!(
            c.call(CMD_BLOCK_STATUS, 0, 0, 4096, &[]).await.error,
            EINVAL
        );
        let (mut s, _) = Client::connect(server.addr, "mem", mode_structured_only()).await;
        let answer = s.call(CMD_BLOCK_STATUS, 0, 0, 4096, &[]).await;
        assert_eq!(
            (answer.error, answer.chunk_types),
            (EINVAL, vec![CHUNK_ERROR])
        );
        assert_eq!(server.device("mem").calls(), 0);
        assert_eq!(c.read(0, 16).await.error, 0, "connection still usable");
        server.stop().await;
    });
}

fn mode_structured_only() -> Mode {
    Mode {
        structured: true,
        allocation: false,
    }
}

#[test]
fn zero_length_requests_succeed_except_block_status() {
    run(async {
        let server = TestServer::default().await;
        let (mut c, _) = Client::connect(server.addr, "mem", STRUCTURED).await;
        assert_eq!(c.read(4096, 0).await.error, 0);
        assert_eq!(c.write(4096, &[], 0).await, 0);
        assert_eq!(c.call(CMD_TRIM, 0, 4096, 0, &[]).await.error, 0);
        assert_eq!(c.call(CMD_WRITE_ZEROES, 0, MEM_SIZE, 0, &[]).await.error, 0);
        assert_eq!(c.call(CMD_BLOCK_STATUS, 0, 0, 0, &[]).await.error, EINVAL);
        assert_eq!(server.device("mem").calls(), 0);
        server.stop().await;
    });
}

#[test]
fn client_vanishing_with_requests_in_flight_is_harmless() {
    run(async {
        let server = TestServer::default().await;
        server
            .device("mem")
            .delay_reads_at(0, Duration::from_millis(200));
        let (mut c, _) = Client::connect(server.addr, "mem", SIMPLE).await;
        for _ in 0..10 {
            c.send(CMD_READ, 0, 0, 65536, &[]).await;
        }
        drop(c);
        server.ended(1).await;
        assert_healthy(server.addr).await;
        server.stop().await;
    });
}

#[test]
fn a_client_that_never_reads_replies_only_blocks_itself() {
    run(async {
        let limits = NbdLimits {
            max_in_flight_requests: 4,
            ..NbdLimits::default()
        };
        let server = TestServer::start(registry(), limits).await;
        let (mut c, _) = Client::connect(server.addr, "mem", SIMPLE).await;
        // Far more reply bytes than socket buffers hold, and never read.
        for _ in 0..64 {
            c.send(CMD_READ, 0, 0, 1 << 20, &[]).await;
        }
        assert_healthy(server.addr).await;
        drop(c);
        server.stop().await;
    });
}

#[test]
fn endless_options_are_cut_off() {
    run(async {
        let server = TestServer::default().await;
        let mut c = Client::greet(server.addr, 1).await;
        let mut burst = Vec::new();
        for _ in 0..300 {
            burst.extend_from_slice(&IHAVEOPT.to_be_bytes());
            burst.extend_from_slice(&OPT_STRUCTURED_REPLY.to_be_bytes());
            burst.extend_from_slice(&0u32.to_be_bytes());
        }
        send_raw(&mut c.stream, &burst).await;
        for _ in 0..256 {
            assert_eq!(c.option_reply().await.kind, REP_ACK);
        }
        assert!(c.closed_by_server().await);
        assert!(server.ended(1).await[0]
            .as_ref()
            .unwrap_err()
            .contains("options"));
        assert_healthy(server.addr).await;
        server.stop().await;
    });
}

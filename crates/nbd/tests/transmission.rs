//! Transmission phase over real TCP: round trips, structured replies, block status,
//! pipelining, disconnect and shutdown.

mod common;

use ashlar_core::IoError;
use ashlar_nbd::NbdLimits;
use common::client::*;
use common::memory::MemoryDevice;
use common::{assert_flags, assert_healthy, registry, run, TestServer, MEM_SIZE};
use std::collections::HashSet;
use std::time::Duration;

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) | 1)
        .collect()
}

#[test]
fn simple_replies_round_trip() {
    run(async {
        let server = TestServer::default().await;
        let device = server.device("mem");
        let (mut c, size) = Client::connect(server.addr, "mem", SIMPLE).await;
        assert_eq!(size, MEM_SIZE);

        let data = pattern(64 * 1024, 7);
        assert_eq!(c.write(0, &data, FLAG_FUA).await, 0);
        let answer = c.read(0, 64 * 1024).await;
        assert_eq!((answer.error, &answer.data), (0, &data));
        assert_eq!(c.call(CMD_FLUSH, 0, 0, 0, &[]).await.error, 0);

        // Unaligned I/O is fine with the default minimum block size of 1.
        assert_eq!(c.write(100_003, b"hello", 0).await, 0);
        assert_eq!(c.read(100_000, 10).await.data, b"\0\0\0hello\0\0");

        // Trim frees whole blocks; write-zeroes punches holes unless NO_HOLE.
        let before = device.allocated_blocks();
        assert_eq!(c.call(CMD_TRIM, 0, 0, 8192, &[]).await.error, 0);
        assert_eq!(device.allocated_blocks(), before - 2);
        assert_eq!(
            c.call(CMD_WRITE_ZEROES, FLAG_NO_HOLE, 8192, 4096, &[])
                .await
                .error,
            0
        );
        assert_eq!(
            device.allocated_blocks(),
            before - 2,
            "NO_HOLE keeps the block"
        );
        assert_eq!(
            c.call(CMD_WRITE_ZEROES, FLAG_FUA, 12288, 4096, &[])
                .await
                .error,
            0
        );
        assert_eq!(
            device.allocated_blocks(),
            before - 3,
            "holes may be punched"
        );
        let answer = c.read(0, 16384).await;
        assert_eq!(answer.data, vec![0u8; 16384]);
        assert_eq!(c.read(16384, 100).await.data, data[16384..16484]);

        c.disconnect().await;
        assert!(c.closed_by_server().await);
        assert_eq!(server.stop().await, vec![Ok(())]);
    });
}

#[test]
fn structured_reads_use_data_and_hole_chunks() {
    run(async {
        let server = TestServer::default().await;
        let (mut c, _) = Client::connect(server.addr, "mem", STRUCTURED).await;
        let data = pattern(4096, 3);
        assert_eq!(c.write(0, &data, 0).await, 0);

        let answer = c.read(0, 8192).await;
        assert_eq!(answer.chunk_types, vec![CHUNK_OFFSET_DATA]);
        assert_eq!(&answer.data[..4096], &data[..]);
        assert_eq!(&answer.data[4096..], &[0u8; 4096][..]);

        let answer = c.read(1 << 20, 65536).await;
        assert_eq!(answer.chunk_types, vec![CHUNK_OFFSET_HOLE]);
        assert_eq!(answer.data, vec![0u8; 65536]);

        let answer = c.read(0, 0).await;
        assert_eq!((answer.error, answer.chunk_types), (0, vec![CHUNK_NONE]));
        assert_eq!(
            c.call(CMD_TRIM, 0, 0, 4096, &[]).await.chunk_types,
            Vec::<u16>::new(),
            "simple ok"
        );
        c.disconnect().await;
        assert!(c.closed_by_server().await);
        server.stop().await;
    });
}

#[test]
fn block_status_reports_holes_zeroes_and_data() {
    run(async {
        let server = TestServer::default().await;
        let mut c = Client::greet(server.addr, 1).await;
        c.send_option(OPT_STRUCTURED_REPLY, &[]).await;
        assert_eq!(c.option_reply().await.kind, REP_ACK);
        c.mark_structured();
        let (contexts, kind) = c
            .meta(OPT_SET_META_CONTEXT, "mem", &["base:allocation"])
            .await;
        assert_eq!(kind, REP_ACK);
        let [(id, name)] = contexts.as_slice() else {
            panic!("one context: {contexts:?}")
        };
        assert_eq!(name, "base:allocation");
        let info = c.go(OPT_GO, "mem", &[]).await.unwrap();
        assert_flags(info.flags);

        assert_eq!(c.write(65536, &pattern(65536, 1), 0).await, 0);
        assert_eq!(
            c.call(CMD_WRITE_ZEROES, FLAG_NO_HOLE, 131072, 4096, &[])
                .await
                .error,
            0
        );

        let answer = c.call(CMD_BLOCK_STATUS, 0, 0, 262144, &[]).await;
        assert_eq!(answer.error, 0);
        assert_eq!(answer.context_id, *id);
        assert_eq!(answer.chunk_types, vec![CHUNK_BLOCK_STATUS]);
        assert_eq!(
            answer.extents,
            vec![(65536, 3), (65536, 0), (4096, 2), (126976, 3)]
        );

        let one = c.call(CMD_BLOCK_STATUS, FLAG_REQ_ONE, 0, 262144, &[]).await;
        assert_eq!(one.extents, vec![(65536, 3)]);
        let tail = c.call(CMD_BLOCK_STATUS, 0, MEM_SIZE - 512, 512, &[]).await;
        assert_eq!(tail.extents, vec![(512, 3)]);
        c.disconnect().await;
        server.stop().await;
    });
}

#[test]
fn replies_complete_out_of_order() {
    run(async {
        let server = TestServer::default().await;
        server
            .device("mem")
            .delay_reads_at(0, Duration::from_millis(300));
        let (mut c, _) = Client::connect(server.addr, "mem", SIMPLE).await;
        let slow = c.send(CMD_READ, 0, 0, 4096, &[]).await;
        let fast = c.send(CMD_READ, 0, 4096, 4096, &[]).await;
        assert_eq!(c.reply().await.cookie(), fast);
        assert_eq!(c.reply().await.cookie(), slow);
        server.stop().await;
    });
}

#[test]
fn pipelined_requests_respect_a_small_in_flight_limit() {
    run(async {
        let limits = NbdLimits {
            max_in_flight_requests: 2,
            ..NbdLimits::default()
        };
        let server = TestServer::start(registry(), limits).await;
        let data = pattern(1 << 20, 9);
        server.device("mem").fill(0, &data);
        let (mut c, _) = Client::connect(server.addr, "mem", SIMPLE).await;
        // 500 reads of 4 KiB (2 MiB of replies) are sent before any reply is read: the server
        // must stop reading at the limit, not buffer everything.
        let mut cookies = HashSet::new();
        for i in 0..500u64 {
            cookies.insert(c.send(CMD_READ, 0, (i % 256) * 4096, 4096, &[]).await);
        }
        for _ in 0..500 {
            let Reply::Simple {
                cookie,
                error,
                data: got,
            } = c.reply().await
            else {
                panic!("simple")
            };
            assert_eq!(error, 0);
            let offset = ((cookie - 1) % 256) as usize * 4096;
            assert_eq!(got, data[offset..offset + 4096]);
            assert!(cookies.remove(&cookie), "cookie {cookie} answered twice");
        }
        server.stop().await;
    });
}

#[test]
fn disc_answers_in_flight_requests_first() {
    run(async {
        let server = TestServer::default().await;
        server
            .device("mem")
            .delay_reads_at(0, Duration::from_millis(200));
        let (mut c, _) = Client::connect(server.addr, "mem", SIMPLE).await;
        let cookie = c.send(CMD_READ, 0, 0, 4096, &[]).await;
        c.disconnect().await;
        assert_eq!(c.reply().await.cookie(), cookie);
        assert!(c.closed_by_server().await);
        assert_eq!(server.ended(1).await, vec![Ok(())]);
        server.stop().await;
    });
}

#[test]
fn shutdown_answers_in_flight_requests_then_closes() {
    run(async {
        let server = TestServer::default().await;
        server
            .device("mem")
            .delay_reads_at(0, Duration::from_millis(300));
        let (mut c, _) = Client::connect(server.addr, "mem", STRUCTURED).await;
        let cookie = c.send(CMD_READ, 0, 0, 4096, &[]).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        server.trigger_shutdown();
        let answer = c.answer(cookie, 0, 4096).await;
        assert_eq!(answer.error, 0);
        assert!(c.closed_by_server().await);
        assert_eq!(server.stop().await, vec![Ok(())]);
    });
}

#[test]
fn device_errors_map_to_nbd_errors() {
    run(async {
        let server = TestServer::default().await;
        let device = server.device("mem");
        let (mut simple, _) = Client::connect(server.addr, "mem", SIMPLE).await;
        let (mut structured, _) = Client::connect(server.addr, "mem", STRUCTURED).await;
        let cases = [
            (IoError::Io("checksum mismatch".into()), EIO),
            (IoError::Invalid("bad".into()), EINVAL),
            (IoError::NoSpace, ENOSPC),
            (IoError::ShuttingDown, ESHUTDOWN),
            (IoError::NotServing("lease lapsed".into()), EIO),
        ];
        for (error, errno) in cases {
            device.fail_with(Some(error.clone()));
            assert_eq!(simple.read(0, 4096).await.error, errno, "{error}");
            assert_eq!(simple.write(0, &[1; 512], 0).await, errno, "{error}");
            let answer = structured.read(0, 4096).await;
            assert_eq!(answer.error, errno);
            assert_eq!(answer.chunk_types, vec![CHUNK_ERROR]);
            assert_eq!(answer.message, error.to_string());
            let status = structured.call(CMD_BLOCK_STATUS, 0, 0, 4096, &[]).await;
            assert_eq!(status.error, errno);
        }
        device.fail_with(None);
        assert_eq!(simple.read(0, 4096).await.error, 0);
        server.stop().await;
    });
}

#[test]
fn connections_to_one_export_share_its_data() {
    run(async {
        let server = TestServer::default().await;
        let (mut a, _) = Client::connect(server.addr, "mem", SIMPLE).await;
        let (mut b, _) = Client::connect(server.addr, "mem", STRUCTURED).await;
        let data = pattern(8192, 5);
        assert_eq!(a.write(4096, &data, FLAG_FUA).await, 0);
        assert_eq!(b.read(4096, 8192).await.data, data);
        let (mut other, size) = Client::connect(server.addr, "small", SIMPLE).await;
        assert_eq!(size, common::SMALL_SIZE);
        assert_eq!(other.read(4096, 8192).await.data, vec![0; 8192]);
        assert_healthy(server.addr).await;
        server.stop().await;
    });
}

#[test]
fn memory_device_block_status_is_sane() {
    // Guards the test device itself, so failures above point at the server.
    run(async {
        use ashlar_core::BlockDevice;
        let device = MemoryDevice::new(1 << 20);
        device.fill(4096, &[1]);
        let runs = device.block_status(0, 3 * 4096).await.unwrap();
        let lengths: Vec<_> = runs.iter().map(|r| (r.length, r.hole)).collect();
        assert_eq!(lengths, vec![(4096, true), (4096, false), (4096, true)]);
    });
}

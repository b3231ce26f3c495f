//! The request budget shared by all connections: payload bytes are reserved before they are
//! read, a connection without budget stops reading (and fails nothing), small I/O is served
//! from each connection's allowance meanwhile, a request larger than the budget is still
//! served, and every reservation is returned however a connection ends.

mod common;

use ashlar_nbd::{NbdLimits, RequestBudget};
use common::client::*;
use common::{assert_healthy, noise, registry, run, TestServer};
use std::time::Duration;

const KIB: u32 = 1024;
const MIB: u32 = 1024 * KIB;

fn limits(budget: &RequestBudget, allowance: u32) -> NbdLimits {
    NbdLimits {
        request_budget: budget.clone(),
        connection_allowance_bytes: allowance,
        ..NbdLimits::default()
    }
}

/// Waits (bounded) until the budget has exactly `bytes` available.
async fn wait_available(budget: &RequestBudget, bytes: u64) {
    for _ in 0..1000 {
        if budget.available_bytes() == bytes {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!(
        "budget: {} bytes available, expected {bytes}",
        budget.available_bytes()
    );
}

#[test]
fn a_stalled_write_holds_the_budget_others_wait_and_small_io_goes_on() {
    run(async {
        let budget = RequestBudget::new(u64::from(MIB));
        let server = TestServer::start(registry(), limits(&budget, 64 * KIB)).await;
        let device = server.device("mem");

        // A write of the whole budget that stops one byte short of its end.
        let (mut stalled, _) = Client::connect(server.addr, "mem", SIMPLE).await;
        let data = noise(1, MIB as usize);
        stalled
            .send(CMD_WRITE, 0, 0, MIB, &data[..MIB as usize - 1])
            .await;
        wait_available(&budget, 0).await;

        // A write that needs the shared budget waits: no reply, and its payload stays unread.
        let (mut waiting, _) = Client::connect(server.addr, "mem", SIMPLE).await;
        let big = noise(2, 512 * KIB as usize);
        let cookie = waiting
            .send(CMD_WRITE, 0, 2 * MIB as u64, big.len() as u32, &big)
            .await;
        let early = tokio::time::timeout(Duration::from_millis(300), waiting.reply()).await;
        assert!(early.is_err(), "a write without budget must wait, not fail");

        // Small I/O of other clients fits in their allowance and is served meanwhile.
        assert_healthy(server.addr).await;
        let (mut small, _) = Client::connect(server.addr, "mem", STRUCTURED).await;
        assert_eq!(small.write(8 * MIB as u64, &[5u8; 4096], 0).await, 0);
        assert_eq!(small.read(8 * MIB as u64, 4096).await.data, vec![5u8; 4096]);
        assert_eq!(device.contents(2 * MIB as u64, 4096), vec![0u8; 4096]);

        // The stalled client leaves: its reservation returns, the waiting write goes through.
        drop(stalled);
        let reply = tokio::time::timeout(Duration::from_secs(10), waiting.answer(cookie, 0, 0))
            .await
            .expect("the waiting write is served once the budget is free");
        assert_eq!(reply.error, 0);
        assert_eq!(device.contents(2 * MIB as u64, big.len()), big);
        assert_eq!(
            device.contents(0, 4096),
            vec![0u8; 4096],
            "half a write is never applied"
        );
        waiting.disconnect().await;
        small.disconnect().await;
        server.ended(5).await;
        wait_available(&budget, u64::from(MIB)).await;
        server.stop().await;
    });
}

#[test]
fn requests_larger_than_the_whole_budget_are_served() {
    run(async {
        let budget = RequestBudget::new(64 * 1024);
        let server = TestServer::start(registry(), limits(&budget, 0)).await;
        let (mut a, _) = Client::connect(server.addr, "mem", SIMPLE).await;
        let (mut b, _) = Client::connect(server.addr, "mem", STRUCTURED).await;
        let one = noise(3, MIB as usize);
        let two = noise(4, MIB as usize);
        // Pipelined on two connections at once: each request takes the whole budget in turn.
        let mut cookies = Vec::new();
        for i in 0..4u64 {
            cookies.push(a.send(CMD_WRITE, 0, i * MIB as u64, MIB, &one).await);
        }
        let b_cookie = b.send(CMD_WRITE, 0, 4 * MIB as u64, MIB, &two).await;
        for cookie in cookies {
            assert_eq!(a.answer(cookie, 0, 0).await.error, 0);
        }
        assert_eq!(b.answer(b_cookie, 0, 0).await.error, 0);
        assert_eq!(a.read(3 * MIB as u64, MIB).await.data, one);
        assert_eq!(b.read(4 * MIB as u64, MIB).await.data, two);
        a.disconnect().await;
        b.disconnect().await;
        server.ended(2).await;
        wait_available(&budget, 64 * 1024).await;
        server.stop().await;
    });
}

#[test]
fn read_replies_hold_budget_until_written_and_are_released_when_the_client_goes() {
    run(async {
        let budget = RequestBudget::new(u64::from(MIB));
        let server = TestServer::start(registry(), limits(&budget, 64 * KIB)).await;
        server.device("mem").fill(0, &noise(5, 4 * MIB as usize));
        // A client that asks for far more reply data than socket buffers hold, never reading.
        let (mut hog, _) = Client::connect(server.addr, "mem", SIMPLE).await;
        for i in 0..48u64 {
            hog.send(CMD_READ, 0, (i % 4) * MIB as u64, MIB, &[]).await;
        }
        // Its replies back up: the budget is held by a reply the socket cannot take.
        wait_available(&budget, 0).await;
        // Others' small reads are served from their allowance.
        assert_healthy(server.addr).await;
        drop(hog);
        server.ended(3).await;
        wait_available(&budget, u64::from(MIB)).await;
        server.stop().await;
    });
}

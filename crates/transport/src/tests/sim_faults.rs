//! Faults only the simulated network can inject: partitions, delay, loss, resets. Time is
//! paused (tokio advances it when every task waits), so these run in microseconds of real
//! time and the same seed gives the same run.

use super::env::*;
use crate::sim::SimNetwork;
use crate::{Connection, Transport, TransportError, TransportLimits};
use bytes::Bytes;
use std::time::Duration;
use tokio::time::Instant;

const SECRET: u8 = 1;

async fn connected(
    env: &SimEnv,
    started: &Started,
    limits: TransportLimits,
) -> (crate::Server, Connection) {
    let server = serve(env, SECRET, limits.clone(), echo(started.clone())).await;
    let connection = env
        .node(CLIENT, &secret(SECRET), limits)
        .connect(server.local_addr())
        .await
        .unwrap();
    (server, connection)
}

#[tokio::test(start_paused = true)]
async fn partition_times_out_calls_and_heal_lets_a_new_connection_in() {
    let env = SimEnv::new(1);
    let started = Started::default();
    let (server, old) = connected(&env, &started, quick_limits()).await;
    assert_eq!(
        old.call_default(Bytes::from_static(b"before"))
            .await
            .unwrap(),
        echoed(b"before")
    );

    env.network.partition(host(CLIENT), host(SERVER));
    let timed_out = old
        .call(Bytes::from_static(b"during"), Duration::from_millis(200))
        .await
        .unwrap_err();
    assert!(
        matches!(timed_out, TransportError::Timeout { timeout_ms: 200 }),
        "{timed_out:?}"
    );
    let client = env.node(CLIENT, &secret(SECRET), quick_limits());
    let refused = client.connect(server.local_addr()).await.unwrap_err();
    assert!(
        matches!(refused, TransportError::Timeout { .. }),
        "connect during a partition: {refused:?}"
    );
    // Nothing arrives, not even pongs: the old connection gives up after its idle timeout.
    tokio::time::sleep(Duration::from_millis(2 * quick_limits().idle_timeout_ms)).await;
    let gave_up = old
        .call_default(Bytes::from_static(b"x"))
        .await
        .unwrap_err();
    assert!(
        matches!(gave_up, TransportError::PeerUnresponsive { .. }),
        "{gave_up:?}"
    );
    assert_eq!(started.get(), 1, "a request crossed the partition");

    env.network.heal(host(CLIENT), host(SERVER));
    let fresh = client.connect(server.local_addr()).await.unwrap();
    assert_eq!(
        fresh
            .call_default(Bytes::from_static(b"after"))
            .await
            .unwrap(),
        echoed(b"after")
    );
}

#[tokio::test(start_paused = true)]
async fn one_way_cut_delivers_requests_but_loses_responses() {
    let env = SimEnv::new(2);
    let started = Started::default();
    let (_server, connection) = connected(&env, &started, quick_limits()).await;
    env.network.set_cut(host(SERVER), host(CLIENT), true);
    let lost = connection
        .call(Bytes::from_static(b"one way"), Duration::from_millis(100))
        .await
        .unwrap_err();
    assert!(matches!(lost, TransportError::Timeout { .. }), "{lost:?}");
    assert_eq!(started.get(), 1, "the request should have arrived");
}

#[tokio::test(start_paused = true)]
async fn link_delay_shows_in_call_latency() {
    let env = SimEnv::new(3);
    let (_server, connection) =
        connected(&env, &Started::default(), TransportLimits::default()).await;
    let start = Instant::now();
    connection
        .call_default(Bytes::from_static(b"fast"))
        .await
        .unwrap();
    assert!(
        start.elapsed() < Duration::from_millis(1),
        "no delay configured: {:?}",
        start.elapsed()
    );

    env.network.set_delay(
        host(CLIENT),
        host(SERVER),
        Duration::from_millis(30),
        Duration::ZERO,
    );
    env.network.set_delay(
        host(SERVER),
        host(CLIENT),
        Duration::from_millis(20),
        Duration::from_millis(10),
    );
    let start = Instant::now();
    connection
        .call_default(Bytes::from_static(b"slow"))
        .await
        .unwrap();
    let elapsed = start.elapsed();
    assert!(
        elapsed >= Duration::from_millis(50) && elapsed <= Duration::from_millis(61),
        "round trip took {elapsed:?}"
    );
}

/// Sends `CALLS` calls one after another over a link that loses a third of the client's
/// segments; returns which timed out and how many segments were lost.
async fn lossy_run(seed: u64) -> (Vec<bool>, u64) {
    const CALLS: usize = 40;
    let env = SimEnv::new(seed);
    let (_server, connection) =
        connected(&env, &Started::default(), TransportLimits::default()).await;
    env.network.set_loss(host(CLIENT), host(SERVER), 333_333);
    let mut timed_out = Vec::with_capacity(CALLS);
    for i in 0..CALLS {
        let result = connection
            .call(Bytes::from(format!("call {i}")), Duration::from_millis(50))
            .await;
        let failed = result.is_err();
        match result {
            Ok(response) => assert_eq!(response, echoed(format!("call {i}").as_bytes())),
            Err(error) => assert!(matches!(error, TransportError::Timeout { .. }), "{error:?}"),
        }
        timed_out.push(failed);
    }
    (timed_out, env.network.segments_dropped())
}

#[tokio::test(start_paused = true)]
async fn loss_times_out_some_calls_and_a_seed_replays_the_same_run() {
    let (first, dropped) = lossy_run(42).await;
    let lost = first.iter().filter(|&&t| t).count();
    assert!(
        (5..=25).contains(&lost),
        "{lost} of {} calls lost at 1/3 loss",
        first.len()
    );
    assert!(dropped >= lost as u64);
    assert_eq!(
        lossy_run(42).await,
        (first.clone(), dropped),
        "same seed, different run"
    );
    assert_ne!(
        lossy_run(43).await.0,
        first,
        "another seed should lose other calls"
    );
}

#[tokio::test(start_paused = true)]
async fn reset_fails_pending_calls_and_reconnect_works() {
    let env = SimEnv::new(4);
    let started = Started::default();
    let server = serve(
        &env,
        SECRET,
        TransportLimits::default(),
        black_hole(started.clone()),
    )
    .await;
    let client = env.node(CLIENT, &secret(SECRET), TransportLimits::default());
    let connection = client.connect(server.local_addr()).await.unwrap();
    let pending = {
        let connection = connection.clone();
        tokio::spawn(async move {
            connection
                .call(Bytes::from_static(b"stuck"), Duration::from_secs(60))
                .await
        })
    };
    eventually("the call reaches the handler", || started.get() == 1).await;
    let reset_at = Instant::now();
    env.network.reset_connections(host(CLIENT), host(SERVER));
    let failed = pending.await.unwrap().unwrap_err();
    assert!(matches!(failed, TransportError::PeerClosed), "{failed:?}");
    assert!(reset_at.elapsed() < Duration::from_millis(10));
    let again = client.connect(server.local_addr()).await.unwrap();
    assert!(!again.is_closed());
}

#[tokio::test(start_paused = true)]
async fn connect_to_nobody_is_refused() {
    let network = SimNetwork::new(5);
    let env = SimEnv { network };
    let client = env.node(CLIENT, &secret(SECRET), TransportLimits::default());
    let refused = client.connect(env.listen_addr(SERVER)).await.unwrap_err();
    assert!(
        matches!(&refused, TransportError::Io(e) if e.kind() == std::io::ErrorKind::ConnectionRefused),
        "{refused:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_partition_cuts_only_its_link_in_a_three_node_cluster() {
    let env = SimEnv::new(6);
    let limits = quick_limits();
    let mut servers = Vec::new();
    for node in 1..=3u64 {
        let transport = env.node(node, &secret(SECRET), limits.clone());
        servers.push(
            transport
                .serve(env.listen_addr(node), echo(Started::default()))
                .await
                .unwrap(),
        );
    }
    let link = |from: u64, to: u64| {
        let transport = env.node(from, &secret(SECRET), limits.clone());
        let addr = env.listen_addr(to);
        async move {
            let connection = transport.connect_node(addr, crate::NodeId(to)).await?;
            connection
                .call(Bytes::from_static(b"hi"), Duration::from_millis(200))
                .await
        }
    };
    env.network.partition(host(1), host(2));
    for (from, to) in [(1, 3), (3, 1), (2, 3), (3, 2)] {
        assert_eq!(
            link(from, to).await.unwrap(),
            echoed(b"hi"),
            "{from} -> {to}"
        );
    }
    for (from, to) in [(1, 2), (2, 1)] {
        let cut = link(from, to).await.unwrap_err();
        assert!(
            matches!(cut, TransportError::Timeout { .. }),
            "{from} -> {to}: {cut:?}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn connecting_to_an_unexpected_node_is_refused() {
    let env = SimEnv::new(7);
    let (server, _) = serve_echo(&env, SECRET, TransportLimits::default()).await;
    let client = env.node(CLIENT, &secret(SECRET), TransportLimits::default());
    let wrong = client
        .connect_node(server.local_addr(), crate::NodeId(9))
        .await
        .unwrap_err();
    assert!(
        matches!(
            wrong,
            TransportError::WrongPeer {
                expected: crate::NodeId(9),
                got: crate::NodeId(SERVER)
            }
        ),
        "{wrong:?}"
    );
    assert!(client
        .connect_node(server.local_addr(), crate::NodeId(SERVER))
        .await
        .is_ok());
}

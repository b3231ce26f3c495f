//! Peers that break the rules, scripted byte by byte over the simulated network (the code
//! under test is the same on TCP), with paused time.

use super::env::*;
use crate::framed::FrameReader;
use crate::handshake::{client_handshake, server_handshake};
use crate::wire::frame::FrameKind;
use crate::wire::hello::Hello;
use crate::{
    handler_fn, Listener, ProtocolError, RemoteError, RequestId, ServerStats, Transport,
    TransportError, TransportLimits,
};
use bytes::{Bytes, BytesMut};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const SECRET: u8 = 1;

#[tokio::test(start_paused = true)]
async fn server_reads_no_more_requests_than_its_slots() {
    let env = SimEnv::new(11);
    let started = Started::default();
    let limits = TransportLimits {
        max_in_flight_requests: 2,
        ..TransportLimits::default()
    };
    let server = serve(&env, SECRET, limits.clone(), black_hole(started.clone())).await;
    // A client that ignores the negotiated limit of 2 and sends 5 requests at once.
    let client = env.node(CLIENT, &secret(SECRET), TransportLimits::default());
    let (mut reader, mut writer) = client.dial(server.local_addr()).await.unwrap();
    let negotiated = client_handshake(&mut reader, &mut writer, client.config(), 0)
        .await
        .unwrap();
    assert_eq!(negotiated.max_in_flight_requests, 2);
    for id in 1..=5 {
        writer
            .write_all(&frame_bytes(FrameKind::Request, id, b"more"))
            .await
            .unwrap();
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        started.get(),
        2,
        "the server ran more handlers than its slots"
    );
}

#[tokio::test(start_paused = true)]
async fn slow_handlers_on_every_slot_do_not_make_the_connection_idle() {
    let env = SimEnv::new(12);
    let limits = TransportLimits {
        max_in_flight_requests: 2,
        ..quick_limits()
    };
    let slow = 3 * limits.idle_timeout();
    let handler = handler_fn(move |_peer, request: Bytes| async move {
        tokio::time::sleep(slow).await;
        Ok::<_, RemoteError>(request)
    });
    let server = serve(&env, SECRET, limits.clone(), handler).await;
    let connection = connect(&env, &server, limits).await;
    let calls = (0..2u8).map(|i| connection.call(Bytes::from(vec![i]), 2 * slow));
    for (i, response) in (0..2u8).zip(futures_util::future::join_all(calls).await) {
        assert_eq!(response.unwrap(), Bytes::from(vec![i]));
    }
    assert_eq!(connection.close_reason(), None);
}

/// A connection to a server that completes the handshake, reads one request and answers
/// with `reply`.
async fn rogue_server(
    env: &SimEnv,
    reply: impl Fn(RequestId) -> BytesMut + Send + 'static,
) -> crate::Connection {
    let transport = env.node(SERVER, &secret(SECRET), TransportLimits::default());
    let mut listener = transport.bind(env.listen_addr(SERVER)).await.unwrap();
    let addr = listener.local_addr();
    tokio::spawn(async move {
        let (mut reader, mut writer, _) = listener.accept().await.unwrap();
        server_handshake(&mut reader, &mut writer, transport.config())
            .await
            .unwrap();
        let mut frames = FrameReader::new(reader, 1 << 20);
        let request = frames.next_frame().await.unwrap();
        writer.write_all(&reply(request.request_id)).await.unwrap();
        std::future::pending::<()>().await; // Keep the connection open.
    });
    let client = env.node(CLIENT, &secret(SECRET), TransportLimits::default());
    client.connect(addr).await.unwrap()
}

#[tokio::test(start_paused = true)]
async fn response_to_a_request_never_sent_closes_the_connection() {
    let env = SimEnv::new(13);
    let connection = rogue_server(&env, |id| {
        frame_bytes(FrameKind::Response, id.0 + 98, b"whose?")
    })
    .await;
    let failed = ask(&connection, b"hello").await.unwrap_err();
    let expected = ProtocolError::UnknownRequestId(RequestId(99));
    assert!(
        matches!(&failed, TransportError::Protocol(e) if *e == expected),
        "{failed:?}"
    );
    assert!(failed.is_connection_lost());
    assert!(connection.is_closed());
}

#[tokio::test(start_paused = true)]
async fn corrupted_response_fails_the_call_with_a_checksum_error() {
    let env = SimEnv::new(14);
    let connection = rogue_server(&env, |id| {
        let mut frame = frame_bytes(FrameKind::Response, id.0, b"flipped on the way");
        let last = frame.len() - 1;
        frame[last] ^= 0x20;
        frame
    })
    .await;
    let failed = ask(&connection, b"hello").await.unwrap_err();
    assert!(
        matches!(
            failed,
            TransportError::Protocol(ProtocolError::PayloadChecksum { .. })
        ),
        "{failed:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn silent_peer_is_dropped_after_the_handshake_timeout() {
    let env = SimEnv::new(15);
    let (server, _) = serve_echo(&env, SECRET, quick_limits()).await;
    let client = env.node(CLIENT, &secret(SECRET), quick_limits());
    let (mut reader, _writer) = client.dial(server.local_addr()).await.unwrap();
    let mut byte = [0u8; 1];
    let read = tokio::time::timeout(
        2 * quick_limits().handshake_timeout(),
        reader.read(&mut byte),
    )
    .await;
    assert_eq!(read.expect("the server kept a silent peer").unwrap(), 0);
    assert_eq!(ServerStats::get(&server.stats().handshakes_failed), 1);
}

#[tokio::test(start_paused = true)]
async fn hello_with_bad_magic_or_version_is_refused() {
    let env = SimEnv::new(16);
    let (server, _) = serve_echo(&env, SECRET, TransportLimits::default()).await;
    let client = env.node(CLIENT, &secret(SECRET), TransportLimits::default());
    let hello = Hello::for_test(CLIENT);
    let mut bad_magic = hello.encode();
    bad_magic[0..4].copy_from_slice(b"HTTP");
    let mut version_3 = hello.encode();
    version_3[4..6].copy_from_slice(&3u16.to_le_bytes());
    for (number, bytes) in [bad_magic, version_3].iter().enumerate() {
        let (mut reader, mut writer) = client.dial(server.local_addr()).await.unwrap();
        writer.write_all(bytes).await.unwrap();
        let mut reply = Vec::new();
        reader.read_to_end(&mut reply).await.unwrap();
        assert!(reply.is_empty(), "the server answered a bad hello");
        let failed = number as u64 + 1;
        eventually("the server counts it", || {
            ServerStats::get(&server.stats().handshakes_failed) == failed
        })
        .await;
    }
    assert_eq!(ServerStats::get(&server.stats().connections_accepted), 0);
}

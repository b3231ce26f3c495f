//! The behaviour every transport must show. Each test is generic over the network.

use super::env::*;
use crate::handshake::client_handshake;
use crate::wire::frame::{FrameKind, FRAME_HEADER_BYTES};
use crate::wire::hello::{Hello, HelloKind, HELLO_BYTES};
use crate::{
    handler_fn, CloseReason, NodeId, RemoteError, ServerStats, Transport, TransportError,
    TransportLimits,
};
use bytes::{Bytes, BytesMut};
use futures_util::future::join_all;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::Semaphore;

const SECRET: u8 = 1;
const OTHER_SECRET: u8 = 2;

pub async fn round_trip_many_concurrent_calls<E: Env>(env: &E) {
    let (server, started) = serve_echo(env, SECRET, TransportLimits::default()).await;
    let client = env.node(CLIENT, &secret(SECRET), TransportLimits::default());
    let connection = client.connect(server.local_addr()).await.unwrap();
    assert_eq!(connection.peer(), NodeId(SERVER));

    let requests: Vec<Bytes> = (0..500u32)
        .map(|i| Bytes::from(format!("request {i}").repeat(1 + i as usize % 7)))
        .collect();
    let calls = requests
        .iter()
        .map(|request| connection.call_default(request.clone()));
    let responses = join_all(calls).await;
    for (request, response) in requests.iter().zip(responses) {
        assert_eq!(response.unwrap(), echoed(request));
    }
    assert_eq!(started.get(), 500);
    assert_eq!(ServerStats::get(&server.stats().connections_accepted), 1);
}

pub async fn responses_out_of_order_reach_their_callers<E: Env>(env: &E) {
    // Request i answers only after request i + 1 has: the last sent is answered first, by
    // construction rather than by timing.
    const COUNT: u8 = 6;
    let finished = Arc::new(Mutex::new(Vec::new()));
    let order = Arc::clone(&finished);
    let turn = Arc::new(tokio::sync::watch::Sender::new(COUNT - 1));
    let handler = handler_fn(move |_peer, request: Bytes| {
        let (order, turn) = (Arc::clone(&order), Arc::clone(&turn));
        async move {
            let index = request[0];
            turn.subscribe()
                .wait_for(|&next| next == index)
                .await
                .unwrap();
            order.lock().unwrap().push(index);
            turn.send_replace(index.wrapping_sub(1));
            Ok::<_, RemoteError>(Bytes::from(vec![index, index]))
        }
    });
    let server = serve(env, SECRET, TransportLimits::default(), handler).await;
    let connection = connect(env, &server, TransportLimits::default()).await;

    let calls = (0..COUNT).map(|i| connection.call_default(Bytes::from(vec![i])));
    let responses = join_all(calls).await;
    for (i, response) in (0..COUNT).zip(responses) {
        assert_eq!(
            response.unwrap(),
            Bytes::from(vec![i, i]),
            "call {i} got another call's response"
        );
    }
    let order = finished.lock().unwrap().clone();
    assert_eq!(
        order,
        (0..COUNT).rev().collect::<Vec<_>>(),
        "responses were not sent out of order"
    );
}

fn failed_handshakes(stats: &ServerStats) -> u64 {
    ServerStats::get(&stats.handshakes_refused) + ServerStats::get(&stats.handshakes_failed)
}

pub async fn stranger_with_wrong_secret_is_refused<E: Env>(env: &E) {
    let (server, started) = serve_echo(env, SECRET, TransportLimits::default()).await;
    let stranger = env.node(CLIENT, &secret(OTHER_SECRET), TransportLimits::default());
    let refused = stranger.connect(server.local_addr()).await.unwrap_err();
    assert!(matches!(refused, TransportError::AuthFailed), "{refused:?}");
    eventually("the server counts the failed handshake", || {
        failed_handshakes(server.stats()) == 1
    })
    .await;
    assert_eq!(ServerStats::get(&server.stats().connections_accepted), 0);
    assert_eq!(started.get(), 0);
    // A member still gets in.
    let member = env.node(3, &secret(SECRET), TransportLimits::default());
    let connection = member.connect(server.local_addr()).await.unwrap();
    assert_eq!(ask(&connection, b"hi").await.unwrap(), echoed(b"hi"));
}

pub async fn impostor_server_is_refused<E: Env>(env: &E) {
    let (impostor, started) = serve_echo(env, OTHER_SECRET, TransportLimits::default()).await;
    let client = env.node(CLIENT, &secret(SECRET), TransportLimits::default());
    let refused = client.connect(impostor.local_addr()).await.unwrap_err();
    assert!(matches!(refused, TransportError::AuthFailed), "{refused:?}");
    assert_eq!(started.get(), 0);
}

pub async fn forged_client_proof_is_refused<E: Env>(env: &E) {
    let (server, started) = serve_echo(env, SECRET, TransportLimits::default()).await;
    let raw = env.node(CLIENT, &secret(OTHER_SECRET), TransportLimits::default());
    let (mut reader, mut writer) = raw.dial(server.local_addr()).await.unwrap();
    let hello = Hello::for_test(CLIENT);
    writer.write_all(&hello.encode()).await.unwrap();
    let mut server_hello = [0u8; HELLO_BYTES];
    reader.read_exact(&mut server_hello).await.unwrap();
    assert_eq!(
        Hello::decode(&server_hello).unwrap().kind,
        HelloKind::ServerHello
    );
    // A stranger cannot compute the proof; it sends something else, then a request.
    let forged = Hello {
        kind: HelloKind::ClientProof,
        mac: [0x5a; 32],
        lane: 0,
        ..hello
    };
    writer.write_all(&forged.encode()).await.unwrap();
    let request = frame_bytes(FrameKind::Request, 1, b"let me in");
    let _ = writer.write_all(&request).await;
    assert_closed_by_server(&mut reader).await;
    eventually("the server counts the refusal", || {
        ServerStats::get(&server.stats().handshakes_refused) == 1
    })
    .await;
    assert_eq!(started.get(), 0);
}

/// The server must close: the read ends (EOF or reset) instead of returning data or hanging.
async fn assert_closed_by_server(reader: &mut (impl tokio::io::AsyncRead + Unpin)) {
    let mut byte = [0u8; 1];
    let read = tokio::time::timeout(Duration::from_secs(3), reader.read(&mut byte)).await;
    match read.expect("server did not close the connection") {
        Ok(n) => assert_eq!(n, 0, "server sent data instead of closing"),
        Err(error) => assert!(
            matches!(error.kind(), std::io::ErrorKind::ConnectionReset),
            "{error}"
        ),
    }
}

/// Frames a server must refuse, each with the corruption a test applies after encoding.
fn bad_frames() -> Vec<(&'static str, BytesMut)> {
    let frame = |kind, payload| frame_bytes(kind, 1, payload);
    let reseal = |mut buf: BytesMut| {
        let crc = crc32c::crc32c(&buf[..20]);
        buf[20..24].copy_from_slice(&crc.to_le_bytes());
        buf
    };
    let mut payload_flip = frame(FrameKind::Request, b"tampered payload");
    payload_flip[FRAME_HEADER_BYTES + 3] ^= 0x04;
    let mut header_flip = frame(FrameKind::Request, b"tampered header");
    header_flip[10] ^= 0x01;
    let mut oversize = frame(FrameKind::Request, b"");
    oversize[4..8].copy_from_slice(&2048u32.to_le_bytes());
    let mut unknown_kind = frame(FrameKind::Request, b"?");
    unknown_kind[0] = 200;
    vec![
        ("payload bit flip", payload_flip),
        ("header bit flip", header_flip),
        ("oversize length", reseal(oversize)),
        ("unknown kind", reseal(unknown_kind)),
        (
            "response from a client",
            frame(FrameKind::Response, b"not yours to send"),
        ),
    ]
}

pub async fn bad_frames_close_the_connection<E: Env>(env: &E) {
    let started = Started::default();
    let limits = TransportLimits {
        max_frame_payload_bytes: 1024,
        ..TransportLimits::default()
    };
    let server = serve(env, SECRET, limits.clone(), echo(started.clone())).await;
    let client = env.node(CLIENT, &secret(SECRET), limits);
    let cases = bad_frames();
    for (number, (what, bytes)) in cases.iter().enumerate() {
        let (mut reader, mut writer) = client.dial(server.local_addr()).await.unwrap();
        client_handshake(&mut reader, &mut writer, client.config(), 0)
            .await
            .unwrap();
        writer.write_all(bytes).await.unwrap();
        assert_closed_by_server(&mut reader).await;
        let closed = number as u64 + 1;
        eventually(what, || {
            ServerStats::get(&server.stats().connections_closed) == closed
        })
        .await;
    }
    assert_eq!(started.get(), 0, "a handler ran on a bad frame");
}

pub async fn oversize_payload_is_refused_before_sending<E: Env>(env: &E) {
    let started = Started::default();
    let small = TransportLimits {
        max_frame_payload_bytes: 1024,
        ..TransportLimits::default()
    };
    let server = serve(env, SECRET, small, echo(started.clone())).await;
    let client = env.node(CLIENT, &secret(SECRET), TransportLimits::default());
    let connection = client.connect(server.local_addr()).await.unwrap();
    assert_eq!(
        connection.max_frame_payload_bytes(),
        1024,
        "the smaller side's limit applies"
    );
    let refused = connection
        .call_default(Bytes::from(vec![0; 1025]))
        .await
        .unwrap_err();
    assert!(
        matches!(
            refused,
            TransportError::PayloadTooLarge {
                len: 1025,
                max: 1024
            }
        ),
        "{refused:?}"
    );
    assert!(!refused.is_connection_lost());
    assert_eq!(started.get(), 0);
    // Still usable, up to the limit (the echo's answer must fit too: 6 bytes of prefix).
    let fits = Bytes::from(vec![7; 1018]);
    assert_eq!(
        connection.call_default(fits.clone()).await.unwrap(),
        echoed(&fits)
    );
    // A response over the limit comes back as an error, not a closed connection.
    let too_big = connection
        .call_default(Bytes::from(vec![7; 1024]))
        .await
        .unwrap_err();
    assert!(
        matches!(&too_big, TransportError::Remote(e) if e.code == RemoteError::RESPONSE_TOO_LARGE),
        "{too_big:?}"
    );
}

pub async fn in_flight_limit_makes_the_next_call_wait<E: Env>(env: &E) {
    const LIMIT: u32 = 4;
    let started = Started::default();
    let gate = Arc::new(Semaphore::new(0));
    let (counter, held) = (started.clone(), Arc::clone(&gate));
    let handler = handler_fn(move |_peer, request: Bytes| {
        counter.bump();
        let gate = Arc::clone(&held);
        async move {
            gate.acquire().await.unwrap().forget();
            Ok::<_, RemoteError>(request)
        }
    });
    let limits = TransportLimits {
        max_in_flight_requests: LIMIT,
        ..TransportLimits::default()
    };
    let server = serve(env, SECRET, limits.clone(), handler).await;
    let connection = connect(env, &server, limits).await;

    let calls: Vec<_> = (0..=LIMIT)
        .map(|i| {
            let connection = connection.clone();
            tokio::spawn(async move {
                connection
                    .call(
                        Bytes::from(vec![u8::try_from(i).unwrap()]),
                        Duration::from_secs(10),
                    )
                    .await
            })
        })
        .collect();
    eventually("the first calls reach the handler", || {
        started.get() == u64::from(LIMIT)
    })
    .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        started.get(),
        u64::from(LIMIT),
        "the call beyond the limit was sent"
    );
    assert_eq!(connection.in_flight(), LIMIT as usize);
    assert!(calls.iter().all(|call| !call.is_finished()));

    gate.add_permits(LIMIT as usize + 1);
    for (i, call) in calls.into_iter().enumerate() {
        assert_eq!(
            call.await.unwrap().unwrap(),
            Bytes::from(vec![u8::try_from(i).unwrap()])
        );
    }
    assert_eq!(started.get(), u64::from(LIMIT) + 1);
    assert_eq!(connection.in_flight(), 0);
}

pub async fn timed_out_call_leaves_connection_usable<E: Env>(env: &E) {
    let started = Started::default();
    let counter = started.clone();
    let handler = handler_fn(move |_peer, request: Bytes| {
        counter.bump();
        async move {
            if &request[..] == b"hang" {
                std::future::pending::<()>().await;
            }
            Ok::<_, RemoteError>(request)
        }
    });
    let server = serve(env, SECRET, TransportLimits::default(), handler).await;
    let connection = connect(env, &server, TransportLimits::default()).await;
    let timed_out = connection
        .call(Bytes::from_static(b"hang"), Duration::from_millis(100))
        .await
        .unwrap_err();
    assert!(
        matches!(timed_out, TransportError::Timeout { timeout_ms: 100 }),
        "{timed_out:?}"
    );
    assert!(!timed_out.is_connection_lost());
    assert_eq!(
        connection.in_flight(),
        0,
        "a timed-out call still holds its slot"
    );
    assert_eq!(
        ask(&connection, b"ok").await.unwrap(),
        Bytes::from_static(b"ok")
    );
    assert!(!connection.is_closed());
}

pub async fn peer_crash_fails_pending_calls_promptly<E: Env>(env: &E) {
    let started = Started::default();
    let server = serve(
        env,
        SECRET,
        TransportLimits::default(),
        black_hole(started.clone()),
    )
    .await;
    let connection = connect(env, &server, TransportLimits::default()).await;
    let calls: Vec<_> = (0..3u8)
        .map(|i| {
            let connection = connection.clone();
            tokio::spawn(async move {
                connection
                    .call(Bytes::from(vec![i]), Duration::from_secs(30))
                    .await
            })
        })
        .collect();
    eventually("the calls reach the handler", || started.get() == 3).await;
    let crashed_at = tokio::time::Instant::now();
    drop(server);
    for call in calls {
        let failed = tokio::time::timeout(Duration::from_secs(2), call)
            .await
            .expect("a pending call hung")
            .unwrap();
        assert!(
            matches!(failed, Err(TransportError::PeerClosed)),
            "{failed:?}"
        );
    }
    assert!(crashed_at.elapsed() < Duration::from_secs(2));
    assert_eq!(connection.close_reason(), Some(CloseReason::PeerClosed));
    let after = ask(&connection, b"x").await.unwrap_err();
    assert!(matches!(after, TransportError::PeerClosed), "{after:?}");
}

pub async fn handler_errors_and_panics_reach_the_caller<E: Env>(env: &E) {
    let handler = handler_fn(|_peer, request: Bytes| async move {
        match &request[..] {
            b"fail" => Err(RemoteError::new(7, "no such vdisk")),
            b"panic" => panic!("handler bug (expected by the test)"),
            _ => Ok(request),
        }
    });
    let server = serve(env, SECRET, TransportLimits::default(), handler).await;
    let connection = connect(env, &server, TransportLimits::default()).await;
    let failed = ask(&connection, b"fail").await.unwrap_err();
    assert!(
        matches!(&failed, TransportError::Remote(e) if *e == RemoteError::new(7, "no such vdisk")),
        "{failed:?}"
    );
    let panicked = ask(&connection, b"panic").await.unwrap_err();
    assert!(
        matches!(&panicked, TransportError::Remote(e) if e.code == RemoteError::HANDLER_PANICKED),
        "{panicked:?}"
    );
    assert_eq!(
        ask(&connection, b"fine").await.unwrap(),
        Bytes::from_static(b"fine")
    );
}

pub async fn quiet_connection_stays_open<E: Env>(env: &E) {
    let (server, _) = serve_echo(env, SECRET, quick_limits()).await;
    let connection = connect(env, &server, quick_limits()).await;
    // Longer than the idle timeout without a call: pings must keep both sides content.
    tokio::time::sleep(Duration::from_millis(2 * quick_limits().idle_timeout_ms)).await;
    assert_eq!(connection.close_reason(), None);
    assert_eq!(
        ask(&connection, b"still here").await.unwrap(),
        echoed(b"still here")
    );
    assert_eq!(ServerStats::get(&server.stats().connections_closed), 0);
}

pub async fn dropping_the_connection_closes_it_on_the_server<E: Env>(env: &E) {
    let (server, _) = serve_echo(env, SECRET, TransportLimits::default()).await;
    let connection = connect(env, &server, TransportLimits::default()).await;
    ask(&connection, b"x").await.unwrap();
    drop(connection);
    eventually("the server sees the close", || {
        ServerStats::get(&server.stats().connections_closed) == 1
    })
    .await;
}

pub async fn large_payloads_round_trip<E: Env>(env: &E) {
    const PAYLOAD_BYTES: usize = 3 << 20;
    let (server, started) = serve_echo(env, SECRET, TransportLimits::default()).await;
    let connection = connect(env, &server, TransportLimits::default()).await;
    let requests: Vec<Bytes> = (0..6u8)
        .map(|i| {
            Bytes::from(
                (0..PAYLOAD_BYTES)
                    .map(|at| (at as u8).wrapping_mul(i + 1))
                    .collect::<Vec<u8>>(),
            )
        })
        .collect();
    let calls = requests
        .iter()
        .map(|request| connection.call(request.clone(), Duration::from_secs(30)));
    for (request, response) in requests.iter().zip(join_all(calls).await) {
        assert_eq!(response.unwrap(), echoed(request));
    }
    assert_eq!(started.get(), 6);
}

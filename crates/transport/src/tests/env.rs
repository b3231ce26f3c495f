//! What the suite needs of a network, and helpers shared by the tests.

use crate::sim::SimNetwork;
use crate::wire::frame::{encode_frame, Frame, FrameKind};
use crate::RequestId;
use crate::{
    handler_fn, ClusterSecret, Handler, NodeId, RemoteError, Server, TcpTransport, Transport,
    TransportConfig, TransportLimits,
};
use bytes::{Bytes, BytesMut};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// A network on which the suite can start nodes.
pub trait Env {
    type T: Transport;
    fn node(&self, id: u64, secret: &ClusterSecret, limits: TransportLimits) -> Self::T;
    /// Where node `id` listens.
    fn listen_addr(&self, id: u64) -> SocketAddr;
}

pub struct TcpEnv;

impl Env for TcpEnv {
    type T = TcpTransport;

    fn node(&self, id: u64, secret: &ClusterSecret, limits: TransportLimits) -> TcpTransport {
        TcpTransport::new(TransportConfig::new(NodeId(id), secret.clone(), limits))
    }

    fn listen_addr(&self, _id: u64) -> SocketAddr {
        "127.0.0.1:0".parse().unwrap()
    }
}

pub struct SimEnv {
    pub network: SimNetwork,
}

impl SimEnv {
    pub fn new(seed: u64) -> SimEnv {
        SimEnv {
            network: SimNetwork::new(seed),
        }
    }
}

/// Node `id`'s address on the simulated network.
pub fn host(id: u64) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(10, 0, 0, u8::try_from(id).unwrap()))
}

impl Env for SimEnv {
    type T = crate::sim::SimTransport;

    fn node(&self, id: u64, secret: &ClusterSecret, limits: TransportLimits) -> Self::T {
        self.network.transport(
            host(id),
            TransportConfig::new(NodeId(id), secret.clone(), limits),
        )
    }

    fn listen_addr(&self, id: u64) -> SocketAddr {
        SocketAddr::new(host(id), 7000)
    }
}

pub const SERVER: u64 = 1;
pub const CLIENT: u64 = 2;

pub fn secret(byte: u8) -> ClusterSecret {
    ClusterSecret::new(vec![byte; 32]).unwrap()
}

/// Limits with short timers, so failures show within a test's patience.
pub fn quick_limits() -> TransportLimits {
    TransportLimits {
        request_timeout_ms: 2_000,
        handshake_timeout_ms: 1_000,
        ping_interval_ms: 100,
        idle_timeout_ms: 1_500,
        ..TransportLimits::default()
    }
}

/// Counts the requests a handler has started.
#[derive(Clone, Default)]
pub struct Started(Arc<AtomicU64>);

impl Started {
    pub fn bump(&self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }

    pub fn get(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

/// A handler that answers `reply:` + the request, counting requests in `started`.
pub fn echo(started: Started) -> impl Handler {
    handler_fn(move |_peer, request: Bytes| {
        started.bump();
        async move { Ok::<_, RemoteError>(Bytes::from([b"reply:".as_slice(), &request].concat())) }
    })
}

pub fn echoed(request: &[u8]) -> Bytes {
    Bytes::from([b"reply:".as_slice(), request].concat())
}

/// A handler that never answers.
pub fn black_hole(started: Started) -> impl Handler {
    handler_fn(move |_peer, _request: Bytes| {
        started.bump();
        std::future::pending::<Result<Bytes, RemoteError>>()
    })
}

pub async fn serve<E: Env>(
    env: &E,
    secret_byte: u8,
    limits: TransportLimits,
    handler: impl Handler,
) -> Server {
    let transport = env.node(SERVER, &secret(secret_byte), limits);
    transport
        .serve(env.listen_addr(SERVER), handler)
        .await
        .unwrap()
}

/// Waits until `condition` holds, for at most 5 s; panics with `what` otherwise.
pub async fn eventually(what: &str, condition: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while !condition() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting until {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A server of the echo handler, and its request count.
pub async fn serve_echo<E: Env>(
    env: &E,
    secret_byte: u8,
    limits: TransportLimits,
) -> (Server, Started) {
    let started = Started::default();
    (
        serve(env, secret_byte, limits, echo(started.clone())).await,
        started,
    )
}

/// Node `CLIENT`'s connection to `server`, with the suite's usual secret.
pub async fn connect<E: Env>(
    env: &E,
    server: &Server,
    limits: TransportLimits,
) -> crate::Connection {
    env.node(CLIENT, &secret(1), limits)
        .connect(server.local_addr())
        .await
        .unwrap()
}

/// One call with the default timeout.
pub async fn ask(
    connection: &crate::Connection,
    request: &'static [u8],
) -> Result<Bytes, crate::TransportError> {
    connection.call_default(Bytes::from_static(request)).await
}

/// The wire bytes of one frame.
pub fn frame_bytes(kind: FrameKind, id: u64, payload: &'static [u8]) -> BytesMut {
    let mut buf = BytesMut::new();
    encode_frame(
        &Frame::new(kind, RequestId(id), Bytes::from_static(payload)),
        &mut buf,
    );
    buf
}

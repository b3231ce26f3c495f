//! The handshake of `docs/node-protocol.md`: client hello, server hello with the server's
//! proof, client proof. Both sides are authenticated before either sends a frame.

use crate::auth::{fresh_nonce, prove, verify, Role};
use crate::config::TransportConfig;
use crate::error::{CloseReason, ProtocolError, TransportError};
use crate::ids::NodeId;
use crate::wire::hello::{Hello, HelloKind, HELLO_BYTES, MAC_BYTES, NONCE_BYTES};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// What both sides agreed on: each limit is the smaller of the two sides'.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Negotiated {
    pub peer: NodeId,
    pub max_frame_payload_bytes: u32,
    pub max_in_flight_requests: u32,
    /// The client's lane (0: none), see [`crate::wire::hello::Hello::lane`].
    pub lane: u8,
}

fn hello(kind: HelloKind, config: &TransportConfig, lane: u8) -> std::io::Result<Hello> {
    Ok(Hello {
        lane,
        kind,
        node_id: config.node_id,
        max_frame_payload_bytes: config.limits.max_frame_payload_bytes,
        max_in_flight_requests: config.limits.max_in_flight_requests,
        nonce: fresh_nonce()?,
        mac: [0; MAC_BYTES],
    })
}

fn negotiated(config: &TransportConfig, peer: &Hello, lane: u8) -> Negotiated {
    Negotiated {
        lane,
        peer: peer.node_id,
        max_frame_payload_bytes: config
            .limits
            .max_frame_payload_bytes
            .min(peer.max_frame_payload_bytes),
        max_in_flight_requests: config
            .limits
            .max_in_flight_requests
            .min(peer.max_in_flight_requests),
    }
}

fn io_error(error: &std::io::Error) -> TransportError {
    TransportError::from(CloseReason::from_io(error))
}

async fn send<W: AsyncWrite + Unpin>(stream: &mut W, hello: &Hello) -> Result<(), TransportError> {
    stream
        .write_all(&hello.encode())
        .await
        .map_err(|error| io_error(&error))?;
    stream.flush().await.map_err(|error| io_error(&error))
}

async fn receive<R: AsyncRead + Unpin>(
    stream: &mut R,
    expected: HelloKind,
) -> Result<Hello, TransportError> {
    let mut bytes = [0u8; HELLO_BYTES];
    stream
        .read_exact(&mut bytes)
        .await
        .map_err(|error| io_error(&error))?;
    let hello = Hello::decode(&bytes)?;
    if hello.kind != expected {
        return Err(ProtocolError::UnexpectedHelloKind {
            got: hello.kind.name(),
            expected: expected.name(),
        }
        .into());
    }
    Ok(hello)
}

async fn with_timeout<T>(
    config: &TransportConfig,
    work: impl std::future::Future<Output = Result<T, TransportError>>,
) -> Result<T, TransportError> {
    let timeout_ms = config.limits.handshake_timeout_ms;
    tokio::time::timeout(config.limits.handshake_timeout(), work)
        .await
        .unwrap_or(Err(TransportError::Timeout { timeout_ms }))
}

/// The connecting side's handshake, within the handshake timeout. `lane`: see
/// [`Hello::lane`].
pub async fn client_handshake(
    reader: &mut (impl AsyncRead + Unpin),
    writer: &mut (impl AsyncWrite + Unpin),
    config: &TransportConfig,
    lane: u8,
) -> Result<Negotiated, TransportError> {
    with_timeout(config, async {
        let client_hello = hello(HelloKind::ClientHello, config, lane)?;
        send(writer, &client_hello).await?;
        let server_hello = receive(reader, HelloKind::ServerHello).await?;
        if !verify(
            &config.secret,
            Role::Server,
            &client_hello,
            &server_hello,
            &server_hello.mac,
        ) {
            return Err(TransportError::AuthFailed);
        }
        let proof = Hello {
            kind: HelloKind::ClientProof,
            node_id: config.node_id,
            max_frame_payload_bytes: 0,
            max_in_flight_requests: 0,
            nonce: [0; NONCE_BYTES],
            mac: prove(&config.secret, Role::Client, &client_hello, &server_hello),
            lane: 0,
        };
        send(writer, &proof).await?;
        Ok(negotiated(config, &server_hello, lane))
    })
    .await
}

/// The accepting side's handshake, within the handshake timeout.
pub async fn server_handshake(
    reader: &mut (impl AsyncRead + Unpin),
    writer: &mut (impl AsyncWrite + Unpin),
    config: &TransportConfig,
) -> Result<Negotiated, TransportError> {
    with_timeout(config, async {
        let client_hello = receive(reader, HelloKind::ClientHello).await?;
        let mut server_hello = hello(HelloKind::ServerHello, config, 0)?;
        server_hello.mac = prove(&config.secret, Role::Server, &client_hello, &server_hello);
        send(writer, &server_hello).await?;
        let proof = receive(reader, HelloKind::ClientProof).await?;
        if proof.node_id != client_hello.node_id {
            return Err(ProtocolError::NodeIdChanged {
                hello: client_hello.node_id.0,
                proof: proof.node_id.0,
            }
            .into());
        }
        if !verify(
            &config.secret,
            Role::Client,
            &client_hello,
            &server_hello,
            &proof.mac,
        ) {
            return Err(TransportError::AuthFailed);
        }
        Ok(negotiated(config, &client_hello, client_hello.lane))
    })
    .await
}

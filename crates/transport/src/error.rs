//! Typed errors. A decoder or a connection never panics on what a peer sends: every bad input
//! is a [`ProtocolError`] that closes the connection.

use crate::ids::{NodeId, RequestId};
use std::io;
use std::sync::Arc;

/// What a peer sent that breaks `docs/node-protocol.md`. Each closes the connection.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtocolError {
    #[error("bad magic {got:#010x} (not an Ashlar node-to-node connection)")]
    BadMagic { got: u32 },
    #[error(
        "unsupported protocol version {got} (this node speaks {}): every node of a cluster must run the same protocol version",
        crate::wire::PROTOCOL_VERSION
    )]
    UnsupportedVersion { got: u16 },
    #[error(
        "handshake message checksum mismatch: stored {stored:#010x}, computed {computed:#010x}"
    )]
    HelloChecksum { stored: u32, computed: u32 },
    #[error("frame header checksum mismatch: stored {stored:#010x}, computed {computed:#010x}")]
    HeaderChecksum { stored: u32, computed: u32 },
    #[error("frame {request_id} payload checksum mismatch: stored {stored:#010x}, computed {computed:#010x}")]
    PayloadChecksum {
        request_id: RequestId,
        stored: u32,
        computed: u32,
    },
    #[error("frame payload of {len} bytes exceeds the limit of {max} bytes")]
    FrameTooLarge { len: u32, max: u32 },
    #[error("unknown frame kind {0}")]
    UnknownFrameKind(u8),
    #[error("unknown handshake message kind {0}")]
    UnknownHelloKind(u8),
    #[error("unknown flags {0:#04x}")]
    UnknownFlags(u8),
    #[error("reserved field is {0:#x}, must be 0")]
    NonZeroReserved(u64),
    #[error("{kind} frame not allowed from this side of the connection")]
    UnexpectedFrameKind { kind: &'static str },
    #[error("handshake message {got} where {expected} was expected")]
    UnexpectedHelloKind {
        got: &'static str,
        expected: &'static str,
    },
    #[error("{kind} frame with request id 0")]
    ZeroRequestId { kind: &'static str },
    #[error("response to request {0}, which was never sent")]
    UnknownRequestId(RequestId),
    #[error("{kind} frame must have an empty payload, has {len} bytes")]
    NonEmptyPayload { kind: &'static str, len: u32 },
    #[error("error frame payload of {len} bytes is shorter than its 4-byte code")]
    ShortErrorPayload { len: usize },
    #[error("handshake field {field} is {got}, must be in {min}..={max}")]
    HelloFieldOutOfRange {
        field: &'static str,
        got: u64,
        min: u64,
        max: u64,
    },
    #[error("client proof names node {proof}, its hello named node {hello}")]
    NodeIdChanged { hello: u64, proof: u64 },
}

/// Why a connection ended. Cloned into the error of every call it fails.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CloseReason {
    /// The peer closed the connection (EOF, reset, broken pipe): it crashed, restarted or
    /// dropped the connection.
    #[error("peer closed the connection")]
    PeerClosed,
    /// Nothing arrived (or no write progressed) for the idle timeout.
    #[error("peer unresponsive for {idle_ms} ms")]
    Idle { idle_ms: u64 },
    #[error("protocol violation: {0}")]
    Protocol(ProtocolError),
    /// Any other I/O error, as its kind and message (so it can be cloned to every caller).
    #[error("i/o error ({kind:?}): {message}")]
    Io {
        kind: io::ErrorKind,
        message: String,
    },
    /// Every handle of this connection was dropped.
    #[error("connection closed locally")]
    Local,
}

impl CloseReason {
    pub(crate) fn from_io(error: &io::Error) -> CloseReason {
        use io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset, UnexpectedEof};
        match error.kind() {
            BrokenPipe | ConnectionAborted | ConnectionReset | UnexpectedEof => {
                CloseReason::PeerClosed
            }
            kind => CloseReason::Io {
                kind,
                message: error.to_string(),
            },
        }
    }
}

/// An error a server's handler returned for one request, carried back in an error frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("remote error {code}: {message}")]
pub struct RemoteError {
    /// Meaning chosen by the layer above, except [`RemoteError::HANDLER_PANICKED`].
    pub code: u32,
    pub message: String,
}

impl RemoteError {
    /// The server's handler panicked on this request.
    pub const HANDLER_PANICKED: u32 = u32::MAX;
    /// The server's handler answered with more bytes than the connection's frame limit.
    pub const RESPONSE_TOO_LARGE: u32 = u32::MAX - 1;

    pub fn new(code: u32, message: impl Into<String>) -> RemoteError {
        RemoteError {
            code,
            message: message.into(),
        }
    }
}

/// The error of a transport operation.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// The call (or handshake) did not finish within its timeout. The connection stays usable;
    /// a late response is discarded.
    #[error("timed out after {timeout_ms} ms")]
    Timeout { timeout_ms: u64 },
    /// The connection ended (see [`CloseReason::PeerClosed`]); reconnect to go on.
    #[error("peer closed the connection")]
    PeerClosed,
    /// Nothing arrived from the peer for the idle timeout; the connection was closed.
    #[error("peer unresponsive for {idle_ms} ms; connection closed")]
    PeerUnresponsive { idle_ms: u64 },
    /// The peer could not prove it holds the cluster secret (or we could not prove it to the
    /// peer): it is not a member of this cluster.
    #[error("authentication failed: peer does not hold this cluster's secret")]
    AuthFailed,
    /// The peer broke the protocol; the connection was closed.
    #[error("protocol violation: {0}")]
    Protocol(#[from] ProtocolError),
    #[error("i/o error: {0}")]
    Io(Arc<io::Error>),
    /// The payload is larger than this connection's frame limit; nothing was sent and the
    /// connection stays usable.
    #[error("payload of {len} bytes exceeds the connection's frame limit of {max} bytes")]
    PayloadTooLarge { len: usize, max: u32 },
    /// The node at the address is not the one the caller expected; the connection was
    /// closed.
    #[error("expected {expected} at this address, found {got}")]
    WrongPeer { expected: NodeId, got: NodeId },
    /// The server's handler answered with an error.
    #[error(transparent)]
    Remote(#[from] RemoteError),
    /// The connection closed for a reason other than the above.
    #[error("connection closed: {0}")]
    Closed(CloseReason),
}

impl TransportError {
    /// True when the connection is gone and the caller must reconnect to go on.
    pub fn is_connection_lost(&self) -> bool {
        !matches!(
            self,
            TransportError::Timeout { .. }
                | TransportError::PayloadTooLarge { .. }
                | TransportError::Remote(_)
        )
    }
}

impl From<io::Error> for TransportError {
    fn from(error: io::Error) -> Self {
        TransportError::Io(Arc::new(error))
    }
}

impl From<CloseReason> for TransportError {
    fn from(reason: CloseReason) -> Self {
        match reason {
            CloseReason::PeerClosed => TransportError::PeerClosed,
            CloseReason::Idle { idle_ms } => TransportError::PeerUnresponsive { idle_ms },
            CloseReason::Protocol(error) => TransportError::Protocol(error),
            other => TransportError::Closed(other),
        }
    }
}

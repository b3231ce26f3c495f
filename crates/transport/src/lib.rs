//! Node-to-node messaging for Ashlar: opaque request and response payloads between the nodes
//! of one cluster, over a versioned binary protocol (`docs/node-protocol.md`) whose every
//! connection is authenticated with the cluster secret.
//!
//! Connections are one-way: the side that connects calls ([`Connection::call`]), the side that
//! accepts serves (a [`Handler`]). Two nodes that call each other hold two connections. This
//! keeps the flow control simple and free of deadlock: a client always reads its responses,
//! so a server's writes always drain.
//!
//! ```no_run
//! # async fn example() -> Result<(), ashlar_transport::TransportError> {
//! use ashlar_transport::*;
//! use bytes::Bytes;
//! let secret = ClusterSecret::new(*b"a secret of 16 bytes or more").unwrap();
//! let server = TcpTransport::new(TransportConfig::new(NodeId(1), secret.clone(), TransportLimits::default()));
//! let serving = server
//!     .serve("127.0.0.1:0".parse().unwrap(), handler_fn(|_peer, request: Bytes| async move { Ok(request) }))
//!     .await?;
//! let client = TcpTransport::new(TransportConfig::new(NodeId(2), secret, TransportLimits::default()));
//! let connection = client.connect(serving.local_addr()).await?;
//! let echo = connection.call_default(Bytes::from_static(b"ping")).await?;
//! assert_eq!(echo, "ping");
//! # Ok(()) }
//! ```

pub mod auth;
mod client;
mod config;
pub mod error;
pub mod faults;
mod framed;
mod handshake;
pub mod ids;
pub mod limits;
mod rng;
mod server;
#[cfg(any(test, feature = "sim"))]
pub mod sim;
mod task;
mod tcp;
mod transport;
pub mod wire;

pub use auth::ClusterSecret;
pub use client::Connection;
pub use config::TransportConfig;
pub use error::{CloseReason, ProtocolError, RemoteError, TransportError};
pub use faults::{LinkFaults, OutgoingFaults};
pub use ids::{NodeId, RequestId};
pub use limits::TransportLimits;
pub use server::{handler_fn, FnHandler, Handler, LanePlacer, PlacedServing, Server, ServerStats};
pub use tcp::{TcpListener, TcpTransport, TcpWriter};
pub use transport::{Listener, Transport};

#[cfg(test)]
mod tests;

//! The seam between the protocol and the network: [`Transport`] dials and binds byte streams;
//! everything above (handshake, frames, calls, serving) is the same code on every network.

use crate::client::Connection;
use crate::config::TransportConfig;
use crate::error::TransportError;
use crate::handshake::client_handshake;
use crate::ids::NodeId;
use crate::server::{Handler, LanePlacer, Server};
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncWrite};

/// A network a node can reach its peers on: real TCP ([`crate::TcpTransport`]) or, in tests,
/// a simulated one (`SimTransport`, feature `sim`).
pub trait Transport: Send + Sync + 'static {
    type Reader: AsyncRead + Unpin + Send + 'static;
    type Writer: AsyncWrite + Unpin + Send + 'static;
    type Listener: Listener<Reader = Self::Reader, Writer = Self::Writer>;

    /// This node's identity and limits.
    fn config(&self) -> &TransportConfig;

    /// Opens a byte stream to `addr`, split into its halves.
    fn dial(
        &self,
        addr: SocketAddr,
    ) -> impl Future<Output = io::Result<(Self::Reader, Self::Writer)>> + Send;

    /// Listens at `addr` (port 0: any free port).
    fn bind(&self, addr: SocketAddr) -> impl Future<Output = io::Result<Self::Listener>> + Send;

    /// Connects to the node serving at `addr` and authenticates both ways, all within the
    /// handshake timeout. The returned connection calls; the peer serves.
    fn connect(
        &self,
        addr: SocketAddr,
    ) -> impl Future<Output = Result<Connection, TransportError>> + Send {
        self.connect_on_lane(addr, 0)
    }

    /// [`Transport::connect`] for the caller's `lane` (its reactor, + 1; 0: none), which the
    /// peer may serve on the matching one of its own (see [`LanePlacer`]). The connection's
    /// tasks run on the caller's runtime.
    fn connect_on_lane(
        &self,
        addr: SocketAddr,
        lane: u8,
    ) -> impl Future<Output = Result<Connection, TransportError>> + Send {
        async move {
            let limits = &self.config().limits;
            let timeout_ms = limits.handshake_timeout_ms;
            let (mut reader, mut writer) =
                tokio::time::timeout(limits.handshake_timeout(), self.dial(addr))
                    .await
                    .map_err(|_| TransportError::Timeout { timeout_ms })??;
            let negotiated =
                client_handshake(&mut reader, &mut writer, self.config(), lane).await?;
            Ok(Connection::start(reader, writer, negotiated, limits))
        }
    }

    /// [`Transport::connect`], and then checks that the peer is the node `expected`: an
    /// address can outlive the node that advertised it (a replacement node may listen there
    /// now). The connection is closed on a mismatch.
    fn connect_node(
        &self,
        addr: SocketAddr,
        expected: NodeId,
    ) -> impl Future<Output = Result<Connection, TransportError>> + Send {
        self.connect_node_on_lane(addr, expected, 0)
    }

    /// [`Transport::connect_node`] for the caller's `lane` ([`Transport::connect_on_lane`]).
    fn connect_node_on_lane(
        &self,
        addr: SocketAddr,
        expected: NodeId,
        lane: u8,
    ) -> impl Future<Output = Result<Connection, TransportError>> + Send {
        async move {
            let connection = self.connect_on_lane(addr, lane).await?;
            let got = connection.peer();
            if got != expected {
                return Err(TransportError::WrongPeer { expected, got });
            }
            Ok(connection)
        }
    }

    /// Listens at `addr` and serves every authenticated connection with `handler`, until the
    /// returned [`Server`] is dropped.
    fn serve<H: Handler>(
        &self,
        addr: SocketAddr,
        handler: H,
    ) -> impl Future<Output = Result<Server, TransportError>> + Send {
        self.serve_placed(addr, handler, None)
    }

    /// [`Transport::serve`], handing each connection that names a lane to `placer` if any.
    fn serve_placed<H: Handler>(
        &self,
        addr: SocketAddr,
        handler: H,
        placer: Option<Arc<dyn LanePlacer>>,
    ) -> impl Future<Output = Result<Server, TransportError>> + Send {
        async move {
            let listener = self.bind(addr).await?;
            let config = self.config().clone();
            Ok(Server::spawn(listener, config, handler, placer))
        }
    }
}

/// A bound listener of a [`Transport`].
pub trait Listener: Send + 'static {
    type Reader: AsyncRead + Unpin + Send + 'static;
    type Writer: AsyncWrite + Unpin + Send + 'static;

    fn local_addr(&self) -> SocketAddr;

    /// The next incoming stream and its remote address. Must be cancel-safe: the server
    /// selects it against other work.
    fn accept(
        &mut self,
    ) -> impl Future<Output = io::Result<(Self::Reader, Self::Writer, SocketAddr)>> + Send;

    /// An accepted connection, detached from the runtime it was accepted on so that another
    /// runtime can serve it.
    type Portable: Send + 'static;

    /// Detaches an accepted connection (an error closes it).
    fn detach(reader: Self::Reader, writer: Self::Writer) -> io::Result<Self::Portable>;

    /// Attaches a detached connection to the current runtime.
    fn attach(portable: Self::Portable) -> io::Result<(Self::Reader, Self::Writer)>;
}

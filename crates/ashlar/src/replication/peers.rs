//! Connections to the other nodes: one [`Peer`] per node this node replicates to, holding a
//! connection that is made on first use and made again after it closed.

use arc_swap::ArcSwapOption;
use ashlar_cluster::NodeId;
use ashlar_core::VdiskId;
use ashlar_transport::{Connection, TcpTransport, Transport, TransportError};
use bytes::Bytes;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The transport's id for a cluster node: the low 64 bits of its 128-bit id. A collision of
/// two random ids is as good as impossible, and a connection checks the peer's id anyway.
pub fn transport_id(node: NodeId) -> ashlar_transport::NodeId {
    ashlar_transport::NodeId(node.value() as u64)
}

/// One other node, reached at its advertised node address.
pub struct Peer {
    node: NodeId,
    address: SocketAddr,
    transport: Arc<TcpTransport>,
    /// Connections are made on the control runtime, whose tasks then serve them: never on a
    /// reactor, whose thread belongs to its shards.
    control: tokio::runtime::Handle,
    connection: ArcSwapOption<Connection>,
    /// Whether the last call failed: the log says so when this changes, not per call.
    failing: AtomicBool,
}

impl Peer {
    /// Logs the first failure after a success (and the first success after failures).
    pub fn note_outcome(&self, vdisk: VdiskId, error: Option<&TransportError>) {
        let failing = error.is_some();
        if self.failing.swap(failing, Ordering::Relaxed) == failing {
            return;
        }
        match error {
            Some(error) => tracing::warn!(node = %self.node, address = %self.address, %vdisk,
                %error, "replica node did not take the write; writes to its vdisks fail until it does"),
            None => tracing::info!(node = %self.node, address = %self.address, %vdisk,
                "replica node takes writes again"),
        }
    }

    pub fn node(&self) -> NodeId {
        self.node
    }

    /// One request and its response, connecting first if there is no open connection.
    pub async fn call(&self, payload: Bytes, timeout: Duration) -> Result<Bytes, TransportError> {
        let connection = match self.connection.load_full() {
            Some(connection) if !connection.is_closed() => connection,
            _ => self.connect().await?,
        };
        connection.call(payload, timeout).await
    }

    async fn connect(&self) -> Result<Arc<Connection>, TransportError> {
        let (transport, address, expected) = (
            self.transport.clone(),
            self.address,
            transport_id(self.node),
        );
        let connected = self
            .control
            .spawn(async move { transport.connect_node(address, expected).await })
            .await
            .map_err(|e| TransportError::Io(Arc::new(std::io::Error::other(e.to_string()))))??;
        let connection = Arc::new(connected);
        self.connection.store(Some(connection.clone()));
        Ok(connection)
    }
}

/// The node's peers by id. Looked up when a vdisk is claimed, never per I/O.
pub struct Peers {
    transport: Arc<TcpTransport>,
    control: tokio::runtime::Handle,
    known: Mutex<HashMap<NodeId, Arc<Peer>>>,
}

impl Peers {
    pub fn new(transport: Arc<TcpTransport>) -> Peers {
        Peers {
            transport,
            control: tokio::runtime::Handle::current(),
            known: Mutex::new(HashMap::new()),
        }
    }

    /// The peer for `node` at `address` (a new one if the node moved to another address).
    pub fn peer(&self, node: NodeId, address: SocketAddr) -> Arc<Peer> {
        let mut known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(peer) = known.get(&node) {
            if peer.address == address {
                return peer.clone();
            }
        }
        let peer = Arc::new(Peer {
            node,
            address,
            transport: self.transport.clone(),
            control: self.control.clone(),
            connection: ArcSwapOption::empty(),
            failing: AtomicBool::new(false),
        });
        known.insert(node, peer.clone());
        peer
    }
}

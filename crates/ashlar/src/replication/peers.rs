//! Connections to the other nodes: one [`Peer`] per node this node replicates to, holding a
//! connection that is made on first use and made again after it closed.
//!
//! A call made on a reactor (a shard's replicated record, a repair read) goes over that
//! reactor's own connection to the peer, served by tasks on the reactor: the record leaves
//! and its answer comes back on the thread that waits for it. Through the control runtime
//! instead, every record woke the control thread to send it and woke the reactor again with
//! the answer: a third of the owner's CPU per replicated write at QD1
//! (bench/results/20261127-021500-vm). Calls made elsewhere use the control runtime's
//! connection.

use arc_swap::ArcSwapOption;
use ashlar_cluster::NodeId;
use ashlar_core::VdiskId;
use ashlar_transport::{Connection, TcpTransport, Transport, TransportError};
use bytes::Bytes;
use std::cell::RefCell;
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
    /// The connection for calls made off the reactors is made on the control runtime, whose
    /// tasks then serve it (a caller's runtime may be short-lived: a test's, a tool's).
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

    /// One request and its response, connecting first if there is no open connection (on a
    /// reactor: no open connection of that reactor).
    pub async fn call(&self, payload: Bytes, timeout: Duration) -> Result<Bytes, TransportError> {
        let connection = if let Some(reactor) = ashlar_engine::reactor::current_reactor() {
            self.reactor_connection(reactor).await?
        } else {
            match self.connection.load_full() {
                Some(connection) if !connection.is_closed() => connection,
                _ => self.connect().await?,
            }
        };
        connection.call(payload, timeout).await
    }

    /// This reactor's connection to the peer, made here (its tasks run on this reactor) if
    /// there is none open. Two calls that find none at once may both connect; the later
    /// stays, the other closes once its call is done.
    async fn reactor_connection(
        &self,
        reactor: ashlar_engine::reactor::ReactorId,
    ) -> Result<Arc<Connection>, TransportError> {
        let key = self.reactor_key();
        let open = REACTOR_CONNECTIONS.with(|connections| {
            connections
                .borrow()
                .get(&key)
                .filter(|connection| !connection.is_closed())
                .cloned()
        });
        if let Some(connection) = open {
            return Ok(connection);
        }
        let connection = Arc::new(
            self.transport
                .connect_node_on_lane(self.address, transport_id(self.node), lane(reactor))
                .await?,
        );
        REACTOR_CONNECTIONS.with(|connections| {
            let mut connections = connections.borrow_mut();
            connections.retain(|_, connection| !connection.is_closed());
            connections.insert(key, connection.clone());
        });
        Ok(connection)
    }

    fn reactor_key(&self) -> ReactorConnectionKey {
        (self.transport.config().node_id, self.node, self.address)
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

/// The lane a reactor's connections name: the peer serves them on its reactor of the same
/// index (modulo its count), which runs the same shards of a vdisk if both nodes have as
/// many reactors (a shard's reactor is `vdisk + shard`).
pub fn lane(reactor: ashlar_engine::reactor::ReactorId) -> u8 {
    (reactor.0 % usize::from(u8::MAX)) as u8 + 1
}

/// A reactor's connection: from which local node (a test process may run several), to which
/// node, at which address.
type ReactorConnectionKey = (ashlar_transport::NodeId, NodeId, SocketAddr);

thread_local! {
    /// The connections of the reactor running on this thread, made and used only here.
    static REACTOR_CONNECTIONS: RefCell<HashMap<ReactorConnectionKey, Arc<Connection>>> =
        RefCell::new(HashMap::new());
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

#[cfg(test)]
mod tests {
    use super::*;
    use ashlar_engine::reactor::{ReactorId, ReactorPool};
    use ashlar_transport::{
        handler_fn, ClusterSecret, ServerStats, TransportConfig, TransportLimits,
    };

    fn transport(node: u64) -> Arc<TcpTransport> {
        let secret = ClusterSecret::new(vec![7; 32]).unwrap();
        let id = ashlar_transport::NodeId(node);
        Arc::new(TcpTransport::new(TransportConfig::new(
            id,
            secret,
            TransportLimits::default(),
        )))
    }

    /// Places connections that name a lane on the pool's reactor of that lane.
    struct OnPool(Arc<ReactorPool>);

    impl ashlar_transport::LanePlacer for OnPool {
        fn place(&self, lane: u8, serving: ashlar_transport::PlacedServing) {
            let reactor = self.0.get(ReactorId(usize::from(lane)));
            reactor.spawn_detached(serving).unwrap();
        }
    }

    /// Answers where it ran: on a reactor or not. On a reactor it runs as a local task (as
    /// the engine's code expects there): `spawn_local` works.
    async fn where_served(
        _peer: ashlar_transport::NodeId,
        _request: Bytes,
    ) -> Result<Bytes, ashlar_transport::RemoteError> {
        let reactor = ashlar_engine::reactor::current_reactor();
        if reactor.is_some() {
            tokio::task::spawn_local(async {}).await.unwrap();
        }
        Ok(Bytes::from(format!("{:?}", reactor.map(|r| r.0))))
    }

    /// Calls made on a reactor go over that reactor's own connection, made once and served
    /// by the peer on its reactor of the same lane; calls made elsewhere share the control
    /// runtime's connection, which the peer serves on its own runtime.
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn a_reactor_calls_over_its_own_connection_served_on_the_peers_reactor() {
        let copy = NodeId::new(2).unwrap();
        let copy_reactors = Arc::new(ReactorPool::start(2, Duration::ZERO, &[]).unwrap());
        let server = transport(transport_id(copy).0)
            .serve_placed(
                "127.0.0.1:0".parse().unwrap(),
                handler_fn(where_served),
                Some(Arc::new(OnPool(copy_reactors.clone()))),
            )
            .await
            .unwrap();
        let accepted = || ServerStats::get(&server.stats().connections_accepted);
        let placed = || ServerStats::get(&server.stats().connections_placed);
        let peer = Peers::new(transport(1)).peer(copy, server.local_addr());
        let timeout = Duration::from_secs(5);

        for _ in 0..2 {
            let answer = peer.call(Bytes::new(), timeout).await.unwrap();
            assert_eq!(
                answer,
                Bytes::from_static(b"None"),
                "served off the reactors"
            );
        }
        assert_eq!(
            accepted(),
            1,
            "the control runtime's calls share one connection"
        );
        assert_eq!(
            placed(),
            0,
            "a connection that names no lane stays where it was accepted"
        );

        let pool = ReactorPool::start(2, Duration::ZERO, &[]).unwrap();
        for reactor in [1, 0] {
            let on_reactor = peer.clone();
            let answers = pool
                .get(ReactorId(reactor))
                .run(move || async move {
                    let mut answers = Vec::new();
                    for _ in 0..3 {
                        answers.push(on_reactor.call(Bytes::new(), timeout).await);
                    }
                    answers
                })
                .await
                .unwrap();
            for answer in answers {
                let expected = format!("Some({reactor})");
                assert_eq!(
                    answer.unwrap(),
                    Bytes::from(expected),
                    "served on the same lane"
                );
            }
        }
        assert_eq!(
            accepted(),
            3,
            "each reactor made one connection of its own and kept it"
        );
        assert_eq!(placed(), 2, "both were served on the peer's reactors");
        let answer = peer.call(Bytes::new(), timeout).await;
        assert_eq!(answer.unwrap(), Bytes::from_static(b"None"));
        assert_eq!(
            accepted(),
            3,
            "the control runtime's connection is still the one used"
        );
        drop(server);
        pool.stop();
        if let Ok(reactors) = Arc::try_unwrap(copy_reactors) {
            reactors.stop();
        }
    }
}

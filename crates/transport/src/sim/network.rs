//! The simulated network: links with faults, listeners, and the transport that uses them.

use super::pipe::{Pipe, SimReader, SimWriter};
use crate::config::TransportConfig;
use crate::faults::{Fate, LinkFaults, MILLION};
use crate::rng::SplitMix64;
use crate::transport::{Listener, Transport};
use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;
use tokio::sync::mpsc;

/// Connections a listener holds before its server accepts them; beyond, connects are
/// refused, as a full kernel backlog would.
const BACKLOG_CONNECTIONS: usize = 128;
/// First port handed out for port 0 and for the client end of connections.
const FIRST_EPHEMERAL_PORT: u16 = 40_000;
type Incoming = (SimReader, SimWriter, SocketAddr);

struct NetState {
    rng: SplitMix64,
    links: HashMap<(IpAddr, IpAddr), LinkFaults>,
    listeners: HashMap<SocketAddr, mpsc::Sender<Incoming>>,
    /// Every live pipe, to reset connections between two hosts.
    pipes: Vec<Weak<Pipe>>,
    next_port: u16,
    segments_dropped: u64,
}

/// The network; cheap to clone (all clones are one network).
#[derive(Clone)]
pub struct SimNetwork {
    state: Arc<Mutex<NetState>>,
}

impl std::fmt::Debug for SimNetwork {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SimNetwork")
    }
}

impl SimNetwork {
    /// A network without faults whose random choices follow from `seed`.
    pub fn new(seed: u64) -> SimNetwork {
        let state = NetState {
            rng: SplitMix64::new(seed),
            links: HashMap::new(),
            listeners: HashMap::new(),
            pipes: Vec::new(),
            next_port: FIRST_EPHEMERAL_PORT,
            segments_dropped: 0,
        };
        SimNetwork {
            state: Arc::new(Mutex::new(state)),
        }
    }

    fn lock(&self) -> MutexGuard<'_, NetState> {
        self.state.lock().expect("sim network lock poisoned")
    }

    /// The transport of the node at `host`.
    pub fn transport(&self, host: IpAddr, config: TransportConfig) -> SimTransport {
        config.limits.assert_valid();
        SimTransport {
            network: self.clone(),
            host,
            config,
        }
    }

    /// Changes the faults of the direction `from` → `to`.
    pub fn update_link(&self, from: IpAddr, to: IpAddr, change: impl FnOnce(&mut LinkFaults)) {
        change(self.lock().links.entry((from, to)).or_default());
    }

    /// Delays every segment `from` → `to` by `delay` plus up to `jitter`.
    pub fn set_delay(&self, from: IpAddr, to: IpAddr, delay: Duration, jitter: Duration) {
        self.update_link(from, to, |link| {
            link.delay = delay;
            link.jitter = jitter;
        });
    }

    /// Loses segments `from` → `to` at this rate.
    pub fn set_loss(&self, from: IpAddr, to: IpAddr, loss_per_million: u32) {
        assert!(
            u64::from(loss_per_million) <= MILLION,
            "loss rate {loss_per_million} ppm above 100 %"
        );
        self.update_link(from, to, |link| link.loss_per_million = loss_per_million);
    }

    /// Cuts (or restores) the direction `from` → `to` only.
    pub fn set_cut(&self, from: IpAddr, to: IpAddr, cut: bool) {
        self.update_link(from, to, |link| link.cut = cut);
    }

    /// Cuts both directions between `a` and `b`.
    pub fn partition(&self, a: IpAddr, b: IpAddr) {
        self.set_cut(a, b, true);
        self.set_cut(b, a, true);
    }

    /// Restores both directions between `a` and `b` (delay and loss stay as set).
    pub fn heal(&self, a: IpAddr, b: IpAddr) {
        self.set_cut(a, b, false);
        self.set_cut(b, a, false);
    }

    /// Resets every open connection between `a` and `b`: both ends fail with ECONNRESET.
    pub fn reset_connections(&self, a: IpAddr, b: IpAddr) {
        let mut state = self.lock();
        state.pipes.retain(|pipe| pipe.strong_count() > 0);
        for pipe in state.pipes.iter().filter_map(Weak::upgrade) {
            if (pipe.from, pipe.to) == (a, b) || (pipe.from, pipe.to) == (b, a) {
                pipe.reset();
            }
        }
    }

    /// Segments lost to cuts and loss so far.
    pub fn segments_dropped(&self) -> u64 {
        self.lock().segments_dropped
    }

    pub(crate) fn fate(&self, from: IpAddr, to: IpAddr) -> Fate {
        let mut state = self.lock();
        let link = state.links.get(&(from, to)).copied().unwrap_or_default();
        let fate = link.fate(&mut state.rng);
        if matches!(fate, Fate::Drop) {
            state.segments_dropped += 1;
        }
        fate
    }

    fn next_port(state: &mut NetState) -> u16 {
        let port = state.next_port;
        state.next_port = state
            .next_port
            .checked_add(1)
            .expect("sim network ran out of ports");
        port
    }

    fn dial(&self, from: IpAddr, to: SocketAddr) -> io::Result<(SimReader, SimWriter)> {
        let mut state = self.lock();
        let listener = state
            .listeners
            .get(&to)
            .ok_or(io::ErrorKind::ConnectionRefused)?
            .clone();
        let local = SocketAddr::new(from, Self::next_port(&mut state));
        let outbound = Pipe::new(from, to.ip());
        let inbound = Pipe::new(to.ip(), from);
        state.pipes.push(Arc::downgrade(&outbound));
        state.pipes.push(Arc::downgrade(&inbound));
        drop(state);
        let server_end = (
            SimReader::new(Arc::clone(&outbound)),
            SimWriter::new(Arc::clone(&inbound), self.clone()),
            local,
        );
        listener
            .try_send(server_end)
            .map_err(|_| io::Error::from(io::ErrorKind::ConnectionRefused))?;
        Ok((
            SimReader::new(inbound),
            SimWriter::new(outbound, self.clone()),
        ))
    }

    fn bind(&self, host: IpAddr, addr: SocketAddr) -> io::Result<SimListener> {
        let ip = if addr.ip().is_unspecified() {
            host
        } else {
            addr.ip()
        };
        if ip != host {
            return Err(io::ErrorKind::AddrNotAvailable.into());
        }
        let mut state = self.lock();
        let port = if addr.port() == 0 {
            Self::next_port(&mut state)
        } else {
            addr.port()
        };
        let local = SocketAddr::new(ip, port);
        if state.listeners.contains_key(&local) {
            return Err(io::ErrorKind::AddrInUse.into());
        }
        let (incoming, accepted) = mpsc::channel(BACKLOG_CONNECTIONS);
        state.listeners.insert(local, incoming);
        Ok(SimListener {
            network: self.clone(),
            local,
            accepted,
        })
    }
}

/// One node's view of a [`SimNetwork`].
#[derive(Debug, Clone)]
pub struct SimTransport {
    network: SimNetwork,
    host: IpAddr,
    config: TransportConfig,
}

impl SimTransport {
    pub fn host(&self) -> IpAddr {
        self.host
    }
}

impl Transport for SimTransport {
    type Reader = SimReader;
    type Writer = SimWriter;
    type Listener = SimListener;

    fn config(&self) -> &TransportConfig {
        &self.config
    }

    async fn dial(&self, addr: SocketAddr) -> io::Result<(SimReader, SimWriter)> {
        self.network.dial(self.host, addr)
    }

    async fn bind(&self, addr: SocketAddr) -> io::Result<SimListener> {
        self.network.bind(self.host, addr)
    }
}

/// A bound address on a [`SimNetwork`]; dropping it frees the address, and connects to it
/// are then refused.
pub struct SimListener {
    network: SimNetwork,
    local: SocketAddr,
    accepted: mpsc::Receiver<Incoming>,
}

impl Drop for SimListener {
    fn drop(&mut self) {
        self.network.lock().listeners.remove(&self.local);
    }
}

impl Listener for SimListener {
    type Reader = SimReader;
    type Writer = SimWriter;

    fn local_addr(&self) -> SocketAddr {
        self.local
    }

    async fn accept(&mut self) -> io::Result<(SimReader, SimWriter, SocketAddr)> {
        // The sender lives in the network's table as long as this listener does.
        Ok(self
            .accepted
            .recv()
            .await
            .expect("listener's sender outlives it"))
    }

    /// Simulated streams belong to no runtime: they move as they are.
    type Portable = (SimReader, SimWriter);

    fn detach(reader: SimReader, writer: SimWriter) -> io::Result<(SimReader, SimWriter)> {
        Ok((reader, writer))
    }

    fn attach(portable: (SimReader, SimWriter)) -> io::Result<(SimReader, SimWriter)> {
        Ok(portable)
    }
}

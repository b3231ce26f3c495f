//! NBD server front-end of Ashlar: fixed newstyle handshake, simple and structured replies,
//! the `base:allocation` metadata context, and pipelined transmission, generic over the
//! vdisk [`BlockDevice`] interface. See `docs/nbd.md` for what is supported.
//!
//! A connection runs inside a tokio current-thread runtime and a `LocalSet` (with the time
//! driver enabled): device futures need not be `Send`. A read the device can answer at once
//! (`BlockDevice::read_now`) is answered by the reader itself; every other request runs as a
//! `spawn_local` task.
//!
//! Memory: every request's payload is reserved from a [`RequestBudget`] shared by all
//! connections (see `NbdLimits::request_budget`) before it is read or executed; a connection
//! without budget stops reading its socket until some is released.

mod budget;
mod error;
mod execute;
mod handshake;
mod limits;
mod negotiate;
mod options;
mod proto;
mod reply;
mod request;
mod signal;
mod transmission;
mod violation;
mod writer;

pub use budget::{RequestBudget, DEFAULT_CONNECTION_ALLOWANCE_BYTES, DEFAULT_REQUEST_BUDGET_BYTES};
pub use error::NbdError;
pub use limits::NbdLimits;

use ashlar_core::BlockDevice;
use handshake::HandshakeEnd;
use limits::Effective;
use std::rc::Rc;
use tokio::io::{AsyncReadExt, BufReader};
use tokio::net::TcpStream;
use tokio::sync::watch;
use violation::{Violation, ViolationLog};

/// Socket read buffer: large enough that small requests arrive in few syscalls.
const READ_BUFFER_BYTES: usize = 128 * 1024;

/// One export as listed to clients.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportInfo {
    pub name: String,
    pub description: String,
}

/// Where the server finds exports. The export size is the device's `size_bytes()`.
pub trait ExportRegistry: 'static {
    type Device: BlockDevice + Clone + 'static;
    fn list_exports(&self) -> Vec<ExportInfo>;
    /// Opens an export for one connection (also called to answer NBD_OPT_INFO and the
    /// meta-context options). `Err(reason)` for an unknown export or one this server may
    /// not serve now; the reason is sent to the client. Asynchronous so that a server may
    /// consult its cluster (claim the export's ownership) before answering.
    fn open_export(
        &self,
        name: &str,
    ) -> impl std::future::Future<Output = Result<Self::Device, String>>;
}

/// Serves one client connection until it disconnects, breaks the protocol, or `shutdown`
/// becomes true; then requests already read are answered before the connection closes.
///
/// Returns `Ok` for orderly ends (NBD_OPT_ABORT, NBD_CMD_DISC, the client closing between
/// messages, shutdown) and `Err` for protocol violations, timeouts and socket errors.
pub async fn serve_connection<R: ExportRegistry>(
    stream: TcpStream,
    registry: Rc<R>,
    limits: NbdLimits,
    shutdown: watch::Receiver<bool>,
) -> Result<(), NbdError> {
    let stay = |_: &R::Device| true;
    serve_or_hand_over(stream, registry, limits, shutdown, stay)
        .await
        .map(|_| ())
}

/// A connection between its handshake and its transmission phase, in a form that can move
/// to another thread: the socket, the bytes the client already sent, and what was
/// negotiated. [`resume_connection`] serves it wherever it lands.
#[derive(Debug)]
pub struct Handover {
    stream: std::net::TcpStream,
    early: Vec<u8>,
    export: String,
    structured: bool,
    allocation_context: Option<u32>,
}

impl Handover {
    /// The export the client selected.
    pub fn export(&self) -> &str {
        &self.export
    }
}

/// As [`serve_connection`], but once the client has selected an export, `stay` decides
/// whether the transmission phase runs here; if not, the negotiated connection is returned
/// (`Ok(Some)`) for the caller to move, e.g. to the thread that owns the export's data.
pub async fn serve_or_hand_over<R: ExportRegistry>(
    stream: TcpStream,
    registry: Rc<R>,
    limits: NbdLimits,
    mut shutdown: watch::Receiver<bool>,
    stay: impl FnOnce(&R::Device) -> bool,
) -> Result<Option<Handover>, NbdError> {
    let peer = peer_name(&stream);
    // Requests and replies are small and latency-bound; never wait to coalesce them.
    stream.set_nodelay(true)?;
    let limits = Effective::from(&limits);
    let mut log = ViolationLog::new(peer);
    let mut stream = BufReader::with_capacity(READ_BUFFER_BYTES, stream);
    let handshake = handshake::handshake(
        &mut stream,
        registry.as_ref(),
        &limits,
        &mut shutdown,
        &mut log,
    );
    let session = match tokio::time::timeout(limits.handshake_timeout, handshake).await {
        Ok(Ok(HandshakeEnd::Transmission(session))) => session,
        Ok(Ok(HandshakeEnd::Closed)) => return Ok(None),
        Ok(Err(error)) => return Err(error),
        Err(_) => {
            log.report(
                Violation::HandshakeTimeout,
                &"handshake did not finish in time",
            );
            return Err(NbdError::HandshakeTimeout(limits.handshake_timeout));
        }
    };
    tracing::debug!(peer = log.peer(), export = %session.export, "NBD transmission started");
    // Bytes the client sent right behind its final option are already buffered: keep them.
    let early = stream.buffer().to_vec();
    let stream = stream.into_inner();
    if !stay(&session.device) {
        return Ok(Some(Handover {
            stream: stream.into_std()?,
            early,
            export: session.export,
            structured: session.structured,
            allocation_context: session.allocation_context,
        }));
    }
    transmit(stream, early, session, &limits, &mut shutdown, &mut log).await?;
    Ok(None)
}

/// Serves the transmission phase of a connection handed over by [`serve_or_hand_over`],
/// with the export opened again from `registry` on this thread. An export that vanished
/// meanwhile closes the connection.
pub async fn resume_connection<R: ExportRegistry>(
    handover: Handover,
    registry: Rc<R>,
    limits: NbdLimits,
    mut shutdown: watch::Receiver<bool>,
) -> Result<(), NbdError> {
    let stream = TcpStream::from_std(handover.stream)?;
    let mut log = ViolationLog::new(peer_name(&stream));
    let limits = Effective::from(&limits);
    let device = match registry.open_export(&handover.export).await {
        Ok(device) => device,
        Err(reason) => {
            tracing::warn!(peer = log.peer(), export = %handover.export, %reason,
                "export vanished while the connection moved; closing it");
            return Ok(());
        }
    };
    let session = negotiate::Session {
        device,
        export: handover.export,
        structured: handover.structured,
        allocation_context: handover.allocation_context,
    };
    transmit(
        stream,
        handover.early,
        session,
        &limits,
        &mut shutdown,
        &mut log,
    )
    .await
}

fn peer_name(stream: &TcpStream) -> String {
    match stream.peer_addr() {
        Ok(addr) => addr.to_string(),
        Err(_) => "unknown peer".to_string(),
    }
}

async fn transmit<D: BlockDevice + 'static>(
    stream: TcpStream,
    early: Vec<u8>,
    session: negotiate::Session<D>,
    limits: &Effective,
    shutdown: &mut watch::Receiver<bool>,
    log: &mut ViolationLog,
) -> Result<(), NbdError> {
    let (read_half, write_half) = stream.into_split();
    let reader = BufReader::with_capacity(
        READ_BUFFER_BYTES,
        std::io::Cursor::new(early).chain(read_half),
    );
    transmission::serve(reader, write_half, session, limits, shutdown, log).await
}

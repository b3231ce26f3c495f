//! NBD server front-end of Ashlar: fixed newstyle handshake, simple and structured replies,
//! the `base:allocation` metadata context, and pipelined transmission, generic over the
//! vdisk [`BlockDevice`] interface. See `docs/nbd.md` for what is supported.
//!
//! A connection runs inside a tokio current-thread runtime and a `LocalSet` (with the time
//! driver enabled): device futures need not be `Send`, and each request runs as a
//! `spawn_local` task.

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
    /// meta-context options). `Err(reason)` for an unknown export; the reason is sent to
    /// the client.
    fn open_export(&self, name: &str) -> Result<Self::Device, String>;
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
    mut shutdown: watch::Receiver<bool>,
) -> Result<(), NbdError> {
    let peer = match stream.peer_addr() {
        Ok(addr) => addr.to_string(),
        Err(_) => "unknown peer".to_string(),
    };
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
        Ok(Ok(HandshakeEnd::Closed)) => return Ok(()),
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
    let (read_half, write_half) = stream.into_inner().into_split();
    let reader = BufReader::with_capacity(
        READ_BUFFER_BYTES,
        std::io::Cursor::new(early).chain(read_half),
    );
    transmission::serve(
        reader,
        write_half,
        session,
        &limits,
        &mut shutdown,
        &mut log,
    )
    .await
}

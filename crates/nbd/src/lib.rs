//! NBD server front-end (fixed newstyle handshake, structured replies, `base:allocation`),
//! generic over the vdisk [`BlockDevice`] interface. See docs/nbd.md.
//!
//! A connection runs on one reactor (a current-thread runtime inside a `LocalSet`): device
//! futures need not be `Send`.

mod negotiate;
mod transmit;
pub mod wire;

use ashlar_core::BlockDevice;
use std::rc::Rc;
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::sync::watch;

/// One export as listed to clients.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportInfo {
    pub name: String,
    pub description: String,
}

/// Where the server finds exports. `open_export` is called once per connection (and for
/// NBD_OPT_INFO); the device it returns serves that connection.
pub trait ExportRegistry: 'static {
    type Device: BlockDevice + Clone + 'static;
    fn list_exports(&self) -> Vec<ExportInfo>;
    /// `Err(reason)` for an unknown export; the reason is sent to the client.
    fn open_export(&self, name: &str) -> Result<Self::Device, String>;
}

/// Per-connection limits.
#[derive(Clone, Debug)]
pub struct NbdLimits {
    /// Largest READ/WRITE payload (also advertised as the maximum block size).
    pub max_request_bytes: u32,
    /// Requests served at once; the server stops reading the socket at this limit.
    pub max_in_flight_requests: usize,
    /// Time a client has to finish the handshake.
    pub handshake_timeout: Duration,
    pub min_block_size: u32,
    pub preferred_block_size: u32,
}

impl Default for NbdLimits {
    fn default() -> Self {
        NbdLimits {
            max_request_bytes: 32 << 20,
            max_in_flight_requests: 128,
            handshake_timeout: Duration::from_secs(10),
            min_block_size: 1,
            preferred_block_size: 4096,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum NbdError {
    #[error("connection error: {0}")]
    Io(#[from] std::io::Error),
    #[error("protocol violation: {0}")]
    Protocol(String),
    #[error("handshake not finished within {0:?}")]
    HandshakeTimeout(Duration),
}

/// Serves one client connection until it disconnects, violates the protocol, or `shutdown`
/// becomes true (then in-flight requests finish and are answered first).
pub async fn serve_connection<R: ExportRegistry>(
    mut stream: TcpStream,
    registry: Rc<R>,
    limits: NbdLimits,
    shutdown: watch::Receiver<bool>,
) -> Result<(), NbdError> {
    let peer = stream.peer_addr()?;
    stream.set_nodelay(true)?;
    let negotiated = tokio::time::timeout(
        limits.handshake_timeout,
        negotiate::negotiate(&mut stream, registry.as_ref(), &limits),
    )
    .await
    .map_err(|_| NbdError::HandshakeTimeout(limits.handshake_timeout))?;
    let negotiated = match negotiated {
        Ok(Some(negotiated)) => negotiated,
        Ok(None) => return Ok(()),
        Err(NbdError::Io(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
        Err(error) => {
            tracing::warn!(%peer, %error, "NBD handshake failed");
            return Err(error);
        }
    };
    transmit::transmit(stream, negotiated, limits, shutdown, peer).await
}

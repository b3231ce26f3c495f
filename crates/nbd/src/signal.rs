//! Waiting for the next message or for shutdown, whichever comes first.

use tokio::io::{AsyncBufRead, AsyncBufReadExt};
use tokio::sync::watch;

/// What happened while waiting for the client's next message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Readiness {
    /// At least one byte is buffered.
    Data,
    /// The client closed its side cleanly, between messages.
    Eof,
    /// The server is shutting down and no byte was waiting.
    Shutdown,
}

/// Resolves once `shutdown` is true. If the sender is gone without ever saying so, the
/// server is not shutting down, so this never resolves.
pub(crate) async fn wait_shutdown(shutdown: &mut watch::Receiver<bool>) {
    if shutdown.wait_for(|stop| *stop).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// Waits for the first byte of the next message without consuming it. `fill_buf` is
/// cancel-safe, so losing the race against shutdown loses no data. Buffered data wins over
/// shutdown; callers that must not start a new message during shutdown check the flag
/// themselves.
pub(crate) async fn wait_readable<R: AsyncBufRead + Unpin>(
    reader: &mut R,
    shutdown: &mut watch::Receiver<bool>,
) -> std::io::Result<Readiness> {
    tokio::select! {
        biased;
        filled = async { reader.fill_buf().await.map(|buf| buf.is_empty()) } => {
            Ok(if filled? { Readiness::Eof } else { Readiness::Data })
        }
        _ = wait_shutdown(shutdown) => Ok(Readiness::Shutdown),
    }
}

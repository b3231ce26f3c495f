//! The one task that writes replies. Request tasks hand it complete replies over a bounded
//! channel, so two replies never interleave on the socket whatever order they finish in.

use crate::budget::Charge;
use crate::reply::Encoded;
use tokio::io::{AsyncWrite, AsyncWriteExt, BufWriter};
use tokio::sync::{mpsc, OwnedSemaphorePermit};

/// Small replies that are ready together are gathered into one socket write of up to this
/// many bytes; larger payloads bypass the buffer.
const WRITE_BUFFER_BYTES: usize = 256 * 1024;

/// A reply ready to go out, with what its request holds. Both are released only once the
/// reply is handed to the socket, so the limits also bound replies queued behind a client
/// that does not read.
pub(crate) struct Outgoing {
    pub reply: Encoded,
    pub slot: Slot,
}

/// What a request holds from the moment the reader starts on it until its reply is written:
/// its in-flight permit and its payload bytes' share of the request budget.
#[allow(dead_code)] // held for what dropping them releases
pub(crate) struct Slot {
    pub in_flight: OwnedSemaphorePermit,
    pub budget: Charge,
}

/// Writes replies until every sender is gone, then closes the write side.
pub(crate) async fn write_replies<W: AsyncWrite + Unpin>(
    mut replies: mpsc::Receiver<Outgoing>,
    socket: W,
) -> std::io::Result<()> {
    let mut out = BufWriter::with_capacity(WRITE_BUFFER_BYTES, socket);
    while let Some(first) = replies.recv().await {
        write_one(&mut out, first).await?;
        while let Ok(next) = replies.try_recv() {
            write_one(&mut out, next).await?;
        }
        out.flush().await?;
    }
    out.shutdown().await
}

async fn write_one<W: AsyncWrite + Unpin>(
    out: &mut BufWriter<W>,
    outgoing: Outgoing,
) -> std::io::Result<()> {
    let Outgoing { reply, slot } = outgoing;
    out.write_all(&reply.head).await?;
    out.write_all(&reply.data).await?;
    // The data is copied out (to the socket or the fixed write buffer): release it, then the
    // request's in-flight permit and budget.
    drop(reply);
    drop(slot);
    Ok(())
}

//! Frames over a byte stream: a cancel-safe reader and the writer's batching.

use crate::error::CloseReason;
use crate::wire::frame::{decode_frame, encode_frame, frame_bytes_needed, Frame};
use bytes::BytesMut;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Smallest read: a burst of small frames costs one syscall.
const READ_CHUNK_BYTES: usize = 64 << 10;
/// A writer stops gathering queued frames into one write at this size, so one write's copy
/// stays small next to the frame limit.
pub const WRITE_BATCH_BYTES: usize = 256 << 10;

/// Reads frames off a stream. [`FrameReader::next_frame`] is cancel-safe: bytes read before a
/// cancellation stay in the buffer.
pub struct FrameReader<R> {
    stream: R,
    buf: BytesMut,
    max_payload_bytes: u32,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    pub fn new(stream: R, max_payload_bytes: u32) -> Self {
        FrameReader {
            stream,
            buf: BytesMut::with_capacity(READ_CHUNK_BYTES),
            max_payload_bytes,
        }
    }

    /// The next frame. EOF (clean or in the middle of a frame) is [`CloseReason::PeerClosed`].
    pub async fn next_frame(&mut self) -> Result<Frame, CloseReason> {
        loop {
            if let Some(frame) = decode_frame(&mut self.buf, self.max_payload_bytes)
                .map_err(CloseReason::Protocol)?
            {
                return Ok(frame);
            }
            // The header (if complete) passed its checks, so `needed` is within the limit.
            let needed = frame_bytes_needed(&self.buf);
            self.buf
                .reserve(needed.saturating_sub(self.buf.len()).max(READ_CHUNK_BYTES));
            match self.stream.read_buf(&mut self.buf).await {
                Ok(0) => return Err(CloseReason::PeerClosed),
                Ok(_) => {}
                Err(error) => return Err(CloseReason::from_io(&error)),
            }
        }
    }
}

/// Writes the frames gathered in `buf` and empties it. A batch not written within
/// `stall_timeout` closes the connection: the peer stopped reading (or the network is gone),
/// and waiting longer would only hold the caller's slots.
pub async fn write_batch<W: AsyncWrite + Unpin>(
    stream: &mut W,
    buf: &mut BytesMut,
    stall_timeout: Duration,
) -> Result<(), CloseReason> {
    let idle_ms = u64::try_from(stall_timeout.as_millis()).unwrap_or(u64::MAX);
    let written = tokio::time::timeout(stall_timeout, async {
        stream.write_all(buf).await?;
        stream.flush().await
    })
    .await;
    buf.clear();
    if buf.capacity() > 2 * WRITE_BATCH_BYTES {
        // One large frame must not pin its size in memory for the connection's life.
        *buf = BytesMut::new();
    }
    match written {
        Ok(Ok(())) => Ok(()),
        Ok(Err(error)) => Err(CloseReason::from_io(&error)),
        Err(_) => Err(CloseReason::Idle { idle_ms }),
    }
}

/// Encodes `frame` into the batch; true when the batch is full and should be written.
pub fn add_to_batch(buf: &mut BytesMut, frame: &Frame) -> bool {
    encode_frame(frame, buf);
    buf.len() >= WRITE_BATCH_BYTES
}

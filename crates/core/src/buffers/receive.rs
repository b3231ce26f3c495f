//! Receiving a large payload (an NBD write's, an iSCSI Data-Out's) from a buffered socket
//! reader into the payload's own buffer: what the reader has already buffered is copied, the
//! rest is read from the socket straight into place. Through the reader's buffer every byte
//! would be copied once more (tokio's `BufReader` bypasses its buffer only for a read at least
//! as large as the buffer, so the tail of every payload went through it).

use std::io;
use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncRead, AsyncReadExt, BufReader};

/// A buffered reader whose buffer a payload may bypass.
pub trait PayloadSource: AsyncBufRead + Unpin {
    /// Bytes read from the socket and not consumed yet.
    fn buffered(&self) -> &[u8];
    /// The socket under the buffer. Reading from it directly keeps the reader consistent
    /// only while nothing is buffered.
    fn unbuffered(&mut self) -> &mut (dyn AsyncRead + Unpin);
}

impl<R: AsyncRead + Unpin> PayloadSource for BufReader<R> {
    fn buffered(&self) -> &[u8] {
        self.buffer()
    }

    fn unbuffered(&mut self) -> &mut (dyn AsyncRead + Unpin) {
        self.get_mut()
    }
}

/// The rest of a payload is read straight from the socket when at least this long. A shorter
/// rest goes through the reader's buffer, whose one read then also brings the next request's
/// header, where a direct read would cost a second system call for it.
pub const DIRECT_RECEIVE_MIN_BYTES: usize = 32 << 10;

/// Fills `target` with the next `target.len()` bytes of `source`.
pub async fn receive_payload<S: PayloadSource + ?Sized>(
    source: &mut S,
    target: &mut [u8],
) -> io::Result<()> {
    let buffered = source.buffered();
    let copied = buffered.len().min(target.len());
    target[..copied].copy_from_slice(&buffered[..copied]);
    source.consume(copied);
    let rest = &mut target[copied..];
    if rest.len() >= DIRECT_RECEIVE_MIN_BYTES {
        // Nothing is buffered now (the payload goes on past what was).
        debug_assert!(source.buffered().is_empty());
        source.unbuffered().read_exact(rest).await?;
    } else {
        source.read_exact(rest).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    /// Payloads of every size around the buffer's and the threshold's, back to back with
    /// small headers between them, arrive whole and in order, and what follows a payload is
    /// still read through the buffer.
    #[test]
    fn payloads_arrive_whole_whatever_was_buffered() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        runtime.block_on(async {
            let sizes = [
                1,
                4096,
                DIRECT_RECEIVE_MIN_BYTES - 1,
                DIRECT_RECEIVE_MIN_BYTES,
                DIRECT_RECEIVE_MIN_BYTES + 1,
                64 << 10,
                (64 << 10) + 7,
                1 << 20,
            ];
            let (mut client, server) = tokio::io::duplex(48 << 10);
            let mut stream = Vec::new();
            for (i, &size) in sizes.iter().enumerate() {
                stream.extend_from_slice(&[i as u8; 8]);
                stream.extend_from_slice(&pattern(size, i as u8));
            }
            let writer = async move {
                for piece in stream.chunks(5000) {
                    client.write_all(piece).await.unwrap();
                }
            };
            let reader = async move {
                let mut source = BufReader::with_capacity(64 << 10, server);
                for (i, &size) in sizes.iter().enumerate() {
                    let mut header = [0u8; 8];
                    source.read_exact(&mut header).await.unwrap();
                    assert_eq!(header, [i as u8; 8], "header {i}");
                    let mut payload = vec![0u8; size];
                    receive_payload(&mut source, &mut payload).await.unwrap();
                    assert!(payload == pattern(size, i as u8), "payload of {size} bytes");
                }
                let mut end = [0u8; 1];
                assert_eq!(source.read(&mut end).await.unwrap(), 0);
            };
            tokio::join!(writer, reader);
        });
    }

    #[test]
    fn a_payload_cut_short_is_an_error() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        runtime.block_on(async {
            for sent in [10, 100 << 10] {
                let bytes = vec![7u8; sent];
                let mut source = BufReader::new(&bytes[..]);
                let mut payload = vec![0u8; 200 << 10];
                let error = receive_payload(&mut source, &mut payload)
                    .await
                    .unwrap_err();
                assert_eq!(error.kind(), io::ErrorKind::UnexpectedEof);
            }
        });
    }
}

//! The one task that writes replies. Request tasks hand it complete replies over a bounded
//! channel, so two replies never interleave on the socket whatever order they finish in.

use crate::budget::Charge;
use crate::reply::Encoded;
use tokio::io::{AsyncWrite, AsyncWriteExt, BufWriter};
use tokio::sync::{mpsc, OwnedSemaphorePermit};

/// Small replies that are ready together are gathered into one socket write of up to this
/// many bytes; larger payloads bypass the buffer.
const WRITE_BUFFER_BYTES: usize = 256 * 1024;

/// Reply bytes written before the writer lets the connection's other tasks run. Copying a
/// 1 MiB reply into the socket takes 0.1-0.3 ms; with a deep queue of large reads finishing
/// together, writing them all before the reader looks at the socket again left the disk idle
/// for the whole send phase (the client's next requests were already waiting), so sequential
/// reads went in lock step: all disk, then all send.
const YIELD_AFTER_BYTES: usize = 256 * 1024;

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
        let mut since_yield = write_one(&mut out, first).await?;
        while let Ok(next) = replies.try_recv() {
            if since_yield >= YIELD_AFTER_BYTES {
                out.flush().await?;
                // Deferred until the runtime has polled for I/O: a reader with requests
                // waiting on the socket runs first and starts them.
                tokio::task::yield_now().await;
                since_yield = 0;
            }
            since_yield += write_one(&mut out, next).await?;
        }
        out.flush().await?;
    }
    out.shutdown().await
}

/// Writes one reply; returns its size in bytes.
async fn write_one<W: AsyncWrite + Unpin>(
    out: &mut BufWriter<W>,
    outgoing: Outgoing,
) -> std::io::Result<usize> {
    let Outgoing { reply, slot } = outgoing;
    let bytes = reply.head.len() + reply.data.len();
    out.write_all(&reply.head).await?;
    out.write_all(&reply.data).await?;
    // The data is copied out (to the socket or the fixed write buffer): release it, then the
    // request's in-flight permit and budget.
    drop(reply);
    drop(slot);
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::Charge;
    use crate::proto::encode_simple_reply;
    use bytes::Bytes;
    use std::cell::{Cell, RefCell};
    use std::pin::Pin;
    use std::rc::Rc;
    use std::sync::Arc;
    use std::task::{Context, Poll};
    use tokio::sync::Semaphore;

    /// A socket that always takes everything at once and records, per write of reply data,
    /// whether another task on the thread has run by then.
    struct Recorder {
        other_ran: Rc<Cell<bool>>,
        seen: Rc<RefCell<Vec<bool>>>,
    }

    impl AsyncWrite for Recorder {
        fn poll_write(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<std::io::Result<usize>> {
            if buf.len() >= 64 * 1024 {
                self.seen.borrow_mut().push(self.other_ran.get());
            }
            Poll::Ready(Ok(buf.len()))
        }
        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Poll::Ready(Ok(()))
        }
        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    fn large_reply(permits: &Arc<Semaphore>) -> Outgoing {
        Outgoing {
            reply: Encoded {
                head: encode_simple_reply(1, 0),
                data: Bytes::from(vec![7u8; 1 << 20]),
            },
            slot: Slot {
                in_flight: permits.clone().try_acquire_owned().expect("permit"),
                budget: Charge::None,
            },
        }
    }

    /// Large replies queued together do not keep the connection's other tasks (the reader,
    /// which starts the next requests) from running until all of them are written.
    #[tokio::test(flavor = "current_thread")]
    async fn other_tasks_run_between_large_replies() {
        let local = tokio::task::LocalSet::new();
        local
            .run_until(async {
                let permits = Arc::new(Semaphore::new(8));
                let (sender, receiver) = mpsc::channel(8);
                for _ in 0..4 {
                    assert!(sender.try_send(large_reply(&permits)).is_ok());
                }
                drop(sender);
                let other_ran = Rc::new(Cell::new(false));
                let seen = Rc::new(RefCell::new(Vec::new()));
                let flag = other_ran.clone();
                // Ready to run as soon as the writer gives the thread up.
                let other = tokio::task::spawn_local(async move { flag.set(true) });
                let socket = Recorder {
                    other_ran,
                    seen: seen.clone(),
                };
                write_replies(receiver, socket).await.expect("written");
                other.await.expect("other task");
                let seen = seen.borrow();
                assert_eq!(seen.len(), 4, "one data write per reply");
                assert!(!seen[0], "the first reply goes out at once");
                assert!(
                    seen[3],
                    "the other task ran before the last reply: {seen:?}"
                );
                assert_eq!(permits.available_permits(), 8, "every slot released");
            })
            .await;
    }
}

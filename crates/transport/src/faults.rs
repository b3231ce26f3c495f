//! Network faults injected in-process (this machine's kernel has no netem): per link, a delay
//! with jitter, a loss rate, or a cut. The simulated network applies them to its pipes; a
//! real node applies them, when a test asks (`TcpTransport::with_faults`), to the
//! connections it opens to each peer address: its own requests are delayed, lost or cut,
//! the answers to them are not. Faults act on segments (what one write handed over: the
//! transport writes whole frames, so a lost segment loses frames without corrupting the
//! stream; the caller times out, as over a dead network).

use crate::rng::SplitMix64;
use bytes::Bytes;
use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio::time::Instant;

/// A loss rate is in parts per million.
pub const MILLION: u64 = 1_000_000;
/// Segments a faulty connection holds on their way (delayed) before its writer waits.
pub const FAULTY_SEGMENTS_QUEUED: usize = 256;

/// Faults of one direction of a link.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LinkFaults {
    /// Added to every segment's delivery time.
    pub delay: Duration,
    /// A further delay, uniform in `0..=jitter`; segments stay in order.
    pub jitter: Duration,
    /// Segments lost, in parts per million.
    pub loss_per_million: u32,
    /// Every segment is lost (a partition).
    pub cut: bool,
}

/// What the network does with one segment.
pub(crate) enum Fate {
    Deliver { delay: Duration },
    Drop,
}

impl LinkFaults {
    pub(crate) fn fate(&self, rng: &mut SplitMix64) -> Fate {
        if self.cut || rng.below(MILLION) < u64::from(self.loss_per_million) {
            return Fate::Drop;
        }
        let jitter_us = u64::try_from(self.jitter.as_micros()).unwrap_or(u64::MAX);
        let jitter = Duration::from_micros(rng.below(jitter_us.saturating_add(1)));
        Fate::Deliver {
            delay: self.delay + jitter,
        }
    }
}

/// The faults a node injects into the connections it opens, per peer address. Cheap to
/// clone (all clones are one table); changes apply to the next segment written.
#[derive(Clone)]
pub struct OutgoingFaults {
    state: Arc<Mutex<FaultTable>>,
}

struct FaultTable {
    rng: SplitMix64,
    links: HashMap<SocketAddr, LinkFaults>,
    segments_dropped: u64,
}

impl OutgoingFaults {
    /// No faults yet; random choices follow from `seed`.
    pub fn new(seed: u64) -> OutgoingFaults {
        OutgoingFaults {
            state: Arc::new(Mutex::new(FaultTable {
                rng: SplitMix64::new(seed),
                links: HashMap::new(),
                segments_dropped: 0,
            })),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, FaultTable> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Replaces every link's faults by `links` (a peer absent from it gets none).
    pub fn set_all(&self, links: HashMap<SocketAddr, LinkFaults>) {
        self.lock().links = links;
    }

    /// Segments lost to cuts and loss so far.
    pub fn segments_dropped(&self) -> u64 {
        self.lock().segments_dropped
    }

    fn fate(&self, peer: SocketAddr) -> Fate {
        let mut table = self.lock();
        let link = table.links.get(&peer).copied().unwrap_or_default();
        let fate = link.fate(&mut table.rng);
        if matches!(fate, Fate::Drop) {
            table.segments_dropped += 1;
        }
        fate
    }

    /// Wraps the writing half of a connection to `peer`: segments go through a task that
    /// delivers each at its time, in order, or drops it.
    pub fn wrap<W>(&self, peer: SocketAddr, writer: W) -> FaultyWriter
    where
        W: AsyncWrite + Unpin + Send + 'static,
    {
        let (queue, segments) = mpsc::channel(FAULTY_SEGMENTS_QUEUED);
        tokio::spawn(deliver(segments, writer));
        FaultyWriter {
            peer,
            faults: self.clone(),
            queue: Some(queue),
            reserving: None,
        }
    }
}

struct Segment {
    data: Bytes,
    deliver_at: Instant,
}

/// Writes each segment at its time, in order; closes the stream once the writer is gone.
async fn deliver<W: AsyncWrite + Unpin>(mut segments: mpsc::Receiver<Segment>, mut writer: W) {
    while let Some(segment) = segments.recv().await {
        tokio::time::sleep_until(segment.deliver_at).await;
        if writer.write_all(&segment.data).await.is_err() {
            return;
        }
    }
    let _ = writer.shutdown().await;
}

type Reserve = Pin<
    Box<dyn Future<Output = Result<mpsc::OwnedPermit<Segment>, mpsc::error::SendError<()>>> + Send>,
>;

/// The writing half of a connection whose segments meet the faults of its peer's link.
pub struct FaultyWriter {
    peer: SocketAddr,
    faults: OutgoingFaults,
    queue: Option<mpsc::Sender<Segment>>,
    reserving: Option<Reserve>,
}

impl AsyncWrite for FaultyWriter {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        let Some(queue) = &this.queue else {
            return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
        };
        let reserving = this
            .reserving
            .get_or_insert_with(|| Box::pin(queue.clone().reserve_owned()));
        let permit = match reserving.as_mut().poll(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(permit) => permit,
        };
        this.reserving = None;
        let permit = permit.map_err(|_| io::Error::from(io::ErrorKind::BrokenPipe))?;
        if let Fate::Deliver { delay } = this.faults.fate(this.peer) {
            permit.send(Segment {
                data: Bytes::copy_from_slice(buf),
                deliver_at: Instant::now() + delay,
            });
        }
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // Handed to the network: delivery is the network's business, as with a socket.
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.queue = None;
        self.reserving = None;
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    fn peer() -> SocketAddr {
        "127.0.0.1:7".parse().unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn segments_arrive_in_order_after_the_delay_or_not_at_all_once_cut() {
        let faults = OutgoingFaults::new(1);
        let delayed = LinkFaults {
            delay: Duration::from_millis(20),
            ..LinkFaults::default()
        };
        faults.set_all(HashMap::from([(peer(), delayed)]));
        let (near, mut far) = tokio::io::duplex(1 << 16);
        let mut writer = faults.wrap(peer(), near);
        let start = Instant::now();
        writer.write_all(b"one").await.unwrap();
        writer.write_all(b"two").await.unwrap();
        let mut got = [0u8; 6];
        far.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"onetwo");
        assert!(start.elapsed() >= Duration::from_millis(20));

        let cut = LinkFaults {
            cut: true,
            ..LinkFaults::default()
        };
        faults.set_all(HashMap::from([(peer(), cut)]));
        writer.write_all(b"lost").await.unwrap();
        faults.set_all(HashMap::new());
        writer.write_all(b"kept").await.unwrap();
        let mut got = [0u8; 4];
        far.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"kept", "the segment written while cut never arrives");
        assert_eq!(faults.segments_dropped(), 1);
        writer.shutdown().await.unwrap();
        let mut rest = Vec::new();
        far.read_to_end(&mut rest).await.unwrap();
        assert!(
            rest.is_empty(),
            "the stream ends after the writer shut down"
        );
    }
}

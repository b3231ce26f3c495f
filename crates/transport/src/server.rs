//! The serving side: a [`Handler`] answers requests; [`Server`] accepts, authenticates and
//! serves connections.
//!
//! Per connection one task reads frames and starts a handler task per request, holding an
//! in-flight slot; at the limit it stops reading (holding at most the one request that
//! waits for a slot), so TCP pushes back on the client. Finished
//! handlers queue their response for the connection's writer (the same task, selected
//! against the reader), which batches frames into writes.

use crate::config::TransportConfig;
use crate::error::{CloseReason, ProtocolError, RemoteError, TransportError};
use crate::framed::{add_to_batch, write_batch, FrameReader};
use crate::handshake::{server_handshake, Negotiated};
use crate::ids::NodeId;
use crate::limits::TransportLimits;
use crate::task::AbortOnDrop;
use crate::transport::Listener;
use crate::wire::frame::{Frame, FrameKind};
use bytes::{Bytes, BytesMut};
use futures_util::FutureExt;
use std::future::Future;
use std::net::SocketAddr;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;

/// Answers requests. Runs on the runtime's tasks, many at once (up to the in-flight limit
/// per connection).
pub trait Handler: Send + Sync + 'static {
    fn handle(
        &self,
        peer: NodeId,
        request: Bytes,
    ) -> impl Future<Output = Result<Bytes, RemoteError>> + Send;
}

/// A [`Handler`] made from an async closure; see [`handler_fn`].
#[derive(Debug, Clone)]
pub struct FnHandler<F>(F);

/// Wraps `f(peer, request)` as a [`Handler`].
pub fn handler_fn<F, Fut>(f: F) -> FnHandler<F>
where
    F: Fn(NodeId, Bytes) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Bytes, RemoteError>> + Send + 'static,
{
    FnHandler(f)
}

impl<F, Fut> Handler for FnHandler<F>
where
    F: Fn(NodeId, Bytes) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Bytes, RemoteError>> + Send + 'static,
{
    fn handle(
        &self,
        peer: NodeId,
        request: Bytes,
    ) -> impl Future<Output = Result<Bytes, RemoteError>> + Send {
        (self.0)(peer, request)
    }
}

/// A connection's serving, ready to run on another runtime ([`LanePlacer`]).
pub type PlacedServing = Box<dyn FnOnce() -> Pin<Box<dyn Future<Output = ()> + Send>> + Send>;

/// Chooses where connections that name a lane are served: a node serves the connection a
/// peer's reactor made on its own reactor of the same lane, so a request and its answer stay
/// on the thread that handles them.
pub trait LanePlacer: Send + Sync + 'static {
    /// Starts `serving` (call it there, then run its future) inside a tokio `LocalSet` on the
    /// runtime for `lane` (the client's lane, 0-based): the connection's handlers run as
    /// local tasks there. Dropping `serving` instead closes the connection.
    fn place(&self, lane: u8, serving: PlacedServing);
}

/// Where a connection's handler tasks run.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum HandlerTasks {
    /// Spawned on the runtime.
    Runtime,
    /// Spawned on the `LocalSet` the connection is served in (a placed connection).
    Local,
}

/// Counters of one server, for tests and metrics.
#[derive(Debug, Default)]
pub struct ServerStats {
    /// Connections that completed the handshake.
    pub connections_accepted: AtomicU64,
    /// Handshakes refused because the peer's proof did not verify: a stranger.
    pub handshakes_refused: AtomicU64,
    /// Handshakes that failed otherwise: timeout, protocol error, the peer hung up (which is
    /// what a client does that finds *our* proof wrong).
    pub handshakes_failed: AtomicU64,
    /// Accepted connections that have ended.
    pub connections_closed: AtomicU64,
    /// Accepted connections handed to a [`LanePlacer`] (served on another runtime).
    pub connections_placed: AtomicU64,
}

impl ServerStats {
    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

/// A listening server. Dropping it stops accepting and closes every connection it serves
/// (as a crash would, from the clients' point of view).
#[derive(Debug)]
pub struct Server {
    local_addr: SocketAddr,
    stats: Arc<ServerStats>,
    _accept_loop: AbortOnDrop<()>,
}

/// Pause after a failed accept (say, out of file descriptors), so the loop does not spin.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(100);

impl Server {
    pub(crate) fn spawn<L: Listener, H: Handler>(
        listener: L,
        config: TransportConfig,
        handler: H,
        placer: Option<Arc<dyn LanePlacer>>,
    ) -> Server {
        let local_addr = listener.local_addr();
        let stats = Arc::new(ServerStats::default());
        let accept_loop = accept_loop(
            listener,
            Arc::new(config),
            Arc::new(handler),
            placer,
            Arc::clone(&stats),
        );
        Server {
            local_addr,
            stats,
            _accept_loop: AbortOnDrop(tokio::spawn(accept_loop)),
        }
    }

    /// The address clients connect to (with the port chosen, if bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    pub fn stats(&self) -> &ServerStats {
        &self.stats
    }
}

async fn accept_loop<L: Listener, H: Handler>(
    mut listener: L,
    config: Arc<TransportConfig>,
    handler: Arc<H>,
    placer: Option<Arc<dyn LanePlacer>>,
    stats: Arc<ServerStats>,
) {
    // Dropped with this task, which aborts every connection's task.
    let mut connections = JoinSet::new();
    // At the limit the loop stops accepting: the kernel's backlog holds further connects.
    let limit = usize::try_from(config.limits.max_incoming_connections).expect("u32 fits usize");
    let slots = Arc::new(Semaphore::new(limit));
    loop {
        let slot = Arc::clone(&slots)
            .acquire_owned()
            .await
            .expect("never closed");
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
        };
        match accepted {
            Ok((reader, writer, remote)) => {
                let work = serve_incoming::<L, H>(
                    reader,
                    writer,
                    remote,
                    Arc::clone(&config),
                    Arc::clone(&handler),
                    placer.clone(),
                    Arc::clone(&stats),
                    slot,
                );
                connections.spawn(work);
            }
            Err(error) => {
                tracing::warn!(%error, "accepting a node-to-node connection failed");
                tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn serve_incoming<L: Listener, H: Handler>(
    mut reader: L::Reader,
    mut writer: L::Writer,
    remote: SocketAddr,
    config: Arc<TransportConfig>,
    handler: Arc<H>,
    placer: Option<Arc<dyn LanePlacer>>,
    stats: Arc<ServerStats>,
    _slot: OwnedSemaphorePermit,
) {
    let negotiated = match server_handshake(&mut reader, &mut writer, &config).await {
        Ok(negotiated) => negotiated,
        Err(TransportError::AuthFailed) => {
            stats.handshakes_refused.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(%remote, "refused a node-to-node connection: the peer does not hold the cluster secret");
            return;
        }
        Err(error) => {
            stats.handshakes_failed.fetch_add(1, Ordering::Relaxed);
            tracing::info!(%remote, %error, "node-to-node handshake failed");
            return;
        }
    };
    stats.connections_accepted.fetch_add(1, Ordering::Relaxed);
    let reason = match placer.filter(|_| negotiated.lane != 0) {
        Some(placer) => {
            stats.connections_placed.fetch_add(1, Ordering::Relaxed);
            serve_placed::<L, H>(reader, writer, negotiated, config, handler, placer).await
        }
        None => {
            let tasks = HandlerTasks::Runtime;
            serve_connection(reader, writer, negotiated, &config.limits, handler, tasks).await
        }
    };
    stats.connections_closed.fetch_add(1, Ordering::Relaxed);
    tracing::debug!(%remote, peer = %negotiated.peer, %reason, "node-to-node connection closed");
}

/// Serves a connection that names a lane where `placer` puts it, until it ends; returns why.
/// This task stays (holding the connection's slot) and dropping it closes the connection.
async fn serve_placed<L: Listener, H: Handler>(
    reader: L::Reader,
    writer: L::Writer,
    negotiated: Negotiated,
    config: Arc<TransportConfig>,
    handler: Arc<H>,
    placer: Arc<dyn LanePlacer>,
) -> CloseReason {
    let portable = match L::detach(reader, writer) {
        Ok(portable) => portable,
        Err(error) => return CloseReason::from_io(&error),
    };
    let (ended, reason) = oneshot::channel();
    // Dropped with this task: the connection, wherever it runs, closes then.
    let (_served_while_held, dropped) = oneshot::channel::<()>();
    let serving: PlacedServing = Box::new(move || {
        Box::pin(async move {
            let reason = match L::attach(portable) {
                Ok((reader, writer)) => {
                    let (limits, tasks) = (&config.limits, HandlerTasks::Local);
                    tokio::select! {
                        reason = serve_connection(reader, writer, negotiated, limits, handler, tasks) => reason,
                        _ = dropped => CloseReason::Local,
                    }
                }
                Err(error) => CloseReason::from_io(&error),
            };
            let _ = ended.send(reason);
        })
    });
    placer.place(negotiated.lane - 1, serving);
    reason.await.unwrap_or(CloseReason::Local)
}

/// Serves one authenticated connection until it ends; returns why.
pub(crate) async fn serve_connection<R, W, H>(
    reader: R,
    writer: W,
    negotiated: Negotiated,
    limits: &TransportLimits,
    handler: Arc<H>,
    tasks: HandlerTasks,
) -> CloseReason
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
    H: Handler,
{
    let (out, out_rx) =
        mpsc::channel(usize::try_from(limits.send_queue_frames).expect("u32 fits usize"));
    let session = Session {
        peer: negotiated.peer,
        max_payload_bytes: negotiated.max_frame_payload_bytes,
        out,
        handler,
    };
    let frames = FrameReader::new(reader, negotiated.max_frame_payload_bytes);
    let slots = usize::try_from(negotiated.max_in_flight_requests).expect("u32 fits usize");
    // Whichever ends first ends the connection; dropping the other closes its socket half
    // and (through the JoinSet) aborts the running handlers.
    tokio::select! {
        reason = session.read_requests(frames, slots, limits.idle_timeout(), tasks) => reason,
        reason = write_responses(writer, out_rx, limits.idle_timeout()) => reason,
    }
}

struct Session<H> {
    peer: NodeId,
    max_payload_bytes: u32,
    out: mpsc::Sender<Frame>,
    handler: Arc<H>,
}

impl<H: Handler> Session<H> {
    async fn read_requests<R: AsyncRead + Unpin>(
        &self,
        mut frames: FrameReader<R>,
        slots: usize,
        idle_timeout: Duration,
        tasks: HandlerTasks,
    ) -> CloseReason {
        let slots = Arc::new(Semaphore::new(slots));
        let mut handlers = JoinSet::new();
        loop {
            // Handlers never panic out (see `answer`); reaping only frees their memory.
            while handlers.try_join_next().is_some() {}
            let frame = match tokio::time::timeout(idle_timeout, frames.next_frame()).await {
                Ok(Ok(frame)) => frame,
                Ok(Err(reason)) => return reason,
                Err(_) => {
                    return CloseReason::Idle {
                        idle_ms: u64::try_from(idle_timeout.as_millis()).unwrap_or(u64::MAX),
                    }
                }
            };
            match frame.kind {
                FrameKind::Request => {
                    // No slot, no further reads: the client's requests wait in TCP buffers.
                    // The slot is taken after reading, not before, so that a client with
                    // all its (negotiated) slots busy on slow handlers still gets its pings
                    // read and answered: the frame after its requests can only be a ping.
                    let slot = Arc::clone(&slots)
                        .acquire_owned()
                        .await
                        .expect("never closed");
                    let answering = answer(
                        Arc::clone(&self.handler),
                        self.peer,
                        frame,
                        self.max_payload_bytes,
                        self.out.clone(),
                        slot,
                    );
                    match tasks {
                        HandlerTasks::Runtime => handlers.spawn(answering),
                        HandlerTasks::Local => handlers.spawn_local(answering),
                    };
                }
                FrameKind::Ping => {
                    let pong = Frame::new(FrameKind::Pong, frame.request_id, Bytes::new());
                    if self.out.send(pong).await.is_err() {
                        return CloseReason::Local;
                    }
                }
                kind => {
                    return CloseReason::Protocol(ProtocolError::UnexpectedFrameKind {
                        kind: kind.name(),
                    })
                }
            }
        }
    }
}

/// Runs the handler on one request and queues its answer. A panic in the handler becomes an
/// error frame, so the caller learns at once instead of waiting for its timeout.
async fn answer<H: Handler>(
    handler: Arc<H>,
    peer: NodeId,
    request: Frame,
    max_payload_bytes: u32,
    out: mpsc::Sender<Frame>,
    _slot: OwnedSemaphorePermit,
) {
    let id = request.request_id;
    let outcome = AssertUnwindSafe(handler.handle(peer, request.payload))
        .catch_unwind()
        .await;
    let response = match outcome {
        Ok(Ok(payload)) if payload.len() <= max_payload_bytes as usize => {
            Frame::new(FrameKind::Response, id, payload)
        }
        Ok(Ok(payload)) => {
            tracing::error!(%peer, request = %id, len = payload.len(), "handler's response exceeds the frame limit");
            let message = format!(
                "response of {} bytes exceeds the frame limit of {max_payload_bytes}",
                payload.len()
            );
            Frame::error(
                id,
                &RemoteError::new(RemoteError::RESPONSE_TOO_LARGE, message),
            )
        }
        Ok(Err(error)) => Frame::error(id, &error),
        Err(_) => {
            tracing::error!(%peer, request = %id, "handler panicked");
            Frame::error(
                id,
                &RemoteError::new(RemoteError::HANDLER_PANICKED, "handler panicked"),
            )
        }
    };
    // Fails only when the connection is closing; the caller learns that from it.
    let _ = out.send(response).await;
}

async fn write_responses<W: AsyncWrite + Unpin>(
    mut writer: W,
    mut frames: mpsc::Receiver<Frame>,
    stall_timeout: Duration,
) -> CloseReason {
    let mut batch = BytesMut::new();
    while let Some(frame) = frames.recv().await {
        let mut full = add_to_batch(&mut batch, &frame);
        while !full {
            match frames.try_recv() {
                Ok(frame) => full = add_to_batch(&mut batch, &frame),
                Err(_) => break,
            }
        }
        if let Err(reason) = write_batch(&mut writer, &mut batch, stall_timeout).await {
            return reason;
        }
    }
    // The reader holds a sender until it returns, and the select ends with it.
    unreachable!("response queue closed while the reader runs")
}

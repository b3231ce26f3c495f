//! The calling side of a connection: [`Connection`] handles and the event loop behind them.
//!
//! One task (the loop) owns the socket's write half, the map of pending requests and the
//! ping state; a second task owns the read half and hands it decoded frames. Callers talk to
//! the loop by message. The only state callers share is the in-flight semaphore and the close
//! reason, written once.

use crate::error::{CloseReason, ProtocolError, TransportError};
use crate::framed::{add_to_batch, write_batch, FrameReader};
use crate::handshake::Negotiated;
use crate::ids::{NodeId, RequestId};
use crate::limits::TransportLimits;
use crate::task::AbortOnDrop;
use crate::wire::frame::{decode_error_payload, Frame, FrameKind};
use bytes::{Bytes, BytesMut};
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{mpsc, oneshot, Semaphore};
use tokio::time::{Instant, MissedTickBehavior};

type Reply = oneshot::Sender<Result<Bytes, TransportError>>;

/// One call on its way to the loop.
struct Call {
    payload: Bytes,
    reply: Reply,
}

/// What the loop and the handles share.
struct Status {
    /// One permit per request that may be in flight: the backpressure on callers.
    slots: Semaphore,
    /// Why the connection ended; set once, by the loop, before it fails the pending calls.
    closed: OnceLock<CloseReason>,
}

/// A connection to one peer node, on which many calls can be in flight at once. Cheap to
/// clone; the connection closes when the last clone is dropped.
#[derive(Clone)]
pub struct Connection {
    inner: Arc<Handle>,
}

struct Handle {
    calls: mpsc::Sender<Call>,
    status: Arc<Status>,
    peer: NodeId,
    max_payload_bytes: u32,
    max_in_flight_requests: u32,
    default_timeout: Duration,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("peer", &self.inner.peer)
            .field("closed", &self.close_reason())
            .finish()
    }
}

impl Connection {
    /// Starts the connection's tasks on an authenticated stream.
    pub(crate) fn start<R, W>(
        reader: R,
        writer: W,
        negotiated: Negotiated,
        limits: &TransportLimits,
    ) -> Connection
    where
        R: AsyncRead + Unpin + Send + 'static,
        W: AsyncWrite + Unpin + Send + 'static,
    {
        let max_in_flight =
            usize::try_from(negotiated.max_in_flight_requests).expect("u32 fits usize");
        let status = Arc::new(Status {
            slots: Semaphore::new(max_in_flight),
            closed: OnceLock::new(),
        });
        let queue_frames = usize::try_from(limits.send_queue_frames).expect("u32 fits usize");
        let (calls, call_rx) = mpsc::channel(queue_frames);
        // Unbounded, yet bounded in practice: this reader forwards only responses, errors and
        // pongs, one per request or ping this side wrote, and the server answers no faster
        // than it reads. It must never wait, or a server blocked on writing responses could
        // stop reading the requests this side is blocked on writing.
        let (inbound, inbound_rx) = mpsc::unbounded_channel();
        let frames = FrameReader::new(reader, negotiated.max_frame_payload_bytes);
        let reader_task = AbortOnDrop(tokio::spawn(forward_frames(frames, inbound)));
        let event_loop = ClientLoop {
            writer,
            out: BytesMut::new(),
            pending: HashMap::new(),
            last_issued: RequestId(0),
            ping_seq: 0,
            last_received: Instant::now(),
            late_responses: 0,
            max_in_flight,
            ping_interval: limits.ping_interval(),
            idle_timeout: limits.idle_timeout(),
            status: Arc::clone(&status),
            peer: negotiated.peer,
        };
        tokio::spawn(event_loop.run(call_rx, inbound_rx, reader_task));
        Connection {
            inner: Arc::new(Handle {
                calls,
                status,
                peer: negotiated.peer,
                max_payload_bytes: negotiated.max_frame_payload_bytes,
                max_in_flight_requests: negotiated.max_in_flight_requests,
                default_timeout: limits.request_timeout(),
            }),
        }
    }

    /// Sends `payload` as a request and waits for its response, for at most `timeout` in all
    /// (waiting for an in-flight slot included). A timed-out call leaves the connection
    /// usable; errors for which [`TransportError::is_connection_lost`] holds do not.
    pub async fn call(&self, payload: Bytes, timeout: Duration) -> Result<Bytes, TransportError> {
        let max = self.inner.max_payload_bytes;
        if payload.len() > max as usize {
            return Err(TransportError::PayloadTooLarge {
                len: payload.len(),
                max,
            });
        }
        let timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        match tokio::time::timeout(timeout, self.call_unbounded(payload)).await {
            Ok(result) => result,
            Err(_) => Err(TransportError::Timeout { timeout_ms }),
        }
    }

    /// [`Connection::call`] with the limits' `request_timeout_ms`.
    pub async fn call_default(&self, payload: Bytes) -> Result<Bytes, TransportError> {
        self.call(payload, self.inner.default_timeout).await
    }

    async fn call_unbounded(&self, payload: Bytes) -> Result<Bytes, TransportError> {
        let _slot = self
            .inner
            .status
            .slots
            .acquire()
            .await
            .map_err(|_| self.closed_error())?;
        let (reply, response) = oneshot::channel();
        self.inner
            .calls
            .send(Call { payload, reply })
            .await
            .map_err(|_| self.closed_error())?;
        response.await.map_err(|_| self.closed_error())?
    }

    fn closed_error(&self) -> TransportError {
        self.close_reason()
            .map_or(TransportError::PeerClosed, TransportError::from)
    }

    /// The node at the other end, as authenticated by the handshake.
    pub fn peer(&self) -> NodeId {
        self.inner.peer
    }

    /// Why the connection ended, once it has.
    pub fn close_reason(&self) -> Option<CloseReason> {
        self.inner.status.closed.get().cloned()
    }

    pub fn is_closed(&self) -> bool {
        self.inner.status.closed.get().is_some()
    }

    /// Calls holding an in-flight slot now.
    pub fn in_flight(&self) -> usize {
        self.inner.max_in_flight_requests as usize - self.inner.status.slots.available_permits()
    }

    /// This connection's in-flight limit: the smaller of the two sides'.
    pub fn max_in_flight_requests(&self) -> u32 {
        self.inner.max_in_flight_requests
    }

    /// This connection's frame payload limit: the smaller of the two sides'.
    pub fn max_frame_payload_bytes(&self) -> u32 {
        self.inner.max_payload_bytes
    }
}

async fn forward_frames<R: AsyncRead + Unpin>(
    mut frames: FrameReader<R>,
    inbound: mpsc::UnboundedSender<Result<Frame, CloseReason>>,
) {
    loop {
        let next = frames.next_frame().await;
        let end = next.is_err();
        if inbound.send(next).is_err() || end {
            return;
        }
    }
}

/// One event the loop applies.
enum Event {
    Call(Call),
    Inbound(Frame),
    Tick,
}

struct ClientLoop<W> {
    writer: W,
    /// Frames encoded and not yet written.
    out: BytesMut,
    pending: HashMap<RequestId, Reply>,
    last_issued: RequestId,
    /// Sequence number of the last ping sent.
    ping_seq: u64,
    last_received: Instant,
    /// Responses that arrived after their caller gave up.
    late_responses: u64,
    max_in_flight: usize,
    ping_interval: Duration,
    idle_timeout: Duration,
    status: Arc<Status>,
    peer: NodeId,
}

impl<W: AsyncWrite + Unpin> ClientLoop<W> {
    async fn run(
        mut self,
        mut calls: mpsc::Receiver<Call>,
        mut inbound: mpsc::UnboundedReceiver<Result<Frame, CloseReason>>,
        _reader_task: AbortOnDrop<()>,
    ) {
        let reason = self.run_until_closed(&mut calls, &mut inbound).await;
        tracing::debug!(peer = %self.peer, %reason, late_responses = self.late_responses, "connection closed");
        self.status
            .closed
            .set(reason.clone())
            .expect("only the loop closes the connection");
        self.status.slots.close();
        for (_, reply) in self.pending.drain() {
            let _ = reply.send(Err(TransportError::from(reason.clone())));
        }
    }

    async fn run_until_closed(
        &mut self,
        calls: &mut mpsc::Receiver<Call>,
        inbound: &mut mpsc::UnboundedReceiver<Result<Frame, CloseReason>>,
    ) -> CloseReason {
        let mut tick = tokio::time::interval(self.ping_interval);
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            let event = tokio::select! {
                biased;
                frame = inbound.recv() => match frame {
                    Some(Ok(frame)) => Event::Inbound(frame),
                    Some(Err(reason)) => return reason,
                    None => return CloseReason::PeerClosed,
                },
                call = calls.recv() => match call {
                    Some(call) => Event::Call(call),
                    None => return CloseReason::Local,
                },
                _ = tick.tick() => Event::Tick,
            };
            if let Err(reason) = self.apply(event, calls).await {
                return reason;
            }
        }
    }

    async fn apply(
        &mut self,
        event: Event,
        calls: &mut mpsc::Receiver<Call>,
    ) -> Result<(), CloseReason> {
        match event {
            Event::Call(call) => {
                let mut full = self.issue(call);
                // Gather what else is queued into the same write.
                while !full {
                    match calls.try_recv() {
                        Ok(call) => full = self.issue(call),
                        Err(_) => break,
                    }
                }
                self.flush().await
            }
            Event::Inbound(frame) => self.receive(frame),
            Event::Tick => self.tick().await,
        }
    }

    /// Assigns the call an id and encodes it; true when the write batch is full.
    fn issue(&mut self, call: Call) -> bool {
        if call.reply.is_closed() {
            return false; // The caller gave up while queued.
        }
        let id = self.last_issued.next();
        self.last_issued = id;
        let full = add_to_batch(
            &mut self.out,
            &Frame::new(FrameKind::Request, id, call.payload),
        );
        let previous = self.pending.insert(id, call.reply);
        assert!(previous.is_none(), "request id {id} issued twice");
        if self.pending.len() > 2 * self.max_in_flight {
            self.forget_abandoned();
        }
        full
    }

    /// Drops the entries of callers that gave up (timed out). Each live entry's caller holds
    /// an in-flight slot, so what remains is bounded by the limit (twice it, for callers
    /// between releasing their slot and dropping their receiver on another thread).
    fn forget_abandoned(&mut self) {
        self.pending.retain(|_, reply| !reply.is_closed());
        assert!(
            self.pending.len() <= 2 * self.max_in_flight,
            "{} pending requests, limit {}",
            self.pending.len(),
            self.max_in_flight
        );
    }

    async fn flush(&mut self) -> Result<(), CloseReason> {
        if self.out.is_empty() {
            return Ok(());
        }
        write_batch(&mut self.writer, &mut self.out, self.idle_timeout).await
    }

    fn receive(&mut self, frame: Frame) -> Result<(), CloseReason> {
        self.last_received = Instant::now();
        match frame.kind {
            FrameKind::Response => self.resolve(frame.request_id, Ok(frame.payload)),
            FrameKind::Error => {
                let error = decode_error_payload(&frame.payload).map_err(CloseReason::Protocol)?;
                self.resolve(frame.request_id, Err(TransportError::Remote(error)))
            }
            // A pong's only news is that the peer is alive, recorded above.
            FrameKind::Pong => Ok(()),
            FrameKind::Request | FrameKind::Ping => {
                Err(CloseReason::Protocol(ProtocolError::UnexpectedFrameKind {
                    kind: frame.kind.name(),
                }))
            }
        }
    }

    fn resolve(
        &mut self,
        id: RequestId,
        result: Result<Bytes, TransportError>,
    ) -> Result<(), CloseReason> {
        if id > self.last_issued {
            return Err(CloseReason::Protocol(ProtocolError::UnknownRequestId(id)));
        }
        match self.pending.remove(&id) {
            // The caller may have given up just now; nothing to do then.
            Some(reply) => drop(reply.send(result)),
            None => self.late_responses += 1,
        }
        Ok(())
    }

    /// Every ping interval: forget abandoned calls, close an idle connection, or ping a quiet
    /// one. A quiet connection is pinged on every tick, so a lost ping or pong costs one
    /// interval, not the connection.
    async fn tick(&mut self) -> Result<(), CloseReason> {
        self.forget_abandoned();
        let quiet = self.last_received.elapsed();
        if quiet >= self.idle_timeout {
            return Err(CloseReason::Idle {
                idle_ms: u64::try_from(quiet.as_millis()).unwrap_or(u64::MAX),
            });
        }
        if quiet >= self.ping_interval {
            self.ping_seq += 1;
            add_to_batch(
                &mut self.out,
                &Frame::new(FrameKind::Ping, RequestId(self.ping_seq), Bytes::new()),
            );
            self.flush().await?;
        }
        Ok(())
    }
}

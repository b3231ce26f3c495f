//! One direction of a simulated connection: an ordered queue of segments, each delivered at
//! its time. A segment is what one `write` call handed over, whole: the transport writes
//! whole frames, so dropping a segment loses frames without corrupting the stream.

use super::network::SimNetwork;
use crate::faults::Fate;
use bytes::{Buf, Bytes};
use std::collections::VecDeque;
use std::future::Future;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// Bytes one direction holds before its writer waits: the simulated socket buffers.
pub const PIPE_BUFFER_BYTES: usize = 1 << 20;

struct Segment {
    deliver_at: Instant,
    data: Bytes,
}

#[derive(Default)]
struct PipeState {
    segments: VecDeque<Segment>,
    queued_bytes: usize,
    last_deliver_at: Option<Instant>,
    writer_closed: bool,
    reader_closed: bool,
    reset: bool,
    reader_waker: Option<Waker>,
    writer_waker: Option<Waker>,
}

/// One direction, `from` → `to`.
pub struct Pipe {
    pub from: IpAddr,
    pub to: IpAddr,
    state: Mutex<PipeState>,
}

fn wake(waker: Option<Waker>) {
    if let Some(waker) = waker {
        waker.wake();
    }
}

impl Pipe {
    pub fn new(from: IpAddr, to: IpAddr) -> Arc<Pipe> {
        Arc::new(Pipe {
            from,
            to,
            state: Mutex::new(PipeState::default()),
        })
    }

    fn lock(&self) -> MutexGuard<'_, PipeState> {
        self.state.lock().expect("sim pipe lock poisoned")
    }

    /// Both ends fail from now on with ECONNRESET.
    pub fn reset(&self) {
        let (reader, writer) = {
            let mut state = self.lock();
            state.reset = true;
            state.segments.clear();
            state.queued_bytes = 0;
            (state.reader_waker.take(), state.writer_waker.take())
        };
        wake(reader);
        wake(writer);
    }

    fn close_writer(&self) {
        let reader = {
            let mut state = self.lock();
            state.writer_closed = true;
            state.reader_waker.take()
        };
        wake(reader);
    }

    fn close_reader(&self) {
        let writer = {
            let mut state = self.lock();
            state.reader_closed = true;
            state.segments.clear();
            state.queued_bytes = 0;
            state.writer_waker.take()
        };
        wake(writer);
    }
}

/// The reading end of a [`Pipe`].
pub struct SimReader {
    pipe: Arc<Pipe>,
    /// Wakes the reader when the front segment is due.
    sleep: Option<Pin<Box<Sleep>>>,
}

impl SimReader {
    pub fn new(pipe: Arc<Pipe>) -> SimReader {
        SimReader { pipe, sleep: None }
    }
}

impl Drop for SimReader {
    fn drop(&mut self) {
        self.pipe.close_reader();
    }
}

impl AsyncRead for SimReader {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            let due = {
                let mut state = self.pipe.lock();
                if state.reset {
                    return Poll::Ready(Err(io::ErrorKind::ConnectionReset.into()));
                }
                state.reader_waker = Some(cx.waker().clone());
                let writer_closed = state.writer_closed;
                let Some(front) = state.segments.front_mut() else {
                    return if writer_closed {
                        Poll::Ready(Ok(()))
                    } else {
                        Poll::Pending
                    };
                };
                if front.deliver_at > Instant::now() {
                    front.deliver_at
                } else {
                    let n = front.data.len().min(buf.remaining());
                    buf.put_slice(&front.data[..n]);
                    front.data.advance(n);
                    if front.data.is_empty() {
                        state.segments.pop_front();
                    }
                    state.queued_bytes -= n;
                    let writer = state.writer_waker.take();
                    drop(state);
                    wake(writer);
                    return Poll::Ready(Ok(()));
                }
            };
            let sleep = self
                .sleep
                .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(due)));
            sleep.as_mut().reset(due);
            if sleep.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
        }
    }
}

/// The writing end of a [`Pipe`].
pub struct SimWriter {
    pipe: Arc<Pipe>,
    network: SimNetwork,
}

impl SimWriter {
    pub fn new(pipe: Arc<Pipe>, network: SimNetwork) -> SimWriter {
        SimWriter { pipe, network }
    }
}

impl SimWriter {
    /// `Some` when a write of `len` bytes cannot go ahead now: an error, or `Pending` with
    /// the waker stored until the reader makes room.
    fn check_writable(&self, cx: &mut Context<'_>, len: usize) -> Option<Poll<io::Result<usize>>> {
        let mut state = self.pipe.lock();
        if state.reset {
            return Some(Poll::Ready(Err(io::ErrorKind::ConnectionReset.into())));
        }
        if state.reader_closed || state.writer_closed {
            return Some(Poll::Ready(Err(io::ErrorKind::BrokenPipe.into())));
        }
        if state.queued_bytes > 0 && state.queued_bytes + len > PIPE_BUFFER_BYTES {
            state.writer_waker = Some(cx.waker().clone());
            return Some(Poll::Pending);
        }
        None
    }
}

impl Drop for SimWriter {
    fn drop(&mut self) {
        self.pipe.close_writer();
    }
}

impl AsyncWrite for SimWriter {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        if let Some(blocked) = self.check_writable(cx, data.len()) {
            return blocked;
        }
        // Drawn only for a write that goes ahead (so a retried write draws once), and without
        // the pipe's lock: the network's lock comes first everywhere. The pipe can only have
        // drained in between: this writer is its only one.
        let fate = self.network.fate(self.pipe.from, self.pipe.to);
        let Fate::Deliver { delay } = fate else {
            return Poll::Ready(Ok(data.len())); // Lost on the way.
        };
        let mut state = self.pipe.lock();
        // In order, like TCP: never before the segment ahead of it.
        let at = Instant::now() + delay;
        let deliver_at = state.last_deliver_at.map_or(at, |last| last.max(at));
        state.last_deliver_at = Some(deliver_at);
        state.segments.push_back(Segment {
            deliver_at,
            data: Bytes::copy_from_slice(data),
        });
        state.queued_bytes += data.len();
        let reader = state.reader_waker.take();
        drop(state);
        wake(reader);
        Poll::Ready(Ok(data.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.pipe.close_writer();
        Poll::Ready(Ok(()))
    }
}

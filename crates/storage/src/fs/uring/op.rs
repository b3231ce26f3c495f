//! The futures of one operation: [`Acquire`] (admission: an in-flight slot and a bounce
//! buffer), [`Op`] (one submitted operation) and [`OwnedGrant`] (what is held between them).
//! They are `!Send`: they refer to the ring of the thread that created them.

use super::pool::{AlignedBuf, Grant};
use super::ring::{with_existing_ring, with_ring, Urgency, Waiter};
use super::UringConfig;
use crate::fs::DiskBuf;
use io_uring::squeue;
use std::fs::File;
use std::future::Future;
use std::io;
use std::marker::PhantomData;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;
use std::task::{Context, Poll};

type NotSend = PhantomData<*const ()>;

fn ring_gone() -> io::Error {
    io::Error::other("io_uring of this thread is gone")
}

/// The caller's side of a [`Grant`]: an admitted operation's slot and bounce buffer. Dropping
/// it gives both back.
pub(super) struct OwnedGrant {
    grant: Option<Grant>,
    _not_send: NotSend,
}

impl OwnedGrant {
    fn new(grant: Grant) -> OwnedGrant {
        OwnedGrant {
            grant: Some(grant),
            _not_send: PhantomData,
        }
    }

    fn buf_ref(&self) -> Option<&AlignedBuf> {
        self.grant.as_ref().and_then(|g| g.buf.as_ref())
    }

    /// The bounce buffer (empty for a grant of 0 bytes).
    pub(super) fn buf(&self) -> &[u8] {
        self.buf_ref().map(AlignedBuf::as_slice).unwrap_or(&[])
    }

    pub(super) fn buf_mut(&mut self) -> &mut [u8] {
        match self.grant.as_mut().and_then(|g| g.buf.as_mut()) {
            Some(buf) => buf.as_mut_slice(),
            None => &mut [],
        }
    }

    /// Hands the grant `target` to read into (see [`Grant::target`]).
    pub(super) fn set_target(&mut self, target: DiskBuf) {
        let grant = self.grant.as_mut().expect("grant not yet used");
        assert!(grant.target.is_none(), "grant already has a read target");
        grant.target = Some(target);
    }

    /// Takes back the read target.
    pub(super) fn take_target(&mut self) -> Option<DiskBuf> {
        self.grant.as_mut().and_then(|g| g.target.take())
    }

    /// Address of byte `at` of the read target, for the kernel.
    pub(super) fn target_ptr_at(&mut self, at: usize) -> *mut u8 {
        self.grant
            .as_mut()
            .and_then(|g| g.target.as_mut())
            .expect("grant has a read target")
            .as_mut_ptr_at(at)
    }

    /// Hands the grant the data a write sends (see [`Grant::source`]).
    pub(super) fn set_source(&mut self, source: bytes::Bytes) {
        let grant = self.grant.as_mut().expect("grant not yet used");
        assert!(grant.source.is_none(), "grant already has a write source");
        grant.source = Some(source);
    }

    /// Address of byte `at` of the write source, for the kernel, which only reads there.
    pub(super) fn source_ptr_at(&mut self, at: usize) -> *const u8 {
        let source = self
            .grant
            .as_ref()
            .and_then(|g| g.source.as_ref())
            .expect("grant has a write source");
        assert!(at <= source.len());
        // SAFETY: `at` is within the bytes (checked above).
        unsafe { source.as_ptr().add(at) }
    }

    /// Address of byte `at` of the bounce buffer, for the kernel.
    pub(super) fn ptr_at(&mut self, at: usize) -> *mut u8 {
        let buf = self
            .grant
            .as_mut()
            .and_then(|g| g.buf.as_mut())
            .expect("grant has a buffer");
        assert!(at <= buf.len());
        // SAFETY: `at` is within the allocation (checked above).
        unsafe { buf.as_mut_ptr().add(at) }
    }
}

impl Drop for OwnedGrant {
    fn drop(&mut self) {
        if let Some(grant) = self.grant.take() {
            // At thread exit the ring is gone: the grant's buffer is simply freed.
            with_existing_ring(|ring| ring.release(grant));
        }
    }
}

/// Waits for an in-flight slot and a bounce buffer of at least `bytes` (none for 0), in FIFO
/// order with the thread's other waiters.
pub(super) fn acquire(config: &UringConfig, bytes: usize) -> Acquire {
    Acquire {
        config: *config,
        bytes,
        waiter: None,
        _not_send: PhantomData,
    }
}

pub(super) struct Acquire {
    config: UringConfig,
    bytes: usize,
    waiter: Option<Rc<Waiter>>,
    _not_send: NotSend,
}

impl Future for Acquire {
    type Output = io::Result<OwnedGrant>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let polled = with_ring(&this.config, |ring| {
            let waiter = match &this.waiter {
                Some(waiter) => waiter.clone(),
                None => match ring.admit(this.bytes) {
                    Ok(grant) => return Poll::Ready(Ok(grant)),
                    Err(waiter) => this.waiter.insert(waiter).clone(),
                },
            };
            ring.poll_admission(&waiter, cx)
        });
        match polled {
            Ok(Poll::Ready(Ok(grant))) => {
                this.waiter = None;
                Poll::Ready(Ok(OwnedGrant::new(grant)))
            }
            Ok(Poll::Ready(Err(e))) | Err(e) => Poll::Ready(Err(e)),
            Ok(Poll::Pending) => Poll::Pending,
        }
    }
}

impl Drop for Acquire {
    fn drop(&mut self) {
        let Some(waiter) = self.waiter.take() else {
            return;
        };
        with_existing_ring(|ring| ring.cancel_admission(&waiter));
    }
}

/// One operation submitted to this thread's ring; resolves to the kernel's result (a byte
/// count or `-errno`) and the grant it was submitted with.
pub(super) struct Op {
    index: usize,
    finished: bool,
    _not_send: NotSend,
}

impl Op {
    /// Submits `entry`, moving `grant` and `file` into the ring until its completion.
    ///
    /// # Safety
    /// Every pointer in `entry` must point into `grant`'s bounce buffer or read target (or to
    /// memory that otherwise outlives the operation), and its fd must be `file`'s.
    pub(super) unsafe fn start(
        entry: squeue::Entry,
        mut grant: OwnedGrant,
        file: Arc<File>,
        urgency: Urgency,
    ) -> io::Result<Op> {
        let grant = grant.grant.take().expect("grant not yet used");
        // SAFETY: passed on from our caller.
        let index = with_existing_ring(|ring| unsafe { ring.submit(entry, grant, file, urgency) })
            .ok_or_else(ring_gone)??;
        Ok(Op {
            index,
            finished: false,
            _not_send: PhantomData,
        })
    }
}

impl Future for Op {
    type Output = io::Result<(i32, OwnedGrant)>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        assert!(!this.finished, "Op polled after completion");
        let polled = with_existing_ring(|ring| ring.poll_op(this.index, cx))
            .unwrap_or_else(|| Poll::Ready(Err(ring_gone())));
        match polled {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Ok((result, grant))) => {
                this.finished = true;
                Poll::Ready(Ok((result, OwnedGrant::new(grant))))
            }
            // Drop abandons the operation; the ring keeps its buffer until it completes.
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
        }
    }
}

impl Drop for Op {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        with_existing_ring(|ring| ring.abandon_op(self.index));
        self.finished = true;
    }
}

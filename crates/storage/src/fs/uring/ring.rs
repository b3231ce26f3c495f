//! The thread's io_uring: its slots of operations in flight, its admission queue, and how the
//! futures of `op.rs` ([`super::op::Acquire`], [`super::op::Op`]) wait on it.
//!
//! There is no driver task. The ring's fd is registered with the thread's tokio runtime
//! (`AsyncFd`), and whichever future is waiting registers its own waker there; tokio keeps only
//! the most recent one, so that future is the *leader*. Any poll of any waiting future first
//! reaps the completion queue (no syscall) and wakes the futures whose operations finished. A
//! leader that finishes or is dropped wakes another waiting future, which becomes the leader
//! on its next poll. So while any future waits, one of them will be woken by the next
//! completion, and the rest are woken by its reap: no task, no `LocalSet`, no thread hop.
//!
//! Cancel-safety: an operation's buffer, in-flight slot and file descriptor move into its slot
//! in the ring when it is submitted. The future gets them back only from a completed slot; if
//! the future is dropped first, the slot keeps them until the completion arrives (reaped by
//! any later poll or by [`reap_completions`]), and only then is the buffer reused. A thread
//! that exits with operations in flight waits for them before its ring and buffers go.

use super::pool::{Grant, Pool};
use super::UringConfig;
use io_uring::{squeue, IoUring};
use std::cell::RefCell;
use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::rc::Rc;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

thread_local! {
    static RING: RefCell<Option<Ring>> = const { RefCell::new(None) };
    static SUBMITTER: RefCell<Submitter> = const {
        RefCell::new(Submitter { running: false, waker: None })
    };
}

/// Submissions queued at once before one is made without waiting for the submitter: bounds
/// the delay a long turn of the thread adds to the first of them.
const DEFERRED_SUBMISSIONS_LIMIT: usize = 64;

/// When an operation goes to the kernel while a submitter runs on the thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Urgency {
    /// With the others its thread starts in the same turn.
    Batched,
    /// At once (with whatever is queued before it): someone waits on just this one.
    Now,
}

/// The thread's submitter task ([`run_submitter`]), if one runs.
struct Submitter {
    running: bool,
    /// Set while the task waits; taken (and woken) when an operation is queued.
    waker: Option<Waker>,
}

/// Hands this thread's queued operations to the kernel, one `io_uring_enter` for every batch,
/// for as long as it runs (see [`super::run_submitter`]).
pub(super) async fn run_submitter() {
    /// Ends the deferral when the task is dropped, and submits what is queued.
    struct Running;
    impl Drop for Running {
        fn drop(&mut self) {
            let _ = SUBMITTER.try_with(|submitter| {
                let mut submitter = submitter.borrow_mut();
                submitter.running = false;
                submitter.waker = None;
            });
            with_existing_ring(Ring::flush);
        }
    }
    let already =
        SUBMITTER.with(|submitter| std::mem::replace(&mut submitter.borrow_mut().running, true));
    if already {
        // One per thread: the first keeps submitting.
        return;
    }
    let _running = Running;
    std::future::poll_fn(|cx| {
        SUBMITTER.with(|submitter| submitter.borrow_mut().waker = Some(cx.waker().clone()));
        let unsubmitted = with_existing_ring(|ring| {
            ring.flush();
            ring.state.unsubmitted
        });
        if unsubmitted == Some(true) {
            // The kernel took only part: try again on the next turn.
            cx.waker().wake_by_ref();
        }
        std::task::Poll::<()>::Pending
    })
    .await
}

/// Whether a submitter runs on this thread.
fn submitter_running() -> bool {
    SUBMITTER
        .try_with(|submitter| submitter.borrow().running)
        .unwrap_or(false)
}

/// Runs `f` on this thread's ring, creating the ring with `config` on first use, then wakes
/// the futures `f` completed (after the ring is released, so a waker may do anything).
pub(super) fn with_ring<R>(config: &UringConfig, f: impl FnOnce(&mut Ring) -> R) -> io::Result<R> {
    let (out, wake) = RING.with(|cell| -> io::Result<_> {
        let mut slot = cell.borrow_mut();
        let ring = match slot.as_mut() {
            Some(ring) => ring,
            None => slot.insert(Ring::new(config)?),
        };
        let out = f(ring);
        Ok((out, std::mem::take(&mut ring.state.to_wake)))
    })?;
    wake.into_iter().for_each(Waker::wake);
    Ok(out)
}

/// Like [`with_ring`] but never creates the ring, and does nothing (returns `None`) when the
/// ring is gone (thread exit) or busy: for destructors and the reactor's spin loop.
pub(super) fn with_existing_ring<R>(f: impl FnOnce(&mut Ring) -> R) -> Option<R> {
    let (out, wake) = RING
        .try_with(|cell| {
            let mut slot = cell.try_borrow_mut().ok()?;
            let ring = slot.as_mut()?;
            let out = f(ring);
            Some((out, std::mem::take(&mut ring.state.to_wake)))
        })
        .ok()??;
    wake.into_iter().for_each(Waker::wake);
    Some(out)
}

/// Reaps this thread's completion queue and wakes the futures whose operations finished;
/// returns how many completions it reaped. See [`super::reap_completions`].
pub(super) fn reap_completions() -> usize {
    with_existing_ring(|ring| {
        ring.flush();
        if ring.uring.submission().taskrun() {
            // Completions wait as task work (COOP_TASKRUN): one enter runs it.
            let _ = ring.uring.submit();
        }
        ring.reap()
    })
    .unwrap_or(0)
}

/// Counters of this thread's ring, if this thread has one.
pub(super) fn thread_stats() -> Option<super::UringThreadStats> {
    with_existing_ring(|ring| super::UringThreadStats {
        ring_entries: ring.uring.params().sq_entries(),
        in_flight_ops: ring.state.pool.in_flight(),
        max_in_flight_ops: ring.state.pool.max_in_flight(),
        waiting_for_admission: ring.state.waiters.len(),
        bounce_bytes_allocated: ring.state.pool.allocated_bytes(),
        bounce_bytes_limit: ring.state.pool.limit_bytes(),
        submit_calls: ring.state.submit_calls,
        entries_submitted: ring.state.entries_submitted,
    })
}

struct RingFd(RawFd);

impl AsRawFd for RingFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

/// What the kernel may use while an operation is in flight.
struct Held {
    grant: Grant,
    _file: Arc<File>,
}

enum Slot {
    Vacant,
    /// Submitted; its future waits (with the waker of its latest poll).
    Waiting {
        waker: Option<Waker>,
        held: Held,
    },
    Done {
        result: i32,
        held: Held,
    },
    /// Its future was dropped; the ring keeps `held` until the completion arrives.
    Abandoned {
        held: Held,
    },
}

/// Who registered its waker on the ring's fd last.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Leader {
    Op(usize),
    Waiter(u64),
}

/// A future waiting for admission.
pub(super) struct Waiter {
    id: u64,
    bytes: usize,
    waker: RefCell<Option<Waker>>,
    grant: RefCell<Option<Grant>>,
}

pub(super) struct Ring {
    /// The ring's fd registered with the runtime this thread runs now (declared before
    /// `uring`, so it is dropped first).
    notifier: Option<(tokio::runtime::Id, AsyncFd<RingFd>)>,
    uring: IoUring,
    state: State,
}

/// Everything but the ring itself, so completions can be applied while the completion queue
/// is borrowed.
struct State {
    slots: Vec<Slot>,
    vacant: Vec<usize>,
    pool: Pool,
    waiters: VecDeque<Rc<Waiter>>,
    next_waiter_id: u64,
    leader: Option<Leader>,
    to_wake: Vec<Waker>,
    /// Operations handed to the ring whose completion has not been reaped.
    in_kernel: usize,
    /// Submissions the kernel has not taken yet (it refused for now); retried on every poll.
    unsubmitted: bool,
    /// `io_uring_enter` calls that submitted something, and the entries they submitted.
    submit_calls: u64,
    entries_submitted: u64,
    submit_error_logged: bool,
}

impl Ring {
    fn new(config: &UringConfig) -> io::Result<Ring> {
        let entries = config.ring_entries;
        // Completions are posted as task work run when the thread next enters the kernel
        // (no interrupt of a running reactor per completion); the TASKRUN flag tells
        // `reap_completions` when that is pending. SUBMIT_ALL: one bad entry does not hold back
        // the rest. Older kernels without these flags get a plain ring.
        let uring = IoUring::builder()
            .setup_coop_taskrun()
            .setup_taskrun_flag()
            .setup_single_issuer()
            .setup_submit_all()
            .build(entries)
            .or_else(|_| IoUring::new(entries))?;
        if (config.max_in_flight_ops as u64) > u64::from(uring.params().sq_entries()) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "max_in_flight_ops exceeds the ring's submission queue",
            ));
        }
        Ok(Ring {
            uring,
            state: State {
                slots: Vec::new(),
                vacant: Vec::new(),
                pool: Pool::new(config.bounce_pool_bytes, config.max_in_flight_ops),
                waiters: VecDeque::new(),
                next_waiter_id: 0,
                leader: None,
                to_wake: Vec::new(),
                in_kernel: 0,
                unsubmitted: false,
                submit_calls: 0,
                entries_submitted: 0,
                submit_error_logged: false,
            },
            notifier: None,
        })
    }

    /// Applies every completion in the queue; returns how many.
    fn reap(&mut self) -> usize {
        let mut count = 0;
        for cqe in self.uring.completion() {
            count += 1;
            self.state.complete(cqe.user_data() as usize, cqe.result());
        }
        count
    }

    /// Hands queued submissions to the kernel.
    fn flush(&mut self) {
        if self.uring.submission().is_empty() {
            self.state.unsubmitted = false;
            return;
        }
        loop {
            match self.uring.submit() {
                Ok(taken) => {
                    self.state.submit_calls += 1;
                    self.state.entries_submitted += taken as u64;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    let transient = matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EBUSY));
                    if !transient && !self.state.submit_error_logged {
                        self.state.submit_error_logged = true;
                        tracing::error!(error = %e, "io_uring submission failed; will retry");
                    }
                }
            }
            break;
        }
        self.state.unsubmitted = !self.uring.submission().is_empty();
    }

    /// Registers `cx`'s waker for the next completion. `Ready(Ok)` means completions may have
    /// arrived since the last reap (the readiness was consumed: reap, then poll again).
    fn poll_notifier(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return self.block_for_completion(cx);
        };
        let current = self.notifier.as_ref().map(|(id, _)| *id);
        if current != Some(handle.id()) {
            // First wait on this thread, or its runtime changed: register with this one.
            self.notifier = None;
            let fd = RingFd(self.uring.as_raw_fd());
            // SAFETY: the fd is the ring's, open for as long as `self.uring` lives, and the
            // registration (`self.notifier`) is dropped before it (field order, and first
            // thing in `Ring::drop`).
            match unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) } {
                Ok(fd) => self.notifier = Some((handle.id(), fd)),
                Err(e) => return Poll::Ready(Err(e.into())),
            }
        }
        let (_, fd) = self.notifier.as_ref().expect("registered above");
        match fd.poll_read_ready(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Ok(mut guard)) => {
                guard.clear_ready();
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => {
                self.notifier = None;
                Poll::Ready(Err(e))
            }
        }
    }

    /// Outside a tokio runtime nothing would wake us: block the thread until a completion
    /// arrives, if any is due; else ask to be polled again (the operations we wait for are
    /// held by other futures between two steps).
    fn block_for_completion(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.state.in_kernel == 0 {
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        match self.uring.submit_and_wait(1) {
            Ok(_) => Poll::Ready(Ok(())),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Poll::Ready(Ok(())),
            Err(e) => Poll::Ready(Err(e)),
        }
    }

    /// Waits for the next completion as `me`; `done` says when the caller no longer needs to.
    fn wait(
        &mut self,
        cx: &mut Context<'_>,
        me: Leader,
        done: impl Fn(&State) -> bool,
    ) -> Poll<io::Result<()>> {
        loop {
            if done(&self.state) {
                return Poll::Ready(Ok(()));
            }
            match self.poll_notifier(cx) {
                Poll::Pending => {
                    self.state.leader = Some(me);
                    if self.state.unsubmitted {
                        // Nothing will complete what the kernel has not taken: retry soon.
                        cx.waker().wake_by_ref();
                    }
                    return Poll::Pending;
                }
                Poll::Ready(Ok(())) => {
                    self.reap();
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl State {
    fn complete(&mut self, index: usize, result: i32) {
        let Some(slot) = self.slots.get_mut(index) else {
            debug_assert!(false, "completion for unknown slot {index}");
            return;
        };
        match std::mem::replace(slot, Slot::Vacant) {
            Slot::Waiting { waker, held } => {
                *slot = Slot::Done { result, held };
                self.in_kernel -= 1;
                self.to_wake.extend(waker);
            }
            Slot::Abandoned { held } => {
                self.in_kernel -= 1;
                self.vacant.push(index);
                self.release(held.grant);
            }
            other => {
                debug_assert!(false, "completion for a slot that was not in flight");
                *slot = other;
            }
        }
    }

    fn occupy(&mut self, slot: Slot) -> usize {
        match self.vacant.pop() {
            Some(index) => {
                self.slots[index] = slot;
                index
            }
            None => {
                self.slots.push(slot);
                self.slots.len() - 1
            }
        }
    }

    /// Takes back a grant and admits the waiters it makes room for, in order.
    fn release(&mut self, grant: Grant) {
        self.pool.release(grant);
        while let Some(front) = self.waiters.front() {
            let Some(grant) = self.pool.try_grant(front.bytes) else {
                break;
            };
            *front.grant.borrow_mut() = Some(grant);
            self.to_wake.extend(front.waker.borrow_mut().take());
            self.waiters.pop_front();
        }
    }

    /// `leaving` no longer waits: if it was the leader, or nobody leads (a future woken to
    /// take over found its own operation done), wake another waiting future to take over (an
    /// operation's future first, else the first waiter for admission). Without the second
    /// case the lead could end with a future that never waits again, leaving completions
    /// nobody reaps.
    fn hand_off(&mut self, leaving: Leader) {
        if self.leader.is_some() && self.leader != Some(leaving) {
            return;
        }
        self.leader = None;
        let op_waker = self.slots.iter().find_map(|slot| match slot {
            Slot::Waiting {
                waker: Some(waker), ..
            } => Some(waker.clone()),
            _ => None,
        });
        let next = op_waker.or_else(|| {
            self.waiters
                .iter()
                .find_map(|waiter| waiter.waker.borrow().clone())
        });
        self.to_wake.extend(next);
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        // The thread is exiting. Deregister from the runtime, then wait for the kernel to be
        // done with every buffer it was handed before they are freed.
        self.notifier = None;
        loop {
            let in_flight = self
                .state
                .slots
                .iter()
                .any(|slot| matches!(slot, Slot::Waiting { .. } | Slot::Abandoned { .. }));
            if !in_flight {
                break;
            }
            match self.uring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    tracing::error!(error = %e, "io_uring wait at thread exit failed; leaking its buffers");
                    std::mem::forget(std::mem::take(&mut self.state.slots));
                    break;
                }
            }
            self.reap();
        }
        // Futures still waiting are being torn down with the thread: do not wake them.
        self.state.to_wake.clear();
    }
}

/// Operations and admission, for the futures of `op.rs`.
impl Ring {
    /// Queues and submits `entry` (its user data is set here), moving `grant` and `file` into
    /// a slot until its completion is reaped; returns the slot.
    ///
    /// # Safety
    /// Every pointer in `entry` must point into `grant`'s bounce buffer (or to memory that
    /// otherwise outlives the operation), and its fd must be `file`'s.
    pub(super) unsafe fn submit(
        &mut self,
        entry: squeue::Entry,
        grant: Grant,
        file: Arc<File>,
        urgency: Urgency,
    ) -> io::Result<usize> {
        let held = Held { grant, _file: file };
        let index = self.state.occupy(Slot::Waiting { waker: None, held });
        let entry = entry.user_data(index as u64);
        let mut pushed = false;
        for _ in 0..2 {
            // SAFETY: the caller guarantees the entry's pointers point into the grant's
            // buffer, which now belongs to slot `index` and stays there (at a fixed address:
            // only the `AlignedBuf` handle moves) until this entry's completion is reaped. The
            // fd is kept open by the same slot.
            pushed = unsafe { self.uring.submission().push(&entry) }.is_ok();
            if pushed {
                break;
            }
            // Cannot happen (every queued entry holds one of at most `sq_entries` in-flight
            // slots), but if the queue is full, submitting makes room.
            self.flush();
        }
        if !pushed {
            // The kernel never saw the entry: take everything back.
            let Slot::Waiting { held, .. } =
                std::mem::replace(&mut self.state.slots[index], Slot::Vacant)
            else {
                unreachable!("occupied above")
            };
            self.state.vacant.push(index);
            self.state.release(held.grant);
            return Err(io::Error::other("io_uring submission queue full"));
        }
        self.state.in_kernel += 1;
        if urgency == Urgency::Now || !self.defer_flush() {
            self.flush();
        }
        Ok(index)
    }

    /// With a submitter running on this thread and fewer than [`DEFERRED_SUBMISSIONS_LIMIT`]
    /// entries queued, leaves the queued entries to it (waking it) and returns true: the
    /// operations that the thread's tasks start before it runs go in one `io_uring_enter`, and
    /// the block layer gets them as one plugged batch (one doorbell to the device, not one
    /// per write).
    fn defer_flush(&mut self) -> bool {
        if self.uring.submission().len() >= DEFERRED_SUBMISSIONS_LIMIT {
            return false;
        }
        SUBMITTER
            .try_with(|submitter| {
                let mut submitter = submitter.borrow_mut();
                if !submitter.running {
                    return false;
                }
                self.state.to_wake.extend(submitter.waker.take());
                true
            })
            .unwrap_or(false)
    }

    /// The result (a byte count or `-errno`) and grant of the operation in slot `index` once
    /// it completed; until then, `cx` is woken when it may have.
    pub(super) fn poll_op(
        &mut self,
        index: usize,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<(i32, Grant)>> {
        if !submitter_running() {
            self.flush();
        }
        self.reap();
        if let Slot::Waiting { waker, .. } = &mut self.state.slots[index] {
            match waker {
                Some(w) if w.will_wake(cx.waker()) => {}
                _ => *waker = Some(cx.waker().clone()),
            }
        }
        let me = Leader::Op(index);
        let done = |state: &State| matches!(state.slots[index], Slot::Done { .. });
        match self.wait(cx, me, done) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Ready(Ok(())) => {
                self.state.hand_off(me);
                let Slot::Done { result, held } =
                    std::mem::replace(&mut self.state.slots[index], Slot::Vacant)
                else {
                    unreachable!("checked by wait")
                };
                self.state.vacant.push(index);
                Poll::Ready(Ok((result, held.grant)))
            }
        }
    }

    /// The future of the operation in slot `index` is gone before its result was taken: the
    /// slot keeps what the kernel may still use until the completion arrives.
    pub(super) fn abandon_op(&mut self, index: usize) {
        match std::mem::replace(&mut self.state.slots[index], Slot::Vacant) {
            Slot::Waiting { held, .. } => self.state.slots[index] = Slot::Abandoned { held },
            Slot::Done { held, .. } => {
                self.state.vacant.push(index);
                self.state.release(held.grant);
            }
            other => self.state.slots[index] = other,
        }
        self.state.hand_off(Leader::Op(index));
    }

    /// A grant of `bytes` now if nobody waits before us and there is room; else our place in
    /// the queue.
    pub(super) fn admit(&mut self, bytes: usize) -> Result<Grant, Rc<Waiter>> {
        if self.state.waiters.is_empty() {
            if let Some(grant) = self.state.pool.try_grant(bytes) {
                return Ok(grant);
            }
            // Full: completions may be waiting to be reaped.
            self.flush();
            self.reap();
            if let Some(grant) = self.state.pool.try_grant(bytes) {
                return Ok(grant);
            }
        }
        let waiter = Rc::new(Waiter {
            id: self.state.next_waiter_id,
            bytes,
            waker: RefCell::new(None),
            grant: RefCell::new(None),
        });
        self.state.next_waiter_id += 1;
        self.state.waiters.push_back(waiter.clone());
        Err(waiter)
    }

    /// The grant of a queued `waiter` once it has one; until then, `cx` is woken when it may.
    pub(super) fn poll_admission(
        &mut self,
        waiter: &Waiter,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<Grant>> {
        let me = Leader::Waiter(waiter.id);
        *waiter.waker.borrow_mut() = Some(cx.waker().clone());
        self.flush();
        self.reap();
        match self.wait(cx, me, |_| waiter.grant.borrow().is_some()) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(result) => {
                self.state.hand_off(me);
                // On error, the caller cancels its place in the queue.
                result?;
                let grant = waiter.grant.borrow_mut().take().expect("granted");
                Poll::Ready(Ok(grant))
            }
        }
    }

    /// `waiter` leaves the queue (its future is gone), giving back a grant it was handed.
    pub(super) fn cancel_admission(&mut self, waiter: &Rc<Waiter>) {
        self.state.waiters.retain(|w| !Rc::ptr_eq(w, waiter));
        self.state.hand_off(Leader::Waiter(waiter.id));
        if let Some(grant) = waiter.grant.borrow_mut().take() {
            self.state.release(grant);
        }
    }

    /// Takes back a grant that is not in flight.
    pub(super) fn release(&mut self, grant: Grant) {
        self.state.release(grant);
    }
}

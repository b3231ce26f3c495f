//! Write locks on the extents of one egroup: a batch holds the extents it writes, so batches
//! on different extents of one egroup run at once (a 1 MiB sequential stream keeps several
//! whole-extent writes of an egroup in flight), while two batches never interleave inside one
//! extent. Recovery and the re-check of a checksum mismatch hold every extent.
//!
//! Granted in arrival order: a waiter is granted once its extents are free and no earlier
//! waiter wants any of them, so a waiter for every extent is never starved by a stream of
//! smaller ones. Single-threaded, like the store.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use super::format::EXTENTS;

/// A set of extents of one egroup, one bit per extent.
pub(crate) type ExtentMask = u8;
/// Every extent of an egroup.
pub(crate) const EVERY_EXTENT: ExtentMask = (1 << EXTENTS) - 1;

#[derive(Default)]
pub(crate) struct ExtentLocks {
    state: RefCell<LockState>,
}

#[derive(Default)]
struct LockState {
    held: ExtentMask,
    next_ticket: u64,
    /// Not yet granted, oldest first.
    waiting: VecDeque<Waiter>,
}

struct Waiter {
    ticket: u64,
    mask: ExtentMask,
    waker: Waker,
}

impl LockState {
    /// Whether a request for `mask` queued behind the first `position` waiters may have it now.
    fn grantable(&self, mask: ExtentMask, position: usize) -> bool {
        let ahead = self
            .waiting
            .iter()
            .take(position)
            .fold(self.held, |taken, w| taken | w.mask);
        ahead & mask == 0
    }

    /// Wakes the waiters that could now be granted (each takes its extents when it runs).
    fn wake_grantable(&self) {
        let mut taken = self.held;
        for waiter in &self.waiting {
            if taken & waiter.mask == 0 {
                waiter.waker.wake_by_ref();
            }
            taken |= waiter.mask;
        }
    }
}

impl ExtentLocks {
    /// Holds the extents of `mask` until the guard is dropped.
    pub(crate) fn lock(&self, mask: ExtentMask) -> Acquire<'_> {
        Acquire {
            locks: self,
            mask,
            ticket: None,
        }
    }

    #[cfg(test)]
    fn held(&self) -> ExtentMask {
        self.state.borrow().held
    }
}

/// The future of [`ExtentLocks::lock`].
pub(crate) struct Acquire<'l> {
    locks: &'l ExtentLocks,
    mask: ExtentMask,
    /// Set while queued.
    ticket: Option<u64>,
}

impl<'l> Future for Acquire<'l> {
    type Output = ExtentGuard<'l>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<ExtentGuard<'l>> {
        let locks = self.locks;
        let mask = self.mask;
        let mut state = locks.state.borrow_mut();
        let position = match self.ticket {
            Some(ticket) => state
                .waiting
                .iter()
                .position(|w| w.ticket == ticket)
                .expect("a queued lock request stays queued until granted or dropped"),
            None => state.waiting.len(),
        };
        if state.grantable(mask, position) {
            if self.ticket.take().is_some() {
                state.waiting.remove(position);
            }
            state.held |= mask;
            return Poll::Ready(ExtentGuard { locks, mask });
        }
        match self.ticket {
            Some(_) => state.waiting[position].waker.clone_from(cx.waker()),
            None => {
                let ticket = state.next_ticket;
                state.next_ticket += 1;
                state.waiting.push_back(Waiter {
                    ticket,
                    mask,
                    waker: cx.waker().clone(),
                });
                drop(state);
                self.ticket = Some(ticket);
            }
        }
        Poll::Pending
    }
}

impl Drop for Acquire<'_> {
    fn drop(&mut self) {
        if let Some(ticket) = self.ticket {
            let mut state = self.locks.state.borrow_mut();
            state.waiting.retain(|w| w.ticket != ticket);
            // Waiters behind this one may no longer be blocked by it.
            state.wake_grantable();
        }
    }
}

/// Holds some extents of an egroup.
pub(crate) struct ExtentGuard<'l> {
    locks: &'l ExtentLocks,
    mask: ExtentMask,
}

impl ExtentGuard<'_> {
    pub(crate) fn mask(&self) -> ExtentMask {
        self.mask
    }
}

impl Drop for ExtentGuard<'_> {
    fn drop(&mut self) {
        let mut state = self.locks.state.borrow_mut();
        debug_assert_eq!(state.held & self.mask, self.mask);
        state.held &= !self.mask;
        state.wake_grantable();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::rc::Rc;

    fn ready<F: Future>(future: Pin<&mut F>) -> Option<F::Output> {
        let mut cx = Context::from_waker(Waker::noop());
        match future.poll(&mut cx) {
            Poll::Ready(out) => Some(out),
            Poll::Pending => None,
        }
    }

    #[test]
    fn disjoint_extents_are_held_at_once_and_overlapping_ones_wait() {
        let locks = ExtentLocks::default();
        let first = ready(std::pin::pin!(locks.lock(0b0001))).expect("free");
        let second = ready(std::pin::pin!(locks.lock(0b0010))).expect("disjoint");
        assert_eq!(locks.held(), 0b0011);
        let mut third = std::pin::pin!(locks.lock(0b0011));
        assert!(ready(third.as_mut()).is_none());
        drop(first);
        assert!(ready(third.as_mut()).is_none(), "extent 1 is still held");
        drop(second);
        let third = ready(third.as_mut()).expect("both free");
        assert_eq!(third.mask(), 0b0011);
        drop(third);
        assert_eq!(locks.held(), 0);
    }

    #[test]
    fn a_waiter_for_every_extent_is_not_overtaken() {
        let locks = ExtentLocks::default();
        let first = ready(std::pin::pin!(locks.lock(0b0001))).expect("free");
        let mut every = std::pin::pin!(locks.lock(EVERY_EXTENT));
        assert!(ready(every.as_mut()).is_none());
        // Extent 2 is free, but the earlier waiter wants it.
        let mut later = std::pin::pin!(locks.lock(0b0100));
        assert!(ready(later.as_mut()).is_none());
        drop(first);
        let every_guard = ready(every.as_mut()).expect("granted in order");
        assert!(ready(later.as_mut()).is_none());
        drop(every_guard);
        assert!(ready(later.as_mut()).is_some());
    }

    #[test]
    fn a_dropped_waiter_unblocks_those_behind_it() {
        let locks = ExtentLocks::default();
        let first = ready(std::pin::pin!(locks.lock(0b0001))).expect("free");
        let mut every = Box::pin(locks.lock(EVERY_EXTENT));
        assert!(ready(every.as_mut()).is_none());
        let mut later = std::pin::pin!(locks.lock(0b0010));
        assert!(ready(later.as_mut()).is_none());
        drop(every);
        assert!(ready(later.as_mut()).is_some());
        drop(first);
    }

    #[tokio::test]
    async fn waiters_are_woken_when_their_extents_are_released() {
        let locks = Rc::new(ExtentLocks::default());
        let local = tokio::task::LocalSet::new();
        local
            .run_until(async {
                let guard = locks.lock(EVERY_EXTENT).await;
                let waiting = {
                    let locks = locks.clone();
                    tokio::task::spawn_local(async move {
                        let guard = locks.lock(0b1000).await;
                        guard.mask()
                    })
                };
                tokio::task::yield_now().await;
                assert!(!waiting.is_finished());
                drop(guard);
                assert_eq!(waiting.await.expect("task"), 0b1000);
            })
            .await;
    }
}

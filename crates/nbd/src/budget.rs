//! The budget of request payload bytes held in memory, shared by every connection of a server
//! (in the node: every connection on every reactor).
//!
//! A request's payload bytes (a WRITE's data, a READ's reply data) are reserved *before* the
//! payload is read or the read is executed, and released once the reply has been handed to
//! the socket. A connection that cannot reserve stops reading its socket until it can
//! (backpressure); a request is never failed for want of budget.
//!
//! Two sources, so that clients holding the shared budget (a write stalled one byte short of
//! its end holds its reservation for as long as the client likes) cannot starve small I/O:
//!
//! - Each connection has a small **allowance** of its own (`connection_allowance_bytes`). A
//!   request that fits in what is left of it is charged there: a `Cell`, no atomic, no lock,
//!   so ordinary 4 KiB I/O at moderate queue depth never touches the shared budget. Node-wide
//!   the allowances add at most connections × allowance bytes.
//! - Everything else is charged to the shared [`RequestBudget`], a fair (FIFO) semaphore in
//!   KiB units: a large request that waits is not overtaken forever by smaller ones. A request
//!   larger than the whole budget waits until it can take all of it, so it is served, alone.
//!
//! A request that waits for the shared budget also watches its own connection's allowance and
//! takes that instead if its earlier requests free enough of it, so a small request never
//! waits on other clients.

use std::cell::Cell;
use std::fmt;
use std::rc::Rc;
use std::sync::Arc;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

/// Budget unit: permits are KiB, so even a 1 TiB budget is far from the semaphore's maximum
/// and a 1 GiB request is one acquisition of 2^20 permits.
const UNIT: u64 = 1024;

/// Default of [`RequestBudget`] in `NbdLimits::default()`.
pub const DEFAULT_REQUEST_BUDGET_BYTES: u64 = 256 << 20;

/// Default payload bytes a connection may hold outside the shared budget.
pub const DEFAULT_CONNECTION_ALLOWANCE_BYTES: u32 = 128 << 10;

/// A budget of request payload bytes held in memory, shared by every connection served with
/// (clones of) the same `NbdLimits`. Cloning shares the budget.
#[derive(Clone)]
pub struct RequestBudget {
    inner: Arc<Shared>,
}

struct Shared {
    semaphore: Arc<Semaphore>,
    capacity_units: u32,
}

impl RequestBudget {
    /// A budget of `bytes`, rounded up to whole KiB, at least 1 KiB and at most 4 TiB - 1 KiB.
    pub fn new(bytes: u64) -> Self {
        let units = bytes.div_ceil(UNIT).clamp(1, u64::from(u32::MAX)) as u32;
        Self {
            inner: Arc::new(Shared {
                semaphore: Arc::new(Semaphore::new(units as usize)),
                capacity_units: units,
            }),
        }
    }

    /// The whole budget in bytes.
    pub fn capacity_bytes(&self) -> u64 {
        u64::from(self.inner.capacity_units) * UNIT
    }

    /// Bytes not reserved right now (a snapshot).
    pub fn available_bytes(&self) -> u64 {
        self.inner.semaphore.available_permits() as u64 * UNIT
    }

    /// Units a request of `bytes` takes: rounded up, and never more than the whole budget, so
    /// that a request larger than the budget can still be served (alone).
    fn units_for(&self, bytes: u32) -> u32 {
        let units = u64::from(bytes).div_ceil(UNIT);
        units.min(u64::from(self.inner.capacity_units)) as u32
    }
}

impl Default for RequestBudget {
    fn default() -> Self {
        Self::new(DEFAULT_REQUEST_BUDGET_BYTES)
    }
}

/// Two `NbdLimits` are equal only if they share one budget.
impl PartialEq for RequestBudget {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

impl Eq for RequestBudget {}

impl fmt::Debug for RequestBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RequestBudget")
            .field("capacity_bytes", &self.capacity_bytes())
            .field("available_bytes", &self.available_bytes())
            .finish()
    }
}

/// One connection's view of the budget: its own allowance, and the shared budget. Lives on
/// the connection's thread.
pub(crate) struct Ledger {
    budget: RequestBudget,
    allowance: u32,
    /// Bytes of the allowance reserved by requests of this connection.
    held: Cell<u32>,
    /// Set while a request waits for budget, so releases wake it only then (no atomic
    /// operation on the hot path otherwise).
    waiting: Cell<bool>,
    freed: Notify,
}

/// Budget reserved for one request; released when dropped (after its reply was written).
#[must_use]
pub(crate) enum Charge {
    None,
    Allowance { ledger: Rc<Ledger>, bytes: u32 },
    Shared(#[allow(dead_code)] OwnedSemaphorePermit),
}

impl Drop for Charge {
    fn drop(&mut self) {
        if let Charge::Allowance { ledger, bytes } = self {
            ledger.held.set(ledger.held.get() - *bytes);
            if ledger.waiting.get() {
                ledger.freed.notify_one();
            }
        }
        // A shared permit returns its units to the semaphore as it drops.
    }
}

impl Ledger {
    pub(crate) fn new(budget: RequestBudget, allowance: u32) -> Rc<Self> {
        Rc::new(Self {
            budget,
            allowance,
            held: Cell::new(0),
            waiting: Cell::new(false),
            freed: Notify::new(),
        })
    }

    /// Reserves `bytes` without waiting, if possible.
    pub(crate) fn try_take(self: &Rc<Self>, bytes: u32) -> Option<Charge> {
        if bytes == 0 {
            return Some(Charge::None);
        }
        if let Some(charge) = self.try_allowance(bytes) {
            return Some(charge);
        }
        let units = self.budget.units_for(bytes);
        self.budget
            .inner
            .semaphore
            .clone()
            .try_acquire_many_owned(units)
            .ok()
            .map(Charge::Shared)
    }

    /// Reserves `bytes`, waiting as long as it takes. Cancel-safe: dropping the future
    /// reserves nothing and leaves the semaphore's queue.
    pub(crate) async fn take(self: &Rc<Self>, bytes: u32) -> Charge {
        if let Some(charge) = self.try_take(bytes) {
            return charge;
        }
        let units = self.budget.units_for(bytes);
        let semaphore = self.budget.inner.semaphore.clone();
        let shared = semaphore.acquire_many_owned(units);
        tokio::pin!(shared);
        self.waiting.set(true);
        let _waiting = ResetOnDrop(&self.waiting);
        loop {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            // Register before checking, so a release between the check and the wait is seen.
            freed.as_mut().enable();
            if let Some(charge) = self.try_allowance(bytes) {
                return charge;
            }
            tokio::select! {
                permit = &mut shared => match permit {
                    Ok(permit) => return Charge::Shared(permit),
                    // The semaphore is never closed.
                    Err(_) => unreachable!("the request budget's semaphore was closed"),
                },
                _ = freed => {}
            }
        }
    }

    fn try_allowance(self: &Rc<Self>, bytes: u32) -> Option<Charge> {
        let held = self.held.get();
        if bytes <= self.allowance - held {
            self.held.set(held + bytes);
            Some(Charge::Allowance {
                ledger: self.clone(),
                bytes,
            })
        } else {
            None
        }
    }
}

struct ResetOnDrop<'a>(&'a Cell<bool>);

impl Drop for ResetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.set(false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;
    use std::task::{Context, Poll};

    fn poll_once<F: Future + Unpin>(future: &mut F) -> Poll<F::Output> {
        let waker = std::task::Waker::noop();
        std::pin::Pin::new(future).poll(&mut Context::from_waker(waker))
    }

    #[test]
    fn small_requests_use_the_allowance_then_the_shared_budget() {
        let budget = RequestBudget::new(1 << 20);
        let ledger = Ledger::new(budget.clone(), 8192);
        let a = ledger.try_take(4096).unwrap();
        let b = ledger.try_take(4096).unwrap();
        assert!(matches!(a, Charge::Allowance { .. }));
        assert!(matches!(b, Charge::Allowance { .. }));
        assert_eq!(budget.available_bytes(), 1 << 20);
        let c = ledger.try_take(100).unwrap();
        assert!(matches!(c, Charge::Shared(_)));
        assert_eq!(
            budget.available_bytes(),
            (1 << 20) - 1024,
            "rounded up to 1 KiB"
        );
        drop((a, b, c));
        assert_eq!(ledger.held.get(), 0);
        assert_eq!(budget.available_bytes(), 1 << 20);
        assert!(matches!(ledger.try_take(0), Some(Charge::None)));
    }

    #[test]
    fn a_request_larger_than_the_budget_takes_all_of_it() {
        let budget = RequestBudget::new(64 << 10);
        let ledger = Ledger::new(budget.clone(), 0);
        let small = ledger.try_take(4096).unwrap();
        assert!(
            ledger.try_take(1 << 20).is_none(),
            "must wait for the whole budget"
        );
        drop(small);
        let big = ledger.try_take(1 << 20).unwrap();
        assert_eq!(budget.available_bytes(), 0);
        drop(big);
        assert_eq!(budget.available_bytes(), 64 << 10);
    }

    #[test]
    fn a_waiting_request_takes_its_freed_allowance_instead() {
        let budget = RequestBudget::new(4096);
        let stalled = Ledger::new(budget.clone(), 0);
        let hog = stalled.try_take(4096).unwrap(); // another client holds the whole budget
        let ledger = Ledger::new(budget.clone(), 4096);
        let first = ledger.try_take(4096).unwrap();
        let mut second = Box::pin(ledger.take(4096));
        assert!(poll_once(&mut second).is_pending());
        assert!(ledger.waiting.get());
        drop(first);
        match poll_once(&mut second) {
            Poll::Ready(Charge::Allowance { bytes: 4096, .. }) => {}
            _ => panic!("the freed allowance should have been taken"),
        }
        assert!(!ledger.waiting.get());
        drop(hog);
        assert_eq!(budget.available_bytes(), 4096);
    }

    #[test]
    fn waiting_is_fair_and_cancel_safe() {
        let budget = RequestBudget::new(8192);
        let ledger = Ledger::new(budget.clone(), 0);
        let held = ledger.try_take(8192).unwrap();
        let mut big = Box::pin(ledger.take(8192));
        assert!(poll_once(&mut big).is_pending());
        let mut small = Box::pin(ledger.take(1024));
        assert!(poll_once(&mut small).is_pending());
        drop(held);
        // The big request queued first gets the budget; the small one waits behind it.
        let Poll::Ready(big_charge) = poll_once(&mut big) else {
            panic!("the first waiter should be served")
        };
        assert!(poll_once(&mut small).is_pending());
        drop(big_charge);
        assert!(poll_once(&mut small).is_ready());
        // A cancelled waiter reserves nothing.
        let held = ledger.try_take(8192).unwrap();
        let mut gone = Box::pin(ledger.take(4096));
        assert!(poll_once(&mut gone).is_pending());
        drop(gone);
        drop(held);
        assert_eq!(budget.available_bytes(), 8192);
    }
}

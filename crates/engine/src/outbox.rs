//! Requests to shard controllers leave a reactor in bursts.
//!
//! Waking a shard controller on another reactor costs an eventfd write and usually a context
//! switch. Request tasks that become ready in the same scheduler tick (a connection read
//! several requests at once) post their shard requests here; one flush task, queued behind
//! them, sends the whole burst back to back, so the controller is woken once per burst
//! instead of once per request.

use crate::shard::ShardRequest;
use std::cell::RefCell;
use tokio::sync::mpsc;
use tokio::sync::mpsc::error::TrySendError;

struct Posted {
    to: mpsc::Sender<ShardRequest>,
    request: ShardRequest,
}

#[derive(Default)]
struct Outbox {
    posted: Vec<Posted>,
    flush_queued: bool,
}

thread_local! {
    static OUTBOX: RefCell<Outbox> = RefCell::default();
}

/// Sends `request` to `to` soon, together with the other requests posted in this tick.
/// A request that cannot be delivered (the controller retired) is dropped, which its caller
/// sees as a closed reply channel and retries on the current shard map.
///
/// Only on a reactor thread (it needs the thread's local task set).
pub fn post(to: &mpsc::Sender<ShardRequest>, request: ShardRequest) {
    let queue_flush = OUTBOX.with(|outbox| {
        let mut outbox = outbox.borrow_mut();
        outbox.posted.push(Posted {
            to: to.clone(),
            request,
        });
        !std::mem::replace(&mut outbox.flush_queued, true)
    });
    if queue_flush {
        tokio::task::spawn_local(flush());
    }
}

/// The outbox holds at most the requests of one tick: each waits on its reply, so the
/// in-flight limits of the front ends bound it.
async fn flush() {
    let posted = OUTBOX.with(|outbox| {
        let mut outbox = outbox.borrow_mut();
        outbox.flush_queued = false;
        std::mem::take(&mut outbox.posted)
    });
    for Posted { to, request } in posted {
        match to.try_send(request) {
            Ok(()) | Err(TrySendError::Closed(_)) => {}
            // Backpressure from a busy controller: wait for room, keeping the order.
            Err(TrySendError::Full(request)) => {
                let _ = to.send(request).await;
            }
        }
    }
}

//! PERSISTENT RESERVE OUT / PREEMPT AND ABORT across sessions (SPC-4, "Preempting and
//! aborting"): besides what PREEMPT does, the commands the preempted I_T nexuses sent to the
//! unit before the preemption are aborted. With TAS=0 (our control mode page) an aborted
//! command is never answered; the nexus learns of it from the REGISTRATIONS PREEMPTED unit
//! attention.
//!
//! The preempted sessions may run on any reactor, and their commands live in each session's
//! own task table (no lock: one thread owns it). So the unit does not touch them: it sends an
//! [`AbortOrder`] over the channel each session gave it when it joined, and the session's
//! own task (in `session`) aborts the commands on its thread and answers when they are
//! gone. Nothing here is on the data path: a command only reads the unit's preemption count
//! (an atomic) when it arrives.

use crate::lun::Lun;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

/// How long a PREEMPT AND ABORT waits for the preempted sessions to abort their commands.
/// A session waits for the device I/O its commands already started (so no write of a
/// preempted nexus lands after the preemption is answered); past this the PREEMPT AND ABORT
/// is answered anyway and the straggler logged.
pub(crate) const ABORT_WAIT: Duration = Duration::from_secs(30);

/// Tells one session to abort its commands to `lun` that arrived before the preemption.
#[derive(Debug)]
pub(crate) struct AbortOrder {
    pub lun: Lun,
    /// Commands that saw a preemption count below this arrived before the preemption.
    pub before: u64,
    /// Dropped (or sent) once the session's commands are gone.
    pub done: oneshot::Sender<()>,
}

/// How a unit reaches one session's commands to it.
#[derive(Debug, Clone)]
pub(crate) struct AbortRoute {
    /// The session, so it can take its route out again when it ends.
    pub session: u64,
    /// The unit's LUN in that session's target.
    pub lun: Lun,
    pub orders: mpsc::UnboundedSender<AbortOrder>,
}

/// Numbers sessions for [`AbortRoute::session`].
static NEXT_SESSION: AtomicU64 = AtomicU64::new(1);

pub(crate) fn next_session_id() -> u64 {
    NEXT_SESSION.fetch_add(1, Ordering::Relaxed)
}

/// The sessions open to one unit, by I_T nexus (a nexus may have two while a reinstatement
/// replaces its old session).
#[derive(Debug, Default)]
pub(crate) struct AbortRoutes {
    by_nexus: HashMap<String, Vec<AbortRoute>>,
}

impl AbortRoutes {
    pub fn add(&mut self, nexus: &str, route: AbortRoute) {
        self.by_nexus
            .entry(nexus.to_string())
            .or_default()
            .push(route);
    }

    pub fn remove(&mut self, nexus: &str, session: u64) {
        if let Some(routes) = self.by_nexus.get_mut(nexus) {
            routes.retain(|r| r.session != session);
            if routes.is_empty() {
                self.by_nexus.remove(nexus);
            }
        }
    }

    /// The routes to every session of the given nexuses.
    pub fn of<'a>(&self, nexuses: impl IntoIterator<Item = &'a str>) -> Vec<AbortRoute> {
        nexuses
            .into_iter()
            .filter_map(|n| self.by_nexus.get(n))
            .flatten()
            .cloned()
            .collect()
    }
}

/// Orders every session of `routes` to abort its commands that arrived before preemption
/// number `before`, and waits until they have (a session that ended counts as done), at most
/// `wait`. Returns how many sessions did not confirm in time.
pub(crate) async fn abort_sessions(routes: Vec<AbortRoute>, before: u64, wait: Duration) -> usize {
    let mut pending = Vec::with_capacity(routes.len());
    for route in routes {
        let (done, confirmed) = oneshot::channel();
        let order = AbortOrder {
            lun: route.lun,
            before,
            done,
        };
        // A closed channel is a session that ended: nothing left to abort.
        if route.orders.send(order).is_ok() {
            pending.push(confirmed);
        }
    }
    let deadline = tokio::time::Instant::now() + wait;
    let mut late = 0;
    for confirmed in pending {
        // Err inside: the session ended before confirming, which also ends its commands.
        if tokio::time::timeout_at(deadline, confirmed).await.is_err() {
            late += 1;
        }
    }
    late
}

#[cfg(test)]
mod sessions;

#[cfg(test)]
mod tests {
    use super::*;

    fn route(session: u64, lun: u16) -> (AbortRoute, mpsc::UnboundedReceiver<AbortOrder>) {
        let (orders, received) = mpsc::unbounded_channel();
        let route = AbortRoute {
            session,
            lun: Lun(lun),
            orders,
        };
        (route, received)
    }

    #[test]
    fn routes_follow_sessions_of_each_nexus() {
        let mut routes = AbortRoutes::default();
        let (a1, _ra1) = route(1, 0);
        let (a2, _ra2) = route(2, 0);
        let (b, _rb) = route(3, 1);
        routes.add("a", a1);
        routes.add("a", a2);
        routes.add("b", b);
        assert_eq!(routes.of(["a"]).len(), 2);
        routes.remove("a", 1);
        let left: Vec<u64> = routes.of(["a", "b"]).iter().map(|r| r.session).collect();
        assert_eq!(left, vec![2, 3]);
        routes.remove("a", 2);
        assert!(routes.of(["a"]).is_empty());
    }

    #[tokio::test]
    async fn waits_for_confirmation_and_counts_sessions_that_stay_silent() {
        let (live, mut live_orders) = route(1, 0);
        let (gone, gone_orders) = route(2, 0);
        let (silent, _silent_orders) = route(3, 0);
        drop(gone_orders);
        let confirm = tokio::spawn(async move {
            let order = live_orders.recv().await.expect("an order");
            assert_eq!((order.lun, order.before), (Lun(0), 7));
            let _ = order.done.send(());
        });
        let late = abort_sessions(vec![live, gone, silent], 7, Duration::from_millis(200)).await;
        confirm.await.unwrap();
        assert_eq!(late, 1, "only the session that never answered is late");
    }
}

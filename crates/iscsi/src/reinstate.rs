//! Session reinstatement (RFC 7143 6.3.5): a login with the initiator name, ISID and target of
//! a live session replaces it; the old session ends (its running commands finish first),
//! which also ends its I_T nexus (RESERVE(6) is released). The same table lets the node end
//! every session of one target (`end_target`: the target is handed to another node).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::Notify;

/// Live normal sessions of a node, by (initiator, ISID, target). Shared by every reactor.
#[derive(Clone, Default)]
pub struct SessionTable {
    inner: Arc<Shared>,
}

#[derive(Default)]
struct Shared {
    live: Mutex<HashMap<String, Entry>>,
    next_id: AtomicU64,
}

struct Entry {
    id: u64,
    target: String,
    ending: Arc<Ending>,
}

/// Tells a session to end: its reader stops, running commands finish, the connection closes.
#[derive(Debug, Default)]
pub(crate) struct Ending {
    notify: Notify,
    /// Why: false for a newer login of the same nexus, true for [`SessionTable::end_target`].
    target_moved: AtomicBool,
}

impl Ending {
    /// Waits until the session is told to end; true if its target moved to another node.
    pub(crate) async fn ended(&self) -> bool {
        self.notify.notified().await;
        self.target_moved.load(Ordering::Acquire)
    }

    fn end(&self, target_moved: bool) {
        if target_moved {
            self.target_moved.store(true, Ordering::Release);
        }
        // Stores a permit if the session is not waiting right now.
        self.notify.notify_one();
    }
}

impl std::fmt::Debug for SessionTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionTable").finish_non_exhaustive()
    }
}

/// A registered session; it leaves the table when dropped.
pub(crate) struct Registration {
    table: SessionTable,
    key: String,
    id: u64,
    /// Notified when a newer login replaces this session or its target moves.
    pub ending: Arc<Ending>,
}

impl SessionTable {
    /// Registers a session, telling the one it replaces (if any) to end.
    pub(crate) fn register(&self, initiator: &str, isid: [u8; 6], target: &str) -> Registration {
        let key = format!("{initiator}\0{isid:02x?}\0{target}");
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let ending = Arc::new(Ending::default());
        let entry = Entry {
            id,
            target: target.to_string(),
            ending: ending.clone(),
        };
        let old = self.lock().insert(key.clone(), entry);
        if let Some(old) = old {
            old.ending.end(false);
        }
        Registration {
            table: self.clone(),
            key,
            id,
            ending,
        }
    }

    pub fn live_sessions(&self) -> usize {
        self.lock().len()
    }

    /// Sessions of `target` still registered (ended ones leave once their connection closed).
    pub fn live_sessions_of(&self, target: &str) -> usize {
        self.lock().values().filter(|e| e.target == target).count()
    }

    /// Tells every session of `target` on this node to end as after a logout request: no
    /// new command is read, running ones finish and are answered, an Asynchronous Message
    /// says the connection drops (AsyncEvent 2, Time2Wait 0), then the connection closes
    /// (the initiator logs in again: ERL 0 session recovery). Returns how many were told.
    pub fn end_target(&self, target: &str) -> usize {
        let live = self.lock();
        let mut told = 0;
        for entry in live.values().filter(|e| e.target == target) {
            entry.ending.end(true);
            told += 1;
        }
        told
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        self.inner.live.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut live = self.table.lock();
        if live.get(&self.key).is_some_and(|e| e.id == self.id) {
            live.remove(&self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn a_second_login_replaces_the_first() {
        let table = SessionTable::default();
        let first = table.register("iqn.a", [1; 6], "iqn.t");
        let other_isid = table.register("iqn.a", [2; 6], "iqn.t");
        assert_eq!(table.live_sessions(), 2);
        let second = table.register("iqn.a", [1; 6], "iqn.t");
        // The first is told to end (the permit waits for it), not because its target moved.
        let moved = tokio::time::timeout(Duration::from_secs(1), first.ending.ended())
            .await
            .expect("the replaced session is notified");
        assert!(!moved);
        drop(first);
        assert_eq!(
            table.live_sessions(),
            2,
            "dropping the old one keeps the new entry"
        );
        drop(second);
        drop(other_isid);
        assert_eq!(table.live_sessions(), 0);
    }

    #[tokio::test]
    async fn ending_a_target_ends_its_sessions_only() {
        let table = SessionTable::default();
        let a = table.register("iqn.a", [1; 6], "iqn.t");
        let b = table.register("iqn.b", [1; 6], "iqn.t");
        let other = table.register("iqn.a", [1; 6], "iqn.other");
        assert_eq!(table.live_sessions_of("iqn.t"), 2);
        assert_eq!(table.end_target("iqn.t"), 2);
        for session in [&a, &b] {
            let moved = tokio::time::timeout(Duration::from_secs(1), session.ending.ended())
                .await
                .expect("told to end");
            assert!(moved, "told that its target moved");
        }
        let untouched = tokio::time::timeout(Duration::from_millis(50), other.ending.ended()).await;
        assert!(untouched.is_err(), "another target's session goes on");
        drop(a);
        assert_eq!(table.live_sessions_of("iqn.t"), 1);
        drop(b);
        assert_eq!(table.live_sessions_of("iqn.t"), 0);
        assert_eq!(table.live_sessions_of("iqn.other"), 1);
    }
}

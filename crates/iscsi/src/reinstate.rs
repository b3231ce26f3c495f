//! Session reinstatement (RFC 7143 6.3.5): a login with the initiator name, ISID and target of
//! a live session replaces it; the old session ends (its running commands finish first),
//! which also ends its I_T nexus (RESERVE(6) is released).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::Notify;

/// Live normal sessions of a node, by (initiator, ISID, target). Shared by every reactor.
#[derive(Clone, Default)]
pub struct SessionTable {
    inner: Arc<Shared>,
}

#[derive(Default)]
struct Shared {
    live: Mutex<HashMap<String, (u64, Arc<Notify>)>>,
    next_id: AtomicU64,
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
    /// Notified when a newer login replaces this session.
    pub replaced: Arc<Notify>,
}

impl SessionTable {
    /// Registers a session, telling the one it replaces (if any) to end.
    pub(crate) fn register(&self, initiator: &str, isid: [u8; 6], target: &str) -> Registration {
        let key = format!("{initiator}\0{isid:02x?}\0{target}");
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let replaced = Arc::new(Notify::new());
        let old = self.lock().insert(key.clone(), (id, replaced.clone()));
        if let Some((_, old)) = old {
            // Stores a permit if the old session is not waiting right now.
            old.notify_one();
        }
        Registration {
            table: self.clone(),
            key,
            id,
            replaced,
        }
    }

    pub fn live_sessions(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, (u64, Arc<Notify>)>> {
        self.inner.live.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut live = self.table.lock();
        if live.get(&self.key).is_some_and(|(id, _)| *id == self.id) {
            live.remove(&self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_second_login_replaces_the_first() {
        let table = SessionTable::default();
        let first = table.register("iqn.a", [1; 6], "iqn.t");
        let other_isid = table.register("iqn.a", [2; 6], "iqn.t");
        assert_eq!(table.live_sessions(), 2);
        let second = table.register("iqn.a", [1; 6], "iqn.t");
        // The first is told to end (the permit waits for it).
        tokio::time::timeout(std::time::Duration::from_secs(1), first.replaced.notified())
            .await
            .expect("the replaced session is notified");
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
}

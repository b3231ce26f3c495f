//! In-memory lease bookkeeping of the embedded store.
//!
//! Only the key -> lease association is persisted (in each key's record);
//! deadlines live here. A restart therefore loses every lease, and `open`
//! deletes the keys that were attached to one (single node: whoever held the
//! lease died with the process).

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::error::MetaError;
use crate::types::{EventKind, LeaseId, WatchEvent};

struct Clock {
    ttl: Duration,
    deadline: Instant,
}

/// Lease deadlines, under a lock of their own: a keep-alive only moves a
/// deadline, so it never waits for the store's state lock, which every
/// commit holds while it fsyncs. Otherwise a busy store could let a lease
/// expire that its holder kept alive in time. Lock order: state, then this.
#[derive(Default)]
pub(crate) struct Deadlines(Mutex<HashMap<LeaseId, Clock>>);

impl Deadlines {
    fn lock(&self) -> Result<MutexGuard<'_, HashMap<LeaseId, Clock>>, MetaError> {
        self.0.lock().map_err(|_| MetaError::Poisoned)
    }

    /// A lease whose deadline has passed is gone even before it is reaped.
    pub(crate) fn keep_alive(&self, id: LeaseId, now: Instant) -> Result<(), MetaError> {
        match self.lock()?.get_mut(&id) {
            Some(clock) if clock.deadline > now => {
                // A TTL too large to add saturates.
                clock.deadline = now.checked_add(clock.ttl).unwrap_or(clock.deadline);
                Ok(())
            }
            _ => Err(MetaError::LeaseNotFound(id)),
        }
    }
}

pub(crate) struct LeaseTable {
    /// Bumped (durably) on every open, so ids are unique across restarts
    /// without a disk write per grant: id = epoch << 32 | sequence.
    epoch: i64,
    next_seq: u64,
    /// Keys currently attached to each lease, so revoke/expiry need no table scan.
    keys: HashMap<LeaseId, BTreeSet<Vec<u8>>>,
    deadlines: Arc<Deadlines>,
}

impl LeaseTable {
    pub(crate) fn new(epoch: i64) -> Self {
        LeaseTable {
            epoch,
            next_seq: 1,
            keys: HashMap::new(),
            deadlines: Arc::default(),
        }
    }

    /// The deadlines, for keep-alives without the state lock.
    pub(crate) fn deadlines(&self) -> Arc<Deadlines> {
        Arc::clone(&self.deadlines)
    }

    pub(crate) fn grant(&mut self, ttl: Duration, now: Instant) -> Result<LeaseId, MetaError> {
        if ttl.is_zero() {
            return Err(MetaError::invalid("lease TTL must be greater than zero"));
        }
        let deadline = now
            .checked_add(ttl)
            .ok_or_else(|| MetaError::invalid(format!("lease TTL {ttl:?} is too large")))?;
        if self.next_seq > u64::from(u32::MAX) {
            return Err(MetaError::invalid(
                "lease ids of this process are exhausted; restart the process",
            ));
        }
        let id = self
            .epoch
            .checked_mul(1 << 32)
            .and_then(|base| base.checked_add(self.next_seq as i64))
            .ok_or_else(|| MetaError::invalid("lease id space exhausted"))?;
        self.next_seq += 1;
        let id = LeaseId(id);
        self.deadlines.lock()?.insert(id, Clock { ttl, deadline });
        self.keys.insert(id, BTreeSet::new());
        Ok(id)
    }

    pub(crate) fn contains(&self, id: LeaseId) -> bool {
        self.keys.contains_key(&id)
    }

    /// Keys attached to the lease, for a revoke.
    pub(crate) fn keys(&self, id: LeaseId) -> Result<Vec<Vec<u8>>, MetaError> {
        self.keys
            .get(&id)
            .map(|keys| keys.iter().cloned().collect())
            .ok_or(MetaError::LeaseNotFound(id))
    }

    /// Forget the lease (after its keys were deleted).
    pub(crate) fn remove(&mut self, id: LeaseId) -> Result<(), MetaError> {
        self.keys.remove(&id);
        self.deadlines.lock()?.remove(&id);
        Ok(())
    }

    /// Leases whose deadline has passed.
    pub(crate) fn expired(&self, now: Instant) -> Result<Vec<LeaseId>, MetaError> {
        let mut ids: Vec<LeaseId> = self
            .deadlines
            .lock()?
            .iter()
            .filter(|(_, c)| c.deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        // Deterministic order: oldest grant first.
        ids.sort();
        Ok(ids)
    }

    pub(crate) fn next_deadline(&self) -> Result<Option<Instant>, MetaError> {
        Ok(self.deadlines.lock()?.values().map(|c| c.deadline).min())
    }

    /// Follow the key -> lease associations changed by a committed transaction.
    pub(crate) fn apply(&mut self, events: &[WatchEvent]) {
        for ev in events {
            let key = &ev.kv.key;
            if let Some(old) = ev.prev.as_ref().and_then(|p| p.lease) {
                if let Some(keys) = self.keys.get_mut(&old) {
                    keys.remove(key);
                }
            }
            if ev.kind == EventKind::Put {
                if let Some(new) = ev.kv.lease {
                    if let Some(keys) = self.keys.get_mut(&new) {
                        keys.insert(key.clone());
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_positive_and_carry_the_epoch() {
        let mut t = LeaseTable::new(3);
        let now = Instant::now();
        let a = t.grant(Duration::from_secs(1), now).expect("grant");
        let b = t.grant(Duration::from_secs(1), now).expect("grant");
        assert_eq!(a, LeaseId((3 << 32) + 1));
        assert_eq!(b, LeaseId((3 << 32) + 2));
    }

    #[test]
    fn expiry_and_keep_alive() {
        let mut t = LeaseTable::new(1);
        let now = Instant::now();
        let id = t.grant(Duration::from_secs(10), now).expect("grant");
        let deadlines = t.deadlines();
        assert!(t.expired(now + Duration::from_secs(9)).unwrap().is_empty());
        deadlines
            .keep_alive(id, now + Duration::from_secs(9))
            .expect("keep alive");
        assert!(t.expired(now + Duration::from_secs(18)).unwrap().is_empty());
        assert_eq!(t.expired(now + Duration::from_secs(19)).unwrap(), vec![id]);
        // Past its deadline, a lease cannot be kept alive even before it is reaped.
        assert!(matches!(
            deadlines.keep_alive(id, now + Duration::from_secs(19)),
            Err(MetaError::LeaseNotFound(_))
        ));
        t.remove(id).unwrap();
        assert!(matches!(
            deadlines.keep_alive(id, now),
            Err(MetaError::LeaseNotFound(_))
        ));
    }

    #[test]
    fn zero_ttl_is_rejected() {
        let mut t = LeaseTable::new(1);
        assert!(matches!(
            t.grant(Duration::ZERO, Instant::now()),
            Err(MetaError::InvalidArgument(_))
        ));
    }
}

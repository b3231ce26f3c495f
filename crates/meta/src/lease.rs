//! In-memory lease bookkeeping of the embedded store.
//!
//! Only the key -> lease association is persisted (in each key's record);
//! deadlines live here. A restart therefore loses every lease, and `open`
//! deletes the keys that were attached to one (single node: whoever held the
//! lease died with the process).

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use crate::error::MetaError;
use crate::types::{EventKind, LeaseId, WatchEvent};

struct Lease {
    ttl: Duration,
    deadline: Instant,
    /// Keys currently attached, so revoke/expiry need no table scan.
    keys: BTreeSet<Vec<u8>>,
}

pub(crate) struct LeaseTable {
    /// Bumped (durably) on every open, so ids are unique across restarts
    /// without a disk write per grant: id = epoch << 32 | sequence.
    epoch: i64,
    next_seq: u64,
    leases: HashMap<LeaseId, Lease>,
}

impl LeaseTable {
    pub(crate) fn new(epoch: i64) -> Self {
        LeaseTable {
            epoch,
            next_seq: 1,
            leases: HashMap::new(),
        }
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
        self.leases.insert(
            id,
            Lease {
                ttl,
                deadline,
                keys: BTreeSet::new(),
            },
        );
        Ok(id)
    }

    pub(crate) fn keep_alive(&mut self, id: LeaseId, now: Instant) -> Result<(), MetaError> {
        let lease = self
            .leases
            .get_mut(&id)
            .ok_or(MetaError::LeaseNotFound(id))?;
        // The deadline only moves forward; a TTL too large to add saturates.
        lease.deadline = now.checked_add(lease.ttl).unwrap_or(lease.deadline);
        Ok(())
    }

    pub(crate) fn contains(&self, id: LeaseId) -> bool {
        self.leases.contains_key(&id)
    }

    /// Keys attached to the lease, for a revoke.
    pub(crate) fn keys(&self, id: LeaseId) -> Result<Vec<Vec<u8>>, MetaError> {
        self.leases
            .get(&id)
            .map(|l| l.keys.iter().cloned().collect())
            .ok_or(MetaError::LeaseNotFound(id))
    }

    /// Forget the lease (after its keys were deleted).
    pub(crate) fn remove(&mut self, id: LeaseId) {
        self.leases.remove(&id);
    }

    /// Leases whose deadline has passed.
    pub(crate) fn expired(&self, now: Instant) -> Vec<LeaseId> {
        let mut ids: Vec<LeaseId> = self
            .leases
            .iter()
            .filter(|(_, l)| l.deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        // Deterministic order: oldest grant first.
        ids.sort();
        ids
    }

    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        self.leases.values().map(|l| l.deadline).min()
    }

    /// Follow the key -> lease associations changed by a committed transaction.
    pub(crate) fn apply(&mut self, events: &[WatchEvent]) {
        for ev in events {
            let key = &ev.kv.key;
            if let Some(old) = ev.prev.as_ref().and_then(|p| p.lease) {
                if let Some(lease) = self.leases.get_mut(&old) {
                    lease.keys.remove(key);
                }
            }
            if ev.kind == EventKind::Put {
                if let Some(new) = ev.kv.lease {
                    if let Some(lease) = self.leases.get_mut(&new) {
                        lease.keys.insert(key.clone());
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
        assert!(t.expired(now + Duration::from_secs(9)).is_empty());
        t.keep_alive(id, now + Duration::from_secs(9))
            .expect("keep alive");
        assert!(t.expired(now + Duration::from_secs(18)).is_empty());
        assert_eq!(t.expired(now + Duration::from_secs(19)), vec![id]);
        t.remove(id);
        assert!(matches!(
            t.keep_alive(id, now),
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

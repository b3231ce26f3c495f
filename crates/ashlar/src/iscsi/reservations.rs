//! SCSI persistent reservations of iSCSI logical units, held in the MetaStore so
//! registrations and reservations survive a node restart (and, with a shared store,
//! failover). One JSON record per unit (vdisk id) under
//! `/ashlar/v1/iscsi-reservations/<vdisk id>`, changed with compare-and-swap transactions
//! like the volume group records. The node keeps a copy per unit in memory that I/O checks
//! (never the store); a PERSISTENT RESERVE OUT is answered only after its change is saved.
//! In a cluster the copy follows the store: it is read again whenever a login claims the
//! unit's vdisk here ([`MetaReservations::reload`], before the login is answered) and
//! whenever the record changes ([`follow_changes`], a watch of the records).
//!
//! RESERVE(6) reservations end with their I_T nexus and are never saved.

use ashlar_iscsi::{
    BackendFuture, LunReservations, PrState, Registration, Reservation, ReservationBackend,
    ReservationError, ReservationStore,
};
use ashlar_meta::{Compare, KeyRange, MetaStore, Txn, TxnOp};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Prefix of the reservation records.
pub const RESERVATIONS_PREFIX: &str = "/ashlar/v1/iscsi-reservations/";

/// The key of unit `unit_id` (zero-padded, so keys sort by id).
fn unit_key(unit_id: u64) -> Vec<u8> {
    format!("{RESERVATIONS_PREFIX}{unit_id:020}").into_bytes()
}

/// The unit id a record's key names.
fn unit_of_key(key: &[u8]) -> Result<u64, ReservationError> {
    let id_text = String::from_utf8_lossy(key.get(RESERVATIONS_PREFIX.len()..).unwrap_or(&[]));
    id_text.parse().map_err(|_| ReservationError::Corrupt {
        unit_id: 0,
        reason: format!("key {id_text:?} is not a unit id"),
    })
}

/// What the MetaStore holds for a unit (format version 1 of the JSON record).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
struct ReservationRecord {
    unit_id: u64,
    generation: u32,
    #[serde(default)]
    aptpl: bool,
    registrations: Vec<RegistrationRecord>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    reservation: Option<ReservationRecordHolder>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
struct RegistrationRecord {
    /// The I_T nexus: `<initiator name>,i,0x<ISID>`.
    nexus: String,
    key: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
struct ReservationRecordHolder {
    holder: String,
    /// SPC-4 persistent reservation type code.
    kind: u8,
}

impl ReservationRecord {
    fn from_state(unit_id: u64, state: &PrState) -> Self {
        ReservationRecord {
            unit_id,
            generation: state.generation,
            aptpl: state.aptpl,
            registrations: state
                .registrations
                .iter()
                .map(|r| RegistrationRecord {
                    nexus: r.nexus.clone(),
                    key: r.key,
                })
                .collect(),
            reservation: state.reservation.as_ref().map(|r| ReservationRecordHolder {
                holder: r.holder.clone(),
                kind: r.kind,
            }),
        }
    }

    fn into_state(self) -> PrState {
        PrState {
            generation: self.generation,
            aptpl: self.aptpl,
            registrations: self
                .registrations
                .into_iter()
                .map(|r| Registration {
                    nexus: r.nexus,
                    key: r.key,
                })
                .collect(),
            reservation: self.reservation.map(|r| Reservation {
                holder: r.holder,
                kind: r.kind,
            }),
            legacy: None,
        }
    }
}

fn store_error(error: impl std::fmt::Display) -> ReservationError {
    ReservationError::Store(error.to_string())
}

fn decode(unit_id: u64, value: &[u8]) -> Result<PrState, ReservationError> {
    let record: ReservationRecord =
        serde_json::from_slice(value).map_err(|e| ReservationError::Corrupt {
            unit_id,
            reason: e.to_string(),
        })?;
    if record.unit_id != unit_id {
        return Err(ReservationError::Corrupt {
            unit_id,
            reason: format!("record names unit {}", record.unit_id),
        });
    }
    Ok(record.into_state())
}

/// Saves units' states in the MetaStore.
struct MetaBackend<M> {
    meta: M,
}

impl<M: MetaStore> MetaBackend<M> {
    /// The saved state of `unit_id` (empty if it has no record).
    async fn read(&self, unit_id: u64) -> Result<PrState, ReservationError> {
        match self
            .meta
            .get(&unit_key(unit_id))
            .await
            .map_err(store_error)?
        {
            Some(kv) => decode(unit_id, &kv.value),
            None => Ok(PrState::default()),
        }
    }

    async fn update_record(
        &self,
        unit_id: u64,
        change: &mut dyn FnMut(&mut PrState) -> bool,
    ) -> Result<PrState, ReservationError> {
        let key = unit_key(unit_id);
        loop {
            let current = self.meta.get(&key).await.map_err(store_error)?;
            let (mut state, unchanged) = match &current {
                Some(kv) => (
                    decode(unit_id, &kv.value)?,
                    Compare::mod_revision_equals(key.clone(), kv.mod_revision),
                ),
                None => (PrState::default(), Compare::absent(key.clone())),
            };
            let read = state.clone();
            if !change(&mut state) {
                return Ok(read);
            }
            state.legacy = None;
            let value = serde_json::to_vec(&ReservationRecord::from_state(unit_id, &state))
                .map_err(store_error)?;
            let response = self
                .meta
                .txn(
                    Txn::new()
                        .when([unchanged])
                        .and_then([TxnOp::put(key.clone(), value, None)]),
                )
                .await
                .map_err(store_error)?;
            if response.succeeded {
                return Ok(state);
            }
            // Changed meanwhile (another node): decide again on the newer state.
        }
    }
}

impl<M: MetaStore> ReservationBackend for MetaBackend<M> {
    fn update<'a>(
        &'a self,
        unit_id: u64,
        change: &'a mut dyn FnMut(&mut PrState) -> bool,
    ) -> BackendFuture<'a, PrState> {
        Box::pin(self.update_record(unit_id, change))
    }
}

/// The reservation state of every unit of the node, saved in the MetaStore.
pub struct MetaReservations<M> {
    backend: Arc<MetaBackend<M>>,
    units: Mutex<HashMap<u64, Arc<LunReservations>>>,
}

impl<M: MetaStore> MetaReservations<M> {
    /// Loads every saved unit state.
    pub async fn load(meta: M) -> Result<Self, ReservationError> {
        let kvs = meta
            .range(KeyRange::prefix(RESERVATIONS_PREFIX), None)
            .await
            .map_err(store_error)?;
        let backend = Arc::new(MetaBackend { meta });
        let mut units = HashMap::new();
        for kv in kvs {
            let unit_id = unit_of_key(&kv.key)?;
            let state = decode(unit_id, &kv.value)?;
            let unit = LunReservations::saved(unit_id, state, backend.clone());
            units.insert(unit_id, Arc::new(unit));
        }
        Ok(MetaReservations {
            backend,
            units: Mutex::new(units),
        })
    }

    fn units(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<LunReservations>>> {
        self.units.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reads unit `unit_id`'s saved state again and makes it the one its I/O is checked
    /// against (the unit is created here if this node never served it). Returns whether the
    /// state here changed.
    pub async fn reload(&self, unit_id: u64) -> Result<bool, ReservationError> {
        let unit = self.unit(unit_id);
        unit.reload_from(self.backend.read(unit_id)).await
    }

    /// Reads again every unit that has a record, and every unit this node holds a copy of
    /// (its record may be gone).
    async fn reload_all(&self) -> Result<(), ReservationError> {
        let kvs = self
            .backend
            .meta
            .range(KeyRange::prefix(RESERVATIONS_PREFIX), None)
            .await
            .map_err(store_error)?;
        let mut ids: Vec<u64> = self.units().keys().copied().collect();
        for kv in kvs {
            ids.push(unit_of_key(&kv.key)?);
        }
        ids.sort_unstable();
        ids.dedup();
        for unit_id in ids {
            self.follow(unit_id).await?;
        }
        Ok(())
    }

    /// Reads unit `unit_id` again after its record changed (or may have); says so when that
    /// changed the copy here.
    async fn follow(&self, unit_id: u64) -> Result<(), ReservationError> {
        if self.reload(unit_id).await? {
            tracing::info!(
                unit = unit_id,
                "persistent reservations of the unit changed through another node; following them"
            );
        }
        Ok(())
    }
}

/// Pause before watching the records again after the watch failed (etcd away).
const WATCH_RETRY: Duration = Duration::from_secs(1);

/// Cluster mode: keeps every unit's copy here equal to its record in the store, for as long
/// as the node runs (spawned on the control runtime). Each change to a record (a PERSISTENT
/// RESERVE OUT through any node) makes this node read that record again (holding a copy of
/// the unit from then on); each time the watch starts, every record and copy is read again,
/// so a change made while it was not watching is not missed.
pub async fn follow_changes<M: MetaStore>(reservations: Arc<MetaReservations<M>>) {
    let mut last_error = String::new();
    loop {
        if let Err(error) = follow_once(&reservations).await {
            let error = error.to_string();
            if error != last_error {
                tracing::warn!(%error,
                    "watch of iSCSI persistent reservations ended; watching again every {WATCH_RETRY:?}");
                last_error = error;
            }
        }
        tokio::time::sleep(WATCH_RETRY).await;
    }
}

async fn follow_once<M: MetaStore>(
    reservations: &MetaReservations<M>,
) -> Result<(), ReservationError> {
    let meta = &reservations.backend.meta;
    let revision = meta.current_revision().await.map_err(store_error)?;
    reservations.reload_all().await?;
    let mut watch = meta
        .watch(KeyRange::prefix(RESERVATIONS_PREFIX), Some(revision.next()))
        .await
        .map_err(store_error)?;
    loop {
        let event = watch.next_event().await.map_err(store_error)?;
        match unit_of_key(&event.kv.key) {
            Ok(unit_id) => reservations.follow(unit_id).await?,
            Err(error) => {
                tracing::warn!(%error, "ignoring a reservation record that names no unit")
            }
        }
    }
}

impl<M: MetaStore> ReservationStore for MetaReservations<M> {
    fn unit(&self, unit_id: u64) -> Arc<LunReservations> {
        let backend = self.backend.clone();
        self.units()
            .entry(unit_id)
            .or_insert_with(|| {
                Arc::new(LunReservations::saved(unit_id, PrState::default(), backend))
            })
            .clone()
    }

    fn forget(&self, unit_id: u64) {
        self.units().remove(&unit_id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ashlar_iscsi::scsi::reservation::Access;
    use ashlar_meta::EmbeddedMetaStore;

    /// PERSISTENT RESERVE OUT with APTPL: REGISTER (action 0) or RESERVE (1) of type WRITE
    /// EXCLUSIVE; must succeed.
    async fn reserve_out(unit: &LunReservations, nexus: &str, action: u8, key: u64, sa: u64) {
        let cdb = [0x5f, action, 1, 0, 0, 0, 0, 0, 24, 0];
        let mut params = vec![0u8; 24];
        params[0..8].copy_from_slice(&key.to_be_bytes());
        params[8..16].copy_from_slice(&sa.to_be_bytes());
        params[20] = 0x01; // APTPL
        let outcome = unit.reserve_out(nexus, &cdb, &params).await;
        assert_eq!(outcome.status(), 0, "{outcome:?}");
    }

    #[tokio::test]
    async fn registrations_and_reservations_are_reloaded() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("meta.redb");
        {
            let meta = EmbeddedMetaStore::open(&path).unwrap();
            let store = MetaReservations::load(meta).await.unwrap();
            let unit = store.unit(9);
            reserve_out(&unit, "iqn.a,i,0x01", 0, 0, 0xaa).await;
            reserve_out(&unit, "iqn.a,i,0x01", 1, 0xaa, 0).await;
            // A RESERVE(6)-style holder is never saved.
            unit.update(|s| s.legacy = Some("iqn.c,i,0x03".into()));
        }
        let meta = EmbeddedMetaStore::open(&path).unwrap();
        let store = MetaReservations::load(meta).await.unwrap();
        let state = store.unit(9).snapshot();
        assert_eq!(state.registrations.len(), 1);
        assert_eq!(state.registrations[0].key, 0xaa);
        assert!(state.aptpl);
        assert_eq!(state.generation, 1);
        let reservation = state.reservation.expect("reservation reloaded");
        assert_eq!(reservation.holder, "iqn.a,i,0x01");
        assert_eq!(reservation.kind, 1);
        assert_eq!(state.legacy, None);
        assert!(store.unit(9).allows("iqn.a,i,0x01", Access::Write));
        assert!(!store.unit(9).allows("iqn.b,i,0x02", Access::Write));
        // An untouched unit starts empty.
        assert_eq!(store.unit(10).snapshot(), PrState::default());
    }

    #[tokio::test]
    async fn a_change_made_elsewhere_is_seen_before_deciding() {
        let dir = tempfile::tempdir().unwrap();
        let meta = EmbeddedMetaStore::open(&dir.path().join("meta.redb")).unwrap();
        // Two stores over one MetaStore stand for two nodes.
        let first = MetaReservations::load(meta.clone()).await.unwrap();
        let second = MetaReservations::load(meta).await.unwrap();
        reserve_out(&first.unit(3), "iqn.a,i,0x01", 0, 0, 0xaa).await;
        // The second node's copy is stale, but its REGISTER lands on the saved state.
        reserve_out(&second.unit(3), "iqn.b,i,0x02", 0, 0, 0xbb).await;
        let state = second.unit(3).snapshot();
        let keys: Vec<u64> = state.registrations.iter().map(|r| r.key).collect();
        assert_eq!(keys, vec![0xaa, 0xbb]);
        assert_eq!(state.generation, 2);
    }

    #[tokio::test]
    async fn a_reload_adopts_what_another_node_saved() {
        let dir = tempfile::tempdir().unwrap();
        let meta = EmbeddedMetaStore::open(&dir.path().join("meta.redb")).unwrap();
        let first = MetaReservations::load(meta.clone()).await.unwrap();
        let second = MetaReservations::load(meta).await.unwrap();
        // The second node holds an (empty) copy of unit 4 and a RESERVE(6) holder of its own.
        second
            .unit(4)
            .update(|s| s.legacy = Some("iqn.c,i,0x03".into()));
        reserve_out(&first.unit(4), "iqn.a,i,0x01", 0, 0, 0xaa).await;
        reserve_out(&first.unit(4), "iqn.a,i,0x01", 1, 0xaa, 0).await;
        assert_eq!(second.unit(4).snapshot().reservation, None, "stale");
        assert!(second.reload(4).await.unwrap(), "the copy changed");
        let unit = second.unit(4);
        let state = unit.snapshot();
        assert_eq!(state.reservation.map(|r| r.kind), Some(1));
        assert_eq!(state.registrations[0].key, 0xaa);
        assert_eq!(
            state.legacy.as_deref(),
            Some("iqn.c,i,0x03"),
            "RESERVE(6) kept"
        );
        unit.update(|s| s.legacy = None);
        assert!(!unit.allows("iqn.b,i,0x02", Access::Write));
        assert!(unit.allows("iqn.a,i,0x01", Access::Write));
        assert!(!second.reload(4).await.unwrap(), "nothing new");
        // A unit the second node never held is read from the store too.
        reserve_out(&first.unit(5), "iqn.a,i,0x01", 0, 0, 0xcc).await;
        second.reload(5).await.unwrap();
        assert_eq!(second.unit(5).snapshot().registrations[0].key, 0xcc);
    }

    #[tokio::test]
    async fn the_watch_follows_changes_made_elsewhere() {
        let dir = tempfile::tempdir().unwrap();
        let meta = EmbeddedMetaStore::open(&dir.path().join("meta.redb")).unwrap();
        let first = MetaReservations::load(meta.clone()).await.unwrap();
        let second = Arc::new(MetaReservations::load(meta).await.unwrap());
        let unit = second.unit(6);
        let follower = tokio::spawn(follow_changes(second.clone()));
        reserve_out(&first.unit(6), "iqn.a,i,0x01", 0, 0, 0xaa).await;
        reserve_out(&first.unit(6), "iqn.a,i,0x01", 1, 0xaa, 0).await;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while unit.allows("iqn.b,i,0x02", Access::Write) {
            assert!(tokio::time::Instant::now() < deadline, "never followed");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(unit.snapshot().registrations[0].key, 0xaa);
        // A unit this node never held is followed too: its first session finds the state.
        reserve_out(&first.unit(7), "iqn.a,i,0x01", 0, 0, 0xdd).await;
        while second
            .units()
            .get(&7)
            .is_none_or(|u| u.snapshot().registrations.is_empty())
        {
            assert!(
                tokio::time::Instant::now() < deadline,
                "never followed unit 7"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(second.unit(7).snapshot().registrations[0].key, 0xdd);
        follower.abort();
    }
}

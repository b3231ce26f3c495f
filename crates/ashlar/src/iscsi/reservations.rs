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
//!
//! In a cluster a change is fenced by the unit's vdisk's ownership claim ([`ServingClaims`]):
//! it is refused (NOT READY) while this node does not serve the vdisk under a surely valid
//! claim, and it is saved by a transaction that also compares the owner key with this node's
//! claim, so a node whose claim ended (another node may serve the unit now) changes nothing.

use ashlar_cluster::{claim_held, holds_claim, OwnershipClaim};
use ashlar_core::VdiskId;
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

/// Which vdisks this node serves, and under which ownership claim (the node's ownership
/// layer; a unit's id is its vdisk's id).
pub trait ServingClaims: Send + Sync + 'static {
    /// `Ok(Some(claim))`: this node serves `vdisk` under `claim`, surely valid now;
    /// `Ok(None)`: there are no claims (a single node serves everything); `Err(why)`: this
    /// node does not serve `vdisk` now.
    fn serving_claim(&self, vdisk: VdiskId) -> Result<Option<OwnershipClaim>, String>;
}

impl ServingClaims for crate::ownership::NodeOwnership {
    fn serving_claim(&self, vdisk: VdiskId) -> Result<Option<OwnershipClaim>, String> {
        crate::ownership::NodeOwnership::serving_claim(self, vdisk)
    }
}

/// Saves units' states in the MetaStore.
struct MetaBackend<M> {
    meta: M,
    /// `None`: changes are not fenced (a store of one node, or tests).
    fence: Option<Arc<dyn ServingClaims>>,
}

impl<M: MetaStore> MetaBackend<M> {
    /// The claim a change of unit `unit_id` must be made under (`None`: no fencing).
    fn claim(&self, unit_id: u64) -> Result<Option<OwnershipClaim>, ReservationError> {
        match &self.fence {
            None => Ok(None),
            Some(fence) => fence
                .serving_claim(VdiskId(unit_id))
                .map_err(ReservationError::NotServing),
        }
    }

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
            // Asked again on each attempt: the claim may have lapsed or been made again.
            let claim = self.claim(unit_id)?;
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
            let mut guards = vec![unchanged];
            guards.extend(claim.iter().flat_map(claim_held));
            let response = self
                .meta
                .txn(
                    Txn::new()
                        .when(guards)
                        .and_then([TxnOp::put(key.clone(), value, None)]),
                )
                .await
                .map_err(store_error)?;
            if response.succeeded {
                return Ok(state);
            }
            if let Some(claim) = &claim {
                self.still_held(claim).await?;
            }
            // The record changed meanwhile (another node): decide again on the newer state.
        }
    }

    /// Ok if `claim` still is its vdisk's ownership in the store, else `NotServing`.
    async fn still_held(&self, claim: &OwnershipClaim) -> Result<(), ReservationError> {
        if holds_claim(&self.meta, claim).await.map_err(store_error)? {
            return Ok(());
        }
        Err(ReservationError::NotServing(format!(
            "vdisk {}: this node's ownership claim (epoch {}) ended; another node may serve it",
            claim.vdisk, claim.epoch
        )))
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

    fn serving(&self, unit_id: u64) -> Result<(), ReservationError> {
        self.claim(unit_id).map(|_| ())
    }
}

/// The reservation state of every unit of the node, saved in the MetaStore.
pub struct MetaReservations<M> {
    backend: Arc<MetaBackend<M>>,
    units: Mutex<HashMap<u64, Arc<LunReservations>>>,
}

impl<M: MetaStore> MetaReservations<M> {
    /// Loads every saved unit state; changes are not fenced.
    #[cfg(test)]
    pub async fn load(meta: M) -> Result<Self, ReservationError> {
        Self::load_fenced(meta, None).await
    }

    /// Loads every saved unit state; with `fence`, a change of a unit is made only while
    /// this node serves the unit's vdisk under a live ownership claim (see the module notes).
    pub async fn load_fenced(
        meta: M,
        fence: Option<Arc<dyn ServingClaims>>,
    ) -> Result<Self, ReservationError> {
        let kvs = meta
            .range(KeyRange::prefix(RESERVATIONS_PREFIX), None)
            .await
            .map_err(store_error)?;
        let backend = Arc::new(MetaBackend { meta, fence });
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
    use ashlar_iscsi::scsi::reservation::{Access, PrOutcome};
    use ashlar_iscsi::scsi::sense::Sense;
    use ashlar_meta::EmbeddedMetaStore;

    /// PERSISTENT RESERVE OUT with APTPL: REGISTER (action 0) or RESERVE (1) of type WRITE
    /// EXCLUSIVE.
    async fn try_reserve_out(
        unit: &LunReservations,
        nexus: &str,
        action: u8,
        key: u64,
        sa: u64,
    ) -> PrOutcome {
        let cdb = [0x5f, action, 1, 0, 0, 0, 0, 0, 24, 0];
        let mut params = vec![0u8; 24];
        params[0..8].copy_from_slice(&key.to_be_bytes());
        params[8..16].copy_from_slice(&sa.to_be_bytes());
        params[20] = 0x01; // APTPL
        unit.reserve_out(nexus, &cdb, &params).await
    }

    /// [`try_reserve_out`], which must succeed.
    async fn reserve_out(unit: &LunReservations, nexus: &str, action: u8, key: u64, sa: u64) {
        let outcome = try_reserve_out(unit, nexus, action, key, sa).await;
        assert_eq!(outcome.status(), 0, "{outcome:?}");
    }

    /// The ownership layer of one node, as the test sets it.
    struct TestFence(Mutex<Result<Option<OwnershipClaim>, String>>);

    impl TestFence {
        fn set(&self, serving: Result<Option<OwnershipClaim>, String>) {
            *self.0.lock().unwrap() = serving;
        }
    }

    impl ServingClaims for TestFence {
        fn serving_claim(&self, _vdisk: VdiskId) -> Result<Option<OwnershipClaim>, String> {
            self.0.lock().unwrap().clone()
        }
    }

    #[tokio::test]
    async fn changes_are_fenced_by_the_ownership_claim() {
        let dir = tempfile::tempdir().unwrap();
        let meta = EmbeddedMetaStore::open(&dir.path().join("meta.redb")).unwrap();
        let node = |n| ashlar_cluster::NodeId::new(n).unwrap();
        let vdisk = VdiskId(8);
        let lease = meta.grant_lease(Duration::from_secs(60)).await.unwrap();
        let mine = ashlar_cluster::claim(&meta, vdisk, node(1), lease)
            .await
            .unwrap();
        let fence = Arc::new(TestFence(Mutex::new(Ok(Some(mine.clone())))));
        let store = MetaReservations::load_fenced(meta.clone(), Some(fence.clone()))
            .await
            .unwrap();
        let unit = store.unit(vdisk.0);
        // Served under a live claim: the change is saved.
        reserve_out(&unit, "iqn.a,i,0x01", 0, 0, 0xaa).await;
        let not_ready = PrOutcome::Check(Sense::LUN_BECOMING_READY);

        // The claim lapsed here (the gate shut): refused at once, RESERVE(6) too.
        fence.set(Err("lapsed".into()));
        let outcome = try_reserve_out(&unit, "iqn.a,i,0x01", 1, 0xaa, 0).await;
        assert_eq!(outcome, not_ready);
        assert_eq!(unit.reserve6("iqn.b,i,0x02"), not_ready);
        assert_eq!(unit.release6("iqn.b,i,0x02"), not_ready);
        assert_eq!(unit.snapshot().legacy, None, "RESERVE(6) not taken");

        // Another node took the vdisk while this node still believes in its claim (its gate
        // not shut yet): the save compares the owner key, so nothing is saved.
        ashlar_cluster::release(&meta, &mine).await.unwrap();
        let theirs = meta.grant_lease(Duration::from_secs(60)).await.unwrap();
        ashlar_cluster::claim(&meta, vdisk, node(2), theirs)
            .await
            .unwrap();
        fence.set(Ok(Some(mine.clone())));
        let outcome = try_reserve_out(&unit, "iqn.a,i,0x01", 1, 0xaa, 0).await;
        assert_eq!(outcome, not_ready);
        let register = try_reserve_out(&unit, "iqn.b,i,0x02", 0, 0, 0xbb).await;
        assert_eq!(register, not_ready);

        // The store and the copy here hold the one registration saved under the claim.
        for state in [
            unit.snapshot(),
            MetaReservations::load(meta.clone())
                .await
                .unwrap()
                .unit(vdisk.0)
                .snapshot(),
        ] {
            let keys: Vec<u64> = state.registrations.iter().map(|r| r.key).collect();
            assert_eq!(keys, vec![0xaa]);
            assert_eq!(state.reservation, None);
            assert_eq!(state.generation, 1);
        }
        // A single node's store is not fenced.
        let unfenced = MetaReservations::load(meta).await.unwrap();
        reserve_out(&unfenced.unit(vdisk.0), "iqn.a,i,0x01", 1, 0xaa, 0).await;
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

//! Reservations of one logical unit: SPC-4 persistent reservations (PERSISTENT RESERVE IN and
//! OUT, every type) and SPC-2 RESERVE/RELEASE(6). The rules are pure functions over
//! [`PrState`]; [`LunReservations`] holds the state of one unit behind a mutex shared by every
//! session of the unit (on any reactor), with an atomic fast path so I/O to a unit nobody
//! reserved never takes the lock. It also holds the unit's pending unit attentions.
//!
//! Where the state lives is behind [`ReservationStore`]. [`MemoryReservations`] keeps it in
//! memory only: registrations survive sessions coming and going but not a node restart (so
//! APTPL is refused). A store with a [`ReservationBackend`] saves every change before
//! answering (the node's metadata store), so registrations survive restarts and APTPL is
//! accepted.
use super::attention::{self, Attentions};
use super::sense::{status, Sense};
use crate::abort::{self, AbortRoute, AbortRoutes};
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// PERSISTENT RESERVE OUT service action PREEMPT AND ABORT.
const PREEMPT_AND_ABORT: u8 = 5;

/// Registrations one unit keeps; one more is refused with INSUFFICIENT REGISTRATION
/// RESOURCES.
pub const MAX_REGISTRATIONS_PER_UNIT: usize = 64;

/// Persistent reservation types (SPC-4 table 212).
pub mod kind {
    pub const WRITE_EXCLUSIVE: u8 = 1;
    pub const EXCLUSIVE_ACCESS: u8 = 3;
    pub const WRITE_EXCLUSIVE_REGISTRANTS_ONLY: u8 = 5;
    pub const EXCLUSIVE_ACCESS_REGISTRANTS_ONLY: u8 = 6;
    pub const WRITE_EXCLUSIVE_ALL_REGISTRANTS: u8 = 7;
    pub const EXCLUSIVE_ACCESS_ALL_REGISTRANTS: u8 = 8;
}

fn valid_type(t: u8) -> bool {
    matches!(t, 1 | 3 | 5 | 6 | 7 | 8)
}

fn all_registrants(t: u8) -> bool {
    t == kind::WRITE_EXCLUSIVE_ALL_REGISTRANTS || t == kind::EXCLUSIVE_ACCESS_ALL_REGISTRANTS
}

/// How a command touches the medium, for reservation conflicts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Allowed whatever is reserved (INQUIRY, REPORT LUNS, READ CAPACITY, ...).
    Always,
    Read,
    Write,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registration {
    /// The I_T nexus: initiator port name (`iqn...,i,0x<ISID>`).
    pub nexus: String,
    pub key: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation {
    pub holder: String,
    pub kind: u8,
}

/// Reservation state of one unit.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrState {
    pub generation: u32,
    pub registrations: Vec<Registration>,
    pub reservation: Option<Reservation>,
    /// The last valid APTPL bit of a REGISTER (SPC-4 5.14.5; reported as PTPL_A).
    pub aptpl: bool,
    /// RESERVE(6) holder: lives only as long as its I_T nexus, never saved.
    pub legacy: Option<String>,
}

impl PrState {
    fn key_of(&self, nexus: &str) -> Option<u64> {
        self.registrations
            .iter()
            .find(|r| r.nexus == nexus)
            .map(|r| r.key)
    }

    fn is_holder(&self, nexus: &str) -> bool {
        match &self.reservation {
            Some(r) if all_registrants(r.kind) => self.key_of(nexus).is_some(),
            Some(r) => r.holder == nexus,
            None => false,
        }
    }

    /// Takes the saved part (everything but RESERVE(6)) from `saved`.
    fn adopt_saved(&mut self, saved: PrState) {
        self.generation = saved.generation;
        self.registrations = saved.registrations;
        self.reservation = saved.reservation;
        self.aptpl = saved.aptpl;
    }

    fn is_empty(&self) -> bool {
        self.registrations.is_empty() && self.reservation.is_none() && self.legacy.is_none()
    }

    /// Whether `nexus` may run a command of class `access` (SPC-4 5.12.9 table 57).
    pub fn allows(&self, nexus: &str, access: Access) -> bool {
        if access == Access::Always {
            return true;
        }
        if let Some(holder) = &self.legacy {
            return holder == nexus;
        }
        let Some(reservation) = &self.reservation else {
            return true;
        };
        if self.is_holder(nexus) {
            return true;
        }
        let registered = self.key_of(nexus).is_some();
        match reservation.kind {
            kind::WRITE_EXCLUSIVE => access == Access::Read,
            kind::EXCLUSIVE_ACCESS => false,
            kind::WRITE_EXCLUSIVE_REGISTRANTS_ONLY | kind::WRITE_EXCLUSIVE_ALL_REGISTRANTS => {
                registered || access == Access::Read
            }
            _ => registered,
        }
    }

    /// Drops the registration of `nexus`, releasing what only it held.
    fn unregister(&mut self, nexus: &str) {
        self.registrations.retain(|r| r.nexus != nexus);
        let release = match &self.reservation {
            Some(r) if all_registrants(r.kind) => self.registrations.is_empty(),
            Some(r) => r.holder == nexus,
            None => false,
        };
        if release {
            self.reservation = None;
        }
    }
}

/// Outcome of a reservation command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PrOutcome {
    Good(Vec<u8>),
    Conflict,
    Check(Sense),
}

impl PrOutcome {
    pub fn status(&self) -> u8 {
        match self {
            PrOutcome::Good(_) => status::GOOD,
            PrOutcome::Conflict => status::RESERVATION_CONFLICT,
            PrOutcome::Check(_) => status::CHECK_CONDITION,
        }
    }
}

/// PERSISTENT RESERVE OUT with its parameter list. `ptpl_capable`: the state is saved so it
/// survives the node (APTPL may be set).
pub fn reserve_out(
    state: &mut PrState,
    nexus: &str,
    cdb: &[u8],
    params: &[u8],
    ptpl_capable: bool,
) -> PrOutcome {
    let action = cdb[1] & 0x1f;
    let scope = cdb[2] >> 4;
    let rtype = cdb[2] & 0x0f;
    let length = u32::from_be_bytes([cdb[5], cdb[6], cdb[7], cdb[8]]) as usize;
    if action > 7 {
        return PrOutcome::Check(Sense::INVALID_FIELD_IN_CDB);
    }
    if action == 7 {
        // REGISTER AND MOVE is not supported.
        return PrOutcome::Check(Sense::INVALID_FIELD_IN_CDB);
    }
    if length != 24 || params.len() < 24 {
        return PrOutcome::Check(Sense::PARAMETER_LIST_LENGTH_ERROR);
    }
    let key = u64::from_be_bytes(params[0..8].try_into().expect("8 bytes"));
    let sa_key = u64::from_be_bytes(params[8..16].try_into().expect("8 bytes"));
    let flags = params[20];
    if flags & 0x08 != 0 {
        // SPEC_I_PT: not supported (REPORT CAPABILITIES says so).
        return PrOutcome::Check(Sense::INVALID_FIELD_IN_PARAMETER_LIST);
    }
    let aptpl = flags & 0x01 != 0;
    if aptpl && !ptpl_capable {
        // Held in memory only: registrations would not survive a restart of this node.
        return PrOutcome::Check(Sense::INVALID_FIELD_IN_PARAMETER_LIST);
    }
    if state.legacy.as_deref().is_some_and(|h| h != nexus) {
        return PrOutcome::Conflict;
    }
    let registered = state.key_of(nexus);
    match action {
        0 | 6 => {
            let ignore = action == 6;
            match registered {
                None => {
                    if !ignore && key != 0 {
                        return PrOutcome::Conflict;
                    }
                    if sa_key != 0 {
                        if state.registrations.len() >= MAX_REGISTRATIONS_PER_UNIT {
                            return PrOutcome::Check(Sense::INSUFFICIENT_REGISTRATION_RESOURCES);
                        }
                        state.registrations.push(Registration {
                            nexus: nexus.to_string(),
                            key: sa_key,
                        });
                    }
                }
                Some(current) => {
                    if !ignore && key != current {
                        return PrOutcome::Conflict;
                    }
                    if sa_key == 0 {
                        state.unregister(nexus);
                    } else if let Some(r) =
                        state.registrations.iter_mut().find(|r| r.nexus == nexus)
                    {
                        r.key = sa_key;
                    }
                }
            }
            // SPC-4 5.14.5: APTPL counts from a REGISTER; other actions ignore the bit.
            state.aptpl = aptpl;
            state.generation = state.generation.wrapping_add(1);
            PrOutcome::Good(Vec::new())
        }
        _ if registered != Some(key) => PrOutcome::Conflict,
        1 => {
            if scope != 0 || !valid_type(rtype) {
                return PrOutcome::Check(Sense::INVALID_FIELD_IN_CDB);
            }
            match &state.reservation {
                Some(r) if state.is_holder(nexus) => {
                    if r.kind == rtype {
                        PrOutcome::Good(Vec::new())
                    } else {
                        PrOutcome::Conflict
                    }
                }
                Some(_) => PrOutcome::Conflict,
                None => {
                    state.reservation = Some(Reservation {
                        holder: nexus.to_string(),
                        kind: rtype,
                    });
                    PrOutcome::Good(Vec::new())
                }
            }
        }
        2 => {
            let Some(r) = &state.reservation else {
                return PrOutcome::Good(Vec::new());
            };
            if !state.is_holder(nexus) {
                return PrOutcome::Good(Vec::new());
            }
            if scope != 0 || r.kind != rtype {
                return PrOutcome::Check(Sense::INVALID_RELEASE_OF_PR);
            }
            state.reservation = None;
            PrOutcome::Good(Vec::new())
        }
        3 => {
            state.registrations.clear();
            state.reservation = None;
            state.generation = state.generation.wrapping_add(1);
            PrOutcome::Good(Vec::new())
        }
        _ => preempt(state, nexus, scope, rtype, sa_key),
    }
}

fn preempt(state: &mut PrState, nexus: &str, scope: u8, rtype: u8, sa_key: u64) -> PrOutcome {
    if scope != 0 || !valid_type(rtype) {
        return PrOutcome::Check(Sense::INVALID_FIELD_IN_CDB);
    }
    let new_reservation = Reservation {
        holder: nexus.to_string(),
        kind: rtype,
    };
    match state.reservation.clone() {
        Some(r) if all_registrants(r.kind) => {
            if sa_key == 0 {
                state.registrations.retain(|reg| reg.nexus == nexus);
                state.reservation = Some(new_reservation);
            } else {
                state
                    .registrations
                    .retain(|reg| reg.key != sa_key || reg.nexus == nexus);
            }
        }
        Some(r) => {
            let holder_key = state.key_of(&r.holder);
            if holder_key == Some(sa_key) {
                state
                    .registrations
                    .retain(|reg| reg.key != sa_key || reg.nexus == nexus);
                state.reservation = Some(new_reservation);
            } else {
                if sa_key == 0 {
                    return PrOutcome::Check(Sense::INVALID_FIELD_IN_PARAMETER_LIST);
                }
                let before = state.registrations.len();
                state
                    .registrations
                    .retain(|reg| reg.key != sa_key || reg.nexus == nexus);
                if state.registrations.len() == before {
                    return PrOutcome::Conflict;
                }
            }
        }
        None => {
            if sa_key == 0 {
                return PrOutcome::Check(Sense::INVALID_FIELD_IN_PARAMETER_LIST);
            }
            let before = state.registrations.len();
            state
                .registrations
                .retain(|reg| reg.key != sa_key || reg.nexus == nexus);
            if state.registrations.len() == before {
                return PrOutcome::Conflict;
            }
        }
    }
    state.generation = state.generation.wrapping_add(1);
    PrOutcome::Good(Vec::new())
}

/// PERSISTENT RESERVE IN; `ptpl_capable` as for [`reserve_out`].
pub fn reserve_in(state: &PrState, cdb: &[u8], ptpl_capable: bool) -> PrOutcome {
    let action = cdb[1] & 0x1f;
    let mut out = Vec::new();
    out.extend_from_slice(&state.generation.to_be_bytes());
    match action {
        0 => {
            let keys: Vec<u64> = state.registrations.iter().map(|r| r.key).collect();
            out.extend_from_slice(&((keys.len() * 8) as u32).to_be_bytes());
            for key in keys {
                out.extend_from_slice(&key.to_be_bytes());
            }
        }
        1 => match &state.reservation {
            Some(r) => {
                out.extend_from_slice(&16u32.to_be_bytes());
                let key = if all_registrants(r.kind) {
                    0
                } else {
                    state.key_of(&r.holder).unwrap_or(0)
                };
                out.extend_from_slice(&key.to_be_bytes());
                out.extend_from_slice(&[0, 0, 0, 0, 0, r.kind & 0x0f, 0, 0]);
            }
            None => out.extend_from_slice(&0u32.to_be_bytes()),
        },
        2 => {
            out.clear();
            // Length 8; CRH; ATP_C/SIP_C not supported; PTPL_C when saved; TMV with every
            // type; PTPL_A is the last APTPL registered.
            let ptpl_c = u8::from(ptpl_capable);
            let ptpl_a = u8::from(state.aptpl);
            out.extend_from_slice(&[0, 8, 0x10 | ptpl_c, 0x80 | ptpl_a, 0xea, 0x01, 0, 0]);
        }
        3 => {
            let mut descriptors = Vec::new();
            for reg in &state.registrations {
                let transport_id = transport_id(&reg.nexus);
                descriptors.extend_from_slice(&reg.key.to_be_bytes());
                descriptors.extend_from_slice(&[0; 4]);
                let holder = state.is_holder(&reg.nexus);
                descriptors.push(if holder { 0x01 } else { 0 });
                let kind = match (&state.reservation, holder) {
                    (Some(r), true) => r.kind & 0x0f,
                    _ => 0,
                };
                descriptors.push(kind);
                descriptors.extend_from_slice(&[0; 4]);
                descriptors.extend_from_slice(&1u16.to_be_bytes()); // relative target port 1
                descriptors.extend_from_slice(&(transport_id.len() as u32).to_be_bytes());
                descriptors.extend_from_slice(&transport_id);
            }
            out.extend_from_slice(&(descriptors.len() as u32).to_be_bytes());
            out.extend_from_slice(&descriptors);
        }
        _ => return PrOutcome::Check(Sense::INVALID_FIELD_IN_CDB),
    }
    PrOutcome::Good(out)
}

/// The iSCSI TransportID of an initiator port (SPC-4 7.6.4.6, format 01b).
fn transport_id(nexus: &str) -> Vec<u8> {
    let mut name = nexus.as_bytes().to_vec();
    name.push(0);
    while !name.len().is_multiple_of(4) {
        name.push(0);
    }
    let mut out = vec![0x45, 0];
    out.extend_from_slice(&(name.len() as u16).to_be_bytes());
    out.extend_from_slice(&name);
    out
}

/// RESERVE(6): exclusive to one I_T nexus; refused while persistent reservations exist.
pub fn reserve6(state: &mut PrState, nexus: &str) -> PrOutcome {
    if state.reservation.is_some() || !state.registrations.is_empty() {
        return PrOutcome::Conflict;
    }
    match &state.legacy {
        Some(holder) if holder != nexus => PrOutcome::Conflict,
        _ => {
            state.legacy = Some(nexus.to_string());
            PrOutcome::Good(Vec::new())
        }
    }
}

/// RELEASE(6): releases only the caller's reservation; otherwise does nothing.
pub fn release6(state: &mut PrState, nexus: &str) -> PrOutcome {
    if state.reservation.is_some() {
        return if state.allows(nexus, Access::Write) {
            PrOutcome::Good(Vec::new())
        } else {
            PrOutcome::Conflict
        };
    }
    if state.legacy.as_deref() == Some(nexus) {
        state.legacy = None;
    }
    PrOutcome::Good(Vec::new())
}

/// Why the saved reservation state could not be read or changed.
#[derive(Debug, thiserror::Error)]
pub enum ReservationError {
    #[error("reservation store: {0}")]
    Store(String),
    #[error("corrupt reservation record of unit {unit_id}: {reason}")]
    Corrupt { unit_id: u64, reason: String },
    /// This node may not change the unit's state now: it does not serve the unit (in a
    /// cluster: its ownership claim of the unit's vdisk lapsed or another node took it).
    /// Answered NOT READY, like the unit's I/O.
    #[error("not serving the unit: {0}")]
    NotServing(String),
}

impl ReservationError {
    /// The sense a command that could not save its change answers with.
    pub(crate) fn sense(&self) -> Sense {
        match self {
            ReservationError::NotServing(_) => Sense::LUN_BECOMING_READY,
            ReservationError::Store(_) | ReservationError::Corrupt { .. } => {
                Sense::INTERNAL_TARGET_FAILURE
            }
        }
    }
}

/// A future of a [`ReservationBackend`]; it runs on the reactor of the session that asked.
pub type BackendFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, ReservationError>> + 'a>>;

/// Where the persistent part of a unit's reservation state is saved (everything but
/// RESERVE(6), which ends with its I_T nexus).
pub trait ReservationBackend: Send + Sync + 'static {
    /// Applies `change` to the saved state of `unit_id` atomically: reads it, runs `change`,
    /// and saves the result if `change` returns true, running `change` again on the newer
    /// state if the record changed meanwhile (compare-and-swap). Returns the state as saved,
    /// or as read when `change` returned false.
    fn update<'a>(
        &'a self,
        unit_id: u64,
        change: &'a mut dyn FnMut(&mut PrState) -> bool,
    ) -> BackendFuture<'a, PrState>;

    /// Whether this node may change `unit_id`'s reservations now (asked before every
    /// change, RESERVE(6) and RELEASE(6) included): `Err(NotServing)` while it does not
    /// serve the unit. [`Self::update`] must also refuse with `NotServing` when serving
    /// stopped while it ran. Always yes for a store of one node.
    fn serving(&self, unit_id: u64) -> Result<(), ReservationError> {
        let _ = unit_id;
        Ok(())
    }
}

/// A unit's saved state: where, and under which number.
struct Saved {
    unit_id: u64,
    backend: Arc<dyn ReservationBackend>,
}

impl std::fmt::Debug for Saved {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Saved")
            .field("unit_id", &self.unit_id)
            .finish_non_exhaustive()
    }
}

/// Capacity not observed yet.
const CAPACITY_UNKNOWN: u64 = u64::MAX;

/// The reservation state of one unit, shared by all its sessions, with its pending unit
/// attentions.
#[derive(Debug)]
pub struct LunReservations {
    /// True while the state is not empty: I/O checks the mutex only then.
    active: AtomicBool,
    state: Mutex<PrState>,
    /// True while some nexus has a unit attention pending: commands check the mutex only
    /// then.
    attention_pending: AtomicBool,
    attentions: Mutex<Attentions>,
    /// The capacity last reported, to tell every nexus when it changes (`vdisk resize`).
    capacity_bytes: AtomicU64,
    /// One PERSISTENT RESERVE OUT at a time per unit on this node, so the saved state and
    /// the copy here change in the same order.
    changes: tokio::sync::Mutex<()>,
    /// Orders COMPARE AND WRITE against every write of the unit: writes share it, COMPARE
    /// AND WRITE holds it alone from its read to its write (SBC-3 5.2: atomic).
    pub(crate) write_order: tokio::sync::RwLock<()>,
    saved: Option<Saved>,
    /// PREEMPT AND ABORTs done so far. A command notes it when it arrives, so an abort
    /// takes only the commands that arrived before the preemption (later ones see its unit
    /// attention instead).
    preemptions: AtomicU64,
    /// The sessions open to the unit, to order their commands aborted (taken at login,
    /// logout and PREEMPT AND ABORT only).
    sessions: Mutex<AbortRoutes>,
}

impl Default for LunReservations {
    fn default() -> Self {
        LunReservations {
            active: AtomicBool::new(false),
            state: Mutex::new(PrState::default()),
            attention_pending: AtomicBool::new(false),
            attentions: Mutex::new(Attentions::default()),
            capacity_bytes: AtomicU64::new(CAPACITY_UNKNOWN),
            changes: tokio::sync::Mutex::new(()),
            write_order: tokio::sync::RwLock::new(()),
            saved: None,
            preemptions: AtomicU64::new(0),
            sessions: Mutex::new(AbortRoutes::default()),
        }
    }
}

impl LunReservations {
    /// A unit whose persistent state is saved by `backend`, starting from `state` (as loaded).
    pub fn saved(unit_id: u64, state: PrState, backend: Arc<dyn ReservationBackend>) -> Self {
        assert!(state.legacy.is_none(), "RESERVE(6) is never saved");
        let unit = LunReservations {
            saved: Some(Saved { unit_id, backend }),
            ..LunReservations::default()
        };
        unit.update(|s| *s = state);
        unit
    }

    /// Whether `nexus` may run a command of class `access` now.
    pub fn allows(&self, nexus: &str, access: Access) -> bool {
        if access == Access::Always || !self.active.load(Ordering::Acquire) {
            return true;
        }
        self.lock().allows(nexus, access)
    }

    /// Runs `f` on the state in memory only (RESERVE/RELEASE(6)); keeps the fast-path flag
    /// in step.
    pub fn update<T>(&self, f: impl FnOnce(&mut PrState) -> T) -> T {
        let mut state = self.lock();
        let result = f(&mut state);
        self.active.store(!state.is_empty(), Ordering::Release);
        result
    }

    /// A copy of the state (for tests and diagnostics).
    pub fn snapshot(&self) -> PrState {
        self.lock().clone()
    }

    /// PERSISTENT RESERVE IN.
    pub fn reserve_in(&self, cdb: &[u8]) -> PrOutcome {
        reserve_in(&self.lock(), cdb, self.saved.is_some())
    }

    /// PERSISTENT RESERVE OUT: saved (when the unit has a backend) before it takes effect
    /// here; the nexuses it affects get their unit attentions. A PREEMPT AND ABORT is
    /// answered only once the preempted nexuses' earlier commands are aborted.
    pub async fn reserve_out(&self, nexus: &str, cdb: &[u8], params: &[u8]) -> PrOutcome {
        if let Err(error) = self.serving() {
            return PrOutcome::Check(error.sense());
        }
        let serial = self.changes.lock().await;
        let action = cdb[1] & 0x1f;
        let current = self.snapshot();
        let mut outcome = None;
        let mut before = current.clone();
        let mut change = |state: &mut PrState| {
            state.legacy = current.legacy.clone();
            before = state.clone();
            let result = reserve_out(state, nexus, cdb, params, self.saved.is_some());
            let good = matches!(result, PrOutcome::Good(_));
            outcome = Some(result);
            good && *state != before
        };
        let after = match &self.saved {
            None => {
                let mut state = current.clone();
                change(&mut state);
                state
            }
            Some(saved) => match saved.backend.update(saved.unit_id, &mut change).await {
                Ok(state) => state,
                Err(error @ ReservationError::NotServing(_)) => {
                    tracing::warn!(unit = saved.unit_id, %error,
                        "PERSISTENT RESERVE OUT refused: this node no longer serves the unit");
                    return PrOutcome::Check(error.sense());
                }
                Err(error) => {
                    tracing::error!(unit = saved.unit_id, %error,
                        "cannot save persistent reservation state; command failed");
                    return PrOutcome::Check(error.sense());
                }
            },
        };
        let outcome = outcome.expect("the change ran at least once");
        let told = if matches!(outcome, PrOutcome::Good(_)) {
            attention::after_reserve_out(&before, &after, action, nexus)
        } else {
            Vec::new()
        };
        let preempted = if action == PREEMPT_AND_ABORT && matches!(outcome, PrOutcome::Good(_)) {
            removed(&before, &after)
        } else {
            Vec::new()
        };
        // Whatever the outcome, the copy here follows what the store holds.
        self.update(|state| state.adopt_saved(after));
        self.post(told);
        // The preempted nexuses' own PERSISTENT RESERVE OUTs may be queued behind this one,
        // and their sessions wait for them while aborting.
        drop(serial);
        if !preempted.is_empty() {
            self.abort_preempted(&preempted).await;
        }
        outcome
    }

    /// Whether this node may change the unit's reservations now (see
    /// [`ReservationBackend::serving`]); a unit held in memory only always may. TEST UNIT
    /// READY asks it too: a node that does not serve the unit is not ready.
    pub(crate) fn serving(&self) -> Result<(), ReservationError> {
        match &self.saved {
            Some(saved) => saved.backend.serving(saved.unit_id),
            None => Ok(()),
        }
    }

    /// RESERVE(6) for `nexus`. Held in memory only, but refused (NOT READY) on a node that
    /// does not serve the unit: the initiator would believe it holds a reservation that the
    /// node serving the unit knows nothing of.
    pub fn reserve6(&self, nexus: &str) -> PrOutcome {
        match self.serving() {
            Ok(()) => self.update(|state| reserve6(state, nexus)),
            Err(error) => PrOutcome::Check(error.sense()),
        }
    }

    /// RELEASE(6) for `nexus`; refused like [`Self::reserve6`] where the unit is not served.
    pub fn release6(&self, nexus: &str) -> PrOutcome {
        match self.serving() {
            Ok(()) => self.update(|state| release6(state, nexus)),
            Err(error) => PrOutcome::Check(error.sense()),
        }
    }

    /// Makes the saved state that `read` reads (again, from where the backend saves it) the
    /// state here (RESERVE(6) stays): another node may have changed it. Ordered with this
    /// node's PERSISTENT RESERVE OUTs (`read` runs after those before it finished and before
    /// those after it start), so a read never undoes a newer change made here. Returns
    /// whether the state here changed.
    pub async fn reload_from(
        &self,
        read: impl Future<Output = Result<PrState, ReservationError>>,
    ) -> Result<bool, ReservationError> {
        let _serial = self.changes.lock().await;
        let stored = read.await?;
        Ok(self.update(|state| {
            let before = state.clone();
            state.adopt_saved(stored);
            *state != before
        }))
    }

    /// How many PREEMPT AND ABORTs the unit has seen: a command notes it when it arrives.
    pub(crate) fn preemptions(&self) -> u64 {
        self.preemptions.load(Ordering::Acquire)
    }

    /// Aborts the commands the `preempted` nexuses sent before now, in their sessions on any
    /// reactor, and waits until they are gone.
    async fn abort_preempted(&self, preempted: &[String]) {
        // The unit attentions are posted before the count moves: a command that sees the new
        // count is not aborted and must find its attention.
        let before = self.preemptions.fetch_add(1, Ordering::AcqRel) + 1;
        let routes = self.sessions().of(preempted.iter().map(String::as_str));
        let late = abort::abort_sessions(routes, before, abort::ABORT_WAIT).await;
        if late > 0 {
            tracing::warn!(sessions = late, waited = ?abort::ABORT_WAIT,
                "PREEMPT AND ABORT: preempted sessions did not abort their commands in time; answering anyway");
        }
    }

    /// An I_T nexus opened a session to the unit; `route` reaches its commands.
    pub(crate) fn nexus_joined(&self, nexus: &str, route: AbortRoute) {
        let mut attentions = self.attentions();
        attentions.joined(nexus);
        self.attention_pending
            .store(!attentions.is_empty(), Ordering::Release);
        drop(attentions);
        self.sessions().add(nexus, route);
    }

    /// The unit is served here anew: this node serves it for the first time, or another node
    /// may have served it since this node last did (a failover or a failback). As after a
    /// power on, the RESERVE(6) held here is gone and every I_T nexus's next command (of a
    /// session open now or opened later) gets UNIT ATTENTION, POWER ON, RESET, OR BUS DEVICE
    /// RESET OCCURRED, once.
    pub fn served_anew(&self) {
        self.update(|state| state.legacy = None);
        let mut attentions = self.attentions();
        attentions.served_anew();
        self.attention_pending
            .store(!attentions.is_empty(), Ordering::Release);
    }

    /// Session `session` of an I_T nexus ended: what the nexus held only for its lifetime
    /// (RESERVE(6)) is dropped; persistent registrations stay.
    pub(crate) fn nexus_lost(&self, nexus: &str, session: u64) {
        self.sessions().remove(nexus, session);
        let registered = self.update(|state| {
            if state.legacy.as_deref() == Some(nexus) {
                state.legacy = None;
            }
            state.key_of(nexus).is_some()
        });
        let mut attentions = self.attentions();
        attentions.left(nexus, registered);
        self.attention_pending
            .store(!attentions.is_empty(), Ordering::Release);
    }

    /// A LOGICAL UNIT RESET (`sense` BUS DEVICE RESET FUNCTION OCCURRED) or a target reset:
    /// releases RESERVE(6) reservations and tells every connected nexus.
    pub fn reset(&self, sense: Sense) {
        self.update(|state| state.legacy = None);
        let mut attentions = self.attentions();
        attentions.post_connected(sense);
        self.attention_pending
            .store(!attentions.is_empty(), Ordering::Release);
    }

    /// Notes the capacity a command sees; a change (a resize) is told to every connected
    /// nexus (SBC-3 4.5: CAPACITY DATA HAS CHANGED).
    pub fn observe_capacity(&self, bytes: u64) {
        let last = self.capacity_bytes.load(Ordering::Relaxed);
        if last == bytes {
            return;
        }
        let swapped =
            self.capacity_bytes
                .compare_exchange(last, bytes, Ordering::AcqRel, Ordering::Relaxed);
        if swapped.is_ok() && last != CAPACITY_UNKNOWN {
            let mut attentions = self.attentions();
            attentions.post_connected(Sense::CAPACITY_DATA_CHANGED);
            self.attention_pending
                .store(!attentions.is_empty(), Ordering::Release);
        }
    }

    /// Takes the oldest unit attention pending for `nexus`.
    pub fn take_attention(&self, nexus: &str) -> Option<Sense> {
        if !self.attention_pending.load(Ordering::Acquire) {
            return None;
        }
        let mut attentions = self.attentions();
        let sense = attentions.take(nexus);
        self.attention_pending
            .store(!attentions.is_empty(), Ordering::Release);
        sense
    }

    fn post(&self, told: Vec<(String, Sense)>) {
        if told.is_empty() {
            return;
        }
        let mut attentions = self.attentions();
        for (nexus, sense) in told {
            attentions.post(&nexus, sense);
        }
        self.attention_pending.store(true, Ordering::Release);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, PrState> {
        // A panic while holding the lock leaves a consistent state (updates are whole).
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn attentions(&self) -> std::sync::MutexGuard<'_, Attentions> {
        self.attentions.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn sessions(&self) -> std::sync::MutexGuard<'_, AbortRoutes> {
        self.sessions.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The nexuses registered in `before` and not in `after`.
fn removed(before: &PrState, after: &PrState) -> Vec<String> {
    before
        .registrations
        .iter()
        .filter(|b| !after.registrations.iter().any(|a| a.nexus == b.nexus))
        .map(|b| b.nexus.clone())
        .collect()
}

/// Where reservation state lives, one [`LunReservations`] per unit id.
pub trait ReservationStore: Send + Sync + 'static {
    fn unit(&self, unit_id: u64) -> Arc<LunReservations>;
    /// Forgets a unit (its vdisk was deleted).
    fn forget(&self, unit_id: u64);
}

/// In-memory reservation state of a single node; lost when the node restarts.
#[derive(Debug, Default)]
pub struct MemoryReservations {
    units: Mutex<HashMap<u64, Arc<LunReservations>>>,
}

impl ReservationStore for MemoryReservations {
    fn unit(&self, unit_id: u64) -> Arc<LunReservations> {
        let mut units = self.units.lock().unwrap_or_else(|e| e.into_inner());
        units.entry(unit_id).or_default().clone()
    }

    fn forget(&self, unit_id: u64) {
        self.units
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&unit_id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn out_cdb(action: u8, rtype: u8) -> [u8; 10] {
        [0x5f, action, rtype, 0, 0, 0, 0, 0, 24, 0]
    }

    fn params(key: u64, sa_key: u64) -> Vec<u8> {
        let mut p = vec![0u8; 24];
        p[0..8].copy_from_slice(&key.to_be_bytes());
        p[8..16].copy_from_slice(&sa_key.to_be_bytes());
        p
    }

    fn out(s: &mut PrState, nexus: &str, cdb: &[u8], params: &[u8]) -> PrOutcome {
        reserve_out(s, nexus, cdb, params, false)
    }

    const A: &str = "iqn.a,i,0x000000000001";
    const B: &str = "iqn.b,i,0x000000000002";

    #[test]
    fn register_reserve_conflict_release() {
        let mut s = PrState::default();
        assert_eq!(
            out(&mut s, A, &out_cdb(0, 0), &params(0, 0xa)),
            PrOutcome::Good(vec![])
        );
        assert_eq!(s.generation, 1);
        // Reserving needs the right key.
        assert_eq!(
            out(&mut s, A, &out_cdb(1, 1), &params(0xb, 0)),
            PrOutcome::Conflict
        );
        assert_eq!(
            out(
                &mut s,
                A,
                &out_cdb(1, kind::WRITE_EXCLUSIVE),
                &params(0xa, 0)
            ),
            PrOutcome::Good(vec![])
        );
        assert!(s.allows(B, Access::Read));
        assert!(!s.allows(B, Access::Write));
        assert!(s.allows(A, Access::Write));
        // Release with the wrong type.
        assert_eq!(
            out(
                &mut s,
                A,
                &out_cdb(2, kind::EXCLUSIVE_ACCESS),
                &params(0xa, 0)
            ),
            PrOutcome::Check(Sense::INVALID_RELEASE_OF_PR)
        );
        assert_eq!(
            out(
                &mut s,
                A,
                &out_cdb(2, kind::WRITE_EXCLUSIVE),
                &params(0xa, 0)
            ),
            PrOutcome::Good(vec![])
        );
        assert!(s.allows(B, Access::Write));
    }

    #[test]
    fn registrants_only_and_preempt() {
        let mut s = PrState::default();
        out(&mut s, A, &out_cdb(0, 0), &params(0, 0xa));
        out(&mut s, B, &out_cdb(0, 0), &params(0, 0xb));
        out(
            &mut s,
            A,
            &out_cdb(1, kind::EXCLUSIVE_ACCESS_REGISTRANTS_ONLY),
            &params(0xa, 0),
        );
        assert!(s.allows(B, Access::Write));
        assert!(!s.allows("iqn.c,i,0x0", Access::Read));
        // B preempts A's reservation and registration.
        assert_eq!(
            out(
                &mut s,
                B,
                &out_cdb(4, kind::EXCLUSIVE_ACCESS),
                &params(0xb, 0xa)
            ),
            PrOutcome::Good(vec![])
        );
        assert_eq!(s.registrations.len(), 1);
        assert_eq!(s.reservation.as_ref().unwrap().holder, B);
        assert!(!s.allows(A, Access::Read));
        // READ KEYS shows B only.
        let PrOutcome::Good(keys) = reserve_in(&s, &[0x5e, 0, 0, 0, 0, 0, 0, 0, 64, 0], false)
        else {
            panic!()
        };
        assert_eq!(&keys[4..8], &[0, 0, 0, 8]);
        assert_eq!(&keys[8..16], &0xbu64.to_be_bytes());
    }

    #[test]
    fn all_registrants_survive_until_the_last_unregisters() {
        let mut s = PrState::default();
        out(&mut s, A, &out_cdb(0, 0), &params(0, 1));
        out(&mut s, B, &out_cdb(0, 0), &params(0, 2));
        out(
            &mut s,
            A,
            &out_cdb(1, kind::WRITE_EXCLUSIVE_ALL_REGISTRANTS),
            &params(1, 0),
        );
        assert!(s.allows(B, Access::Write));
        out(&mut s, A, &out_cdb(0, 0), &params(1, 0));
        assert!(s.reservation.is_some());
        out(&mut s, B, &out_cdb(0, 0), &params(2, 0));
        assert!(s.reservation.is_none());
    }

    #[test]
    fn legacy_reserve_excludes_others() {
        let unit = LunReservations::default();
        assert!(unit.allows(B, Access::Write));
        assert_eq!(unit.update(|s| reserve6(s, A)), PrOutcome::Good(vec![]));
        assert!(!unit.allows(B, Access::Read));
        assert!(unit.allows(B, Access::Always));
        assert_eq!(unit.update(|s| reserve6(s, B)), PrOutcome::Conflict);
        unit.nexus_lost(A, 0);
        assert!(unit.allows(B, Access::Write));
    }
}

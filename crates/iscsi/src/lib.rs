//! iSCSI target front-end of Ashlar (RFC 7143, error recovery level 0) with SPC-4/SBC-3
//! commands, generic over the vdisk [`BlockDevice`](ashlar_core::BlockDevice) interface. See
//! `docs/iscsi.md` for what is supported.
//!
//! Layers, each testable alone:
//! - [`pdu`]: the PDU codec (BHS, AHS, padding, CRC32C digests), pure.
//! - [`login`], `params`, `chap`, `text`: the login state machine, pure.
//! - [`scsi`]: command execution over one device, with reservations.
//! - `session`: one connection's full feature phase (reader, per-command tasks, writer).
//! - `keepalive`: when to NOP-In ping a quiet initiator and when to give up on it, pure.
//!
//! A connection runs inside a tokio current-thread runtime and a `LocalSet`: device futures
//! need not be `Send`. One session has one connection (MaxConnections=1).

mod abort;
pub mod chap;
mod error;
mod keepalive;
mod limits;
pub mod login;
pub mod lun;
mod params;
pub mod pdu;
mod reading;
mod registry;
mod reinstate;
pub mod scsi;
mod session;
#[cfg(test)]
mod testing;
mod text;
mod transfer;

pub use error::IscsiError;
pub use keepalive::NopSettings;
pub use limits::{
    DataBudget, IscsiLimits, DEFAULT_DATA_BUDGET_BYTES, DEFAULT_NOP_INTERVAL, DEFAULT_NOP_TIMEOUT,
};
pub use registry::{
    Access, ChapCredentials, LogicalUnit, Refusal, TargetRegistry, TargetUnavailable,
};
pub use reinstate::SessionTable;
pub use scsi::reservation::{
    BackendFuture, LunReservations, MemoryReservations, PrState, Registration, Reservation,
    ReservationBackend, ReservationError, ReservationStore,
};
pub use session::{resume, serve_connection, serve_or_hand_over, Handover};

/// The portal group tag of every portal of a node.
pub const PORTAL_GROUP_TAG: u16 = 1;

/// The IQN prefix of targets named after volume groups.
pub const TARGET_IQN_PREFIX: &str = "iqn.2024-01.io.ashlar:";

//! What the target asks of its host: which targets exist, who may log in to them, and the
//! logical units (devices) behind each.

use crate::scsi::reservation::LunReservations;
use ashlar_core::BlockDevice;
use std::sync::Arc;

/// A CHAP user name and secret.
#[derive(Clone, PartialEq, Eq)]
pub struct ChapCredentials {
    pub user: String,
    pub secret: String,
}

impl std::fmt::Debug for ChapCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print secrets.
        f.debug_struct("ChapCredentials")
            .field("user", &self.user)
            .finish_non_exhaustive()
    }
}

/// What an initiator must prove to log in to a target.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Access {
    /// The initiator must answer a CHAP challenge with this user and secret.
    pub chap: Option<ChapCredentials>,
    /// Mutual CHAP: the target answers the initiator's challenge with these.
    pub mutual_chap: Option<ChapCredentials>,
}

/// Why a login to a target is refused before authentication.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// No target of that name (login status 0x0203).
    UnknownTarget,
    /// The target exists but this initiator is not attached to it (0x0202).
    NotAttached,
}

/// Why a target cannot be served through this portal now, found as an initiator finishes
/// its login (after authentication): the login fails with a status that tells the
/// initiator what to do (RFC 7143 11.13.5).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TargetUnavailable {
    /// Another portal serves the target: "target moved temporarily" (0x0101), with the
    /// `TargetAddress` (`host:port`, IPv6 in brackets) the initiator logs in at instead.
    MovedTemporarily { address: String },
    /// No portal can serve it now: "service unavailable" (0x0301). The registry logs why.
    ServiceUnavailable,
}

/// One logical unit of a target, opened for one session.
pub struct LogicalUnit<D> {
    pub device: D,
    /// Name shown in INQUIRY data (the vdisk name).
    pub name: String,
    /// A stable, node-unique number for the unit serial number and NAA designator.
    pub id: u64,
    /// Reservation and COMPARE AND WRITE state shared by every session of the unit.
    pub shared: Arc<LunReservations>,
}

/// Where the target finds targets, access rules and devices. Called at login (control
/// plane), never per I/O.
pub trait TargetRegistry: 'static {
    type Device: BlockDevice + 'static;
    /// Names of the targets `initiator` may see in SendTargets discovery.
    fn discover(&self, initiator: &str) -> Vec<String>;
    /// Whether `initiator` may log in to `target`, and how it must authenticate.
    fn authorize(&self, initiator: &str, target: &str) -> Result<Access, Refusal>;
    /// How `initiator` must authenticate for a SendTargets discovery session (any
    /// initiator may discover; it sees only the targets [`Self::discover`] lists).
    fn discovery_access(&self, initiator: &str) -> Access {
        let _ = initiator;
        Access::default()
    }
    /// Makes the target's logical units ready to be served here, before the initiator is
    /// told it is logged in to it (a node of a cluster claims them). Called once per
    /// normal-session login, after authentication; the default serves every target.
    fn prepare_target(
        &self,
        target: &str,
    ) -> impl std::future::Future<Output = Result<(), TargetUnavailable>> {
        let _ = target;
        std::future::ready(Ok(()))
    }
    /// Opens the target's logical units, in LUN order, for one session.
    fn open_luns(&self, target: &str) -> Result<Vec<LogicalUnit<Self::Device>>, String>;
}

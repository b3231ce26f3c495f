//! Why a connection ended other than by logout or shutdown, and the once-per-kind logging of
//! protocol violations (a hostile initiator cannot flood the log).

use crate::pdu::PduError;
use std::fmt::Display;
use std::time::Duration;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum IscsiError {
    #[error("socket error: {0}")]
    Io(#[from] std::io::Error),
    #[error("bad PDU: {0}")]
    Pdu(#[from] PduError),
    #[error("initiator disconnected in the middle of a PDU")]
    Truncated,
    #[error("login not completed within {0:?}")]
    LoginTimeout(Duration),
    #[error("login refused with status {status:#06x}")]
    LoginRefused { status: u16 },
    #[error("protocol error: {0}")]
    Protocol(String),
    #[error("initiator sent nothing within {0:?} of a NOP-In ping")]
    Unresponsive(Duration),
}

impl IscsiError {
    /// Maps a failed read: end of stream inside a PDU means the initiator left mid-PDU.
    pub(crate) fn reading(error: std::io::Error) -> IscsiError {
        if error.kind() == std::io::ErrorKind::UnexpectedEof {
            IscsiError::Truncated
        } else {
            IscsiError::Io(error)
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Violation {
    BadPdu,
    LoginOrder,
    CmdSnOutsideWindow,
    UnknownTask,
    DataOut,
    UnsupportedOpcode,
    ImmediateData,
    DuplicateTask,
    Text,
}

pub(crate) struct ViolationLog {
    peer: String,
    seen: u32,
}

impl ViolationLog {
    pub fn new(peer: String) -> Self {
        ViolationLog { peer, seen: 0 }
    }

    pub fn peer(&self) -> &str {
        &self.peer
    }

    pub fn report(&mut self, kind: Violation, detail: &dyn Display) {
        let bit = 1u32 << (kind as u32);
        if self.seen & bit == 0 {
            self.seen |= bit;
            tracing::warn!(peer = %self.peer, ?kind, "iSCSI protocol violation: {detail}");
        } else {
            tracing::debug!(peer = %self.peer, ?kind, "iSCSI protocol violation: {detail}");
        }
    }
}

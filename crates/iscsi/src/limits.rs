//! Limits of iSCSI sessions, the byte budget they share, and the protocol-valid values
//! derived from them. Each bounds memory or time an initiator can make the node spend; see
//! `docs/iscsi.md`.

use crate::keepalive::NopSettings;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Budget unit: permits are KiB, so a 1 TiB budget stays far below the semaphore's maximum.
const BUDGET_UNIT_BYTES: u64 = 1024;

/// Default of [`DataBudget`].
pub const DEFAULT_DATA_BUDGET_BYTES: u64 = 256 << 20;

/// Limits of the iSCSI target. Clones share one [`DataBudget`].
#[derive(Debug, Clone)]
pub struct IscsiLimits {
    /// SCSI commands a session may have in flight: the CmdSN window (MaxCmdSN - ExpCmdSN + 1)
    /// advertised to the initiator, which must not send more. Commands past it are ignored.
    pub max_commands_in_flight: u32,
    /// Largest data segment we accept in one PDU (our MaxRecvDataSegmentLength). A PDU
    /// announcing more closes the connection before its data is read.
    pub max_recv_data_segment_bytes: u32,
    /// Our offer of MaxBurstLength: bytes per R2T (solicited) or per Data-In sequence.
    pub max_burst_bytes: u32,
    /// Our offer of FirstBurstLength: unsolicited bytes per write (immediate + Data-Out).
    /// Held in memory before any budget is taken, so a session buffers at most
    /// `max_commands_in_flight` times this.
    pub first_burst_bytes: u32,
    /// Largest data transfer of one SCSI command (also reported in the Block Limits VPD
    /// page). Larger commands fail with CHECK CONDITION.
    pub max_transfer_bytes: u32,
    /// Bytes of command data (write data beyond the first burst, read data waiting to be
    /// sent) all sessions of the node hold together. A command that cannot reserve its data
    /// waits (its R2T or its read is delayed); no command fails for it.
    pub data_budget: DataBudget,
    /// Time an initiator has from connecting until its login is complete.
    pub login_timeout: Duration,
    /// Bytes of key=value text accepted in one login or text negotiation.
    pub max_text_bytes: usize,
    /// The node's live sessions, for session reinstatement. Clones share it.
    pub sessions: crate::reinstate::SessionTable,
    /// NOP-In pings to quiet initiators (`None`: never ping, a dead initiator's connection
    /// stays until TCP notices).
    pub nop: Option<NopSettings>,
}

/// Default NOP-In ping interval.
pub const DEFAULT_NOP_INTERVAL: Duration = Duration::from_secs(5);
/// Default time an initiator has to answer a NOP-In ping.
pub const DEFAULT_NOP_TIMEOUT: Duration = Duration::from_secs(10);

impl Default for IscsiLimits {
    fn default() -> Self {
        IscsiLimits {
            max_commands_in_flight: 128,
            max_recv_data_segment_bytes: 256 << 10,
            max_burst_bytes: 1 << 20,
            first_burst_bytes: 64 << 10,
            max_transfer_bytes: 32 << 20,
            data_budget: DataBudget::default(),
            login_timeout: Duration::from_secs(15),
            max_text_bytes: 64 << 10,
            sessions: crate::reinstate::SessionTable::default(),
            nop: Some(NopSettings {
                interval: DEFAULT_NOP_INTERVAL,
                timeout: DEFAULT_NOP_TIMEOUT,
            }),
        }
    }
}

/// A node-wide budget of command data bytes, in KiB permits. Cloning shares it.
#[derive(Clone)]
pub struct DataBudget {
    semaphore: Arc<Semaphore>,
    capacity_units: u32,
}

impl std::fmt::Debug for DataBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataBudget")
            .field("capacity_bytes", &self.capacity_bytes())
            .field("available_bytes", &self.available_bytes())
            .finish()
    }
}

impl DataBudget {
    /// A budget of `bytes`, rounded up to whole KiB, at least 1 KiB.
    pub fn new(bytes: u64) -> Self {
        let units = bytes
            .div_ceil(BUDGET_UNIT_BYTES)
            .clamp(1, u64::from(u32::MAX >> 3)) as u32;
        DataBudget {
            semaphore: Arc::new(Semaphore::new(units as usize)),
            capacity_units: units,
        }
    }

    pub fn capacity_bytes(&self) -> u64 {
        u64::from(self.capacity_units) * BUDGET_UNIT_BYTES
    }

    pub fn available_bytes(&self) -> u64 {
        self.semaphore.available_permits() as u64 * BUDGET_UNIT_BYTES
    }

    /// Reserves `bytes` (at most the whole budget, so a command larger than the budget is
    /// served alone), waiting as long as it takes. Released when the permit drops.
    pub(crate) async fn take(&self, bytes: u32) -> Option<OwnedSemaphorePermit> {
        if bytes == 0 {
            return None;
        }
        let units = u64::from(bytes)
            .div_ceil(BUDGET_UNIT_BYTES)
            .min(u64::from(self.capacity_units)) as u32;
        // The semaphore is never closed.
        self.semaphore.clone().acquire_many_owned(units).await.ok()
    }
}

impl Default for DataBudget {
    fn default() -> Self {
        DataBudget::new(DEFAULT_DATA_BUDGET_BYTES)
    }
}

/// Largest segment and burst sizes the protocol allows (2^24 - 1).
const MAX_SEGMENT_BYTES: u32 = (1 << 24) - 1;
/// Keeps the CmdSN window far from wrapping concerns.
const MAX_WINDOW: u32 = 1 << 16;

/// [`IscsiLimits`] coerced into values the protocol permits (512 <= segment, first burst <=
/// max burst <= 2^24 - 1, transfers a multiple of 512 bytes).
#[derive(Debug, Clone)]
pub struct Effective {
    pub window: u32,
    pub max_recv_data_segment: u32,
    pub max_burst: u32,
    pub first_burst: u32,
    pub max_transfer: u32,
    pub budget: DataBudget,
    pub login_timeout: Duration,
    pub max_text_bytes: usize,
    pub sessions: crate::reinstate::SessionTable,
    pub nop: Option<NopSettings>,
}

impl From<&IscsiLimits> for Effective {
    fn from(limits: &IscsiLimits) -> Self {
        let max_burst = limits.max_burst_bytes.clamp(512, MAX_SEGMENT_BYTES);
        Effective {
            window: limits.max_commands_in_flight.clamp(1, MAX_WINDOW),
            max_recv_data_segment: limits
                .max_recv_data_segment_bytes
                .clamp(512, MAX_SEGMENT_BYTES),
            max_burst,
            first_burst: limits.first_burst_bytes.clamp(512, max_burst),
            max_transfer: (limits.max_transfer_bytes.clamp(4096, 1 << 30) / 512) * 512,
            budget: limits.data_budget.clone(),
            login_timeout: limits.login_timeout,
            max_text_bytes: limits.max_text_bytes.clamp(8192, 1 << 20),
            sessions: limits.sessions.clone(),
            // A zero interval or timeout means no pings.
            nop: limits
                .nop
                .filter(|n| !n.interval.is_zero() && !n.timeout.is_zero()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nonsense_is_coerced() {
        let e = Effective::from(&IscsiLimits {
            max_commands_in_flight: 0,
            max_recv_data_segment_bytes: 1,
            max_burst_bytes: u32::MAX,
            first_burst_bytes: u32::MAX,
            max_transfer_bytes: 5000,
            ..IscsiLimits::default()
        });
        assert_eq!(e.window, 1);
        assert_eq!(e.max_recv_data_segment, 512);
        assert_eq!(e.max_burst, (1 << 24) - 1);
        assert_eq!(e.first_burst, e.max_burst);
        assert_eq!(e.max_transfer, 4608);
    }

    #[tokio::test]
    async fn budget_is_shared_and_released() {
        let budget = DataBudget::new(8192);
        let clone = budget.clone();
        let permit = budget.take(4096).await;
        assert_eq!(clone.available_bytes(), 4096);
        drop(permit);
        // Larger than the whole budget: takes all of it.
        let big = clone.take(1 << 20).await;
        assert_eq!(budget.available_bytes(), 0);
        drop(big);
        assert_eq!(budget.available_bytes(), 8192);
        assert!(budget.take(0).await.is_none());
    }
}

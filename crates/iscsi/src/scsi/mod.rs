//! SCSI command execution (SPC-4, SBC-3) over one [`BlockDevice`]: pure decoding of CDBs and
//! encoding of parameter data, with the device reached only through the trait. The iSCSI
//! layer hands [`execute`] a CDB, the data the initiator sent and the expected transfer
//! length, and gets back a status, sense data and the data to return.
//!
//! Logical blocks are 512 bytes (8 per 4 KiB physical block).

pub mod attention;
mod block;
mod inquiry;
mod mode;
mod opcodes;
pub mod reservation;
pub mod sense;

use crate::registry::LogicalUnit;
use ashlar_core::{BlockDevice, IoError};
use bytes::Bytes;
use reservation::{Access, PrOutcome};
use sense::{status, Sense};

/// Logical block size reported to initiators.
pub const BLOCK_BYTES: u64 = 512;
/// log2 of logical blocks per physical block (4 KiB).
pub const PHYSICAL_BLOCK_EXPONENT: u8 = 3;

/// The I_T nexus a command arrives on, named by its initiator port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Nexus {
    /// `<initiator name>,i,0x<ISID>`, the SCSI initiator port name (RFC 7143 13.5.1).
    pub initiator_port: String,
}

impl Nexus {
    pub fn new(initiator: &str, isid: [u8; 6]) -> Self {
        let isid: String = isid.iter().map(|b| format!("{b:02x}")).collect();
        Nexus {
            initiator_port: format!("{initiator},i,0x{isid}"),
        }
    }
}

/// What a command ran against.
pub struct Context<'a, D> {
    /// `None` for a LUN the target does not have.
    pub unit: Option<&'a LogicalUnit<D>>,
    pub nexus: &'a Nexus,
    pub target_name: &'a str,
    pub lun_count: usize,
    /// Largest data transfer of one command, in bytes.
    pub max_transfer: u32,
}

/// The result of one command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScsiResult {
    pub status: u8,
    pub sense: Option<Sense>,
    /// Data for the initiator (Data-In), before truncation to the expected length.
    pub data_in: Bytes,
    /// The SCSI data transfer length the command called for (for residuals): bytes to
    /// return, or bytes the command wanted to receive.
    pub transfer: u32,
}

impl ScsiResult {
    pub fn good() -> Self {
        ScsiResult {
            status: status::GOOD,
            sense: None,
            data_in: Bytes::new(),
            transfer: 0,
        }
    }
    pub fn data(data: Vec<u8>) -> Self {
        let transfer = data.len() as u32;
        ScsiResult {
            data_in: Bytes::from(data),
            transfer,
            ..ScsiResult::good()
        }
    }
    /// Returns `data`, cut to the CDB's allocation length.
    pub fn allocated(mut data: Vec<u8>, allocation: usize) -> Self {
        data.truncate(allocation);
        ScsiResult::data(data)
    }
    pub fn check(sense: Sense) -> Self {
        ScsiResult {
            status: status::CHECK_CONDITION,
            sense: Some(sense),
            ..ScsiResult::good()
        }
    }
    pub fn conflict() -> Self {
        ScsiResult {
            status: status::RESERVATION_CONFLICT,
            ..ScsiResult::good()
        }
    }
    fn with_transfer(mut self, transfer: u32) -> Self {
        self.transfer = transfer;
        self
    }
}

/// Maps a device error onto sense data.
fn io_sense(error: &IoError, writing: bool) -> Sense {
    match error {
        IoError::OutOfRange { .. } => Sense::LBA_OUT_OF_RANGE,
        IoError::Invalid(_) => Sense::INVALID_FIELD_IN_CDB,
        IoError::NoSpace => Sense::SPACE_ALLOCATION_FAILED,
        IoError::ShuttingDown => Sense::LUN_NOT_READY_OFFLINE,
        IoError::NotServing(_) => Sense::LUN_BECOMING_READY,
        IoError::Io(_) if writing => Sense::WRITE_ERROR,
        IoError::Io(_) => Sense::UNRECOVERED_READ_ERROR,
    }
}

fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}
fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}
fn be64(b: &[u8]) -> u64 {
    u64::from_be_bytes(b[..8].try_into().expect("8 bytes"))
}

/// How a command touches the medium, for reservation checks.
fn access_of(cdb: &[u8; 16]) -> Access {
    match cdb[0] {
        0x12 | 0xa0 | 0x03 | 0x00 | 0x25 | 0x5e | 0x5f | 0x16 | 0x17 => Access::Always,
        0x9e if cdb[1] & 0x1f == 0x10 => Access::Always,
        0xa3 => Access::Always,
        0x08 | 0x28 | 0xa8 | 0x88 | 0x2f | 0xaf | 0x8f | 0x1a | 0x5a | 0x9e | 0x34 | 0x90 => {
            Access::Read
        }
        _ => Access::Write,
    }
}

/// Runs one command. `data_out` is what the initiator sent (up to its expected transfer
/// length); `expected` is that length.
pub async fn execute<D: BlockDevice>(
    ctx: &Context<'_, D>,
    cdb: &[u8; 16],
    data_out: Bytes,
    expected: u32,
) -> ScsiResult {
    let opcode = cdb[0];
    // Commands that need no unit.
    match opcode {
        0xa0 => return inquiry::report_luns(ctx, cdb),
        0x12 => return inquiry::inquiry(ctx, cdb),
        0x03 => return request_sense(ctx, cdb),
        _ => {}
    }
    let Some(unit) = ctx.unit else {
        return ScsiResult::check(Sense::LUN_NOT_SUPPORTED);
    };
    if let Some(refused) = refusal(ctx, unit, cdb) {
        return refused;
    }
    let nexus = ctx.nexus.initiator_port.as_str();
    match opcode {
        // Path checkers (dm-multipath's tur) ask this: a node whose claim on the unit's
        // vdisk lapsed must not look like a healthy path.
        0x00 => match unit.shared.serving() {
            Ok(()) => ScsiResult::good(),
            Err(error) => ScsiResult::check(error.sense()),
        },
        0x1b | 0x1e => ScsiResult::good(), // START STOP UNIT, PREVENT ALLOW: nothing to do
        0x25 => block::read_capacity10(unit, cdb),
        0x9e => match cdb[1] & 0x1f {
            0x10 => block::read_capacity16(unit, cdb),
            0x12 => block::get_lba_status(unit, cdb).await,
            _ => ScsiResult::check(Sense::INVALID_FIELD_IN_CDB),
        },
        0x08 | 0x28 | 0xa8 | 0x88 => block::read(ctx, unit, cdb).await,
        0x0a | 0x2a | 0xaa | 0x8a | 0x2e | 0xae | 0x8e => {
            block::write(ctx, unit, cdb, data_out, expected).await
        }
        0x2f | 0xaf | 0x8f => block::verify(ctx, unit, cdb, data_out).await,
        0x35 | 0x91 => block::synchronize_cache(unit, cdb).await,
        0x34 | 0x90 => block::prefetch(unit, cdb),
        0x42 => block::unmap(unit, cdb, &data_out).await,
        0x41 | 0x93 => block::write_same(ctx, unit, cdb, data_out).await,
        0x89 => block::compare_and_write(unit, cdb, data_out, expected).await,
        0x1a | 0x5a => mode::mode_sense(unit, cdb),
        0x15 | 0x55 => mode::mode_select(cdb, &data_out),
        0xa3 if cdb[1] & 0x1f == 0x0c => opcodes::report_supported(cdb),
        0x5e => {
            // A node that does not serve the unit may hold a stale copy of its state.
            if let Err(error) = unit.shared.serving() {
                return ScsiResult::check(error.sense());
            }
            let allocation = be16(&cdb[7..9]) as usize;
            pr_result(unit.shared.reserve_in(cdb), allocation)
        }
        0x5f => {
            let length = be32(&cdb[5..9]);
            let outcome = unit.shared.reserve_out(nexus, cdb, &data_out).await;
            pr_result(outcome, 0).with_transfer(length)
        }
        0x16 => pr_result(unit.shared.reserve6(nexus), 0),
        0x17 => pr_result(unit.shared.release6(nexus), 0),
        _ => ScsiResult::check(Sense::INVALID_OPCODE),
    }
}

/// Runs a command that needs no waiting, or returns `None` (nothing done) when it would
/// wait: a READ whose data is at hand ([`BlockDevice::read_now`]). The caller then runs
/// [`execute`], which gives the same answer.
pub fn execute_now<D: BlockDevice>(ctx: &Context<'_, D>, cdb: &[u8; 16]) -> Option<ScsiResult> {
    if !matches!(cdb[0], 0x08 | 0x28 | 0xa8 | 0x88) {
        return None;
    }
    let unit = ctx.unit?;
    if let Some(refused) = refusal(ctx, unit, cdb) {
        // The unit attention taken (if that is the refusal) must be reported now.
        return Some(refused);
    }
    block::read_now(ctx, unit, cdb)
}

/// What stops a command to `unit` before it runs: a unit attention fails the command that
/// finds it (SAM-5 5.14, UA_INTLCK_CTRL=00, and it is cleared), ahead of any reservation
/// conflict.
fn refusal<D: BlockDevice>(
    ctx: &Context<'_, D>,
    unit: &LogicalUnit<D>,
    cdb: &[u8; 16],
) -> Option<ScsiResult> {
    unit.shared.observe_capacity(unit.device.size_bytes());
    if let Some(sense) = unit.shared.take_attention(&ctx.nexus.initiator_port) {
        return Some(ScsiResult::check(sense));
    }
    if !unit
        .shared
        .allows(&ctx.nexus.initiator_port, access_of(cdb))
    {
        return Some(ScsiResult::conflict());
    }
    None
}

fn pr_result(outcome: PrOutcome, allocation: usize) -> ScsiResult {
    match outcome {
        PrOutcome::Good(data) => ScsiResult::allocated(data, allocation),
        PrOutcome::Conflict => ScsiResult::conflict(),
        PrOutcome::Check(sense) => ScsiResult::check(sense),
    }
}

/// REQUEST SENSE: sense is reported with each command (autosense), so only a unit attention
/// can be pending (returned and cleared, SPC-4 5.12.2); otherwise NO SENSE, or LOGICAL UNIT
/// NOT SUPPORTED for a LUN the target lacks.
fn request_sense<D: BlockDevice>(ctx: &Context<'_, D>, cdb: &[u8; 16]) -> ScsiResult {
    let allocation = usize::from(cdb[4]);
    let sense = match ctx.unit {
        Some(unit) => {
            unit.shared.observe_capacity(unit.device.size_bytes());
            unit.shared
                .take_attention(&ctx.nexus.initiator_port)
                .unwrap_or(Sense::NO_SENSE)
        }
        None => Sense::LUN_NOT_SUPPORTED,
    };
    let data = if cdb[1] & 0x01 != 0 {
        sense.descriptor().to_vec()
    } else {
        sense.fixed().to_vec()
    };
    ScsiResult::allocated(data, allocation)
}

#[cfg(test)]
mod tests;

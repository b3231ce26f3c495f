//! INQUIRY (standard data and VPD pages 0x00, 0x80, 0x83, 0xB0, 0xB1, 0xB2) and REPORT LUNS.

use super::block::MAX_WRITE_SAME_BLOCKS;
use super::block::{MAX_COMPARE_AND_WRITE_BLOCKS, MAX_UNMAP_BLOCKS, MAX_UNMAP_DESCRIPTORS};
use super::{be16, be32, sense::Sense, Context, ScsiResult, BLOCK_BYTES};
use crate::lun::Lun;

const VENDOR: &[u8; 8] = b"ASHLAR  ";
const PRODUCT: &[u8; 16] = b"VDISK           ";
const REVISION: &[u8; 4] = b"0001";
/// IEEE company id used in NAA designators (locally administered range).
const NAA_COMPANY_ID: u32 = 0x00_a5_1a;

/// VPD pages we serve, in ascending order.
const VPD_PAGES: [u8; 6] = [0x00, 0x80, 0x83, 0xb0, 0xb1, 0xb2];

pub(super) fn inquiry<D>(ctx: &Context<'_, D>, cdb: &[u8; 16]) -> ScsiResult {
    let evpd = cdb[1] & 0x01 != 0;
    let page = cdb[2];
    let allocation = usize::from(be16(&cdb[3..5]));
    if cdb[1] & 0x02 != 0 || (!evpd && page != 0) {
        return ScsiResult::check(Sense::INVALID_FIELD_IN_CDB);
    }
    // Peripheral qualifier 011b, type 1Fh for a LUN we do not have.
    let peripheral = if ctx.unit.is_some() { 0x00 } else { 0x7f };
    let data = if !evpd {
        standard(peripheral)
    } else {
        let Some(unit) = ctx.unit else {
            return ScsiResult::check(Sense::LUN_NOT_SUPPORTED);
        };
        let body = match page {
            0x00 => VPD_PAGES.to_vec(),
            0x80 => format!("{:016x}", unit.id).into_bytes(),
            0x83 => device_identification(unit.id, &unit.name, ctx.target_name),
            0xb0 => block_limits(ctx.max_transfer),
            0xb1 => {
                let mut p = vec![0u8; 0x3c];
                p[1] = 0x01; // medium rotation rate: non-rotating
                p
            }
            0xb2 => vec![0, 0x80 | 0x40 | 0x20 | 0x04, 0x02, 0],
            _ => return ScsiResult::check(Sense::INVALID_FIELD_IN_CDB),
        };
        let mut data = vec![peripheral, page];
        data.extend_from_slice(&(body.len() as u16).to_be_bytes());
        data.extend_from_slice(&body);
        data
    };
    ScsiResult::allocated(data, allocation)
}

fn standard(peripheral: u8) -> Vec<u8> {
    let mut data = vec![0u8; 96];
    data[0] = peripheral;
    data[2] = 0x06; // SPC-4
    data[3] = 0x12; // HISUP, response data format 2
    data[4] = (data.len() - 5) as u8;
    data[7] = 0x02; // CMDQUE
    data[8..16].copy_from_slice(VENDOR);
    data[16..32].copy_from_slice(PRODUCT);
    data[32..36].copy_from_slice(REVISION);
    // Version descriptors: SAM-5, iSCSI, SPC-4, SBC-3.
    for (i, version) in [0x00a0u16, 0x0960, 0x0460, 0x04c0].iter().enumerate() {
        data[58 + i * 2..60 + i * 2].copy_from_slice(&version.to_be_bytes());
    }
    data
}

/// Designators: NAA 6 and T10 vendor id of the logical unit, the relative target port, and
/// the SCSI name of the target device.
fn device_identification(id: u64, name: &str, target: &str) -> Vec<u8> {
    let mut out = Vec::new();
    // NAA IEEE Registered Extended (6): company id then a 36+64-bit vendor value.
    let mut naa = [0u8; 16];
    let head = 0x6u64 << 60 | u64::from(NAA_COMPANY_ID) << 36;
    naa[0..8].copy_from_slice(&head.to_be_bytes());
    naa[8..16].copy_from_slice(&id.to_be_bytes());
    designator(&mut out, 0x01, 0x03, 0x00, &naa);
    let mut t10 = VENDOR.to_vec();
    t10.extend_from_slice(name.as_bytes());
    t10.truncate(8 + 64);
    designator(&mut out, 0x02, 0x01, 0x00, &t10);
    // Relative target port 1 (association: target port; protocol iSCSI).
    designator(&mut out, 0x51, 0x04, 0x10, &[0, 0, 0, 1]);
    // SCSI name string of the target device, NUL-terminated, padded to 4 bytes.
    let mut scsi_name = target.as_bytes().to_vec();
    scsi_name.truncate(250);
    scsi_name.push(0);
    while !scsi_name.len().is_multiple_of(4) {
        scsi_name.push(0);
    }
    designator(&mut out, 0x53, 0x08, 0x20, &scsi_name);
    out
}

fn designator(out: &mut Vec<u8>, code_set: u8, kind: u8, association: u8, value: &[u8]) {
    let piv = if association != 0 { 0x80 } else { 0 };
    out.extend_from_slice(&[code_set, piv | association | kind, 0, value.len() as u8]);
    out.extend_from_slice(value);
}

fn block_limits(max_transfer: u32) -> Vec<u8> {
    let mut p = vec![0u8; 0x3c];
    p[0] = 0x01; // WSNZ: WRITE SAME with zero blocks is refused
    p[1] = MAX_COMPARE_AND_WRITE_BLOCKS;
    let granularity = 1u16 << super::PHYSICAL_BLOCK_EXPONENT;
    p[2..4].copy_from_slice(&granularity.to_be_bytes());
    let max_blocks = max_transfer / BLOCK_BYTES as u32;
    p[4..8].copy_from_slice(&max_blocks.to_be_bytes());
    p[8..12].copy_from_slice(&max_blocks.min(2048).to_be_bytes());
    p[16..20].copy_from_slice(&MAX_UNMAP_BLOCKS.to_be_bytes());
    p[20..24].copy_from_slice(&MAX_UNMAP_DESCRIPTORS.to_be_bytes());
    p[24..28].copy_from_slice(&u32::from(granularity).to_be_bytes());
    p[32..40].copy_from_slice(&MAX_WRITE_SAME_BLOCKS.to_be_bytes());
    p
}

/// REPORT LUNS: the target's LUNs, 0..n, in single-level addressing.
pub(super) fn report_luns<D>(ctx: &Context<'_, D>, cdb: &[u8; 16]) -> ScsiResult {
    let allocation = be32(&cdb[6..10]) as usize;
    if allocation < 16 || !matches!(cdb[2], 0x00..=0x02) {
        return ScsiResult::check(Sense::INVALID_FIELD_IN_CDB);
    }
    let mut data = Vec::with_capacity(8 + ctx.lun_count * 8);
    data.extend_from_slice(&((ctx.lun_count * 8) as u32).to_be_bytes());
    data.extend_from_slice(&[0; 4]);
    for lun in 0..ctx.lun_count {
        data.extend_from_slice(&Lun(lun as u16).encode());
    }
    ScsiResult::allocated(data, allocation)
}

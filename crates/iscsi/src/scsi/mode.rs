//! MODE SENSE and MODE SELECT (6 and 10): the caching, control and informational exceptions
//! pages. Nothing is changeable, so MODE SELECT accepts only the current values.

use super::block::capacity_blocks;
use super::{be16, sense::Sense, ScsiResult, BLOCK_BYTES};
use crate::registry::LogicalUnit;
use ashlar_core::BlockDevice;

/// Current values of the pages we report, page code first.
fn page(code: u8) -> Option<Vec<u8>> {
    Some(match code {
        // Caching: WCE=0, every acknowledged write is durable.
        0x08 => {
            let mut p = vec![0u8; 20];
            p[0] = 0x08;
            p[1] = 18;
            p
        }
        // Control: unrestricted reordering (QUEUE ALGORITHM MODIFIER 1), fixed-format sense.
        0x0a => {
            let mut p = vec![0u8; 12];
            p[0] = 0x0a;
            p[1] = 10;
            p[3] = 0x10;
            p[8] = 0xff;
            p[9] = 0xff; // busy timeout: unlimited
            p
        }
        // Informational exceptions control: nothing reported.
        0x1c => {
            let mut p = vec![0u8; 12];
            p[0] = 0x1c;
            p[1] = 10;
            p
        }
        _ => return None,
    })
}

const PAGES: [u8; 3] = [0x08, 0x0a, 0x1c];

pub(super) fn mode_sense<D: BlockDevice>(unit: &LogicalUnit<D>, cdb: &[u8; 16]) -> ScsiResult {
    let ten = cdb[0] == 0x5a;
    let dbd = cdb[1] & 0x08 != 0;
    let long_lba = ten && cdb[1] & 0x10 != 0;
    let control = cdb[2] >> 6;
    let code = cdb[2] & 0x3f;
    let subpage = cdb[3];
    let allocation = if ten {
        usize::from(be16(&cdb[7..9]))
    } else {
        usize::from(cdb[4])
    };
    if control == 3 {
        return ScsiResult::check(Sense::SAVING_PARAMETERS_NOT_SUPPORTED);
    }
    let codes: Vec<u8> = match (code, subpage) {
        (0x3f, 0x00 | 0xff) => PAGES.to_vec(),
        (c, 0x00) if PAGES.contains(&c) => vec![c],
        _ => return ScsiResult::check(Sense::INVALID_FIELD_IN_CDB),
    };
    let mut pages = Vec::new();
    for c in codes {
        let mut p = page(c).expect("listed page");
        if control == 1 {
            // Changeable values: none.
            p[2..].fill(0);
        }
        pages.extend_from_slice(&p);
    }
    let blocks = capacity_blocks(unit);
    let descriptor: Vec<u8> = if dbd {
        Vec::new()
    } else if long_lba {
        let mut d = vec![0u8; 16];
        d[0..8].copy_from_slice(&blocks.to_be_bytes());
        d[12..16].copy_from_slice(&(BLOCK_BYTES as u32).to_be_bytes());
        d
    } else {
        let mut d = vec![0u8; 8];
        d[0..4].copy_from_slice(&u32::try_from(blocks).unwrap_or(u32::MAX).to_be_bytes());
        d[5..8].copy_from_slice(&(BLOCK_BYTES as u32).to_be_bytes()[1..4]);
        d
    };
    // Device-specific parameter: DPOFUA.
    let device_specific = 0x10;
    let mut out = Vec::new();
    if ten {
        let length = (6 + descriptor.len() + pages.len()) as u16;
        out.extend_from_slice(&length.to_be_bytes());
        out.extend_from_slice(&[0, device_specific, u8::from(long_lba), 0]);
        out.extend_from_slice(&(descriptor.len() as u16).to_be_bytes());
    } else {
        let length = (3 + descriptor.len() + pages.len()).min(255) as u8;
        out.extend_from_slice(&[length, 0, device_specific, descriptor.len() as u8]);
    }
    out.extend_from_slice(&descriptor);
    out.extend_from_slice(&pages);
    ScsiResult::allocated(out, allocation)
}

/// MODE SELECT: accepted when every page sent equals its current value (nothing is
/// changeable); saving is not supported.
pub(super) fn mode_select(cdb: &[u8; 16], params: &[u8]) -> ScsiResult {
    let ten = cdb[0] == 0x55;
    let length = if ten {
        usize::from(be16(&cdb[7..9]))
    } else {
        usize::from(cdb[4])
    };
    let refuse = |sense| ScsiResult::check(sense).with_transfer(length as u32);
    if cdb[1] & 0x01 != 0 {
        return refuse(Sense::INVALID_FIELD_IN_CDB); // SP
    }
    if length == 0 {
        return ScsiResult::good();
    }
    if params.len() < length {
        return refuse(Sense::PARAMETER_LIST_LENGTH_ERROR);
    }
    let params = &params[..length];
    let header = if ten { 8 } else { 4 };
    if params.len() < header {
        return refuse(Sense::PARAMETER_LIST_LENGTH_ERROR);
    }
    let descriptors = if ten {
        usize::from(be16(&params[6..8]))
    } else {
        usize::from(params[3])
    };
    let mut at = header + descriptors;
    if at > params.len() {
        return refuse(Sense::PARAMETER_LIST_LENGTH_ERROR);
    }
    while at < params.len() {
        if at + 2 > params.len() {
            return refuse(Sense::PARAMETER_LIST_LENGTH_ERROR);
        }
        let code = params[at] & 0x3f;
        let size = 2 + usize::from(params[at + 1]);
        let Some(current) = page(code) else {
            return refuse(Sense::INVALID_FIELD_IN_PARAMETER_LIST);
        };
        if params[at] & 0x40 != 0
            || at + size > params.len()
            || params[at + 1..at + size] != current[1..]
        {
            return refuse(Sense::INVALID_FIELD_IN_PARAMETER_LIST);
        }
        at += size;
    }
    ScsiResult::good().with_transfer(length as u32)
}

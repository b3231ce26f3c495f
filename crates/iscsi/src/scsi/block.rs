//! SBC-3 block commands: capacity, READ/WRITE/VERIFY in every CDB size, SYNCHRONIZE CACHE,
//! PRE-FETCH, UNMAP, WRITE SAME, COMPARE AND WRITE, GET LBA STATUS.

use super::{be16, be32, be64, io_sense, Context, ScsiResult, BLOCK_BYTES};
use super::{sense::Sense, PHYSICAL_BLOCK_EXPONENT};
use crate::registry::LogicalUnit;
use ashlar_core::{BlockDevice, IoResult};
use bytes::{Bytes, BytesMut};

/// Largest byte count handed to one device call by WRITE SAME and UNMAP (the device API
/// takes `u32` lengths).
const DEVICE_CHUNK_BYTES: u64 = 1 << 30;
/// Most blocks one WRITE SAME or UNMAP descriptor may cover (reported in the Block Limits
/// VPD page): 512 MiB.
pub const MAX_UNMAP_BLOCKS: u32 = 1 << 20;
/// Most UNMAP block descriptors in one command.
pub const MAX_UNMAP_DESCRIPTORS: u32 = 256;
/// Most blocks one WRITE SAME may cover.
pub const MAX_WRITE_SAME_BLOCKS: u64 = (1 << 30) / BLOCK_BYTES;
/// Most blocks one COMPARE AND WRITE may cover.
pub const MAX_COMPARE_AND_WRITE_BLOCKS: u8 = 128;

/// Blocks of the unit.
pub(super) fn capacity_blocks<D: BlockDevice>(unit: &LogicalUnit<D>) -> u64 {
    unit.device.size_bytes() / BLOCK_BYTES
}

/// A decoded READ/WRITE/VERIFY-style CDB.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Transfer {
    pub lba: u64,
    pub blocks: u32,
    pub flags: u8,
}

/// Decodes the LBA and transfer length of the 6/10/12/16-byte forms.
pub(super) fn transfer(cdb: &[u8; 16]) -> Transfer {
    match cdb[0] >> 5 {
        0 => {
            let lba = u64::from(cdb[1] & 0x1f) << 16 | u64::from(cdb[2]) << 8 | u64::from(cdb[3]);
            let blocks = if cdb[4] == 0 { 256 } else { u32::from(cdb[4]) };
            Transfer {
                lba,
                blocks,
                flags: 0,
            }
        }
        1 | 2 => Transfer {
            lba: u64::from(be32(&cdb[2..6])),
            blocks: u32::from(be16(&cdb[7..9])),
            flags: cdb[1],
        },
        5 => Transfer {
            lba: u64::from(be32(&cdb[2..6])),
            blocks: be32(&cdb[6..10]),
            flags: cdb[1],
        },
        _ => Transfer {
            lba: be64(&cdb[2..10]),
            blocks: be32(&cdb[10..14]),
            flags: cdb[1],
        },
    }
}

/// Checks `[lba, lba+blocks)` against the capacity.
fn in_range<D: BlockDevice>(unit: &LogicalUnit<D>, lba: u64, blocks: u64) -> Result<(), Sense> {
    match lba.checked_add(blocks) {
        Some(end) if end <= capacity_blocks(unit) => Ok(()),
        _ => Err(Sense::LBA_OUT_OF_RANGE),
    }
}

fn bytes_of(blocks: u64) -> u64 {
    blocks * BLOCK_BYTES
}

pub(super) fn read_capacity10<D: BlockDevice>(unit: &LogicalUnit<D>, cdb: &[u8; 16]) -> ScsiResult {
    // PMI=0 requires LBA=0.
    if cdb[8] & 0x01 == 0 && be32(&cdb[2..6]) != 0 {
        return ScsiResult::check(Sense::INVALID_FIELD_IN_CDB);
    }
    let last = capacity_blocks(unit).saturating_sub(1);
    let mut out = Vec::with_capacity(8);
    out.extend_from_slice(&u32::try_from(last).unwrap_or(u32::MAX).to_be_bytes());
    out.extend_from_slice(&(BLOCK_BYTES as u32).to_be_bytes());
    ScsiResult::data(out)
}

pub(super) fn read_capacity16<D: BlockDevice>(unit: &LogicalUnit<D>, cdb: &[u8; 16]) -> ScsiResult {
    let allocation = be32(&cdb[10..14]) as usize;
    let mut out = vec![0u8; 32];
    out[0..8].copy_from_slice(&capacity_blocks(unit).saturating_sub(1).to_be_bytes());
    out[8..12].copy_from_slice(&(BLOCK_BYTES as u32).to_be_bytes());
    out[13] = PHYSICAL_BLOCK_EXPONENT;
    // LBPME: thin provisioned; LBPRZ: unmapped blocks read as zeros.
    out[14] = 0x80 | 0x40;
    ScsiResult::allocated(out, allocation)
}

/// A READ after its checks: either answered already, or the bytes to read.
enum ReadRange {
    Answered(ScsiResult),
    Bytes { offset: u64, length: u32 },
}

/// Checks a READ's CDB and range against the unit.
fn read_range<D: BlockDevice>(
    ctx: &Context<'_, D>,
    unit: &LogicalUnit<D>,
    cdb: &[u8; 16],
) -> ReadRange {
    let t = transfer(cdb);
    if t.flags & 0xe0 != 0 {
        // RDPROTECT without protection information.
        return ReadRange::Answered(ScsiResult::check(Sense::INVALID_FIELD_IN_CDB));
    }
    if let Err(sense) = in_range(unit, t.lba, u64::from(t.blocks)) {
        return ReadRange::Answered(ScsiResult::check(sense));
    }
    if t.blocks == 0 {
        return ReadRange::Answered(ScsiResult::good());
    }
    let length = bytes_of(u64::from(t.blocks));
    if length > u64::from(ctx.max_transfer) {
        return ReadRange::Answered(ScsiResult::check(Sense::INVALID_FIELD_IN_CDB));
    }
    ReadRange::Bytes {
        offset: bytes_of(t.lba),
        // At most max_transfer (a u32), checked above.
        length: length as u32,
    }
}

pub(super) async fn read<D: BlockDevice>(
    ctx: &Context<'_, D>,
    unit: &LogicalUnit<D>,
    cdb: &[u8; 16],
) -> ScsiResult {
    let (offset, length) = match read_range(ctx, unit, cdb) {
        ReadRange::Answered(result) => return result,
        ReadRange::Bytes { offset, length } => (offset, length),
    };
    let result = match unit.device.read_now(offset, length) {
        Some(result) => result,
        None => unit.device.read(offset, length).await,
    };
    read_result(result, offset, length)
}

/// A READ answered without waiting (its data is at hand, see `BlockDevice::read_now`), or
/// `None` when it would have to wait for the device.
pub(super) fn read_now<D: BlockDevice>(
    ctx: &Context<'_, D>,
    unit: &LogicalUnit<D>,
    cdb: &[u8; 16],
) -> Option<ScsiResult> {
    match read_range(ctx, unit, cdb) {
        ReadRange::Answered(result) => Some(result),
        ReadRange::Bytes { offset, length } => unit
            .device
            .read_now(offset, length)
            .map(|result| read_result(result, offset, length)),
    }
}

fn read_result(result: IoResult<Bytes>, offset: u64, length: u32) -> ScsiResult {
    match result {
        Ok(data) if data.len() == length as usize => ScsiResult {
            data_in: data,
            transfer: length,
            ..ScsiResult::good()
        },
        Ok(data) => {
            tracing::error!(
                offset,
                length,
                got = data.len(),
                "device returned a short read"
            );
            ScsiResult::check(Sense::UNRECOVERED_READ_ERROR)
        }
        Err(error) => ScsiResult::check(io_sense(&error, false)),
    }
}

/// WRITE and WRITE AND VERIFY (the write is durable when acknowledged, so the verify is the
/// write's own checksum).
pub(super) async fn write<D: BlockDevice>(
    ctx: &Context<'_, D>,
    unit: &LogicalUnit<D>,
    cdb: &[u8; 16],
    data: Bytes,
    expected: u32,
) -> ScsiResult {
    let t = transfer(cdb);
    let length = bytes_of(u64::from(t.blocks));
    let is_verify = matches!(cdb[0], 0x2e | 0xae | 0x8e);
    if t.flags & 0xe0 != 0 {
        return ScsiResult::check(Sense::INVALID_FIELD_IN_CDB).with_transfer(length as u32);
    }
    if let Err(sense) = in_range(unit, t.lba, u64::from(t.blocks)) {
        return ScsiResult::check(sense).with_transfer(length as u32);
    }
    if length > u64::from(ctx.max_transfer) {
        return ScsiResult::check(Sense::INVALID_FIELD_IN_CDB).with_transfer(length as u32);
    }
    if t.blocks == 0 {
        return ScsiResult::good();
    }
    // The initiator may send less than the command asks for (expected length below the
    // transfer length): only what it sent is written, and the response reports the overflow
    // (FCP-4 9.4.2 a, which libiscsi's residual tests check).
    let sent = (data.len() as u64).min(length).min(u64::from(expected));
    if sent == 0 {
        return ScsiResult::good().with_transfer(length as u32);
    }
    let fua = t.flags & 0x08 != 0 || is_verify;
    let data = data.slice(..sent as usize);
    let _ordered = unit.shared.write_order.read().await;
    match unit.device.write(bytes_of(t.lba), data, fua).await {
        Ok(()) => ScsiResult::good().with_transfer(length as u32),
        Err(error) => ScsiResult::check(io_sense(&error, true)).with_transfer(length as u32),
    }
}

/// VERIFY: BYTCHK 0 checks the medium can be read; 1 compares with the data sent; 3 compares
/// each block with the one block sent.
pub(super) async fn verify<D: BlockDevice>(
    ctx: &Context<'_, D>,
    unit: &LogicalUnit<D>,
    cdb: &[u8; 16],
    data: Bytes,
) -> ScsiResult {
    let t = transfer(cdb);
    let bytchk = (t.flags >> 1) & 0x03;
    if t.flags & 0xe0 != 0 || bytchk == 2 {
        return ScsiResult::check(Sense::INVALID_FIELD_IN_CDB);
    }
    let wanted = match bytchk {
        0 => 0,
        1 => bytes_of(u64::from(t.blocks)),
        _ => BLOCK_BYTES,
    };
    if let Err(sense) = in_range(unit, t.lba, u64::from(t.blocks)) {
        return ScsiResult::check(sense).with_transfer(wanted as u32);
    }
    let length = bytes_of(u64::from(t.blocks));
    if length > u64::from(ctx.max_transfer) {
        return ScsiResult::check(Sense::INVALID_FIELD_IN_CDB).with_transfer(wanted as u32);
    }
    if t.blocks == 0 {
        return ScsiResult::good();
    }
    if (data.len() as u64) < wanted {
        return ScsiResult::check(Sense::INVALID_FIELD_IN_INFORMATION_UNIT)
            .with_transfer(wanted as u32);
    }
    let medium = match unit.device.read(bytes_of(t.lba), length as u32).await {
        Ok(medium) if medium.len() as u64 == length => medium,
        Ok(_) => return ScsiResult::check(Sense::UNRECOVERED_READ_ERROR),
        Err(error) => return ScsiResult::check(io_sense(&error, false)),
    };
    let mismatch = match bytchk {
        0 => None,
        1 => first_difference(&medium, &data[..length as usize]),
        _ => medium
            .chunks(BLOCK_BYTES as usize)
            .enumerate()
            .find_map(|(i, block)| {
                first_difference(block, &data[..BLOCK_BYTES as usize])
                    .map(|at| at + i * BLOCK_BYTES as usize)
            }),
    };
    match mismatch {
        Some(at) => ScsiResult::check(Sense::MISCOMPARE_DURING_VERIFY.with_information(at as u32))
            .with_transfer(wanted as u32),
        None => ScsiResult::good().with_transfer(wanted as u32),
    }
}

fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter().zip(b).position(|(x, y)| x != y)
}

pub(super) async fn synchronize_cache<D: BlockDevice>(
    unit: &LogicalUnit<D>,
    cdb: &[u8; 16],
) -> ScsiResult {
    let (lba, blocks) = if cdb[0] == 0x35 {
        (u64::from(be32(&cdb[2..6])), u64::from(be16(&cdb[7..9])))
    } else {
        (be64(&cdb[2..10]), u64::from(be32(&cdb[10..14])))
    };
    if let Err(sense) = in_range(unit, lba, blocks) {
        return ScsiResult::check(sense);
    }
    match unit.device.flush().await {
        Ok(()) => ScsiResult::good(),
        Err(error) => ScsiResult::check(io_sense(&error, true)),
    }
}

/// PRE-FETCH: a hint; only the range is checked.
pub(super) fn prefetch<D: BlockDevice>(unit: &LogicalUnit<D>, cdb: &[u8; 16]) -> ScsiResult {
    let (lba, blocks) = if cdb[0] == 0x34 {
        (u64::from(be32(&cdb[2..6])), u64::from(be16(&cdb[7..9])))
    } else {
        (be64(&cdb[2..10]), u64::from(be32(&cdb[10..14])))
    };
    match in_range(unit, lba, blocks) {
        Ok(()) => ScsiResult::good(),
        Err(sense) => ScsiResult::check(sense),
    }
}

/// Zeroes `[offset, offset+length)` in device-sized chunks; storage may be freed.
async fn zero_range<D: BlockDevice>(
    device: &D,
    mut offset: u64,
    mut length: u64,
    punch: bool,
) -> Result<(), ashlar_core::IoError> {
    while length > 0 {
        let chunk = length.min(DEVICE_CHUNK_BYTES);
        device.write_zeroes(offset, chunk as u32, punch).await?;
        offset += chunk;
        length -= chunk;
    }
    Ok(())
}

/// UNMAP: each range is zeroed with its storage released, so unmapped blocks read as zeros
/// (LBPRZ).
pub(super) async fn unmap<D: BlockDevice>(
    unit: &LogicalUnit<D>,
    cdb: &[u8; 16],
    params: &[u8],
) -> ScsiResult {
    let length = usize::from(be16(&cdb[7..9]));
    if cdb[1] & 0x01 != 0 {
        return ScsiResult::check(Sense::INVALID_FIELD_IN_CDB).with_transfer(length as u32);
        // ANCHOR
    }
    if length == 0 {
        return ScsiResult::good();
    }
    if length < 8 || params.len() < length {
        return ScsiResult::check(Sense::PARAMETER_LIST_LENGTH_ERROR).with_transfer(length as u32);
    }
    let params = &params[..length];
    let descriptor_bytes = usize::from(be16(&params[2..4]));
    let end = (8 + descriptor_bytes).min(length);
    let descriptors: Vec<(u64, u32)> = params[8..end]
        .chunks_exact(16)
        .map(|d| (be64(&d[0..8]), be32(&d[8..12])))
        .collect();
    if descriptors.len() > MAX_UNMAP_DESCRIPTORS as usize {
        return ScsiResult::check(Sense::INVALID_FIELD_IN_PARAMETER_LIST)
            .with_transfer(length as u32);
    }
    for &(lba, blocks) in &descriptors {
        if let Err(sense) = in_range(unit, lba, u64::from(blocks)) {
            return ScsiResult::check(sense).with_transfer(length as u32);
        }
        if blocks > MAX_UNMAP_BLOCKS {
            return ScsiResult::check(Sense::INVALID_FIELD_IN_PARAMETER_LIST)
                .with_transfer(length as u32);
        }
    }
    let _ordered = unit.shared.write_order.read().await;
    for (lba, blocks) in descriptors {
        if let Err(error) = zero_range(
            &unit.device,
            bytes_of(lba),
            bytes_of(u64::from(blocks)),
            true,
        )
        .await
        {
            return ScsiResult::check(io_sense(&error, true)).with_transfer(length as u32);
        }
    }
    ScsiResult::good().with_transfer(length as u32)
}

/// WRITE SAME(10/16): one block repeated; zeros (or NDOB) become write-zeroes, with storage
/// released when UNMAP is set.
pub(super) async fn write_same<D: BlockDevice>(
    ctx: &Context<'_, D>,
    unit: &LogicalUnit<D>,
    cdb: &[u8; 16],
    data: Bytes,
) -> ScsiResult {
    let flags = cdb[1];
    let (lba, blocks) = if cdb[0] == 0x41 {
        (u64::from(be32(&cdb[2..6])), u64::from(be16(&cdb[7..9])))
    } else {
        (be64(&cdb[2..10]), u64::from(be32(&cdb[10..14])))
    };
    let ndob = cdb[0] == 0x93 && flags & 0x01 != 0;
    let wanted = if ndob { 0 } else { BLOCK_BYTES as u32 };
    // WRPROTECT, ANCHOR; zero blocks means "to the end", which we do not offer (WSNZ).
    if flags & 0xe0 != 0 || flags & 0x10 != 0 || blocks == 0 {
        return ScsiResult::check(Sense::INVALID_FIELD_IN_CDB).with_transfer(wanted);
    }
    if let Err(sense) = in_range(unit, lba, blocks) {
        return ScsiResult::check(sense).with_transfer(wanted);
    }
    if blocks > MAX_WRITE_SAME_BLOCKS {
        return ScsiResult::check(Sense::INVALID_FIELD_IN_CDB).with_transfer(wanted);
    }
    if data.len() != wanted as usize {
        // Exactly one block of data (none with NDOB).
        return ScsiResult::check(Sense::INVALID_FIELD_IN_CDB).with_transfer(wanted);
    }
    let unmap = flags & 0x08 != 0;
    let _ordered = unit.shared.write_order.read().await;
    let zeros = ndob || data[..BLOCK_BYTES as usize].iter().all(|&b| b == 0);
    let result = if zeros {
        zero_range(&unit.device, bytes_of(lba), bytes_of(blocks), unmap).await
    } else {
        // A pattern: written in chunks of at most the transfer limit.
        let block = data.slice(..BLOCK_BYTES as usize);
        let chunk_blocks = (u64::from(ctx.max_transfer) / BLOCK_BYTES).max(1);
        let mut pattern =
            BytesMut::with_capacity((chunk_blocks.min(blocks) * BLOCK_BYTES) as usize);
        for _ in 0..chunk_blocks.min(blocks) {
            pattern.extend_from_slice(&block);
        }
        let pattern = pattern.freeze();
        let mut at = lba;
        let end = lba + blocks;
        let mut result = Ok(());
        while at < end && result.is_ok() {
            let n = chunk_blocks.min(end - at);
            result = unit
                .device
                .write(bytes_of(at), pattern.slice(..bytes_of(n) as usize), false)
                .await;
            at += n;
        }
        result
    };
    match result {
        Ok(()) => ScsiResult::good().with_transfer(wanted),
        Err(error) => ScsiResult::check(io_sense(&error, true)).with_transfer(wanted),
    }
}

/// COMPARE AND WRITE: atomic with respect to every write of the unit (VMware ATS): no WRITE,
/// WRITE SAME, UNMAP or other COMPARE AND WRITE runs between its read and its write; a mismatch reports MISCOMPARE with the offset of the first differing byte.
pub(super) async fn compare_and_write<D: BlockDevice>(
    unit: &LogicalUnit<D>,
    cdb: &[u8; 16],
    data: Bytes,
    expected: u32,
) -> ScsiResult {
    let lba = be64(&cdb[2..10]);
    let blocks = cdb[13];
    let length = bytes_of(u64::from(blocks));
    let wanted = (length * 2) as u32;
    // The data must be exactly the blocks to compare and the blocks to write.
    if cdb[1] & 0xe0 != 0
        || blocks > MAX_COMPARE_AND_WRITE_BLOCKS
        || expected != wanted
        || data.len() != wanted as usize
    {
        return ScsiResult::check(Sense::INVALID_FIELD_IN_CDB).with_transfer(wanted);
    }
    if let Err(sense) = in_range(unit, lba, u64::from(blocks)) {
        return ScsiResult::check(sense).with_transfer(wanted);
    }
    if blocks == 0 {
        return ScsiResult::good();
    }
    // No write of the unit may land between the compare and the write.
    let _alone = unit.shared.write_order.write().await;
    let offset = bytes_of(lba);
    let current = match unit.device.read(offset, length as u32).await {
        Ok(current) if current.len() as u64 == length => current,
        Ok(_) => return ScsiResult::check(Sense::UNRECOVERED_READ_ERROR).with_transfer(wanted),
        Err(error) => return ScsiResult::check(io_sense(&error, false)).with_transfer(wanted),
    };
    if let Some(at) = first_difference(&current, &data[..length as usize]) {
        return ScsiResult::check(Sense::MISCOMPARE_DURING_VERIFY.with_information(at as u32))
            .with_transfer(wanted);
    }
    let new = data.slice(length as usize..(length * 2) as usize);
    match unit.device.write(offset, new, cdb[1] & 0x08 != 0).await {
        Ok(()) => ScsiResult::good().with_transfer(wanted),
        Err(error) => ScsiResult::check(io_sense(&error, true)).with_transfer(wanted),
    }
}

/// GET LBA STATUS: mapped or deallocated runs from the starting LBA, from the device's
/// allocation map.
pub(super) async fn get_lba_status<D: BlockDevice>(
    unit: &LogicalUnit<D>,
    cdb: &[u8; 16],
) -> ScsiResult {
    let lba = be64(&cdb[2..10]);
    let allocation = be32(&cdb[10..14]) as usize;
    let capacity = capacity_blocks(unit);
    if lba >= capacity {
        return ScsiResult::check(Sense::LBA_OUT_OF_RANGE);
    }
    // Ask about at most 1 GiB; the initiator asks again from where the answer ends.
    let blocks = (capacity - lba).min(MAX_UNMAP_BLOCKS as u64);
    let runs = match unit
        .device
        .block_status(bytes_of(lba), bytes_of(blocks) as u32)
        .await
    {
        Ok(runs) => runs,
        Err(error) => return ScsiResult::check(io_sense(&error, false)),
    };
    let mut descriptors: Vec<(u64, u32, u8)> = Vec::new();
    let mut at = lba;
    for run in runs {
        let n = (run.length / BLOCK_BYTES).min(lba + blocks - at);
        if n == 0 {
            continue;
        }
        let state = if run.hole { 1 } else { 0 };
        match descriptors.last_mut() {
            Some(last) if last.2 == state => last.1 += n as u32,
            _ => descriptors.push((at, n as u32, state)),
        }
        at += n;
        if at >= lba + blocks {
            break;
        }
    }
    if descriptors.is_empty() {
        descriptors.push((lba, 1, 0));
    }
    let mut out = Vec::with_capacity(8 + descriptors.len() * 16);
    out.extend_from_slice(&((4 + descriptors.len() * 16) as u32).to_be_bytes());
    out.extend_from_slice(&[0; 4]);
    for (start, count, state) in descriptors {
        out.extend_from_slice(&start.to_be_bytes());
        out.extend_from_slice(&count.to_be_bytes());
        out.extend_from_slice(&[state, 0, 0, 0]);
    }
    ScsiResult::allocated(out, allocation)
}

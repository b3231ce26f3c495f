//! The checksum block of an extent ("checksum table"): 256 entries of 12 bytes (block state
//! and two CRC32C slots, or for a block in the block log its slot there and its CRC32C), then
//! a trailer naming the format version, the vdisk, egroup and extent, the block log position
//! the table reflects (version 3), and the block's own CRC32C. In memory each entry also
//! carries what this process learned about the data on disk.

use super::block_log::{LogId, LogSlot, Position, SegmentSeq};
use super::format::{
    crc_of, readable_version, seal, u32_at, u64_at, Decoded, BLOCKS_PER_EXTENT, BLOCK_LEN, CRC_AT,
    FORMAT_VERSION,
};
use ashlar_core::VdiskId;

const TABLE_MAGIC: &[u8; 8] = b"ASHLARCK";
const ENTRY_BYTES: usize = 12;
const TRAILER_AT: usize = BLOCKS_PER_EXTENT * ENTRY_BYTES;
/// Trailer offset of the block log position the table reflects (version 3; zero in version 2).
const POSITION_IN_TRAILER: usize = 32;
/// Trailer bytes from here to the block's CRC are reserved (zero).
const RESERVED_IN_TRAILER: usize = 40;

/// The state of one data block, as recorded in its checksum block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BlockState {
    /// Never written or zeroed: reads as zeros without reading the data block.
    Hole = 0,
    /// Holds data whose CRC32C is one of the entry's two slots.
    Written = 1,
    /// A partial write merged into a corrupt block: unreadable until fully overwritten.
    Poisoned = 2,
    /// Reported lost (`mark_lost`): unreadable until fully overwritten or zeroed.
    Lost = 3,
    /// Its data is a block in the block log (`Entry::log`), whose CRC32C is `crc[0]`; its
    /// home block in the egroup file means nothing (version 3).
    InLog = 4,
}

impl BlockState {
    fn from_byte(byte: u8, version: u32) -> Option<BlockState> {
        match byte {
            0 => Some(BlockState::Hole),
            1 => Some(BlockState::Written),
            2 => Some(BlockState::Poisoned),
            3 => Some(BlockState::Lost),
            4 if version >= 3 => Some(BlockState::InLog),
            _ => None,
        }
    }
}

/// One block's entry, in memory (20 bytes). `current` and `zero_known` are not persisted: they
/// are what this process learned about the data on disk ("normalization").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Entry {
    pub state: BlockState,
    /// CRC32C of the two contents the block may hold (`Written`); zeros for a hole.
    pub crc: [u32; 2],
    /// The slot the data on disk matches, once known; `None` = unknown or neither.
    pub current: Option<u8>,
    /// For a hole: its data block is known to read as zeros on disk, durably.
    pub zero_known: bool,
    /// Where the data is, for `InLog`; `LogSlot::NONE` otherwise.
    pub log: LogSlot,
}

impl Entry {
    pub(crate) const HOLE: Entry = Entry {
        state: BlockState::Hole,
        crc: [0, 0],
        current: None,
        zero_known: false,
        log: LogSlot::NONE,
    };

    /// A block recorded lost (`mark_lost`, or replay finding its newest data missing).
    pub(crate) const LOST: Entry = Entry {
        state: BlockState::Lost,
        ..Entry::HOLE
    };

    /// A block whose data is at `log`, with CRC32C `crc`.
    pub(crate) fn in_log(log: LogSlot, crc: u32) -> Entry {
        Entry {
            state: BlockState::InLog,
            crc: [crc, 0],
            current: None,
            zero_known: false,
            log,
        }
    }

    /// The slot holding `crc`, preferring the current one.
    pub(crate) fn slot_of(&self, crc: u32) -> Option<u8> {
        let first = self.current.unwrap_or(0);
        [first, 1 - first]
            .into_iter()
            .find(|&slot| self.crc[slot as usize] == crc)
    }
}

/// The entries of one extent.
pub(crate) type Table = [Entry; BLOCKS_PER_EXTENT];

/// Encodes an extent's checksum block: 256 entries of 12 bytes, then the trailer, stamped with
/// the block log `position` the table reflects.
pub(crate) fn encode_table(
    table: &Table,
    vdisk: VdiskId,
    egroup: u64,
    extent: usize,
    position: Position,
) -> Vec<u8> {
    let mut block = vec![0u8; BLOCK_LEN];
    for (entry, out) in table.iter().zip(block.chunks_mut(ENTRY_BYTES)) {
        out[0] = entry.state as u8;
        match entry.state {
            BlockState::Hole => {}
            BlockState::InLog => {
                out[1..5].copy_from_slice(&entry.log.segment.0.to_le_bytes());
                out[5] = entry.log.log.0;
                out[6..8].copy_from_slice(&entry.log.slot.to_le_bytes());
                out[8..12].copy_from_slice(&entry.crc[0].to_le_bytes());
            }
            BlockState::Written | BlockState::Poisoned | BlockState::Lost => {
                out[4..8].copy_from_slice(&entry.crc[0].to_le_bytes());
                out[8..12].copy_from_slice(&entry.crc[1].to_le_bytes());
            }
        }
    }
    let trailer = &mut block[TRAILER_AT..];
    trailer[0..8].copy_from_slice(TABLE_MAGIC);
    trailer[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    trailer[12..16].copy_from_slice(&(extent as u32).to_le_bytes());
    trailer[16..24].copy_from_slice(&vdisk.0.to_le_bytes());
    trailer[24..32].copy_from_slice(&egroup.to_le_bytes());
    trailer[POSITION_IN_TRAILER..RESERVED_IN_TRAILER].copy_from_slice(&position.0.to_le_bytes());
    seal(&mut block);
    block
}

/// A valid checksum block: its entries and the block log position it reflects.
#[derive(Debug)]
pub(crate) struct DecodedTable {
    pub entries: Box<Table>,
    pub position: Position,
}

/// Decodes and validates a checksum block: checksum, magic, version, identity, reserved bytes
/// and every entry.
pub(crate) fn decode_table(
    block: &[u8],
    vdisk: VdiskId,
    egroup: u64,
    extent: usize,
) -> Decoded<DecodedTable> {
    if block.iter().all(|&b| b == 0) {
        return Decoded::Zero;
    }
    let trailer = &block[TRAILER_AT..];
    if &trailer[0..8] != TABLE_MAGIC {
        return Decoded::Bad("wrong checksum-block magic".into());
    }
    let version = u32_at(trailer, 8);
    if !readable_version(version) {
        return Decoded::Bad(format!("unsupported checksum-block version {version}"));
    }
    if block[CRC_AT..] != crc_of(block) {
        return Decoded::Bad("checksum-block checksum mismatch".into());
    }
    if u32_at(trailer, 12) as usize != extent
        || u64_at(trailer, 16) != vdisk.0
        || u64_at(trailer, 24) != egroup
    {
        return Decoded::Bad("checksum block names another vdisk, egroup or extent".into());
    }
    let position = Position(u64_at(trailer, POSITION_IN_TRAILER));
    let reserved_from = if version >= 3 {
        RESERVED_IN_TRAILER
    } else {
        POSITION_IN_TRAILER
    };
    if trailer[reserved_from..CRC_AT - TRAILER_AT]
        .iter()
        .any(|&b| b != 0)
    {
        return Decoded::Bad("reserved checksum-block bytes are not zero".into());
    }
    let mut entries = Box::new([Entry::HOLE; BLOCKS_PER_EXTENT]);
    for (index, bytes) in block[..TRAILER_AT].chunks(ENTRY_BYTES).enumerate() {
        match decode_entry(bytes, version) {
            Ok(entry) => entries[index] = entry,
            Err(reason) => return Decoded::Bad(format!("block {index} {reason}")),
        }
    }
    Decoded::Valid(DecodedTable { entries, position })
}

fn decode_entry(bytes: &[u8], version: u32) -> Result<Entry, String> {
    let Some(state) = BlockState::from_byte(bytes[0], version) else {
        return Err(format!("has unknown state {}", bytes[0]));
    };
    if state == BlockState::InLog {
        let log = LogSlot {
            log: LogId(bytes[5]),
            segment: SegmentSeq(u32_at(bytes, 1)),
            slot: u16::from_le_bytes([bytes[6], bytes[7]]),
        };
        if !log.is_data_slot() {
            return Err(format!(
                "names slot {} of the block log, not a data slot",
                log.slot
            ));
        }
        return Ok(Entry::in_log(log, u32_at(bytes, 8)));
    }
    if bytes[1..4].iter().any(|&b| b != 0) {
        return Err("has non-zero reserved bytes".into());
    }
    Ok(Entry {
        state,
        crc: [u32_at(bytes, 4), u32_at(bytes, 8)],
        current: None,
        zero_known: false,
        log: LogSlot::NONE,
    })
}

/// CRC32C of a 4 KiB block of zeros: the content of a hole.
pub(crate) fn zero_block_crc() -> u32 {
    static ZEROS: [u8; BLOCK_LEN] = [0; BLOCK_LEN];
    crc32c::crc32c(&ZEROS)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log_slot(slot: u16) -> LogSlot {
        LogSlot {
            log: LogId(7),
            segment: SegmentSeq(0x0102_0304),
            slot,
        }
    }

    #[test]
    fn tables_round_trip_and_reject_damage() {
        let mut table = [Entry::HOLE; BLOCKS_PER_EXTENT];
        table[3] = Entry {
            state: BlockState::Written,
            crc: [7, 9],
            current: Some(1),
            zero_known: false,
            log: LogSlot::NONE,
        };
        table[4].state = BlockState::Lost;
        table[5] = Entry::in_log(log_slot(257), 0xdead_beef);
        let bytes = encode_table(&table, VdiskId(5), 6, 2, Position(99));
        let Decoded::Valid(back) = decode_table(&bytes, VdiskId(5), 6, 2) else {
            panic!("valid table rejected");
        };
        assert_eq!(back.position, Position(99));
        assert_eq!(back.entries[3].crc, [7, 9]);
        assert_eq!(back.entries[3].state, BlockState::Written);
        assert_eq!(back.entries[4].state, BlockState::Lost);
        assert_eq!(back.entries[5], Entry::in_log(log_slot(257), 0xdead_beef));
        assert!(matches!(
            decode_table(&bytes, VdiskId(5), 6, 1),
            Decoded::Bad(_)
        ));
        let mut flipped = bytes.clone();
        flipped[3 * ENTRY_BYTES] = 0; // written -> hole
        assert!(matches!(
            decode_table(&flipped, VdiskId(5), 6, 2),
            Decoded::Bad(_)
        ));
        let mut unknown = bytes.clone();
        unknown[3 * ENTRY_BYTES] = 9;
        seal(&mut unknown);
        match decode_table(&unknown, VdiskId(5), 6, 2) {
            Decoded::Bad(reason) => assert!(reason.contains("unknown state 9"), "{reason}"),
            other => panic!("expected Bad, got {other:?}"),
        }
        let mut reserved = bytes.clone();
        reserved[TRAILER_AT + RESERVED_IN_TRAILER] = 1;
        seal(&mut reserved);
        match decode_table(&reserved, VdiskId(5), 6, 2) {
            Decoded::Bad(reason) => assert!(reason.contains("reserved"), "{reason}"),
            other => panic!("expected Bad, got {other:?}"),
        }
        assert!(matches!(
            decode_table(&[0u8; BLOCK_LEN], VdiskId(5), 6, 2),
            Decoded::Zero
        ));
    }

    #[test]
    fn a_block_in_the_log_must_name_a_data_slot() {
        for slot in [0, 255, 256, 511, u16::MAX] {
            let mut table = [Entry::HOLE; BLOCKS_PER_EXTENT];
            table[0] = Entry::in_log(log_slot(slot), 1);
            let bytes = encode_table(&table, VdiskId(5), 6, 0, Position(1));
            match decode_table(&bytes, VdiskId(5), 6, 0) {
                Decoded::Bad(reason) => assert!(reason.contains("not a data slot"), "{reason}"),
                other => panic!("slot {slot}: expected Bad, got {other:?}"),
            }
        }
    }

    /// A version-2 block (written before the block log existed) reads as before; one that
    /// claims a block in the log is refused (version 2 has no such state).
    #[test]
    fn version_2_blocks_are_read_and_know_no_log() {
        let mut table = [Entry::HOLE; BLOCKS_PER_EXTENT];
        table[1] = Entry {
            state: BlockState::Written,
            crc: [3, 4],
            current: None,
            zero_known: false,
            log: LogSlot::NONE,
        };
        let mut bytes = encode_table(&table, VdiskId(5), 6, 0, Position(0));
        bytes[TRAILER_AT + 8..TRAILER_AT + 12].copy_from_slice(&2u32.to_le_bytes());
        seal(&mut bytes);
        let Decoded::Valid(back) = decode_table(&bytes, VdiskId(5), 6, 0) else {
            panic!("version 2 rejected");
        };
        assert_eq!(back.entries[1].crc, [3, 4]);
        assert_eq!(back.position, Position(0));
        let mut with_log = bytes.clone();
        with_log[0] = BlockState::InLog as u8;
        seal(&mut with_log);
        match decode_table(&with_log, VdiskId(5), 6, 0) {
            Decoded::Bad(reason) => assert!(reason.contains("unknown state 4"), "{reason}"),
            other => panic!("expected Bad, got {other:?}"),
        }
        let mut stamped = bytes;
        stamped[TRAILER_AT + POSITION_IN_TRAILER] = 1;
        seal(&mut stamped);
        assert!(matches!(
            decode_table(&stamped, VdiskId(5), 6, 0),
            Decoded::Bad(_)
        ));
    }
}

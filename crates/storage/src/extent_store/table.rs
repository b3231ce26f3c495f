//! The checksum block of an extent ("checksum table"): 256 entries of 12 bytes (block state
//! and two CRC32C slots), then a trailer naming the format version, the vdisk, egroup and
//! extent, and the block's own CRC32C. In memory each entry also carries what this process
//! learned about the data on disk.

use super::format::{
    crc_of, seal, u32_at, u64_at, Decoded, BLOCKS_PER_EXTENT, BLOCK_LEN, CRC_AT, FORMAT_VERSION,
};
use ashlar_core::VdiskId;

const TABLE_MAGIC: &[u8; 8] = b"ASHLARCK";
const ENTRY_BYTES: usize = 12;
const TRAILER_AT: usize = BLOCKS_PER_EXTENT * ENTRY_BYTES;

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
}

impl BlockState {
    fn from_byte(byte: u8) -> Option<BlockState> {
        match byte {
            0 => Some(BlockState::Hole),
            1 => Some(BlockState::Written),
            2 => Some(BlockState::Poisoned),
            3 => Some(BlockState::Lost),
            _ => None,
        }
    }
}

/// One block's entry, in memory (12 bytes). `current` and `zero_known` are not persisted: they
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
}

impl Entry {
    pub(crate) const HOLE: Entry = Entry {
        state: BlockState::Hole,
        crc: [0, 0],
        current: None,
        zero_known: false,
    };

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

/// Encodes an extent's checksum block: 256 entries of 12 bytes, then the trailer.
pub(crate) fn encode_table(table: &Table, vdisk: VdiskId, egroup: u64, extent: usize) -> Vec<u8> {
    let mut block = vec![0u8; BLOCK_LEN];
    for (entry, out) in table.iter().zip(block.chunks_mut(ENTRY_BYTES)) {
        out[0] = entry.state as u8;
        if entry.state != BlockState::Hole {
            out[4..8].copy_from_slice(&entry.crc[0].to_le_bytes());
            out[8..12].copy_from_slice(&entry.crc[1].to_le_bytes());
        }
    }
    let trailer = &mut block[TRAILER_AT..];
    trailer[0..8].copy_from_slice(TABLE_MAGIC);
    trailer[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    trailer[12..16].copy_from_slice(&(extent as u32).to_le_bytes());
    trailer[16..24].copy_from_slice(&vdisk.0.to_le_bytes());
    trailer[24..32].copy_from_slice(&egroup.to_le_bytes());
    seal(&mut block);
    block
}

/// Decodes and validates a checksum block: checksum, magic, version, identity, reserved bytes
/// and every block state.
pub(crate) fn decode_table(
    block: &[u8],
    vdisk: VdiskId,
    egroup: u64,
    extent: usize,
) -> Decoded<Box<Table>> {
    if block.iter().all(|&b| b == 0) {
        return Decoded::Zero;
    }
    let trailer = &block[TRAILER_AT..];
    if &trailer[0..8] != TABLE_MAGIC {
        return Decoded::Bad("wrong checksum-block magic".into());
    }
    let version = u32_at(trailer, 8);
    if version != FORMAT_VERSION {
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
    if trailer[32..CRC_AT - TRAILER_AT].iter().any(|&b| b != 0) {
        return Decoded::Bad("reserved checksum-block bytes are not zero".into());
    }
    let mut table = Box::new([Entry::HOLE; BLOCKS_PER_EXTENT]);
    for (index, bytes) in block[..TRAILER_AT].chunks(ENTRY_BYTES).enumerate() {
        let Some(state) = BlockState::from_byte(bytes[0]) else {
            return Decoded::Bad(format!("block {index} has unknown state {}", bytes[0]));
        };
        if bytes[1..4].iter().any(|&b| b != 0) {
            return Decoded::Bad(format!("block {index} has non-zero reserved bytes"));
        }
        table[index] = Entry {
            state,
            crc: [u32_at(bytes, 4), u32_at(bytes, 8)],
            current: None,
            zero_known: false,
        };
    }
    Decoded::Valid(table)
}

/// CRC32C of a 4 KiB block of zeros: the content of a hole.
pub(crate) fn zero_block_crc() -> u32 {
    static ZEROS: [u8; BLOCK_LEN] = [0; BLOCK_LEN];
    crc32c::crc32c(&ZEROS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_round_trip_and_reject_damage() {
        let mut table = [Entry::HOLE; BLOCKS_PER_EXTENT];
        table[3] = Entry {
            state: BlockState::Written,
            crc: [7, 9],
            current: Some(1),
            zero_known: false,
        };
        table[4].state = BlockState::Lost;
        let bytes = encode_table(&table, VdiskId(5), 6, 2);
        let Decoded::Valid(back) = decode_table(&bytes, VdiskId(5), 6, 2) else {
            panic!("valid table rejected");
        };
        assert_eq!(back[3].crc, [7, 9]);
        assert_eq!(back[3].state, BlockState::Written);
        assert_eq!(back[4].state, BlockState::Lost);
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
        let mut unknown = bytes;
        unknown[3 * ENTRY_BYTES] = 9;
        seal(&mut unknown);
        match decode_table(&unknown, VdiskId(5), 6, 2) {
            Decoded::Bad(reason) => assert!(reason.contains("unknown state 9"), "{reason}"),
            other => panic!("expected Bad, got {other:?}"),
        }
        assert!(matches!(
            decode_table(&[0u8; BLOCK_LEN], VdiskId(5), 6, 2),
            Decoded::Zero
        ));
    }
}

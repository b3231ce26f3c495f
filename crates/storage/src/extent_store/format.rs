//! The on-disk layout of an extent group, format version 3 (docs/extent-store-format.md):
//! a header block, one checksum block per extent (`table`), then the data blocks. Every
//! metadata block ends with the CRC32C of its first 4092 bytes and carries the format version;
//! decoding never guesses: a block is all zeros, valid, or bad with a reason.

use ashlar_core::{VdiskId, BLOCK_SIZE_BYTES, EXTENT_SIZE_BYTES};
use std::path::{Path, PathBuf};

/// Extents per extent group: an egroup covers 4 MiB of a vdisk, aligned.
pub const EXTENTS_PER_EGROUP: u64 = 4;
/// Bytes of vdisk address space one egroup covers.
pub const EGROUP_SPAN_BYTES: u64 = EXTENTS_PER_EGROUP * EXTENT_SIZE_BYTES;
/// The version this code writes: 3 adds blocks in the block log (`table`, `block_log`).
pub(crate) const FORMAT_VERSION: u32 = 3;
/// The oldest version this code reads: version 2 is version 3 with no block in the log.
pub(crate) const OLDEST_READABLE_VERSION: u32 = 2;
pub(crate) const BLOCK: u64 = BLOCK_SIZE_BYTES;
pub(crate) const BLOCK_LEN: usize = BLOCK as usize;
pub(crate) const EXTENTS: usize = EXTENTS_PER_EGROUP as usize;
pub(crate) const BLOCKS_PER_EXTENT: usize = (EXTENT_SIZE_BYTES / BLOCK) as usize;
pub(crate) const BLOCKS_PER_EGROUP: usize = BLOCKS_PER_EXTENT * EXTENTS;
/// The header block and the checksum blocks precede the data.
pub(crate) const META_BYTES: u64 = (1 + EXTENTS_PER_EGROUP) * BLOCK;
const HEADER_MAGIC: &[u8; 8] = b"ASHLAREG";
/// Every metadata block ends with the CRC32C of the bytes before it.
pub(super) const CRC_AT: usize = BLOCK_LEN - 4;

/// `<disk>/extents/<vdisk>`: the directory holding a vdisk's egroups on one disk.
pub(crate) fn egroup_dir(disk: &Path, vdisk: VdiskId) -> PathBuf {
    disk.join("extents").join(vdisk.to_string())
}

pub(crate) fn egroup_file_name(egroup: u64) -> String {
    format!("{egroup:016x}.egroup")
}

/// The egroup index named by a file name, if it is an egroup file's name.
pub(crate) fn parse_egroup_file_name(name: &str) -> Option<u64> {
    let hex = name.strip_suffix(".egroup")?;
    if hex.len() != 16 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u64::from_str_radix(hex, 16).ok()
}

pub(crate) fn table_offset(extent: usize) -> u64 {
    (1 + extent as u64) * BLOCK
}

/// File offset of data block `block` of the egroup (0..1024; extents follow one another).
pub(crate) fn data_offset(block: usize) -> u64 {
    META_BYTES + block as u64 * BLOCK
}

pub(super) fn crc_of(block: &[u8]) -> [u8; 4] {
    crc32c::crc32c(&block[..CRC_AT]).to_le_bytes()
}

pub(super) fn seal(block: &mut [u8]) {
    let crc = crc_of(block);
    block[CRC_AT..].copy_from_slice(&crc);
}

pub(super) fn u32_at(bytes: &[u8], at: usize) -> u32 {
    let mut word = [0u8; 4];
    word.copy_from_slice(&bytes[at..at + 4]);
    u32::from_le_bytes(word)
}

pub(super) fn u64_at(bytes: &[u8], at: usize) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(word)
}

/// Whether this code reads metadata blocks of `version`.
pub(super) fn readable_version(version: u32) -> bool {
    (OLDEST_READABLE_VERSION..=FORMAT_VERSION).contains(&version)
}

/// What a metadata block (header or checksum block) holds.
#[derive(Debug)]
pub(crate) enum Decoded<T> {
    /// Never written (a hole, or a creation cut short).
    Zero,
    Valid(T),
    /// Damaged: the reason names what is wrong.
    Bad(String),
}

pub(crate) fn encode_header(vdisk: VdiskId, egroup: u64) -> Vec<u8> {
    let mut block = vec![0u8; BLOCK_LEN];
    block[0..8].copy_from_slice(HEADER_MAGIC);
    block[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    block[12..16].copy_from_slice(&(BLOCK as u32).to_le_bytes());
    block[16..20].copy_from_slice(&(EXTENTS as u32).to_le_bytes());
    block[20..24].copy_from_slice(&(BLOCKS_PER_EXTENT as u32).to_le_bytes());
    block[24..32].copy_from_slice(&vdisk.0.to_le_bytes());
    block[32..40].copy_from_slice(&egroup.to_le_bytes());
    seal(&mut block);
    block
}

/// Checks a header block read from disk against the one this egroup must have.
pub(crate) fn decode_header(block: &[u8], vdisk: VdiskId, egroup: u64) -> Decoded<()> {
    if block.iter().all(|&b| b == 0) {
        return Decoded::Zero;
    }
    if &block[0..8] != HEADER_MAGIC {
        return Decoded::Bad("wrong magic".into());
    }
    let version = u32_at(block, 8);
    if !readable_version(version) {
        return Decoded::Bad(format!("unsupported format version {version}"));
    }
    if block[CRC_AT..] != crc_of(block) {
        return Decoded::Bad("header checksum mismatch".into());
    }
    let expected = encode_header(vdisk, egroup);
    if block[..8] != expected[..8] || block[12..CRC_AT] != expected[12..CRC_AT] {
        return Decoded::Bad("header names another vdisk, egroup or geometry".into());
    }
    Decoded::Valid(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_check_identity_and_names_parse() {
        let header = encode_header(VdiskId(1), 2);
        assert!(matches!(
            decode_header(&header, VdiskId(1), 2),
            Decoded::Valid(())
        ));
        assert!(matches!(
            decode_header(&header, VdiskId(1), 3),
            Decoded::Bad(_)
        ));
        let mut version_2 = header.clone();
        version_2[8..12].copy_from_slice(&2u32.to_le_bytes());
        seal(&mut version_2);
        assert!(matches!(
            decode_header(&version_2, VdiskId(1), 2),
            Decoded::Valid(())
        ));
        let mut version_4 = header;
        version_4[8..12].copy_from_slice(&4u32.to_le_bytes());
        seal(&mut version_4);
        match decode_header(&version_4, VdiskId(1), 2) {
            Decoded::Bad(reason) => assert!(reason.contains("version 4"), "{reason}"),
            other => panic!("expected Bad, got {other:?}"),
        }
        assert_eq!(parse_egroup_file_name(&egroup_file_name(0xab)), Some(0xab));
        assert_eq!(parse_egroup_file_name("0000000000000001.tmp"), None);
        assert_eq!(parse_egroup_file_name("1.egroup"), None);
    }
}

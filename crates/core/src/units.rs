//! Newtypes for identifiers and units. Widths are explicit because these values travel on disk
//! and (later) on the wire.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Checksum and cache granularity: every 4 KiB block of the extent store carries its own CRC32C.
pub const BLOCK_SIZE_BYTES: u64 = 4096;
/// An extent is 1 MiB of a vdisk's address space: the unit of placement, locality and migration.
pub const EXTENT_SIZE_BYTES: u64 = 1 << 20;
/// Largest vdisk we accept: 1 PiB. Keeps every offset computation far from u64 overflow.
pub const MAX_VDISK_SIZE_BYTES: u64 = 1 << 50;

/// Cluster-wide identifier of a vdisk. Never reused, so on-disk files named by it cannot be
/// confused with those of a deleted vdisk of the same name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct VdiskId(pub u64);

impl fmt::Display for VdiskId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// A byte offset inside a vdisk's address space.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ByteOffset(pub u64);

/// A length in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ByteCount(pub u64);

/// Index of a 1 MiB extent inside a vdisk (`offset / EXTENT_SIZE_BYTES`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ExtentIndex(pub u64);

impl ExtentIndex {
    pub fn containing(offset: ByteOffset) -> Self {
        ExtentIndex(offset.0 / EXTENT_SIZE_BYTES)
    }
    pub fn start(self) -> ByteOffset {
        ByteOffset(self.0 * EXTENT_SIZE_BYTES)
    }
}

/// A monotonically increasing generation number. Used for shard maps today and for ownership
/// leases once the cluster exists: anything tagged with an older epoch is stale.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Epoch(pub u64);

impl Epoch {
    pub fn next(self) -> Epoch {
        Epoch(self.0 + 1)
    }
}

impl fmt::Display for Epoch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extent_index_maps_offsets_to_their_megabyte() {
        assert_eq!(ExtentIndex::containing(ByteOffset(0)), ExtentIndex(0));
        assert_eq!(
            ExtentIndex::containing(ByteOffset(EXTENT_SIZE_BYTES - 1)),
            ExtentIndex(0)
        );
        assert_eq!(
            ExtentIndex::containing(ByteOffset(EXTENT_SIZE_BYTES)),
            ExtentIndex(1)
        );
        assert_eq!(ExtentIndex(3).start(), ByteOffset(3 * EXTENT_SIZE_BYTES));
    }
}

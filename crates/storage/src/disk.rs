//! The node's disks: directories on mounted filesystems, each with a tier. File I/O on them
//! goes through [`crate::fs`].

use std::path::PathBuf;

/// Storage tier of a disk: `fast` (SSD/NVMe, holds the oplog) or `slow` (HDD).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Tier {
    Fast,
    Slow,
}

impl Tier {
    pub fn name(self) -> &'static str {
        match self {
            Tier::Fast => "fast",
            Tier::Slow => "slow",
        }
    }
}

/// One disk given to the node: a directory on a mounted filesystem, with its tier.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Disk {
    pub path: PathBuf,
    pub tier: Tier,
}

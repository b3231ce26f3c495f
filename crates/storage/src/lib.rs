//! Per-node storage: the node's disks, each vdisk shard's oplog, and the extent store.
//!
//! Everything here is used from a single reactor thread at a time (one shard controller owns
//! one oplog and the extent-store view of the ranges it serves), so nothing here locks.

pub mod copy_identity;
pub mod disk;
pub mod extent_store;
pub mod fs;
mod join;
pub mod oplog;

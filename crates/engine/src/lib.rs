//! The thread-per-core vdisk engine.
//!
//! - [`reactor`]: one pinned thread per core running a current-thread tokio runtime.
//! - [`shard`]: shard controllers, the single-threaded owners of a vdisk's offset ranges.
//! - [`vdisk`]: the shard map and the per-connection handle that splits and joins I/O.
//! - [`engine`]: the control plane: catalog, recovery, create/resize/re-shard/delete.
//! - [`startup`]: what startup does with data the catalog does not name (sets it aside).
//! - [`gate`]: the per-vdisk serving gate (cluster ownership) every request passes.
//! - [`cache`]: the per-reactor read cache (single-touch and multi-touch LRU pools).
//! - [`drain_budget`]: the node-wide bound on the memory drain steps hold.

pub mod cache;
pub mod catalog;
pub mod config;
pub mod drain_budget;
pub mod engine;
pub mod gate;
mod lru;
mod outbox;
pub mod reactor;
pub mod replication;
pub mod shard;
pub mod spin_policy;
pub mod startup;
pub mod stats;
pub mod vdisk;

pub use config::EngineConfig;
pub use engine::{CacheStats, Engine, EngineError, VdiskInfo, VdiskState, VdiskStats};
pub use gate::ServeGate;
pub use vdisk::VdiskHandle;

//! Test tooling: a FUSE filesystem that simulates a power cut by dropping every write that was
//! not made durable. See `README.md` in this crate for the semantics.
//!
//! ```no_run
//! use ashlar_powercut_fs::{CutPolicy, PowercutFs};
//! let fs = PowercutFs::mount("/tmp/backing", "/tmp/mnt")?;
//! // ... run a workload against /tmp/mnt ...
//! let report = fs.cut(CutPolicy::RandomSubset { seed: 7 })?;
//! let fs = PowercutFs::mount("/tmp/backing", "/tmp/mnt")?; // the post-cut state
//! # Ok::<(), std::io::Error>(())
//! ```

mod client;
#[doc(hidden)]
pub mod daemon;
mod fuse;
mod model;
mod protocol;
mod rng;

pub use client::{
    binary_path, check_environment, is_mounted, MountOptions, PowercutFs, BINARY_ENV, BINARY_NAME,
};
pub use model::STAGING;
pub use protocol::{CutPolicy, CutReport, PendingStatus};

//! Errors of every MetaStore implementation. Each message is one line that
//! says what happened and what the operator or caller can do about it.

use std::path::PathBuf;
use std::sync::Arc;

use crate::types::{LeaseId, Revision};

/// The source of a storage failure. `Arc` (not `Box`) so that `MetaError`
/// is `Clone`: a watch hands the same terminal error out on every later call.
pub type ErrorSource = Arc<dyn std::error::Error + Send + Sync + 'static>;

#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum MetaError {
    #[error("metadata store {}: storage failure: {source}; check the disk and file permissions", path.display())]
    Storage {
        path: PathBuf,
        #[source]
        source: ErrorSource,
    },

    #[error("metadata store {} is already open by another process; stop that process or point this one at a different file", path.display())]
    AlreadyOpen { path: PathBuf },

    #[error("metadata store {} holds corrupt data ({detail}); restore it from a backup", path.display())]
    Corrupt { path: PathBuf, detail: String },

    #[error("lease {0} not found: it expired or was revoked; grant a new lease")]
    LeaseNotFound(LeaseId),

    #[error("watch start revision {requested} has been compacted (oldest retained is {oldest}); re-read the current state and watch from its revision")]
    Compacted {
        requested: Revision,
        /// The oldest start revision the store can still replay from.
        oldest: Revision,
    },

    #[error("metadata store is closed or shutting down")]
    Closed,

    #[error("watcher fell more than {capacity} events behind and was dropped; re-read the current state and watch again")]
    WatchLagged { capacity: usize },

    #[error("invalid metadata request: {0}")]
    InvalidArgument(String),

    #[error("metadata store state is unusable after an internal panic; restart the process")]
    Poisoned,

    /// No etcd endpoint answered, or one gave up on the request. A write
    /// that fails this way may or may not have been applied: re-read before
    /// retrying a compare-and-swap.
    #[error("etcd unavailable at {endpoints}: {reason}; check that etcd runs and that this host can reach it")]
    Unavailable { endpoints: String, reason: String },

    /// etcd answered with an error that has no more specific variant.
    #[error("etcd at {endpoint} refused the request ({code}): {message}")]
    Etcd {
        endpoint: String,
        code: String,
        message: String,
    },
}

impl MetaError {
    pub(crate) fn invalid(msg: impl Into<String>) -> Self {
        MetaError::InvalidArgument(msg.into())
    }
}

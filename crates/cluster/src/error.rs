//! Errors of the cluster layer, one line each.

use std::path::PathBuf;

use ashlar_core::VdiskId;
use ashlar_meta::{LeaseId, MetaError};

use crate::node_id::NodeId;
use crate::ownership::OwnershipEpoch;
use crate::serving::ServeRefusal;

/// The node id file could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum NodeIdError {
    #[error("node id file {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("node id file {} is corrupt ({detail}); restore it, or remove it to make this data directory a new node", path.display())]
    Corrupt { path: PathBuf, detail: String },
}

/// Membership and ownership reads and writes.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error(transparent)]
    Meta(#[from] MetaError),
    /// A record that does not decode: named by key, never guessed at.
    #[error("cluster record {key} is corrupt: {detail}")]
    Corrupt { key: String, detail: String },
}

impl ClusterError {
    pub(crate) fn corrupt(key: &[u8], detail: impl Into<String>) -> Self {
        ClusterError::Corrupt {
            key: String::from_utf8_lossy(key).into_owned(),
            detail: detail.into(),
        }
    }
}

/// Why a claim of a vdisk's ownership failed.
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    /// A node (possibly the claimant itself) owns the vdisk under a live lease.
    #[error("vdisk {vdisk} is owned by node {owner} (epoch {epoch})")]
    Owned {
        vdisk: VdiskId,
        owner: NodeId,
        epoch: OwnershipEpoch,
    },
    /// The claimant's lease has ended: it must re-register before it claims anything.
    #[error("lease {0} not found: the node's registration ended; re-register before claiming")]
    LeaseNotFound(LeaseId),
    /// Other claims kept moving the epoch between our read and our transaction.
    #[error(
        "vdisk {vdisk}: ownership changed under {attempts} claim attempts in a row; try again"
    )]
    Contended { vdisk: VdiskId, attempts: u32 },
    #[error(transparent)]
    Cluster(#[from] ClusterError),
}

impl From<MetaError> for ClaimError {
    fn from(error: MetaError) -> Self {
        match error {
            MetaError::LeaseNotFound(lease) => ClaimError::LeaseNotFound(lease),
            other => ClaimError::Cluster(ClusterError::Meta(other)),
        }
    }
}

/// Why a release of ownership failed.
#[derive(Debug, thiserror::Error)]
pub enum ReleaseError {
    /// The claim is no longer current: its lease ended or another claim replaced it. There
    /// is nothing to release, and the caller must already have stopped acting as owner.
    #[error("vdisk {vdisk}: the claim at epoch {epoch} is no longer the current owner")]
    NotOwner {
        vdisk: VdiskId,
        epoch: OwnershipEpoch,
    },
    #[error(transparent)]
    Cluster(#[from] ClusterError),
}

impl From<MetaError> for ReleaseError {
    fn from(error: MetaError) -> Self {
        ReleaseError::Cluster(ClusterError::Meta(error))
    }
}

/// Why a node may not (or could not) claim a vdisk to serve it.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("vdisk {vdisk}: {}", refusal_text(refusal))]
    Refused {
        vdisk: VdiskId,
        refusal: ServeRefusal,
    },
    /// The claim itself failed (lease ended, contention, store errors).
    #[error(transparent)]
    Claim(#[from] ClaimError),
}

fn refusal_text(refusal: &ServeRefusal) -> String {
    match refusal {
        ServeRefusal::StorageOnly => "this node is storage-only; it never serves vdisks".into(),
        ServeRefusal::OwnedElsewhere { owner, epoch } => {
            format!("owned by node {owner} (epoch {epoch})")
        }
        ServeRefusal::DataOnDownNode { node } => format!(
            "its data is on node {node}, which is down; without replication no other node holds it"
        ),
    }
}

impl From<MetaError> for ServeError {
    fn from(error: MetaError) -> Self {
        ServeError::Claim(error.into())
    }
}

impl From<ClusterError> for ServeError {
    fn from(error: ClusterError) -> Self {
        ServeError::Claim(error.into())
    }
}

//! Ashlar's cluster layer over any [`ashlar_meta::MetaStore`]: which nodes exist and which are
//! up (membership, on leases), and which node owns each vdisk at which epoch (ownership, the
//! foundation of fencing). Pure control-plane logic: the store is the only I/O, besides the
//! node id file, and time enters only as an argument or through the keep-alive loop.
//!
//! Key layout, record formats and the claim transaction: docs/cluster-metadata.md.

pub mod drain;
mod error;
pub mod keys;
pub mod membership;
mod node_id;
pub mod ownership;
pub mod placement;
pub mod record;
pub mod serving;
pub mod status;

pub use drain::{cancel_drain, draining_nodes, is_draining, start_drain, DrainRecord};
pub use error::{ClaimError, ClusterError, NodeIdError, ReleaseError, ServeError};
pub use membership::{
    keep_registered, list_nodes, register, remove_member, KeepAliveOutcome, KeepAliveState,
    KeepAliveStep, LeaseStatus, MembershipConfig, NodeState, NodeStatus, Registration, Removal,
    DEFAULT_NODE_LEASE_TTL, DEFAULT_RECORD_REFRESH_INTERVAL,
};
pub use node_id::{load_or_create_node_id, NodeId, NODE_ID_FILE};
pub use ownership::{
    all_owners, claim, claim_held, claim_to_serve, current_epoch, current_owner, holds_claim,
    read_ownership, release, watch_ownership, Owner, OwnershipChange, OwnershipClaim,
    OwnershipEpoch, OwnershipState, OwnershipWatch,
};
pub use placement::{
    choose_copies, mark_placement_synced, read_placement, read_placement_revision,
    record_in_sync_release, record_placement, remove_placement, renew_copies, replace_placement,
    InSyncCopy, InSyncRelease, PlacementError, PlacementRecord, PLACEMENT_RECORD_VERSION,
};
pub use record::{AdvertisedAddresses, DiskRecord, NodeRecord, NODE_RECORD_VERSION};
pub use serving::{decide_serve, gate_step, GateStep, ServeRefusal};
pub use status::{
    cluster_status, ClusterStatus, Health, ResyncRecord, ResyncView, VdiskFacts, VdiskHealth,
    RESYNC_RECORD_VERSION,
};

//! Vdisk ownership with epochs: the foundation of fencing.
//!
//! A vdisk's owner is named by an owner key attached to the owner's lease, so ownership ends
//! by itself when the owner's registration does. Each claim also raises the vdisk's epoch, a
//! persistent key that only ever grows: the claim and the epoch bump are ONE transaction, so
//! every owner holds an epoch no earlier owner held, and it holds it (in the store) before
//! its first write. Replicas that remember the highest epoch they have seen can then refuse
//! an older owner's writes (docs/cluster-metadata.md).

use std::fmt;

use ashlar_core::VdiskId;
use ashlar_meta::{
    Compare, EventKind, KeyRange, KeyValue, LeaseId, MetaError, MetaStore, Revision, Txn, TxnOp,
    TxnOpResult, TxnResponse, Watch,
};
use serde::{Deserialize, Serialize};

use crate::error::{ClaimError, ClusterError, ReleaseError, ServeError};
use crate::keys;
use crate::node_id::NodeId;
use crate::record::{self, EpochRecord, OwnerRecord, OWNERSHIP_RECORD_VERSION};
use crate::serving::decide_serve;

/// Claim transactions tried in a row when other claims keep moving the epoch.
pub const CLAIM_ATTEMPTS: u32 = 8;

/// The epoch of a vdisk's ownership: raised by every claim, never lowered, never reused.
/// Not the engine's shard-map epoch (`ashlar_core::Epoch`), hence a type of its own.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct OwnershipEpoch(pub u64);

impl fmt::Display for OwnershipEpoch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A successful claim: this node owns `vdisk` at `epoch` for as long as `lease` lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnershipClaim {
    pub vdisk: VdiskId,
    pub node: NodeId,
    pub epoch: OwnershipEpoch,
    pub lease: LeaseId,
    /// The store revision of the claim transaction.
    pub revision: Revision,
}

/// The current owner of a vdisk, as the store says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    pub node: NodeId,
    pub epoch: OwnershipEpoch,
    pub lease: Option<LeaseId>,
}

/// The state the claim transaction was prepared from.
struct EpochRead {
    /// `mod_revision` of the epoch key; `Revision(0)` when it does not exist.
    mod_revision: Revision,
    epoch: OwnershipEpoch,
}

/// Claims `vdisk` for `node`, whose registration holds `lease`. One transaction, which holds
/// only if nobody owns the vdisk (an owner whose lease ended has no owner key any more) and
/// the epoch key is unchanged since it was read; it then writes the owner key on `lease` and
/// the raised epoch. Fails with [`ClaimError::Owned`] while anyone (this node included) owns
/// the vdisk.
pub async fn claim<M: MetaStore>(
    store: &M,
    vdisk: VdiskId,
    node: NodeId,
    lease: LeaseId,
) -> Result<OwnershipClaim, ClaimError> {
    let owner_key = keys::owner_key(vdisk);
    let epoch_key = keys::epoch_key(vdisk);
    for _ in 0..CLAIM_ATTEMPTS {
        let read = read_epoch(store, vdisk).await?;
        let epoch = next_epoch(&epoch_key, read.epoch)?;
        let txn = claim_txn(
            vdisk,
            node,
            lease,
            epoch,
            Compare::absent(owner_key.clone()),
            read.mod_revision,
        )
        .or_else([TxnOp::get(KeyRange::key(owner_key.clone()))]);
        let response = store.txn(txn).await?;
        if response.succeeded {
            return Ok(granted(vdisk, node, lease, epoch, &response));
        }
        if let Some(kv) = first_get(&response.results) {
            let current: OwnerRecord = record::decode(&kv.key, &kv.value)?;
            return Err(ClaimError::Owned {
                vdisk,
                owner: current.node_id,
                epoch: current.epoch,
            });
        }
        // Nobody owns it, but the epoch moved: another claim came and went. Read again.
    }
    Err(ClaimError::Contended {
        vdisk,
        attempts: CLAIM_ATTEMPTS,
    })
}

/// The epoch after `current`; the epoch space ending is corruption, not something to wrap.
fn next_epoch(epoch_key: &[u8], current: OwnershipEpoch) -> Result<OwnershipEpoch, ClusterError> {
    current
        .0
        .checked_add(1)
        .map(OwnershipEpoch)
        .ok_or_else(|| ClusterError::corrupt(epoch_key, "epoch is at its maximum"))
}

/// The claim a successful claim transaction granted.
fn granted(
    vdisk: VdiskId,
    node: NodeId,
    lease: LeaseId,
    epoch: OwnershipEpoch,
    response: &TxnResponse,
) -> OwnershipClaim {
    assert!(
        response.succeeded,
        "only a committed claim grants ownership"
    );
    OwnershipClaim {
        vdisk,
        node,
        epoch,
        lease,
        revision: response.revision,
    }
}

/// The claim transaction: if `owner_guard` holds and the epoch key is unchanged since it was
/// read at `epoch_mod_revision`, write the owner key on `lease` and the raised epoch, in one
/// transaction (the epoch is recorded before the new owner's first write).
fn claim_txn(
    vdisk: VdiskId,
    node: NodeId,
    lease: LeaseId,
    epoch: OwnershipEpoch,
    owner_guard: Compare,
    epoch_mod_revision: Revision,
) -> Txn {
    let owner = OwnerRecord {
        version: OWNERSHIP_RECORD_VERSION,
        node_id: node,
        epoch,
    };
    let granted = EpochRecord {
        version: OWNERSHIP_RECORD_VERSION,
        epoch,
        node_id: node,
    };
    Txn::new()
        .when([
            owner_guard,
            Compare::mod_revision_equals(keys::epoch_key(vdisk), epoch_mod_revision),
        ])
        .and_then([
            TxnOp::put(keys::owner_key(vdisk), record::encode(&owner), Some(lease)),
            TxnOp::put(keys::epoch_key(vdisk), record::encode(&granted), None),
        ])
}

/// Claims `vdisk` so that `node` may serve its I/O, by the rules of
/// [`decide_serve`](crate::serving::decide_serve): nobody else owns it, and its last owner
/// (the node its highest epoch went to) is this node or nobody. An owner record of this
/// same node (an earlier run, or a claim whose lease lapsed) is taken over. Like [`claim`],
/// one transaction writes the owner key on `lease` and raises the epoch; it is guarded on
/// both keys being exactly as read, so the rules hold at the revision it commits at.
pub async fn claim_to_serve<M: MetaStore>(
    store: &M,
    vdisk: VdiskId,
    node: NodeId,
    lease: LeaseId,
    storage_only: bool,
) -> Result<OwnershipClaim, ServeError> {
    let owner_key = keys::owner_key(vdisk);
    for _ in 0..CLAIM_ATTEMPTS {
        let state = read_ownership(store, vdisk).await?;
        let owner = state.owner.as_ref().map(|(owner, _)| owner);
        let copies = crate::placement::read_placement(store, vdisk)
            .await?
            .map(|p| p.copies)
            .unwrap_or_default();
        decide_serve(node, storage_only, owner, state.last_owner, &copies)
            .map_err(|refusal| ServeError::Refused { vdisk, refusal })?;
        let owner_guard = match &state.owner {
            None => Compare::absent(owner_key.clone()),
            Some((_, mod_revision)) => {
                Compare::mod_revision_equals(owner_key.clone(), *mod_revision)
            }
        };
        let epoch = next_epoch(&keys::epoch_key(vdisk), state.epoch.epoch)?;
        let txn = claim_txn(
            vdisk,
            node,
            lease,
            epoch,
            owner_guard,
            state.epoch.mod_revision,
        );
        let response = store.txn(txn).await?;
        if response.succeeded {
            return Ok(granted(vdisk, node, lease, epoch, &response));
        }
        // Someone claimed or released in between: decide again on what is there now.
    }
    Err(ServeError::Claim(ClaimError::Contended {
        vdisk,
        attempts: CLAIM_ATTEMPTS,
    }))
}

/// A vdisk's ownership as one revision saw it.
pub struct OwnershipState {
    /// The owner record and its `mod_revision`, if anyone owns the vdisk.
    pub owner: Option<(Owner, Revision)>,
    /// The node the highest epoch went to (the last owner), if it was ever claimed.
    pub last_owner: Option<NodeId>,
    epoch: EpochRead,
}

impl OwnershipState {
    /// The highest epoch ever granted (0 if never claimed).
    pub fn epoch(&self) -> OwnershipEpoch {
        self.epoch.epoch
    }
}

/// Reads a vdisk's owner and epoch records in one transaction (one revision).
pub async fn read_ownership<M: MetaStore>(
    store: &M,
    vdisk: VdiskId,
) -> Result<OwnershipState, ClusterError> {
    let response = store
        .txn(Txn::new().and_then([
            TxnOp::get(KeyRange::key(keys::owner_key(vdisk))),
            TxnOp::get(KeyRange::key(keys::epoch_key(vdisk))),
        ]))
        .await?;
    let mut gets = response.results.iter().filter_map(|r| match r {
        TxnOpResult::Get { kvs } => Some(kvs.first()),
        _ => None,
    });
    let (owner_kv, epoch_kv) = (gets.next().flatten(), gets.next().flatten());
    let owner = owner_kv
        .map(|kv| owner_of(kv).map(|owner| (owner, kv.mod_revision)))
        .transpose()?;
    let (epoch, last_owner) = match epoch_kv {
        None => (
            EpochRead {
                mod_revision: Revision(0),
                epoch: OwnershipEpoch(0),
            },
            None,
        ),
        Some(kv) => {
            let record: EpochRecord = record::decode(&kv.key, &kv.value)?;
            (
                EpochRead {
                    mod_revision: kv.mod_revision,
                    epoch: record.epoch,
                },
                Some(record.node_id),
            )
        }
    };
    Ok(OwnershipState {
        owner,
        last_owner,
        epoch,
    })
}

fn first_get(results: &[TxnOpResult]) -> Option<&KeyValue> {
    results.iter().find_map(|r| match r {
        TxnOpResult::Get { kvs } => kvs.first(),
        _ => None,
    })
}

async fn read_epoch<M: MetaStore>(store: &M, vdisk: VdiskId) -> Result<EpochRead, ClusterError> {
    Ok(match store.get(&keys::epoch_key(vdisk)).await? {
        None => EpochRead {
            mod_revision: Revision(0),
            epoch: OwnershipEpoch(0),
        },
        Some(kv) => EpochRead {
            mod_revision: kv.mod_revision,
            epoch: record::decode::<EpochRecord>(&kv.key, &kv.value)?.epoch,
        },
    })
}

/// The highest epoch ever granted for `vdisk` (0 if it was never claimed).
pub async fn current_epoch<M: MetaStore>(
    store: &M,
    vdisk: VdiskId,
) -> Result<OwnershipEpoch, ClusterError> {
    Ok(read_epoch(store, vdisk).await?.epoch)
}

/// The conditions under which `claim` still is the vdisk's ownership: the owner key holds
/// this claim's record (same node, same epoch) on this claim's lease. A transaction guarded by
/// them changes the store only while the claim holds, which fences a former owner's writes to
/// the store as the epoch fences its writes to the copies.
pub fn claim_held(claim: &OwnershipClaim) -> [Compare; 2] {
    let owner_key = keys::owner_key(claim.vdisk);
    let ours = OwnerRecord {
        version: OWNERSHIP_RECORD_VERSION,
        node_id: claim.node,
        epoch: claim.epoch,
    };
    [
        Compare::value(
            owner_key.clone(),
            ashlar_meta::CompareOp::Equal,
            record::encode(&ours),
        ),
        Compare::lease(owner_key, ashlar_meta::CompareOp::Equal, Some(claim.lease)),
    ]
}

/// Whether `claim` still is the vdisk's ownership in the store ([`claim_held`]).
pub async fn holds_claim<M: MetaStore>(
    store: &M,
    claim: &OwnershipClaim,
) -> Result<bool, ClusterError> {
    Ok(store
        .txn(Txn::new().when(claim_held(claim)))
        .await?
        .succeeded)
}

/// Gives up ownership: deletes the owner key if it still is this claim's (same lease, same
/// record). The epoch stays, so the next claim raises it.
pub async fn release<M: MetaStore>(store: &M, claim: &OwnershipClaim) -> Result<(), ReleaseError> {
    let txn = Txn::new()
        .when(claim_held(claim))
        .and_then([TxnOp::delete(KeyRange::key(keys::owner_key(claim.vdisk)))]);
    if store.txn(txn).await?.succeeded {
        Ok(())
    } else {
        Err(ReleaseError::NotOwner {
            vdisk: claim.vdisk,
            epoch: claim.epoch,
        })
    }
}

/// Who owns `vdisk` now, if anyone.
pub async fn current_owner<M: MetaStore>(
    store: &M,
    vdisk: VdiskId,
) -> Result<Option<Owner>, ClusterError> {
    store
        .get(&keys::owner_key(vdisk))
        .await?
        .map(|kv| owner_of(&kv))
        .transpose()
}

fn owner_of(kv: &KeyValue) -> Result<Owner, ClusterError> {
    let record: OwnerRecord = record::decode(&kv.key, &kv.value)?;
    Ok(Owner {
        node: record.node_id,
        epoch: record.epoch,
        lease: kv.lease,
    })
}

/// Every vdisk's current owner, read at one revision.
pub async fn all_owners<M: MetaStore>(
    store: &M,
) -> Result<(Vec<(VdiskId, Owner)>, Revision), ClusterError> {
    let response = store
        .txn(Txn::new().and_then([TxnOp::get(keys::owners())]))
        .await?;
    let mut owners = Vec::new();
    for result in &response.results {
        if let TxnOpResult::Get { kvs } = result {
            for kv in kvs {
                owners.push((vdisk_of(kv)?, owner_of(kv)?));
            }
        }
    }
    Ok((owners, response.revision))
}

fn vdisk_of(kv: &KeyValue) -> Result<VdiskId, ClusterError> {
    keys::vdisk_of_owner_key(&kv.key)
        .ok_or_else(|| ClusterError::corrupt(&kv.key, "owner key does not name a vdisk id"))
}

/// One change of a vdisk's ownership.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnershipChange {
    pub vdisk: VdiskId,
    /// The new owner, or `None` when ownership ended (release, or the owner's lease ended).
    pub owner: Option<Owner>,
    pub revision: Revision,
}

/// Ownership changes of every vdisk (or of one), in revision order.
pub struct OwnershipWatch {
    watch: Watch,
}

/// Watches ownership changes from `start` (inclusive; `None` for changes after now). To
/// learn the state and then every change, call [`all_owners`] and watch from its revision's
/// `next()`.
pub async fn watch_ownership<M: MetaStore>(
    store: &M,
    vdisk: Option<VdiskId>,
    start: Option<Revision>,
) -> Result<OwnershipWatch, MetaError> {
    let range = match vdisk {
        Some(vdisk) => KeyRange::key(keys::owner_key(vdisk)),
        None => keys::owners(),
    };
    Ok(OwnershipWatch {
        watch: store.watch(range, start).await?,
    })
}

impl OwnershipWatch {
    /// The next change, or the error that ended the watch (then re-read and watch again).
    pub async fn next(&mut self) -> Result<OwnershipChange, ClusterError> {
        let event = self.watch.next_event().await?;
        let vdisk = vdisk_of(&event.kv)?;
        let owner = match event.kind {
            EventKind::Put => Some(owner_of(&event.kv)?),
            EventKind::Delete => None,
        };
        Ok(OwnershipChange {
            vdisk,
            owner,
            revision: event.revision(),
        })
    }
}

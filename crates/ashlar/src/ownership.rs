//! Cluster mode: a node serves a vdisk's I/O only while it holds the vdisk's ownership claim
//! on a lease that is surely valid.
//!
//! - **Open** (an NBD client choosing an export): if this node's gate for the vdisk is open,
//!   it holds the claim and nothing is asked of etcd. Otherwise it claims the vdisk
//!   (`ashlar_cluster::claim_to_serve`: nobody else owns it and its last owner is this node
//!   or nobody, epoch raised in the claim's transaction) and opens the gate until the
//!   lease's `valid_until`; or it refuses with a message naming the owner (and its address)
//!   or the down node that holds the data.
//! - **Lease changes** (every keep-alive moves `valid_until`; a new registration changes the
//!   lease): a follower task extends each open gate, or, when the lease changed or the gate
//!   lapsed meanwhile, keeps it shut and claims the vdisk again at a higher epoch.
//! - **The data path** checks the gate (one atomic and a clock read, in the engine's
//!   `VdiskHandle`); past `valid_until` requests fail with EIO by themselves, even if this
//!   task never runs again.
//!
//! On a single node (`--etcd` not given) none of this exists: gates are open for good.

use crate::cluster::NodeMeta;
use crate::registry::NodeEngine;
use ashlar_cluster::{
    claim_to_serve, gate_step, read_ownership, release, GateStep, LeaseStatus, NodeId, NodeRecord,
    OwnershipClaim, OwnershipEpoch, ServeError, ServeRefusal,
};
use ashlar_core::VdiskId;
use ashlar_engine::ServeGate;
use ashlar_meta::MetaStore;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio::sync::watch;

/// The node's ownership layer; `None` inside on a single node.
#[derive(Clone, Default)]
pub struct NodeOwnership {
    cluster: Option<Arc<Clustered>>,
}

struct Clustered {
    meta: NodeMeta,
    node: NodeId,
    storage_only: bool,
    lease: watch::Receiver<LeaseStatus>,
    /// Claims are made on the control runtime (where the etcd client lives), one at a time:
    /// two opens of one vdisk must not both claim it (the second would take over the first).
    control: tokio::runtime::Handle,
    claiming: tokio::sync::Mutex<()>,
    held: Mutex<HashMap<VdiskId, Held>>,
}

/// A claim this node holds (or held, until it is claimed again) and the gate it opens.
struct Held {
    name: String,
    claim: OwnershipClaim,
    gate: Arc<ServeGate>,
}

/// Why a claim was not made: the line for the client, and whether trying again later may
/// help (the store did not answer) or not (another node owns the vdisk or holds its data).
struct NotClaimed {
    message: String,
    for_good: bool,
}

/// What `vdisk show`/`list` say about a vdisk's ownership.
#[derive(Debug, Clone, serde::Serialize)]
pub struct OwnershipView {
    pub owner: Option<NodeId>,
    pub owner_epoch: Option<OwnershipEpoch>,
    /// The highest epoch ever granted, and the node it went to (the last owner).
    pub epoch: OwnershipEpoch,
    pub last_owner: Option<NodeId>,
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl NodeOwnership {
    /// Cluster mode: every vdisk's gate is closed now and opens only through a claim.
    /// Must run on the control runtime, before the node serves.
    pub fn clustered(
        engine: &NodeEngine,
        meta: NodeMeta,
        node: NodeId,
        storage_only: bool,
        lease: watch::Receiver<LeaseStatus>,
    ) -> Self {
        engine.require_ownership();
        let cluster = Arc::new(Clustered {
            meta,
            node,
            storage_only,
            lease,
            control: tokio::runtime::Handle::current(),
            claiming: tokio::sync::Mutex::new(()),
            held: Mutex::new(HashMap::new()),
        });
        tokio::spawn(follow_lease(cluster.clone()));
        NodeOwnership {
            cluster: Some(cluster),
        }
    }

    /// Makes sure this node may serve `name` (claiming it if it must); the error is the
    /// line the client is shown. Called from any runtime.
    pub async fn ensure_serving(&self, engine: &NodeEngine, name: &str) -> Result<(), String> {
        let Some(cluster) = &self.cluster else {
            return Ok(());
        };
        let (vdisk, gate) = engine.serve_gate(name).map_err(|e| e.to_string())?;
        if gate.admits(std::time::Instant::now()) {
            return Ok(());
        }
        let cluster = cluster.clone();
        let name = name.to_string();
        cluster
            .control
            .clone()
            .spawn(async move { cluster.claim(&name, vdisk, gate).await })
            .await
            .map_err(|e| format!("claiming failed: {e}"))?
            .map_err(|refused| refused.message)
    }

    /// Ownership as `vdisk show` and `vdisk list` show it; `None` on a single node.
    pub async fn view(&self, vdisk: VdiskId) -> Result<Option<OwnershipView>, String> {
        let Some(cluster) = &self.cluster else {
            return Ok(None);
        };
        let state = read_ownership(&cluster.meta, vdisk)
            .await
            .map_err(|e| format!("reading ownership: {e}"))?;
        Ok(Some(OwnershipView {
            owner: state.owner.as_ref().map(|(owner, _)| owner.node),
            owner_epoch: state.owner.as_ref().map(|(owner, _)| owner.epoch),
            epoch: state.epoch(),
            last_owner: state.last_owner,
        }))
    }

    /// Before `vdisk delete`: refused while another live node owns the vdisk (its data and
    /// its clients are there).
    pub async fn check_delete(&self, name: &str, vdisk: VdiskId) -> Result<(), String> {
        let Some(cluster) = &self.cluster else {
            return Ok(());
        };
        let state = read_ownership(&cluster.meta, vdisk)
            .await
            .map_err(|e| format!("reading ownership: {e}"))?;
        match state.owner {
            Some((owner, _)) if owner.node != cluster.node => Err(format!(
                "vdisk {name} is owned by node {}{}; delete it there",
                owner.node,
                cluster.address_of(owner.node).await
            )),
            _ => Ok(()),
        }
    }

    /// After `vdisk delete`: gives up this node's claim on it, if any.
    pub async fn released(&self, vdisk: VdiskId) {
        let Some(cluster) = &self.cluster else {
            return;
        };
        let held = lock(&cluster.held).remove(&vdisk);
        if let Some(held) = held {
            held.gate.close();
            if let Err(error) = release(&cluster.meta, &held.claim).await {
                tracing::info!(vdisk = %held.name, %error, "nothing to release");
            }
        }
    }
}

impl Clustered {
    async fn claim(
        &self,
        name: &str,
        vdisk: VdiskId,
        gate: Arc<ServeGate>,
    ) -> Result<(), NotClaimed> {
        let _one_at_a_time = self.claiming.lock().await;
        if gate.admits(std::time::Instant::now()) {
            return Ok(()); // another open claimed it meanwhile
        }
        let status = *self.lease.borrow();
        if tokio::time::Instant::now() >= status.valid_until {
            return Err(NotClaimed {
                message: format!(
                    "vdisk {name}: this node cannot reach etcd to keep its lease, so it \
                     serves nothing now; try again when it is back"
                ),
                for_good: false,
            });
        }
        match claim_to_serve(
            &self.meta,
            vdisk,
            self.node,
            status.lease,
            self.storage_only,
        )
        .await
        {
            Ok(claim) => {
                self.opened(name, claim, gate);
                Ok(())
            }
            Err(error) => Err(NotClaimed {
                for_good: matches!(error, ServeError::Refused { .. }),
                message: self.refusal_text(name, &error).await,
            }),
        }
    }

    /// Records a fresh claim and opens its gate until its lease is surely valid.
    fn opened(&self, name: &str, claim: OwnershipClaim, gate: Arc<ServeGate>) {
        let status = *self.lease.borrow();
        assert_eq!(
            claim.node, self.node,
            "a node only records claims it made itself"
        );
        if status.lease == claim.lease {
            gate.open_until(status.valid_until.into_std());
        }
        // Else the lease changed under the claim: the follower claims it again.
        tracing::info!(vdisk = name, epoch = %claim.epoch, lease = %claim.lease,
            "claimed vdisk ownership; serving it");
        lock(&self.held).insert(
            claim.vdisk,
            Held {
                name: name.to_string(),
                claim,
                gate,
            },
        );
    }

    async fn refusal_text(&self, name: &str, error: &ServeError) -> String {
        match error {
            ServeError::Refused { refusal, .. } => match refusal {
                ServeRefusal::StorageOnly => format!(
                    "vdisk {name}: node {} is storage-only and never serves vdisks; connect to another node",
                    self.node
                ),
                ServeRefusal::OwnedElsewhere { owner, epoch } => format!(
                    "vdisk {name} is owned by node {owner}{} (epoch {epoch}); connect there \
                     (this version does not forward I/O between nodes)",
                    self.address_of(*owner).await
                ),
                ServeRefusal::DataOnDownNode { node } => format!(
                    "vdisk {name}'s data is on node {node}{}, which is down; without \
                     replication no other node holds it. Start that node again to serve it",
                    self.address_of(*node).await
                ),
            },
            other => format!("vdisk {name}: cannot claim ownership: {other}"),
        }
    }

    /// " at HOST:PORT" (the node's advertised NBD address), or nothing if unknown.
    async fn address_of(&self, node: NodeId) -> String {
        let key = ashlar_cluster::keys::member_key(node);
        match self.meta.get(&key).await {
            Ok(Some(kv)) => ashlar_cluster::record::decode::<NodeRecord>(&kv.key, &kv.value)
                .map(|record| format!(" at {}", record.addresses.nbd))
                .unwrap_or_default(),
            _ => String::new(),
        }
    }

    /// Applies one lease status to every held claim: extend, or shut and claim again.
    async fn apply(&self, status: LeaseStatus) {
        let now_std = std::time::Instant::now();
        let now = tokio::time::Instant::from_std(now_std);
        let mut again = Vec::new();
        for (vdisk, held) in lock(&self.held).iter() {
            let open_until = held
                .gate
                .open_until_at(now_std)
                .map(tokio::time::Instant::from_std);
            let step = gate_step(held.claim.lease, open_until, &status, now);
            let extended = match step {
                GateStep::ExtendUntil(until) => held.gate.extend(until.into_std(), now_std),
                GateStep::Reclaim => false,
            };
            if !extended {
                held.gate.close();
                again.push((*vdisk, held.name.clone(), held.gate.clone()));
            }
        }
        for (vdisk, name, gate) in again {
            tracing::warn!(vdisk = %name, lease = %status.lease,
                "ownership claim lapsed (lease expired or changed); claiming the vdisk again at a higher epoch");
            if let Err(refused) = self.claim(&name, vdisk, gate).await {
                tracing::warn!(vdisk = %name, reason = %refused.message,
                    "could not claim the vdisk again; its I/O keeps failing");
                if refused.for_good {
                    // Another node owns it now: this node is done with it.
                    lock(&self.held).remove(&vdisk);
                }
                // Else it is tried again at the next lease change (etcd answering again).
            }
        }
    }
}

/// Follows the node's lease for as long as the node runs.
async fn follow_lease(cluster: Arc<Clustered>) {
    let mut lease = cluster.lease.clone();
    while lease.changed().await.is_ok() {
        let status = *lease.borrow_and_update();
        cluster.apply(status).await;
    }
}

//! Cluster mode: a node serves a vdisk's I/O only while it holds the vdisk's ownership claim
//! on a lease that is surely valid.
//!
//! - **Open** (an NBD client choosing an export): if this node's gate for the vdisk is open,
//!   it holds the claim and nothing is asked of etcd. Otherwise it claims the vdisk
//!   (`ashlar_cluster::claim_to_serve`: nobody else owns it and its last owner is this node
//!   or nobody, epoch raised in the claim's transaction) and opens the gate until the
//!   lease's `valid_until`; or it refuses with a message naming the owner (and its address)
//!   or the down node that holds the data.
//! - **Login** (an iSCSI initiator logging in to a volume group's target): the same claim
//!   for each of the group's vdisks, in LUN order; but first, if another node owns some of
//!   them and this node none, the group is served there and the login is redirected (a
//!   target is served by one node: claiming the rest here would split it).
//! - **Lease changes** (every keep-alive moves `valid_until`; a new registration changes the
//!   lease): a follower task extends each open gate, or, when the lease changed or the gate
//!   lapsed meanwhile, keeps it shut and claims the vdisk again at a higher epoch.
//! - **The data path** checks the gate (one atomic and a clock read, in the engine's
//!   `VdiskHandle`); past `valid_until` requests fail by themselves (EIO over NBD, NOT READY
//!   over iSCSI), even if this task never runs again.
//!
//! On a single node (`--etcd` not given) none of this exists: gates are open for good.

use crate::cluster::NodeMeta;
use crate::forwarding::Migrations;
use crate::registry::NodeEngine;
use crate::replication::{CopyFailed, NodeReplication, Reclaim};
use ashlar_cluster::{
    claim_to_serve, gate_step, read_ownership, release, AdvertisedAddresses, GateStep, LeaseStatus,
    NodeId, NodeRecord, OwnershipClaim, OwnershipEpoch, ServeError, ServeRefusal,
};
use ashlar_core::VdiskId;
use ashlar_engine::ServeGate;
use ashlar_meta::MetaStore;
use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use tokio::sync::watch;

/// Told of each claim this node makes (the vdisk and the claim's epoch); see
/// [`NodeOwnership::on_claimed`].
pub type ClaimListener = Arc<dyn Fn(VdiskId, OwnershipEpoch) + Send + Sync>;

/// The node's ownership layer; `None` inside on a single node.
#[derive(Clone)]
pub struct NodeOwnership {
    cluster: Option<Arc<Clustered>>,
    /// Forwarded I/O per vdisk, which moves vdisks here (never on a single node).
    migrations: Arc<Migrations>,
}

impl Default for NodeOwnership {
    fn default() -> Self {
        NodeOwnership {
            cluster: None,
            migrations: Arc::new(Migrations::new(None)),
        }
    }
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
    /// The last claim of a vdisk that could not serve (a copy unreachable, ...), and why:
    /// the next attempt waits `CLAIM_FAILURE_BACKOFF`, so clients retrying their requests
    /// do not claim (and raise the epoch in etcd) hundreds of times a second.
    failed_claims: Mutex<HashMap<VdiskId, (std::time::Instant, String)>>,
    /// Makes a claimed vdisk's writes reach every copy before its gate opens.
    replication: Arc<NodeReplication>,
    /// Told of every claim made, before the client that asked for it is served.
    listeners: Mutex<Vec<ClaimListener>>,
}

/// A claim this node holds (or held, until it is claimed again) and the gate it opens.
struct Held {
    wanted: Wanted,
    claim: OwnershipClaim,
    /// Whose client made the claim: refusals of a claim made again name addresses for it.
    frontend: Frontend,
}

/// A vdisk this node is asked to serve, and its serving gate.
#[derive(Clone)]
struct Wanted {
    name: String,
    vdisk: VdiskId,
    gate: Arc<ServeGate>,
}

impl Wanted {
    fn of(engine: &NodeEngine, name: &str) -> Result<Wanted, NotServing> {
        let (vdisk, gate) = engine
            .serve_gate(name)
            .map_err(|e| NotServing::for_now(e.to_string()))?;
        Ok(Wanted {
            name: name.to_string(),
            vdisk,
            gate,
        })
    }

    fn admitted_now(&self) -> bool {
        self.gate.admits(std::time::Instant::now())
    }
}

/// The front-end a refusal is written for: it gives the other node's address for that
/// front-end, where the client may connect instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Frontend {
    Nbd,
    Iscsi,
}

impl Frontend {
    fn address(self, addresses: &AdvertisedAddresses) -> &str {
        match self {
            Frontend::Nbd => &addresses.nbd,
            Frontend::Iscsi => &addresses.iscsi,
        }
    }
}

/// Why this node does not serve a vdisk now: the line for the client (or the log), and the
/// refusal behind it when another node owns the vdisk or holds its data. Without one (the
/// store did not answer, the lease is not valid) trying again later may help.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct NotServing {
    pub message: String,
    pub refusal: Option<ServeRefusal>,
}

impl NotServing {
    fn for_now(message: String) -> Self {
        NotServing {
            message,
            refusal: None,
        }
    }
}

/// Why a volume group's vdisks (an iSCSI target's LUNs) are not all served here.
#[derive(Debug, thiserror::Error)]
pub enum GroupNotServed {
    /// Another live node owns vdisks of the group and this node owns none: that node serves
    /// the group. Its advertised addresses, unless its record could not be read.
    #[error("the group is served by node {node}")]
    ServedBy {
        node: NodeId,
        addresses: Option<AdvertisedAddresses>,
    },
    /// The group's vdisks are owned by more than one node: none can serve it all.
    #[error("the group's vdisks are owned by several nodes ({}); one node must own them all to serve the target, which this version cannot arrange", .owners.join(", "))]
    Split { owners: Vec<String> },
    #[error(transparent)]
    NotServing(#[from] NotServing),
}

/// Who serves a client of a vdisk on this node.
pub enum ServedBy {
    /// This node holds the claim.
    Here,
    /// Another live node owns the vdisk: requests are forwarded to it.
    Owner {
        node: NodeId,
        peer: Arc<crate::replication::Peer>,
    },
}

/// What `vdisk show`/`list` say about a vdisk's ownership.
#[derive(Debug, Clone, serde::Serialize)]
pub struct OwnershipView {
    pub owner: Option<NodeId>,
    pub owner_epoch: Option<OwnershipEpoch>,
    /// The highest epoch ever granted, and the node it went to (the last owner).
    pub epoch: OwnershipEpoch,
    pub last_owner: Option<NodeId>,
    /// The nodes holding a copy (a replicated vdisk, once claimed); empty otherwise.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub copies: Vec<NodeId>,
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
        replication: Arc<NodeReplication>,
        migrate_after: Option<std::time::Duration>,
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
            failed_claims: Mutex::new(HashMap::new()),
            replication,
            listeners: Mutex::new(Vec::new()),
        });
        tokio::spawn(follow_lease(cluster.clone()));
        if let Some(failures) = cluster.replication.take_failures() {
            tokio::spawn(reclaim_after_copy_failures(cluster.clone(), failures));
        }
        NodeOwnership {
            cluster: Some(cluster),
            migrations: Arc::new(Migrations::new(migrate_after)),
        }
    }

    /// This node's id (`None` on a single node).
    pub fn node_id(&self) -> Option<NodeId> {
        self.cluster.as_ref().map(|cluster| cluster.node)
    }

    /// Whether node `asker` may take `vdisk` (held here) over now: `None` if it holds a
    /// complete copy, else why it must wait (it is being given one while the vdisk serves:
    /// `NodeReplication::copy_before_hand_over`).
    pub async fn copy_before_hand_over(
        &self,
        vdisk: VdiskId,
        asker: NodeId,
    ) -> Result<Option<String>, String> {
        let Some(cluster) = &self.cluster else {
            return Ok(None);
        };
        let epoch = lock(&cluster.held)
            .get(&vdisk)
            .map(|held| held.claim.epoch.0)
            .ok_or_else(|| format!("vdisk {vdisk} is not served here"))?;
        let replication = cluster.replication.clone();
        cluster
            .control
            .spawn(async move { replication.copy_before_hand_over(vdisk, asker, epoch).await })
            .await
            .map_err(|e| format!("checking the asking node's copy failed: {e}"))?
    }

    /// The node's forwarded I/O per vdisk.
    pub fn migrations(&self) -> &Migrations {
        &self.migrations
    }

    /// Runs `work` on the control runtime (where the etcd client lives), detached.
    pub fn spawn_on_control(&self, work: impl Future<Output = ()> + Send + 'static) {
        match &self.cluster {
            Some(cluster) => drop(cluster.control.spawn(work)),
            None => drop(tokio::spawn(work)),
        }
    }

    /// Makes sure this node may serve `name` (claiming it if it must) for a client of
    /// `frontend`; the error's message is the line the client is shown. Called from any
    /// runtime.
    pub async fn ensure_serving(
        &self,
        engine: &NodeEngine,
        name: &str,
        frontend: Frontend,
    ) -> Result<(), NotServing> {
        let Some(cluster) = &self.cluster else {
            return Ok(());
        };
        learn(engine, name).await;
        let wanted = Wanted::of(engine, name)?;
        if wanted.admitted_now() {
            return Ok(());
        }
        cluster
            .on_control(move |cluster| async move { cluster.claim(wanted, frontend).await })
            .await
    }

    /// Where a client of `name` on this node is served: here (claimed as
    /// [`NodeOwnership::ensure_serving`] does), or by the live node that owns it, reached over
    /// the node-to-node protocol (`docs/forwarding.md`). Called from any runtime.
    pub async fn route(
        &self,
        engine: &NodeEngine,
        name: &str,
        frontend: Frontend,
    ) -> Result<ServedBy, NotServing> {
        let refused = match self.ensure_serving(engine, name, frontend).await {
            Ok(()) => return Ok(ServedBy::Here),
            Err(refused) => refused,
        };
        let (Some(cluster), Some(ServeRefusal::OwnedElsewhere { owner, .. })) =
            (&self.cluster, &refused.refusal)
        else {
            return Err(refused);
        };
        let owner = *owner;
        let cluster = cluster.clone();
        let address = self
            .cluster
            .as_ref()
            .expect("clustered")
            .control
            .spawn(async move { cluster.addresses_of(owner).await })
            .await
            .ok()
            .flatten()
            .and_then(|addresses| addresses.node.parse().ok());
        let Some(address) = address else {
            return Err(NotServing {
                message: format!(
                    "{} (its node-to-node address is unknown, so this node cannot forward to it)",
                    refused.message
                ),
                refusal: refused.refusal,
            });
        };
        let replication = &self.cluster.as_ref().expect("clustered").replication;
        Ok(ServedBy::Owner {
            node: owner,
            peer: replication.peer(owner, address),
        })
    }

    /// Gives up this node's claim on `vdisk` so that another node can claim it at once (a
    /// forwarder that carries the vdisk's clients, `docs/forwarding.md`): the gate shuts,
    /// writes in flight finish, then the claim is released in etcd.
    pub async fn hand_over(
        &self,
        vdisk: VdiskId,
        shared: Arc<ashlar_engine::vdisk::VdiskShared>,
    ) -> Result<(), String> {
        let Some(cluster) = &self.cluster else {
            return Err("a single node has nobody to hand a vdisk over to".into());
        };
        let work = cluster.clone();
        cluster
            .control
            .spawn(async move {
                work.hand_over(
                    vdisk,
                    shared,
                    "a node that carries its clients asked for it",
                )
                .await
            })
            .await
            .map_err(|e| format!("handing over failed: {e}"))?
    }

    /// Restores a replicated vdisk's copy count (the curator, `crate::curator`): claims it
    /// again, which renews its copy set (copies on nodes that are down replaced) and
    /// resynchronizes the new copies while it serves, and waits for that resync; with
    /// `release`, gives the claim up afterwards (nobody owned the vdisk, and nobody asked
    /// this node to serve it).
    pub async fn restore_copies(
        &self,
        engine: &NodeEngine,
        name: &str,
        release: bool,
    ) -> Result<(), String> {
        let Some(cluster) = &self.cluster else {
            return Ok(());
        };
        learn(engine, name).await;
        let wanted = Wanted::of(engine, name).map_err(|e| e.message)?;
        let shared = engine.vdisk_shared(name).map_err(|e| e.to_string())?;
        let vdisk = wanted.vdisk;
        cluster
            .on_control(move |cluster| async move {
                let frontend = lock(&cluster.held)
                    .get(&vdisk)
                    .map_or(Frontend::Nbd, |held| held.frontend);
                wanted.gate.close();
                cluster.claim(wanted, frontend).await?;
                // The claim serves at once; the copies are restored when its resync ends.
                cluster
                    .replication
                    .wait_resynced(vdisk)
                    .await
                    .map_err(NotServing::for_now)?;
                if release {
                    cluster
                        .hand_over(vdisk, shared, "its copies are restored")
                        .await
                        .map_err(NotServing::for_now)?;
                }
                Ok(())
            })
            .await
            .map_err(|e: NotServing| e.message)?;
        if release {
            let _ = engine.set_replicator(name, None);
        }
        Ok(())
    }

    /// Drops this node's data of `vdisk`, which the copy set left behind as of owner `epoch`
    /// (`crate::trim`), unless this node holds or is making a claim of it (claims and
    /// trims take turns). False when nothing was removed.
    pub async fn trim_copy(&self, vdisk: VdiskId, epoch: u64) -> Result<bool, String> {
        let Some(cluster) = &self.cluster else {
            return Ok(false);
        };
        let _one_at_a_time = cluster.claiming.lock().await;
        if lock(&cluster.held).contains_key(&vdisk) {
            return Ok(false);
        }
        cluster.replication.trim_copy(vdisk, epoch).await
    }

    /// Makes sure this node may serve every vdisk of a volume group (an iSCSI target's
    /// LUNs, `names` in LUN order), claiming those it must, or says which node serves the
    /// group instead. Called from any runtime.
    pub async fn ensure_serving_group(
        &self,
        engine: &NodeEngine,
        names: &[String],
    ) -> Result<(), GroupNotServed> {
        let Some(cluster) = &self.cluster else {
            return Ok(());
        };
        for name in names {
            learn(engine, name).await;
        }
        let wanted = names
            .iter()
            .map(|name| Wanted::of(engine, name))
            .collect::<Result<Vec<_>, _>>()?;
        if wanted.iter().all(Wanted::admitted_now) {
            return Ok(());
        }
        cluster
            .on_control(move |cluster| async move { cluster.claim_group(wanted).await })
            .await
    }

    /// Calls `listener` with every claim this node makes from now on (the vdisk and the
    /// claim's epoch: a new claim or one made again), synchronously, before the client that
    /// asked for it is served (before the vdisk's gate opens); and at once with each claim it
    /// holds now (one claim may be told twice). Nothing on a single node (no claims).
    pub fn on_claimed(&self, listener: ClaimListener) {
        let Some(cluster) = &self.cluster else {
            return;
        };
        // Added first, so a claim made meanwhile is not missed (it may be told twice).
        lock(&cluster.listeners).push(listener.clone());
        let held: Vec<(VdiskId, OwnershipEpoch)> = lock(&cluster.held)
            .values()
            .map(|held| (held.claim.vdisk, held.claim.epoch))
            .collect();
        for (vdisk, epoch) in held {
            listener(vdisk, epoch);
        }
    }

    /// Whether a node asked for a copy of `vdisk` recently, to take it over (the copy set
    /// keeps one copy more than RF for it meanwhile); false on a single node.
    pub fn copy_wished(&self, vdisk: VdiskId) -> bool {
        self.cluster
            .as_ref()
            .is_some_and(|cluster| cluster.replication.copy_wished(vdisk))
    }

    /// The claim under which this node serves `vdisk` now (its gate open): what a change
    /// of the vdisk's shared state in the metadata store (iSCSI persistent reservations) is
    /// fenced by. `Ok(None)` on a single node (nothing to fence); `Err` with the reason when
    /// this node does not serve the vdisk now (never claimed, lapsed, or taken elsewhere).
    pub fn serving_claim(&self, vdisk: VdiskId) -> Result<Option<OwnershipClaim>, String> {
        let Some(cluster) = &self.cluster else {
            return Ok(None);
        };
        match lock(&cluster.held).get(&vdisk) {
            Some(held) if held.wanted.admitted_now() => Ok(Some(held.claim.clone())),
            Some(held) => Err(format!(
                "vdisk {}: this node's ownership claim (epoch {}) is not surely valid now",
                held.wanted.name, held.claim.epoch
            )),
            None => Err(format!(
                "vdisk {vdisk}: this node holds no ownership claim of it"
            )),
        }
    }

    /// Ownership as `vdisk show` and `vdisk list` show it; `None` on a single node.
    pub async fn view(&self, vdisk: VdiskId) -> Result<Option<OwnershipView>, String> {
        let Some(cluster) = &self.cluster else {
            return Ok(None);
        };
        let state = read_ownership(&cluster.meta, vdisk)
            .await
            .map_err(|e| format!("reading ownership: {e}"))?;
        let placement = ashlar_cluster::read_placement(&cluster.meta, vdisk)
            .await
            .map_err(|e| format!("reading placement: {e}"))?;
        Ok(Some(OwnershipView {
            owner: state.owner.as_ref().map(|(owner, _)| owner.node),
            owner_epoch: state.owner.as_ref().map(|(owner, _)| owner.epoch),
            epoch: state.epoch(),
            last_owner: state.last_owner,
            copies: placement.map(|p| p.copies).unwrap_or_default(),
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
                cluster.address_of(owner.node, Frontend::Nbd).await
            )),
            _ => Ok(()),
        }
    }

    /// Failback: gives up this node's claims on `names` (a volume group's vdisks) so that
    /// another node can claim them at once. Each vdisk's gate shuts (its I/O here fails
    /// from now on), its writes in flight settle, and its owner key is deleted; the epoch
    /// stays, so the next claim raises it. A vdisk this node does not hold is skipped.
    pub async fn hand_back(
        &self,
        engine: &NodeEngine,
        names: &[String],
        why: &'static str,
    ) -> Result<(), NotServing> {
        let Some(cluster) = &self.cluster else {
            return Ok(());
        };
        let mut settling = Vec::new();
        for name in names {
            let shared = engine
                .vdisk_shared(name)
                .map_err(|e| NotServing::for_now(format!("vdisk {name}: {e}")))?;
            settling.push((name.clone(), shared));
        }
        cluster
            .on_control(move |cluster| async move {
                // No claim of these vdisks runs meanwhile (a login's or the lease follower's).
                let _one_at_a_time = cluster.claiming.lock().await;
                for (name, shared) in settling {
                    if let Err(error) = cluster.give_up(shared, why).await {
                        tracing::info!(vdisk = %name, %error, "nothing to release");
                    }
                }
                Ok(())
            })
            .await
    }

    /// After `vdisk delete`: gives up this node's claim on it, if any.
    pub async fn released(&self, vdisk: VdiskId) {
        let Some(cluster) = &self.cluster else {
            return;
        };
        if let Err(error) = ashlar_cluster::remove_placement(&cluster.meta, vdisk).await {
            tracing::warn!(%vdisk, %error, "could not remove the deleted vdisk's placement record");
        }
        // A failed resync leaves its record (`replication::resync::publish_progress`).
        crate::replication::forget_resync_progress(&cluster.meta, vdisk).await;
        let held = lock(&cluster.held).remove(&vdisk);
        if let Some(held) = held {
            held.wanted.gate.close();
            if let Err(error) = release(&cluster.meta, &held.claim).await {
                tracing::info!(vdisk = %held.wanted.name, %error, "nothing to release");
            }
        }
    }
}

impl Clustered {
    /// Runs `work` on the control runtime, where the etcd client lives, and waits for it.
    async fn on_control<F, Fut, E>(self: &Arc<Self>, work: F) -> Result<(), E>
    where
        F: FnOnce(Arc<Clustered>) -> Fut,
        Fut: Future<Output = Result<(), E>> + Send + 'static,
        E: From<NotServing> + Send + 'static,
    {
        self.control
            .spawn(work(self.clone()))
            .await
            .map_err(|e| NotServing::for_now(format!("claiming failed: {e}")))?
    }

    async fn claim(&self, wanted: Wanted, frontend: Frontend) -> Result<(), NotServing> {
        let _one_at_a_time = self.claiming.lock().await;
        if wanted.admitted_now() {
            return Ok(()); // another open claimed it meanwhile
        }
        let name = &wanted.name;
        let status = *self.lease.borrow();
        if tokio::time::Instant::now() >= status.valid_until {
            return Err(NotServing::for_now(format!(
                "vdisk {name}: this node cannot reach etcd to keep its lease, so it \
                 serves nothing now; try again when it is back"
            )));
        }
        if let Some(refused) = self.refuse_while_draining(&wanted, frontend).await {
            return Err(refused);
        }
        if let Some((at, reason)) = lock(&self.failed_claims).get(&wanted.vdisk) {
            if at.elapsed() < CLAIM_FAILURE_BACKOFF {
                return Err(NotServing::for_now(format!(
                    "{reason} (a claim failed {} ms ago; trying again shortly)",
                    at.elapsed().as_millis()
                )));
            }
        }
        match claim_to_serve(
            &self.meta,
            wanted.vdisk,
            self.node,
            status.lease,
            self.storage_only,
        )
        .await
        {
            Ok(claim) => {
                if let Err(message) = self
                    .replication
                    .prepare(name, wanted.vdisk, claim.epoch.0)
                    .await
                {
                    // Writes could not reach every copy: serve nothing, hold nothing.
                    tracing::warn!(vdisk = %name, reason = %message,
                        "claimed the vdisk but cannot serve it; claim released");
                    if let Err(error) = release(&self.meta, &claim).await {
                        tracing::info!(vdisk = %name, %error, "nothing to release");
                    }
                    lock(&self.failed_claims)
                        .insert(wanted.vdisk, (std::time::Instant::now(), message.clone()));
                    return Err(NotServing::for_now(message));
                }
                lock(&self.failed_claims).remove(&wanted.vdisk);
                self.opened(wanted, claim, frontend);
                Ok(())
            }
            Err(error) => Err(NotServing {
                message: self.refusal_text(name, &error, frontend).await,
                refusal: match error {
                    ServeError::Refused { refusal, .. } => Some(refusal),
                    ServeError::Claim(_) => None,
                },
            }),
        }
    }

    /// A node being drained claims nothing: it forwards to the owner if there is one, else
    /// refuses. `None`: not draining (or the drain record could not be read: the claim goes
    /// on, as it would have before the drain was asked).
    async fn refuse_while_draining(
        &self,
        wanted: &Wanted,
        frontend: Frontend,
    ) -> Option<NotServing> {
        if !ashlar_cluster::is_draining(&self.meta, self.node)
            .await
            .unwrap_or(false)
        {
            return None;
        }
        let name = &wanted.name;
        if let Ok(state) = read_ownership(&self.meta, wanted.vdisk).await {
            if let Some((owner, _)) = state.owner.filter(|(o, _)| o.node != self.node) {
                let refusal = ServeRefusal::OwnedElsewhere {
                    owner: owner.node,
                    epoch: owner.epoch,
                };
                let error = ServeError::Refused {
                    vdisk: wanted.vdisk,
                    refusal: refusal.clone(),
                };
                return Some(NotServing {
                    message: self.refusal_text(name, &error, frontend).await,
                    refusal: Some(refusal),
                });
            }
        }
        Some(NotServing::for_now(format!(
            "vdisk {name}: node {} is being drained (`ashlar node drain`) and claims no vdisk;              connect to another node",
            self.node
        )))
    }

    /// Gives the claim on `vdisk` up (`why` goes to the log): gate shut, writes settled,
    /// claim released in etcd.
    async fn hand_over(
        &self,
        vdisk: VdiskId,
        shared: Arc<ashlar_engine::vdisk::VdiskShared>,
        why: &str,
    ) -> Result<(), String> {
        let _one_at_a_time = self.claiming.lock().await;
        if self.give_up(shared, why).await? {
            Ok(())
        } else {
            Err(format!("vdisk {vdisk}: this node does not own it"))
        }
    }

    /// Gate shut, writes settled, claim released; false if this node held no claim. The
    /// caller holds `claiming`, so no claim of the vdisk runs meanwhile.
    async fn give_up(
        &self,
        shared: Arc<ashlar_engine::vdisk::VdiskShared>,
        why: &str,
    ) -> Result<bool, String> {
        let Some(held) = lock(&self.held).remove(&shared.id) else {
            return Ok(false);
        };
        held.wanted.gate.close();
        let name = &held.wanted.name;
        match shared.settle().await {
            Ok(()) => {
                self.replication
                    .note_release(name, &shared, held.claim.epoch.0)
                    .await
            }
            // The claim is released anyway: the next owner resynchronizes every copy from
            // its own, and this node's gate stays shut.
            Err(error) => tracing::warn!(vdisk = %name, %error, why,
                "writes in flight did not settle before the claim was released"),
        }
        release(&self.meta, &held.claim)
            .await
            .map_err(|e| format!("vdisk {name}: releasing its claim: {e}"))?;
        tracing::info!(vdisk = %name, epoch = %held.claim.epoch, why,
            "released the vdisk's claim (handed the vdisk over); another node may claim it now, and clients here are forwarded to it");
        Ok(true)
    }

    /// Claims a volume group's vdisks in LUN order, unless another node serves the group.
    /// In order, and stopping at the first refusal, so two nodes that race to claim one
    /// group never end up owning a part each: the one that wins the first LUN gets all.
    async fn claim_group(&self, wanted: Vec<Wanted>) -> Result<(), GroupNotServed> {
        let mut owners = Vec::with_capacity(wanted.len());
        for lun in &wanted {
            let state = read_ownership(&self.meta, lun.vdisk).await.map_err(|e| {
                NotServing::for_now(format!("vdisk {}: reading ownership: {e}", lun.name))
            })?;
            owners.push(state.owner.map(|(owner, _)| owner.node));
        }
        let mut owns_some = match group_placement(self.node, &owners) {
            Placement::Here { owns_some } => owns_some,
            Placement::There(node) => return Err(self.served_by(node).await),
            Placement::Split(nodes) => {
                let owners = nodes.iter().map(|node| self.describe(*node)).collect();
                return Err(GroupNotServed::Split { owners });
            }
        };
        for lun in wanted {
            match self.claim(lun, Frontend::Iscsi).await {
                Ok(()) => owns_some = true,
                // Another node claimed it since the owners were read.
                Err(NotServing {
                    refusal: Some(ServeRefusal::OwnedElsewhere { owner, .. }),
                    ..
                }) if !owns_some => return Err(self.served_by(owner).await),
                Err(refused) => return Err(refused.into()),
            }
        }
        Ok(())
    }

    async fn served_by(&self, node: NodeId) -> GroupNotServed {
        GroupNotServed::ServedBy {
            node,
            addresses: self.addresses_of(node).await,
        }
    }

    fn describe(&self, node: NodeId) -> String {
        if node == self.node {
            format!("this node {node}")
        } else {
            format!("node {node}")
        }
    }

    /// Records a fresh claim and opens its gate until its lease is surely valid.
    fn opened(&self, wanted: Wanted, claim: OwnershipClaim, frontend: Frontend) {
        let status = *self.lease.borrow();
        assert_eq!(
            claim.node, self.node,
            "a node only records claims it made itself"
        );
        // Before the gate opens: no command of a client here runs under the new claim
        // before the listeners know of it (iSCSI units served anew tell their nexuses).
        let listeners = lock(&self.listeners).clone();
        for listener in listeners {
            listener(claim.vdisk, claim.epoch);
        }
        if status.lease == claim.lease {
            wanted.gate.open_until(status.valid_until.into_std());
        }
        // Else the lease changed under the claim: the follower claims it again.
        tracing::info!(vdisk = wanted.name, epoch = %claim.epoch, lease = %claim.lease,
            "claimed vdisk ownership; serving it");
        lock(&self.held).insert(
            claim.vdisk,
            Held {
                wanted,
                claim,
                frontend,
            },
        );
    }

    async fn refusal_text(&self, name: &str, error: &ServeError, frontend: Frontend) -> String {
        match error {
            ServeError::Refused { refusal, .. } => match refusal {
                ServeRefusal::StorageOnly => format!(
                    "vdisk {name}: node {} is storage-only and never serves vdisks; connect to another node",
                    self.node
                ),
                ServeRefusal::OwnedElsewhere { owner, epoch } => format!(
                    "vdisk {name} is owned by node {owner}{} (epoch {epoch}); connect there \
                     (or to any other node, which forwards to it)",
                    self.address_of(*owner, frontend).await
                ),
                ServeRefusal::DataOnDownNode { node } => format!(
                    "vdisk {name}'s data is on node {node}{}, which is down; without \
                     replication no other node holds it. Start that node again to serve it",
                    self.address_of(*node, frontend).await
                ),
            },
            other => format!("vdisk {name}: cannot claim ownership: {other}"),
        }
    }

    /// " at HOST:PORT" (the node's advertised address for `frontend`), or nothing if unknown.
    async fn address_of(&self, node: NodeId, frontend: Frontend) -> String {
        self.addresses_of(node)
            .await
            .map(|addresses| format!(" at {}", frontend.address(&addresses)))
            .unwrap_or_default()
    }

    /// The addresses in the node's record; `None` if it cannot be read.
    async fn addresses_of(&self, node: NodeId) -> Option<AdvertisedAddresses> {
        let key = ashlar_cluster::keys::member_key(node);
        let kv = self.meta.get(&key).await.ok()??;
        ashlar_cluster::record::decode::<NodeRecord>(&kv.key, &kv.value)
            .ok()
            .map(|record| record.addresses)
    }

    /// Applies one lease status to every held claim: extend, or shut and claim again.
    async fn apply(&self, status: LeaseStatus) {
        let now_std = std::time::Instant::now();
        let now = tokio::time::Instant::from_std(now_std);
        let mut again = Vec::new();
        for held in lock(&self.held).values() {
            let gate = &held.wanted.gate;
            let open_until = gate
                .open_until_at(now_std)
                .map(tokio::time::Instant::from_std);
            let step = gate_step(held.claim.lease, open_until, &status, now);
            let extended = match step {
                GateStep::ExtendUntil(until) => gate.extend(until.into_std(), now_std),
                GateStep::Reclaim => false,
            };
            if !extended {
                gate.close();
                again.push((held.wanted.clone(), held.frontend));
            }
        }
        for (wanted, frontend) in again {
            let (name, vdisk) = (wanted.name.clone(), wanted.vdisk);
            tracing::warn!(vdisk = %name, lease = %status.lease,
                "ownership claim lapsed (lease expired or changed); claiming the vdisk again at a higher epoch");
            if let Err(refused) = self.claim(wanted, frontend).await {
                tracing::warn!(vdisk = %name, reason = %refused.message,
                    "could not claim the vdisk again; its I/O keeps failing");
                if refused.refusal.is_some() {
                    // Another node owns it now: this node is done with it.
                    lock(&self.held).remove(&vdisk);
                }
                // Else it is tried again at the next lease change (etcd answering again).
            }
        }
    }
}

/// Where a volume group can be served, from the owners of its vdisks (`None`: nobody).
#[derive(Debug, PartialEq, Eq)]
enum Placement {
    /// Here: nobody else owns any of them (`owns_some`: this node owns some already).
    Here { owns_some: bool },
    /// On that node: it owns some, this node none.
    There(NodeId),
    /// Nowhere whole: owned by more than one node (sorted).
    Split(Vec<NodeId>),
}

fn group_placement(me: NodeId, owners: &[Option<NodeId>]) -> Placement {
    let mut nodes: Vec<NodeId> = owners.iter().flatten().copied().collect();
    nodes.sort();
    nodes.dedup();
    match nodes.as_slice() {
        [] => Placement::Here { owns_some: false },
        [only] if *only == me => Placement::Here { owns_some: true },
        [only] => Placement::There(*only),
        _ => Placement::Split(nodes),
    }
}

/// Starts a vdisk another node created after this one started, so that it can be claimed
/// here. A failure is logged; the open then fails with "not found" or the engine's reason.
async fn learn(engine: &NodeEngine, name: &str) {
    if let Err(error) = engine.learn(name).await {
        tracing::warn!(vdisk = name, %error, "could not start a vdisk from the catalog");
    }
}

/// How long after a claim that could not serve the vdisk is claimed again at the earliest.
const CLAIM_FAILURE_BACKOFF: std::time::Duration = std::time::Duration::from_millis(500);

/// How long a vdisk waits between attempts to claim it again after a copy failed.
const RECLAIM_RETRY: std::time::Duration = std::time::Duration::from_secs(1);

/// Claims a vdisk again whenever one of its copies failed at the epoch this node holds it
/// at: its gate shuts (writes fail meanwhile), and the new claim fences the copies again,
/// resynchronizes them and replaces those on nodes that are down. Retried while the node
/// still holds the vdisk and nobody else took it.
async fn reclaim_after_copy_failures(
    cluster: Arc<Clustered>,
    mut failures: tokio::sync::mpsc::Receiver<CopyFailed>,
) {
    while let Some(failed) = failures.recv().await {
        // The reason of the last failed attempt: a new one is a warning, a repeat is not.
        let mut last_reason = String::new();
        loop {
            let held = lock(&cluster.held)
                .get(&failed.vdisk)
                .map(|h| (h.wanted.clone(), h.frontend, h.claim.epoch.0));
            let Some((wanted, frontend, epoch)) = held else {
                break;
            };
            if epoch != failed.epoch {
                break; // claimed again since that failure
            }
            wanted.gate.close();
            if last_reason.is_empty() {
                match failed.reason {
                    Reclaim::CopyFailed => tracing::warn!(vdisk = %wanted.name, epoch,
                        "a copy failed; claiming the vdisk again to resynchronize or replace its copies"),
                    Reclaim::CopyWanted => tracing::info!(vdisk = %wanted.name, epoch,
                        "a node carrying the vdisk's clients wants a copy; claiming the vdisk again to add it"),
                }
            }
            match cluster.claim(wanted, frontend).await {
                Ok(()) => break,
                Err(refused) if refused.refusal.is_some() => {
                    lock(&cluster.held).remove(&failed.vdisk);
                    break;
                }
                Err(refused) => {
                    if refused.message != last_reason {
                        tracing::warn!(reason = %refused.message,
                            "claiming again failed; retrying every {RECLAIM_RETRY:?}");
                        last_reason = refused.message;
                    }
                    tokio::time::sleep(RECLAIM_RETRY).await;
                }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn node(n: u128) -> NodeId {
        NodeId::new(n).unwrap()
    }

    #[test]
    fn a_group_is_served_where_its_owned_vdisks_are() {
        let (me, a, b) = (node(1), node(2), node(3));
        let here = |owns_some| Placement::Here { owns_some };
        assert_eq!(group_placement(me, &[]), here(false));
        assert_eq!(group_placement(me, &[None, None]), here(false));
        assert_eq!(group_placement(me, &[Some(me), None]), here(true));
        // Another node owns some and this one none: the whole group goes there.
        assert_eq!(
            group_placement(me, &[None, Some(a), Some(a)]),
            Placement::There(a)
        );
        // Owned here and elsewhere, or by two others: no node can serve it all.
        assert_eq!(
            group_placement(me, &[Some(a), Some(me)]),
            Placement::Split(vec![me, a])
        );
        assert_eq!(
            group_placement(me, &[Some(b), None, Some(a)]),
            Placement::Split(vec![a, b])
        );
    }
}

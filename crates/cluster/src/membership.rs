//! Cluster membership: a node registers a persistent member record and a live record on its
//! lease, keeps the lease alive, and registers again when the lease is lost. A node is up
//! while its live record exists and down once the lease took it away; its member record keeps
//! it listed, as down, until it is removed.

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use ashlar_meta::{
    Compare, KeyRange, KeyValue, LeaseId, MetaError, MetaStore, Txn, TxnOp, TxnOpResult,
};
use serde::Serialize;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::error::ClusterError;
use crate::keys;
use crate::node_id::NodeId;
use crate::record::{self, NodeRecord};

/// Default TTL of a node's lease: how long a node that stopped answering stays up.
pub const DEFAULT_NODE_LEASE_TTL: Duration = Duration::from_secs(10);
/// Default interval between rewrites of the node's records (free space changes).
pub const DEFAULT_RECORD_REFRESH_INTERVAL: Duration = Duration::from_secs(30);
/// Keep-alives per TTL: a third of a TTL apart, so two may be lost before the lease ends
/// (docs/metastore.md explains why leases should be kept alive this often).
const KEEP_ALIVES_PER_TTL: u32 = 3;

/// How a node keeps its registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MembershipConfig {
    /// TTL of the node's lease (etcd rounds it up to whole seconds, minimum 2 s by default).
    pub lease_ttl: Duration,
    /// How often the records are rewritten with fresh disk space figures.
    pub record_refresh_interval: Duration,
}

impl Default for MembershipConfig {
    fn default() -> Self {
        MembershipConfig {
            lease_ttl: DEFAULT_NODE_LEASE_TTL,
            record_refresh_interval: DEFAULT_RECORD_REFRESH_INTERVAL,
        }
    }
}

impl MembershipConfig {
    /// Time between keep-alives.
    pub fn keep_alive_interval(&self) -> Duration {
        self.lease_ttl / KEEP_ALIVES_PER_TTL
    }
}

/// The node's lease and how long it surely lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseStatus {
    pub lease: LeaseId,
    /// The lease lives at least until then: one TTL after the last grant or keep-alive that
    /// succeeded, counted from when that request was *sent* (the store restarted its TTL
    /// later than that). An owner must stop acknowledging writes past this instant unless a
    /// newer keep-alive moved it: after it, another node may own its vdisks.
    pub valid_until: Instant,
}

/// A node's registration: its lease and the record it published.
pub struct Registration<M: MetaStore> {
    store: M,
    record: NodeRecord,
    config: MembershipConfig,
    lease: watch::Sender<LeaseStatus>,
}

/// Grants a lease and writes the member and live records in one transaction.
pub async fn register<M: MetaStore>(
    store: M,
    record: NodeRecord,
    config: MembershipConfig,
) -> Result<Registration<M>, ClusterError> {
    assert!(!config.lease_ttl.is_zero(), "a node lease needs a TTL");
    let lease = publish(&store, &record, config.lease_ttl).await?;
    let (lease, _) = watch::channel(lease);
    Ok(Registration {
        store,
        record,
        config,
        lease,
    })
}

/// A new lease with both records on it.
async fn publish<M: MetaStore>(
    store: &M,
    record: &NodeRecord,
    ttl: Duration,
) -> Result<LeaseStatus, ClusterError> {
    let sent = Instant::now();
    let lease = store.grant_lease(ttl).await?;
    write_records(store, record, lease).await?;
    Ok(LeaseStatus {
        lease,
        valid_until: sent + ttl,
    })
}

async fn write_records<M: MetaStore>(
    store: &M,
    record: &NodeRecord,
    lease: LeaseId,
) -> Result<(), MetaError> {
    let value = record::encode(record);
    let txn = Txn::new().and_then([
        TxnOp::put(keys::member_key(record.node_id), value.clone(), None),
        TxnOp::put(keys::live_key(record.node_id), value, Some(lease)),
    ]);
    store.txn(txn).await.map(|_| ())
}

impl<M: MetaStore> Registration<M> {
    pub fn node_id(&self) -> NodeId {
        self.record.node_id
    }

    /// The lease the node's records (and its ownership claims) live on now.
    pub fn lease(&self) -> LeaseId {
        self.lease.borrow().lease
    }

    /// Follows the node's lease: the id changes when the node registers again after losing
    /// it (every claim made on an older lease has ended by then), and `valid_until` moves
    /// with every keep-alive.
    pub fn subscribe_lease(&self) -> watch::Receiver<LeaseStatus> {
        self.lease.subscribe()
    }

    pub fn config(&self) -> MembershipConfig {
        self.config
    }

    /// Rewrites both records (e.g. with new free space) on the current lease.
    pub async fn refresh(&mut self, record: NodeRecord) -> Result<(), MetaError> {
        assert_eq!(
            record.node_id, self.record.node_id,
            "a node's id never changes"
        );
        write_records(&self.store, &record, self.lease()).await?;
        self.record = record;
        Ok(())
    }

    /// Registers again on a new lease, after the old one was lost.
    pub async fn reregister(&mut self) -> Result<LeaseId, ClusterError> {
        let status = publish(&self.store, &self.record, self.config.lease_ttl).await?;
        self.lease.send_replace(status);
        Ok(status.lease)
    }

    /// Ends the lease now: the node is listed as down at once (its member record stays).
    pub async fn deregister(self) -> Result<(), MetaError> {
        match self.store.revoke_lease(self.lease()).await {
            Ok(()) | Err(MetaError::LeaseNotFound(_)) => Ok(()),
            Err(error) => Err(error),
        }
    }

    async fn keep_alive_once(&self) -> KeepAliveOutcome {
        let sent = Instant::now();
        match self.store.keep_alive(self.lease()).await {
            Ok(()) => {
                let valid_until = sent + self.config.lease_ttl;
                self.lease.send_modify(|status| {
                    // Answers may come back out of order across retries; never move it back.
                    status.valid_until = status.valid_until.max(valid_until);
                });
                KeepAliveOutcome::Kept
            }
            Err(MetaError::LeaseNotFound(_)) => KeepAliveOutcome::LeaseLost,
            Err(error) => KeepAliveOutcome::Failed(error.to_string()),
        }
    }
}

/// What one keep-alive found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeepAliveOutcome {
    Kept,
    /// The store no longer knows the lease (it expired while we were cut off, or etcd lost
    /// its data): the node must register again.
    LeaseLost,
    /// The store did not answer; the lease may still live.
    Failed(String),
}

/// What the keep-alive loop should do and say after an outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeepAliveStep {
    /// Nothing to do or say.
    Quiet,
    /// The store answers again after failures: say so once.
    Recovered,
    /// The store stopped answering: say so once, not at every retry.
    Unreachable(String),
    /// The lease is gone: say so and register again.
    Reregister,
}

/// The keep-alive loop's memory, as a pure state machine so that its decisions (register
/// again? log now or stay quiet?) are testable without a store or a clock.
#[derive(Debug)]
pub struct KeepAliveState {
    failing: bool,
    next_refresh: Instant,
    refresh_interval: Duration,
}

impl KeepAliveState {
    pub fn new(now: Instant, refresh_interval: Duration) -> Self {
        KeepAliveState {
            failing: false,
            next_refresh: now + refresh_interval,
            refresh_interval,
        }
    }

    pub fn observe(&mut self, outcome: &KeepAliveOutcome) -> KeepAliveStep {
        match outcome {
            KeepAliveOutcome::Kept if self.failing => {
                self.failing = false;
                KeepAliveStep::Recovered
            }
            KeepAliveOutcome::Kept => KeepAliveStep::Quiet,
            KeepAliveOutcome::LeaseLost => KeepAliveStep::Reregister,
            KeepAliveOutcome::Failed(_) if self.failing => KeepAliveStep::Quiet,
            KeepAliveOutcome::Failed(reason) => {
                self.failing = true;
                KeepAliveStep::Unreachable(reason.clone())
            }
        }
    }

    /// A registration attempt failed: the store is not answering.
    pub fn reregister_failed(&mut self, reason: &str) -> KeepAliveStep {
        self.observe(&KeepAliveOutcome::Failed(reason.to_string()))
    }

    /// A registration succeeded: the store answers, and the records are fresh.
    pub fn registered(&mut self, now: Instant) {
        self.failing = false;
        self.next_refresh = now + self.refresh_interval;
    }

    /// Whether the records are due for a rewrite; if so, the next one is scheduled.
    pub fn refresh_due(&mut self, now: Instant) -> bool {
        if now < self.next_refresh || self.failing {
            return false;
        }
        self.next_refresh = now + self.refresh_interval;
        true
    }
}

/// Keeps the registration alive until `shutdown` completes, then ends the lease. Registers
/// again when the lease is lost, and rewrites the records from `current_record` every
/// refresh interval. Logs once when the store stops answering, once when it answers again,
/// and once per lost lease.
pub async fn keep_registered<M: MetaStore>(
    mut registration: Registration<M>,
    mut current_record: impl FnMut() -> NodeRecord,
    shutdown: impl Future<Output = ()>,
) {
    let node = registration.node_id();
    let mut ticker = tokio::time::interval(registration.config.keep_alive_interval());
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut state =
        KeepAliveState::new(Instant::now(), registration.config.record_refresh_interval);
    let mut lease_lost = false;
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            _ = ticker.tick() => {}
        }
        if lease_lost {
            lease_lost = !reregister(&mut registration, &mut state).await;
            continue;
        }
        let outcome = registration.keep_alive_once().await;
        match state.observe(&outcome) {
            KeepAliveStep::Quiet => {}
            KeepAliveStep::Recovered => {
                tracing::info!(%node, lease = %registration.lease(), "metadata store answers again; node lease kept")
            }
            KeepAliveStep::Unreachable(reason) => tracing::warn!(%node, %reason,
                "cannot keep the node lease alive; retrying every {:?} (the node shows down \
                 if this lasts longer than its lease TTL)", registration.config.keep_alive_interval()),
            KeepAliveStep::Reregister => {
                tracing::warn!(%node, lease = %registration.lease(),
                    "node lease lost (etcd restarted or lost contact longer than the TTL); registering again");
                lease_lost = !reregister(&mut registration, &mut state).await;
                continue;
            }
        }
        if outcome == KeepAliveOutcome::Kept && state.refresh_due(Instant::now()) {
            if let Err(error) = registration.refresh(current_record()).await {
                tracing::debug!(%node, %error, "refreshing the node record failed; next keep-alive will tell");
            }
        }
    }
    let lease = registration.lease();
    if let Err(error) = registration.deregister().await {
        tracing::warn!(%node, %lease, %error, "could not end the node lease; the node shows down once it expires");
    }
}

/// One registration attempt; true when it worked.
async fn reregister<M: MetaStore>(
    registration: &mut Registration<M>,
    state: &mut KeepAliveState,
) -> bool {
    match registration.reregister().await {
        Ok(lease) => {
            state.registered(Instant::now());
            tracing::info!(node = %registration.node_id(), %lease, "node registered again");
            true
        }
        Err(error) => {
            if let KeepAliveStep::Unreachable(reason) = state.reregister_failed(&error.to_string())
            {
                tracing::warn!(node = %registration.node_id(), %reason,
                    "cannot register the node again; retrying");
            }
            false
        }
    }
}

/// Up while the node's lease (and so its live record) exists.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum NodeState {
    Up,
    Down,
}

/// A node as `node list` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NodeStatus {
    /// The live record when up, else the last member record.
    pub record: NodeRecord,
    pub state: NodeState,
    pub vdisks_owned: usize,
    /// An operator asked for the node to be emptied (`ashlar node drain`): it claims no
    /// vdisk and gets no new copy.
    pub draining: bool,
}

impl NodeStatus {
    /// A node with an empty record (no addresses, no disks) in `state`: for decision logic
    /// that needs only ids and states, and its tests.
    pub fn bare(node_id: NodeId, state: NodeState) -> NodeStatus {
        NodeStatus {
            record: NodeRecord {
                version: crate::record::NODE_RECORD_VERSION,
                node_id,
                addresses: Default::default(),
                storage_only: false,
                disks: Vec::new(),
                software_version: String::new(),
                started_at_unix_ms: 0,
            },
            state,
            vdisks_owned: 0,
            draining: false,
        }
    }
}

/// Every member and live node, with the vdisks each owns, read at one revision.
pub async fn list_nodes<M: MetaStore>(store: &M) -> Result<Vec<NodeStatus>, ClusterError> {
    let response = store
        .txn(Txn::new().and_then([
            TxnOp::get(keys::members()),
            TxnOp::get(keys::live_nodes()),
            TxnOp::get(keys::owners()),
            TxnOp::get(keys::drains()),
        ]))
        .await?;
    let [members, live, owners, drains] = gets::<4>(response.results)?;
    let mut draining = std::collections::BTreeSet::new();
    for kv in &drains {
        let drain: crate::drain::DrainRecord = record::decode(&kv.key, &kv.value)?;
        draining.insert(drain.node);
    }
    let mut owned: BTreeMap<NodeId, usize> = BTreeMap::new();
    for kv in &owners {
        let owner: record::OwnerRecord = record::decode(&kv.key, &kv.value)?;
        *owned.entry(owner.node_id).or_default() += 1;
    }
    let mut nodes: BTreeMap<NodeId, NodeStatus> = BTreeMap::new();
    // Live records second: they win, being the node's own current word.
    for (kvs, state) in [(members, NodeState::Down), (live, NodeState::Up)] {
        for kv in kvs {
            let record: NodeRecord = record::decode(&kv.key, &kv.value)?;
            let vdisks_owned = owned.get(&record.node_id).copied().unwrap_or(0);
            nodes.insert(
                record.node_id,
                NodeStatus {
                    draining: draining.contains(&record.node_id),
                    record,
                    state,
                    vdisks_owned,
                },
            );
        }
    }
    Ok(nodes.into_values().collect())
}

fn gets<const N: usize>(results: Vec<TxnOpResult>) -> Result<[Vec<KeyValue>; N], ClusterError> {
    let kvs: Vec<Vec<KeyValue>> = results
        .into_iter()
        .filter_map(|r| match r {
            TxnOpResult::Get { kvs } => Some(kvs),
            _ => None,
        })
        .collect();
    kvs.try_into().map_err(|_| {
        ClusterError::Meta(MetaError::InvalidArgument(
            "transaction answered the wrong number of reads".into(),
        ))
    })
}

/// What [`remove_member`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Removal {
    Removed,
    /// The node is up: stop it first (or wait for its lease to end).
    StillUp,
    NotFound,
}

/// Forgets a down node: deletes its member record, only while it has no live record.
pub async fn remove_member<M: MetaStore>(store: &M, node: NodeId) -> Result<Removal, ClusterError> {
    let txn = Txn::new()
        .when([Compare::absent(keys::live_key(node))])
        .and_then([TxnOp::delete(KeyRange::key(keys::member_key(node)))]);
    let response = store.txn(txn).await?;
    if !response.succeeded {
        return Ok(Removal::StillUp);
    }
    let deleted = response
        .results
        .iter()
        .any(|r| matches!(r, TxnOpResult::Delete { deleted } if *deleted > 0));
    Ok(if deleted {
        Removal::Removed
    } else {
        Removal::NotFound
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unreachable_is_reported_once_and_recovery_once() {
        let start = Instant::now();
        let mut state = KeepAliveState::new(start, Duration::from_secs(30));
        let failed = KeepAliveOutcome::Failed("connection refused".into());
        assert_eq!(state.observe(&KeepAliveOutcome::Kept), KeepAliveStep::Quiet);
        assert_eq!(
            state.observe(&failed),
            KeepAliveStep::Unreachable("connection refused".into())
        );
        for _ in 0..10 {
            assert_eq!(state.observe(&failed), KeepAliveStep::Quiet);
        }
        assert_eq!(
            state.observe(&KeepAliveOutcome::Kept),
            KeepAliveStep::Recovered
        );
        assert_eq!(state.observe(&KeepAliveOutcome::Kept), KeepAliveStep::Quiet);
    }

    #[test]
    fn a_lost_lease_always_asks_to_register_again() {
        let start = Instant::now();
        let mut state = KeepAliveState::new(start, Duration::from_secs(30));
        assert_eq!(
            state.observe(&KeepAliveOutcome::LeaseLost),
            KeepAliveStep::Reregister
        );
        assert_eq!(
            state.reregister_failed("refused"),
            KeepAliveStep::Unreachable("refused".into())
        );
        assert_eq!(state.reregister_failed("refused"), KeepAliveStep::Quiet);
        state.registered(start);
        assert_eq!(state.observe(&KeepAliveOutcome::Kept), KeepAliveStep::Quiet);
        assert_eq!(
            state.observe(&KeepAliveOutcome::LeaseLost),
            KeepAliveStep::Reregister
        );
    }

    #[test]
    fn records_are_refreshed_on_schedule_and_not_while_failing() {
        let start = Instant::now();
        let interval = Duration::from_secs(30);
        let mut state = KeepAliveState::new(start, interval);
        assert!(!state.refresh_due(start + Duration::from_secs(29)));
        assert!(state.refresh_due(start + interval));
        assert!(!state.refresh_due(start + interval + Duration::from_secs(1)));
        state.observe(&KeepAliveOutcome::Failed("timeout".into()));
        assert!(!state.refresh_due(start + interval * 5));
        state.observe(&KeepAliveOutcome::Kept);
        assert!(state.refresh_due(start + interval * 5));
    }

    #[test]
    fn keep_alives_come_three_per_ttl() {
        let config = MembershipConfig::default();
        assert_eq!(config.lease_ttl, Duration::from_secs(10));
        assert_eq!(
            config.keep_alive_interval(),
            Duration::from_nanos(3_333_333_333)
        );
    }
}

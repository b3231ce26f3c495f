//! Cluster mode: each iSCSI target's **preferred node**, and **failback** to it.
//!
//! - The preferred node of a target (a volume group) is the node whose login first claimed
//!   the group's vdisks: recorded once, create-if-absent, under
//!   `/ashlar/v1/iscsi-preferred/<group>` (removed with the group). It does not change when
//!   the target fails over.
//! - A login to a target that nobody owns is redirected (0x0101) to the preferred node when
//!   that is another node, up, not storage-only, and able to claim every vdisk of the group
//!   (`decide_serve`: a replicated vdisk, or one whose data is there). Otherwise the login is
//!   served where it lands, as before; so is it when the target is still unowned
//!   [`PREFERRED_CLAIM_GRACE`] after the first such redirection (the preferred node cannot
//!   claim it), so a preferred node that is up but broken does not keep the target away.
//! - With `--iscsi-failback-after-s N` (N > 0), a node serving a target whose preferred node
//!   is another one hands the target back once it has seen that node up for N seconds
//!   (the same run of it, continuously; checked every second): logins to the target wait,
//!   its sessions here end as after a logout (running commands finish and are answered, an
//!   Async Message says the connection drops, then the connections close), the vdisks'
//!   gates shut, writes in flight settle and the claims are released; the initiators' next
//!   logins are redirected to the preferred node, which claims the vdisks. Only targets
//!   whose every vdisk is replicated are handed back: an unreplicated vdisk's data is on
//!   this node only.

use super::NodeVolumeGroups;
use crate::cluster::NodeMeta;
use crate::ownership::NodeOwnership;
use crate::registry::NodeEngine;
use crate::volume_groups::VolumeGroupRecord;
use ashlar_cluster::{
    decide_serve, list_nodes, read_ownership, read_placement, NodeId, NodeState, NodeStatus,
};
use ashlar_iscsi::SessionTable;
use ashlar_meta::{Compare, KeyRange, MetaStore, Txn, TxnOp};
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Prefix of the preferred-node records, one per volume group.
pub const PREFERRED_PREFIX: &str = "/ashlar/v1/iscsi-preferred/";
const PREFERRED_RECORD_VERSION: u32 = 1;

/// How often a node looks for targets to hand back.
const CHECK_EVERY: Duration = Duration::from_secs(1);
/// Longest a hand-back waits for a target's sessions to end (their running commands get
/// 30 s to finish, then the connection closes anyway).
const SESSIONS_END_WAIT: Duration = Duration::from_secs(35);
/// Longest a login waits for a hand-back of its target to finish.
const LOGIN_WAIT: Duration = Duration::from_secs(40);
/// How long after a login was first redirected to a target's preferred node that node must
/// have claimed the target; if nobody owns it by then, logins here are served here (the
/// preferred node is up but cannot serve it, or the initiators went away).
const PREFERRED_CLAIM_GRACE: Duration = Duration::from_secs(10);

/// Longest `--iscsi-failback-after-s` accepted (a day).
pub const MAX_FAILBACK_AFTER_S: u64 = 86_400;

/// The key of `group`'s preferred-node record.
pub fn preferred_key(group: &str) -> Vec<u8> {
    format!("{PREFERRED_PREFIX}{group}").into_bytes()
}

/// What the MetaStore holds for a group's preferred node (version 1 of the JSON record).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
struct PreferredRecord {
    version: u32,
    group: String,
    node: NodeId,
}

/// Why the preferred node or failback could not be worked out.
#[derive(Debug, thiserror::Error)]
pub enum FailbackError {
    #[error("metadata store: {0}")]
    Store(String),
    #[error("corrupt preferred-node record of volume group {group}: {reason}")]
    Corrupt { group: String, reason: String },
}

fn store_error(error: impl std::fmt::Display) -> FailbackError {
    FailbackError::Store(error.to_string())
}

/// The preferred node of `group`, if one was recorded.
pub async fn read_preferred<M: MetaStore>(
    meta: &M,
    group: &str,
) -> Result<Option<NodeId>, FailbackError> {
    let Some(kv) = meta.get(&preferred_key(group)).await.map_err(store_error)? else {
        return Ok(None);
    };
    let record: PreferredRecord =
        serde_json::from_slice(&kv.value).map_err(|e| FailbackError::Corrupt {
            group: group.to_string(),
            reason: e.to_string(),
        })?;
    if record.group != group || record.version != PREFERRED_RECORD_VERSION {
        return Err(FailbackError::Corrupt {
            group: group.to_string(),
            reason: format!(
                "record names group {:?}, version {}",
                record.group, record.version
            ),
        });
    }
    Ok(Some(record.node))
}

/// Records `node` as `group`'s preferred node unless one is recorded; true if this call
/// recorded it.
pub async fn record_preferred<M: MetaStore>(
    meta: &M,
    group: &str,
    node: NodeId,
) -> Result<bool, FailbackError> {
    let key = preferred_key(group);
    let record = PreferredRecord {
        version: PREFERRED_RECORD_VERSION,
        group: group.to_string(),
        node,
    };
    let value = serde_json::to_vec(&record).map_err(store_error)?;
    let response = meta
        .txn(
            Txn::new()
                .when([Compare::absent(key.clone())])
                .and_then([TxnOp::put(key, value, None)]),
        )
        .await
        .map_err(store_error)?;
    Ok(response.succeeded)
}

/// Removes `group`'s preferred-node record (the group was deleted).
pub async fn forget_preferred<M: MetaStore>(meta: &M, group: &str) -> Result<(), FailbackError> {
    meta.delete(KeyRange::key(preferred_key(group)))
        .await
        .map_err(store_error)?;
    Ok(())
}

/// What decides whether a node may claim one vdisk of a group.
#[derive(Debug, Clone, PartialEq, Eq)]
struct UnitFacts {
    owner: Option<NodeId>,
    last_owner: Option<NodeId>,
    copies: Vec<NodeId>,
}

/// Whether `preferred` is up, serves clients (not storage-only, not being drained), and may
/// claim every unit once nobody owns them (`units` as they would be then).
fn can_take_over(preferred: &NodeStatus, units: &[UnitFacts]) -> bool {
    preferred.state == NodeState::Up
        && !preferred.record.storage_only
        && !preferred.draining
        && units.iter().all(|unit| {
            decide_serve(
                preferred.record.node_id,
                false,
                None,
                unit.last_owner,
                &unit.copies,
            )
            .is_ok()
        })
}

/// Where a login at `me` to a group nobody owns goes: to `preferred` if that is another node
/// that can take the group; `None` to serve it where it landed (or let the owner rule
/// decide, when somebody owns a vdisk of it).
fn login_goes_to(
    me: NodeId,
    preferred: Option<&NodeStatus>,
    units: &[UnitFacts],
) -> Option<NodeId> {
    let preferred = preferred?;
    let node = preferred.record.node_id;
    let nobody_owns = units.iter().all(|unit| unit.owner.is_none());
    (node != me && nobody_owns && can_take_over(preferred, units)).then_some(node)
}

/// When a node saw each other node's current run up, without a gap.
#[derive(Default)]
struct UpSince {
    seen: HashMap<NodeId, (u64, Instant)>,
}

impl UpSince {
    /// Notes the nodes listed now; a node down, or started again, starts over.
    fn observe(&mut self, nodes: &[NodeStatus], now: Instant) {
        let up: HashMap<NodeId, u64> = nodes
            .iter()
            .filter(|n| n.state == NodeState::Up)
            .map(|n| (n.record.node_id, n.record.started_at_unix_ms))
            .collect();
        self.seen
            .retain(|node, (run, _)| up.get(node).is_some_and(|started| started == run));
        for (node, run) in up {
            self.seen.entry(node).or_insert((run, now));
        }
    }

    /// How long `node` has been seen up, or `None` if it is not up now.
    fn up_for(&self, node: NodeId, now: Instant) -> Option<Duration> {
        self.seen
            .get(&node)
            .map(|(_, since)| now.saturating_duration_since(*since))
    }
}

/// The node's preferred-node rule and failback.
pub struct Failback {
    meta: NodeMeta,
    node: NodeId,
    /// `None`: failback is off (`--iscsi-failback-after-s 0`).
    after: Option<Duration>,
    sessions: SessionTable,
    /// Targets being handed back: their logins wait until it is done.
    handing_back: Mutex<HashSet<String>>,
    handed_back: tokio::sync::Notify,
    /// Targets nobody owned whose logins were redirected to their preferred node, and when
    /// that began (see [`PREFERRED_CLAIM_GRACE`]).
    redirected: Mutex<HashMap<String, Instant>>,
}

impl Failback {
    pub fn new(
        meta: NodeMeta,
        node: NodeId,
        after: Option<Duration>,
        sessions: SessionTable,
    ) -> Self {
        Failback {
            meta,
            node,
            after,
            sessions,
            handing_back: Mutex::new(HashSet::new()),
            handed_back: tokio::sync::Notify::new(),
            redirected: Mutex::new(HashMap::new()),
        }
    }

    pub fn enabled(&self) -> bool {
        self.after.is_some()
    }

    fn handing_back(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.handing_back.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn redirected(&self) -> std::sync::MutexGuard<'_, HashMap<String, Instant>> {
        self.redirected.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits while `target` is being handed back (bounded), so that a login made meanwhile
    /// is decided once the claims are released.
    pub async fn wait_hand_back(&self, target: &str) {
        let deadline = tokio::time::Instant::now() + LOGIN_WAIT;
        loop {
            let done = self.handed_back.notified();
            tokio::pin!(done);
            done.as_mut().enable();
            if !self.handing_back().contains(target) {
                return;
            }
            if tokio::time::timeout_at(deadline, done).await.is_err() {
                tracing::warn!(%target, waited = ?LOGIN_WAIT,
                    "iSCSI login waited for the target's hand-back too long; deciding anyway");
                return;
            }
        }
    }

    /// The facts that decide who may claim each vdisk of `group`; `None` if a vdisk is
    /// unknown here.
    async fn units(
        &self,
        engine: &NodeEngine,
        group: &VolumeGroupRecord,
    ) -> Result<Option<Vec<UnitFacts>>, FailbackError> {
        let mut units = Vec::with_capacity(group.disks.len());
        for name in &group.disks {
            let _ = engine.learn(name).await;
            let Ok(info) = engine.vdisk(name) else {
                return Ok(None);
            };
            let state = read_ownership(&self.meta, info.id)
                .await
                .map_err(store_error)?;
            let copies = read_placement(&self.meta, info.id)
                .await
                .map_err(store_error)?
                .map(|p| p.copies)
                .unwrap_or_default();
            units.push(UnitFacts {
                owner: state.owner.map(|(owner, _)| owner.node),
                last_owner: state.last_owner,
                copies,
            });
        }
        Ok(Some(units))
    }

    /// At a login to `group`'s target, which this node does not serve now: the preferred
    /// node and its iSCSI portal, if the login goes there (see the module notes).
    pub async fn login_redirect(
        &self,
        engine: &NodeEngine,
        group: &VolumeGroupRecord,
    ) -> Result<Option<(NodeId, String)>, FailbackError> {
        let Some(preferred) = read_preferred(&self.meta, &group.name).await? else {
            return Ok(None);
        };
        if preferred == self.node {
            return Ok(None);
        }
        let nodes = list_nodes(&self.meta).await.map_err(store_error)?;
        let Some(status) = nodes.iter().find(|n| n.record.node_id == preferred) else {
            return Ok(None);
        };
        let Some(units) = self.units(engine, group).await? else {
            return Ok(None);
        };
        let target = group.iqn();
        let mut redirected = self.redirected();
        if units.iter().any(|unit| unit.owner.is_some()) {
            redirected.remove(&target); // the owner rule decides; the preferred node claimed
            return Ok(None);
        }
        let Some(node) = login_goes_to(self.node, Some(status), &units) else {
            return Ok(None);
        };
        let since = *redirected
            .entry(target.clone())
            .or_insert_with(Instant::now);
        if since.elapsed() > PREFERRED_CLAIM_GRACE {
            redirected.remove(&target);
            tracing::warn!(%target, %preferred, grace = ?PREFERRED_CLAIM_GRACE,
                "logins to the target were redirected to its preferred node, which has not \
                 claimed it; serving the target here instead");
            return Ok(None);
        }
        Ok(Some((node, status.record.addresses.iscsi.clone())))
    }

    /// After a login claimed `group` here: makes this node its preferred node if it has none.
    pub async fn claimed(&self, group: &str) {
        // A redirection to the preferred node before this claim is history now.
        self.redirected()
            .remove(&crate::volume_groups::target_iqn(group));
        match record_preferred(&self.meta, group, self.node).await {
            Ok(true) => tracing::info!(%group, node = %self.node,
                "this node is now the iSCSI target's preferred node (the first to serve it)"),
            Ok(false) => {}
            Err(error) => tracing::warn!(%group, %error,
                "could not record the iSCSI target's preferred node; the next claim tries again"),
        }
    }

    /// Hands targets back to their preferred nodes for as long as the node runs (spawned on
    /// the control runtime when failback is on).
    pub async fn run(
        self: Arc<Self>,
        engine: Arc<NodeEngine>,
        groups: NodeVolumeGroups,
        ownership: NodeOwnership,
    ) {
        let Some(after) = self.after else {
            return;
        };
        let mut up_since = UpSince::default();
        // Groups already reported as not handed back, so the reason is logged once.
        let mut kept: HashSet<String> = HashSet::new();
        let mut last_error = String::new();
        loop {
            tokio::time::sleep(CHECK_EVERY).await;
            let served = served_here(&engine, &groups);
            if served.is_empty() {
                up_since = UpSince::default();
                continue;
            }
            let checked = self
                .check(&engine, &served, after, &mut up_since, &mut kept)
                .await;
            let due = match checked {
                Ok(due) => {
                    last_error.clear();
                    due
                }
                Err(error) => {
                    let error = error.to_string();
                    if error != last_error {
                        tracing::warn!(%error, "cannot check iSCSI targets for failback; retrying");
                        last_error = error;
                    }
                    continue;
                }
            };
            for (group, preferred, up_for) in due {
                self.hand_back(&engine, &ownership, &group, preferred, up_for)
                    .await;
            }
        }
    }

    /// The served groups due to go back to their preferred node now, with that node and how
    /// long it has been up.
    async fn check(
        &self,
        engine: &NodeEngine,
        served: &[VolumeGroupRecord],
        after: Duration,
        up_since: &mut UpSince,
        kept: &mut HashSet<String>,
    ) -> Result<Vec<(VolumeGroupRecord, NodeId, Duration)>, FailbackError> {
        let mut elsewhere = Vec::new();
        for group in served {
            match read_preferred(&self.meta, &group.name).await? {
                Some(preferred) if preferred != self.node => elsewhere.push((group, preferred)),
                _ => {}
            }
        }
        if elsewhere.is_empty() {
            *up_since = UpSince::default();
            return Ok(Vec::new());
        }
        let nodes = list_nodes(&self.meta).await.map_err(store_error)?;
        let now = Instant::now();
        up_since.observe(&nodes, now);
        let mut due = Vec::new();
        for (group, preferred) in elsewhere {
            let Some(up_for) = up_since.up_for(preferred, now) else {
                continue;
            };
            if up_for < after {
                continue;
            }
            let Some(status) = nodes.iter().find(|n| n.record.node_id == preferred) else {
                continue;
            };
            let Some(mut units) = self.units(engine, group).await? else {
                continue;
            };
            // As they will be once this node has released them.
            for unit in &mut units {
                unit.owner = None;
                unit.last_owner = Some(self.node);
            }
            if can_take_over(status, &units) {
                kept.remove(&group.name);
                due.push((group.clone(), preferred, up_for));
            } else if kept.insert(group.name.clone()) {
                tracing::info!(group = %group.name, %preferred,
                    "iSCSI target not handed back to its preferred node: that node could not \
                     claim every vdisk of it (an unreplicated vdisk's data is on this node only)");
            }
        }
        Ok(due)
    }

    /// Moves `group`'s target back to `preferred`: logins wait, sessions end, claims go.
    async fn hand_back(
        &self,
        engine: &NodeEngine,
        ownership: &NodeOwnership,
        group: &VolumeGroupRecord,
        preferred: NodeId,
        up_for: Duration,
    ) {
        let target = group.iqn();
        self.handing_back().insert(target.clone());
        self.redirected().remove(&target);
        let told = self.sessions.end_target(&target);
        tracing::info!(%target, %preferred, up_for_s = up_for.as_secs(), sessions = told,
            "failback: the target's preferred node is up; handing the target back to it \
             (its sessions here end and their initiators log in again)");
        let deadline = Instant::now() + SESSIONS_END_WAIT;
        while self.sessions.live_sessions_of(&target) > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let left = self.sessions.live_sessions_of(&target);
        if left > 0 {
            tracing::warn!(%target, sessions = left, waited = ?SESSIONS_END_WAIT,
                "failback: sessions still open; releasing the target anyway (their I/O fails with NOT READY)");
        }
        match ownership
            .hand_back(
                engine,
                &group.disks,
                "failback: handed back to the target's preferred node",
            )
            .await
        {
            Ok(()) => tracing::info!(%target, %preferred,
                "failback: target handed back; logins here are redirected to its preferred node"),
            Err(error) => tracing::warn!(%target, %error,
                "failback: could not release the target's vdisks; logins decide again"),
        }
        self.handing_back().remove(&target);
        self.handed_back.notify_waiters();
    }
}

/// The groups whose every vdisk this node serves now (gates open).
fn served_here(engine: &NodeEngine, groups: &NodeVolumeGroups) -> Vec<VolumeGroupRecord> {
    let now = Instant::now();
    groups
        .list()
        .into_iter()
        .filter(|group| {
            !group.disks.is_empty()
                && group.disks.iter().all(|name| {
                    engine
                        .serve_gate(name)
                        .is_ok_and(|(_, gate)| gate.admits(now))
                })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use ashlar_cluster::{AdvertisedAddresses, NodeRecord, NODE_RECORD_VERSION};

    fn id(n: u128) -> NodeId {
        NodeId::new(n).unwrap()
    }

    fn status(n: u128, state: NodeState, storage_only: bool, started: u64) -> NodeStatus {
        NodeStatus {
            record: NodeRecord {
                version: NODE_RECORD_VERSION,
                node_id: id(n),
                addresses: AdvertisedAddresses {
                    nbd: format!("10.0.0.{n}:10809"),
                    iscsi: format!("10.0.0.{n}:3260"),
                    http: format!("10.0.0.{n}:8080"),
                    node: format!("10.0.0.{n}:7100"),
                },
                storage_only,
                disks: Vec::new(),
                software_version: "test".into(),
                started_at_unix_ms: started,
            },
            state,
            vdisks_owned: 0,
            draining: false,
        }
    }

    fn unit(owner: Option<u128>, last: Option<u128>, copies: &[u128]) -> UnitFacts {
        UnitFacts {
            owner: owner.map(id),
            last_owner: last.map(id),
            copies: copies.iter().copied().map(id).collect(),
        }
    }

    #[test]
    fn a_login_nobody_serves_goes_to_the_preferred_node_if_it_can_take_the_group() {
        let (me, b) = (id(1), id(2));
        let up = status(2, NodeState::Up, false, 5);
        let replicated = [unit(None, Some(1), &[1, 3])];
        assert_eq!(login_goes_to(me, Some(&up), &replicated), Some(b));
        // Unreplicated with its data here: B cannot claim it.
        assert_eq!(
            login_goes_to(me, Some(&up), &[unit(None, Some(1), &[])]),
            None
        );
        // Unreplicated with its data on B (or never claimed): B can.
        assert_eq!(
            login_goes_to(me, Some(&up), &[unit(None, Some(2), &[])]),
            Some(b)
        );
        assert_eq!(
            login_goes_to(me, Some(&up), &[unit(None, None, &[])]),
            Some(b)
        );
        // Somebody owns a vdisk: the owner rule decides, not this one.
        assert_eq!(
            login_goes_to(me, Some(&up), &[unit(Some(3), Some(3), &[3, 1])]),
            None
        );
        // Down, storage-only, no preferred node, or this node itself: served here.
        let down = status(2, NodeState::Down, false, 5);
        assert_eq!(login_goes_to(me, Some(&down), &replicated), None);
        let mut drained = status(2, NodeState::Up, false, 5);
        drained.draining = true;
        assert!(!can_take_over(&drained, &[]));
        let storage = status(2, NodeState::Up, true, 5);
        assert_eq!(login_goes_to(me, Some(&storage), &replicated), None);
        assert_eq!(login_goes_to(me, None, &replicated), None);
        let mine = status(1, NodeState::Up, false, 5);
        assert_eq!(login_goes_to(me, Some(&mine), &replicated), None);
    }

    #[test]
    fn a_node_counts_as_up_since_it_was_first_seen_up_in_this_run() {
        let start = Instant::now();
        let later = |s| start + Duration::from_secs(s);
        let mut seen = UpSince::default();
        seen.observe(&[status(2, NodeState::Up, false, 100)], start);
        assert_eq!(seen.up_for(id(2), later(3)), Some(Duration::from_secs(3)));
        assert_eq!(seen.up_for(id(3), later(3)), None);
        // Still the same run: the time counts on.
        seen.observe(&[status(2, NodeState::Up, false, 100)], later(5));
        assert_eq!(seen.up_for(id(2), later(6)), Some(Duration::from_secs(6)));
        // Restarted between two looks (a new run): it starts over.
        seen.observe(&[status(2, NodeState::Up, false, 200)], later(7));
        assert_eq!(seen.up_for(id(2), later(8)), Some(Duration::from_secs(1)));
        // Down: forgotten; up again: starts over.
        seen.observe(&[status(2, NodeState::Down, false, 200)], later(9));
        assert_eq!(seen.up_for(id(2), later(9)), None);
        seen.observe(&[status(2, NodeState::Up, false, 200)], later(10));
        assert_eq!(seen.up_for(id(2), later(12)), Some(Duration::from_secs(2)));
    }

    #[tokio::test]
    async fn the_preferred_node_is_recorded_once() {
        let dir = tempfile::tempdir().unwrap();
        let meta = ashlar_meta::EmbeddedMetaStore::open(&dir.path().join("meta.redb")).unwrap();
        assert_eq!(read_preferred(&meta, "db").await.unwrap(), None);
        assert!(record_preferred(&meta, "db", id(2)).await.unwrap());
        assert!(!record_preferred(&meta, "db", id(3)).await.unwrap(), "kept");
        assert_eq!(read_preferred(&meta, "db").await.unwrap(), Some(id(2)));
        forget_preferred(&meta, "db").await.unwrap();
        assert_eq!(read_preferred(&meta, "db").await.unwrap(), None);
    }
}

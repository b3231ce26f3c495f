//! Replicated writes between the nodes of a cluster (docs/replication.md).
//!
//! - `wire`: the replication messages inside node-to-node payloads.
//! - `peers`: connections to other nodes over `ashlar-transport`.
//! - `sender`: the owner's [`ashlar_engine::replication::Replicator`] for one vdisk.
//! - `receiver`: the replica's control loop: fences and trims, and the verdict on records
//!   an intake refused.
//! - `intake`: one loop per reactor that applies the records of its shards, in order,
//!   behind the fence (`stream_order` is its pure bookkeeping).
//! - `fence`: the highest owner epoch seen per vdisk, kept on disk.
//!
//! [`NodeReplication::prepare`] runs when this node claims a vdisk, before its gate opens:
//! with RF > 1 it settles the vdisk's copy set (copies on nodes that are down are replaced
//! by other live nodes), fences every other copy at the claim's epoch, makes them equal to
//! this node's copy (`resync`) and installs the replicator; a copy node that cannot be
//! reached refuses the claim, since no write could be acknowledged.

mod catch_up;
mod digest;
mod fence;
mod intake;
mod pacer;
mod peers;
mod push;
mod receiver;
mod resync;
mod sender;
mod stream_order;
mod unreachable;
pub mod wire;

use crate::args::NodeArgs;
use crate::cluster::NodeMeta;
use crate::forwarding::ForwardServer;
use crate::registry::NodeEngine;
use anyhow::{anyhow, bail, Context, Result};
use ashlar_cluster::{
    choose_copies, list_nodes, mark_placement_synced, read_placement, read_placement_revision,
    record_in_sync_release, record_placement, renew_copies, replace_placement, InSyncRelease,
    NodeId, NodeState, NodeStatus, PlacementRecord, ResyncRecord, RESYNC_RECORD_VERSION,
};
use ashlar_core::VdiskId;
use ashlar_engine::reactor::ReactorId;
use ashlar_meta::{Compare, MetaStore, Txn, TxnOp};
use ashlar_transport::{
    handler_fn, ClusterSecret, LanePlacer, PlacedServing, Server, TcpTransport, Transport,
    TransportConfig, TransportLimits,
};
use peers::Peers;
pub use peers::{transport_id, Peer};
use receiver::ReplicaReceiver;
pub use resync::{forget_progress as forget_resync_progress, unix_ms};
use sender::{replica_error, PeerReplicator};
pub use sender::{CopyFailed, Reclaim};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use wire::Message;

/// How long a node holding a copy may take to send all of it to a claimant without one.
pub const PUSH_TIMEOUT: Duration = Duration::from_secs(3600);
/// How long a replica may take to make one record durable before the write fails.
pub const REPLICA_TIMEOUT: Duration = Duration::from_secs(5);
/// Copy failures queued for the ownership layer (one per vdisk and epoch is enough; more are
/// dropped).
pub const COPY_FAILURE_QUEUE_LIMIT: usize = 64;
/// Default of `--hand-over-copy-keep-s`: how long a node's wish for a copy (it asked to
/// take a vdisk over without one) is kept after its last ask; claims meanwhile add it to
/// the copy set, and the curator drops that copy once the wish is gone.
pub const DEFAULT_COPY_WISH_KEEP: Duration = Duration::from_secs(300);
/// Nodes' wishes for copies kept at once; more are refused (the asker is told to wait).
pub const COPY_WISHES_LIMIT: usize = 1024;

/// The node's replication: its node-to-node server and its peers.
pub struct NodeReplication {
    node: NodeId,
    engine: Arc<NodeEngine>,
    meta: NodeMeta,
    peers: Arc<Peers>,
    failed: mpsc::Sender<CopyFailed>,
    /// This node's own receiver: a claim fences it too, so no record of an older owner is
    /// applied here once this node serves the vdisk.
    receiver: ReplicaReceiver,
    /// Runs requests other nodes forward to this one.
    forward: Arc<ForwardServer>,
    /// Taken once by the ownership layer, which claims a vdisk again when a copy failed.
    failures: std::sync::Mutex<Option<mpsc::Receiver<CopyFailed>>>,
    /// The online resync of each vdisk's last claim here: its epoch and its outcome once
    /// ended (one entry per vdisk ever claimed here, replaced by each claim).
    resyncs: std::sync::Mutex<HashMap<VdiskId, ResyncOutcome>>,
    /// `--resync-max-mib-s` and `--resync-latency-percent`.
    pacing: pacer::Pacing,
    /// What this node's claims of each replicated vdisk did (`catch_up`).
    tracks: Arc<std::sync::Mutex<catch_up::Tracks>>,
    /// Per vdisk, a node that asked to take it over without a complete copy, and when it
    /// last asked: this node's claims add it to the copy set, so it gets one while the
    /// vdisk serves.
    copy_wishes: std::sync::Mutex<HashMap<VdiskId, (NodeId, std::time::Instant)>>,
    /// `--hand-over-copy-keep-s`: how long a wish is kept after the node's last ask.
    copy_wish_keep: Duration,
    /// Copies this node's claims could not fence, and since when (`unreachable`).
    unreachable: std::sync::Mutex<unreachable::UnreachableCopies>,
    /// `--replace-unreachable-copy-after-s` (`None`: 0, never).
    replace_unreachable_after: Option<Duration>,
    _server: Server,
}

impl NodeReplication {
    /// Starts serving node-to-node traffic on `--node-listen` (cluster mode only).
    pub async fn start(
        args: &NodeArgs,
        node: NodeId,
        meta: NodeMeta,
        engine: Arc<NodeEngine>,
    ) -> Result<NodeReplication> {
        let secret = cluster_secret(args, &meta).await?;
        let config = TransportConfig::new(transport_id(node), secret, TransportLimits::default());
        let mut transport = TcpTransport::new(config);
        if let Some(file) = &args.test_net_faults {
            let faults = ashlar_transport::OutgoingFaults::new(random_seed()?);
            crate::net_faults::follow(file.clone(), faults.clone());
            transport = transport.with_faults(faults);
        }
        let transport = Arc::new(transport);
        let receiver = ReplicaReceiver::start(engine.clone(), &args.data_dir);
        let peers = Arc::new(Peers::new(transport.clone()));
        let forward = Arc::new(ForwardServer::new(engine.clone()));
        let services = Arc::new(push::Services {
            engine: engine.clone(),
            forward: forward.clone(),
            receiver: receiver.clone(),
            peers: peers.clone(),
        });
        let handler = handler_fn(move |peer, payload| {
            let services = services.clone();
            async move { services.serve(peer, payload).await }
        });
        let placer: Arc<dyn LanePlacer> = Arc::new(OnReactors(engine.clone()));
        let server = transport
            .serve_placed(args.node_listen, handler, Some(placer))
            .await
            .with_context(|| {
                format!(
                "cannot listen for other nodes on {} (choose another address with --node-listen)",
                args.node_listen
            )
            })?;
        let (failed, failures) = mpsc::channel(COPY_FAILURE_QUEUE_LIMIT);
        Ok(NodeReplication {
            node,
            engine,
            meta,
            peers,
            failed,
            receiver,
            forward,
            failures: std::sync::Mutex::new(Some(failures)),
            resyncs: std::sync::Mutex::new(HashMap::new()),
            pacing: pacer::Pacing {
                busy_cap: (args.resync_max_mib_s > 0).then_some(args.resync_max_mib_s << 20),
                latency_limit_percent: args.resync_latency_percent,
            },
            tracks: Arc::default(),
            copy_wishes: std::sync::Mutex::new(HashMap::new()),
            copy_wish_keep: Duration::from_secs(args.hand_over_copy_keep_s),
            unreachable: std::sync::Mutex::default(),
            replace_unreachable_after: (args.replace_unreachable_copy_after_s > 0)
                .then(|| Duration::from_secs(args.replace_unreachable_copy_after_s)),
            _server: server,
        })
    }

    /// Lets forwarders ask this node to hand vdisks over (once the ownership layer exists).
    pub fn set_ownership(&self, ownership: crate::ownership::NodeOwnership) {
        self.forward.set_ownership(ownership);
    }

    /// Drops this node's data of `vdisk`, not one of its copies as of owner `epoch`
    /// (`crate::trim`); false if a newer owner fenced this node or a client has it open.
    pub async fn trim_copy(&self, vdisk: VdiskId, epoch: u64) -> Result<bool, String> {
        self.receiver.trim(vdisk, epoch).await
    }

    /// The connection to `node` at its node-to-node `address` (made on first use).
    pub fn peer(&self, node: NodeId, address: SocketAddr) -> Arc<Peer> {
        self.peers.peer(node, address)
    }

    /// The copy failures of the vdisks this node owns, for the one task that claims them
    /// again; `None` after the first call.
    pub fn take_failures(&self) -> Option<mpsc::Receiver<CopyFailed>> {
        self.failures
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }

    /// Makes vdisk `name` ready to take writes at ownership `epoch`: nothing to do with one
    /// copy that never moved (no copy set recorded: its data is on its last owner); else its
    /// copy set is settled, every other copy fenced and the replicator installed. The error
    /// is the line a refused client is shown.
    pub async fn prepare(&self, name: &str, vdisk: VdiskId, epoch: u64) -> Result<(), String> {
        let info = self.engine.vdisk(name).map_err(|e| e.to_string())?;
        let rf = info.replication_factor;
        if rf <= 1 && !self.has_placement(name, vdisk).await? {
            self.serve_single_copy(name, vdisk);
            return Ok(());
        }
        let consecutive = lock(&self.tracks).claim(vdisk, epoch);
        let nodes = list_nodes(&self.meta)
            .await
            .map_err(|e| format!("vdisk {name}: listing nodes: {e}"))?;
        let (previous, copies) = self.copy_set(name, vdisk, epoch, rf, &nodes).await?;
        lock(&self.unreachable).forget(vdisk, |n| copies.contains(&n));
        // A claimant that holds no complete copy (its client moved here, every copy holder
        // that could serve is down or storage-only, or its own copy was still being filled)
        // first gets one from a node that holds a complete one.
        let source = match &previous {
            Some(previous) if !previous.holds_complete_copy(self.node) => {
                let found = previous.copies.iter().copied().find(|n| {
                    *n != self.node && copies.contains(n) && previous.holds_complete_copy(*n)
                });
                Some(found.ok_or_else(|| no_complete_copy_up(name, previous))?)
            }
            _ => None,
        };
        let mut peers = Vec::new();
        for copy in copies.iter().filter(|n| **n != self.node) {
            let address = copy_address(name, *copy, &nodes)?;
            peers.push(self.peers.peer(*copy, address));
        }
        let fence_message = Message::Fence { vdisk, epoch };
        let fence = wire::encode(&fence_message);
        self.receiver.handle(fence_message).await.map_err(|e| {
            format!("vdisk {name}: fencing this node's own copy at epoch {epoch}: {e}")
        })?;
        // Each copy answers once the records of older owners it took are applied.
        let mut identities = Vec::new();
        for peer in &peers {
            let answer = match peer.call(fence.clone(), REPLICA_TIMEOUT).await {
                Ok(answer) => {
                    lock(&self.unreachable).answered(vdisk, peer.node());
                    answer
                }
                Err(error) => {
                    lock(&self.unreachable).failed(vdisk, peer.node(), Instant::now());
                    return Err(format!(
                        "vdisk {name} keeps {rf} copies and writes need every one: {}",
                        replica_error(peer.node(), vdisk, error)
                    ));
                }
            };
            identities.push((peer.node(), wire::decode_fence_answer(&answer)));
        }
        let shared = self.engine.vdisk_shared(name).map_err(|e| e.to_string())?;
        // Writes still on their way (the last owner's records this node was applying, or
        // this node's own before its gate shut) finish first.
        shared
            .settle()
            .await
            .map_err(|e| format!("vdisk {name}: waiting for writes in flight: {e}"))?;
        // What failed writes touched since the last claim: with the gate shut and the shards
        // settled, nothing is added until the replicator below is installed.
        let missed = shared
            .take_unreplicated()
            .await
            .map_err(|e| format!("vdisk {name}: {e}"))?;
        let size_bytes = shared.size_bytes.load(std::sync::atomic::Ordering::Relaxed);
        let released_in_sync = source.is_none()
            && previous
                .as_ref()
                .and_then(|p| p.released_in_sync.as_ref())
                .is_some_and(|release| {
                    let mut holders = vec![(self.node, Some(shared.copy_identity))];
                    holders.extend(identities.iter().copied());
                    catch_up::in_sync_since_release(release, epoch, size_bytes, &holders)
                });
        if released_in_sync {
            tracing::info!(vdisk = name, epoch,
                "the previous owner released the vdisk with every copy in sync, and every copy is as it left them: nothing to compare");
        }
        let found = catch_up::ClaimFound {
            epoch,
            copies: identities,
            size_bytes,
            set_changed: previous
                .as_ref()
                .is_none_or(|p| p.copies != copies || !p.filling.is_empty() || source.is_some()),
        };
        let catch_up = {
            let mut tracks = lock(&self.tracks);
            let catch_up = tracks.may_catch_up(vdisk, consecutive, &found);
            tracks.resync_started(vdisk, &found, previous.is_none());
            if released_in_sync {
                Some(Vec::new())
            } else {
                catch_up.then_some(missed).flatten()
            }
        };
        if let Some(source) = source {
            self.pull(name, vdisk, epoch, source, &nodes).await?;
        }
        if copies == [self.node] {
            // RF 1, its one copy here (moved here, `keep_a_complete_copy`): nobody to
            // replicate to or resync.
            self.serve_single_copy(name, vdisk);
            if let Err(error) = mark_placement_synced(&self.meta, vdisk, &copies, epoch).await {
                tracing::warn!(vdisk = name, %error, "could not record the copy set as complete");
            }
            return Ok(());
        }
        assert_eq!(
            peers.len() + 1,
            copies.len(),
            "every other copy takes every write"
        );
        // A repair reads from copies complete at the claim only, until the resync ended.
        let peers = peers
            .into_iter()
            .map(|peer| {
                let complete = previous
                    .as_ref()
                    .is_none_or(|p| p.holds_complete_copy(peer.node()));
                (peer, complete)
            })
            .collect();
        let resynced = Arc::new(std::sync::atomic::AtomicBool::new(previous.is_none()));
        let replicator = PeerReplicator::new(
            epoch,
            peers,
            REPLICA_TIMEOUT,
            self.failed.clone(),
            resynced.clone(),
        );
        self.engine
            .set_replicator(name, Some(Box::new(replicator)))
            .map_err(|e| e.to_string())?;
        if previous.is_none() {
            // The first claim: no copy holds anything yet, so every copy is complete.
            if let Err(error) = mark_placement_synced(&self.meta, vdisk, &copies, epoch).await {
                tracing::warn!(vdisk = name, %error, "could not record the new copy set as complete");
            }
            return Ok(());
        }
        // Every write from now on reaches every copy; what they held before is made equal
        // to this node's in the background, chunk by chunk, while the vdisk serves.
        self.start_online_resync(OnlineResync {
            name: name.to_string(),
            vdisk,
            epoch,
            shared,
            copies,
            chunks: resync::ResyncChunks::new(size_bytes, catch_up),
            all_complete: resynced,
        })
        .await;
        Ok(())
    }

    /// Called when this node gives its claim at `epoch` up, its gate shut and its writes
    /// settled: if every copy held all of the claim's writes (its resync completed, no write
    /// failed since), records that in the placement, so that the next owner compares nothing.
    pub async fn note_release(
        &self,
        name: &str,
        shared: &ashlar_engine::vdisk::VdiskShared,
        epoch: u64,
    ) {
        let vdisk = shared.id;
        let Some(others) = lock(&self.tracks)
            .in_sync_at(vdisk, epoch)
            .map(<[_]>::to_vec)
        else {
            return;
        };
        match shared.take_unreplicated().await {
            Ok(Some(missed)) if missed.is_empty() => {}
            _ => {
                // Some write failed (or nobody knows): whoever claims next, this node
                // included, compares everything.
                lock(&self.tracks).forget(vdisk);
                return;
            }
        }
        let mut copies = vec![catch_up::in_sync_copy(self.node, shared.copy_identity)];
        for (node, identity) in others {
            let Some(identity) = identity else { return };
            copies.push(catch_up::in_sync_copy(node, identity));
        }
        let release = InSyncRelease {
            epoch,
            size_bytes: shared.size_bytes.load(std::sync::atomic::Ordering::Relaxed),
            copies,
        };
        match record_in_sync_release(&self.meta, vdisk, release).await {
            Ok(true) => tracing::info!(
                vdisk = name,
                epoch,
                "released with every copy in sync: the next owner compares nothing"
            ),
            Ok(false) => {}
            Err(error) => tracing::info!(vdisk = name, %error,
                "could not record that the copies are in sync; the next owner compares them"),
        }
    }

    /// Whether the vdisk has a recorded copy set (an RF 1 vdisk has one once a drain moved it).
    async fn has_placement(&self, name: &str, vdisk: VdiskId) -> Result<bool, String> {
        let placement = read_placement(&self.meta, vdisk)
            .await
            .map_err(|e| format!("vdisk {name}: reading its placement: {e}"))?;
        Ok(placement.is_some())
    }

    /// Serves the vdisk from this node's copy alone.
    fn serve_single_copy(&self, name: &str, vdisk: VdiskId) {
        lock(&self.tracks).forget(vdisk);
        lock(&self.unreachable).forget(vdisk, |_| false);
        lock(&self.resyncs).remove(&vdisk);
        let _ = self.engine.set_replicator(name, None);
    }

    /// Resyncs the other copies while the vdisk serves (`resync::resync_online`), publishing
    /// progress for `cluster status`; at the end records the set as complete, or reports a
    /// copy failure (the vdisk is claimed again).
    async fn start_online_resync(&self, resync: OnlineResync) {
        let OnlineResync {
            name,
            vdisk,
            epoch,
            shared,
            copies,
            chunks,
            all_complete,
        } = resync;
        let done = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let record = ResyncRecord {
            version: RESYNC_RECORD_VERSION,
            vdisk,
            node: self.node,
            epoch,
            total_bytes: chunks.bytes(),
            done_bytes: 0,
            started_unix_ms: resync::unix_ms(),
            updated_unix_ms: resync::unix_ms(),
        };
        // Published before the gate opens: `cluster status` never shows the vdisk in sync
        // between the claim and its resync.
        resync::put_progress(&self.meta, &record).await;
        let (finished, outcome) = tokio::sync::watch::channel(None);
        lock(&self.resyncs).insert(vdisk, (epoch, outcome));
        let meta = self.meta.clone();
        let failed = self.failed.clone();
        let pacing = self.pacing;
        let tracks = self.tracks.clone();
        tokio::spawn(async move {
            let started = std::time::Instant::now();
            let (stop, stopped) = tokio::sync::oneshot::channel();
            let publisher = tokio::spawn(resync::publish_progress(
                meta.clone(),
                record,
                done.clone(),
                stopped,
            ));
            let caught_up = chunks.is_catch_up();
            let resynced = resync::resync_online(&shared, chunks, &done, pacing).await;
            // The progress record goes last: once `cluster status` shows the vdisk in sync,
            // this node's tracks and the placement say so too.
            let outcome = match resynced {
                Ok(summary) => {
                    lock(&tracks).resync_completed(vdisk, epoch);
                    all_complete.store(true, std::sync::atomic::Ordering::SeqCst);
                    tracing::info!(vdisk = name, epoch, copies = ?names(&copies),
                        chunks_sent = summary.chunks_sent, chunks_same = summary.chunks_same,
                        data_bytes = summary.data_bytes, caught_up,
                        elapsed_ms = started.elapsed().as_millis() as u64,
                        "copies resynchronized from this node's while it served");
                    if let Err(error) = mark_placement_synced(&meta, vdisk, &copies, epoch).await {
                        tracing::warn!(vdisk = name, %error,
                            "could not record that the copies are in sync; they count as being filled until the next claim");
                    }
                    Ok(())
                }
                Err(error) => {
                    tracing::warn!(vdisk = name, epoch, %error,
                        "resynchronizing the copies failed; the vdisk is claimed again if this node still holds it at this epoch");
                    let _ = failed.try_send(CopyFailed {
                        vdisk,
                        epoch,
                        reason: Reclaim::CopyFailed,
                    });
                    Err(error)
                }
            };
            let _ = stop.send(outcome.is_ok());
            let _ = publisher.await;
            let _ = finished.send(Some(outcome));
        });
    }

    /// Waits until the online resync of `vdisk` started by this node's last claim of it has
    /// ended; its error if it failed. `Ok` if none was started.
    pub async fn wait_resynced(&self, vdisk: VdiskId) -> Result<(), String> {
        let Some((_, mut outcome)) = lock(&self.resyncs).get(&vdisk).cloned() else {
            return Ok(());
        };
        loop {
            if let Some(result) = outcome.borrow_and_update().clone() {
                return result;
            }
            if outcome.changed().await.is_err() {
                return Err(format!("vdisk {vdisk}: its resync stopped"));
            }
        }
    }

    /// The copy set to serve with: chosen and recorded at the vdisk's first claim; at later
    /// claims the recorded one, with this node first and copies on down nodes (or
    /// unreachable for long, `renew`) replaced (new copies recorded as being filled). Also
    /// the record as it was before (`None` at the first claim).
    async fn copy_set(
        &self,
        name: &str,
        vdisk: VdiskId,
        epoch: u64,
        rf: u8,
        nodes: &[NodeStatus],
    ) -> Result<(Option<PlacementRecord>, Vec<NodeId>), String> {
        let recorded = read_placement_revision(&self.meta, vdisk)
            .await
            .map_err(|e| format!("vdisk {name}: reading its placement: {e}"))?;
        let Some((placement, revision)) = recorded else {
            let copies =
                choose_copies(self.node, rf, nodes).map_err(|e| format!("vdisk {name}: {e}"))?;
            let placement = record_placement(&self.meta, vdisk, copies)
                .await
                .map_err(|e| format!("vdisk {name}: recording its placement: {e}"))?;
            if !placement.copies.contains(&self.node) {
                // Another claimant recorded a set first: settle it as a later claim would.
                return Err(format!(
                    "vdisk {name}: another node placed its copies meanwhile; try again"
                ));
            }
            return Ok((None, placement.copies));
        };
        let mut renewed = self
            .renew(name, vdisk, epoch, rf, &placement, nodes)
            .await?;
        if let Some(wanted) = self.wanted_copy(vdisk, nodes) {
            if !renewed.contains(&wanted) {
                // One copy more than RF until the node takes the vdisk over; its claim
                // then drops the least preferred other copy (`renew_copies`).
                renewed.push(wanted);
            }
        }
        if !renewed.iter().any(|n| placement.holds_complete_copy(*n)) {
            // Recording this set would forget where the data is: the nodes that hold it stay
            // in the record, and the vdisk serves again once one of them is back.
            return Err(no_complete_copy_up(name, &placement));
        }
        if renewed != placement.copies {
            let filling: Vec<NodeId> = renewed
                .iter()
                .copied()
                .filter(|n| !placement.holds_complete_copy(*n))
                .collect();
            let replaced = replace_placement(&self.meta, vdisk, revision, renewed.clone(), filling)
                .await
                .map_err(|e| format!("vdisk {name}: recording its placement: {e}"))?;
            if !replaced {
                return Err(format!(
                    "vdisk {name}: its placement changed while this node claimed it; try again"
                ));
            }
            tracing::info!(vdisk = name, from = ?names(&placement.copies), to = ?names(&renewed),
                "copy set renewed (this node first, copies on nodes that are down or unreachable replaced)");
        }
        Ok((Some(placement), renewed))
    }

    /// `renew_copies` of the recorded set, which also replaces copies this node's claims
    /// could not fence for `--replace-unreachable-copy-after-s` (on nodes that are up), as
    /// if they were down: only while this node holds a complete copy, and only once each
    /// replacement answered a fence at `epoch` (else the set is renewed as without them).
    async fn renew(
        &self,
        name: &str,
        vdisk: VdiskId,
        epoch: u64,
        rf: u8,
        placement: &PlacementRecord,
        nodes: &[NodeStatus],
    ) -> Result<Vec<NodeId>, String> {
        let renew = |nodes: &[NodeStatus]| {
            renew_copies(self.node, rf, &placement.copies, &placement.filling, nodes)
                .map_err(|e| format!("vdisk {name}: {e}"))
        };
        let renewed = renew(nodes)?;
        let Some(after) = self.replace_unreachable_after else {
            return Ok(renewed);
        };
        let due: Vec<NodeId> = lock(&self.unreachable)
            .due(vdisk, Instant::now(), after)
            .into_iter()
            .filter(|n| renewed.contains(n))
            .collect();
        if due.is_empty() || !placement.holds_complete_copy(self.node) {
            return Ok(renewed);
        }
        let as_down: Vec<NodeStatus> = nodes
            .iter()
            .map(|n| {
                let mut n = n.clone();
                if due.contains(&n.record.node_id) {
                    n.state = NodeState::Down;
                }
                n
            })
            .collect();
        let replaced = match renew(&as_down) {
            Ok(replaced) => replaced,
            Err(why) => {
                tracing::warn!(vdisk = name, unreachable = ?names(&due), %why,
                    "copies unreachable for long stay: no other node can take them");
                return Ok(renewed);
            }
        };
        let fence = wire::encode(&Message::Fence { vdisk, epoch });
        for newcomer in replaced.iter().filter(|n| !renewed.contains(n)) {
            let peer = self
                .peers
                .peer(*newcomer, copy_address(name, *newcomer, nodes)?);
            if let Err(error) = peer.call(fence.clone(), REPLICA_TIMEOUT).await {
                tracing::warn!(vdisk = name, unreachable = ?names(&due), replacement = %newcomer,
                    error = %replica_error(*newcomer, vdisk, error),
                    "copies unreachable for long stay: their replacement does not answer either");
                return Ok(renewed);
            }
        }
        tracing::warn!(vdisk = name, unreachable = ?names(&due), after_s = after.as_secs(),
            "replacing copies on nodes that are up but have not answered this node's fences for long");
        Ok(replaced)
    }

    /// Whether node `asker`, which asked to take `vdisk` over (held here at `epoch`), may
    /// have it now: `None` if it holds a complete copy; else why it waits. A node outside
    /// the copy set is added to it by a new claim (the vdisk keeps serving; its online
    /// resync fills the copy), and may ask again once that copy is complete.
    pub async fn copy_before_hand_over(
        &self,
        vdisk: VdiskId,
        asker: NodeId,
        epoch: u64,
    ) -> Result<Option<String>, String> {
        let placement = read_placement(&self.meta, vdisk)
            .await
            .map_err(|e| format!("reading the placement of vdisk {vdisk}: {e}"))?;
        let Some(placement) = placement else {
            return Ok(None);
        };
        if let Some(refused) = self.note_copy_wish(vdisk, asker, &placement) {
            return refused;
        }
        if placement.copies.contains(&asker) {
            return Ok(Some(format!(
                "node {asker}'s copy is being filled while the vdisk serves; it may take the vdisk over once the copy is complete"
            )));
        }
        // A claim would not add it (`wanted_copy`): claiming again would only shut the gate.
        let nodes = list_nodes(&self.meta)
            .await
            .map_err(|e| format!("vdisk {vdisk}: listing nodes: {e}"))?;
        if !may_hold_copy(asker, &nodes) {
            return Ok(Some(format!(
                "node {asker} is not up or is being drained: it gets no copy, and the vdisk stays here"
            )));
        }
        let _ = self.failed.try_send(CopyFailed {
            vdisk,
            epoch,
            reason: Reclaim::CopyWanted,
        });
        Ok(Some(format!(
            "node {asker} holds no complete copy: it is added to the copy set and filled while the vdisk serves, then may take the vdisk over"
        )))
    }

    /// Notes that `asker` wants a copy of `vdisk`; `Some(answer)` when that is the whole
    /// answer: it holds a complete copy already (`Ok(None)`), or too many wishes are kept.
    fn note_copy_wish(
        &self,
        vdisk: VdiskId,
        asker: NodeId,
        placement: &PlacementRecord,
    ) -> Option<Result<Option<String>, String>> {
        let mut wishes = lock(&self.copy_wishes);
        if placement.holds_complete_copy(asker) {
            wishes.remove(&vdisk);
            return Some(Ok(None));
        }
        let now = std::time::Instant::now();
        let keep = self.copy_wish_keep;
        wishes.retain(|_, (_, asked)| now.duration_since(*asked) < keep);
        if wishes.len() >= COPY_WISHES_LIMIT && !wishes.contains_key(&vdisk) {
            return Some(Ok(Some(format!(
                "{COPY_WISHES_LIMIT} copies are wanted on this node's vdisks already; ask again later"
            ))));
        }
        wishes.insert(vdisk, (asker, now));
        None
    }

    /// The node that wants a copy of `vdisk` (asked within `--hand-over-copy-keep-s`), if it is up
    /// and may hold one.
    /// Whether a node asked for a copy of `vdisk` within `--hand-over-copy-keep-s` (its copy, one
    /// more than RF, is kept for it).
    pub fn copy_wished(&self, vdisk: VdiskId) -> bool {
        lock(&self.copy_wishes)
            .get(&vdisk)
            .is_some_and(|(_, asked)| asked.elapsed() < self.copy_wish_keep)
    }

    fn wanted_copy(&self, vdisk: VdiskId, nodes: &[NodeStatus]) -> Option<NodeId> {
        let (wanted, asked) = *lock(&self.copy_wishes).get(&vdisk)?;
        let usable = may_hold_copy(wanted, nodes);
        (asked.elapsed() < self.copy_wish_keep && usable && wanted != self.node).then_some(wanted)
    }

    /// Has `source` (which holds a copy and was fenced at `epoch`) resync this node from its copy.
    async fn pull(
        &self,
        name: &str,
        vdisk: VdiskId,
        epoch: u64,
        source: NodeId,
        nodes: &[NodeStatus],
    ) -> Result<(), String> {
        let address = copy_address(name, self.node, nodes)?.to_string();
        let peer = self.peers.peer(source, copy_address(name, source, nodes)?);
        let push = wire::encode(&Message::Push {
            vdisk,
            epoch,
            target: self.node,
            address,
        });
        let started = std::time::Instant::now();
        peer.call(push, PUSH_TIMEOUT).await.map_err(|e| {
            format!(
                "vdisk {name}: getting a copy from node {source}: {}",
                replica_error(source, vdisk, e)
            )
        })?;
        tracing::info!(vdisk = name, epoch, %source, elapsed_ms = started.elapsed().as_millis() as u64,
            "got a copy of the vdisk from a node holding one");
        Ok(())
    }
}

/// Serves a peer reactor's connection on this node's reactor of the same lane, where the
/// records it carries are applied (`intake`) if both nodes have as many reactors.
struct OnReactors(Arc<NodeEngine>);

impl LanePlacer for OnReactors {
    fn place(&self, lane: u8, serving: PlacedServing) {
        let reactor = self.0.reactors().get(ReactorId(usize::from(lane)));
        if reactor.spawn_detached(serving).is_err() {
            // Its job queue is full or it stopped: the connection closes (dropped with the
            // job) and the peer connects again.
            tracing::warn!(
                reactor = reactor.id.0,
                "could not move a node-to-node connection to its reactor"
            );
        }
    }
}

fn no_complete_copy_up(name: &str, placement: &PlacementRecord) -> String {
    format!(
        "vdisk {name}: no node holding a complete copy is up (copies {}, of which {} are being \
         filled); it stays offline until one is",
        names(&placement.copies).join(", "),
        names(&placement.filling).join(", ")
    )
}

/// Whether `node` may be given a new copy: up and not being drained.
fn may_hold_copy(node: NodeId, nodes: &[NodeStatus]) -> bool {
    nodes
        .iter()
        .any(|n| n.record.node_id == node && n.state == NodeState::Up && !n.draining)
}

/// What a claim's online resync goes through, and for whom.
struct OnlineResync {
    name: String,
    vdisk: VdiskId,
    epoch: u64,
    shared: Arc<ashlar_engine::vdisk::VdiskShared>,
    copies: Vec<NodeId>,
    chunks: resync::ResyncChunks,
    /// Set when it ends well: the replicator may then repair from every copy.
    all_complete: Arc<std::sync::atomic::AtomicBool>,
}

/// An online resync's epoch and outcome (`None` while it runs).
type ResyncOutcome = (
    u64,
    tokio::sync::watch::Receiver<Option<Result<(), String>>>,
);

fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

fn names(nodes: &[NodeId]) -> Vec<String> {
    nodes.iter().map(|n| n.to_string()).collect()
}

fn copy_address(name: &str, node: NodeId, nodes: &[NodeStatus]) -> Result<SocketAddr, String> {
    let status = nodes
        .iter()
        .find(|n| n.record.node_id == node)
        .ok_or_else(|| format!("vdisk {name}: its copy node {node} is not a cluster member"))?;
    if status.state != NodeState::Up {
        return Err(format!(
            "vdisk {name}: its copy node {node} is down, and writes need every copy; start it \
             again (rebuilding a copy elsewhere is not available yet)"
        ));
    }
    status.record.addresses.node.parse().map_err(|_| {
        format!(
            "vdisk {name}: copy node {node} advertises no node-to-node address ('{}'): it runs \
             a version without replication",
            status.record.addresses.node
        )
    })
}

/// A random seed for the injected network faults of a test.
fn random_seed() -> Result<u64> {
    let mut bytes = [0u8; 8];
    getrandom::fill(&mut bytes)
        .map_err(|e| anyhow!("drawing a seed for the network faults: {e}"))?;
    Ok(u64::from_le_bytes(bytes))
}

/// The secret from `--cluster-secret-file`, else the one kept in etcd (generated by the
/// first node that needs it, in a create-if-absent transaction).
async fn cluster_secret(args: &NodeArgs, meta: &NodeMeta) -> Result<ClusterSecret> {
    if let Some(path) = &args.cluster_secret_file {
        let bytes = std::fs::read(path)
            .with_context(|| format!("reading --cluster-secret-file {}", path.display()))?;
        let trimmed = bytes.trim_ascii().to_vec();
        return ClusterSecret::new(trimmed).ok_or_else(|| {
            anyhow!(
                "--cluster-secret-file {}: the secret must be at least 16 bytes",
                path.display()
            )
        });
    }
    let key = ashlar_cluster::keys::SECRET_KEY.as_bytes().to_vec();
    let mut fresh = [0u8; 32];
    getrandom::fill(&mut fresh).map_err(|e| anyhow!("generating the cluster secret: {e}"))?;
    let fresh: String = fresh.iter().map(|b| format!("{b:02x}")).collect();
    let txn = Txn::new()
        .when([Compare::absent(key.clone())])
        .and_then([TxnOp::put(key.clone(), fresh.into_bytes(), None)]);
    meta.txn(txn)
        .await
        .map_err(|e| anyhow!("storing the cluster secret in etcd: {e}"))?;
    let stored = meta
        .get(&key)
        .await
        .map_err(|e| anyhow!("reading the cluster secret from etcd: {e}"))?;
    let Some(stored) = stored else {
        bail!("the cluster secret vanished from etcd");
    };
    ClusterSecret::new(stored.value)
        .ok_or_else(|| anyhow!("the cluster secret in etcd is shorter than 16 bytes"))
}

//! Replicated writes between the nodes of a cluster (docs/replication.md).
//!
//! - `wire`: the replication messages inside node-to-node payloads.
//! - `peers`: connections to other nodes over `ashlar-transport`.
//! - `sender`: the owner's [`ashlar_engine::replication::Replicator`] for one vdisk.
//! - `receiver`: the replica's loop that applies records in order behind the fence.
//! - `fence`: the highest owner epoch seen per vdisk, kept on disk.
//!
//! [`NodeReplication::prepare`] runs when this node claims a vdisk, before its gate opens:
//! with RF > 1 it settles the vdisk's copy set, fences every other copy at the claim's epoch
//! and installs the replicator; a copy node that cannot be reached refuses the claim, since
//! no write could be acknowledged.

mod fence;
mod peers;
mod receiver;
mod sender;
pub mod wire;

use crate::args::NodeArgs;
use crate::cluster::NodeMeta;
use crate::registry::NodeEngine;
use anyhow::{anyhow, bail, Context, Result};
use ashlar_cluster::{
    choose_copies, list_nodes, read_placement, record_placement, NodeId, NodeState, NodeStatus,
};
use ashlar_core::VdiskId;
use ashlar_meta::{Compare, MetaStore, Txn, TxnOp};
use ashlar_transport::{
    handler_fn, ClusterSecret, Server, TcpTransport, Transport, TransportConfig, TransportLimits,
};
use peers::{transport_id, Peers};
use receiver::ReplicaReceiver;
use sender::{replica_error, PeerReplicator};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use wire::Message;

/// How long a replica may take to make one record durable before the write fails.
pub const REPLICA_TIMEOUT: Duration = Duration::from_secs(5);

/// The node's replication: its node-to-node server and its peers.
pub struct NodeReplication {
    node: NodeId,
    engine: Arc<NodeEngine>,
    meta: NodeMeta,
    peers: Peers,
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
        let transport = Arc::new(TcpTransport::new(config));
        let receiver = ReplicaReceiver::start(engine.clone(), &args.data_dir);
        let handler = handler_fn(move |_peer, payload| {
            let receiver = receiver.clone();
            async move { receiver.handle(payload).await }
        });
        let server = transport
            .serve(args.node_listen, handler)
            .await
            .with_context(|| {
                format!(
                "cannot listen for other nodes on {} (choose another address with --node-listen)",
                args.node_listen
            )
            })?;
        Ok(NodeReplication {
            node,
            engine,
            meta,
            peers: Peers::new(transport),
            _server: server,
        })
    }

    /// Makes vdisk `name` ready to take writes at ownership `epoch`: nothing to do with one
    /// copy; else its copy set is settled, every other copy fenced and the replicator
    /// installed. The error is the line a refused client is shown.
    pub async fn prepare(&self, name: &str, vdisk: VdiskId, epoch: u64) -> Result<(), String> {
        let info = self.engine.vdisk(name).map_err(|e| e.to_string())?;
        let rf = info.replication_factor;
        if rf <= 1 {
            let _ = self.engine.set_replicator(name, None);
            return Ok(());
        }
        let nodes = list_nodes(&self.meta)
            .await
            .map_err(|e| format!("vdisk {name}: listing nodes: {e}"))?;
        let copies = self.copy_set(name, vdisk, rf, &nodes).await?;
        let mut peers = Vec::new();
        for copy in copies.iter().filter(|n| **n != self.node) {
            let address = copy_address(name, *copy, &nodes)?;
            peers.push(self.peers.peer(*copy, address));
        }
        let fence = wire::encode(&Message::Fence { vdisk, epoch });
        for peer in &peers {
            peer.call(fence.clone(), REPLICA_TIMEOUT)
                .await
                .map_err(|e| {
                    format!(
                        "vdisk {name} keeps {rf} copies and writes need every one: {}",
                        replica_error(peer.node(), vdisk, e)
                    )
                })?;
        }
        let replicator = PeerReplicator::new(epoch, peers, REPLICA_TIMEOUT);
        self.engine
            .set_replicator(name, Some(Box::new(replicator)))
            .map_err(|e| e.to_string())?;
        tracing::info!(vdisk = name, epoch, copies = ?copies.iter().map(|n| n.to_string()).collect::<Vec<_>>(),
            "replicating the vdisk's writes to every copy");
        Ok(())
    }

    async fn copy_set(
        &self,
        name: &str,
        vdisk: VdiskId,
        rf: u8,
        nodes: &[NodeStatus],
    ) -> Result<Vec<NodeId>, String> {
        let recorded = read_placement(&self.meta, vdisk)
            .await
            .map_err(|e| format!("vdisk {name}: reading its placement: {e}"))?;
        let placement = match recorded {
            Some(placement) => placement,
            None => {
                let copies = choose_copies(self.node, rf, nodes)
                    .map_err(|e| format!("vdisk {name}: {e}"))?;
                record_placement(&self.meta, vdisk, copies)
                    .await
                    .map_err(|e| format!("vdisk {name}: recording its placement: {e}"))?
            }
        };
        if !placement.copies.contains(&self.node) {
            let holders: Vec<String> = placement.copies.iter().map(|n| n.to_string()).collect();
            return Err(format!(
                "vdisk {name}'s copies are on nodes {}; this node holds none, and this version \
                 cannot move a vdisk's copies: connect to one of those nodes",
                holders.join(", ")
            ));
        }
        Ok(placement.copies)
    }
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

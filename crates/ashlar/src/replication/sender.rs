//! The owner's side: the engine's [`Replicator`] for one vdisk this node owns, sending each
//! record to every other node of the vdisk's copy set at once and succeeding when all of
//! them hold it durably.

use super::peers::Peer;
use super::resync::{sync_chunk, Target};
use super::wire::{self, Message, FENCED_CODE};
use crate::forwarding::wire::ForwardMessage;
use ashlar_cluster::NodeId;
use ashlar_core::IoError;
use ashlar_core::VdiskId;
use ashlar_engine::replication::{
    ReplicaAck, ReplicaFetch, ReplicaOp, ReplicaRecord, ReplicaResync, Replicator,
};
use ashlar_transport::TransportError;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

pub struct PeerReplicator {
    /// The ownership epoch this node claimed the vdisk at.
    epoch: u64,
    peers: Vec<Arc<Peer>>,
    timeout: Duration,
    /// Where a failed copy is reported, so the vdisk is claimed again (copies resynchronized
    /// or replaced): after a failure a copy may miss records, and its streams cannot go on.
    failed: mpsc::Sender<CopyFailed>,
    /// The same copies as resync targets (each with its resync stream at `epoch`).
    resync_targets: Arc<Vec<Target>>,
    /// The copies that were complete when the vdisk was claimed: until the claim's online
    /// resync has ended, only these may supply blocks to repair this node's copy (a copy
    /// being filled answers zeros, or older data, for chunks it has not got yet).
    complete: Vec<Arc<Peer>>,
    /// Set once the claim's online resync ended well: every copy is complete.
    resynced: Arc<AtomicBool>,
}

/// The claim of `vdisk` at `epoch` must be made again: a copy did not take a record sent at
/// it (or its resync failed), or a node wants a copy (`reason`).
#[derive(Debug, Clone, Copy)]
pub struct CopyFailed {
    pub vdisk: VdiskId,
    pub epoch: u64,
    pub reason: Reclaim,
}

/// Why a vdisk is claimed again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reclaim {
    /// A copy failed: resynchronize it or replace it.
    CopyFailed,
    /// A node that carries the vdisk's clients asked for it without holding a complete copy:
    /// the copy set takes it in first (`docs/forwarding.md`, migration).
    CopyWanted,
}

impl PeerReplicator {
    /// `complete` says, for each of `peers`, whether it held a complete copy at the claim;
    /// `resynced` is set when the claim's online resync ends well.
    pub fn new(
        epoch: u64,
        peers: Vec<(Arc<Peer>, bool)>,
        timeout: Duration,
        failed: mpsc::Sender<CopyFailed>,
        resynced: Arc<AtomicBool>,
    ) -> PeerReplicator {
        let complete = peers
            .iter()
            .filter(|(_, complete)| *complete)
            .map(|(peer, _)| peer.clone())
            .collect();
        let peers: Vec<Arc<Peer>> = peers.into_iter().map(|(peer, _)| peer).collect();
        let resync_targets = Arc::new(peers.iter().cloned().map(Target::new).collect());
        PeerReplicator {
            epoch,
            peers,
            timeout,
            failed,
            resync_targets,
            complete,
            resynced,
        }
    }

    /// The copies a repair may read from now.
    fn repair_sources(&self) -> Vec<Arc<Peer>> {
        if self.resynced.load(Ordering::SeqCst) {
            self.peers.clone()
        } else {
            self.complete.clone()
        }
    }
}

impl Replicator for PeerReplicator {
    /// Compares the chunk with every copy's (digests) and sends it where it differs.
    fn resync(&self, vdisk: VdiskId, content: ReplicaOp) -> ReplicaResync {
        let targets = self.resync_targets.clone();
        let epoch = self.epoch;
        Box::pin(async move {
            sync_chunk(&targets, vdisk, epoch, content)
                .await
                .map_err(IoError::Io)
        })
    }

    /// Tries the other complete copies in turn; the first that answers gives the bytes.
    fn fetch(&self, vdisk: VdiskId, offset: u64, length: u64) -> ReplicaFetch {
        let peers = self.repair_sources();
        let timeout = self.timeout;
        Box::pin(async move {
            let length = u32::try_from(length)
                .map_err(|_| IoError::Invalid(format!("copy read of {length} bytes")))?;
            let ask = crate::forwarding::wire::encode(&ForwardMessage::CopyRead {
                vdisk,
                offset,
                length,
            });
            let mut failures = Vec::new();
            for peer in &peers {
                match peer.call(ask.clone(), timeout).await {
                    Ok(bytes) if bytes.len() == length as usize => return Ok(bytes),
                    Ok(bytes) => failures.push(format!(
                        "node {} answered {} bytes",
                        peer.node(),
                        bytes.len()
                    )),
                    Err(error) => failures.push(format!("node {}: {error}", peer.node())),
                }
            }
            Err(IoError::Io(format!(
                "vdisk {vdisk}: no other copy could be read: {}",
                failures.join("; ")
            )))
        })
    }

    fn replicate(&self, record: ReplicaRecord) -> ReplicaAck {
        let vdisk = record.vdisk;
        let payload = wire::encode(&Message::Record {
            epoch: self.epoch,
            record,
        });
        let epoch = self.epoch;
        let calls: Vec<_> = self
            .peers
            .iter()
            .map(|peer| {
                let (peer, payload, timeout) = (peer.clone(), payload.clone(), self.timeout);
                let failed = self.failed.clone();
                async move {
                    let result = peer.call(payload, timeout).await;
                    peer.note_outcome(vdisk, result.as_ref().err());
                    if result.is_err() {
                        // Full: a re-claim is queued already; one is enough.
                        let _ = failed.try_send(CopyFailed {
                            vdisk,
                            epoch,
                            reason: Reclaim::CopyFailed,
                        });
                    }
                    result.map_err(|error| replica_error(peer.node(), vdisk, error))
                }
            })
            .collect();
        Box::pin(async move {
            for result in futures_util::future::join_all(calls).await {
                result?;
            }
            Ok(())
        })
    }
}

/// What the client is told when a replica did not take a record.
pub fn replica_error(node: NodeId, vdisk: VdiskId, error: TransportError) -> IoError {
    match error {
        TransportError::Remote(remote) if remote.code == FENCED_CODE => {
            IoError::NotServing(format!(
                "vdisk {vdisk}: replica node {node} refused the write: {}",
                remote.message
            ))
        }
        other => IoError::Io(format!(
            "vdisk {vdisk}: replica node {node} did not take the write: {other}"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replication::peers::Peers;
    use ashlar_transport::{ClusterSecret, TcpTransport, TransportConfig, TransportLimits};

    fn node(n: u128) -> NodeId {
        NodeId::new(n).unwrap()
    }

    #[tokio::test]
    async fn a_copy_being_filled_supplies_no_repair_until_the_resync_ended() {
        let secret = ClusterSecret::new(vec![7; 32]).unwrap();
        let config = TransportConfig::new(
            ashlar_transport::NodeId(1),
            secret,
            TransportLimits::default(),
        );
        let peers = Peers::new(Arc::new(TcpTransport::new(config)));
        let complete = peers.peer(node(2), "127.0.0.1:1".parse().unwrap());
        let filling = peers.peer(node(3), "127.0.0.1:2".parse().unwrap());
        let (failed, _failures) = mpsc::channel(1);
        let resynced = Arc::new(AtomicBool::new(false));
        let replicator = PeerReplicator::new(
            5,
            vec![(filling, false), (complete, true)],
            Duration::from_secs(1),
            failed,
            resynced.clone(),
        );
        let sources = |r: &PeerReplicator| -> Vec<NodeId> {
            r.repair_sources().iter().map(|p| p.node()).collect()
        };
        assert_eq!(sources(&replicator), vec![node(2)]);
        resynced.store(true, Ordering::SeqCst);
        assert_eq!(sources(&replicator), vec![node(3), node(2)]);
    }
}

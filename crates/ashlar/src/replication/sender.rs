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
}

/// A copy of `vdisk` did not take a record sent at `epoch`.
#[derive(Debug, Clone, Copy)]
pub struct CopyFailed {
    pub vdisk: VdiskId,
    pub epoch: u64,
}

impl PeerReplicator {
    pub fn new(
        epoch: u64,
        peers: Vec<Arc<Peer>>,
        timeout: Duration,
        failed: mpsc::Sender<CopyFailed>,
    ) -> PeerReplicator {
        let resync_targets = Arc::new(peers.iter().cloned().map(Target::new).collect());
        PeerReplicator {
            epoch,
            peers,
            timeout,
            failed,
            resync_targets,
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

    /// Tries the other copies in turn; the first that answers gives the bytes.
    fn fetch(&self, vdisk: VdiskId, offset: u64, length: u64) -> ReplicaFetch {
        let peers = self.peers.clone();
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
                        let _ = failed.try_send(CopyFailed { vdisk, epoch });
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

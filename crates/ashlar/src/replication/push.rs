//! Serving node-to-node requests: records go to their shard's intake and fences to the
//! receiver's control loop (`receiver`); a push (a claimant that holds no copy asks this
//! node, which holds one, for all of it) runs as a resync from this node's copy to the
//! claimant, outside the loops since it takes as long as reading the vdisk; so does a
//! digest request (what this copy holds, for a claimant's resync).

use super::peers::Peers;
use super::receiver::{remote, ReplicaReceiver};
use super::resync::resync;
use super::wire::{self, Message, FAILED_CODE, MALFORMED_CODE};
use crate::forwarding::ForwardServer;
use crate::registry::NodeEngine;
use ashlar_core::VdiskId;
use ashlar_engine::vdisk::VdiskShared;
use ashlar_transport::RemoteError;
use bytes::Bytes;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

pub struct Services {
    pub engine: Arc<NodeEngine>,
    /// Client requests forwarded by other nodes (`docs/forwarding.md`).
    pub forward: Arc<ForwardServer>,
    pub receiver: ReplicaReceiver,
    pub peers: Arc<Peers>,
}

impl Services {
    /// Serves one request of the node `peer` (authenticated by the transport).
    pub async fn serve(
        &self,
        peer: ashlar_transport::NodeId,
        payload: Bytes,
    ) -> Result<Bytes, RemoteError> {
        if crate::forwarding::wire::is_forwarding(&payload) {
            return self.forward.serve(peer, payload).await;
        }
        let message = wire::decode(&payload).map_err(|e| remote(MALFORMED_CODE, e))?;
        match message {
            Message::Push {
                vdisk,
                epoch,
                target,
                address,
            } => {
                let failed = |e: String| remote(FAILED_CODE, format!("vdisk {vdisk}: {e}"));
                let address = address
                    .parse()
                    .map_err(|_| failed(format!("bad push address {address}")))?;
                // No older owner's record lands here while (or after) the copy is read.
                let shared = self.fence_and_settle(vdisk, epoch).await?;
                let peer = self.peers.peer(target, address);
                let done = AtomicU64::new(0);
                let sent = resync(shared, vdisk, epoch, &[peer], &done)
                    .await
                    .map_err(failed)?;
                tracing::info!(%vdisk, epoch, %target, chunks_sent = sent.chunks_sent,
                    chunks_same = sent.chunks_same, data_bytes = sent.data_bytes,
                    "sent this node's copy to the node taking the vdisk over");
            }
            Message::Digest {
                vdisk,
                epoch,
                offset,
                length,
            } => {
                // Only the claimant that fenced this copy (or a newer one) may ask.
                self.receiver
                    .handle(Message::Fence { vdisk, epoch })
                    .await?;
                return super::digest::serve(&self.engine, vdisk, offset, length).await;
            }
            Message::Fence { vdisk, epoch } => {
                // The claimant compares this copy with its own next, all of it or, if the
                // copy's identity is the one it saw at its last claim, what it missed.
                // Read after the fence: a trim it let through before started the copy again
                // (with a new identity), and none can follow it (a trim refuses once this
                // claim's epoch fenced the copy).
                let shared = self.fence_and_settle(vdisk, epoch).await?;
                return Ok(wire::encode_fence_answer(shared.copy_identity));
            }
            other => self.receiver.handle(other).await?,
        }
        Ok(Bytes::new())
    }

    /// Fences this copy at `epoch`, then waits until the older owners' records it took
    /// before the fence are applied; the copy's shared state.
    async fn fence_and_settle(
        &self,
        vdisk: VdiskId,
        epoch: u64,
    ) -> Result<Arc<VdiskShared>, RemoteError> {
        self.receiver
            .handle(Message::Fence { vdisk, epoch })
            .await?;
        let failed = |e: String| remote(FAILED_CODE, format!("vdisk {vdisk}: {e}"));
        let shared = self
            .engine
            .replica_target(vdisk)
            .await
            .map_err(|e| failed(e.to_string()))?;
        shared.settle().await.map_err(|e| failed(e.to_string()))?;
        Ok(shared)
    }
}

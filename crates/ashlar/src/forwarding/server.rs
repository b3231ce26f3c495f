//! The owner's side: runs forwarded client requests on the vdisk exactly as a local client's
//! (same serving gate, same shards), and gives the vdisk up to a forwarder that carries its
//! clients when none of its own is connected.

use super::device::FORWARD_PIECE_BYTES;
use super::wire::{
    self, error_code, ForwardMessage, ForwardOp, BUSY_CODE, IO_CODE, MALFORMED_CODE,
    NOT_SERVING_CODE, SHUTTING_DOWN_CODE,
};
use crate::ownership::NodeOwnership;
use crate::registry::NodeEngine;
use crate::replication::transport_id;
use ashlar_core::{BlockDevice, IoResult, VdiskId};
use ashlar_engine::reactor::ReactorId;
use ashlar_engine::shard::{ShardOp, ShardReply};
use ashlar_engine::vdisk::VdiskShared;
use ashlar_engine::VdiskHandle;
use ashlar_transport::RemoteError;
use bytes::Bytes;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

pub struct ForwardServer {
    engine: Arc<NodeEngine>,
    /// Set once the node's ownership layer exists (it is made after the node-to-node server).
    ownership: OnceLock<NodeOwnership>,
    /// Forwarded requests running per vdisk: each holds a handle, which counts as one of
    /// the vdisk's connections, so the node's own clients are the connections beyond these.
    running: Mutex<HashMap<VdiskId, usize>>,
}

fn remote(code: u32, message: impl ToString) -> RemoteError {
    RemoteError {
        code,
        message: message.to_string(),
    }
}

impl ForwardServer {
    pub fn new(engine: Arc<NodeEngine>) -> ForwardServer {
        ForwardServer {
            engine,
            ownership: OnceLock::new(),
            running: Mutex::new(HashMap::new()),
        }
    }

    pub fn set_ownership(&self, ownership: NodeOwnership) {
        let _ = self.ownership.set(ownership);
    }

    /// Serves one forwarding message of the node `peer` (authenticated by the transport).
    pub async fn serve(
        &self,
        peer: ashlar_transport::NodeId,
        payload: Bytes,
    ) -> Result<Bytes, RemoteError> {
        let message = wire::decode(&payload).map_err(|e| remote(MALFORMED_CODE, e))?;
        match message {
            ForwardMessage::Io { vdisk, offset, op } => self.run(vdisk, offset, op).await,
            ForwardMessage::HandOver { vdisk, asker } => {
                if asker.is_some_and(|asker| transport_id(asker) != peer) {
                    return Err(remote(
                        MALFORMED_CODE,
                        "a hand-over names another node than the one asking",
                    ));
                }
                self.hand_over(vdisk, asker).await
            }
            ForwardMessage::CopyRead {
                vdisk,
                offset,
                length,
            } => self.copy_read(vdisk, offset, length).await,
        }
    }

    /// Reads this node's copy below its serving gate, for an owner whose copy is damaged.
    async fn copy_read(
        &self,
        vdisk: VdiskId,
        offset: u64,
        length: u32,
    ) -> Result<Bytes, RemoteError> {
        check_piece(length)?;
        let failed = |e: String| remote(IO_CODE, format!("vdisk {vdisk}: {e}"));
        let shared = self
            .engine
            .replica_target(vdisk)
            .await
            .map_err(|e| failed(e.to_string()))?;
        ashlar_core::check_range(
            offset,
            u64::from(length),
            shared.size_bytes.load(std::sync::atomic::Ordering::Relaxed),
        )
        .map_err(|e| remote(wire::INVALID_CODE, e))?;
        let replies = shared
            .call_split(offset, u64::from(length), |o, l| ShardOp::Read {
                offset: o,
                length: l,
            })
            .await
            .map_err(|e| failed(e.to_string()))?;
        let mut joined = bytes::BytesMut::with_capacity(length as usize);
        for reply in replies {
            match reply {
                ShardReply::Data(data) => joined.extend_from_slice(&data),
                _ => return Err(failed("unexpected shard reply".into())),
            }
        }
        Ok(joined.freeze())
    }

    async fn run(&self, vdisk: VdiskId, offset: u64, op: ForwardOp) -> Result<Bytes, RemoteError> {
        if let ForwardOp::Read { length } = op {
            check_piece(length)?;
        }
        let shared = self.shared(vdisk)?;
        let reactor = shared.reactor_for(offset).unwrap_or(ReactorId(0));
        let (reply, answer) = tokio::sync::oneshot::channel();
        let _running = Running::new(self, vdisk);
        self.engine
            .reactors()
            .get(reactor)
            .spawn_detached(move || async move {
                let handle = VdiskHandle::new(shared);
                let _ = reply.send(run_op(&handle, offset, op).await);
            })
            .map_err(|_| remote(SHUTTING_DOWN_CODE, "the node is stopping"))?;
        let result = answer
            .await
            .map_err(|_| remote(IO_CODE, "the request was dropped (the node is stopping)"))?;
        result.map_err(|e| remote(error_code(&e), e))
    }

    async fn hand_over(
        &self,
        vdisk: VdiskId,
        asker: Option<ashlar_cluster::NodeId>,
    ) -> Result<Bytes, RemoteError> {
        let Some(ownership) = self.ownership.get() else {
            return Err(remote(NOT_SERVING_CODE, "this node is starting"));
        };
        let shared = self.shared(vdisk)?;
        let rf = self
            .engine
            .vdisk(&shared.name)
            .map_err(|e| remote(NOT_SERVING_CODE, e))?
            .replication_factor;
        if rf <= 1 {
            return Err(remote(
                BUSY_CODE,
                format!(
                    "vdisk {}: its one copy is on this node; it stays here",
                    shared.name
                ),
            ));
        }
        let connections = shared
            .connections
            .load(std::sync::atomic::Ordering::Relaxed);
        let forwarded = self.running_for(vdisk);
        if connections > forwarded {
            return Err(remote(
                BUSY_CODE,
                format!(
                    "vdisk {}: {} client connection(s) of this node use it; it stays here",
                    shared.name,
                    connections - forwarded
                ),
            ));
        }
        // A node without a complete copy first gets one, while this node serves: taking
        // the vdisk over would otherwise keep it offline while the whole copy is sent.
        if let Some(asker) = asker {
            if let Some(filling) = ownership
                .copy_before_hand_over(vdisk, asker)
                .await
                .map_err(|e| remote(NOT_SERVING_CODE, e))?
            {
                return Err(remote(
                    BUSY_CODE,
                    format!("vdisk {}: {filling}", shared.name),
                ));
            }
        }
        ownership
            .hand_over(vdisk, shared.clone())
            .await
            .map_err(|e| remote(NOT_SERVING_CODE, e))?;
        // The gate is shut: no write goes through this replicator again. The next claim
        // here, if any, installs its own.
        let _ = self.engine.set_replicator(&shared.name, None);
        Ok(Bytes::new())
    }

    fn shared(&self, vdisk: VdiskId) -> Result<Arc<VdiskShared>, RemoteError> {
        self.engine
            .shared_by_id(vdisk)
            .map_err(|e| remote(NOT_SERVING_CODE, e))?
            .ok_or_else(|| {
                remote(
                    NOT_SERVING_CODE,
                    format!("vdisk {vdisk} is not served here"),
                )
            })
    }

    fn running_for(&self, vdisk: VdiskId) -> usize {
        let running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        running.get(&vdisk).copied().unwrap_or(0)
    }
}

/// A read answered over the node-to-node protocol is at most one forwarding piece: the
/// answer's buffer is bounded whatever a peer asks (forwarders and read repair never ask for
/// more; the transport's frames are 16 MiB).
fn check_piece(length: u32) -> Result<(), RemoteError> {
    if length > FORWARD_PIECE_BYTES {
        return Err(remote(
            wire::INVALID_CODE,
            format!(
                "a forwarded read of {length} bytes exceeds the {FORWARD_PIECE_BYTES}-byte piece"
            ),
        ));
    }
    Ok(())
}

/// Counts one forwarded request of a vdisk while it runs.
struct Running<'a> {
    server: &'a ForwardServer,
    vdisk: VdiskId,
}

impl<'a> Running<'a> {
    fn new(server: &'a ForwardServer, vdisk: VdiskId) -> Self {
        let mut running = server.running.lock().unwrap_or_else(|p| p.into_inner());
        *running.entry(vdisk).or_insert(0) += 1;
        Running { server, vdisk }
    }
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        let mut running = self
            .server
            .running
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(count) = running.get_mut(&self.vdisk) {
            *count -= 1;
            if *count == 0 {
                running.remove(&self.vdisk);
            }
        }
    }
}

/// One forwarded request on the vdisk's handle; its answer's payload.
async fn run_op(handle: &VdiskHandle, offset: u64, op: ForwardOp) -> IoResult<Bytes> {
    match op {
        ForwardOp::Read { length } => match handle.read_now(offset, length) {
            Some(result) => result,
            None => handle.read(offset, length).await,
        },
        ForwardOp::Write { data, fua } => {
            handle.write(offset, data, fua).await.map(|_| Bytes::new())
        }
        ForwardOp::Flush => handle.flush().await.map(|_| Bytes::new()),
        ForwardOp::Trim { length } => handle.trim(offset, length).await.map(|_| Bytes::new()),
        ForwardOp::WriteZeroes {
            length,
            may_punch_hole,
        } => handle
            .write_zeroes(offset, length, may_punch_hole)
            .await
            .map(|_| Bytes::new()),
        ForwardOp::BlockStatus { length } => handle
            .block_status(offset, length)
            .await
            .map(|runs| wire::encode_runs(&runs)),
    }
}

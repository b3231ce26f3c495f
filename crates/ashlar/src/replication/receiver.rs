//! The replica's side: records other nodes send are applied to this node's copy of the
//! vdisk, in each stream's order, behind the vdisk's fence.
//!
//! One owner, one loop: transport handlers hand each decoded message to the loop and wait
//! for its answer. The loop checks the epoch against the fence, puts the record in its
//! stream's order (the network may reorder: a record waits until its `prev_seq` was
//! applied), and queues it on the local vdisk's shard (`VdiskShared::enqueue_replica`) —
//! queued one after another, records reach the shard in stream order, so overlapping writes
//! land in the owner's order. The answer goes back once the shard made the record durable in
//! this node's own oplog.

use super::fence::{Fences, Verdict};
use super::wire::{Message, FAILED_CODE, FENCED_CODE, MALFORMED_CODE, STALE_CODE};
use crate::registry::NodeEngine;
use ashlar_core::VdiskId;
use ashlar_engine::replication::ReplicaRecord;
use ashlar_engine::shard::ShardError;
use ashlar_engine::vdisk::{VdiskShared, SHARD_RANGE_BYTES};
use ashlar_transport::RemoteError;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;
use tokio::sync::{mpsc, oneshot};

/// Messages queued for the loop; more wait in the transport (which stops reading).
pub const RECEIVER_QUEUE_LIMIT: usize = 1024;
/// Records a stream may hold out of order, waiting for an earlier one, before the stream
/// is refused (an owner has at most its in-flight limit of records outstanding).
pub const MAX_WAITING_PER_STREAM: usize = 4096;

type Answer = oneshot::Sender<Result<(), RemoteError>>;

enum Incoming {
    Message {
        message: Message,
        answer: Answer,
    },
    /// Drop this node's copy of `vdisk`, no longer one of its copies as of owner `epoch`.
    Trim {
        vdisk: VdiskId,
        epoch: u64,
        answer: oneshot::Sender<Result<bool, String>>,
    },
}

/// The handle transport handlers use.
#[derive(Clone)]
pub struct ReplicaReceiver {
    queue: mpsc::Sender<Incoming>,
}

impl ReplicaReceiver {
    /// Starts the loop on the current (control) runtime.
    pub fn start(engine: Arc<NodeEngine>, data_dir: &Path) -> ReplicaReceiver {
        let (queue, incoming) = mpsc::channel(RECEIVER_QUEUE_LIMIT);
        let receiver_loop = ReceiverLoop {
            engine,
            fences: Fences::new(data_dir),
            streams: HashMap::new(),
            targets: HashMap::new(),
            stale_reported: HashSet::new(),
            fenced_this_run: HashSet::new(),
        };
        tokio::spawn(receiver_loop.run(incoming));
        ReplicaReceiver { queue }
    }

    /// Answers one record or fence.
    pub async fn handle(&self, message: Message) -> Result<(), RemoteError> {
        let (answer, answered) = oneshot::channel();
        self.queue
            .send(Incoming::Message { message, answer })
            .await
            .map_err(|_| remote(FAILED_CODE, "the node is stopping"))?;
        answered
            .await
            .map_err(|_| remote(FAILED_CODE, "the node is stopping"))?
    }

    /// Removes this node's data of `vdisk` (starting it again empty), which is not one of the
    /// vdisk's copies as of owner `epoch`: in the loop, so no record or fence of the vdisk
    /// is applied meanwhile. If an owner at `epoch` or later fenced this node already (its
    /// claim may have made this node a copy again, and may be comparing it), nothing is
    /// removed (false); else the fence is raised to `epoch` first. Also false while a
    /// client of this node has the vdisk open.
    pub async fn trim(&self, vdisk: VdiskId, epoch: u64) -> Result<bool, String> {
        let (answer, answered) = oneshot::channel();
        let stopping = || "the node is stopping".to_string();
        self.queue
            .send(Incoming::Trim {
                vdisk,
                epoch,
                answer,
            })
            .await
            .map_err(|_| stopping())?;
        answered.await.map_err(|_| stopping())?
    }
}

pub fn remote(code: u32, message: impl ToString) -> RemoteError {
    RemoteError {
        code,
        message: message.to_string(),
    }
}

/// One owner's run of one shard: (vdisk, owner epoch, shard, stream).
type StreamKey = (VdiskId, u64, u32, u64);

#[derive(Default)]
struct Stream {
    /// The seq of the last record queued on the shard (0: none yet).
    last: u64,
    /// Records that arrived before their predecessor, by `prev_seq`.
    waiting: BTreeMap<u64, (ReplicaRecord, Answer)>,
}

struct ReceiverLoop {
    engine: Arc<NodeEngine>,
    fences: Fences,
    streams: HashMap<StreamKey, Stream>,
    targets: HashMap<VdiskId, Arc<VdiskShared>>,
    /// (vdisk, owner epoch) whose stale copy the log has named already.
    stale_reported: HashSet<(VdiskId, u64)>,
    /// (vdisk, owner epoch) an owner fenced while this process ran: records of any other
    /// epoch come from a claim made before a restart of this node.
    fenced_this_run: HashSet<(VdiskId, u64)>,
}

impl ReceiverLoop {
    async fn run(mut self, mut incoming: mpsc::Receiver<Incoming>) {
        while let Some(work) = incoming.recv().await {
            let (message, answer) = match work {
                Incoming::Message { message, answer } => (message, answer),
                Incoming::Trim {
                    vdisk,
                    epoch,
                    answer,
                } => {
                    let _ = answer.send(self.trim(vdisk, epoch).await);
                    continue;
                }
            };
            match message {
                Message::Fence { vdisk, epoch } => {
                    let fenced = self.fence(vdisk, epoch).await;
                    if fenced.is_ok() {
                        self.fenced_this_run.insert((vdisk, epoch));
                    }
                    let _ = answer.send(fenced);
                }
                Message::Record { epoch, record } => self.record(epoch, record, answer).await,
                Message::Push { .. } | Message::Digest { .. } => {
                    let _ = answer.send(Err(remote(MALFORMED_CODE, "not a record or a fence")));
                }
            }
        }
    }

    async fn trim(&mut self, vdisk: VdiskId, epoch: u64) -> Result<bool, String> {
        let fence_error = |e: std::io::Error| format!("replica fence of vdisk {vdisk}: {e}");
        // A claim at `epoch` or later fenced this node: it may be reading (or filling) this
        // copy as one of its own, so it stays.
        if self.fences.highest(vdisk).await.map_err(fence_error)? >= epoch {
            return Ok(false);
        }
        self.fence(vdisk, epoch).await.map_err(|e| e.message)?;
        self.targets.remove(&vdisk);
        self.streams.retain(|key, _| key.0 != vdisk);
        // The copy started again empty has a new identity (its files go with the data).
        self.engine
            .trim_copy(vdisk)
            .await
            .map_err(|e| e.to_string())
    }

    async fn fence(&mut self, vdisk: VdiskId, epoch: u64) -> Result<(), RemoteError> {
        let verdict = self
            .fences
            .admit(vdisk, epoch)
            .await
            .map_err(|e| remote(FAILED_CODE, format!("replica fence of vdisk {vdisk}: {e}")))?;
        match verdict {
            Verdict::Admit => {
                // Streams of older owners can never go on.
                self.streams
                    .retain(|key, _| key.0 != vdisk || key.1 >= epoch);
                Ok(())
            }
            Verdict::Fenced { highest } => Err(fenced(vdisk, epoch, highest)),
        }
    }

    async fn record(&mut self, epoch: u64, record: ReplicaRecord, answer: Answer) {
        if let Err(refused) = self.fence(record.vdisk, epoch).await {
            let _ = answer.send(Err(refused));
            return;
        }
        if !self.fenced_this_run.contains(&(record.vdisk, epoch)) {
            // The owner fences every copy before it sends a record at its epoch: this node
            // restarted since, and may have missed records while it was away.
            let reason = format!(
                "vdisk {}: this copy restarted after the owner claimed the vdisk at epoch \
                 {epoch} and may have missed records; the owner must resynchronize it",
                record.vdisk
            );
            if self.stale_reported.insert((record.vdisk, epoch)) {
                tracing::warn!(%reason, "refusing replicated records");
            }
            let _ = answer.send(Err(remote(STALE_CODE, reason)));
            return;
        }
        let key = (record.vdisk, epoch, record.shard, record.stream);
        let stream = self.streams.entry(key).or_default();
        if record.prev_seq != stream.last {
            if record.seq <= stream.last {
                let _ = answer.send(Err(remote(
                    FAILED_CODE,
                    format!(
                        "record {} of stream {key:?} was already applied",
                        record.seq
                    ),
                )));
            } else if stream.waiting.len() >= MAX_WAITING_PER_STREAM {
                let _ = answer.send(Err(remote(
                    FAILED_CODE,
                    format!(
                        "stream {key:?} has {MAX_WAITING_PER_STREAM} records waiting for record {}",
                        stream.last
                    ),
                )));
            } else {
                stream.waiting.insert(record.prev_seq, (record, answer));
            }
            return;
        }
        let mut next = Some((record, answer));
        while let Some((record, answer)) = next.take() {
            let seq = record.seq;
            self.apply(record, answer).await;
            let stream = self.streams.entry(key).or_default();
            stream.last = seq;
            next = stream.waiting.remove(&seq);
        }
    }

    /// Queues the record on the local copy's shard; answers when the shard is done with it.
    async fn apply(&mut self, record: ReplicaRecord, answer: Answer) {
        let vdisk = record.vdisk;
        let (offset, length) = record.op.range();
        let op = record.op.into_shard_op();
        let queued = match self.target(vdisk).await {
            Ok(shared) => match check_record_range(&shared, offset, length) {
                Ok(()) => shared
                    .enqueue_replica(op, offset)
                    .await
                    .map_err(|e| e.to_string()),
                Err(reason) => Err(reason),
            },
            Err(e) => Err(e),
        };
        let reply = match queued {
            Ok(reply) => reply,
            Err(error) => {
                self.targets.remove(&vdisk);
                let _ = answer.send(Err(remote(FAILED_CODE, format!("vdisk {vdisk}: {error}"))));
                return;
            }
        };
        tokio::spawn(async move {
            let result = match reply.await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(ShardError::Io(error))) => Err(remote(
                    FAILED_CODE,
                    format!("vdisk {vdisk} at {offset}: {error}"),
                )),
                Ok(Err(ShardError::Retired)) | Err(_) => Err(remote(
                    FAILED_CODE,
                    format!("vdisk {vdisk}: its shard changed under a replicated record"),
                )),
            };
            let _ = answer.send(result);
        });
    }

    async fn target(&mut self, vdisk: VdiskId) -> Result<Arc<VdiskShared>, String> {
        if let Some(shared) = self.targets.get(&vdisk) {
            return Ok(shared.clone());
        }
        let shared = self
            .engine
            .replica_target(vdisk)
            .await
            .map_err(|e| e.to_string())?;
        self.targets.insert(vdisk, shared.clone());
        Ok(shared)
    }
}

/// A record lies inside the vdisk and inside one shard range (as every owner's oplog record
/// does): anything else would reach a shard controller with a request it never takes from a
/// client, so it is refused here.
fn check_record_range(shared: &VdiskShared, offset: u64, length: u64) -> Result<(), String> {
    let size = shared.size_bytes.load(std::sync::atomic::Ordering::Relaxed);
    let end = offset.checked_add(length).filter(|end| *end <= size);
    let Some(end) = end.filter(|_| length > 0) else {
        return Err(format!(
            "record [{offset}, +{length}) is empty or outside the vdisk's {size} bytes"
        ));
    };
    if offset / SHARD_RANGE_BYTES != (end - 1) / SHARD_RANGE_BYTES {
        return Err(format!(
            "record [{offset}, +{length}) crosses a {SHARD_RANGE_BYTES}-byte shard range"
        ));
    }
    Ok(())
}

fn fenced(vdisk: VdiskId, epoch: u64, highest: u64) -> RemoteError {
    remote(
        FENCED_CODE,
        format!("vdisk {vdisk}: owner epoch {epoch} is older than epoch {highest}, which this replica has seen: another node owns the vdisk now"),
    )
}

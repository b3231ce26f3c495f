//! Where replicated records are applied: one intake loop per reactor, each taking the
//! records of the shards that run on its reactor (the engine's placement: reactor
//! `vdisk + shard`), so a record whose connection is served on that reactor reaches its
//! shard, and its answer the connection, without waking another thread.
//!
//! The receiver's control loop (`receiver`) decides fences; an intake only follows them. A
//! fence the control loop admits reaches every intake as a [`IntakeWork::Fence`] before the
//! fencing owner gets its answer; an intake handles its work in order, so every record it
//! admitted before the fence is queued on its shard by then, and it refuses every record of
//! an older owner after. A record an intake cannot admit goes back to the control loop,
//! which answers it with the same verdict it would give a fence (fenced, stale copy).

use super::receiver::{remote, Incoming};
use super::stream_order::{Offered, StreamOrder};
use super::wire::FAILED_CODE;
use crate::registry::NodeEngine;
use ashlar_core::VdiskId;
use ashlar_engine::replication::ReplicaRecord;
use ashlar_engine::shard::ShardError;
use ashlar_engine::vdisk::{VdiskShared, SHARD_RANGE_BYTES};
use ashlar_transport::RemoteError;
use std::collections::HashMap;
use std::sync::Arc;
use tokio::sync::{mpsc, oneshot};

/// Work queued for one intake; more waits in the transport, which stops reading.
pub const INTAKE_QUEUE_LIMIT: usize = 1024;

pub type Answer = oneshot::Sender<Result<(), RemoteError>>;

pub enum IntakeWork {
    Record {
        epoch: u64,
        record: ReplicaRecord,
        answer: Answer,
    },
    /// The control loop admitted `epoch` as `vdisk`'s fence. `by_owner`: an owner fenced
    /// this copy at `epoch` in this run, so its records may be applied; otherwise (a trim
    /// raised it) records of `epoch` come from a claim this run never saw.
    Fence {
        vdisk: VdiskId,
        epoch: u64,
        by_owner: bool,
        done: oneshot::Sender<()>,
    },
    /// The copy was trimmed (started again empty): forget its state and streams.
    Forget {
        vdisk: VdiskId,
        done: oneshot::Sender<()>,
    },
}

/// The handles of every intake, by reactor.
#[derive(Clone)]
pub struct Intakes {
    engine: Arc<NodeEngine>,
    queues: Arc<Vec<mpsc::Sender<IntakeWork>>>,
}

impl Intakes {
    /// Starts one intake on each reactor. `control` is the receiver's control loop, which
    /// answers the records an intake cannot admit; `runtime` is the control runtime, where
    /// a copy not started yet is started.
    pub fn start(
        engine: Arc<NodeEngine>,
        control: mpsc::Sender<Incoming>,
        runtime: tokio::runtime::Handle,
    ) -> Intakes {
        let mut queues = Vec::new();
        for reactor in engine.reactors().handles() {
            let (queue, work) = mpsc::channel(INTAKE_QUEUE_LIMIT);
            let intake = Intake {
                engine: engine.clone(),
                control: control.clone(),
                runtime: runtime.clone(),
                fences: HashMap::new(),
                order: StreamOrder::new(),
                targets: HashMap::new(),
            };
            if reactor.spawn_detached(move || intake.run(work)).is_err() {
                // The node is stopping: the queue's receiver is gone, sends fail cleanly.
                tracing::warn!(reactor = reactor.id.0, "could not start a replica intake");
            }
            queues.push(queue);
        }
        Intakes {
            engine,
            queues: Arc::new(queues),
        }
    }

    /// Applies one record on the intake of its shard's reactor; answers when it is durable.
    pub async fn record(&self, epoch: u64, record: ReplicaRecord) -> Result<(), RemoteError> {
        let index = self.engine.shard_reactor(record.vdisk, record.shard).0;
        let (answer, answered) = oneshot::channel();
        let work = IntakeWork::Record {
            epoch,
            record,
            answer,
        };
        let stopping = || remote(FAILED_CODE, "the node is stopping");
        self.queues[index]
            .send(work)
            .await
            .map_err(|_| stopping())?;
        answered.await.map_err(|_| stopping())?
    }

    /// Tells every intake; returns once each has taken it (after all work queued before).
    pub async fn broadcast(&self, make: impl Fn(oneshot::Sender<()>) -> IntakeWork) {
        for queue in self.queues.iter() {
            let (done, taken) = oneshot::channel();
            if queue.send(make(done)).await.is_ok() {
                let _ = taken.await;
            }
        }
    }
}

/// One reactor's intake: what it knows of each vdisk's fence, its streams, its copies.
struct Intake {
    engine: Arc<NodeEngine>,
    control: mpsc::Sender<Incoming>,
    runtime: tokio::runtime::Handle,
    /// By vdisk: the highest epoch admitted, and whether an owner fenced at it this run.
    fences: HashMap<VdiskId, (u64, bool)>,
    /// Streams by (vdisk, owner epoch, shard, stream).
    order: StreamOrder<(VdiskId, u64, u32, u64), (ReplicaRecord, Answer)>,
    targets: HashMap<VdiskId, Arc<VdiskShared>>,
}

impl Intake {
    async fn run(mut self, mut work: mpsc::Receiver<IntakeWork>) {
        while let Some(next) = work.recv().await {
            match next {
                IntakeWork::Record {
                    epoch,
                    record,
                    answer,
                } => self.record(epoch, record, answer).await,
                IntakeWork::Fence {
                    vdisk,
                    epoch,
                    by_owner,
                    done,
                } => {
                    self.fences.insert(vdisk, (epoch, by_owner));
                    // Streams of older owners can never go on.
                    self.order.forget(|key| key.0 == vdisk && key.1 < epoch);
                    let _ = done.send(());
                }
                IntakeWork::Forget { vdisk, done } => {
                    self.targets.remove(&vdisk);
                    self.order.forget(|key| key.0 == vdisk);
                    let _ = done.send(());
                }
            }
        }
    }

    async fn record(&mut self, epoch: u64, record: ReplicaRecord, answer: Answer) {
        let vdisk = record.vdisk;
        if self.fences.get(&vdisk) != Some(&(epoch, true)) {
            // Not this intake's to refuse: the control loop gives the fence's verdict. Sent
            // from a task, since the control loop may be waiting for this intake.
            let control = self.control.clone();
            tokio::task::spawn_local(async move {
                let refuse = Incoming::Refuse {
                    vdisk,
                    epoch,
                    answer,
                };
                let _ = control.send(refuse).await;
            });
            return;
        }
        let key = (vdisk, epoch, record.shard, record.stream);
        let (seq, prev_seq) = (record.seq, record.prev_seq);
        match self.order.offer(key, seq, prev_seq, (record, answer)) {
            Offered::Held => {}
            Offered::Refused((_, answer), reason) => {
                let _ = answer.send(Err(remote(FAILED_CODE, reason)));
            }
            Offered::Release(records) => {
                for (record, answer) in records {
                    self.apply(record, answer).await;
                }
            }
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
        tokio::task::spawn_local(async move {
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

    /// The copy's shared state; a copy this node has not started yet is started on the
    /// control runtime (it reads the catalog).
    async fn target(&mut self, vdisk: VdiskId) -> Result<Arc<VdiskShared>, String> {
        if let Some(shared) = self.targets.get(&vdisk) {
            return Ok(shared.clone());
        }
        let engine = self.engine.clone();
        let shared = self
            .runtime
            .spawn(async move { engine.replica_target(vdisk).await })
            .await
            .map_err(|e| e.to_string())?
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

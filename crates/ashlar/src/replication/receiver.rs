//! The replica's side: records other nodes send are applied to this node's copy of the
//! vdisk, in each stream's order, behind the vdisk's fence.
//!
//! Records go straight to the intake of their shard's reactor (`intake`), which orders and
//! applies them. Fences and trims go through one control loop here, the only place that
//! reads and raises the fences on disk: a fence is answered once every intake took it, so
//! no intake applies a record of an older owner after its new owner was answered. Records
//! an intake cannot admit come back here and get the fence's verdict.

use super::fence::{Fences, Verdict};
use super::intake::{Answer, IntakeWork, Intakes};
use super::wire::{Message, FAILED_CODE, FENCED_CODE, MALFORMED_CODE, STALE_CODE};
use crate::registry::NodeEngine;
use ashlar_core::VdiskId;
use ashlar_transport::RemoteError;
use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;
use tokio::sync::{mpsc, oneshot};

/// Fences, trims and refused records queued for the control loop.
pub const RECEIVER_QUEUE_LIMIT: usize = 1024;

pub enum Incoming {
    Fence {
        vdisk: VdiskId,
        epoch: u64,
        answer: Answer,
    },
    /// Drop this node's copy of `vdisk`, no longer one of its copies as of owner `epoch`.
    Trim {
        vdisk: VdiskId,
        epoch: u64,
        answer: oneshot::Sender<Result<bool, String>>,
    },
    /// A record of owner `epoch` an intake did not admit: answer with the fence's verdict.
    Refuse {
        vdisk: VdiskId,
        epoch: u64,
        answer: Answer,
    },
}

/// The handle transport handlers use.
#[derive(Clone)]
pub struct ReplicaReceiver {
    queue: mpsc::Sender<Incoming>,
    intakes: Intakes,
}

impl ReplicaReceiver {
    /// Starts the control loop on the current (control) runtime and an intake on every
    /// reactor.
    pub fn start(engine: Arc<NodeEngine>, data_dir: &Path) -> ReplicaReceiver {
        let (queue, incoming) = mpsc::channel(RECEIVER_QUEUE_LIMIT);
        let runtime = tokio::runtime::Handle::current();
        let intakes = Intakes::start(engine.clone(), queue.clone(), runtime);
        let receiver_loop = ReceiverLoop {
            engine,
            fences: Fences::new(data_dir),
            intakes: intakes.clone(),
            stale_reported: HashSet::new(),
            fenced_this_run: HashSet::new(),
        };
        tokio::spawn(receiver_loop.run(incoming));
        ReplicaReceiver { queue, intakes }
    }

    /// Answers one record or fence.
    pub async fn handle(&self, message: Message) -> Result<(), RemoteError> {
        let stopping = || remote(FAILED_CODE, "the node is stopping");
        let (answer, answered) = oneshot::channel();
        let incoming = match message {
            Message::Record { epoch, record } => return self.intakes.record(epoch, record).await,
            Message::Fence { vdisk, epoch } => Incoming::Fence {
                vdisk,
                epoch,
                answer,
            },
            Message::Push { .. } | Message::Digest { .. } => {
                return Err(remote(MALFORMED_CODE, "not a record or a fence"))
            }
        };
        self.queue.send(incoming).await.map_err(|_| stopping())?;
        answered.await.map_err(|_| stopping())?
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

struct ReceiverLoop {
    engine: Arc<NodeEngine>,
    fences: Fences,
    intakes: Intakes,
    /// (vdisk, owner epoch) whose stale copy the log has named already.
    stale_reported: HashSet<(VdiskId, u64)>,
    /// (vdisk, owner epoch) an owner fenced while this process ran: records of any other
    /// epoch come from a claim made before a restart of this node.
    fenced_this_run: HashSet<(VdiskId, u64)>,
}

impl ReceiverLoop {
    async fn run(mut self, mut incoming: mpsc::Receiver<Incoming>) {
        while let Some(work) = incoming.recv().await {
            match work {
                Incoming::Fence {
                    vdisk,
                    epoch,
                    answer,
                } => {
                    let fenced = self.fence(vdisk, epoch, true).await;
                    let _ = answer.send(fenced);
                }
                Incoming::Trim {
                    vdisk,
                    epoch,
                    answer,
                } => {
                    let _ = answer.send(self.trim(vdisk, epoch).await);
                }
                Incoming::Refuse {
                    vdisk,
                    epoch,
                    answer,
                } => {
                    let _ = answer.send(self.refuse(vdisk, epoch).await);
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
        self.fence(vdisk, epoch, false)
            .await
            .map_err(|e| e.message)?;
        self.intakes
            .broadcast(|done| IntakeWork::Forget { vdisk, done })
            .await;
        // The copy started again empty has a new identity (its files go with the data).
        self.engine
            .trim_copy(vdisk)
            .await
            .map_err(|e| e.to_string())
    }

    /// Admits `epoch` as `vdisk`'s fence (`by_owner`: an owner's fence, whose records may
    /// follow) and tells every intake before returning.
    async fn fence(
        &mut self,
        vdisk: VdiskId,
        epoch: u64,
        by_owner: bool,
    ) -> Result<(), RemoteError> {
        let failed =
            |e: std::io::Error| remote(FAILED_CODE, format!("replica fence of vdisk {vdisk}: {e}"));
        let raised = epoch > self.fences.highest(vdisk).await.map_err(failed)?;
        let verdict = self.fences.admit(vdisk, epoch).await.map_err(failed)?;
        if let Verdict::Fenced { highest } = verdict {
            return Err(fenced(vdisk, epoch, highest));
        }
        if by_owner {
            self.fenced_this_run.insert((vdisk, epoch));
        }
        // An owner's fence always reaches every intake: its answer promises that the older
        // owners' records taken before it are queued on their shards. A fence raised by a
        // trim or a refused record must reach them too (they admit by the fence they know);
        // one that changed nothing need not.
        if by_owner || raised {
            let by_owner = self.fenced_this_run.contains(&(vdisk, epoch));
            self.intakes
                .broadcast(|done| IntakeWork::Fence {
                    vdisk,
                    epoch,
                    by_owner,
                    done,
                })
                .await;
        }
        Ok(())
    }

    /// The answer to a record of owner `epoch` that an intake did not admit.
    async fn refuse(&mut self, vdisk: VdiskId, epoch: u64) -> Result<(), RemoteError> {
        self.fence(vdisk, epoch, false).await?;
        if !self.fenced_this_run.contains(&(vdisk, epoch)) {
            // The owner fences every copy before it sends a record at its epoch: this node
            // restarted since, and may have missed records while it was away.
            let reason = format!(
                "vdisk {vdisk}: this copy restarted after the owner claimed the vdisk at epoch \
                 {epoch} and may have missed records; the owner must resynchronize it"
            );
            if self.stale_reported.insert((vdisk, epoch)) {
                tracing::warn!(%reason, "refusing replicated records");
            }
            return Err(remote(STALE_CODE, reason));
        }
        Err(remote(
            FAILED_CODE,
            format!(
                "vdisk {vdisk}: a record of owner epoch {epoch} arrived before its owner's fence \
                 was applied"
            ),
        ))
    }
}

fn fenced(vdisk: VdiskId, epoch: u64, highest: u64) -> RemoteError {
    remote(
        FENCED_CODE,
        format!("vdisk {vdisk}: owner epoch {epoch} is older than epoch {highest}, which this replica has seen: another node owns the vdisk now"),
    )
}

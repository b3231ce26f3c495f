//! Writes on their way into the oplog: appended without waiting (`Oplog::try_append`), in
//! arrival order, and finished when the log says every record of the write has an outcome.
//!
//! A write the log cannot take yet (it is full until a drain frees a segment, or its pending
//! batch is full) waits here, and so does every write after it, so appends keep the order in
//! which writes arrived. Whether a record is durable is asked of the log (`Oplog::outcome`),
//! not learnt from its events, so nothing depends on who consumed which event.
//!
//! A replicated write (the vdisk has a [`crate::replication::Replicator`]) also waits for
//! one replica acknowledgement per record: every record appended is queued in
//! [`LogWrites::take_outgoing`] for the controller to send, and [`LogWrites::replica_acked`]
//! counts the answers.

use super::ShardRequest;
use ashlar_core::IoError;
use ashlar_storage::fs::NodeFs;
use ashlar_storage::oplog::{Append, Backpressure, Oplog, OplogError, Seq, TryAppendError};
use bytes::Bytes;
use std::collections::VecDeque;

/// One client write (or zeroing, or the barrier after a bypass write) and its records.
pub(super) struct LogWrite {
    pub request: ShardRequest,
    /// Vdisk bytes the write covers.
    pub range: (u64, u64),
    /// Records still to append, in order.
    pieces: VecDeque<Append>,
    /// Records appended.
    seqs: Vec<Seq>,
    /// Whether each record must also be acknowledged by the vdisk's replicas.
    replicated: bool,
    /// Replica acknowledgements (one per record) still awaited.
    replicas_pending: usize,
    /// The first replica failure, if any.
    replica_error: Option<IoError>,
}

impl LogWrite {
    /// `data` at `offset`, in records of at most `max_record_bytes`.
    pub fn data(request: ShardRequest, offset: u64, data: Bytes, max_record_bytes: u64) -> Self {
        assert!(max_record_bytes > 0, "the log takes records of some size");
        let length = data.len() as u64;
        let mut pieces = VecDeque::with_capacity(length.div_ceil(max_record_bytes) as usize);
        let mut done = 0u64;
        while done < length {
            let part = (length - done).min(max_record_bytes);
            pieces.push_back(Append::Write {
                offset: offset + done,
                data: data.slice(done as usize..(done + part) as usize),
            });
            done += part;
        }
        Self::new(request, (offset, offset + length), pieces)
    }

    pub fn zeroes(request: ShardRequest, offset: u64, length: u64) -> Self {
        let pieces = VecDeque::from([Append::Zero { offset, length }]);
        Self::new(request, (offset, offset + length), pieces)
    }

    pub fn barrier(request: ShardRequest, offset: u64, length: u64) -> Self {
        let pieces = VecDeque::from([Append::Barrier { offset, length }]);
        Self::new(request, (offset, offset + length), pieces)
    }

    fn new(request: ShardRequest, range: (u64, u64), pieces: VecDeque<Append>) -> Self {
        LogWrite {
            request,
            range,
            pieces,
            seqs: Vec::new(),
            replicated: false,
            replicas_pending: 0,
            replica_error: None,
        }
    }

    /// Makes the write wait for its records' replica acknowledgements too.
    pub fn replicated(mut self) -> Self {
        assert!(
            self.pieces
                .iter()
                .all(|p| !matches!(p, Append::Barrier { .. })),
            "barriers follow bypass writes, which a replicated vdisk never makes"
        );
        self.replicated = true;
        self
    }

    /// Appends the remaining records until the log refuses one; the records of a replicated
    /// write go to `outgoing` too.
    fn append(
        &mut self,
        oplog: &Oplog<NodeFs>,
        outgoing: &mut Vec<(Seq, Append)>,
    ) -> Result<(), Refusal> {
        while let Some(piece) = self.pieces.front() {
            match oplog.try_append(piece.clone()) {
                Ok(seq) => {
                    self.seqs.push(seq);
                    let piece = self.pieces.pop_front().expect("the front piece exists");
                    if self.replicated {
                        self.replicas_pending += 1;
                        outgoing.push((seq, piece));
                    }
                }
                Err(TryAppendError::Backpressure(why)) => return Err(Refusal::Wait(why)),
                Err(TryAppendError::Rejected(error)) => return Err(Refusal::Failed(error)),
            }
        }
        Ok(())
    }

    /// The write's outcome once every record has one: the first failure, else success.
    fn outcome(&self, oplog: &Oplog<NodeFs>) -> Option<Result<(), WriteFailure>> {
        assert!(
            self.pieces.is_empty(),
            "asked for the outcome of a write not fully appended"
        );
        let mut result = Ok(());
        for seq in &self.seqs {
            match oplog.outcome(*seq)? {
                Ok(()) => {}
                Err(error) => {
                    if result.is_ok() {
                        result = Err(WriteFailure::Log(error));
                    }
                }
            }
        }
        if result.is_ok() {
            if let Some(error) = &self.replica_error {
                return Some(Err(WriteFailure::Replica(error.clone())));
            }
            if self.replicas_pending > 0 {
                return None;
            }
        }
        Some(result)
    }

    fn has_seq(&self, seq: Seq) -> bool {
        self.seqs.contains(&seq)
    }
}

/// Why a write through the log failed.
#[derive(Debug)]
pub(super) enum WriteFailure {
    /// The local oplog refused or lost it.
    Log(OplogError),
    /// A replica did not take a record.
    Replica(IoError),
}

impl From<OplogError> for WriteFailure {
    fn from(error: OplogError) -> Self {
        WriteFailure::Log(error)
    }
}

enum Refusal {
    Wait(Backpressure),
    Failed(OplogError),
}

/// A write that is done, with its outcome (to answer).
pub(super) type Finished = (LogWrite, Result<(), WriteFailure>);

#[derive(Default)]
pub(super) struct LogWrites {
    /// Not (fully) appended yet, in arrival order.
    waiting: VecDeque<LogWrite>,
    /// Every record appended, waiting for outcomes, in append order.
    committing: VecDeque<LogWrite>,
    /// Why the head of `waiting` waits.
    waiting_for: Option<Backpressure>,
    /// Records of replicated writes appended and not yet handed to the replicator, in
    /// sequence order.
    outgoing: Vec<(Seq, Append)>,
}

impl LogWrites {
    /// Takes a new write: appended at once unless writes wait before it.
    pub fn submit(&mut self, oplog: &Oplog<NodeFs>, write: LogWrite) -> Vec<Finished> {
        self.waiting.push_back(write);
        if self.waiting.len() == 1 {
            self.append_waiting(oplog)
        } else {
            Vec::new()
        }
    }

    /// Appends waiting writes in order until the log refuses one (after the log freed space
    /// or took its pending batch).
    pub fn append_waiting(&mut self, oplog: &Oplog<NodeFs>) -> Vec<Finished> {
        let mut failed = Vec::new();
        self.waiting_for = None;
        while let Some(mut write) = self.waiting.pop_front() {
            match write.append(oplog, &mut self.outgoing) {
                Ok(()) => self.committing.push_back(write),
                Err(Refusal::Wait(why)) => {
                    self.waiting.push_front(write);
                    self.waiting_for = Some(why);
                    break;
                }
                // Records of it already appended may still become durable; a failed write's
                // range may hold old or new data, as a client must expect.
                Err(Refusal::Failed(error)) => failed.push((write, Err(error.into()))),
            }
        }
        failed
    }

    /// Records to send to the replicas now, in sequence order.
    pub fn take_outgoing(&mut self) -> Vec<(Seq, Append)> {
        std::mem::take(&mut self.outgoing)
    }

    /// A replica acknowledgement (or failure) for record `seq`. A write answered meanwhile
    /// (its local append failed) is no longer here: then nothing changes.
    pub fn replica_acked(&mut self, seq: Seq, result: Result<(), IoError>) {
        let write = self
            .committing
            .iter_mut()
            .chain(self.waiting.iter_mut())
            .find(|w| w.has_seq(seq));
        let Some(write) = write else {
            return;
        };
        assert!(write.replicas_pending > 0, "one acknowledgement per record");
        write.replicas_pending -= 1;
        if let Err(error) = result {
            write.replica_error.get_or_insert(error);
        }
    }

    /// Writes whose every record has an outcome.
    pub fn take_finished(&mut self, oplog: &Oplog<NodeFs>) -> Vec<Finished> {
        // In place: records become durable in sequence, so finished writes are mostly at the
        // front, where removing is cheap. Rebuilding the queue on every call reallocated it
        // (and regrew it on the next appends): a tenth of the node's time went to malloc under
        // durable writes at QD32.
        let mut finished = Vec::new();
        let mut index = 0;
        while index < self.committing.len() {
            match self.committing[index].outcome(oplog) {
                Some(result) => {
                    let write = self.committing.remove(index).expect("index is in range");
                    finished.push((write, result));
                }
                None => index += 1,
            }
        }
        finished
    }

    /// Writes waiting because the log is full: the drain that would make room is failing,
    /// so they are answered with its error instead of waiting for it.
    pub fn take_waiting_for_space(&mut self) -> Vec<LogWrite> {
        if self.waiting_for != Some(Backpressure::Full) {
            return Vec::new();
        }
        self.waiting_for = None;
        self.waiting.drain(..).collect()
    }

    /// The log refuses writes for want of space.
    pub fn log_full(&self) -> bool {
        self.waiting_for == Some(Backpressure::Full)
    }

    pub fn len(&self) -> usize {
        self.waiting.len() + self.committing.len()
    }

    /// Whether a write in flight (waiting or committing) covers any byte of `[start, end)`.
    pub fn overlaps(&self, start: u64, end: u64) -> bool {
        self.waiting
            .iter()
            .chain(&self.committing)
            .any(|write| write.range.0 < end && start < write.range.1)
    }
}

//! Chunks held still for an online resync (`ShardOp::ResyncChunk`): the controller's
//! bookkeeping, pure (no I/O), so its rules are tested on their own.
//!
//! A resync of a chunk *holds* its range from the moment it is accepted: client writes that
//! overlap a held range (or a write already held back, so overlapping writes keep their
//! order) are *parked* instead of started. The resync waits until no write that was already
//! in flight touches its range, reads the chunk and hands it to the replicator; when that is
//! done the range is released and the parked writes that no longer overlap anything held
//! start, in the order they arrived.

use super::{overlaps, ShardOp, ShardRequest};
use std::collections::VecDeque;

/// A vdisk byte range, `[start, end)`.
pub(super) type Range = (u64, u64);

#[derive(Default)]
pub(super) struct Holds {
    /// Ranges of the resyncs accepted and not finished (waiting or running).
    held: Vec<Range>,
    /// Resyncs waiting for the writes in flight on their range to finish.
    waiting: Vec<(ShardRequest, Range)>,
    /// Client writes held back, in arrival order.
    parked: VecDeque<(ShardRequest, Range)>,
}

/// The range a write request covers (`None` for anything else).
pub(super) fn write_range(op: &ShardOp) -> Option<Range> {
    match op {
        ShardOp::Write { offset, data } => Some((*offset, offset + data.len() as u64)),
        ShardOp::WriteZeroes { offset, length, .. } => Some((*offset, offset + length)),
        _ => None,
    }
}

impl Holds {
    /// Holds `range` for the resync `request` from now on.
    pub(super) fn hold(&mut self, request: ShardRequest, range: Range) {
        self.held.push(range);
        self.waiting.push((request, range));
    }

    /// A write over `range` must wait: it meets a held range or a write held back.
    pub(super) fn must_park(&self, range: Range) -> bool {
        self.held.iter().any(|held| overlaps(*held, range))
            || self
                .parked
                .iter()
                .any(|(_, parked)| overlaps(*parked, range))
    }

    pub(super) fn park(&mut self, request: ShardRequest, range: Range) {
        self.parked.push_back((request, range));
    }

    /// The waiting resyncs whose range no write in flight touches (`busy` says whether one
    /// does): they may read their chunk now.
    pub(super) fn take_ready(
        &mut self,
        busy: impl Fn(Range) -> bool,
    ) -> Vec<(ShardRequest, Range)> {
        let (ready, still): (Vec<_>, Vec<_>) = std::mem::take(&mut self.waiting)
            .into_iter()
            .partition(|(_, range)| !busy(*range));
        self.waiting = still;
        ready
    }

    /// Ends the hold of `range` (a resync finished); returns the parked writes free to start
    /// now, in arrival order.
    pub(super) fn release(&mut self, range: Range) -> Vec<ShardRequest> {
        if let Some(at) = self.held.iter().position(|held| *held == range) {
            self.held.remove(at);
        }
        let mut free = Vec::new();
        let mut still: VecDeque<(ShardRequest, Range)> = VecDeque::new();
        for (request, range) in std::mem::take(&mut self.parked) {
            let blocked = self.held.iter().any(|held| overlaps(*held, range))
                || still.iter().any(|(_, earlier)| overlaps(*earlier, range));
            if blocked {
                still.push_back((request, range));
            } else {
                free.push(request);
            }
        }
        self.parked = still;
        free
    }

    /// Drops every waiting resync (the shard retires): their requests, to be answered, and
    /// the parked writes now free, in arrival order.
    pub(super) fn cancel_waiting(&mut self) -> (Vec<ShardRequest>, Vec<ShardRequest>) {
        let waiting = std::mem::take(&mut self.waiting);
        let mut free = Vec::new();
        let mut cancelled = Vec::new();
        for (request, range) in waiting {
            cancelled.push(request);
            free.extend(self.release(range));
        }
        (cancelled, free)
    }

    pub(super) fn parked_len(&self) -> usize {
        self.parked.len()
    }

    pub(super) fn waiting_len(&self) -> usize {
        self.waiting.len()
    }

    pub(super) fn check_invariants(&self) {
        assert!(
            self.parked.is_empty() || !self.held.is_empty(),
            "a write is held back while no range is held"
        );
        assert!(
            self.waiting.len() <= self.held.len(),
            "every waiting resync holds its range"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn write(offset: u64, length: usize) -> (ShardRequest, Range) {
        let op = ShardOp::Write {
            offset,
            data: Bytes::from(vec![1u8; length]),
        };
        let range = write_range(&op).unwrap();
        let (reply, _) = tokio::sync::oneshot::channel();
        let request = ShardRequest {
            op,
            reply,
            route: None,
        };
        (request, range)
    }

    fn offsets(requests: &[ShardRequest]) -> Vec<u64> {
        requests
            .iter()
            .map(|r| write_range(&r.op).unwrap().0)
            .collect()
    }

    #[test]
    fn writes_over_a_held_chunk_wait_and_go_on_in_order_after_it() {
        let mut holds = Holds::default();
        let (resync, _) = write(0, 1); // any request stands for the resync's
        holds.hold(resync, (0, 1 << 20));
        assert!(holds.must_park((4096, 8192)));
        assert!(!holds.must_park((1 << 20, (1 << 20) + 4096)));
        let (a, ra) = write(4096, 4096);
        let (b, rb) = write(8192, 4096);
        holds.park(a, ra);
        holds.park(b, rb);
        // A write elsewhere that overlaps a parked one waits behind it.
        assert!(holds.must_park(((1 << 20) - 4096, (1 << 20) + 4096)));
        // Writes in flight on the range: the resync is not ready.
        assert!(holds.take_ready(|_| true).is_empty());
        let ready = holds.take_ready(|_| false);
        assert_eq!(ready.len(), 1);
        holds.check_invariants();
        let free = holds.release((0, 1 << 20));
        assert_eq!(offsets(&free), vec![4096, 8192]);
        assert_eq!(holds.parked_len(), 0);
        holds.check_invariants();
    }

    #[test]
    fn a_parked_write_overlapping_another_held_chunk_keeps_waiting() {
        let mut holds = Holds::default();
        let (first, _) = write(0, 1);
        let (second, _) = write(0, 1);
        holds.hold(first, (0, 8192));
        holds.hold(second, (8192, 16384));
        let (spanning, range) = write(4096, 8192); // meets both
        holds.park(spanning, range);
        let (later, later_range) = write(20480, 4096);
        assert!(!holds.must_park(later_range));
        drop(later);
        assert!(
            holds.release((0, 8192)).is_empty(),
            "still meets the second hold"
        );
        assert_eq!(offsets(&holds.release((8192, 16384))), vec![4096]);
    }

    #[test]
    fn cancelling_frees_waiting_resyncs_and_their_parked_writes() {
        let mut holds = Holds::default();
        let (resync, _) = write(0, 1);
        holds.hold(resync, (0, 4096));
        let (a, ra) = write(0, 4096);
        holds.park(a, ra);
        let (cancelled, free) = holds.cancel_waiting();
        assert_eq!(cancelled.len(), 1);
        assert_eq!(offsets(&free), vec![0]);
        assert_eq!(holds.waiting_len(), 0);
        holds.check_invariants();
    }
}

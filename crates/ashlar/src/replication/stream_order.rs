//! Puts each stream's records back in the owner's order: pure bookkeeping, no I/O.
//!
//! A record names its predecessor (`prev_seq`, 0 for a stream's first). One that arrives
//! before its predecessor was released waits; releasing a record releases every waiting
//! one that follows it.

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;

/// Records a stream may hold out of order, waiting for an earlier one, before the stream
/// is refused (an owner has at most its in-flight limit of records outstanding).
pub const MAX_WAITING_PER_STREAM: usize = 4096;

/// What became of an offered record.
#[derive(Debug, PartialEq, Eq)]
pub enum Offered<T> {
    /// These records (the offered one first) follow each other and the last released one:
    /// apply them in this order.
    Release(Vec<T>),
    /// Waiting for its predecessor.
    Held,
    /// Refused: already released, or the stream holds too many records already.
    Refused(T, String),
}

#[derive(Default)]
struct Stream<T> {
    /// The seq of the last record released (0: none yet).
    last: u64,
    /// Records that arrived before their predecessor, by `prev_seq`.
    waiting: BTreeMap<u64, (u64, T)>,
}

/// The order of every stream one receiver sees, by stream key.
pub struct StreamOrder<K, T> {
    streams: HashMap<K, Stream<T>>,
}

impl<K: Hash + Eq + Clone + std::fmt::Debug, T> StreamOrder<K, T> {
    pub fn new() -> Self {
        StreamOrder {
            streams: HashMap::new(),
        }
    }

    pub fn offer(&mut self, key: K, seq: u64, prev_seq: u64, item: T) -> Offered<T> {
        let stream = self.streams.entry(key.clone()).or_insert_with(|| Stream {
            last: 0,
            waiting: BTreeMap::new(),
        });
        if prev_seq != stream.last {
            if seq <= stream.last {
                let reason = format!("record {seq} of stream {key:?} was already applied");
                return Offered::Refused(item, reason);
            }
            if stream.waiting.len() >= MAX_WAITING_PER_STREAM {
                let reason = format!(
                    "stream {key:?} has {MAX_WAITING_PER_STREAM} records waiting for record {}",
                    stream.last
                );
                return Offered::Refused(item, reason);
            }
            stream.waiting.insert(prev_seq, (seq, item));
            return Offered::Held;
        }
        let mut released = vec![item];
        stream.last = seq;
        while let Some((seq, item)) = stream.waiting.remove(&stream.last) {
            released.push(item);
            stream.last = seq;
        }
        Offered::Release(released)
    }

    /// Forgets the streams `gone` selects (their held records are dropped).
    pub fn forget(&mut self, gone: impl Fn(&K) -> bool) {
        self.streams.retain(|key, _| !gone(key));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn released(offered: Offered<u64>) -> Vec<u64> {
        match offered {
            Offered::Release(items) => items,
            other => panic!("expected a release, got {other:?}"),
        }
    }

    #[test]
    fn records_are_released_in_the_owners_order_whatever_order_they_arrive_in() {
        let mut order = StreamOrder::new();
        assert_eq!(order.offer("a", 3, 2, 3), Offered::Held);
        assert_eq!(order.offer("a", 2, 1, 2), Offered::Held);
        // Another stream is independent.
        assert_eq!(released(order.offer("b", 1, 0, 10)), vec![10]);
        assert_eq!(released(order.offer("a", 1, 0, 1)), vec![1, 2, 3]);
        assert_eq!(released(order.offer("a", 5, 3, 5)), vec![5]);
    }

    #[test]
    fn a_record_already_released_is_refused() {
        let mut order = StreamOrder::new();
        released(order.offer("a", 1, 0, 1));
        released(order.offer("a", 2, 1, 2));
        match order.offer("a", 1, 0, 1) {
            Offered::Refused(1, reason) => assert!(reason.contains("already applied"), "{reason}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_stream_holds_at_most_its_limit_of_waiting_records() {
        let mut order = StreamOrder::new();
        for seq in 0..MAX_WAITING_PER_STREAM as u64 {
            assert_eq!(order.offer("a", seq + 3, seq + 2, seq), Offered::Held);
        }
        match order.offer("a", u64::MAX, u64::MAX - 1, 0) {
            Offered::Refused(_, reason) => assert!(reason.contains("waiting"), "{reason}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_forgotten_stream_starts_again() {
        let mut order = StreamOrder::new();
        released(order.offer("a", 1, 0, 1));
        order.forget(|key| *key == "a");
        assert_eq!(released(order.offer("a", 1, 0, 1)), vec![1]);
    }
}

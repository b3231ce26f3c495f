//! Watches: the public `Watch` handle and the embedded store's fan-out hub
//! (history ring for replay plus the set of live watchers).

use std::collections::VecDeque;

use tokio::sync::mpsc;

use crate::error::MetaError;
use crate::types::{KeyRange, Revision, WatchEvent};

/// What travels on a watch channel: events, then possibly one terminal error.
pub type WatchItem = Result<WatchEvent, MetaError>;

/// A stream of changes in revision order.
///
/// Ends (for good) when the store closes, when the watcher falls too far
/// behind ([`MetaError::WatchLagged`]) or, for remote stores, when the
/// connection is lost and no endpoint can resume it. [`Watch::next`] reports the end as `None` and keeps
/// the reason in [`Watch::end_reason`]; [`Watch::next_event`] returns it.
#[derive(Debug)]
pub struct Watch {
    /// Replayed history, delivered before anything from `rx`. Kept outside the
    /// channel so that a replay longer than the channel is not a lag.
    backlog: VecDeque<WatchEvent>,
    rx: mpsc::Receiver<WatchItem>,
    ended: Option<MetaError>,
}

impl Watch {
    /// Wrap a receiver fed by a MetaStore implementation. The sender sends
    /// events in revision order and at most one `Err` as its last item;
    /// dropping the sender without an error ends the watch with
    /// [`MetaError::Closed`].
    pub fn from_receiver(rx: mpsc::Receiver<WatchItem>) -> Self {
        Self::with_backlog(VecDeque::new(), rx)
    }

    pub(crate) fn with_backlog(
        backlog: VecDeque<WatchEvent>,
        rx: mpsc::Receiver<WatchItem>,
    ) -> Self {
        Watch {
            backlog,
            rx,
            ended: None,
        }
    }

    /// The next event, or `None` once the watch has ended (see
    /// [`Watch::end_reason`] for why).
    pub async fn next(&mut self) -> Option<WatchEvent> {
        self.next_event().await.ok()
    }

    /// The next event, or the error that ended the watch (returned again on
    /// every later call).
    pub async fn next_event(&mut self) -> Result<WatchEvent, MetaError> {
        if let Some(ev) = self.backlog.pop_front() {
            return Ok(ev);
        }
        if let Some(err) = &self.ended {
            return Err(err.clone());
        }
        let err = match self.rx.recv().await {
            Some(Ok(ev)) => return Ok(ev),
            Some(Err(err)) => err,
            None => MetaError::Closed,
        };
        // Close our end too, so the store notices and forgets this watcher.
        self.rx.close();
        self.ended = Some(err.clone());
        Err(err)
    }

    /// Why the watch ended, once it has.
    pub fn end_reason(&self) -> Option<&MetaError> {
        self.ended.as_ref()
    }
}

struct Watcher {
    range: KeyRange,
    /// Events below this revision are not for this watcher (start revision in
    /// the future).
    min_revision: Revision,
    tx: mpsc::Sender<WatchItem>,
}

/// Fan-out of committed events to watchers, plus the replay history.
/// Lives inside the store's state mutex: `publish` is called right after a
/// commit with the lock still held, which is what puts events in revision
/// order without gaps.
pub(crate) struct WatchHub {
    history: VecDeque<WatchEvent>,
    history_limit: usize,
    /// Smallest start revision that can be replayed completely.
    first_replayable: Revision,
    watchers: Vec<Watcher>,
    channel_capacity: usize,
}

impl WatchHub {
    /// `current` is the store revision at open: nothing before it is in the
    /// (in-memory) history, so only later revisions are replayable.
    pub(crate) fn new(current: Revision, history_limit: usize, channel_capacity: usize) -> Self {
        WatchHub {
            history: VecDeque::new(),
            history_limit,
            first_replayable: current.next(),
            watchers: Vec::new(),
            channel_capacity,
        }
    }

    /// Register a watcher. `current` is the store revision now.
    pub(crate) fn subscribe(
        &mut self,
        range: KeyRange,
        start: Option<Revision>,
        current: Revision,
    ) -> Result<Watch, MetaError> {
        let start = match start {
            None | Some(Revision(0)) => current.next(),
            Some(r) if r.0 < 0 => {
                return Err(MetaError::invalid(format!(
                    "watch start revision {r} is negative"
                )))
            }
            Some(r) => r,
        };
        if start < self.first_replayable {
            return Err(MetaError::Compacted {
                requested: start,
                oldest: self.first_replayable,
            });
        }
        let backlog: VecDeque<WatchEvent> = self
            .history
            .iter()
            .filter(|ev| ev.revision() >= start && range.contains(&ev.kv.key))
            .cloned()
            .collect();
        // One slot beyond the advertised capacity is kept for the terminal
        // WatchLagged error, so it can always be delivered without blocking.
        let (tx, rx) = mpsc::channel(self.channel_capacity + 1);
        self.watchers.retain(|w| !w.tx.is_closed());
        self.watchers.push(Watcher {
            range,
            min_revision: start,
            tx,
        });
        Ok(Watch::with_backlog(backlog, rx))
    }

    /// Record and deliver the events of one committed transaction.
    pub(crate) fn publish(&mut self, events: &[WatchEvent]) {
        let capacity = self.channel_capacity;
        self.watchers.retain(|w| {
            for ev in events {
                if ev.revision() < w.min_revision || !w.range.contains(&ev.kv.key) {
                    continue;
                }
                if w.tx.is_closed() {
                    return false;
                }
                // Never block a writer on a slow reader: when only the
                // reserved slot is left, end the watch instead.
                if w.tx.capacity() <= 1 {
                    let _ = w.tx.try_send(Err(MetaError::WatchLagged { capacity }));
                    return false;
                }
                if w.tx.try_send(Ok(ev.clone())).is_err() {
                    return false;
                }
            }
            true
        });

        for ev in events {
            self.history.push_back(ev.clone());
        }
        while self.history.len() > self.history_limit {
            if let Some(old) = self.history.pop_front() {
                // Losing any event of revision r makes r no longer replayable.
                self.first_replayable = self.first_replayable.max(old.revision().next());
            }
        }
        if self.history_limit == 0 {
            if let Some(last) = events.last() {
                self.first_replayable = self.first_replayable.max(last.revision().next());
            }
        }
    }

    #[cfg(test)]
    pub(crate) fn watcher_count(&self) -> usize {
        self.watchers.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{EventKind, KeyValue};

    fn ev(key: &str, rev: i64) -> WatchEvent {
        WatchEvent {
            kind: EventKind::Put,
            kv: KeyValue {
                key: key.as_bytes().to_vec(),
                value: Vec::new(),
                create_revision: Revision(rev),
                mod_revision: Revision(rev),
                version: 1,
                lease: None,
            },
            prev: None,
        }
    }

    #[tokio::test]
    async fn history_eviction_moves_the_compaction_point() {
        let mut hub = WatchHub::new(Revision(1), 2, 8);
        hub.publish(&[ev("a", 2)]);
        hub.publish(&[ev("b", 3)]);
        hub.publish(&[ev("c", 4)]);
        // Revision 2 fell out of the ring.
        assert!(matches!(
            hub.subscribe(KeyRange::prefix(""), Some(Revision(2)), Revision(4)),
            Err(MetaError::Compacted {
                requested: Revision(2),
                oldest: Revision(3)
            })
        ));
        let mut w = hub
            .subscribe(KeyRange::prefix(""), Some(Revision(3)), Revision(4))
            .expect("replayable");
        assert_eq!(w.next().await.map(|e| e.revision()), Some(Revision(3)));
        assert_eq!(w.next().await.map(|e| e.revision()), Some(Revision(4)));
    }

    #[tokio::test]
    async fn dropped_watch_is_forgotten() {
        let mut hub = WatchHub::new(Revision(1), 10, 8);
        let w = hub
            .subscribe(KeyRange::prefix(""), None, Revision(1))
            .expect("subscribe");
        assert_eq!(hub.watcher_count(), 1);
        drop(w);
        hub.publish(&[ev("a", 2)]);
        assert_eq!(hub.watcher_count(), 0);
    }

    #[tokio::test]
    async fn future_start_revision_skips_earlier_events() {
        let mut hub = WatchHub::new(Revision(1), 10, 8);
        let mut w = hub
            .subscribe(KeyRange::prefix(""), Some(Revision(3)), Revision(1))
            .expect("subscribe");
        hub.publish(&[ev("a", 2)]);
        hub.publish(&[ev("b", 3)]);
        assert_eq!(w.next().await.map(|e| e.revision()), Some(Revision(3)));
    }
}

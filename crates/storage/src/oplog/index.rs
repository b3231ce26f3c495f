//! The in-memory index: which durable record holds the newest contents of each byte range.
//!
//! Entries never overlap. A newer record cuts older entries around its range (coalescing), so an
//! entry is always a sub-range of the record it points to. Besides the map by offset, the index
//! keeps, per segment, the set of entries pointing into it: that is what decides whether a
//! segment may be freed (rule 2) and which entries a drain takes first.

use super::{SegmentId, Seq};
use std::collections::{BTreeMap, BTreeSet};
use std::ops::Bound;

/// Where a write record's payload lives in its segment file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DataLoc {
    /// File offset of the record's first chunk CRC.
    pub crcs_at: u64,
    /// File offset of the record's first payload byte.
    pub payload_at: u64,
    /// Vdisk offset of the record's first byte (entries may start later after a split).
    pub record_offset: u64,
    pub record_length: u64,
}

/// Where the rotted bytes of a lost range are, for the error a read of it returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LostLoc {
    pub file_offset: u64,
    pub cause: LostCause,
}

/// Why a range was lost at replay.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LostCause {
    /// The record header failed its checks; the batch table named the range.
    RecordHeader,
    /// A payload chunk failed its CRC32C.
    PayloadChunk,
}

impl LostCause {
    pub fn describe(self) -> &'static str {
        match self {
            LostCause::RecordHeader => "the record header is corrupt",
            LostCause::PayloadChunk => "a payload chunk fails its CRC32C",
        }
    }
}

/// What an entry's range reads as.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TargetKind {
    Data(DataLoc),
    Zero,
    /// Acknowledged contents lost to corruption: reads fail until drained or overwritten.
    Lost(LostLoc),
}

/// The record an entry points to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Target {
    pub seq: Seq,
    /// The segment holding the record.
    pub segment: SegmentId,
    pub kind: TargetKind,
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    end: u64,
    target: Target,
}

/// One entry as seen from outside: `[start, end)` and its record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    pub start: u64,
    pub end: u64,
    pub target: Target,
}

/// A drain batch being gathered a few entries at a time ([`Index::gather_drain`]), with the
/// thread's other work running in between: the live entries of the oldest segments first, in
/// offset order within each, about `max_bytes` of data (at least one entry; zero and lost
/// entries cost nothing), until a segment boundary past `max_bytes` or an entry that would
/// exceed it.
///
/// Writes made while it gathers must not join the batch: a newer record of a range already
/// taken would put both versions in one batch, in no defined order. Entries of records past
/// `newest` (the last record in the index when the gathering began) are therefore skipped.
/// Everything taken is then part of an entry that existed when the gathering began, and no two
/// taken spans overlap, as no two entries did then.
#[derive(Debug)]
pub struct DrainCursor {
    newest: Seq,
    max_bytes: u64,
    bytes: u64,
    spans: usize,
    /// The segment being visited and the end of the last entry visited in it.
    at: Option<(SegmentId, u64)>,
    done: bool,
}

impl DrainCursor {
    /// A gathering of about `max_bytes` of entries of records up to `newest`.
    pub fn new(max_bytes: u64, newest: Seq) -> DrainCursor {
        DrainCursor {
            newest,
            max_bytes,
            bytes: 0,
            spans: 0,
            at: None,
            done: false,
        }
    }
}

#[derive(Debug, Default)]
pub struct Index {
    entries: BTreeMap<u64, Entry>,
    /// Segment id -> start offsets of the entries pointing into it. Empty sets are removed.
    by_segment: BTreeMap<SegmentId, BTreeSet<u64>>,
    live_bytes: u64,
}

impl Index {
    /// Records that `[start, end)` now reads from `target`, or, with `None` (a barrier), from
    /// the extent store. Older entries are cut around the range.
    pub fn apply(&mut self, start: u64, end: u64, target: Option<Target>) {
        self.clear_range(start, end, |_| true);
        if let Some(target) = target {
            self.insert(start, end, target);
        }
    }

    /// Drops the parts of `[start, end)` still pointing at record `seq` (a drained record);
    /// parts overwritten meanwhile by newer records stay.
    pub fn remove_if_record(&mut self, start: u64, end: u64, seq: Seq) {
        self.clear_range(start, end, |target| target.seq == seq);
    }

    /// Whether any entry overlaps `[start, end)`; allocates nothing (every read asks). An
    /// empty range overlaps nothing, as `overlapping` finds nothing in it.
    pub fn overlaps(&self, start: u64, end: u64) -> bool {
        if start >= end {
            return false;
        }
        let from_before = self
            .entries
            .range(..start)
            .next_back()
            .is_some_and(|(_, entry)| entry.end > start);
        from_before || self.entries.range(start..end).next().is_some()
    }

    /// The entries overlapping `[start, end)`, clipped to it, in offset order (none for an
    /// empty range, whatever entry it lies in).
    pub fn overlapping(&self, start: u64, end: u64) -> Vec<Span> {
        if start >= end {
            return Vec::new();
        }
        self.overlapping_starts(start, end)
            .into_iter()
            .filter_map(|s| self.entries.get(&s).map(|e| (s, *e)))
            .map(|(s, e)| Span {
                start: s.max(start),
                end: e.end.min(end),
                target: e.target,
            })
            .collect()
    }

    /// Whether any entry points into segment `id`.
    pub fn segment_is_live(&self, id: SegmentId) -> bool {
        self.by_segment.contains_key(&id)
    }

    /// Visits up to `limit` more entries for the drain batch `cursor` gathers (see
    /// [`DrainCursor`]), calling `enter` for each segment it starts on and pushing the spans it
    /// takes to `taken`. Returns true once the batch is complete.
    pub fn gather_drain(
        &self,
        cursor: &mut DrainCursor,
        limit: usize,
        mut enter: impl FnMut(SegmentId),
        taken: &mut Vec<Span>,
    ) -> bool {
        if cursor.done {
            return true;
        }
        let from = cursor
            .at
            .map_or(Bound::Unbounded, |(segment, _)| Bound::Included(segment));
        let mut visited = 0;
        for (&segment, starts) in self.by_segment.range((from, Bound::Unbounded)) {
            let lower = match cursor.at {
                // Entries never overlap, so the next one starts at or past the last one's end;
                // a part of a visited entry that a write cut off (same segment, re-inserted)
                // starts before it and is not visited twice.
                Some((at, end)) if at == segment => Bound::Included(end),
                _ => {
                    if cursor.at.is_some() && cursor.bytes >= cursor.max_bytes {
                        cursor.done = true;
                        return true;
                    }
                    enter(segment);
                    cursor.at = Some((segment, 0));
                    Bound::Unbounded
                }
            };
            for &start in starts.range((lower, Bound::Unbounded)) {
                if visited == limit {
                    return false;
                }
                visited += 1;
                let Some(entry) = self.entries.get(&start) else {
                    continue;
                };
                cursor.at = Some((segment, entry.end));
                if entry.target.seq > cursor.newest {
                    // Written after the gathering began: a later drain's.
                    continue;
                }
                let cost = match entry.target.kind {
                    TargetKind::Data(_) => entry.end - start,
                    TargetKind::Zero | TargetKind::Lost(_) => 0,
                };
                if cursor.spans > 0 && cursor.bytes.saturating_add(cost) > cursor.max_bytes {
                    cursor.done = true;
                    return true;
                }
                cursor.bytes += cost;
                cursor.spans += 1;
                taken.push(Span {
                    start,
                    end: entry.end,
                    target: entry.target,
                });
            }
        }
        cursor.done = true;
        true
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes of address space the index covers (data and zero entries).
    pub fn live_bytes(&self) -> u64 {
        self.live_bytes
    }

    fn overlapping_starts(&self, start: u64, end: u64) -> Vec<u64> {
        let mut starts = Vec::new();
        if let Some((&s, entry)) = self.entries.range(..start).next_back() {
            if entry.end > start {
                starts.push(s);
            }
        }
        starts.extend(self.entries.range(start..end).map(|(&s, _)| s));
        starts
    }

    /// Removes the parts inside `[start, end)` of the entries for which `matches` holds,
    /// re-inserting the parts outside the range.
    fn clear_range(&mut self, start: u64, end: u64, matches: impl Fn(&Target) -> bool) {
        for s in self.overlapping_starts(start, end) {
            let entry = *self
                .entries
                .get(&s)
                .expect("overlapping_starts returns starts of existing entries");
            if !matches(&entry.target) {
                continue;
            }
            self.remove(s);
            if s < start {
                self.insert(s, start, entry.target);
            }
            if entry.end > end {
                self.insert(end, entry.end, entry.target);
            }
        }
    }

    fn insert(&mut self, start: u64, end: u64, target: Target) {
        assert!(start < end, "empty index entry {start}..{end}");
        self.entries.insert(start, Entry { end, target });
        self.by_segment
            .entry(target.segment)
            .or_default()
            .insert(start);
        self.count(end - start, true);
    }

    fn remove(&mut self, start: u64) {
        let entry = self
            .entries
            .remove(&start)
            .expect("remove is called with the start of an existing entry");
        if let Some(starts) = self.by_segment.get_mut(&entry.target.segment) {
            starts.remove(&start);
            if starts.is_empty() {
                self.by_segment.remove(&entry.target.segment);
            }
        }
        self.count(entry.end - start, false);
    }

    fn count(&mut self, bytes: u64, add: bool) {
        if add {
            self.live_bytes += bytes;
        } else {
            self.live_bytes -= bytes;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn zero(seq: u64, segment: u64) -> Target {
        Target {
            seq: Seq(seq),
            segment: SegmentId(segment),
            kind: TargetKind::Zero,
        }
    }

    fn data(seq: u64, segment: u64) -> Target {
        Target {
            seq: Seq(seq),
            segment: SegmentId(segment),
            kind: TargetKind::Data(DataLoc {
                crcs_at: 0,
                payload_at: 0,
                record_offset: 0,
                record_length: 0,
            }),
        }
    }

    fn spans(index: &Index) -> Vec<(u64, u64, u64)> {
        index
            .overlapping(0, u64::MAX)
            .iter()
            .map(|s| (s.start, s.end, s.target.seq.0))
            .collect()
    }

    #[test]
    fn an_empty_range_overlaps_nothing_even_inside_an_entry() {
        let mut index = Index::default();
        index.apply(0, 100, Some(zero(1, 1)));
        assert!(index.overlapping(50, 50).is_empty());
        assert!(!index.overlaps(50, 50));
        assert!(index.overlaps(99, 100));
        assert!(index.overlaps(50, 51));
        assert!(!index.overlaps(100, 200));
        assert_eq!(index.overlapping(99, 150).len(), 1);
    }

    /// Gathers a whole drain batch one entry per turn, calling `between` after each turn.
    fn gather_by_one(
        index: &mut Index,
        max_bytes: u64,
        mut between: impl FnMut(&mut Index, usize),
    ) -> (Vec<(u64, u64, u64)>, Vec<u64>) {
        let newest = Seq(index
            .entries
            .values()
            .map(|e| e.target.seq.0)
            .max()
            .unwrap_or(0));
        let mut cursor = DrainCursor::new(max_bytes, newest);
        let (mut taken, mut entered) = (Vec::new(), Vec::new());
        let mut turn = 0;
        while !index.gather_drain(&mut cursor, 1, |s| entered.push(s.0), &mut taken) {
            between(index, turn);
            turn += 1;
        }
        let taken = taken
            .iter()
            .map(|s| (s.start, s.end, s.target.seq.0))
            .collect();
        (taken, entered)
    }

    #[test]
    fn a_drain_gathered_in_turns_takes_oldest_segments_first_within_its_budget() {
        let mut index = Index::default();
        index.apply(300, 400, Some(zero(3, 2)));
        index.apply(0, 100, Some(data(1, 1)));
        index.apply(200, 300, Some(data(2, 1)));
        index.apply(500, 600, Some(data(4, 3)));
        // Segment 1 holds 200 bytes of data: a budget of 200 ends the batch at its end.
        let (taken, entered) = gather_by_one(&mut index, 200, |_, _| {});
        assert_eq!(taken, vec![(0, 100, 1), (200, 300, 2)]);
        assert_eq!(entered, vec![1]);
        // With 250, segment 2's zero entry costs nothing; segment 3's entry would pass the
        // budget (its segment is entered, and pinned, all the same).
        let (taken, entered) = gather_by_one(&mut index, 250, |_, _| {});
        assert_eq!(taken, vec![(0, 100, 1), (200, 300, 2), (300, 400, 3)]);
        assert_eq!(entered, vec![1, 2, 3]);
        // Always at least one entry, even past the budget.
        let (taken, _) = gather_by_one(&mut index, 10, |_, _| {});
        assert_eq!(taken, vec![(0, 100, 1)]);
    }

    #[test]
    fn writes_between_turns_stay_out_of_the_drain_and_nothing_is_taken_twice() {
        let mut index = Index::default();
        index.apply(0, 100, Some(data(1, 1)));
        index.apply(100, 200, Some(data(2, 1)));
        index.apply(200, 300, Some(data(3, 1)));
        let (taken, _) = gather_by_one(&mut index, u64::MAX, |index, turn| {
            if turn == 0 {
                // A newer record over the end of the first entry (taken) and the start of
                // the second (not yet): the cut-off part of the first is re-inserted behind
                // the cursor, the new record is newer than the drain.
                index.apply(50, 150, Some(data(4, 2)));
            }
        });
        assert_eq!(taken, vec![(0, 100, 1), (150, 200, 2), (200, 300, 3)]);
        for pair in taken.windows(2) {
            assert!(pair[0].1 <= pair[1].0, "drain items overlap: {taken:?}");
        }
    }

    #[test]
    fn newer_records_cut_older_entries() {
        let mut index = Index::default();
        index.apply(0, 100, Some(zero(1, 1)));
        index.apply(20, 30, Some(zero(2, 2)));
        assert_eq!(spans(&index), vec![(0, 20, 1), (20, 30, 2), (30, 100, 1)]);
        index.apply(10, 40, None);
        assert_eq!(spans(&index), vec![(0, 10, 1), (40, 100, 1)]);
        assert!(!index.segment_is_live(SegmentId(2)));
        assert_eq!(index.live_bytes(), 70);
        index.apply(0, 100, Some(zero(3, 2)));
        assert!(!index.segment_is_live(SegmentId(1)));
        assert_eq!(spans(&index), vec![(0, 100, 3)]);
    }

    #[test]
    fn drain_removal_keeps_overwritten_parts() {
        let mut index = Index::default();
        index.apply(0, 100, Some(zero(1, 1)));
        index.apply(50, 60, Some(zero(2, 1)));
        index.remove_if_record(0, 100, Seq(1));
        assert_eq!(spans(&index), vec![(50, 60, 2)]);
        assert_eq!(index.live_bytes(), 10);
    }
}

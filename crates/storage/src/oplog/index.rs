//! The in-memory index: which durable record holds the newest contents of each byte range.
//!
//! Entries never overlap. A newer record cuts older entries around its range (coalescing), so an
//! entry is always a sub-range of the record it points to. Besides the map by offset, the index
//! keeps, per segment, the set of entries pointing into it: that is what decides whether a
//! segment may be freed (rule 2) and which entries a drain takes first.

use super::{SegmentId, Seq};
use std::collections::{BTreeMap, BTreeSet};

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

    /// Live segments, oldest first, each with its entries in offset order.
    pub fn segments(
        &self,
    ) -> impl Iterator<Item = (SegmentId, impl Iterator<Item = Span> + '_)> + '_ {
        self.by_segment.iter().map(move |(&id, starts)| {
            let spans = starts.iter().filter_map(move |&s| {
                self.entries.get(&s).map(|e| Span {
                    start: s,
                    end: e.end,
                    target: e.target,
                })
            });
            (id, spans)
        })
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

//! Which vdisk ranges a replay could still bring back.
//!
//! A drained record stays in its segment until the segment is freed, and replay applies it
//! again (rule 2 of docs/oplog-format.md). A write that goes straight to the extent store
//! therefore needs a barrier record only while some segment not yet durably freed holds a
//! write or zero record of its range; this map answers that without reading the segments.
//!
//! It keeps, per granule of the vdisk touched by such a record, the newest segment holding
//! one. Segments are freed strictly oldest first, so a granule whose newest segment is older
//! than the oldest segment not yet durably freed holds nothing a replay would read. Records
//! spanning more than [`MAX_GRANULES_PER_RECORD`] granules (a zeroing of a whole vdisk, say)
//! are kept as ranges instead, so the map's size follows the number of records in the log,
//! never the size of the vdisk.

use super::SegmentId;
use std::collections::HashMap;

/// Records touching more granules than this are kept as one range each.
const MAX_GRANULES_PER_RECORD: u64 = 64;

pub(super) struct ReplayReach {
    granule_bytes: u64,
    /// Granule index → newest segment holding a write or zero record touching it.
    newest: HashMap<u64, SegmentId>,
    /// Wide records: `(start, end, segment)`.
    wide: Vec<(u64, u64, SegmentId)>,
}

impl ReplayReach {
    pub fn new(granule_bytes: u64) -> Self {
        assert!(granule_bytes > 0, "a replay-reach granule has a size");
        ReplayReach {
            granule_bytes,
            newest: HashMap::new(),
            wide: Vec::new(),
        }
    }

    /// Segment `segment` holds a write or zero record of `[start, end)` (or replay found one
    /// there).
    pub fn note(&mut self, start: u64, end: u64, segment: SegmentId) {
        if start >= end {
            return;
        }
        let (first, last) = (start / self.granule_bytes, (end - 1) / self.granule_bytes);
        if last - first >= MAX_GRANULES_PER_RECORD {
            self.wide.push((start, end, segment));
            return;
        }
        for granule in first..=last {
            let newest = self.newest.entry(granule).or_insert(segment);
            *newest = (*newest).max(segment);
        }
    }

    /// Whether a segment at or after `oldest_unfreed` holds a record overlapping
    /// `[start, end)`. `None`: every segment is freed.
    pub fn reaches(&self, start: u64, end: u64, oldest_unfreed: Option<SegmentId>) -> bool {
        let Some(oldest) = oldest_unfreed else {
            return false;
        };
        if start >= end {
            return false;
        }
        let (first, last) = (start / self.granule_bytes, (end - 1) / self.granule_bytes);
        let in_granules = if last - first < self.newest.len() as u64 {
            (first..=last).any(|g| self.newest.get(&g).is_some_and(|s| *s >= oldest))
        } else {
            self.newest
                .iter()
                .any(|(g, s)| *s >= oldest && (first..=last).contains(g))
        };
        in_granules
            || self
                .wide
                .iter()
                .any(|&(s, e, segment)| segment >= oldest && s < end && start < e)
    }

    /// Drops what only segments older than `oldest_unfreed` held (they are freed durably).
    pub fn forget_before(&mut self, oldest_unfreed: Option<SegmentId>) {
        match oldest_unfreed {
            None => {
                self.newest.clear();
                self.wide.clear();
            }
            Some(oldest) => {
                self.newest.retain(|_, s| *s >= oldest);
                self.wide.retain(|&(_, _, s)| s >= oldest);
            }
        }
    }

    /// Granules and wide ranges remembered (for tests of the bound).
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.newest.len() + self.wide.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: u64 = 4096;

    #[test]
    fn a_range_is_reached_while_its_segment_is_unfreed() {
        let mut reach = ReplayReach::new(G);
        reach.note(G, 3 * G, SegmentId(5));
        assert!(reach.reaches(2 * G, 2 * G + 1, Some(SegmentId(5))));
        assert!(reach.reaches(0, 2 * G, Some(SegmentId(3))));
        // Segment 5 freed: the oldest unfreed one is newer.
        assert!(!reach.reaches(G, 3 * G, Some(SegmentId(6))));
        assert!(!reach.reaches(G, 3 * G, None));
        // Neighbouring granules are not touched.
        assert!(!reach.reaches(0, G, Some(SegmentId(1))));
        assert!(!reach.reaches(3 * G, 4 * G, Some(SegmentId(1))));
        assert!(
            !reach.reaches(2 * G, 2 * G, Some(SegmentId(1))),
            "an empty range"
        );
    }

    #[test]
    fn the_newest_segment_of_a_granule_counts() {
        let mut reach = ReplayReach::new(G);
        reach.note(0, G, SegmentId(7));
        reach.note(0, G, SegmentId(4));
        assert!(reach.reaches(0, G, Some(SegmentId(6))));
        reach.forget_before(Some(SegmentId(8)));
        assert_eq!(reach.len(), 0);
        assert!(!reach.reaches(0, G, Some(SegmentId(8))));
    }

    #[test]
    fn wide_records_are_ranges_not_granules() {
        let mut reach = ReplayReach::new(G);
        reach.note(0, 1 << 40, SegmentId(2));
        assert_eq!(reach.len(), 1);
        assert!(reach.reaches((1 << 40) - 1, 1 << 40, Some(SegmentId(2))));
        assert!(!reach.reaches(1 << 40, (1 << 40) + G, Some(SegmentId(2))));
        // A query wider than the granules remembered scans them instead of the range.
        reach.note(5 * G, 6 * G, SegmentId(3));
        assert!(reach.reaches(0, u64::MAX, Some(SegmentId(3))));
        reach.forget_before(Some(SegmentId(3)));
        assert_eq!(reach.len(), 1);
        reach.forget_before(None);
        assert_eq!(reach.len(), 0);
    }
}

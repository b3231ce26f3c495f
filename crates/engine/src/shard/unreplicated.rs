//! The chunks a shard wrote that its copies may not hold: every chunk a replicated write
//! failed on (locally, on a copy, or not knowing which). A later claim by the same node
//! catches the copies up on these chunks alone instead of comparing the whole vdisk
//! (`docs/replication.md`, "Catching up"): a write that succeeded is durable on every copy,
//! so only a failed one can leave the copies different.
//!
//! The set starts *unknown* (a new controller cannot know what failed before it existed) and
//! becomes unknown again past [`MAX_UNREPLICATED_CHUNKS`]; unknown means "compare
//! everything". Taking the set (at a claim, with no write in flight) starts it again empty.

use std::collections::BTreeSet;

/// Bytes per chunk of the set: the resync's chunk.
pub const UNREPLICATED_CHUNK_BYTES: u64 = 1 << 20;
/// Chunks a shard remembers before it gives up and calls the set unknown (4 GiB of failed
/// writes; at most ~40 bytes each in memory).
pub const MAX_UNREPLICATED_CHUNKS: usize = 4096;

#[derive(Debug, Default)]
pub struct UnreplicatedChunks {
    /// `None`: unknown (a controller's start, or past the limit).
    chunks: Option<BTreeSet<u64>>,
}

impl UnreplicatedChunks {
    /// Notes that the write of `[offset, end)` failed.
    pub fn mark(&mut self, offset: u64, end: u64) {
        let Some(chunks) = &mut self.chunks else {
            return;
        };
        if end <= offset {
            return;
        }
        let first = offset / UNREPLICATED_CHUNK_BYTES;
        let last = (end - 1) / UNREPLICATED_CHUNK_BYTES;
        if last - first >= MAX_UNREPLICATED_CHUNKS as u64 {
            self.chunks = None;
            return;
        }
        chunks.extend(first..=last);
        if chunks.len() > MAX_UNREPLICATED_CHUNKS {
            self.chunks = None;
        }
    }

    /// The chunk indexes noted since the last take (`None`: unknown), and a fresh, empty
    /// and known set from now on.
    pub fn take(&mut self) -> Option<Vec<u64>> {
        let taken = self.chunks.replace(BTreeSet::new());
        taken.map(|chunks| chunks.into_iter().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = UNREPLICATED_CHUNK_BYTES;

    #[test]
    fn a_new_set_is_unknown_until_taken_then_collects_the_chunks_of_failed_writes() {
        let mut set = UnreplicatedChunks::default();
        set.mark(0, 4096);
        assert_eq!(set.take(), None, "a new controller cannot know");
        // A write across a chunk boundary marks both chunks; one inside a chunk, one.
        set.mark(MIB - 512, MIB + 512);
        set.mark(5 * MIB + 4096, 5 * MIB + 8192);
        set.mark(5 * MIB, 5 * MIB + 4096);
        assert_eq!(set.take(), Some(vec![0, 1, 5]));
        assert_eq!(set.take(), Some(vec![]), "taking empties it");
    }

    #[test]
    fn past_the_limit_the_set_is_unknown_until_taken_again() {
        let mut set = UnreplicatedChunks::default();
        set.take();
        for chunk in 0..=MAX_UNREPLICATED_CHUNKS as u64 {
            set.mark(chunk * MIB, chunk * MIB + 1);
        }
        assert_eq!(set.take(), None);
        set.mark(0, (MAX_UNREPLICATED_CHUNKS as u64 + 1) * MIB);
        assert_eq!(
            set.take(),
            None,
            "one huge failed write is too many chunks too"
        );
        set.mark(3 * MIB, 3 * MIB + 1);
        assert_eq!(set.take(), Some(vec![3]));
    }
}

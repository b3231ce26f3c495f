//! The read cache: one per reactor, so only that reactor's shard controllers touch it (no
//! locks). Two pools, as in DSF's unified cache: a block read once enters the single-touch pool;
//! a second hit promotes it to the multi-touch pool, so one large scan cannot flush the blocks a
//! workload reads again and again. Blocks evicted from the multi-touch pool get a second chance
//! in the single-touch pool.
//!
//! The pools share one capacity: nothing is evicted while the cache has room, whichever pool
//! holds the blocks. Once it is full, the multi-touch pool gives back what it holds beyond its
//! share (half the capacity) first, then the single-touch pool's oldest blocks go. So a scan
//! never takes the multi-touch pool below its share, and a working set that fits the cache
//! costs one lookup per hit (a hard split made every block of a set larger than half the
//! cache move between the pools on every hit).
//!
//! Only reads of up to [`MAX_FILLING_READ_BYTES`] fill the cache: longer ones are scans.

use crate::lru::Lru;
use ashlar_core::{Epoch, VdiskId};
use ashlar_storage::fs::DiskBuf;
use bytes::Bytes;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Reads longer than this do not fill the cache. Such reads are scans (a backup, a copy,
/// sequential read-ahead) whose blocks are rarely read again soon. Caching them also cost the
/// scan itself: each cached block is a 4 KiB slice of its read's buffer, so the cache kept
/// whole 1 MiB buffers alive until every slice was evicted, every read needed fresh memory,
/// and the pools churned 256 entries per read. Cold 1 MiB sequential reads at QD8 ran at
/// 790-1,000 MiB/s with the fills and 900-1,560 without (bench/results/20261128-074500-vm).
/// Random reads of databases and file systems (4-256 KiB) still fill it.
pub const MAX_FILLING_READ_BYTES: u64 = 256 << 10;

/// A cached 4 KiB block. The shard-map epoch is part of the key: when shards are re-created
/// the new controllers never see blocks cached under an older epoch, which may be stale.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CacheKey {
    pub vdisk: VdiskId,
    pub epoch: Epoch,
    pub block: u64,
}

/// Counters readable from any thread (the stats endpoint), written only by the owning reactor.
#[derive(Default, Debug)]
pub struct CacheCounters {
    pub single_touch_hits: AtomicU64,
    pub multi_touch_hits: AtomicU64,
    pub misses: AtomicU64,
    pub single_touch_bytes: AtomicU64,
    pub multi_touch_bytes: AtomicU64,
    pub capacity_bytes: AtomicU64,
}

pub struct BlockCache {
    single_touch: Lru<CacheKey, Bytes>,
    multi_touch: Lru<CacheKey, Bytes>,
    capacity_bytes: u64,
    /// What a full cache keeps of the multi-touch pool whatever the single-touch pool reads.
    multi_touch_share_bytes: u64,
    block_bytes: u64,
    counters: Arc<CacheCounters>,
}

impl BlockCache {
    /// The multi-touch pool's share is half of `capacity_bytes`.
    pub fn new(capacity_bytes: u64, block_bytes: u64) -> Self {
        let counters = Arc::new(CacheCounters::default());
        counters
            .capacity_bytes
            .store(capacity_bytes, Ordering::Relaxed);
        BlockCache {
            single_touch: Lru::new(),
            multi_touch: Lru::new(),
            capacity_bytes,
            multi_touch_share_bytes: capacity_bytes - capacity_bytes / 2,
            block_bytes,
            counters,
        }
    }

    pub fn counters(&self) -> Arc<CacheCounters> {
        self.counters.clone()
    }

    pub fn get(&mut self, key: &CacheKey) -> Option<Bytes> {
        if let Some(block) = self.multi_touch.get(key) {
            let block = block.clone();
            self.counters
                .multi_touch_hits
                .fetch_add(1, Ordering::Relaxed);
            return Some(block);
        }
        if let Some(block) = self.single_touch.remove(key) {
            self.counters
                .single_touch_hits
                .fetch_add(1, Ordering::Relaxed);
            // A block cached from a large read is a slice of that read's buffer. Its
            // neighbours leave the single-touch pool together, but a promoted block may stay
            // for long: it gets a buffer of its own, so the pool never keeps a whole read's
            // buffer alive for one block (the cache's memory is then its size, not up to 256
            // times that). Its copy is a slot of the node's small buffers, not a heap block
            // (see `ashlar_storage::fs::small_buffers`).
            let own = DiskBuf::copy_of(&block).into_bytes();
            self.multi_touch.insert(*key, own.clone());
            self.enforce_limits();
            return Some(own);
        }
        self.counters.misses.fetch_add(1, Ordering::Relaxed);
        None
    }

    /// Caches a block just read from the extent store. A block the multi-touch pool already
    /// holds stays there as it is: the read brought the same bytes (a write drops the block
    /// from the cache, and a read that overlapped a write caches nothing), and a fill is not a
    /// hit. Reads that do not look in the cache first (over 128 KiB, or not all cached) used to
    /// move such blocks back to the single-touch pool, so a scan demoted the hot blocks and
    /// then evicted them (reads over [`MAX_FILLING_READ_BYTES`] no longer fill at all).
    pub fn insert(&mut self, key: CacheKey, block: Bytes) {
        debug_assert_eq!(block.len() as u64, self.block_bytes);
        if self.capacity_bytes < self.block_bytes || self.multi_touch.contains(&key) {
            return;
        }
        self.single_touch.insert(key, block);
        self.enforce_limits();
    }

    /// Drops a block whose data changed.
    pub fn invalidate(&mut self, key: &CacheKey) {
        if self.single_touch.remove(key).is_none() {
            self.multi_touch.remove(key);
        }
        self.publish_sizes();
    }

    fn enforce_limits(&mut self) {
        while self.bytes(&self.single_touch) + self.bytes(&self.multi_touch) > self.capacity_bytes {
            if self.bytes(&self.multi_touch) > self.multi_touch_share_bytes {
                let (key, block) = self.multi_touch.pop_lru().expect("a pool over its share");
                self.single_touch.insert(key, block);
            } else if self.single_touch.pop_lru().is_none() {
                self.multi_touch.pop_lru();
            }
        }
        debug_assert!(
            self.bytes(&self.single_touch) + self.bytes(&self.multi_touch) <= self.capacity_bytes
        );
        self.publish_sizes();
    }

    fn bytes(&self, pool: &Lru<CacheKey, Bytes>) -> u64 {
        pool.len() as u64 * self.block_bytes
    }

    fn publish_sizes(&self) {
        let c = &self.counters;
        c.single_touch_bytes
            .store(self.bytes(&self.single_touch), Ordering::Relaxed);
        c.multi_touch_bytes
            .store(self.bytes(&self.multi_touch), Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(block: u64) -> CacheKey {
        CacheKey {
            vdisk: VdiskId(1),
            epoch: Epoch(1),
            block,
        }
    }

    fn block(fill: u8) -> Bytes {
        Bytes::from(vec![fill; 4096])
    }

    #[test]
    fn second_hit_promotes_and_scans_do_not_evict_hot_blocks() {
        let mut cache = BlockCache::new(8 * 4096, 4096);
        cache.insert(key(0), block(0));
        assert!(cache.get(&key(0)).is_some()); // promoted to multi-touch
        for b in 1..100 {
            cache.insert(key(b), block(b as u8)); // a scan through single-touch
        }
        assert_eq!(cache.get(&key(0)).unwrap()[0], 0);
        let counters = cache.counters();
        assert_eq!(
            counters.single_touch_bytes.load(Ordering::Relaxed),
            7 * 4096
        );
        assert_eq!(counters.multi_touch_bytes.load(Ordering::Relaxed), 4096);
    }

    #[test]
    fn a_scan_of_large_reads_leaves_hot_blocks_hot() {
        let mut cache = BlockCache::new(8 * 4096, 4096);
        for b in 0..2 {
            cache.insert(key(b), block(b as u8));
            assert!(cache.get(&key(b)).is_some()); // promoted to multi-touch
        }
        // A scan whose reads skip the lookup fills every block it reads, the hot ones too.
        for b in 0..100 {
            cache.insert(key(b), block(b as u8));
        }
        let counters = cache.counters();
        assert_eq!(counters.multi_touch_bytes.load(Ordering::Relaxed), 2 * 4096);
        for b in 0..2 {
            assert_eq!(cache.get(&key(b)).unwrap()[0], b as u8);
        }
        assert_eq!(counters.multi_touch_hits.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn a_working_set_that_fits_stays_whole_and_a_scan_takes_only_what_exceeds_the_share() {
        let mut cache = BlockCache::new(8 * 4096, 4096);
        // Six blocks read twice: more than the multi-touch pool's share, less than the cache.
        for b in 0..6 {
            cache.insert(key(b), block(b as u8));
            assert!(cache.get(&key(b)).is_some());
        }
        for round in 0..3 {
            for b in 0..6 {
                assert!(cache.get(&key(b)).is_some(), "round {round}, block {b}");
            }
        }
        let counters = cache.counters();
        assert_eq!(counters.multi_touch_bytes.load(Ordering::Relaxed), 6 * 4096);
        assert_eq!(counters.multi_touch_hits.load(Ordering::Relaxed), 18);
        // A scan: the multi-touch pool keeps its share, its most recently used blocks.
        for b in 100..200 {
            cache.insert(key(b), block(b as u8));
        }
        assert_eq!(counters.multi_touch_bytes.load(Ordering::Relaxed), 4 * 4096);
        assert_eq!(
            counters.single_touch_bytes.load(Ordering::Relaxed),
            4 * 4096
        );
        for b in 2..6 {
            assert_eq!(cache.get(&key(b)).unwrap()[0], b as u8);
        }
    }

    /// An owner that records when the buffer it owns is freed.
    struct Tracked(Vec<u8>, Arc<std::sync::atomic::AtomicBool>);

    impl AsRef<[u8]> for Tracked {
        fn as_ref(&self) -> &[u8] {
            &self.0
        }
    }

    impl Drop for Tracked {
        fn drop(&mut self) {
            self.1.store(true, Ordering::SeqCst);
        }
    }

    #[test]
    fn a_promoted_block_does_not_keep_its_reads_buffer_alive() {
        let mut cache = BlockCache::new(8 * 4096, 4096);
        let freed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let read = Bytes::from_owner(Tracked(vec![7u8; 4 * 4096], freed.clone()));
        for b in 0..4 {
            cache.insert(
                key(b),
                read.slice(b as usize * 4096..(b as usize + 1) * 4096),
            );
        }
        drop(read);
        assert!(cache.get(&key(1)).is_some()); // promoted
        for b in 100..110 {
            cache.insert(key(b), block(b as u8)); // the read's other blocks leave
        }
        assert!(cache.get(&key(0)).is_none());
        assert!(
            freed.load(Ordering::SeqCst),
            "the read's buffer is freed once only the promoted block is left"
        );
        assert_eq!(cache.get(&key(1)).unwrap()[..], [7u8; 4096][..]);
    }

    #[test]
    fn invalidate_removes_from_either_pool() {
        let mut cache = BlockCache::new(8 * 4096, 4096);
        cache.insert(key(1), block(1));
        cache.insert(key(2), block(2));
        cache.get(&key(2));
        cache.invalidate(&key(1));
        cache.invalidate(&key(2));
        assert!(cache.get(&key(1)).is_none());
        assert!(cache.get(&key(2)).is_none());
    }

    #[test]
    fn zero_capacity_caches_nothing() {
        let mut cache = BlockCache::new(0, 4096);
        cache.insert(key(1), block(1));
        assert!(cache.get(&key(1)).is_none());
    }
}

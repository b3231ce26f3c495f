//! Memory for large [`super::DiskBuf`]s (above [`super::small_buffers::SMALL_BUFFER_MAX_BYTES`],
//! in mappings of at least [`LARGE_BUFFER_MIN_BYTES`]): each buffer is a mapping of its own
//! (or a piece of a huge page, given back to the kernel on its own), and a dropped one waits
//! on a node-wide free list for the next buffer of its size class (a
//! large read's target, an oplog batch) instead of going back to the kernel, up to a
//! configurable total ([`set_free_limit_bytes`]). If the kernel refuses a new mapping, the
//! buffer comes from the heap instead (`anonymous_mapping`).
//!
//! Why not the allocator: a read buffer must be 4 KiB-aligned, and glibc serves an aligned
//! 1 MiB request from a chunk larger than the 1 MiB one that was just freed, so freed read
//! buffers were never reused; the heap grew and every read faulted in fresh pages. A node
//! restarted on written data and read sequentially with 1 MiB reads spent 74-76 % of its
//! samples zeroing those pages (`clear_page_erms`), read 447-753 MiB/s (1.0-1.24 GiB/s with
//! the buffers kept) and its RSS grew without bound (4.0 GiB after 8 s). Pages of a reused
//! buffer are already faulted in, and a mapping of its own gives all of its memory back when
//! it is unmapped.
//!
//! Why huge pages: the kernel splits a direct read or write into one segment per physically
//! contiguous piece of its buffer. A 1 MiB buffer of scattered 4 KiB pages is 256 segments,
//! more than a request may have (virtio-blk: 254), so it becomes two requests; and a virtio
//! queue without indirect descriptors spends a ring slot per segment, so one such request
//! fills a 256-slot ring and the next waits (the test VM's disk: cold 1 MiB reads at QD2 kept
//! 0.9 requests in the disk, raw fio 1.7; bench/results/20261129-182310-vm). Buffers carved from
//! a huge page are one segment each. (This was the "cause not found" of
//! bench/results/20261128-010000-vm: fresh heap memory happened to be contiguous.)
//!
//! The free list is shared by every thread (a buffer filled on one reactor is often dropped
//! on another, after its reply is sent), behind one mutex taken once per large buffer
//! allocated and dropped: a few thousand times a second, never per 4 KiB block.

use super::anonymous_mapping::{self, unmap, HUGE_PAGE_BYTES};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// Smallest mapping made here: the size class of every buffer from just above
/// `SMALL_BUFFER_MAX_BYTES` to this.
pub const LARGE_BUFFER_MIN_BYTES: usize = 64 << 10;

/// Default of [`set_free_limit_bytes`]: 64 of the 1 MiB buffers of sequential reads.
pub const DEFAULT_FREE_LIMIT_BYTES: usize = 64 << 20;

static FREE_LIMIT_BYTES: AtomicUsize = AtomicUsize::new(DEFAULT_FREE_LIMIT_BYTES);
static FREE: Mutex<FreeList> = Mutex::new(FreeList::new());

/// Sets how many bytes of dropped large buffers the process keeps for reuse (0: none).
/// Buffers kept beyond a lowered limit are released at once.
pub fn set_free_limit_bytes(bytes: usize) {
    FREE_LIMIT_BYTES.store(bytes, Ordering::Relaxed);
    FREE.lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .shrink_to(bytes);
}

/// The limit [`set_free_limit_bytes`] set.
pub fn free_limit_bytes() -> usize {
    FREE_LIMIT_BYTES.load(Ordering::Relaxed)
}

/// Bytes of large buffers kept for reuse now.
pub fn free_bytes() -> usize {
    FREE.lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .bytes
}

/// The mapping size a buffer of `len` bytes gets: a power of two, so a freed buffer serves
/// every later request of its class.
pub(super) fn class_bytes(len: usize) -> usize {
    len.max(LARGE_BUFFER_MIN_BYTES).next_power_of_two()
}

/// A buffer of `class_bytes(len)` bytes, page-aligned, its bytes unspecified (zeros when
/// freshly mapped, a former reader's data when reused); `None` if none is free and the kernel
/// refuses a new mapping (the caller then uses the heap).
pub(super) fn take(len: usize) -> Option<NonNull<u8>> {
    let class = class_bytes(len);
    if let Some(ptr) = lock().pop(class) {
        return Some(ptr);
    }
    map_new(class)
}

/// A new buffer of `class` bytes, in huge pages where the kernel has them (see the module
/// comment): a class of a huge page or more is a huge-page-aligned mapping of its own; a
/// smaller one is carved from a new huge page when [`carves`] says so, its other pieces going
/// to the free list as far as it has room (the rest are given back at once), else it is a
/// mapping of ordinary pages.
fn map_new(class: usize) -> Option<NonNull<u8>> {
    if class >= HUGE_PAGE_BYTES {
        return anonymous_mapping::map_huge_aligned(class)
            .or_else(|| anonymous_mapping::map(class));
    }
    let limit = FREE_LIMIT_BYTES.load(Ordering::Relaxed);
    if !carves(class, lock().bytes, limit) {
        return anonymous_mapping::map(class);
    }
    let Some(chunk) = anonymous_mapping::map_huge_aligned(HUGE_PAGE_BYTES) else {
        return anonymous_mapping::map(class);
    };
    // Fault the huge page in while the whole chunk is still one mapping: a piece given back
    // splits the mapping, and the other pieces keep their (contiguous) pages.
    // SAFETY: the chunk is mapped, writable and unused; it reads as zeros, so writing a zero
    // changes nothing but the fault.
    unsafe { chunk.as_ptr().write_volatile(0) };
    let base = chunk.as_ptr() as usize;
    let mut unkept = Vec::new();
    {
        let mut free = lock();
        for index in 1..HUGE_PAGE_BYTES / class {
            let piece = NonNull::new((base + index * class) as *mut u8).expect("non-zero");
            if free.bytes + class <= limit {
                free.push(class, piece);
            } else {
                unkept.push(piece);
            }
        }
    }
    for piece in unkept {
        // SAFETY: a piece of the chunk, never handed out.
        unsafe { unmap(piece, class) };
    }
    Some(chunk)
}

/// Whether a new buffer of `class` (under a huge page) is carved from a huge page, with the
/// free list holding `free_bytes` of at most `limit_bytes`. Carving faults in and zeroes the
/// whole huge page. For a class of a quarter of a huge page or more that costs at most four
/// times the buffer, in one fault instead of one per 4 KiB page, and the buffer is large
/// enough for its segment count to matter: always. A smaller class is carved only when the
/// list has room for every other piece; otherwise (a list full of other classes, or a limit
/// of 0) each new 64 KiB buffer would zero 2 MiB.
fn carves(class: usize, free_bytes: usize, limit_bytes: usize) -> bool {
    let spare_bytes = HUGE_PAGE_BYTES - class;
    class >= HUGE_PAGE_BYTES / 4 || free_bytes + spare_bytes <= limit_bytes
}

/// Hands back a buffer `take` gave for a `len` of this class.
///
/// # Safety
/// `ptr` came from [`take`] with the same class, and nothing uses it any more.
pub(super) unsafe fn give_back(ptr: NonNull<u8>, len: usize) {
    let class = class_bytes(len);
    let limit = FREE_LIMIT_BYTES.load(Ordering::Relaxed);
    let mut free = lock();
    if free.bytes + class <= limit {
        free.push(class, ptr);
        return;
    }
    drop(free);
    // SAFETY: passed on from our caller; the list does not hold it.
    unsafe { unmap(ptr, class) };
}

fn lock() -> std::sync::MutexGuard<'static, FreeList> {
    // A panic while the lock was held cannot leave the list half-changed (each change is one
    // push or pop with its byte count), so a poisoned list is still sound.
    FREE.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Free buffers by class (index: log2 of the class size).
struct FreeList {
    by_class: [Vec<usize>; 40],
    bytes: usize,
}

impl FreeList {
    const fn new() -> FreeList {
        FreeList {
            by_class: [const { Vec::new() }; 40],
            bytes: 0,
        }
    }

    fn pop(&mut self, class: usize) -> Option<NonNull<u8>> {
        let address = self.by_class[class.trailing_zeros() as usize].pop()?;
        self.bytes -= class;
        NonNull::new(address as *mut u8)
    }

    fn push(&mut self, class: usize, ptr: NonNull<u8>) {
        self.by_class[class.trailing_zeros() as usize].push(ptr.as_ptr() as usize);
        self.bytes += class;
    }

    /// Releases buffers, largest classes first, until at most `limit` bytes are kept.
    fn shrink_to(&mut self, limit: usize) {
        for index in (0..self.by_class.len()).rev() {
            let class = 1usize << index;
            while self.bytes > limit {
                let Some(address) = self.by_class[index].pop() else {
                    break;
                };
                self.bytes -= class;
                let ptr = NonNull::new(address as *mut u8).expect("a kept buffer");
                // SAFETY: kept buffers are mappings of their class size and unused.
                unsafe { unmap(ptr, class) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // The free list is process-wide, so these tests use sizes no other test of this crate
    // asks for and check only what other threads cannot change.

    #[test]
    fn a_dropped_buffer_serves_the_next_request_of_its_class() {
        let len = 48 << 20; // class 64 MiB, a size no other test reads
        set_free_limit_bytes(1 << 30);
        let first = take(len).expect("a mapping");
        // SAFETY: the buffer is mapped, 64 MiB long, and unused.
        unsafe { first.as_ptr().add(len - 1).write(7) };
        unsafe { give_back(first, len) };
        let second = take(len - 4096).expect("the kept buffer");
        assert_eq!(second, first, "the kept buffer is reused");
        // SAFETY: the same mapping; its pages stayed faulted in with the old bytes.
        assert_eq!(unsafe { second.as_ptr().add(len - 1).read() }, 7);
        unsafe { give_back(second, len) };
        set_free_limit_bytes(DEFAULT_FREE_LIMIT_BYTES);
        assert!(free_bytes() <= DEFAULT_FREE_LIMIT_BYTES);
    }

    #[test]
    fn buffers_below_a_huge_page_are_carved_from_one() {
        let len = 200 << 10; // class 256 KiB, a size no other test takes from the list
        set_free_limit_bytes(1 << 30);
        let first = take(len).expect("a mapping");
        let base = first.as_ptr() as usize;
        assert!(
            base.is_multiple_of(HUGE_PAGE_BYTES),
            "a new huge page's first piece"
        );
        let rest: Vec<NonNull<u8>> = (1..HUGE_PAGE_BYTES / (256 << 10))
            .map(|_| take(len).expect("a kept piece"))
            .collect();
        let mut offsets: Vec<usize> = rest.iter().map(|p| p.as_ptr() as usize - base).collect();
        offsets.sort_unstable();
        let expected: Vec<usize> = (1..8).map(|i| i * (256 << 10)).collect();
        assert_eq!(offsets, expected, "the other pieces of the same huge page");
        for piece in rest.into_iter().chain([first]) {
            // SAFETY: each piece is mapped, 256 KiB, writable; giving it back splits the page.
            unsafe {
                piece.as_ptr().add((256 << 10) - 1).write(1);
                give_back(piece, len);
            }
        }
        set_free_limit_bytes(DEFAULT_FREE_LIMIT_BYTES);
    }

    /// The physical frame of each 4 KiB page of `[ptr, ptr + len)`, from `/proc/self/pagemap`
    /// (frames read as 0 without CAP_SYS_ADMIN).
    fn page_frames(ptr: NonNull<u8>, len: usize) -> Vec<u64> {
        use std::io::{Read, Seek, SeekFrom};
        let mut pagemap = std::fs::File::open("/proc/self/pagemap").expect("pagemap");
        let first_page = ptr.as_ptr() as u64 / 4096;
        pagemap.seek(SeekFrom::Start(first_page * 8)).expect("seek");
        let mut entries = vec![0u8; len / 4096 * 8];
        pagemap.read_exact(&mut entries).expect("pagemap entries");
        entries
            .chunks_exact(8)
            .map(|e| u64::from_le_bytes(e.try_into().expect("8 bytes")) & ((1 << 55) - 1))
            .collect()
    }

    #[test]
    fn a_buffer_is_physically_contiguous_where_the_kernel_gives_huge_pages() {
        let len = 1 << 20;
        let buf = take(len).expect("a mapping");
        // SAFETY: the buffer is mapped, `len` bytes, writable and unused; fault every page in.
        unsafe {
            for page in 0..len / 4096 {
                buf.as_ptr().add(page * 4096).write_volatile(1);
            }
        }
        let frames = page_frames(buf, len);
        let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .unwrap_or_default();
        let huge_pages_on = thp.contains("[always]") || thp.contains("[madvise]");
        if huge_pages_on && frames[0] != 0 {
            let contiguous = frames.windows(2).all(|w| w[1] == w[0] + 1);
            assert!(
                contiguous,
                "a 1 MiB buffer spans scattered pages: {frames:?}"
            );
        } else {
            eprintln!(
                "not checked here: transparent huge pages {thp:?}, page frames readable: {}",
                frames[0] != 0
            );
        }
        // SAFETY: taken above, unused now.
        unsafe { give_back(buf, len) };
    }

    #[test]
    fn small_classes_are_carved_only_when_the_list_has_room_for_the_other_pieces() {
        let mib = 1 << 20;
        assert!(carves(mib, 64 * mib, 64 * mib), "1 MiB: always");
        assert!(carves(512 << 10, 0, 0), "a quarter of a huge page: always");
        assert!(carves(64 << 10, 0, 64 * mib));
        assert!(
            !carves(64 << 10, 63 * mib, 64 * mib),
            "no room for 31 more pieces"
        );
        assert!(!carves(256 << 10, 0, 0), "a limit of 0 keeps no pieces");
    }

    #[test]
    fn sizes_round_up_to_power_of_two_classes() {
        assert_eq!(class_bytes(4096), LARGE_BUFFER_MIN_BYTES);
        assert_eq!(class_bytes(64 << 10), 64 << 10);
        assert_eq!(class_bytes((64 << 10) + 4096), 128 << 10);
        assert_eq!(class_bytes(1 << 20), 1 << 20);
    }

    #[test]
    fn a_list_over_its_limit_releases_buffers() {
        let mut list = FreeList::new();
        let class = 256 << 10;
        for _ in 0..4 {
            list.push(class, anonymous_mapping::map(class).expect("a mapping"));
        }
        list.shrink_to(2 * class);
        assert_eq!(list.bytes, 2 * class);
        list.shrink_to(0);
        assert_eq!(list.bytes, 0);
        assert!(list.by_class.iter().all(Vec::is_empty));
    }
}

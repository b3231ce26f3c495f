//! Memory for small [`super::DiskBuf`]s (up to [`SMALL_BUFFER_MAX_BYTES`]): slots of 4, 8, 16
//! and 32 KiB carved out of 2 MiB mappings, recycled through free lists, never given back to
//! the allocator.
//!
//! Why not the allocator: these buffers are what the read caches hold (a 4 KiB read's buffer
//! is the cached block, a promoted block is copied into one), gigabytes of them that writes
//! free in random order. In glibc's heap they sat among every other allocation, and the holes
//! they left made each later allocation search long free lists: after a mix of reads that
//! filled a 6 GiB cache and random writes that freed part of it, `_int_malloc` took 42-58 %
//! of the node and 1 MiB sequential writes ran at 160-340 MiB/s, against 1,200-1,400 for the
//! same job run right after (`bench/seqwrite-after-mix-probe.sh`; with the slots, 2 % and
//! +25-40 % side by side: bench/results/20261129-013000-vm). Aligned blocks from the heap also cost up to 4 KiB of
//! fragment each, which is why small reads used to be copied out of a bounce buffer instead of
//! read into a buffer of their own. A slot is exactly its size and 4 KiB-aligned, so the kernel
//! reads straight into it and a cached 4 KiB block costs 4 KiB.
//!
//! Each thread keeps a few free slots of each size of its own; the node-wide lists behind one
//! mutex are touched once per [`TRANSFER_SLOTS`] slots taken or given back (a buffer filled on
//! one reactor is often dropped on another, after its reply is sent).
//!
//! Memory: the mappings are the peak number of small buffers alive at once (the read caches
//! plus the requests in flight), up to [`set_limit_bytes`]; beyond the limit buffers come from
//! the heap as before. Free slots keep their pages.

use std::cell::RefCell;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// Largest buffer served from here; larger ones have mappings of their own
/// ([`super::large_buffers`]).
pub const SMALL_BUFFER_MAX_BYTES: usize = 32 << 10;

/// Default of [`set_limit_bytes`]. A node sets its own from its cache and request budgets.
pub const DEFAULT_LIMIT_BYTES: usize = 1 << 30;

const SMALLEST_CLASS_BYTES: usize = 4 << 10;
const CLASSES: usize = 4; // 4, 8, 16, 32 KiB
const CHUNK_BYTES: usize = 2 << 20;
/// Free slots of one size a thread keeps before it hands some to the node-wide list.
const STASH_SLOTS: usize = 64;
/// Slots moved at once between a thread's stash and the node-wide list.
const TRANSFER_SLOTS: usize = 32;

static LIMIT_BYTES: AtomicUsize = AtomicUsize::new(DEFAULT_LIMIT_BYTES);
static MAPPED_BYTES: AtomicUsize = AtomicUsize::new(0);
static SHARED: Mutex<Slots> = Mutex::new(Slots::new());

thread_local! {
    static STASH: RefCell<Stash> = const { RefCell::new(Stash(Slots::new())) };
}

/// Sets the most memory the slots may map in all (0: every small buffer from the heap).
/// Mappings made before a lower limit stay.
pub fn set_limit_bytes(bytes: usize) {
    LIMIT_BYTES.store(bytes, Ordering::Relaxed);
}

/// The limit [`set_limit_bytes`] set.
pub fn limit_bytes() -> usize {
    LIMIT_BYTES.load(Ordering::Relaxed)
}

/// Bytes mapped for slots so far (in use or free).
pub fn mapped_bytes() -> usize {
    MAPPED_BYTES.load(Ordering::Relaxed)
}

/// The slot size a buffer of `len` bytes gets (`0 < len <= SMALL_BUFFER_MAX_BYTES`).
pub(super) fn class_bytes(len: usize) -> usize {
    debug_assert!(len > 0 && len <= SMALL_BUFFER_MAX_BYTES);
    len.max(SMALLEST_CLASS_BYTES).next_power_of_two()
}

fn class_index(len: usize) -> usize {
    (class_bytes(len) / SMALLEST_CLASS_BYTES).trailing_zeros() as usize
}

/// A 4 KiB-aligned slot of `class_bytes(len)` bytes, its bytes unspecified (zeros when fresh,
/// a former user's data when reused), or `None` once the slots have reached their limit (or
/// the kernel refused a mapping).
pub(super) fn take(len: usize) -> Option<NonNull<u8>> {
    let class = class_index(len);
    let from_stash = STASH.try_with(|stash| stash.borrow_mut().take(class));
    match from_stash {
        Ok(slot) => slot,
        // The thread is exiting and its stash is gone: the node-wide list serves it.
        Err(_) => take_shared(class, &mut Vec::new()),
    }
}

/// Hands back a slot `take` gave for a `len` of this class.
///
/// # Safety
/// `ptr` came from [`take`] with the same class, and nothing uses it any more.
pub(super) unsafe fn give_back(ptr: NonNull<u8>, len: usize) {
    let class = class_index(len);
    let address = ptr.as_ptr() as usize;
    let kept = STASH.try_with(|stash| stash.borrow_mut().give_back(class, address));
    if kept.is_err() {
        lock().by_class[class].push(address);
    }
}

fn lock() -> std::sync::MutexGuard<'static, Slots> {
    // Each change under the lock is a push or a pop, so a poisoned list is still sound.
    SHARED
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Free slot addresses by class.
struct Slots {
    by_class: [Vec<usize>; CLASSES],
}

impl Slots {
    const fn new() -> Slots {
        Slots {
            by_class: [const { Vec::new() }; CLASSES],
        }
    }
}

/// One thread's free slots.
struct Stash(Slots);

impl Stash {
    fn take(&mut self, class: usize) -> Option<NonNull<u8>> {
        let mine = &mut self.0.by_class[class];
        if let Some(address) = mine.pop() {
            return NonNull::new(address as *mut u8);
        }
        take_shared(class, mine)
    }

    fn give_back(&mut self, class: usize, address: usize) {
        let mine = &mut self.0.by_class[class];
        mine.push(address);
        if mine.len() > STASH_SLOTS {
            // The oldest go: the slots freed last are the likeliest still in the CPU's caches.
            lock().by_class[class].extend(mine.drain(..TRANSFER_SLOTS));
        }
    }
}

impl Drop for Stash {
    fn drop(&mut self) {
        let mut shared = lock();
        for (class, mine) in self.0.by_class.iter_mut().enumerate() {
            shared.by_class[class].append(mine);
        }
    }
}

/// A slot from the node-wide list, moving up to `TRANSFER_SLOTS - 1` more into `stash`; a
/// new mapping's slots when the list is empty and the limit allows.
fn take_shared(class: usize, stash: &mut Vec<usize>) -> Option<NonNull<u8>> {
    {
        let mut shared = lock();
        let list = &mut shared.by_class[class];
        if let Some(address) = list.pop() {
            let more = list.len().min(TRANSFER_SLOTS - 1);
            stash.extend(list.drain(list.len() - more..));
            return NonNull::new(address as *mut u8);
        }
    }
    let chunk = map_chunk()?;
    let slot_bytes = SMALLEST_CLASS_BYTES << class;
    let mut slots = (0..CHUNK_BYTES / slot_bytes).map(|i| chunk.as_ptr() as usize + i * slot_bytes);
    let first = slots.next().expect("a chunk holds slots");
    stash.extend(slots.by_ref().take(TRANSFER_SLOTS - 1));
    lock().by_class[class].extend(slots);
    NonNull::new(first as *mut u8)
}

/// A new 2 MiB mapping, counted against the limit; `None` past the limit or if the kernel
/// refuses (the caller then uses the heap: a failed mapping is never fatal here).
fn map_chunk() -> Option<NonNull<u8>> {
    let limit = LIMIT_BYTES.load(Ordering::Relaxed);
    let reserved = MAPPED_BYTES.fetch_add(CHUNK_BYTES, Ordering::Relaxed);
    if reserved + CHUNK_BYTES > limit {
        MAPPED_BYTES.fetch_sub(CHUNK_BYTES, Ordering::Relaxed);
        return None;
    }
    let chunk = super::anonymous_mapping::map(CHUNK_BYTES);
    if chunk.is_none() {
        MAPPED_BYTES.fetch_sub(CHUNK_BYTES, Ordering::Relaxed);
    }
    chunk
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_round_up_to_power_of_two_slots() {
        assert_eq!(class_bytes(1), 4096);
        assert_eq!(class_bytes(4096), 4096);
        assert_eq!(class_bytes(4097), 8192);
        assert_eq!(class_bytes(12 << 10), 16 << 10);
        assert_eq!(class_bytes(SMALL_BUFFER_MAX_BYTES), SMALL_BUFFER_MAX_BYTES);
        assert_eq!(class_index(SMALL_BUFFER_MAX_BYTES), CLASSES - 1);
    }

    #[test]
    fn slots_are_aligned_distinct_and_reused_after_their_release() {
        // 16 KiB slots: other tests of this crate ask mostly for 4 KiB ones.
        let len = 16 << 10;
        let taken: Vec<NonNull<u8>> = (0..200).map(|_| take(len).expect("a slot")).collect();
        let mut addresses: Vec<usize> = taken.iter().map(|p| p.as_ptr() as usize).collect();
        assert!(addresses.iter().all(|a| a % 4096 == 0));
        addresses.sort_unstable();
        assert!(
            addresses.windows(2).all(|w| w[1] - w[0] >= len),
            "no two slots overlap"
        );
        for (i, ptr) in taken.iter().enumerate() {
            // SAFETY: each slot is 16 KiB and ours alone.
            unsafe { ptr.as_ptr().add(len - 1).write(i as u8) };
        }
        for (i, ptr) in taken.iter().enumerate() {
            // SAFETY: as above; no other slot wrote here.
            assert_eq!(unsafe { ptr.as_ptr().add(len - 1).read() }, i as u8);
        }
        let last = *taken.last().unwrap();
        for ptr in taken {
            // SAFETY: taken above for this length, unused from here on.
            unsafe { give_back(ptr, len) };
        }
        let again = take(len).expect("a slot");
        assert_eq!(
            again, last,
            "the thread's last released slot comes back first"
        );
        // SAFETY: as above.
        unsafe { give_back(again, len) };
    }

    #[test]
    fn slots_released_on_another_thread_come_back() {
        let len = 32 << 10;
        let taken: Vec<usize> = (0..300)
            .map(|_| take(len).expect("a slot").as_ptr() as usize)
            .collect();
        let given = taken.clone();
        std::thread::spawn(move || {
            for address in given {
                let ptr = NonNull::new(address as *mut u8).unwrap();
                // SAFETY: taken above for this length, unused by the first thread now.
                unsafe { give_back(ptr, len) };
            }
        })
        .join()
        .unwrap();
        // The other thread's stash went to the node-wide list when it exited; this thread
        // takes its slots back before anything new is mapped. (Not checked through
        // `mapped_bytes`: other tests map slots of their own meanwhile.)
        let again: Vec<NonNull<u8>> = (0..300).map(|_| take(len).expect("a slot")).collect();
        let reused = again
            .iter()
            .filter(|p| taken.contains(&(p.as_ptr() as usize)))
            .count();
        assert!(reused >= 250, "only {reused} of 300 slots reused");
        for ptr in again {
            // SAFETY: as above.
            unsafe { give_back(ptr, len) };
        }
    }
}

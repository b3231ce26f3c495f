//! Anonymous private mappings: the memory of [`super::small_buffers`] and
//! [`super::large_buffers`]. A refused mapping (the kernel out of address space or of map
//! areas, `vm.max_map_count`) is `None`, never an abort: callers fall back to the heap, so a
//! read that cannot get a mapping still gets its buffer and the node stays up.

use std::ptr::NonNull;

/// `bytes` (a multiple of the page size) of zero-filled, page-aligned memory, or `None` if
/// the kernel refuses.
pub(super) fn map(bytes: usize) -> Option<NonNull<u8>> {
    if refused_for_tests() {
        return None;
    }
    // SAFETY: an anonymous private mapping touches no existing memory.
    let raw = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            bytes,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if raw == libc::MAP_FAILED {
        return None;
    }
    NonNull::new(raw.cast())
}

/// Size and alignment of a transparent huge page on x86-64 and most aarch64 kernels.
pub(super) const HUGE_PAGE_BYTES: usize = 2 << 20;

/// `bytes` (a multiple of [`HUGE_PAGE_BYTES`]) of zero-filled memory aligned to
/// [`HUGE_PAGE_BYTES`] and marked `MADV_HUGEPAGE`, so the kernel backs it with huge pages where
/// it can (`transparent_hugepage` set to `always` or `madvise`): each huge page is physically
/// contiguous. `None` if the kernel refuses the mapping. Where huge pages are off or none is
/// free, the memory is ordinary pages, as from [`map`]. Any page-aligned piece of it may be
/// given back on its own with [`unmap`].
pub(super) fn map_huge_aligned(bytes: usize) -> Option<NonNull<u8>> {
    debug_assert!(bytes > 0 && bytes.is_multiple_of(HUGE_PAGE_BYTES));
    // Map a huge page more than asked, then give back the unaligned head and the tail.
    let padded = bytes.checked_add(HUGE_PAGE_BYTES)?;
    let raw = map(padded)?;
    let start = raw.as_ptr() as usize;
    let aligned = start.next_multiple_of(HUGE_PAGE_BYTES);
    let head = aligned - start;
    let tail = padded - head - bytes;
    // SAFETY: head and tail are page-aligned pieces of the mapping just made, unused.
    unsafe {
        if head > 0 {
            unmap(raw, head);
        }
        if tail > 0 {
            unmap(NonNull::new_unchecked((aligned + bytes) as *mut u8), tail);
        }
    }
    // SAFETY: `[aligned, aligned + bytes)` is the part of the mapping kept above.
    unsafe { libc::madvise(aligned as *mut libc::c_void, bytes, libc::MADV_HUGEPAGE) };
    // A refused advice (huge pages compiled out) leaves ordinary pages: nothing to handle.
    NonNull::new(aligned as *mut u8)
}

/// Gives a mapping, or a page-aligned piece of one, back to the kernel.
///
/// # Safety
/// `[ptr, ptr + bytes)` lies in a mapping made by [`map`] or [`map_huge_aligned`], and
/// nothing uses it any more.
pub(super) unsafe fn unmap(ptr: NonNull<u8>, bytes: usize) {
    // SAFETY: passed on from our caller.
    let result = unsafe { libc::munmap(ptr.as_ptr().cast(), bytes) };
    // munmap of a whole mapping of ours fails only if that invariant was broken.
    assert_eq!(result, 0, "munmap of a buffer mapping failed");
}

#[cfg(not(test))]
fn refused_for_tests() -> bool {
    false
}

#[cfg(test)]
thread_local! {
    static REFUSE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

#[cfg(test)]
fn refused_for_tests() -> bool {
    REFUSE.with(|refuse| refuse.get())
}

/// Makes this thread's mappings fail (as if the kernel refused) while `refuse` is set.
#[cfg(test)]
pub(super) fn refuse_on_this_thread(refuse: bool) {
    REFUSE.with(|cell| cell.set(refuse));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_impossible_mapping_is_refused_not_fatal() {
        assert!(map(1 << 62).is_none());
        let page = map(4096).expect("one page");
        // SAFETY: the mapping is one writable page that nothing else uses.
        unsafe {
            assert_eq!(page.as_ptr().read(), 0);
            page.as_ptr().write(1);
            unmap(page, 4096);
        }
    }

    #[test]
    fn a_huge_aligned_mapping_is_aligned_and_its_pieces_are_given_back_alone() {
        let bytes = 2 * HUGE_PAGE_BYTES;
        let region = map_huge_aligned(bytes).expect("a mapping");
        let start = region.as_ptr() as usize;
        assert!(start.is_multiple_of(HUGE_PAGE_BYTES));
        // SAFETY: the mapping is `bytes` long, writable, and nothing else uses it.
        unsafe {
            assert_eq!(region.as_ptr().read(), 0);
            region.as_ptr().add(bytes - 1).write(9);
            unmap(region, HUGE_PAGE_BYTES);
            let rest = NonNull::new_unchecked((start + HUGE_PAGE_BYTES) as *mut u8);
            assert_eq!(rest.as_ptr().add(HUGE_PAGE_BYTES - 1).read(), 9);
            unmap(rest, HUGE_PAGE_BYTES);
        }
    }
}

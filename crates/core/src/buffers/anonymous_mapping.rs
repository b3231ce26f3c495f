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

/// Gives a mapping back to the kernel.
///
/// # Safety
/// `ptr` is a mapping of `bytes` made by [`map`] that nothing uses any more.
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
}

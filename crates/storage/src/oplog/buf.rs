//! A zeroed byte buffer aligned to 4 KiB in memory, as O_DIRECT writes need.

use super::format::BLOCK_BYTES;
use std::alloc::{alloc_zeroed, dealloc, handle_alloc_error, Layout};
use std::ptr::NonNull;

/// An owned, zero-initialised buffer whose address and length are multiples of 4 KiB.
pub(super) struct AlignedBuf {
    ptr: NonNull<u8>,
    layout: Layout,
}

impl AlignedBuf {
    /// `len` is rounded up to a multiple of 4 KiB (at least one block).
    pub fn zeroed(len: u64) -> Self {
        let len = usize::try_from(len.max(1).div_ceil(BLOCK_BYTES) * BLOCK_BYTES)
            .expect("buffer length fits in memory");
        let layout = Layout::from_size_align(len, BLOCK_BYTES as usize)
            .expect("4 KiB-aligned layout of a 4 KiB multiple is valid");
        // SAFETY: `layout` has a non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            handle_alloc_error(layout)
        };
        AlignedBuf { ptr, layout }
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` points to `layout.size()` initialised (zeroed) bytes owned by `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.layout.size()) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this very layout.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_and_rounded_up() {
        let mut buf = AlignedBuf::zeroed(5000);
        assert_eq!(buf.as_slice().len(), 8192);
        assert_eq!(buf.as_slice().as_ptr() as usize % 4096, 0);
        assert!(buf.as_slice().iter().all(|&b| b == 0));
        buf.as_mut_slice()[8191] = 1;
        assert_eq!(buf.as_slice()[8191], 1);
    }
}

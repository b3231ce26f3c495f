//! [`DiskBuf`]: a buffer a read fills and then hands over whole, so data read from the disk
//! reaches a client's reply without being copied on the way (see
//! `ashlar_storage::fs::DiskFile::read_new`), and a buffer a front-end receives a write's
//! payload into, so the disk writes from it without a copy (`DiskFile::write_from`).
//! Small ones are slots of [`super::small_buffers`], larger ones mappings recycled through
//! [`super::large_buffers`]; the heap serves only what the slots' limit leaves over and what
//! the kernel refuses to map.

use super::large_buffers;
use super::small_buffers::{self, SMALL_BUFFER_MAX_BYTES};
use bytes::Bytes;
use std::alloc::{self, Layout};
use std::ptr::NonNull;

/// Alignment of every `DiskBuf`: what O_DIRECT needs of a buffer's address.
pub const DISK_BUF_ALIGN_BYTES: usize = crate::BLOCK_SIZE_BYTES as usize;

/// A 4 KiB-aligned heap buffer of initialised bytes that owns its memory. Its address never
/// changes while it lives (moving the value moves only the pointer), so the kernel may be
/// handed it for a read; [`DiskBuf::into_bytes`] turns it into `Bytes` without a copy.
pub struct DiskBuf {
    ptr: NonNull<u8>,
    len: usize,
    memory: Memory,
}

/// Where a buffer's memory came from, so that it goes back there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Memory {
    /// No memory (`len` 0).
    None,
    Small,
    Large,
    Heap,
}

// SAFETY: a `DiskBuf` owns its allocation outright (no aliasing pointer survives a move), like
// a `Vec<u8>`.
unsafe impl Send for DiskBuf {}
// SAFETY: shared access only reads the bytes.
unsafe impl Sync for DiskBuf {}

impl DiskBuf {
    /// `len` zero bytes (`len` may be 0).
    pub fn zeroed(len: usize) -> DiskBuf {
        // SAFETY: `alloc_zeroed` initialises every byte.
        unsafe { DiskBuf::allocate(len, true) }
    }

    /// `len` bytes to be overwritten in full (a write payload received from a socket), not
    /// zeroed first: zeros or a former user's bytes, never uninitialised memory. The pools'
    /// memory is initialised once mapped (zero pages) and only ever written after that; only
    /// the heap fallback is zeroed here.
    pub fn for_overwrite(len: usize) -> DiskBuf {
        // SAFETY: memory from the pools is initialised (see above); the heap's is zeroed.
        let buf = unsafe { DiskBuf::allocate(len, false) };
        if buf.memory == Memory::Heap {
            // SAFETY: the allocation has `len` writable bytes; writing initialises them.
            unsafe { std::ptr::write_bytes(buf.ptr.as_ptr(), 0, len) };
        }
        buf
    }

    /// `len` bytes the caller must write in full, through [`DiskBuf::as_mut_ptr_at`], before
    /// anything reads them (through a slice or `into_bytes`).
    ///
    /// # Safety
    /// Reading a byte not yet written is undefined behaviour.
    pub unsafe fn uninit(len: usize) -> DiskBuf {
        // SAFETY: passed on to our caller.
        unsafe { DiskBuf::allocate(len, false) }
    }

    /// # Safety
    /// Without `zeroed`, as in [`DiskBuf::uninit`].
    unsafe fn allocate(len: usize, zeroed: bool) -> DiskBuf {
        if len == 0 {
            // No allocation, but an aligned address all the same.
            let dangling = std::ptr::without_provenance_mut(DISK_BUF_ALIGN_BYTES);
            return DiskBuf {
                ptr: NonNull::new(dangling).expect("non-zero address"),
                len: 0,
                memory: Memory::None,
            };
        }
        let recycled = if len <= SMALL_BUFFER_MAX_BYTES {
            small_buffers::take(len).map(|ptr| (ptr, Memory::Small))
        } else {
            large_buffers::take(len).map(|ptr| (ptr, Memory::Large))
        };
        if let Some((ptr, memory)) = recycled {
            if zeroed {
                // SAFETY: `take` gives at least `len` writable bytes.
                unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, len) };
            }
            return DiskBuf { ptr, len, memory };
        }
        let layout = Self::layout(len);
        // SAFETY: the layout has a non-zero size (`len > 0`).
        let raw = unsafe {
            if zeroed {
                alloc::alloc_zeroed(layout)
            } else {
                alloc::alloc(layout)
            }
        };
        let Some(ptr) = NonNull::new(raw) else {
            alloc::handle_alloc_error(layout)
        };
        DiskBuf {
            ptr,
            len,
            memory: Memory::Heap,
        }
    }

    /// A buffer of its own holding a copy of `data`.
    pub fn copy_of(data: &[u8]) -> DiskBuf {
        // SAFETY: every byte is written by the copy before anything reads it.
        let mut buf = unsafe { DiskBuf::uninit(data.len()) };
        if !data.is_empty() {
            // SAFETY: `buf` has `data.len()` bytes of its own, which `data` cannot overlap.
            unsafe {
                std::ptr::copy_nonoverlapping(data.as_ptr(), buf.as_mut_ptr_at(0), data.len())
            };
        }
        buf
    }

    fn layout(len: usize) -> Layout {
        Layout::from_size_align(len, DISK_BUF_ALIGN_BYTES).expect("disk buffer size overflows")
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Address of byte `at` (at most `len`), for the kernel to write into.
    pub fn as_mut_ptr_at(&mut self, at: usize) -> *mut u8 {
        assert!(at <= self.len);
        // SAFETY: `at` is within the allocation, or one past its end (checked above).
        unsafe { self.ptr.as_ptr().add(at) }
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` bytes this value owns, initialised (zeroed at
        // allocation, or written in full before any read, per `uninit`'s contract).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, with the exclusive borrow making this the only access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes as `Bytes`, sharing this allocation (freed when the last clone or slice of
    /// the `Bytes` goes).
    pub fn into_bytes(self) -> Bytes {
        Bytes::from_owner(self)
    }
}

impl AsRef<[u8]> for DiskBuf {
    fn as_ref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl Drop for DiskBuf {
    fn drop(&mut self) {
        match self.memory {
            Memory::None => {}
            // SAFETY (both): `allocate` took it from there for this `len`; we are its last
            // user.
            Memory::Small => unsafe { small_buffers::give_back(self.ptr, self.len) },
            Memory::Large => unsafe { large_buffers::give_back(self.ptr, self.len) },
            // SAFETY: allocated in `allocate` with exactly this layout, and freed only here.
            Memory::Heap => unsafe { alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.len)) },
        }
    }
}

impl std::fmt::Debug for DiskBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskBuf").field("len", &self.len).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_zeroed_and_shared_as_bytes_without_a_copy() {
        let mut buf = DiskBuf::zeroed(3 * DISK_BUF_ALIGN_BYTES);
        assert_eq!(buf.as_slice().as_ptr() as usize % DISK_BUF_ALIGN_BYTES, 0);
        assert!(buf.as_slice().iter().all(|&b| b == 0));
        buf.as_mut_slice()[5] = 7;
        let address = buf.as_slice().as_ptr();
        let bytes = buf.into_bytes();
        assert_eq!(bytes.as_ptr(), address);
        assert_eq!(bytes.len(), 3 * DISK_BUF_ALIGN_BYTES);
        assert_eq!(bytes[5], 7);
        let block = bytes.slice(DISK_BUF_ALIGN_BYTES..2 * DISK_BUF_ALIGN_BYTES);
        drop(bytes);
        assert!(block.iter().all(|&b| b == 0));
    }

    #[test]
    fn large_buffers_are_aligned_and_zeroed_when_asked_even_when_reused() {
        let len = 640 << 10; // class 1 MiB
        for _ in 0..2 {
            let mut buf = DiskBuf::zeroed(len);
            assert_eq!(buf.as_slice().as_ptr() as usize % DISK_BUF_ALIGN_BYTES, 0);
            assert!(buf.as_slice().iter().all(|&b| b == 0));
            buf.as_mut_slice().fill(0xa5);
            let bytes = buf.into_bytes();
            assert_eq!(bytes.len(), len);
        }
    }

    #[test]
    fn a_refused_mapping_falls_back_to_the_heap() {
        // Class 32 MiB: a size no other test of this crate asks for, so no kept buffer of
        // that class can serve it instead of a new mapping.
        let len = 20 << 20;
        super::super::anonymous_mapping::refuse_on_this_thread(true);
        let mut buf = DiskBuf::zeroed(len);
        super::super::anonymous_mapping::refuse_on_this_thread(false);
        assert_eq!(buf.memory, Memory::Heap);
        assert_eq!(buf.as_slice().as_ptr() as usize % DISK_BUF_ALIGN_BYTES, 0);
        assert!(buf.as_slice().iter().all(|&b| b == 0));
        buf.as_mut_slice()[len - 1] = 3;
        let bytes = buf.into_bytes();
        assert_eq!(bytes[len - 1], 3);
    }

    #[test]
    fn empty_buffers_allocate_nothing() {
        let buf = DiskBuf::zeroed(0);
        assert!(buf.is_empty());
        assert!(buf.into_bytes().is_empty());
    }
}

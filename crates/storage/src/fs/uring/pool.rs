//! Bounce buffers and admission: each operation in flight holds a [`Grant`], one of the thread's
//! `max_in_flight_ops` slots plus (for reads and writes) a 4 KiB-aligned buffer from a pool whose
//! total size never exceeds `bounce_pool_bytes`. Callers that cannot be served wait in FIFO
//! order (the waiting itself lives in `ring.rs`; this file is plain bookkeeping).

use crate::fs::DiskBuf;
use std::alloc::{self, Layout};
use std::ptr::NonNull;

/// Alignment (and size granularity) of every bounce buffer.
pub(super) const BUFFER_ALIGN_BYTES: usize = 4096;

/// A zero-initialised, 4 KiB-aligned heap buffer whose address never changes while it lives
/// (moving the value moves only the pointer), so the kernel may be handed its address.
pub(super) struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

impl AlignedBuf {
    /// `len` must be a non-zero multiple of [`BUFFER_ALIGN_BYTES`].
    pub(super) fn new(len: usize) -> AlignedBuf {
        assert!(len > 0 && len.is_multiple_of(BUFFER_ALIGN_BYTES));
        let layout = Self::layout(len);
        // SAFETY: the layout has a non-zero size (asserted above).
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            alloc::handle_alloc_error(layout)
        };
        AlignedBuf { ptr, len }
    }

    fn layout(len: usize) -> Layout {
        Layout::from_size_align(len, BUFFER_ALIGN_BYTES).expect("bounce buffer size overflows")
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    pub(super) fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub(super) fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` initialised bytes (zeroed at allocation) that this value
        // owns; the shared borrow of `self` keeps them from being written through us meanwhile.
        // The kernel writes into a buffer only while the ring owns it, never while a caller
        // holds it (see `ring.rs`).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub(super) fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, with the exclusive borrow of `self` making this the only
        // access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with exactly this layout, and freed only here.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.len)) }
    }
}

/// The right to have one operation in flight, with its bounce buffer if it moves data. Handed
/// back to [`Pool::release`]; a `Grant` that is simply dropped leaks its in-flight slot.
pub(super) struct Grant {
    pub(super) buf: Option<AlignedBuf>,
    /// The caller's own buffer a read fills directly (instead of `buf`). It travels with the
    /// grant so that the ring keeps it alive until the kernel is done, whatever the caller
    /// drops; it is not the pool's memory (the caller accounts for it).
    pub(super) target: Option<DiskBuf>,
    /// The caller's data a write sends directly (instead of `buf`), kept alive with the
    /// grant like `target`.
    pub(super) source: Option<bytes::Bytes>,
}

/// Bounce-buffer sizes are powers of two from 4 KiB up: few classes, so freed buffers are
/// reused instead of returned to the allocator.
fn class_of(bytes: usize) -> usize {
    let size = bytes.max(BUFFER_ALIGN_BYTES).next_power_of_two();
    (size.trailing_zeros() - BUFFER_ALIGN_BYTES.trailing_zeros()) as usize
}

fn class_size(class: usize) -> usize {
    BUFFER_ALIGN_BYTES << class
}

/// The size of the buffer a request of `bytes` gets.
#[cfg(test)]
fn buffer_size_for(bytes: usize) -> usize {
    class_size(class_of(bytes))
}

/// Per-thread bookkeeping of in-flight slots and bounce-buffer memory.
pub(super) struct Pool {
    limit_bytes: usize,
    /// Bytes of every buffer that exists: handed out plus kept for reuse. Never above the limit.
    allocated_bytes: usize,
    /// Buffers kept for reuse, by class.
    free: Vec<Vec<AlignedBuf>>,
    max_in_flight: usize,
    in_flight: usize,
}

impl Pool {
    pub(super) fn new(limit_bytes: usize, max_in_flight: usize) -> Pool {
        Pool {
            limit_bytes,
            allocated_bytes: 0,
            free: (0..=class_of(limit_bytes)).map(|_| Vec::new()).collect(),
            max_in_flight,
            in_flight: 0,
        }
    }

    /// A grant with a buffer of at least `bytes` (none when `bytes` is 0), if a slot and the
    /// memory are available now. `bytes` must not exceed the pool limit once rounded up.
    pub(super) fn try_grant(&mut self, bytes: usize) -> Option<Grant> {
        if self.in_flight >= self.max_in_flight {
            return None;
        }
        let buf = if bytes == 0 {
            None
        } else {
            Some(self.take_buffer(bytes)?)
        };
        self.in_flight += 1;
        Some(Grant {
            buf,
            target: None,
            source: None,
        })
    }

    fn take_buffer(&mut self, bytes: usize) -> Option<AlignedBuf> {
        let class = class_of(bytes);
        let size = class_size(class);
        debug_assert!(size <= self.limit_bytes, "request larger than the pool");
        if let Some(buf) = self.free.get_mut(class).and_then(Vec::pop) {
            return Some(buf);
        }
        // Free kept buffers of other sizes until the new one fits under the limit.
        let mut victim_class = self.free.len();
        while self.allocated_bytes + size > self.limit_bytes {
            while victim_class > 0 && self.free[victim_class - 1].is_empty() {
                victim_class -= 1;
            }
            if victim_class == 0 {
                return None;
            }
            let victim = self.free[victim_class - 1]
                .pop()
                .expect("checked non-empty");
            self.allocated_bytes -= victim.len();
        }
        self.allocated_bytes += size;
        Some(AlignedBuf::new(size))
    }

    /// Takes back a grant: its slot, and its buffer for reuse.
    pub(super) fn release(&mut self, grant: Grant) {
        self.in_flight -= 1;
        // A read target still here was abandoned by its caller: it is simply freed.
        if let Some(buf) = grant.buf {
            self.free[class_of(buf.len())].push(buf);
        }
    }

    pub(super) fn in_flight(&self) -> usize {
        self.in_flight
    }

    pub(super) fn allocated_bytes(&self) -> usize {
        self.allocated_bytes
    }

    pub(super) fn limit_bytes(&self) -> usize {
        self.limit_bytes
    }

    pub(super) fn max_in_flight(&self) -> usize {
        self.max_in_flight
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_round_up_to_powers_of_two() {
        assert_eq!(buffer_size_for(1), 4096);
        assert_eq!(buffer_size_for(4096), 4096);
        assert_eq!(buffer_size_for(4097), 8192);
        assert_eq!(buffer_size_for(1 << 20), 1 << 20);
    }

    #[test]
    fn buffers_are_aligned_and_reused() {
        let mut pool = Pool::new(64 << 10, 8);
        let mut grant = pool.try_grant(5000).unwrap();
        let buf = grant.buf.as_mut().unwrap();
        assert_eq!(buf.as_mut_ptr() as usize % BUFFER_ALIGN_BYTES, 0);
        assert_eq!(buf.len(), 8192);
        let address = buf.as_mut_ptr() as usize;
        pool.release(grant);
        let mut again = pool.try_grant(8192).unwrap();
        assert_eq!(again.buf.as_mut().unwrap().as_mut_ptr() as usize, address);
        assert_eq!(pool.allocated_bytes(), 8192);
        pool.release(again);
        assert_eq!(pool.in_flight(), 0);
    }

    #[test]
    fn memory_and_slots_are_bounded() {
        let mut pool = Pool::new(16 << 10, 3);
        let a = pool.try_grant(8192).unwrap();
        let b = pool.try_grant(8192).unwrap();
        assert!(pool.try_grant(4096).is_none(), "memory limit");
        let c = pool.try_grant(0).unwrap();
        assert!(pool.try_grant(0).is_none(), "slot limit");
        pool.release(a);
        pool.release(c);
        // The kept 8 KiB buffer is freed to make room for a 4 KiB one.
        let d = pool.try_grant(4096).unwrap();
        assert_eq!(pool.allocated_bytes(), 8192 + 4096);
        // Now 12 KiB are allocated: a second 8 KiB buffer does not fit.
        assert!(pool.try_grant(8192).is_none());
        pool.release(b);
        pool.release(d);
        let e = pool.try_grant(16 << 10).unwrap();
        assert_eq!(pool.allocated_bytes(), 16 << 10);
        pool.release(e);
    }
}

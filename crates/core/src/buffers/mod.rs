//! Buffers the kernel reads into and writes from: 4 KiB-aligned [`DiskBuf`]s, whose memory
//! comes from slots of `small_buffers` (up to 32 KiB) or recycled mappings of `large_buffers`
//! rather than the heap, and [`receive::receive_payload`], which reads a payload from a
//! socket into one. Here, not in the storage crate, so that the front-ends receive write
//! payloads straight into such buffers and the disk writes from them without a copy.

mod anonymous_mapping;
pub mod disk_buf;
pub mod large_buffers;
pub mod receive;
pub mod small_buffers;

pub use disk_buf::{DiskBuf, DISK_BUF_ALIGN_BYTES};

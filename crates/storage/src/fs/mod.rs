//! The filesystem seam: every file and directory operation the oplog and the extent store make
//! goes through [`Filesystem`] and [`DiskFile`], so a node can run on io_uring with O_DIRECT
//! (`uring`), on plain blocking calls (`std_fs`, for tools and tests), or on a simulated disk
//! that injects faults and power cuts (`sim`).
//!
//! Contract shared by every implementation (the simulated disk checks it):
//! - Writes are not durable until a `sync_data` of the file returns, or unless they were made
//!   with `write_durable_at`. A power cut may keep any subset of non-durable writes, in any
//!   order, torn at any sector.
//! - A directory entry (a file created, renamed or removed) is durable only once `sync_dir` of
//!   its parent returns. `create_dir_all` is the exception: it returns with every directory it
//!   made durable in its parent.
//! - With `IoMode::Direct`, `write_at` and `write_durable_at` need `offset` and `buf.len()` to
//!   be multiples of [`DIRECT_IO_ALIGNMENT_BYTES`] (else `EINVAL`); reads may have any
//!   alignment (the implementation reads the enclosing aligned range).
//! - Futures may be dropped at any await: an implementation that hands a buffer to the kernel
//!   keeps its own copy alive until the kernel is done with it, so a dropped future never
//!   lets the kernel touch freed memory.
//!
//! All types here are single-threaded: one reactor thread owns each open file. (The simulated
//! disk is `Send + Sync` so that controllers on several reactors can share one.)

pub mod node_fs;
pub mod sim;
pub mod std_fs;
pub mod uring;

use std::io;
use std::path::{Path, PathBuf};

pub use ashlar_core::buffers::{disk_buf, large_buffers, small_buffers, DiskBuf};
pub use node_fs::{NodeFile, NodeFs};
pub use sim::{SimFile, SimFs};
pub use std_fs::{StdFs, StdFsFile};
pub use uring::{UringConfig, UringFile, UringFs};

/// Offsets and lengths of O_DIRECT writes are multiples of this (the largest logical sector
/// size in common use; 4 KiB is also Ashlar's block size).
pub const DIRECT_IO_ALIGNMENT_BYTES: u64 = 4096;

const _: () = assert!(DIRECT_IO_ALIGNMENT_BYTES == ashlar_core::BLOCK_SIZE_BYTES);

/// How a file's bytes move between Ashlar and the disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoMode {
    /// O_DIRECT: no kernel page cache; writes must be aligned.
    Direct,
    /// Through the kernel page cache (the filesystem refused O_DIRECT, e.g. tmpfs, or the
    /// implementation never uses it).
    Buffered,
}

/// One open file. Positional I/O only; every method acts on whole buffers (a short transfer is
/// retried inside or reported as an error).
// A file has no `is_empty`: callers ask for its length.
#[allow(async_fn_in_trait, clippy::len_without_is_empty)]
pub trait DiskFile {
    /// Fills `buf` from `offset`. Bytes past the end of the file read as zeros.
    async fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// Reads `len` bytes at `offset` into a new buffer and hands it over, as `read_at` would
    /// fill it. Where it can (io_uring in Direct mode, an aligned range), the kernel reads
    /// straight into that buffer: no bounce buffer, no copy, no zeroing first.
    async fn read_new(&self, offset: u64, len: usize) -> io::Result<DiskBuf> {
        let mut buf = DiskBuf::zeroed(len);
        self.read_at(buf.as_mut_slice(), offset).await?;
        Ok(buf)
    }
    /// Writes `buf` at `offset` (not durable until `sync_data`).
    async fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()>;
    /// Writes `data` at `offset` as `write_durable_at` (`durable`) or `write_at` would. Where
    /// it can (io_uring in Direct mode, `data` and `offset` aligned), the kernel writes from
    /// `data` itself, held until the kernel is done with it: no bounce buffer, no copy.
    async fn write_from(&self, data: bytes::Bytes, offset: u64, durable: bool) -> io::Result<()> {
        if durable {
            self.write_durable_at(&data, offset).await
        } else {
            self.write_at(&data, offset).await
        }
    }
    /// Writes `buf` at `offset` and returns once these bytes (and the file size, if the write
    /// extended it) are durable, without flushing the file's other dirty data: `RWF_DSYNC`.
    async fn write_durable_at(&self, buf: &[u8], offset: u64) -> io::Result<()>;
    /// Makes every completed write to this file durable (fdatasync).
    async fn sync_data(&self) -> io::Result<()>;
    /// Frees `[offset, offset + length)`; it reads back as zeros. Durable after `sync_data`.
    async fn punch_hole(&self, offset: u64, length: u64) -> io::Result<()>;
    /// Reserves `[offset, offset + length)` on disk, extending the file size if needed
    /// (fallocate mode 0). Durable after `sync_data`.
    async fn allocate(&self, offset: u64, length: u64) -> io::Result<()>;
    /// Current size in bytes.
    async fn len(&self) -> io::Result<u64>;
    /// Truncates or extends to `len` bytes. Durable after `sync_data`.
    async fn set_len(&self, len: u64) -> io::Result<()>;
    fn path(&self) -> &Path;
    fn mode(&self) -> IoMode;
}

/// One entry of a directory listing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirEntry {
    pub name: String,
    pub is_dir: bool,
}

/// Opens files and changes directories. Cheap to clone (a handle).
#[allow(async_fn_in_trait)]
pub trait Filesystem: Clone + 'static {
    type File: DiskFile + 'static;
    /// Opens `path` for reading and writing; with `create`, creates it if missing (the new
    /// entry is durable only after `sync_dir` of the parent).
    async fn open(&self, path: &Path, create: bool) -> io::Result<Self::File>;
    /// Creates `dir` and its missing ancestors, each made durable in its parent.
    async fn create_dir_all(&self, dir: &Path) -> io::Result<()>;
    /// Makes the creations, renames and removals of `dir`'s entries durable.
    async fn sync_dir(&self, dir: &Path) -> io::Result<()>;
    /// Renames `from` to `to`, replacing `to` (durable after `sync_dir` of both parents).
    async fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    /// Removes a file (durable after `sync_dir` of its parent). `NotFound` if absent.
    async fn remove_file(&self, path: &Path) -> io::Result<()>;
    /// Removes an empty directory (durable after `sync_dir` of its parent).
    async fn remove_dir(&self, path: &Path) -> io::Result<()>;
    /// The entries of `dir`, sorted by name. `NotFound` if `dir` does not exist.
    async fn list_dir(&self, dir: &Path) -> io::Result<Vec<DirEntry>>;
    /// Whether `path` exists (file or directory).
    async fn exists(&self, path: &Path) -> io::Result<bool>;
    /// Bytes available to unprivileged writers on the filesystem holding `path`.
    async fn free_bytes(&self, path: &Path) -> io::Result<u64>;
}

/// Removes `dir` (or a file in its place) and everything below it, then makes the removal durable in its parent.
/// `Ok` if `dir` does not exist.
pub async fn remove_tree<F: Filesystem>(fs: &F, dir: &Path) -> io::Result<()> {
    let mut stack: Vec<(PathBuf, bool)> = vec![(dir.to_path_buf(), false)];
    while let Some((path, listed)) = stack.pop() {
        if listed {
            fs.remove_dir(&path).await?;
            continue;
        }
        let entries = match fs.list_dir(&path).await {
            Ok(entries) => entries,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) if e.raw_os_error() == Some(libc::ENOTDIR) => {
                fs.remove_file(&path).await?;
                continue;
            }
            Err(e) => return Err(e),
        };
        stack.push((path.clone(), true));
        for entry in entries {
            let child = path.join(&entry.name);
            if entry.is_dir {
                stack.push((child, false));
            } else {
                match fs.remove_file(&child).await {
                    Ok(()) => {}
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                    Err(e) => return Err(e),
                }
            }
        }
    }
    match dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(parent) if fs.exists(parent).await? => fs.sync_dir(parent).await,
        _ => Ok(()),
    }
}

/// Whether an I/O error means the filesystem is full.
pub fn is_no_space(error: &io::Error) -> bool {
    error.raw_os_error() == Some(libc::ENOSPC) || error.kind() == io::ErrorKind::StorageFull
}

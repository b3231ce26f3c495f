//! [`UringFs`]: the data path's [`Filesystem`], with one io_uring per thread and O_DIRECT where
//! the filesystem allows it.
//!
//! Reads, writes (plain and `RWF_DSYNC`), `fdatasync`, hole punching and allocation go through
//! the calling thread's ring, created on the first operation of that thread and driven by the
//! thread's own tokio runtime: the ring's fd is registered with the runtime, and the futures
//! waiting on it reap completions and wake one another on the same thread (see `ring.rs`). It
//! needs no driver task and no `LocalSet`, only a tokio runtime with I/O enabled (outside any
//! runtime, a future that has to wait blocks its thread in `io_uring_enter`). A reactor
//! that spins (its poll window) may call [`reap_completions`] on each turn to pick up
//! completions as soon as they land. Opening, renaming, listing, removing, truncating and
//! `statvfs` run on tokio's blocking pool; `len` is an `fstat` on the calling thread (it does
//! not wait for the disk).
//!
//! `open` asks for O_DIRECT first; where the filesystem refuses it (`EINVAL`, e.g. ramfs, or
//! tmpfs before Linux 6.6), the file is reopened through the page cache, one warning is logged
//! per filesystem and [`buffered_fallback_opens`] counts it.
//!
//! Every operation copies through a bounce buffer owned by the operation (4 KiB-aligned, as
//! O_DIRECT needs), so a future may be dropped at any await: the buffer stays with the thread's
//! ring until the kernel reports the operation complete, and only then is reused. Reads of any
//! alignment read the enclosing aligned range and copy out; writes in Direct mode must be
//! aligned (`EINVAL` otherwise). Calls larger than [`UringConfig::max_op_bytes`] run as several
//! operations, one after another.
//!
//! # Memory
//! Per thread that uses the ring:
//! - the ring: `ring_entries` 64-byte submission entries plus `2 × ring_entries` 16-byte
//!   completion entries and the index arrays, about 40 KiB at the default 256 entries (pinned
//!   kernel memory, charged to the memlock limit on old kernels);
//! - bounce buffers: at most `bounce_pool_bytes` (default 16 MiB), allocated on demand and kept
//!   for reuse. Each operation in flight holds one buffer of its size rounded up to a power of
//!   two (4 KiB to `max_op_bytes`), so QD32 of 4 KiB reads needs 128 KiB;
//! - bookkeeping: one slot per operation in flight, at most `max_in_flight_ops` (default 256).
//!
//! Operations that find no free slot or not enough pool memory wait, in FIFO order
//! (backpressure); they never fail for it. The defaults thus bound a node with R reactors to
//! about R × 16 MiB of bounce buffers.

mod pool;
mod ring;

use super::std_fs::{self, blocking};
use super::{DirEntry, DiskFile, Filesystem, IoMode, StdFs, DIRECT_IO_ALIGNMENT_BYTES};
use io_uring::{opcode, types};
use ring::{acquire, Op, OwnedGrant};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Limits of the io_uring backend. They apply per thread; a thread's ring is created with the
/// configuration of the first [`UringFs`] that does I/O on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UringConfig {
    /// Submission-queue entries of each thread's ring (a power of two, at most 32768); the
    /// completion queue gets twice as many. Default 256.
    pub ring_entries: u32,
    /// Operations admitted at once per thread (at most `ring_entries`); more wait for one to
    /// finish. Default 256.
    pub max_in_flight_ops: usize,
    /// Bytes of bounce buffers per thread (at least `max_op_bytes`); operations that need more
    /// wait. Default 16 MiB.
    pub bounce_pool_bytes: usize,
    /// Most bytes one ring operation moves (a power of two, 4 KiB to 64 MiB); larger calls run
    /// in pieces of this size. Default 1 MiB.
    pub max_op_bytes: usize,
    /// Open files with O_DIRECT where the filesystem allows it. Default true; false keeps
    /// every file in the page cache (tests, tools).
    pub prefer_direct: bool,
}

/// Default [`UringConfig::ring_entries`].
pub const DEFAULT_RING_ENTRIES: u32 = 256;
/// Default [`UringConfig::max_in_flight_ops`].
pub const DEFAULT_MAX_IN_FLIGHT_OPS: usize = 256;
/// Default [`UringConfig::bounce_pool_bytes`].
pub const DEFAULT_BOUNCE_POOL_BYTES: usize = 16 << 20;
/// Default [`UringConfig::max_op_bytes`].
pub const DEFAULT_MAX_OP_BYTES: usize = 1 << 20;

impl Default for UringConfig {
    fn default() -> Self {
        UringConfig {
            ring_entries: DEFAULT_RING_ENTRIES,
            max_in_flight_ops: DEFAULT_MAX_IN_FLIGHT_OPS,
            bounce_pool_bytes: DEFAULT_BOUNCE_POOL_BYTES,
            max_op_bytes: DEFAULT_MAX_OP_BYTES,
            prefer_direct: true,
        }
    }
}

impl UringConfig {
    fn validate(&self) -> io::Result<()> {
        let align = DIRECT_IO_ALIGNMENT_BYTES as usize;
        let problem = if !self.ring_entries.is_power_of_two() || self.ring_entries > 32768 {
            "ring_entries must be a power of two, at most 32768"
        } else if self.max_in_flight_ops == 0 || self.max_in_flight_ops > self.ring_entries as usize
        {
            "max_in_flight_ops must be between 1 and ring_entries"
        } else if !self.max_op_bytes.is_power_of_two()
            || self.max_op_bytes < align
            || self.max_op_bytes > 64 << 20
        {
            "max_op_bytes must be a power of two from 4 KiB to 64 MiB"
        } else if self.bounce_pool_bytes < self.max_op_bytes {
            "bounce_pool_bytes must be at least max_op_bytes"
        } else {
            return Ok(());
        };
        Err(io::Error::new(io::ErrorKind::InvalidInput, problem))
    }
}

/// Counters of the calling thread's ring (for a stats page and tests).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UringThreadStats {
    pub ring_entries: u32,
    /// Operations admitted and not yet given back (including ones whose future was dropped
    /// and whose completion has not been reaped yet).
    pub in_flight_ops: usize,
    pub max_in_flight_ops: usize,
    /// Operations waiting for a slot or for bounce-buffer memory.
    pub waiting_for_admission: usize,
    /// Bounce-buffer bytes allocated (in use or kept for reuse).
    pub bounce_bytes_allocated: usize,
    pub bounce_bytes_limit: usize,
}

/// The calling thread's ring counters; `None` if this thread has not used [`UringFs`].
pub fn thread_stats() -> Option<UringThreadStats> {
    ring::thread_stats()
}

/// Reaps the calling thread's completion queue and wakes the futures whose operations
/// finished; returns the number of completions reaped (0 if this thread has no ring).
///
/// Reaping reads shared memory and costs no syscall, except that when the kernel has
/// completions queued as task work for this thread (the ring is set up with COOP_TASKRUN, so
/// it does not interrupt a busy thread to post them) one `io_uring_enter` posts them. Meant
/// for a reactor's spin loop: call it on every turn of the poll window so I/O futures are
/// woken without waiting for the runtime to poll its fds. Never required for progress: the
/// ring's fd is registered with the runtime, which wakes the futures anyway.
pub fn reap_completions() -> usize {
    ring::reap_completions()
}

static BUFFERED_FALLBACK_OPENS: AtomicU64 = AtomicU64::new(0);
/// Filesystems (device numbers) already warned about.
static WARNED_FILESYSTEMS: Mutex<Vec<u64>> = Mutex::new(Vec::new());

/// Files opened through the page cache because their filesystem refused O_DIRECT, since the
/// process started.
pub fn buffered_fallback_opens() -> u64 {
    BUFFERED_FALLBACK_OPENS.load(Ordering::Relaxed)
}

/// The io_uring implementation of [`Filesystem`]. Cheap to copy; may be sent between threads
/// (each thread that does I/O gets its own ring).
#[derive(Clone, Copy, Debug)]
pub struct UringFs {
    config: UringConfig,
}

impl UringFs {
    /// `InvalidInput` if a limit is out of range (see [`UringConfig`]).
    pub fn new(config: UringConfig) -> io::Result<UringFs> {
        config.validate()?;
        Ok(UringFs { config })
    }

    pub fn config(&self) -> &UringConfig {
        &self.config
    }
}

/// A file opened by [`UringFs`]. It may be sent between threads; each operation runs on the
/// ring of the thread that awaits it (its future cannot move to another thread).
#[derive(Clone, Debug)]
pub struct UringFile {
    file: Arc<File>,
    path: PathBuf,
    mode: IoMode,
    config: UringConfig,
}

const ALIGN: u64 = DIRECT_IO_ALIGNMENT_BYTES;

fn align_down(x: u64) -> u64 {
    x / ALIGN * ALIGN
}

fn align_up(x: u64) -> u64 {
    x.div_ceil(ALIGN) * ALIGN
}

/// The end of `[offset, offset + len)`, if the kernel can address it (offsets are signed).
fn checked_end(offset: u64, len: u64) -> io::Result<u64> {
    offset
        .checked_add(len)
        .filter(|&end| end <= i64::MAX as u64)
        .ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))
}

/// Times an operation is resubmitted after `EINTR` or `EAGAIN` before the error is returned.
const MAX_RETRIES: u32 = 64;

impl UringFile {
    fn raw_fd(&self) -> types::Fd {
        types::Fd(self.file.as_raw_fd())
    }

    fn direct(&self) -> bool {
        self.mode == IoMode::Direct
    }

    /// Runs one operation built by `build` (given the grant, to point into its buffer),
    /// retrying on `EINTR`/`EAGAIN`; returns the non-negative result and the grant.
    async fn run(
        &self,
        mut grant: OwnedGrant,
        build: impl Fn(&mut OwnedGrant) -> io_uring::squeue::Entry,
    ) -> io::Result<(u32, OwnedGrant)> {
        let mut retries = 0;
        loop {
            let entry = build(&mut grant);
            // SAFETY: `build` points the entry only into `grant`'s buffer, and the entry's fd
            // is `self.file`'s, both handed to the ring with the entry.
            let op = unsafe { Op::start(entry, grant, self.file.clone())? };
            let (result, back) = op.await?;
            grant = back;
            if result >= 0 {
                return Ok((result as u32, grant));
            }
            let errno = -result;
            if (errno == libc::EINTR || errno == libc::EAGAIN) && retries < MAX_RETRIES {
                retries += 1;
                continue;
            }
            return Err(io::Error::from_raw_os_error(errno));
        }
    }

    /// Reads `len` bytes at `pos` (aligned in Direct mode) into a bounce buffer; returns it
    /// with the number of bytes read (fewer only at the end of the file).
    async fn read_piece(&self, pos: u64, len: usize) -> io::Result<(OwnedGrant, usize)> {
        let mut grant = acquire(&self.config, len).await?;
        let mut have = 0usize;
        while have < len {
            // In Direct mode a short read can end unaligned (at the end of the file): go on
            // from the aligned offset below it; a read that brings nothing new is the end.
            let at = if self.direct() {
                align_down(have as u64) as usize
            } else {
                have
            };
            let (n, back) = self
                .run(grant, |g| {
                    opcode::Read::new(self.raw_fd(), g.ptr_at(at), (len - at) as u32)
                        .offset(pos + at as u64)
                        .build()
                })
                .await?;
            grant = back;
            let reached = at + n as usize;
            if reached <= have {
                break;
            }
            have = reached;
        }
        Ok((grant, have))
    }

    /// Writes `data` (at most `max_op_bytes`) at `pos` with `rw_flags`, continuing short writes.
    async fn write_piece(&self, data: &[u8], pos: u64, rw_flags: i32) -> io::Result<()> {
        let mut grant = acquire(&self.config, data.len()).await?;
        grant.buf_mut()[..data.len()].copy_from_slice(data);
        let mut done = 0usize;
        while done < data.len() {
            let (n, back) = self
                .run(grant, |g| {
                    opcode::Write::new(self.raw_fd(), g.ptr_at(done), (data.len() - done) as u32)
                        .offset(pos + done as u64)
                        .rw_flags(rw_flags)
                        .build()
                })
                .await?;
            grant = back;
            let mut reached = done + n as usize;
            if self.direct() {
                // Rewrite from the aligned offset below a short, unaligned end.
                reached = align_down(reached as u64) as usize;
            }
            if reached <= done {
                return Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    format!("write at {} made no progress", pos + done as u64),
                ));
            }
            done = reached;
        }
        Ok(())
    }

    async fn write_with_flags(&self, buf: &[u8], offset: u64, rw_flags: i32) -> io::Result<()> {
        checked_end(offset, buf.len() as u64)?;
        if self.direct()
            && !(offset.is_multiple_of(ALIGN) && (buf.len() as u64).is_multiple_of(ALIGN))
        {
            // The kernel's own answer to a misaligned O_DIRECT write.
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        let mut pos = offset;
        for piece in buf.chunks(self.config.max_op_bytes) {
            self.write_piece(piece, pos, rw_flags).await?;
            pos += piece.len() as u64;
        }
        Ok(())
    }

    async fn fallocate(&self, mode: i32, offset: u64, length: u64) -> io::Result<()> {
        checked_end(offset, length)?;
        let grant = acquire(&self.config, 0).await?;
        self.run(grant, |_| {
            opcode::Fallocate::new(self.raw_fd(), length)
                .offset(offset)
                .mode(mode)
                .build()
        })
        .await?;
        Ok(())
    }

    /// Makes `[offset, offset + length)` read as zeros by writing zeros, without growing the
    /// file: the last resort of `punch_hole` where fallocate cannot. In Direct mode, partial
    /// blocks at the edges are read, zeroed in part and written back.
    async fn write_zeros(&self, offset: u64, length: u64) -> io::Result<()> {
        let size = self.len().await?;
        let end = checked_end(offset, length)?.min(size);
        let max_piece = self.config.max_op_bytes as u64;
        let mut pos = offset;
        while pos < end {
            let block = align_down(pos);
            let whole_blocks = align_down(end).saturating_sub(pos).min(max_piece);
            if self.direct() && (pos != block || whole_blocks == 0) {
                let piece_end = (block + ALIGN).min(end);
                let mut data = vec![0u8; ALIGN as usize];
                self.read_at(&mut data, block).await?;
                data[(pos - block) as usize..(piece_end - block) as usize].fill(0);
                self.write_at(&data, block).await?;
                if block + ALIGN > size {
                    // The block went past the end of the file: give the file its size back.
                    self.set_len(size).await?;
                }
                pos = piece_end;
            } else {
                let piece = if self.direct() {
                    whole_blocks
                } else {
                    (end - pos).min(max_piece)
                };
                self.write_at(&vec![0u8; piece as usize], pos).await?;
                pos += piece;
            }
        }
        Ok(())
    }
}

impl DiskFile for UringFile {
    async fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let end = checked_end(offset, buf.len() as u64)?;
        if buf.is_empty() {
            return Ok(());
        }
        let mut pos = align_down(offset);
        let last = align_up(end);
        while pos < end {
            let piece = (last - pos).min(self.config.max_op_bytes as u64);
            let (grant, got) = self.read_piece(pos, piece as usize).await?;
            // Copy out the part of [pos, pos + piece) that the caller asked for.
            let want_start = pos.max(offset);
            let want_end = (pos + piece).min(end);
            let valid_end = want_end.min(pos + got as u64);
            if valid_end > want_start {
                let from = &grant.buf()[(want_start - pos) as usize..(valid_end - pos) as usize];
                buf[(want_start - offset) as usize..(valid_end - offset) as usize]
                    .copy_from_slice(from);
            }
            if valid_end < want_end {
                // The file ends here: the rest reads as zeros.
                buf[(valid_end.max(want_start) - offset) as usize..].fill(0);
                return Ok(());
            }
            pos += piece;
        }
        Ok(())
    }

    async fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.write_with_flags(buf, offset, 0).await
    }

    async fn write_durable_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.write_with_flags(buf, offset, libc::RWF_DSYNC).await
    }

    async fn sync_data(&self) -> io::Result<()> {
        let grant = acquire(&self.config, 0).await?;
        self.run(grant, |_| {
            opcode::Fsync::new(self.raw_fd())
                .flags(types::FsyncFlags::DATASYNC)
                .build()
        })
        .await?;
        Ok(())
    }

    async fn punch_hole(&self, offset: u64, length: u64) -> io::Result<()> {
        let keep = libc::FALLOC_FL_KEEP_SIZE;
        let not_supported = |e: &io::Error| e.raw_os_error() == Some(libc::EOPNOTSUPP);
        match self
            .fallocate(libc::FALLOC_FL_PUNCH_HOLE | keep, offset, length)
            .await
        {
            Err(e) if not_supported(&e) => {}
            other => return other,
        }
        match self
            .fallocate(libc::FALLOC_FL_ZERO_RANGE | keep, offset, length)
            .await
        {
            Err(e) if not_supported(&e) => self.write_zeros(offset, length).await,
            other => other,
        }
    }

    async fn allocate(&self, offset: u64, length: u64) -> io::Result<()> {
        self.fallocate(0, offset, length).await
    }

    async fn len(&self) -> io::Result<u64> {
        // fstat of an open file reads the in-memory inode; it does not wait for the disk.
        Ok(self.file.metadata()?.len())
    }

    async fn set_len(&self, len: u64) -> io::Result<()> {
        let file = self.file.clone();
        blocking(move || file.set_len(len)).await
    }

    fn path(&self) -> &Path {
        &self.path
    }

    fn mode(&self) -> IoMode {
        self.mode
    }
}

/// Opens `path` read-write, with O_DIRECT first if `prefer_direct`, falling back to the page
/// cache where the filesystem refuses O_DIRECT. `open(direct)` does the opening.
fn open_with_fallback(
    path: &Path,
    prefer_direct: bool,
    open: impl Fn(bool) -> io::Result<File>,
) -> io::Result<(File, IoMode)> {
    if !prefer_direct {
        return Ok((open(false)?, IoMode::Buffered));
    }
    match open(true) {
        Ok(file) => Ok((file, IoMode::Direct)),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            let file = open(false)?;
            note_buffered_fallback(path, &file);
            Ok((file, IoMode::Buffered))
        }
        Err(e) => Err(e),
    }
}

fn note_buffered_fallback(path: &Path, file: &File) {
    BUFFERED_FALLBACK_OPENS.fetch_add(1, Ordering::Relaxed);
    let device = file.metadata().map(|m| m.dev()).unwrap_or(u64::MAX);
    let mut warned = WARNED_FILESYSTEMS.lock().unwrap_or_else(|e| e.into_inner());
    if !warned.contains(&device) {
        warned.push(device);
        tracing::warn!(
            path = %path.display(),
            device,
            "this filesystem refuses O_DIRECT: its files go through the page cache \
             (data is cached twice and writes may be reordered by the kernel until synced)"
        );
    }
}

impl Filesystem for UringFs {
    type File = UringFile;

    async fn open(&self, path: &Path, create: bool) -> io::Result<UringFile> {
        let owned = path.to_path_buf();
        let prefer_direct = self.config.prefer_direct;
        let (file, mode) = blocking(move || {
            open_with_fallback(&owned, prefer_direct, |direct| {
                OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(create)
                    .mode(0o600)
                    .custom_flags(if direct { libc::O_DIRECT } else { 0 })
                    .open(&owned)
            })
        })
        .await?;
        Ok(UringFile {
            file: Arc::new(file),
            path: path.to_path_buf(),
            mode,
            config: self.config,
        })
    }

    async fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        let owned = dir.to_path_buf();
        blocking(move || std_fs::create_dir_all_durably(&owned)).await
    }

    async fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        StdFs.sync_dir(dir).await
    }

    async fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        StdFs.rename(from, to).await
    }

    async fn remove_file(&self, path: &Path) -> io::Result<()> {
        StdFs.remove_file(path).await
    }

    async fn remove_dir(&self, path: &Path) -> io::Result<()> {
        StdFs.remove_dir(path).await
    }

    async fn list_dir(&self, dir: &Path) -> io::Result<Vec<DirEntry>> {
        StdFs.list_dir(dir).await
    }

    async fn exists(&self, path: &Path) -> io::Result<bool> {
        StdFs.exists(path).await
    }

    async fn free_bytes(&self, path: &Path) -> io::Result<u64> {
        StdFs.free_bytes(path).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    #[test]
    fn refused_o_direct_falls_back_to_the_page_cache_and_is_counted() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, b"x").unwrap();
        let before = buffered_fallback_opens();
        for _ in 0..2 {
            let (_, mode) = open_with_fallback(&path, true, |direct| {
                if direct {
                    Err(io::Error::from_raw_os_error(libc::EINVAL))
                } else {
                    File::open(&path)
                }
            })
            .unwrap();
            assert_eq!(mode, IoMode::Buffered);
        }
        assert!(buffered_fallback_opens() >= before + 2);
        // Other errors are not retried.
        let error = open_with_fallback(&path, true, |_| {
            Err(io::Error::from_raw_os_error(libc::EACCES))
        })
        .unwrap_err();
        assert_eq!(error.raw_os_error(), Some(libc::EACCES));
        let (_, mode) = open_with_fallback(&path, true, |_| File::open(&path)).unwrap();
        assert_eq!(mode, IoMode::Direct);
    }

    #[test]
    fn invalid_limits_are_refused() {
        let bad = [
            UringConfig {
                ring_entries: 100,
                ..Default::default()
            },
            UringConfig {
                max_in_flight_ops: 512,
                ..Default::default()
            },
            UringConfig {
                max_op_bytes: 3 << 12,
                ..Default::default()
            },
            UringConfig {
                bounce_pool_bytes: 4096,
                ..Default::default()
            },
        ];
        for config in bad {
            let error = UringFs::new(config).unwrap_err();
            assert_eq!(error.kind(), io::ErrorKind::InvalidInput, "{config:?}");
        }
        UringFs::new(UringConfig::default()).unwrap();
    }

    /// The last-resort zeroing of `punch_hole`, in both modes, with unaligned edges.
    #[test]
    fn write_zeros_zeroes_without_growing_the_file() {
        let dir = tempfile::tempdir().unwrap();
        runtime().block_on(async {
            for prefer_direct in [true, false] {
                let fs = UringFs::new(UringConfig {
                    prefer_direct,
                    max_op_bytes: 8192,
                    bounce_pool_bytes: 64 << 10,
                    ..Default::default()
                })
                .unwrap();
                let path = dir.path().join(format!("z{prefer_direct}"));
                let file = fs.open(&path, true).await.unwrap();
                let size = 40960u64;
                let data: Vec<u8> = (0..size).map(|i| (i % 251) as u8 + 1).collect();
                file.write_at(&data, 0).await.unwrap();
                // Make the size unaligned.
                file.set_len(size - 100).await.unwrap();
                let (start, length) = (1000u64, 50_000u64);
                file.write_zeros(start, length).await.unwrap();
                assert_eq!(file.len().await.unwrap(), size - 100);
                let mut back = vec![0u8; (size - 100) as usize];
                file.read_at(&mut back, 0).await.unwrap();
                assert_eq!(&back[..1000], &data[..1000]);
                assert!(back[1000..].iter().all(|&b| b == 0));
                let (start, length) = (5000u64, 10_000u64);
                file.write_at(&data[..32768], 0).await.unwrap();
                file.write_zeros(start, length).await.unwrap();
                file.read_at(&mut back[..32768], 0).await.unwrap();
                assert_eq!(&back[..5000], &data[..5000]);
                assert!(back[5000..15000].iter().all(|&b| b == 0));
                assert_eq!(&back[15000..32768], &data[15000..32768]);
            }
        });
    }
}

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

mod config;
mod file;
mod op;
mod pool;
mod ring;

pub use config::{
    UringConfig, DEFAULT_BOUNCE_POOL_BYTES, DEFAULT_MAX_IN_FLIGHT_OPS, DEFAULT_MAX_OP_BYTES,
    DEFAULT_RING_ENTRIES,
};
pub use file::UringFile;

use super::std_fs::{self, blocking};
use super::{DirEntry, Filesystem, IoMode, StdFs};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

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
    /// `io_uring_enter` calls that submitted entries, and how many entries they submitted in
    /// all (their ratio is the batch size [`run_submitter`] achieves).
    pub submit_calls: u64,
    pub entries_submitted: u64,
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

/// Runs for as long as the calling thread's tasks do I/O (spawn it as a task of the thread's
/// runtime): while it runs, an operation started by a task is queued in the ring and handed to
/// the kernel when this task next runs, after the tasks already woken, so everything they
/// start goes to the kernel in one `io_uring_enter` (up to 64 queued at once; more are
/// submitted at once). Without it, each operation is submitted as it starts. A reactor runs
/// one: a drain step starts hundreds of writes in one turn, and submitted one by one each
/// costs its own system call and its own doorbell to the device. Dropping the task submits
/// what is queued and ends the deferral; a second one on the same thread returns at once.
pub async fn run_submitter() {
    ring::run_submitter().await
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

/// Opens `path` read-write with `flags` and `O_NOATIME`, or without `O_NOATIME` where the
/// kernel refuses it (EPERM: a file this process neither owns nor may act for). Reads then
/// never update the inode: with `relatime`, the first read after each write would dirty it,
/// a journal write the data path does not need, and every read pays the kernel's check.
fn open_without_atime(path: &Path, create: bool, flags: i32) -> io::Result<File> {
    let open = |flags| {
        OpenOptions::new()
            .read(true)
            .write(true)
            .create(create)
            .mode(0o600)
            .custom_flags(flags)
            .open(path)
    };
    match open(flags | libc::O_NOATIME) {
        Err(e) if e.raw_os_error() == Some(libc::EPERM) => open(flags),
        other => other,
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
                open_without_atime(&owned, create, if direct { libc::O_DIRECT } else { 0 })
            })
        })
        .await?;
        Ok(UringFile::new(file, path.to_path_buf(), mode, self.config))
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
    fn data_files_are_opened_without_atime_updates() {
        use std::os::fd::AsRawFd;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let file = open_without_atime(&path, true, 0).unwrap();
        // SAFETY: F_GETFL on a descriptor this test owns reads its flags and changes nothing.
        let flags = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETFL) };
        assert!(flags >= 0, "{}", io::Error::last_os_error());
        assert_ne!(flags & libc::O_NOATIME, 0, "O_NOATIME missing: {flags:#o}");
        assert_eq!(flags & libc::O_ACCMODE, libc::O_RDWR);
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
}

//! The node's disks and the file I/O they offer, behind a trait so tests can inject faults.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::rc::Rc;

/// Storage tier of a disk: `fast` (SSD/NVMe, holds the oplog) or `slow` (HDD).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Tier {
    Fast,
    Slow,
}

impl Tier {
    pub fn name(self) -> &'static str {
        match self {
            Tier::Fast => "fast",
            Tier::Slow => "slow",
        }
    }
}

/// One disk given to the node: a directory on a mounted filesystem, with its tier.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Disk {
    pub path: PathBuf,
    pub tier: Tier,
}

/// Positional file I/O as the oplog and extent store need it. All methods act on whole
/// buffers: a short read or write is retried inside the implementation or reported as an error.
///
/// The futures may complete immediately (blocking implementation) or later (io_uring).
#[allow(async_fn_in_trait)]
pub trait FileIo {
    /// Fills `buf` from `offset`. Reading past the end of the file yields zeros (sparse files).
    async fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    async fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()>;
    /// Makes every completed write durable (fdatasync).
    async fn sync_data(&self) -> io::Result<()>;
    /// Makes every completed write to any file of this file's filesystem durable (syncfs).
    /// One call replaces an fdatasync per file when many files are dirty.
    async fn sync_filesystem(&self) -> io::Result<()> {
        self.sync_data().await
    }
    /// Frees the storage of `[offset, offset+length)`; it reads back as zeros.
    async fn punch_hole(&self, offset: u64, length: u64) -> io::Result<()>;
    fn path(&self) -> &Path;
}

/// Opens files of one kind; lets tests substitute a fault-injecting implementation.
pub trait FileOpener {
    type File: FileIo;
    fn open(&self, path: &Path, create: bool) -> io::Result<Self::File>;
}

/// Plain positional I/O on a std `File`. Reads and writes run on the calling (reactor) thread;
/// `sync_data` runs on tokio's blocking pool so a slow flush does not stall the reactor.
#[derive(Clone, Debug)]
pub struct StdFile {
    file: Rc<File>,
    path: PathBuf,
}

impl StdFile {
    pub fn open(path: &Path, create: bool) -> io::Result<Self> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(create)
            .mode(0o600)
            .open(path)?;
        Ok(StdFile {
            file: Rc::new(file),
            path: path.to_path_buf(),
        })
    }
}

impl FileIo for StdFile {
    async fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let mut done = 0;
        while done < buf.len() {
            match self.file.read_at(&mut buf[done..], offset + done as u64) {
                Ok(0) => {
                    buf[done..].fill(0);
                    return Ok(());
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    async fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.file.write_all_at(buf, offset)
    }

    async fn sync_data(&self) -> io::Result<()> {
        let file = self.file.try_clone()?;
        match tokio::runtime::Handle::try_current() {
            Ok(_) => tokio::task::spawn_blocking(move || file.sync_data())
                .await
                .map_err(|e| io::Error::other(format!("sync task failed: {e}")))?,
            Err(_) => file.sync_data(),
        }
    }

    async fn sync_filesystem(&self) -> io::Result<()> {
        use std::os::fd::AsRawFd;
        let file = self.file.try_clone()?;
        let syncfs = move || {
            // SAFETY: syncfs on a valid, open file descriptor.
            if unsafe { libc::syncfs(file.as_raw_fd()) } == 0 {
                Ok(())
            } else {
                Err(io::Error::last_os_error())
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(_) => tokio::task::spawn_blocking(syncfs)
                .await
                .map_err(|e| io::Error::other(format!("syncfs task failed: {e}")))?,
            Err(_) => syncfs(),
        }
    }

    async fn punch_hole(&self, offset: u64, length: u64) -> io::Result<()> {
        use std::os::fd::AsRawFd;
        // SAFETY: fallocate on a valid, open file descriptor with plain integer arguments.
        let rc = unsafe {
            libc::fallocate(
                self.file.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                offset as libc::off_t,
                length as libc::off_t,
            )
        };
        if rc == 0 {
            return Ok(());
        }
        let err = io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::EOPNOTSUPP) {
            // Filesystem without hole punching: write zeros so the range still reads as zeros.
            let zeros = vec![0u8; length.min(1 << 20) as usize];
            let mut done = 0u64;
            while done < length {
                let n = (length - done).min(zeros.len() as u64) as usize;
                self.file.write_all_at(&zeros[..n], offset + done)?;
                done += n as u64;
            }
            return Ok(());
        }
        Err(err)
    }

    fn path(&self) -> &Path {
        &self.path
    }
}

/// Opens [`StdFile`]s.
#[derive(Clone, Copy, Debug, Default)]
pub struct StdOpener;

impl FileOpener for StdOpener {
    type File = StdFile;
    fn open(&self, path: &Path, create: bool) -> io::Result<StdFile> {
        StdFile::open(path, create)
    }
}

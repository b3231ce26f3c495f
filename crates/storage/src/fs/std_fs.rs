//! Plain blocking file I/O through the kernel page cache (`IoMode::Buffered`). Reads and writes
//! run on the calling thread; syncs, truncation and directory operations that may wait for the
//! disk run on tokio's blocking pool when called inside a runtime. Used where io_uring is not
//! available and by tools and tests; the node's data path uses `uring`.

use super::{DirEntry, DiskFile, Filesystem, IoMode};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Runs a blocking call off the reactor when inside a tokio runtime.
pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> io::Result<T> + Send + 'static,
) -> io::Result<T> {
    match tokio::runtime::Handle::try_current() {
        Ok(_) => tokio::task::spawn_blocking(f)
            .await
            .map_err(|e| io::Error::other(format!("blocking filesystem task failed: {e}")))?,
        Err(_) => f(),
    }
}

/// The blocking implementation of [`Filesystem`].
#[derive(Clone, Copy, Debug, Default)]
pub struct StdFs;

/// A file opened by [`StdFs`].
#[derive(Clone, Debug)]
pub struct StdFsFile {
    file: Arc<File>,
    path: PathBuf,
}

impl StdFsFile {
    fn raw_fd(&self) -> libc::c_int {
        self.file.as_raw_fd()
    }
}

fn check(rc: libc::c_int) -> io::Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

impl DiskFile for StdFsFile {
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

    async fn write_durable_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.file.write_all_at(buf, offset)?;
        self.sync_data().await
    }

    async fn sync_data(&self) -> io::Result<()> {
        let file = self.file.clone();
        blocking(move || file.sync_data()).await
    }

    async fn punch_hole(&self, offset: u64, length: u64) -> io::Result<()> {
        // SAFETY: fallocate on an open descriptor with plain integer arguments.
        let rc = unsafe {
            libc::fallocate(
                self.raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                offset as libc::off_t,
                length as libc::off_t,
            )
        };
        match check(rc) {
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {
                // No hole punching here: zeros still make the range read as zeros.
                let zeros = vec![0u8; length.min(1 << 20) as usize];
                let mut done = 0u64;
                while done < length {
                    let n = (length - done).min(zeros.len() as u64) as usize;
                    self.file.write_all_at(&zeros[..n], offset + done)?;
                    done += n as u64;
                }
                Ok(())
            }
            other => other,
        }
    }

    async fn allocate(&self, offset: u64, length: u64) -> io::Result<()> {
        let fd = self.raw_fd();
        let file = self.file.clone();
        blocking(move || {
            let _keep_open = file;
            // SAFETY: fallocate on an open descriptor (kept open by `_keep_open`).
            check(unsafe { libc::fallocate(fd, 0, offset as libc::off_t, length as libc::off_t) })
        })
        .await
    }

    async fn len(&self) -> io::Result<u64> {
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
        IoMode::Buffered
    }
}

impl Filesystem for StdFs {
    type File = StdFsFile;

    async fn open(&self, path: &Path, create: bool) -> io::Result<StdFsFile> {
        let owned = path.to_path_buf();
        let file = blocking(move || {
            OpenOptions::new()
                .read(true)
                .write(true)
                .create(create)
                .mode(0o600)
                .open(&owned)
        })
        .await?;
        Ok(StdFsFile {
            file: Arc::new(file),
            path: path.to_path_buf(),
        })
    }

    async fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        let owned = dir.to_path_buf();
        blocking(move || create_dir_all_durably(&owned)).await
    }

    async fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        let owned = dir.to_path_buf();
        blocking(move || File::open(&owned)?.sync_all()).await
    }

    async fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        let (from, to) = (from.to_path_buf(), to.to_path_buf());
        blocking(move || std::fs::rename(&from, &to)).await
    }

    async fn remove_file(&self, path: &Path) -> io::Result<()> {
        let owned = path.to_path_buf();
        blocking(move || std::fs::remove_file(&owned)).await
    }

    async fn remove_dir(&self, path: &Path) -> io::Result<()> {
        let owned = path.to_path_buf();
        blocking(move || std::fs::remove_dir(&owned)).await
    }

    async fn list_dir(&self, dir: &Path) -> io::Result<Vec<DirEntry>> {
        let owned = dir.to_path_buf();
        blocking(move || list_dir_now(&owned)).await
    }

    async fn exists(&self, path: &Path) -> io::Result<bool> {
        let owned = path.to_path_buf();
        blocking(move || owned.try_exists()).await
    }

    async fn free_bytes(&self, path: &Path) -> io::Result<u64> {
        let owned = path.to_path_buf();
        blocking(move || free_bytes_now(&owned)).await
    }
}

/// `create_dir_all`, then an fsync of the parent of every directory it made, outermost first.
pub(crate) fn create_dir_all_durably(dir: &Path) -> io::Result<()> {
    let missing: Vec<PathBuf> = dir
        .ancestors()
        .take_while(|p| !p.as_os_str().is_empty() && !p.is_dir())
        .map(Path::to_path_buf)
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    std::fs::create_dir_all(dir)?;
    for created in missing.iter().rev() {
        if let Some(parent) = created.parent().filter(|p| !p.as_os_str().is_empty()) {
            File::open(parent)?.sync_all()?;
        }
    }
    Ok(())
}

pub(crate) fn list_dir_now(dir: &Path) -> io::Result<Vec<DirEntry>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let Ok(name) = entry.file_name().into_string() else {
            tracing::warn!(path = %entry.path().display(), "ignoring a file whose name is not UTF-8");
            continue;
        };
        out.push(DirEntry {
            name,
            is_dir: entry.file_type()?.is_dir(),
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

pub(crate) fn free_bytes_now(path: &Path) -> io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))?;
    // SAFETY: statvfs writes into the zeroed struct we own; the path is a valid C string.
    unsafe {
        let mut stat: libc::statvfs = std::mem::zeroed();
        check(libc::statvfs(c_path.as_ptr(), &mut stat))?;
        Ok(stat.f_bavail as u64 * stat.f_frsize as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn round_trip_listing_and_removal() {
        let dir = tempfile::tempdir().unwrap();
        let fs = StdFs;
        let sub = dir.path().join("a/b");
        fs.create_dir_all(&sub).await.unwrap();
        let file = fs.open(&sub.join("f"), true).await.unwrap();
        file.write_at(b"hello", 4096).await.unwrap();
        file.write_durable_at(b"world", 0).await.unwrap();
        let mut buf = [0u8; 16];
        file.read_at(&mut buf, 4094).await.unwrap();
        assert_eq!(&buf[..7], b"\0\0hello");
        assert_eq!(&buf[7..], &[0u8; 9]);
        assert_eq!(file.len().await.unwrap(), 4101);
        fs.sync_dir(&sub).await.unwrap();
        let listed = fs.list_dir(&sub).await.unwrap();
        assert_eq!(
            listed,
            vec![DirEntry {
                name: "f".into(),
                is_dir: false
            }]
        );
        super::super::remove_tree(&fs, &dir.path().join("a"))
            .await
            .unwrap();
        assert!(!fs.exists(&dir.path().join("a")).await.unwrap());
        assert!(fs.free_bytes(dir.path()).await.unwrap() > 0);
    }
}

//! [`NodeFs`]: the filesystem a node runs on, chosen at run time: io_uring with O_DIRECT (the
//! data path's default), plain blocking calls (where io_uring is unavailable), or the
//! simulated disk (tests that inject faults into a whole engine). One `match` per call is the
//! whole cost of the choice.

use super::{
    DirEntry, DiskBuf, DiskFile, Filesystem, IoMode, SimFile, SimFs, StdFs, StdFsFile, UringConfig,
    UringFile, UringFs,
};
use std::io;
use std::path::Path;

#[derive(Clone, Debug)]
pub enum NodeFs {
    Uring(UringFs),
    Std(StdFs),
    Sim(SimFs),
}

/// A file opened by [`NodeFs`].
#[derive(Debug)]
pub enum NodeFile {
    Uring(UringFile),
    Std(StdFsFile),
    Sim(SimFile),
}

impl NodeFs {
    /// io_uring if this kernel lets the process create a ring, else blocking calls (with a
    /// warning saying why).
    pub fn detect(config: UringConfig) -> io::Result<NodeFs> {
        let uring = UringFs::new(config)?;
        match io_uring::IoUring::new(2) {
            Ok(_) => Ok(NodeFs::Uring(uring)),
            Err(error) => {
                tracing::warn!(%error,
                    "io_uring is not available; disk I/O uses blocking calls on the reactor threads");
                Ok(NodeFs::Std(StdFs))
            }
        }
    }

    /// The engine's name for the choice, for logs and stats.
    pub fn name(&self) -> &'static str {
        match self {
            NodeFs::Uring(_) => "io_uring",
            NodeFs::Std(_) => "blocking",
            NodeFs::Sim(_) => "simulated",
        }
    }
}

macro_rules! each_file {
    ($file:expr, $f:ident => $body:expr) => {
        match $file {
            NodeFile::Uring($f) => $body,
            NodeFile::Std($f) => $body,
            NodeFile::Sim($f) => $body,
        }
    };
}

macro_rules! each_fs {
    ($fs:expr, $f:ident => $body:expr) => {
        match $fs {
            NodeFs::Uring($f) => $body,
            NodeFs::Std($f) => $body,
            NodeFs::Sim($f) => $body,
        }
    };
}

impl DiskFile for NodeFile {
    async fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        each_file!(self, f => f.read_at(buf, offset).await)
    }
    async fn read_new(&self, offset: u64, len: usize) -> io::Result<DiskBuf> {
        each_file!(self, f => f.read_new(offset, len).await)
    }
    async fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        each_file!(self, f => f.write_at(buf, offset).await)
    }
    async fn write_durable_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        each_file!(self, f => f.write_durable_at(buf, offset).await)
    }
    async fn write_from(&self, data: bytes::Bytes, offset: u64, durable: bool) -> io::Result<()> {
        each_file!(self, f => f.write_from(data, offset, durable).await)
    }
    async fn sync_data(&self) -> io::Result<()> {
        each_file!(self, f => f.sync_data().await)
    }
    async fn punch_hole(&self, offset: u64, length: u64) -> io::Result<()> {
        each_file!(self, f => f.punch_hole(offset, length).await)
    }
    async fn allocate(&self, offset: u64, length: u64) -> io::Result<()> {
        each_file!(self, f => f.allocate(offset, length).await)
    }
    async fn len(&self) -> io::Result<u64> {
        each_file!(self, f => f.len().await)
    }
    async fn set_len(&self, len: u64) -> io::Result<()> {
        each_file!(self, f => f.set_len(len).await)
    }
    fn path(&self) -> &Path {
        each_file!(self, f => f.path())
    }
    fn mode(&self) -> IoMode {
        each_file!(self, f => f.mode())
    }
}

impl Filesystem for NodeFs {
    type File = NodeFile;

    async fn open(&self, path: &Path, create: bool) -> io::Result<NodeFile> {
        Ok(match self {
            NodeFs::Uring(fs) => NodeFile::Uring(fs.open(path, create).await?),
            NodeFs::Std(fs) => NodeFile::Std(fs.open(path, create).await?),
            NodeFs::Sim(fs) => NodeFile::Sim(fs.open(path, create).await?),
        })
    }
    async fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        each_fs!(self, fs => fs.create_dir_all(dir).await)
    }
    async fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        each_fs!(self, fs => fs.sync_dir(dir).await)
    }
    async fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        each_fs!(self, fs => fs.rename(from, to).await)
    }
    async fn remove_file(&self, path: &Path) -> io::Result<()> {
        each_fs!(self, fs => fs.remove_file(path).await)
    }
    async fn remove_dir(&self, path: &Path) -> io::Result<()> {
        each_fs!(self, fs => fs.remove_dir(path).await)
    }
    async fn list_dir(&self, dir: &Path) -> io::Result<Vec<DirEntry>> {
        each_fs!(self, fs => fs.list_dir(dir).await)
    }
    async fn exists(&self, path: &Path) -> io::Result<bool> {
        each_fs!(self, fs => fs.exists(path).await)
    }
    async fn free_bytes(&self, path: &Path) -> io::Result<u64> {
        each_fs!(self, fs => fs.free_bytes(path).await)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn each_choice_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let choices = [
            NodeFs::detect(UringConfig::default()).unwrap(),
            NodeFs::Std(StdFs),
            NodeFs::Sim(SimFs::new(IoMode::Direct)),
        ];
        for fs in choices {
            let sub = dir.path().join(fs.name());
            fs.create_dir_all(&sub).await.unwrap();
            let file = fs.open(&sub.join("f"), true).await.unwrap();
            file.write_durable_at(&[7u8; 4096], 4096).await.unwrap();
            let mut buf = [0u8; 8192];
            file.read_at(&mut buf, 0).await.unwrap();
            assert_eq!(&buf[..4096], &[0u8; 4096][..], "{}", fs.name());
            assert_eq!(&buf[4096..], &[7u8; 4096][..], "{}", fs.name());
            assert_eq!(file.len().await.unwrap(), 8192);
        }
    }
}

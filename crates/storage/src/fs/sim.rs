//! A simulated disk, entirely in memory, that keeps durable and non-durable state apart and
//! injects faults: power cuts, I/O errors, a full disk, bit rot and slow operations. Storage
//! and engine tests run on it to check the durability contract of [`super`] the hard way.
//!
//! [`SimFs`] is a cloneable handle to one disk (shared state behind a mutex, `Send + Sync`,
//! so shard controllers on several reactor threads can share it); [`SimFile`] is an open file.
//!
//! # Model
//!
//! - **Inodes.** Directories map names to inodes; data belongs to inodes. Every inode has a
//!   *live* copy (what reads and listings see) and a *durable* copy (what a power cut keeps
//!   for sure).
//! - **File data.** `write_at`, `punch_hole`, `allocate` and `set_len` change the live copy
//!   and are recorded as pending changes of the file: one per sector a write touched (the
//!   sector's whole contents just after the write, as a page writeback would send it), one
//!   per block punched out or allocated, one per size change. `sync_data` makes them all
//!   durable, in order. `write_durable_at` makes its own sectors durable at once, and the
//!   file size with them; other pending data changes stay pending, but older ones to the same
//!   sectors can no longer reach the disk (a disk never writes an old version of a sector
//!   over a newer one).
//! - **Sizes** are journaled metadata: they reach the disk in order, so committing one (a
//!   `write_durable_at`) commits the older ones too. A truncation frees the blocks past the
//!   new end and kills older pending data there (the kernel drops truncated pages instead of
//!   writing them); the zeros it puts in the rest of the last block are sector writes of
//!   their own, which a cut may drop like any other.
//! - **Sectors.** Ashlar assumes that an aligned 4 KiB write is atomic (4Kn devices, and the
//!   kernel's page writeback of a 4 KiB page, give that): a power cut tears writes at
//!   `sector_bytes` granularity (default 4096; [`SimFs::set_sector_bytes`] takes 512 to 4096
//!   to model 512e devices). Space is counted, and holes punched, in 4 KiB blocks.
//! - **Directories.** `open(create)`, `rename`, `remove_file` and `remove_dir` change the live
//!   namespace and are pending in each parent until `sync_dir(parent)`. A rename within one
//!   directory is one atomic change; across directories it is two, one per parent (so a
//!   rename synced only in its target may leave the file under both names). `create_dir_all`
//!   syncs the parent of each directory it makes, as `StdFs` does: that parent's other pending
//!   entry changes become durable too.
//! - **Power cut** ([`SimFs::power_cut`]). Pending data changes are kept or dropped one by one
//!   and the kept ones applied in any order, interleaved with an ordered prefix of the size
//!   changes; a directory keeps an order-preserving prefix of its pending entry changes (a
//!   journaling filesystem commits them in order; per directory is stricter than one global
//!   journal, so it covers it). Then live = durable, every inode no durable entry reaches is
//!   gone (a file whose data was synced but whose entry was not is lost), and every handle
//!   opened before the cut fails all further calls with `EIO`: the process that held them is
//!   dead. So after a cut every sector below the file's size holds its durable value or one
//!   that some pending change gave it.
//! - **Failed syncs.** A `sync_data` that fails (injected) leaves the file's pending data
//!   changes visible but never makes them durable later: a later successful `sync_data` does
//!   not cover them, and a power cut keeps or drops each. This is what Linux does after a
//!   writeback error (the pages are marked clean), so retrying an fsync proves nothing; a
//!   rewrite of the same sectors does. Size changes are not lost (they are in the journal).
//!   A failed `sync_dir` changes nothing.
//! - **Faults** apply to file data calls (reads: `read_at`; writes: `write_at`,
//!   `write_durable_at`, `punch_hole`, `allocate`, `set_len`; syncs: `sync_data`, `sync_dir`
//!   and the flush of `write_durable_at`) and fail them with `EIO` before they change
//!   anything (except the flush, whose write is then done but not durable). Namespace calls
//!   do not fail. Faults, delays, capacity and counters survive power cuts.
//! - **Space.** Allocated 4 KiB blocks of the live copies of files that are linked or open
//!   count against the capacity (default 1 TiB); directories are free. A write or allocation
//!   that would exceed it fails with `ENOSPC` and changes nothing.
//!
//! Errors are raw OS errors (`ENOENT`, `ENOTDIR`, `EISDIR`, `ENOTEMPTY`, `EBUSY`, `EINVAL`,
//! `EFBIG`, `ENOSPC`, `EIO`), as the kernel returns them. Relative paths are taken from the
//! root; `..` is resolved lexically. There are no symlinks, hard links or permissions.
//!
//! # Example
//!
//! ```
//! use ashlar_storage::fs::sim::{CutPolicy, Times};
//! use ashlar_storage::fs::{DiskFile, Filesystem, IoMode, SimFs};
//! use std::path::Path;
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! let fs = SimFs::new(IoMode::Direct);
//! let dir = Path::new("/disk0/oplog");
//! fs.create_dir_all(dir).await?;
//! let file = fs.open(&dir.join("seg-1"), true).await?;
//! fs.sync_dir(dir).await?;
//! file.write_at(&[1u8; 4096], 0).await?;
//! file.write_durable_at(&[2u8; 4096], 4096).await?;
//! fs.fail_syncs(Some(dir), Times::Next(1));
//! assert!(file.sync_data().await.is_err());
//! assert_eq!(fs.op_counts(Some(dir)).syncs, 1);
//! fs.power_cut(CutPolicy::DropAll);
//! assert!(file.len().await.is_err()); // the process died with the power
//! let durable = fs.read_live(&dir.join("seg-1"))?;
//! assert_eq!(&durable[..4096], &[0u8; 4096][..]); // its sync failed
//! assert_eq!(&durable[4096..], &[2u8; 4096][..]);
//! # std::io::Result::Ok(())
//! # }).unwrap();
//! ```

mod contents;
mod cut;
mod faults;
mod state;

pub use cut::{CutPolicy, CutReport};
pub use faults::{OpCounts, Times};

use super::{DirEntry, DiskFile, Filesystem, IoMode};
use faults::FaultClass;
use state::{components, errno, normalize, Disk, Ino, Node, ROOT};
use std::collections::HashSet;
use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// A handle to one simulated disk; clones share it.
#[derive(Clone)]
pub struct SimFs {
    disk: Arc<Mutex<Disk>>,
}

/// One file of the simulated disk as [`SimFs::files`] reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimFileInfo {
    pub path: PathBuf,
    pub live_len: u64,
    pub durable_len: u64,
    /// Bytes allocated to the live copy (whole 4 KiB blocks).
    pub allocated_bytes: u64,
    /// Changes not durable yet (including those of failed syncs).
    pub pending_changes: usize,
    /// Whether the directory entry naming this file is durable.
    pub entry_durable: bool,
}

fn lock(disk: &Mutex<Disk>) -> MutexGuard<'_, Disk> {
    disk.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl fmt::Debug for SimFs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let disk = lock(&self.disk);
        f.debug_struct("SimFs")
            .field("mode", &disk.mode)
            .field("inodes", &disk.nodes.len())
            .field("generation", &disk.generation)
            .finish()
    }
}

impl SimFs {
    /// An empty disk (only the root directory) in `mode`: with `IoMode::Direct`, unaligned
    /// writes fail with `EINVAL`.
    pub fn new(mode: IoMode) -> SimFs {
        SimFs {
            disk: Arc::new(Mutex::new(Disk::new(mode))),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Disk> {
        lock(&self.disk)
    }

    pub fn mode(&self) -> IoMode {
        self.lock().mode
    }

    /// Sets the unit a power cut tears writes at: a power of two from 512 to 4096 (`EINVAL`
    /// otherwise). Applies to writes made from now on.
    pub fn set_sector_bytes(&self, bytes: u64) -> io::Result<()> {
        if !bytes.is_power_of_two() || !(512..=4096).contains(&bytes) {
            return Err(errno(libc::EINVAL));
        }
        self.lock().sector_bytes = bytes;
        Ok(())
    }

    pub fn sector_bytes(&self) -> u64 {
        self.lock().sector_bytes
    }

    /// Sets the disk's size. Lowering it below what is used makes writes fail with `ENOSPC`
    /// until space is freed or it is raised again.
    pub fn set_capacity(&self, bytes: u64) {
        self.lock().capacity = bytes;
    }

    pub fn capacity(&self) -> u64 {
        self.lock().capacity
    }

    /// Bytes allocated to linked or open files (live state).
    pub fn used_bytes(&self) -> u64 {
        self.lock().used_bytes()
    }

    /// Fails `read_at` of files under `prefix` (all files if `None`) with `EIO`.
    pub fn fail_reads(&self, prefix: Option<&Path>, times: Times) {
        self.add_rule(FaultClass::Read, prefix, times);
    }

    /// Fails `write_at`, `write_durable_at`, `punch_hole`, `allocate` and `set_len` of files
    /// under `prefix` with `EIO`, before they change anything.
    pub fn fail_writes(&self, prefix: Option<&Path>, times: Times) {
        self.add_rule(FaultClass::Write, prefix, times);
    }

    /// Fails `sync_data`, `sync_dir` and the flush of `write_durable_at` under `prefix` with
    /// `EIO`. A failed `sync_data` leaves the file's pending changes for ever non-durable
    /// (see the module doc).
    pub fn fail_syncs(&self, prefix: Option<&Path>, times: Times) {
        self.add_rule(FaultClass::Sync, prefix, times);
    }

    fn add_rule(&self, class: FaultClass, prefix: Option<&Path>, times: Times) {
        self.lock()
            .faults
            .add_rule(class, prefix.map(normalize), times);
    }

    /// Removes every failure rule (delays stay).
    pub fn clear_failures(&self) {
        self.lock().faults.clear_rules();
    }

    /// Delays every call on paths under `prefix` (all if `None`) by `delay` (a tokio sleep
    /// before the call acts); replaces an earlier delay of the same prefix, and a zero delay
    /// removes it. When several prefixes match, the longest delay applies.
    pub fn set_delay(&self, prefix: Option<&Path>, delay: Duration) {
        self.lock().faults.set_delay(prefix.map(normalize), delay);
    }

    pub fn clear_delays(&self) {
        self.lock().faults.clear_delays();
    }

    /// XORs the byte at `offset` of the file at `path` with `mask`, in both its live and its
    /// durable copy (bit rot). Bytes in holes or past the end are not touched; `EINVAL` if
    /// nothing was.
    pub fn flip_bits(&self, path: &Path, offset: u64, mask: u8) -> io::Result<()> {
        self.rot(path, offset..offset.saturating_add(1), |_, byte| {
            byte ^ mask
        })
    }

    /// Overwrites `bytes.len()` bytes at `offset` of the file at `path`, in both its live and
    /// its durable copy. Bytes in holes or past the end are not touched; `EINVAL` if nothing
    /// was.
    pub fn corrupt(&self, path: &Path, offset: u64, bytes: &[u8]) -> io::Result<()> {
        let end = offset
            .checked_add(bytes.len() as u64)
            .ok_or(errno(libc::EINVAL))?;
        self.rot(path, offset..end, |at, _| bytes[(at - offset) as usize])
    }

    fn rot(
        &self,
        path: &Path,
        range: std::ops::Range<u64>,
        f: impl Fn(u64, u8) -> u8,
    ) -> io::Result<()> {
        let mut disk = self.lock();
        let ino = disk.lookup(&components(path)?)?;
        let Some(Node::File(file)) = disk.nodes.get_mut(&ino) else {
            return Err(errno(libc::EISDIR));
        };
        let touched = file.live.rot(range.clone(), &f) + file.durable.rot(range, &f);
        if touched == 0 {
            return Err(errno(libc::EINVAL));
        }
        Ok(())
    }

    /// Cuts the power: see the module doc. Handles opened before fail from now on.
    pub fn power_cut(&self, policy: CutPolicy) -> CutReport {
        self.lock().power_cut(policy)
    }

    /// Every file of the live namespace, sorted by path.
    pub fn files(&self) -> Vec<SimFileInfo> {
        let disk = self.lock();
        let mut out = Vec::new();
        walk(&disk, false, &mut |dir, name, path, ino| {
            if let Some(Node::File(file)) = disk.nodes.get(&ino) {
                out.push(SimFileInfo {
                    path,
                    live_len: file.live.len(),
                    durable_len: file.durable.len(),
                    allocated_bytes: file.live.allocated_bytes(),
                    pending_changes: file.pending.len(),
                    entry_durable: dir.durable.get(name) == Some(&ino),
                });
            }
        });
        out.sort_by(|a, b| a.path.cmp(&b.path));
        out
    }

    /// Every file the durable namespace names: the paths a `DropAll` power cut would leave.
    pub fn durable_files(&self) -> Vec<PathBuf> {
        let disk = self.lock();
        let mut out = Vec::new();
        walk(&disk, true, &mut |_, _, path, ino| {
            if let Some(Node::File(_)) = disk.nodes.get(&ino) {
                out.push(path);
            }
        });
        out.sort();
        out
    }

    /// The durable copy of the file `path` names (live namespace): its bytes up to its
    /// durable size (`EFBIG` past 4 GiB).
    pub fn read_durable(&self, path: &Path) -> io::Result<Vec<u8>> {
        let disk = self.lock();
        let ino = disk.lookup(&components(path)?)?;
        whole(&disk.file(ino)?.durable)
    }

    /// The live copy of the file at `path`, up to its size (no faults, no counting; `EFBIG`
    /// past 4 GiB).
    pub fn read_live(&self, path: &Path) -> io::Result<Vec<u8>> {
        let disk = self.lock();
        let ino = disk.lookup(&components(path)?)?;
        whole(&disk.file(ino)?.live)
    }

    /// Calls made on paths under `prefix` (all if `None`) since the start or the last reset.
    pub fn op_counts(&self, prefix: Option<&Path>) -> OpCounts {
        let prefix = prefix.map(normalize);
        self.lock().faults.counts_under(prefix.as_deref())
    }

    pub fn reset_op_counts(&self) {
        self.lock().faults.reset_counts();
    }

    /// Sleeps for the delay set for `path`, if any (without holding the lock).
    async fn delay(&self, path: &Path) {
        let delay = self.lock().faults.delay_for(path);
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
    }
}

/// Largest file [`SimFs::read_live`] and [`SimFs::read_durable`] return whole.
const WHOLE_FILE_LIMIT_BYTES: u64 = 1 << 32;

fn whole(contents: &contents::Contents) -> io::Result<Vec<u8>> {
    if contents.len() > WHOLE_FILE_LIMIT_BYTES {
        return Err(errno(libc::EFBIG));
    }
    Ok(contents.to_vec())
}

/// Visits every entry reachable from the root through live (or durable) entries, once per
/// inode, as (parent directory, name, path, inode).
fn walk(disk: &Disk, durable: bool, visit: &mut dyn FnMut(&state::DirNode, &str, PathBuf, Ino)) {
    let mut seen = HashSet::from([ROOT]);
    let mut stack = vec![(PathBuf::from("/"), ROOT)];
    while let Some((path, ino)) = stack.pop() {
        let Some(Node::Dir(dir)) = disk.nodes.get(&ino) else {
            continue;
        };
        let entries = if durable { &dir.durable } else { &dir.live };
        for (name, &child) in entries {
            if seen.insert(child) {
                visit(dir, name, path.join(name), child);
                stack.push((path.join(name), child));
            }
        }
    }
}

/// An open file of a [`SimFs`]. Clones share the handle.
#[derive(Clone, Debug)]
pub struct SimFile {
    handle: Arc<Handle>,
}

struct Handle {
    fs: SimFs,
    ino: Ino,
    generation: u64,
    /// As given to `open`.
    path: PathBuf,
    /// Normalized, for fault prefixes and counters.
    key: PathBuf,
    mode: IoMode,
}

impl fmt::Debug for Handle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Handle")
            .field("path", &self.path)
            .field("ino", &self.ino)
            .field("generation", &self.generation)
            .finish()
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        let mut disk = self.fs.lock();
        if disk.generation == self.generation {
            disk.release_handle(self.ino);
        }
    }
}

impl SimFile {
    /// Runs `f` on the disk after the delay, or fails with `EIO` if the power was cut since
    /// this file was opened.
    async fn run<T>(
        &self,
        f: impl FnOnce(&mut Disk, Ino, &Path) -> io::Result<T>,
    ) -> io::Result<T> {
        let handle = &self.handle;
        handle.fs.delay(&handle.key).await;
        let mut disk = handle.fs.lock();
        if disk.generation != handle.generation {
            return Err(errno(libc::EIO));
        }
        f(&mut disk, handle.ino, &handle.key)
    }
}

impl DiskFile for SimFile {
    async fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.run(|disk, ino, key| disk.read(ino, key, buf, offset))
            .await
    }

    async fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.run(|disk, ino, key| disk.write(ino, key, buf, offset, false))
            .await
    }

    async fn write_durable_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.run(|disk, ino, key| disk.write(ino, key, buf, offset, true))
            .await
    }

    async fn sync_data(&self) -> io::Result<()> {
        self.run(|disk, ino, key| disk.sync_data(ino, key)).await
    }

    async fn punch_hole(&self, offset: u64, length: u64) -> io::Result<()> {
        self.run(|disk, ino, key| disk.punch_hole(ino, key, offset, length))
            .await
    }

    async fn allocate(&self, offset: u64, length: u64) -> io::Result<()> {
        self.run(|disk, ino, key| disk.allocate(ino, key, offset, length))
            .await
    }

    async fn len(&self) -> io::Result<u64> {
        self.run(|disk, ino, _| Ok(disk.file(ino)?.live.len()))
            .await
    }

    async fn set_len(&self, len: u64) -> io::Result<()> {
        self.run(|disk, ino, key| disk.set_len(ino, key, len)).await
    }

    fn path(&self) -> &Path {
        &self.handle.path
    }

    fn mode(&self) -> IoMode {
        self.handle.mode
    }
}

impl Filesystem for SimFs {
    type File = SimFile;

    async fn open(&self, path: &Path, create: bool) -> io::Result<SimFile> {
        let key = normalize(path);
        self.delay(&key).await;
        let mut disk = self.lock();
        let (ino, created) = disk.open(path, create)?;
        if created {
            disk.faults.count(&key, |c| c.creates += 1);
        }
        let handle = Handle {
            fs: self.clone(),
            ino,
            generation: disk.generation,
            path: path.to_path_buf(),
            key,
            mode: disk.mode,
        };
        drop(disk);
        Ok(SimFile {
            handle: Arc::new(handle),
        })
    }

    async fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        self.delay(&normalize(dir)).await;
        self.lock().create_dir_all(dir)
    }

    async fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        let key = normalize(dir);
        self.delay(&key).await;
        self.lock().dir_synced(&key)
    }

    async fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        let key = normalize(from);
        self.delay(&key).await;
        let mut disk = self.lock();
        disk.faults.count(&key, |c| c.renames += 1);
        disk.rename(from, to)
    }

    async fn remove_file(&self, path: &Path) -> io::Result<()> {
        self.remove(path, false).await
    }

    async fn remove_dir(&self, path: &Path) -> io::Result<()> {
        self.remove(path, true).await
    }

    async fn list_dir(&self, dir: &Path) -> io::Result<Vec<DirEntry>> {
        self.delay(&normalize(dir)).await;
        self.lock().list_dir(dir)
    }

    async fn exists(&self, path: &Path) -> io::Result<bool> {
        self.delay(&normalize(path)).await;
        self.lock().exists(path)
    }

    async fn free_bytes(&self, path: &Path) -> io::Result<u64> {
        self.delay(&normalize(path)).await;
        self.lock().free_bytes(path)
    }
}

impl SimFs {
    async fn remove(&self, path: &Path, dir_wanted: bool) -> io::Result<()> {
        let key = normalize(path);
        self.delay(&key).await;
        let mut disk = self.lock();
        disk.faults.count(&key, |c| c.removes += 1);
        disk.remove(path, dir_wanted)
    }
}

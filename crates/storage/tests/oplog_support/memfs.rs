//! `MemFs`: an in-memory [`Filesystem`] double for the oplog tests, standing in for
//! `fs::sim::SimFs` until it lands (tests name it through `TestFs`, so switching is one line).
//!
//! It keeps, per file, the live bytes (what reads see) and the durable bytes (what survives a
//! power cut), following the durability contract of `ashlar_storage::fs`:
//! - `write_at` changes live bytes only; `sync_data` makes the whole file durable;
//!   `write_durable_at` makes its own blocks durable when it returns;
//! - a power cut keeps any subset of the non-durable blocks (4 KiB granularity), so a write
//!   under way may be torn;
//! - creations, renames and removals are durable only after `sync_dir`; a power cut keeps a
//!   prefix of the ones not yet synced.
//!
//! Operations yield to the runtime a random number of times before they complete, so writes
//! in flight together complete in random order. Faults: an optional capacity (ENOSPC), a
//! predicate that makes chosen operations fail with EIO, and a power cut at a chosen operation
//! count, after which every operation fails (the disk is gone) and `crashed()` gives the
//! filesystem as it comes back.

use ashlar_storage::fs::{DirEntry, DiskFile, Filesystem, IoMode, DIRECT_IO_ALIGNMENT_BYTES};
use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io;
use std::path::{Path, PathBuf};
use std::rc::Rc;

const BLOCK: u64 = 4096;

/// Decides which operations fail.
type FaultFn = Box<dyn FnMut(&FaultOp) -> bool>;

/// What an operation is, for fault predicates.
#[derive(Clone, Debug)]
pub struct FaultOp {
    pub kind: OpKind,
    pub path: PathBuf,
    pub offset: u64,
    pub len: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpKind {
    Read,
    Write,
    DurableWrite,
    Sync,
    Allocate,
    SetLen,
    PunchHole,
    Open,
    SyncDir,
    Rename,
    Remove,
    List,
}

/// A deterministic xorshift generator.
#[derive(Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Uniform in `[0, n)`; 0 if `n` is 0.
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }

    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

#[derive(Clone, Default)]
struct FileData {
    live: Vec<u8>,
    durable: Vec<u8>,
    /// Blocks written since they were last durable: their live contents at that write.
    pending: BTreeMap<u64, Vec<u8>>,
}

impl FileData {
    fn write_live(&mut self, buf: &[u8], offset: u64) {
        let end = offset as usize + buf.len();
        if self.live.len() < end {
            self.live.resize(end, 0);
        }
        self.live[offset as usize..end].copy_from_slice(buf);
        self.note_pending(offset, buf.len() as u64);
    }

    fn note_pending(&mut self, offset: u64, len: u64) {
        if len == 0 {
            return;
        }
        for block in offset / BLOCK..(offset + len).div_ceil(BLOCK) {
            let start = (block * BLOCK) as usize;
            let end = (start + BLOCK as usize).min(self.live.len());
            let content = if start < end {
                self.live[start..end].to_vec()
            } else {
                Vec::new()
            };
            self.pending.insert(block, content);
        }
    }

    /// Makes `[offset, offset+len)`'s blocks durable as they are live now.
    fn make_durable(&mut self, offset: u64, len: u64) {
        for block in offset / BLOCK..(offset + len).div_ceil(BLOCK) {
            self.pending.remove(&block);
            let start = (block * BLOCK) as usize;
            let end = (start + BLOCK as usize).min(self.live.len());
            if start >= end {
                continue;
            }
            if self.durable.len() < end {
                self.durable.resize(end, 0);
            }
            self.durable[start..end].copy_from_slice(&self.live[start..end]);
        }
    }

    fn sync(&mut self) {
        self.durable = self.live.clone();
        self.pending.clear();
    }
}

#[derive(Clone, Debug)]
enum DirOp {
    Link(PathBuf, u64),
    Unlink(PathBuf),
}

struct Disk {
    files: HashMap<u64, FileData>,
    next_ino: u64,
    live_names: BTreeMap<PathBuf, u64>,
    durable_names: BTreeMap<PathBuf, u64>,
    /// Name changes not yet made durable by `sync_dir`, in order.
    pending_dir: Vec<DirOp>,
    dirs: BTreeSet<PathBuf>,
    capacity: Option<u64>,
    rng: Rng,
    yield_min: u64,
    yield_max: u64,
    ops: u64,
    cut_at: Option<u64>,
    /// At `cut_at`, kill the process instead of cutting the power: the page cache (live
    /// bytes) survives.
    kill: bool,
    crashed: Option<MemFs>,
    dead: bool,
    /// Woken when the power is cut.
    cut: Rc<tokio::sync::Notify>,
    fault: Option<FaultFn>,
    durable_writes: u64,
    syncs: u64,
    /// Durable writes under way at offsets at or above `track_from`, and the most seen.
    track_from: u64,
    concurrent: u64,
    max_concurrent: u64,
}

impl Disk {
    fn used(&self) -> u64 {
        let named: BTreeSet<u64> = self.live_names.values().copied().collect();
        named
            .iter()
            .filter_map(|ino| self.files.get(ino))
            .map(|f| f.live.len() as u64)
            .sum()
    }

    /// Counts an operation; cuts the power when its time has come; fails injected faults.
    fn begin(&mut self, op: FaultOp) -> io::Result<()> {
        self.ops += 1;
        if self.cut_at == Some(self.ops) {
            if !self.kill {
                let image = self.power_cut_image();
                self.crashed = Some(image);
            }
            self.dead = true;
            self.cut.notify_waiters();
        }
        if self.dead {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        if let Some(fault) = self.fault.as_mut() {
            if fault(&op) {
                return Err(io::Error::from_raw_os_error(libc::EIO));
            }
        }
        Ok(())
    }

    /// What the disk holds after a power cut now: durable bytes, plus a random subset of the
    /// pending blocks, plus a random prefix of the pending name changes.
    fn power_cut_image(&mut self) -> MemFs {
        let mut files = HashMap::new();
        for (&ino, data) in &self.files {
            let mut durable = data.durable.clone();
            for (&block, content) in &data.pending {
                if !self.rng.chance(50) {
                    continue;
                }
                let start = (block * BLOCK) as usize;
                let end = start + content.len();
                if durable.len() < end {
                    durable.resize(end, 0);
                }
                durable[start..end].copy_from_slice(content);
            }
            files.insert(
                ino,
                FileData {
                    live: durable.clone(),
                    durable,
                    pending: BTreeMap::new(),
                },
            );
        }
        let mut names = self.durable_names.clone();
        let keep = self.rng.below(self.pending_dir.len() as u64 + 1) as usize;
        for op in &self.pending_dir[..keep] {
            match op {
                DirOp::Link(path, ino) => {
                    names.insert(path.clone(), *ino);
                }
                DirOp::Unlink(path) => {
                    names.remove(path);
                }
            }
        }
        let seed = self.rng.next();
        MemFs::from_parts(
            files,
            names,
            self.dirs.clone(),
            self.capacity,
            seed,
            self.next_ino,
        )
    }
}

/// The in-memory filesystem (a cheap handle).
#[derive(Clone)]
pub struct MemFs {
    disk: Rc<RefCell<Disk>>,
}

impl MemFs {
    pub fn new(seed: u64) -> Self {
        MemFs::from_parts(
            HashMap::new(),
            BTreeMap::new(),
            BTreeSet::from([PathBuf::from("/")]),
            None,
            seed,
            1,
        )
    }

    fn from_parts(
        files: HashMap<u64, FileData>,
        names: BTreeMap<PathBuf, u64>,
        dirs: BTreeSet<PathBuf>,
        capacity: Option<u64>,
        seed: u64,
        next_ino: u64,
    ) -> Self {
        MemFs {
            disk: Rc::new(RefCell::new(Disk {
                files,
                next_ino,
                live_names: names.clone(),
                durable_names: names,
                pending_dir: Vec::new(),
                dirs,
                capacity,
                rng: Rng::new(seed),
                yield_min: 0,
                yield_max: 2,
                ops: 0,
                cut_at: None,
                kill: false,
                crashed: None,
                dead: false,
                cut: Rc::new(tokio::sync::Notify::new()),
                fault: None,
                durable_writes: 0,
                syncs: 0,
                track_from: u64::MAX,
                concurrent: 0,
                max_concurrent: 0,
            })),
        }
    }

    /// Bytes the files may occupy in all (ENOSPC beyond); `None` for no limit.
    pub fn set_capacity(&self, bytes: Option<u64>) {
        self.disk.borrow_mut().capacity = bytes;
    }

    /// Each operation yields up to this many times before completing (0: completes at once).
    pub fn set_yields(&self, max: u64) {
        self.set_yields_range(0, max);
    }

    /// Each operation yields between `min` and `max` times before completing.
    pub fn set_yields_range(&self, min: u64, max: u64) {
        let mut disk = self.disk.borrow_mut();
        disk.yield_min = min;
        disk.yield_max = max.max(min);
    }

    /// Operations so far.
    pub fn ops(&self) -> u64 {
        self.disk.borrow().ops
    }

    /// Cuts the power when operation number `op` (counting from the start) begins.
    pub fn cut_power_at(&self, op: u64) {
        let mut disk = self.disk.borrow_mut();
        disk.cut_at = Some(op);
        disk.kill = false;
    }

    /// Kills the process when operation `op` begins: every operation fails from then on, as
    /// for a power cut, but the disk keeps everything written (the page cache survives).
    /// `revive` then gives the disk to the next process.
    pub fn kill_at(&self, op: u64) {
        let mut disk = self.disk.borrow_mut();
        disk.cut_at = Some(op);
        disk.kill = true;
    }

    /// Kills the process now (see `kill_at`).
    pub fn kill_now(&self) {
        let mut disk = self.disk.borrow_mut();
        disk.dead = true;
        disk.cut.notify_waiters();
    }

    /// After `kill_at` took effect (or to end a run without a cut): the same disk, working
    /// again, as the next process finds it.
    pub fn revive(&self) {
        let mut disk = self.disk.borrow_mut();
        disk.dead = false;
        disk.cut_at = None;
        disk.kill = false;
    }

    /// The filesystem as it comes back after the scheduled power cut, once it happened.
    pub fn crashed(&self) -> Option<MemFs> {
        self.disk.borrow().crashed.clone()
    }

    /// Cuts the power now: this filesystem fails every operation from now on; the returned
    /// one is what comes back.
    pub fn cut_power_now(&self) -> MemFs {
        let mut disk = self.disk.borrow_mut();
        let image = disk.power_cut_image();
        disk.dead = true;
        disk.cut.notify_waiters();
        image
    }

    /// Whether the power was cut (every operation fails).
    pub fn is_cut(&self) -> bool {
        self.disk.borrow().dead
    }

    /// Resolves once the power is cut.
    pub async fn power_cut(&self) {
        let notify = self.disk.borrow().cut.clone();
        loop {
            let notified = notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.is_cut() {
                return;
            }
            notified.await;
        }
    }

    /// Operations for which `fault` returns true fail with EIO (and change nothing).
    pub fn set_fault(&self, fault: impl FnMut(&FaultOp) -> bool + 'static) {
        self.disk.borrow_mut().fault = Some(Box::new(fault));
    }

    pub fn clear_fault(&self) {
        self.disk.borrow_mut().fault = None;
    }

    /// `write_durable_at` calls and `sync_data` calls so far.
    pub fn durable_writes(&self) -> u64 {
        self.disk.borrow().durable_writes
    }

    pub fn syncs(&self) -> u64 {
        self.disk.borrow().syncs
    }

    /// Starts counting durable writes under way at offsets from `offset` on (resets the
    /// maximum).
    pub fn track_concurrency_from(&self, offset: u64) {
        let mut disk = self.disk.borrow_mut();
        disk.track_from = offset;
        disk.max_concurrent = 0;
    }

    /// The most tracked durable writes under way at once.
    pub fn max_concurrent_writes(&self) -> u64 {
        self.disk.borrow().max_concurrent
    }

    pub fn used_bytes(&self) -> u64 {
        self.disk.borrow().used()
    }

    /// XORs `mask` into the byte at `offset` of `path`, live and durable (bit rot).
    pub fn corrupt(&self, path: &Path, offset: u64, mask: u8) {
        let mut disk = self.disk.borrow_mut();
        let ino = *disk.live_names.get(path).expect("corrupt: no such file");
        let data = disk.files.get_mut(&ino).expect("inode");
        data.live[offset as usize] ^= mask;
        if (offset as usize) < data.durable.len() {
            data.durable[offset as usize] ^= mask;
        }
    }

    /// The live contents of a file.
    pub fn read_file(&self, path: &Path) -> Vec<u8> {
        let disk = self.disk.borrow();
        let ino = disk.live_names[path];
        disk.files[&ino].live.clone()
    }

    /// Creates (or replaces) a file with `bytes`, durably (test setup).
    pub fn write_file(&self, path: &Path, bytes: &[u8]) {
        let mut disk = self.disk.borrow_mut();
        if let Some(parent) = path.parent() {
            for dir in parent.ancestors() {
                disk.dirs.insert(dir.to_path_buf());
            }
        }
        let ino = disk.next_ino;
        disk.next_ino += 1;
        disk.files.insert(
            ino,
            FileData {
                live: bytes.to_vec(),
                durable: bytes.to_vec(),
                pending: BTreeMap::new(),
            },
        );
        disk.live_names.insert(path.to_path_buf(), ino);
        disk.durable_names.insert(path.to_path_buf(), ino);
    }

    /// Names of the files directly in `dir`, sorted.
    pub fn file_names(&self, dir: &Path) -> Vec<String> {
        let disk = self.disk.borrow();
        disk.live_names
            .keys()
            .filter(|p| p.parent() == Some(dir))
            .filter_map(|p| p.file_name()?.to_str().map(String::from))
            .collect()
    }

    /// Paths of the files directly in `dir` whose names start with `prefix`, sorted.
    pub fn files_with_prefix(&self, dir: &Path, prefix: &str) -> Vec<PathBuf> {
        self.file_names(dir)
            .into_iter()
            .filter(|n| n.starts_with(prefix))
            .map(|n| dir.join(n))
            .collect()
    }

    async fn pause(&self) {
        let n = {
            let mut disk = self.disk.borrow_mut();
            let (min, max) = (disk.yield_min, disk.yield_max);
            min + disk.rng.below(max - min + 1)
        };
        for _ in 0..n {
            tokio::task::yield_now().await;
        }
    }

    fn begin(&self, kind: OpKind, path: &Path, offset: u64, len: u64) -> io::Result<()> {
        self.disk.borrow_mut().begin(FaultOp {
            kind,
            path: path.to_path_buf(),
            offset,
            len,
        })
    }

    fn is_dead(&self) -> bool {
        self.disk.borrow().dead
    }
}

fn err(code: i32) -> io::Error {
    io::Error::from_raw_os_error(code)
}

/// A file of a [`MemFs`].
pub struct MemFile {
    fs: MemFs,
    ino: u64,
    path: PathBuf,
}

impl MemFile {
    fn check_aligned(&self, offset: u64, len: usize) -> io::Result<()> {
        if !offset.is_multiple_of(DIRECT_IO_ALIGNMENT_BYTES)
            || !(len as u64).is_multiple_of(DIRECT_IO_ALIGNMENT_BYTES)
        {
            return Err(err(libc::EINVAL));
        }
        Ok(())
    }

    /// Grows the file to `end` if the capacity allows.
    fn reserve(&self, end: u64) -> io::Result<()> {
        let disk = self.fs.disk.borrow();
        let current = disk.files[&self.ino].live.len() as u64;
        if end > current {
            if let Some(capacity) = disk.capacity {
                if disk.used() + (end - current) > capacity {
                    return Err(err(libc::ENOSPC));
                }
            }
        }
        Ok(())
    }
}

impl DiskFile for MemFile {
    async fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.fs
            .begin(OpKind::Read, &self.path, offset, buf.len() as u64)?;
        {
            let disk = self.fs.disk.borrow();
            let live = &disk.files[&self.ino].live;
            for (i, b) in buf.iter_mut().enumerate() {
                *b = live.get(offset as usize + i).copied().unwrap_or(0);
            }
        }
        self.fs.pause().await;
        Ok(())
    }

    async fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.check_aligned(offset, buf.len())?;
        self.fs
            .begin(OpKind::Write, &self.path, offset, buf.len() as u64)?;
        self.reserve(offset + buf.len() as u64)?;
        self.fs
            .disk
            .borrow_mut()
            .files
            .get_mut(&self.ino)
            .expect("inode")
            .write_live(buf, offset);
        self.fs.pause().await;
        Ok(())
    }

    async fn write_durable_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.check_aligned(offset, buf.len())?;
        self.fs
            .begin(OpKind::DurableWrite, &self.path, offset, buf.len() as u64)?;
        self.reserve(offset + buf.len() as u64)?;
        let tracked = {
            let mut disk = self.fs.disk.borrow_mut();
            disk.files
                .get_mut(&self.ino)
                .expect("inode")
                .write_live(buf, offset);
            let tracked = offset >= disk.track_from;
            if tracked {
                disk.concurrent += 1;
                disk.max_concurrent = disk.max_concurrent.max(disk.concurrent);
            }
            tracked
        };
        // Under way: a power cut now keeps any subset of its blocks.
        self.fs.pause().await;
        let mut disk = self.fs.disk.borrow_mut();
        if tracked {
            disk.concurrent -= 1;
        }
        if disk.dead {
            return Err(err(libc::EIO));
        }
        disk.durable_writes += 1;
        disk.files
            .get_mut(&self.ino)
            .expect("inode")
            .make_durable(offset, buf.len() as u64);
        Ok(())
    }

    async fn sync_data(&self) -> io::Result<()> {
        self.fs.begin(OpKind::Sync, &self.path, 0, 0)?;
        self.fs.pause().await;
        if self.fs.is_dead() {
            return Err(err(libc::EIO));
        }
        let mut disk = self.fs.disk.borrow_mut();
        disk.syncs += 1;
        disk.files.get_mut(&self.ino).expect("inode").sync();
        Ok(())
    }

    async fn punch_hole(&self, offset: u64, length: u64) -> io::Result<()> {
        self.fs
            .begin(OpKind::PunchHole, &self.path, offset, length)?;
        let mut disk = self.fs.disk.borrow_mut();
        let data = disk.files.get_mut(&self.ino).expect("inode");
        let end = ((offset + length) as usize).min(data.live.len());
        if (offset as usize) < end {
            data.live[offset as usize..end].fill(0);
            data.note_pending(offset, end as u64 - offset);
        }
        Ok(())
    }

    async fn allocate(&self, offset: u64, length: u64) -> io::Result<()> {
        self.fs
            .begin(OpKind::Allocate, &self.path, offset, length)?;
        self.reserve(offset + length)?;
        {
            let mut disk = self.fs.disk.borrow_mut();
            let data = disk.files.get_mut(&self.ino).expect("inode");
            let end = (offset + length) as usize;
            if data.live.len() < end {
                let old = data.live.len() as u64;
                data.live.resize(end, 0);
                data.note_pending(old, end as u64 - old);
            }
        }
        self.fs.pause().await;
        Ok(())
    }

    async fn len(&self) -> io::Result<u64> {
        if self.fs.is_dead() {
            return Err(err(libc::EIO));
        }
        Ok(self.fs.disk.borrow().files[&self.ino].live.len() as u64)
    }

    async fn set_len(&self, len: u64) -> io::Result<()> {
        self.fs.begin(OpKind::SetLen, &self.path, len, 0)?;
        self.reserve(len)?;
        let mut disk = self.fs.disk.borrow_mut();
        let data = disk.files.get_mut(&self.ino).expect("inode");
        let old = data.live.len() as u64;
        data.live.resize(len as usize, 0);
        if len > old {
            data.note_pending(old, len - old);
        } else {
            data.note_pending(len, 0);
        }
        Ok(())
    }

    fn path(&self) -> &Path {
        &self.path
    }

    fn mode(&self) -> IoMode {
        IoMode::Direct
    }
}

impl Filesystem for MemFs {
    type File = MemFile;

    async fn open(&self, path: &Path, create: bool) -> io::Result<MemFile> {
        self.begin(OpKind::Open, path, 0, 0)?;
        self.pause().await;
        let mut disk = self.disk.borrow_mut();
        let parent = path.parent().unwrap_or(Path::new("/"));
        if !disk.dirs.contains(parent) {
            return Err(err(libc::ENOENT));
        }
        let ino = match disk.live_names.get(path) {
            Some(&ino) => ino,
            None if create => {
                let ino = disk.next_ino;
                disk.next_ino += 1;
                disk.files.insert(ino, FileData::default());
                disk.live_names.insert(path.to_path_buf(), ino);
                disk.pending_dir.push(DirOp::Link(path.to_path_buf(), ino));
                ino
            }
            None => return Err(err(libc::ENOENT)),
        };
        Ok(MemFile {
            fs: self.clone(),
            ino,
            path: path.to_path_buf(),
        })
    }

    async fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        self.begin(OpKind::SyncDir, dir, 0, 0)?;
        let mut disk = self.disk.borrow_mut();
        for d in dir.ancestors() {
            disk.dirs.insert(d.to_path_buf());
        }
        Ok(())
    }

    async fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        self.begin(OpKind::SyncDir, dir, 0, 0)?;
        self.pause().await;
        let mut disk = self.disk.borrow_mut();
        if disk.dead {
            return Err(err(libc::EIO));
        }
        // Name changes are applied in order; every one up to the last in `dir` becomes
        // durable (a journal commits in order).
        let last = disk.pending_dir.iter().rposition(|op| match op {
            DirOp::Link(p, _) | DirOp::Unlink(p) => p.parent() == Some(dir),
        });
        if let Some(last) = last {
            let ops: Vec<DirOp> = disk.pending_dir.drain(..=last).collect();
            for op in ops {
                match op {
                    DirOp::Link(path, ino) => {
                        disk.durable_names.insert(path, ino);
                    }
                    DirOp::Unlink(path) => {
                        disk.durable_names.remove(&path);
                    }
                }
            }
        }
        Ok(())
    }

    async fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        self.begin(OpKind::Rename, from, 0, 0)?;
        let mut disk = self.disk.borrow_mut();
        let ino = disk
            .live_names
            .remove(from)
            .ok_or_else(|| err(libc::ENOENT))?;
        disk.live_names.insert(to.to_path_buf(), ino);
        disk.pending_dir.push(DirOp::Unlink(from.to_path_buf()));
        disk.pending_dir.push(DirOp::Link(to.to_path_buf(), ino));
        Ok(())
    }

    async fn remove_file(&self, path: &Path) -> io::Result<()> {
        self.begin(OpKind::Remove, path, 0, 0)?;
        let mut disk = self.disk.borrow_mut();
        disk.live_names
            .remove(path)
            .ok_or_else(|| err(libc::ENOENT))?;
        disk.pending_dir.push(DirOp::Unlink(path.to_path_buf()));
        Ok(())
    }

    async fn remove_dir(&self, path: &Path) -> io::Result<()> {
        self.begin(OpKind::Remove, path, 0, 0)?;
        let mut disk = self.disk.borrow_mut();
        let busy = disk.live_names.keys().any(|p| p.starts_with(path))
            || disk.dirs.iter().any(|d| d != path && d.starts_with(path));
        if busy {
            return Err(err(libc::ENOTEMPTY));
        }
        if !disk.dirs.remove(path) {
            return Err(err(libc::ENOENT));
        }
        Ok(())
    }

    async fn list_dir(&self, dir: &Path) -> io::Result<Vec<DirEntry>> {
        self.begin(OpKind::List, dir, 0, 0)?;
        let disk = self.disk.borrow();
        if !disk.dirs.contains(dir) {
            return Err(err(libc::ENOENT));
        }
        let mut out: Vec<DirEntry> = disk
            .live_names
            .keys()
            .filter(|p| p.parent() == Some(dir))
            .map(|p| DirEntry {
                name: p.file_name().and_then(|n| n.to_str()).unwrap_or("").into(),
                is_dir: false,
            })
            .chain(
                disk.dirs
                    .iter()
                    .filter(|d| d.parent() == Some(dir))
                    .map(|d| DirEntry {
                        name: d.file_name().and_then(|n| n.to_str()).unwrap_or("").into(),
                        is_dir: true,
                    }),
            )
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    async fn exists(&self, path: &Path) -> io::Result<bool> {
        let disk = self.disk.borrow();
        Ok(disk.live_names.contains_key(path) || disk.dirs.contains(path))
    }

    async fn free_bytes(&self, _path: &Path) -> io::Result<u64> {
        let disk = self.disk.borrow();
        Ok(disk
            .capacity
            .map_or(u64::MAX / 2, |c| c.saturating_sub(disk.used())))
    }
}

//! `CrashFs`: a small in-memory disk that follows the `fs` durability contract and breaks it
//! the way real disks do. It stands in for `fs::sim::SimFs` until that lands; the tests only
//! use the methods below, so switching is the `TestFs` alias in mod.rs plus, if SimFs names
//! them differently, this list:
//! `new`, `cut_after`, `is_cut`, `ops_done`, `power_cut`, `set_space_limit`, `fail_next_syncs`,
//! `fail_nth_sync`, `set_yield`, `max_in_flight`, `reset_max_in_flight`.
//!
//! - Writes must be 4 KiB-aligned (the O_DIRECT rule; `EINVAL` otherwise).
//! - A write is durable after `sync_data` of its file; a new directory entry after `sync_dir`.
//! - `power_cut` returns the disk as it comes back: the durable state plus, per 4 KiB block,
//!   any one of the versions written since (or none); files whose entry was not synced kept
//!   or not at random.
//! - `cut_after(n)`: after `n` more mutating operations every operation fails with EIO (the
//!   machine is going down); take `power_cut` afterwards.
//! - `fail_next_syncs(n)`: the next `n` syncs fail and forget the file's unsynced writes
//!   without making them durable, while reads still return them (Linux after a writeback
//!   error: "fsyncgate").
//! - `set_space_limit`: writes that need a new block beyond the limit fail with ENOSPC (the
//!   blocks before it in the same write land).

use super::Rng;
use ashlar_storage::fs::{DirEntry, DiskFile, Filesystem, IoMode};
use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::path::{Path, PathBuf};
use std::rc::Rc;

const BLOCK: u64 = 4096;

#[derive(Clone, Default)]
struct FileState {
    view: BTreeMap<u64, Box<[u8]>>,
    durable: BTreeMap<u64, Box<[u8]>>,
    /// Unsynced changes in order: a block's new content, or `None` for a punched block.
    pending: Vec<(u64, Option<Box<[u8]>>)>,
    len: u64,
    durable_len: u64,
    entry_durable: bool,
}

#[derive(Default)]
struct State {
    files: BTreeMap<PathBuf, FileState>,
    dirs: BTreeSet<PathBuf>,
    ops_left: Option<u64>,
    ops_done: u64,
    space_blocks: Option<u64>,
    fail_syncs: usize,
    /// Syncs to let through before the one that fails.
    fail_sync_in: Option<usize>,
    yield_every_io: bool,
    in_flight: usize,
    max_in_flight: usize,
}

impl State {
    fn allocated(&self) -> u64 {
        self.files.values().map(|f| f.view.len() as u64).sum()
    }
}

/// See the module comment.
#[derive(Clone, Default)]
pub struct CrashFs {
    state: Rc<RefCell<State>>,
}

fn eio(what: &str) -> io::Error {
    io::Error::other(format!("simulated EIO: {what}"))
}

fn enospc() -> io::Error {
    io::Error::from_raw_os_error(libc::ENOSPC)
}

impl CrashFs {
    pub fn new() -> Self {
        let fs = CrashFs::default();
        fs.state.borrow_mut().dirs.insert(PathBuf::from("/"));
        fs
    }

    /// After `ops` more mutating operations, every operation fails with EIO.
    pub fn cut_after(&self, ops: u64) {
        self.state.borrow_mut().ops_left = Some(ops);
    }

    /// Mutating operations performed so far.
    pub fn ops_done(&self) -> u64 {
        self.state.borrow().ops_done
    }

    /// The disk after a power cut (see the module comment); `self` is left as it was.
    pub fn power_cut(&self, seed: u64) -> CrashFs {
        let mut rng = Rng::new(seed);
        let old = self.state.borrow();
        let mut files = BTreeMap::new();
        for (path, file) in &old.files {
            if !file.entry_durable && rng.chance(2) {
                continue;
            }
            let mut kept = file.durable.clone();
            let mut versions: BTreeMap<u64, Vec<&Option<Box<[u8]>>>> = BTreeMap::new();
            for (block, content) in &file.pending {
                versions.entry(*block).or_default().push(content);
            }
            for (block, candidates) in versions {
                let pick = rng.below(candidates.len() as u64 + 1) as usize;
                if pick == 0 {
                    continue; // the durable version
                }
                match candidates[pick - 1] {
                    Some(content) => kept.insert(block, content.clone()),
                    None => kept.remove(&block),
                };
            }
            let end = kept.keys().last().map_or(0, |b| (b + 1) * BLOCK);
            let len = file.durable_len.max(end);
            files.insert(
                path.clone(),
                FileState {
                    view: kept.clone(),
                    durable: kept,
                    pending: Vec::new(),
                    len,
                    durable_len: len,
                    entry_durable: true,
                },
            );
        }
        let state = State {
            files,
            dirs: old.dirs.clone(),
            space_blocks: old.space_blocks,
            yield_every_io: old.yield_every_io,
            ..State::default()
        };
        CrashFs {
            state: Rc::new(RefCell::new(state)),
        }
    }

    /// Data blocks allowed in all (`None`: unlimited).
    pub fn set_space_limit(&self, bytes: Option<u64>) {
        self.state.borrow_mut().space_blocks = bytes.map(|b| b / BLOCK);
    }

    pub fn allocated_bytes(&self) -> u64 {
        self.state.borrow().allocated() * BLOCK
    }

    pub fn fail_next_syncs(&self, count: usize) {
        self.state.borrow_mut().fail_syncs = count;
    }

    /// The `nth` sync from now (1 = the next one) fails.
    pub fn fail_nth_sync(&self, nth: usize) {
        self.state.borrow_mut().fail_sync_in = nth.checked_sub(1);
    }

    /// Whether the cut point was reached (every operation now fails).
    pub fn is_cut(&self) -> bool {
        self.dead()
    }

    pub fn reset_max_in_flight(&self) {
        self.state.borrow_mut().max_in_flight = 0;
    }

    /// Makes every I/O yield once to the scheduler, as an asynchronous disk does.
    pub fn set_yield(&self, on: bool) {
        self.state.borrow_mut().yield_every_io = on;
    }

    /// Most I/Os in flight at once (with `set_yield`).
    pub fn max_in_flight(&self) -> usize {
        self.state.borrow().max_in_flight
    }

    /// XORs one byte of a file, durably (bit rot).
    pub fn xor_byte(&self, path: &Path, offset: u64, mask: u8) {
        let mut state = self.state.borrow_mut();
        let file = state.files.get_mut(path).expect("no such file");
        for map in [&mut file.view, &mut file.durable] {
            let block = map
                .entry(offset / BLOCK)
                .or_insert_with(|| vec![0u8; BLOCK as usize].into());
            block[(offset % BLOCK) as usize] ^= mask;
        }
    }

    /// Debug description of a file: length, blocks present, pending changes, entry durable.
    pub fn describe(&self, path: &Path) -> String {
        let state = self.state.borrow();
        match state.files.get(path) {
            Some(f) => format!(
                "len {} durable_len {} view {:?} durable {:?} pending {:?} entry_durable {}",
                f.len,
                f.durable_len,
                f.view.keys().collect::<Vec<_>>(),
                f.durable.keys().collect::<Vec<_>>(),
                f.pending
                    .iter()
                    .map(|(b, c)| (*b, c.is_some()))
                    .collect::<Vec<_>>(),
                f.entry_durable
            ),
            None => "absent".into(),
        }
    }

    /// Paths of every file, sorted.
    pub fn files(&self) -> Vec<PathBuf> {
        self.state.borrow().files.keys().cloned().collect()
    }

    /// Counts a mutating operation; fails it once the cut point is reached.
    fn mutate(&self, what: &str) -> io::Result<()> {
        let mut state = self.state.borrow_mut();
        if state.ops_left == Some(0) {
            return Err(eio(what));
        }
        if let Some(left) = state.ops_left.as_mut() {
            *left -= 1;
        }
        state.ops_done += 1;
        Ok(())
    }

    fn dead(&self) -> bool {
        self.state.borrow().ops_left == Some(0)
    }

    async fn io_point(&self) {
        if !self.state.borrow().yield_every_io {
            return;
        }
        {
            let mut state = self.state.borrow_mut();
            state.in_flight += 1;
            state.max_in_flight = state.max_in_flight.max(state.in_flight);
        }
        tokio::task::yield_now().await;
        self.state.borrow_mut().in_flight -= 1;
    }

    fn with_file<T>(
        &self,
        path: &Path,
        f: impl FnOnce(&mut FileState) -> io::Result<T>,
    ) -> io::Result<T> {
        let mut state = self.state.borrow_mut();
        match state.files.get_mut(path) {
            Some(file) => f(file),
            None => Err(io::Error::new(io::ErrorKind::NotFound, "file removed")),
        }
    }
}

pub struct CrashFile {
    fs: CrashFs,
    path: PathBuf,
}

fn check_aligned(buf_len: usize, offset: u64) -> io::Result<()> {
    if !offset.is_multiple_of(BLOCK) || !(buf_len as u64).is_multiple_of(BLOCK) {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    Ok(())
}

impl DiskFile for CrashFile {
    async fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.fs.io_point().await;
        if self.fs.dead() {
            return Err(eio("read after the cut"));
        }
        self.fs.with_file(&self.path, |file| {
            let mut done = 0;
            while done < buf.len() {
                let at = offset + done as u64;
                let in_block = (at % BLOCK) as usize;
                let take = (BLOCK as usize - in_block).min(buf.len() - done);
                let out = &mut buf[done..done + take];
                match file.view.get(&(at / BLOCK)) {
                    Some(block) => out.copy_from_slice(&block[in_block..in_block + take]),
                    None => out.fill(0),
                }
                done += take;
            }
            if offset + buf.len() as u64 > file.len {
                let from = file.len.saturating_sub(offset) as usize;
                buf[from..].fill(0);
            }
            Ok(())
        })
    }

    async fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.fs.io_point().await;
        check_aligned(buf.len(), offset)?;
        self.fs.mutate("write")?;
        let mut state = self.fs.state.borrow_mut();
        let limit = state.space_blocks;
        let mut allocated = state.allocated();
        let file = state
            .files
            .get_mut(&self.path)
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "file removed"))?;
        for (i, chunk) in buf.chunks(BLOCK as usize).enumerate() {
            let block = offset / BLOCK + i as u64;
            if !file.view.contains_key(&block) {
                if limit.is_some_and(|limit| allocated >= limit) {
                    return Err(enospc());
                }
                allocated += 1;
            }
            let content: Box<[u8]> = chunk.into();
            file.view.insert(block, content.clone());
            file.pending.push((block, Some(content)));
            file.len = file.len.max((block + 1) * BLOCK);
        }
        Ok(())
    }

    async fn write_durable_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.write_at(buf, offset).await?;
        self.sync_data().await
    }

    async fn sync_data(&self) -> io::Result<()> {
        self.fs.io_point().await;
        self.fs.mutate("sync")?;
        let fail = {
            let mut state = self.fs.state.borrow_mut();
            let mut fail = state.fail_syncs > 0;
            if fail {
                state.fail_syncs -= 1;
            }
            match state.fail_sync_in {
                Some(0) => {
                    fail = true;
                    state.fail_sync_in = None;
                }
                Some(n) => state.fail_sync_in = Some(n - 1),
                None => {}
            }
            fail
        };
        self.fs.with_file(&self.path, |file| {
            let pending = std::mem::take(&mut file.pending);
            if fail {
                return Err(eio("sync failed; unsynced writes dropped from the disk"));
            }
            for (block, content) in pending {
                match content {
                    Some(content) => file.durable.insert(block, content),
                    None => file.durable.remove(&block),
                };
            }
            file.durable_len = file.len;
            Ok(())
        })
    }

    async fn punch_hole(&self, offset: u64, length: u64) -> io::Result<()> {
        self.fs.io_point().await;
        self.fs.mutate("punch")?;
        self.fs.with_file(&self.path, |file| {
            let mut at = offset;
            while at < offset + length {
                let block = at / BLOCK;
                let end = ((block + 1) * BLOCK).min(offset + length);
                if at.is_multiple_of(BLOCK) && end - at == BLOCK {
                    file.view.remove(&block);
                    file.pending.push((block, None));
                } else if let Some(content) = file.view.get(&block) {
                    let mut content = content.clone();
                    content[(at % BLOCK) as usize..(at % BLOCK + end - at) as usize].fill(0);
                    file.view.insert(block, content.clone());
                    file.pending.push((block, Some(content)));
                }
                at = end;
            }
            Ok(())
        })
    }

    async fn allocate(&self, offset: u64, length: u64) -> io::Result<()> {
        self.fs.io_point().await;
        self.fs.mutate("allocate")?;
        self.fs.with_file(&self.path, |file| {
            file.len = file.len.max(offset + length);
            Ok(())
        })
    }

    async fn len(&self) -> io::Result<u64> {
        if self.fs.dead() {
            return Err(eio("len after the cut"));
        }
        self.fs.with_file(&self.path, |file| Ok(file.len))
    }

    async fn set_len(&self, len: u64) -> io::Result<()> {
        self.fs.mutate("set_len")?;
        self.fs.with_file(&self.path, |file| {
            file.len = len;
            Ok(())
        })
    }

    fn path(&self) -> &Path {
        &self.path
    }

    fn mode(&self) -> IoMode {
        IoMode::Direct
    }
}

impl Filesystem for CrashFs {
    type File = CrashFile;

    async fn open(&self, path: &Path, create: bool) -> io::Result<CrashFile> {
        self.io_point().await;
        if self.dead() {
            return Err(eio("open after the cut"));
        }
        let exists = self.state.borrow().files.contains_key(path);
        if !exists {
            if !create {
                return Err(io::Error::new(io::ErrorKind::NotFound, "no such file"));
            }
            let parent = path.parent().unwrap_or(Path::new("/"));
            if !self.state.borrow().dirs.contains(parent) {
                return Err(io::Error::new(io::ErrorKind::NotFound, "no such directory"));
            }
            self.mutate("create")?;
            self.state
                .borrow_mut()
                .files
                .insert(path.to_path_buf(), FileState::default());
        }
        Ok(CrashFile {
            fs: self.clone(),
            path: path.to_path_buf(),
        })
    }

    async fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        self.io_point().await;
        self.mutate("mkdir")?;
        let mut state = self.state.borrow_mut();
        for ancestor in dir.ancestors() {
            state.dirs.insert(ancestor.to_path_buf());
        }
        Ok(())
    }

    async fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        self.io_point().await;
        self.mutate("sync_dir")?;
        let mut state = self.state.borrow_mut();
        if !state.dirs.contains(dir) {
            return Err(io::Error::new(io::ErrorKind::NotFound, "no such directory"));
        }
        for (path, file) in state.files.iter_mut() {
            if path.parent() == Some(dir) {
                file.entry_durable = true;
            }
        }
        Ok(())
    }

    async fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        self.mutate("rename")?;
        let mut state = self.state.borrow_mut();
        let mut file = state
            .files
            .remove(from)
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no such file"))?;
        file.entry_durable = false;
        state.files.insert(to.to_path_buf(), file);
        Ok(())
    }

    async fn remove_file(&self, path: &Path) -> io::Result<()> {
        self.mutate("unlink")?;
        match self.state.borrow_mut().files.remove(path) {
            Some(_) => Ok(()),
            None => Err(io::Error::new(io::ErrorKind::NotFound, "no such file")),
        }
    }

    async fn remove_dir(&self, path: &Path) -> io::Result<()> {
        self.mutate("rmdir")?;
        let mut state = self.state.borrow_mut();
        let busy = state.files.keys().any(|p| p.parent() == Some(path))
            || state.dirs.iter().any(|d| d.parent() == Some(path));
        if busy {
            return Err(io::Error::other("directory not empty"));
        }
        if state.dirs.remove(path) {
            Ok(())
        } else {
            Err(io::Error::new(io::ErrorKind::NotFound, "no such directory"))
        }
    }

    async fn list_dir(&self, dir: &Path) -> io::Result<Vec<DirEntry>> {
        self.io_point().await;
        if self.dead() {
            return Err(eio("list after the cut"));
        }
        let state = self.state.borrow();
        if !state.dirs.contains(dir) {
            return Err(io::Error::new(io::ErrorKind::NotFound, "no such directory"));
        }
        let name = |p: &Path| p.file_name().map(|n| n.to_string_lossy().into_owned());
        let mut out: Vec<DirEntry> = state
            .files
            .keys()
            .filter(|p| p.parent() == Some(dir))
            .filter_map(|p| {
                name(p).map(|name| DirEntry {
                    name,
                    is_dir: false,
                })
            })
            .chain(
                state
                    .dirs
                    .iter()
                    .filter(|d| d.parent() == Some(dir))
                    .filter_map(|d| name(d).map(|name| DirEntry { name, is_dir: true })),
            )
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    async fn exists(&self, path: &Path) -> io::Result<bool> {
        if self.dead() {
            return Err(eio("stat after the cut"));
        }
        let state = self.state.borrow();
        Ok(state.files.contains_key(path) || state.dirs.contains(path))
    }

    async fn free_bytes(&self, _path: &Path) -> io::Result<u64> {
        let state = self.state.borrow();
        Ok(match state.space_blocks {
            Some(limit) => limit.saturating_sub(state.allocated()) * BLOCK,
            None => 1 << 40,
        })
    }
}

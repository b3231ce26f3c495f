//! The simulated disk's state: inodes (files and directories), each with a live and a durable
//! copy, and the operations of the trait applied to them.

use super::contents::{Change, Contents, Fate, BLOCK_BYTES};
use super::faults::{FaultClass, Faults};
use crate::fs::{DirEntry, IoMode, DIRECT_IO_ALIGNMENT_BYTES};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::io;
use std::ops::Range;
use std::path::{Component, Path, PathBuf};

pub(super) type Ino = u64;
pub(super) const ROOT: Ino = 0;

/// Largest file size (Linux's `MAX_LFS_FILESIZE` on 64-bit).
const MAX_FILE_BYTES: u64 = i64::MAX as u64;

pub(super) fn errno(code: i32) -> io::Error {
    io::Error::from_raw_os_error(code)
}

/// A namespace change of one directory, applied atomically: names set (`Some`) or removed.
pub(super) type NsOp = Vec<(String, Option<Ino>)>;

/// A change not durable yet.
#[derive(Debug)]
pub(super) struct Pending {
    pub(super) change: Change,
    /// Its sync failed: still visible, never made durable by a later sync, kept or dropped by
    /// a power cut (Linux marks the pages clean after a writeback error).
    pub(super) failed: bool,
}

impl Pending {
    fn new(change: Change) -> Pending {
        Pending {
            change,
            failed: false,
        }
    }
}

#[derive(Debug, Default)]
pub(super) struct FileNode {
    pub(super) live: Contents,
    pub(super) durable: Contents,
    /// Changes since the durable copy, oldest first.
    pub(super) pending: Vec<Pending>,
}

#[derive(Debug, Default)]
pub(super) struct DirNode {
    pub(super) live: BTreeMap<String, Ino>,
    pub(super) durable: BTreeMap<String, Ino>,
    /// Entry changes since the durable copy, oldest first.
    pub(super) pending: Vec<NsOp>,
}

#[derive(Debug)]
pub(super) enum Node {
    File(FileNode),
    Dir(DirNode),
}

/// The whole simulated disk.
#[derive(Debug)]
pub(super) struct Disk {
    pub(super) mode: IoMode,
    pub(super) sector_bytes: u64,
    pub(super) capacity: u64,
    pub(super) nodes: HashMap<Ino, Node>,
    /// Open handles per inode (an unlinked inode lives while it has some).
    pub(super) handles: HashMap<Ino, u32>,
    next_ino: Ino,
    /// Bumped by every power cut; handles from an older generation are dead.
    pub(super) generation: u64,
    pub(super) faults: Faults,
}

/// A path as the simulated disk sees it: names below the root (relative paths start at the
/// root too; `..` is resolved lexically).
pub(super) fn components(path: &Path) -> io::Result<Vec<String>> {
    let mut out = Vec::new();
    for component in path.components() {
        match component {
            Component::Normal(name) => match name.to_str() {
                Some(name) => out.push(name.to_string()),
                None => return Err(errno(libc::EINVAL)),
            },
            Component::ParentDir => {
                out.pop();
            }
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    Ok(out)
}

/// The absolute, normalized form of `path` (for prefixes and counters).
pub(super) fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::from("/");
    for name in components(path).unwrap_or_default() {
        out.push(name);
    }
    out
}

fn check_range(offset: u64, length: u64) -> io::Result<Range<u64>> {
    match offset.checked_add(length) {
        Some(end) if end <= MAX_FILE_BYTES => Ok(offset..end),
        _ => Err(errno(libc::EFBIG)),
    }
}

/// The whole contents of every `sector`-sized sector meeting `range`, as they are in `live`.
fn sector_changes(live: &Contents, range: Range<u64>, sector: u64) -> Vec<Change> {
    if range.start >= range.end {
        return Vec::new();
    }
    (range.start / sector..range.end.div_ceil(sector))
        .map(|index| Change::Sector {
            offset: index * sector,
            bytes: live.snapshot(index * sector..(index + 1) * sector),
        })
        .collect()
}

impl Disk {
    pub(super) fn new(mode: IoMode) -> Disk {
        let mut nodes = HashMap::new();
        nodes.insert(ROOT, Node::Dir(DirNode::default()));
        Disk {
            mode,
            sector_bytes: BLOCK_BYTES,
            capacity: 1 << 40,
            nodes,
            handles: HashMap::new(),
            next_ino: ROOT + 1,
            generation: 0,
            faults: Faults::default(),
        }
    }

    fn dir(&self, ino: Ino) -> io::Result<&DirNode> {
        match self.nodes.get(&ino) {
            Some(Node::Dir(dir)) => Ok(dir),
            Some(Node::File(_)) => Err(errno(libc::ENOTDIR)),
            None => Err(errno(libc::ENOENT)),
        }
    }

    fn dir_mut(&mut self, ino: Ino) -> io::Result<&mut DirNode> {
        match self.nodes.get_mut(&ino) {
            Some(Node::Dir(dir)) => Ok(dir),
            Some(Node::File(_)) => Err(errno(libc::ENOTDIR)),
            None => Err(errno(libc::ENOENT)),
        }
    }

    pub(super) fn file(&self, ino: Ino) -> io::Result<&FileNode> {
        match self.nodes.get(&ino) {
            Some(Node::File(file)) => Ok(file),
            Some(Node::Dir(_)) => Err(errno(libc::EISDIR)),
            None => Err(errno(libc::EIO)),
        }
    }

    fn file_mut(&mut self, ino: Ino) -> io::Result<&mut FileNode> {
        match self.nodes.get_mut(&ino) {
            Some(Node::File(file)) => Ok(file),
            Some(Node::Dir(_)) => Err(errno(libc::EISDIR)),
            None => Err(errno(libc::EIO)),
        }
    }

    fn is_dir(&self, ino: Ino) -> bool {
        matches!(self.nodes.get(&ino), Some(Node::Dir(_)))
    }

    /// The inode `names` leads to in the live namespace.
    pub(super) fn lookup(&self, names: &[String]) -> io::Result<Ino> {
        let mut ino = ROOT;
        for name in names {
            ino = *self.dir(ino)?.live.get(name).ok_or(errno(libc::ENOENT))?;
        }
        Ok(ino)
    }

    /// The parent directory of `names` and the last name. The root has no parent: `EBUSY`.
    fn lookup_parent<'a>(&self, names: &'a [String]) -> io::Result<(Ino, &'a str)> {
        let (name, parent) = names.split_last().ok_or(errno(libc::EBUSY))?;
        let parent = self.lookup(parent)?;
        self.dir(parent)?;
        Ok((parent, name))
    }

    fn new_ino(&mut self, node: Node) -> Ino {
        let ino = self.next_ino;
        self.next_ino += 1;
        self.nodes.insert(ino, node);
        ino
    }

    /// Sets `name` in directory `dir` (live) and records the change as pending.
    fn set_entry(&mut self, dir: Ino, op: NsOp) -> io::Result<()> {
        let node = self.dir_mut(dir)?;
        for (name, target) in &op {
            match target {
                Some(ino) => node.live.insert(name.clone(), *ino),
                None => node.live.remove(name),
            };
        }
        node.pending.push(op);
        Ok(())
    }

    pub(super) fn take_handle(&mut self, ino: Ino) {
        *self.handles.entry(ino).or_default() += 1;
    }

    pub(super) fn release_handle(&mut self, ino: Ino) {
        if let Some(count) = self.handles.get_mut(&ino) {
            *count -= 1;
            if *count == 0 {
                self.handles.remove(&ino);
                self.collect_garbage();
            }
        }
    }

    /// Opens (and with `create`, creates) a file; returns its inode and whether it is new.
    pub(super) fn open(&mut self, path: &Path, create: bool) -> io::Result<(Ino, bool)> {
        let names = components(path)?;
        if names.is_empty() {
            return Err(errno(libc::EISDIR));
        }
        let (parent, name) = self.lookup_parent(&names)?;
        if let Some(&ino) = self.dir(parent)?.live.get(name) {
            if self.is_dir(ino) {
                return Err(errno(libc::EISDIR));
            }
            self.take_handle(ino);
            return Ok((ino, false));
        }
        if !create {
            return Err(errno(libc::ENOENT));
        }
        let ino = self.new_ino(Node::File(FileNode::default()));
        self.set_entry(parent, vec![(name.to_string(), Some(ino))])?;
        self.take_handle(ino);
        Ok((ino, true))
    }

    pub(super) fn create_dir_all(&mut self, path: &Path) -> io::Result<()> {
        let names = components(path)?;
        let mut ino = ROOT;
        for (i, name) in names.iter().enumerate() {
            let existing = self.dir(ino)?.live.get(name).copied();
            ino = match existing {
                Some(child) if self.is_dir(child) => child,
                Some(_) if i + 1 == names.len() => return Err(errno(libc::EEXIST)),
                Some(_) => return Err(errno(libc::ENOTDIR)),
                None => {
                    let child = self.new_ino(Node::Dir(DirNode::default()));
                    self.set_entry(ino, vec![(name.clone(), Some(child))])?;
                    self.sync_dir_node(ino)?;
                    child
                }
            };
        }
        Ok(())
    }

    fn sync_dir_node(&mut self, ino: Ino) -> io::Result<()> {
        let dir = self.dir_mut(ino)?;
        dir.durable = dir.live.clone();
        dir.pending.clear();
        Ok(())
    }

    /// `sync_dir`: a directory's entries become durable; on a file, its data does (fsync).
    pub(super) fn sync_dir(&mut self, path: &Path) -> io::Result<()> {
        let ino = self.lookup(&components(path)?)?;
        if self.is_dir(ino) {
            self.sync_dir_node(ino)?;
        } else {
            self.sync_file(ino);
        }
        self.collect_garbage();
        Ok(())
    }

    pub(super) fn rename(&mut self, from: &Path, to: &Path) -> io::Result<()> {
        let (from, to) = (components(from)?, components(to)?);
        let (from_dir, from_name) = self.lookup_parent(&from)?;
        let ino = *self
            .dir(from_dir)?
            .live
            .get(from_name)
            .ok_or(errno(libc::ENOENT))?;
        let (to_dir, to_name) = self.lookup_parent(&to)?;
        if from == to {
            return Ok(());
        }
        if self.is_dir(ino) && to.starts_with(&from) {
            return Err(errno(libc::EINVAL));
        }
        if let Some(&target) = self.dir(to_dir)?.live.get(to_name) {
            if target == ino {
                return Ok(());
            }
            self.check_replace(ino, target)?;
        }
        let (from_name, to_name) = (from_name.to_string(), to_name.to_string());
        if from_dir == to_dir {
            self.set_entry(from_dir, vec![(to_name, Some(ino)), (from_name, None)])?;
        } else {
            self.set_entry(to_dir, vec![(to_name, Some(ino))])?;
            self.set_entry(from_dir, vec![(from_name, None)])?;
        }
        self.collect_garbage();
        Ok(())
    }

    /// Whether `source` may replace `target` in a rename (rename(2) rules).
    fn check_replace(&self, source: Ino, target: Ino) -> io::Result<()> {
        match (self.is_dir(source), self.is_dir(target)) {
            (false, true) => Err(errno(libc::EISDIR)),
            (true, false) => Err(errno(libc::ENOTDIR)),
            (true, true) if !self.dir(target)?.live.is_empty() => Err(errno(libc::ENOTEMPTY)),
            _ => Ok(()),
        }
    }

    pub(super) fn remove(&mut self, path: &Path, dir_wanted: bool) -> io::Result<()> {
        let names = components(path)?;
        let (parent, name) = self.lookup_parent(&names)?;
        let ino = *self
            .dir(parent)?
            .live
            .get(name)
            .ok_or(errno(libc::ENOENT))?;
        match (dir_wanted, self.is_dir(ino)) {
            (false, true) => return Err(errno(libc::EISDIR)),
            (true, false) => return Err(errno(libc::ENOTDIR)),
            (true, true) if !self.dir(ino)?.live.is_empty() => return Err(errno(libc::ENOTEMPTY)),
            _ => {}
        }
        self.set_entry(parent, vec![(name.to_string(), None)])?;
        self.collect_garbage();
        Ok(())
    }

    pub(super) fn list_dir(&self, path: &Path) -> io::Result<Vec<DirEntry>> {
        let ino = self.lookup(&components(path)?)?;
        let dir = self.dir(ino)?;
        Ok(dir
            .live
            .iter()
            .map(|(name, &child)| DirEntry {
                name: name.clone(),
                is_dir: self.is_dir(child),
            })
            .collect())
    }

    pub(super) fn exists(&self, path: &Path) -> io::Result<bool> {
        match self.lookup(&components(path)?) {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(e),
        }
    }

    pub(super) fn free_bytes(&self, path: &Path) -> io::Result<u64> {
        self.lookup(&components(path)?)?;
        Ok(self.capacity.saturating_sub(self.used_bytes()))
    }

    /// Inodes named by some directory's live entries.
    fn live_linked(&self) -> HashSet<Ino> {
        let mut linked = HashSet::from([ROOT]);
        for node in self.nodes.values() {
            if let Node::Dir(dir) = node {
                linked.extend(dir.live.values().copied());
            }
        }
        linked
    }

    /// Allocated bytes of the files that are linked or open (live state).
    pub(super) fn used_bytes(&self) -> u64 {
        let linked = self.live_linked();
        self.nodes
            .iter()
            .filter(|(ino, _)| linked.contains(ino) || self.handles.contains_key(ino))
            .map(|(_, node)| match node {
                Node::File(file) => file.live.allocated_bytes(),
                Node::Dir(_) => 0,
            })
            .sum()
    }

    /// Drops inodes that no directory names (live, durable, or in a pending entry change a
    /// power cut may still make durable) and no handle holds.
    pub(super) fn collect_garbage(&mut self) {
        loop {
            let mut referenced = HashSet::from([ROOT]);
            for node in self.nodes.values() {
                if let Node::Dir(dir) = node {
                    referenced.extend(dir.live.values().chain(dir.durable.values()).copied());
                    let pending = dir.pending.iter().flatten();
                    referenced.extend(pending.filter_map(|(_, target)| *target));
                }
            }
            let doomed: Vec<Ino> = self
                .nodes
                .keys()
                .filter(|ino| !referenced.contains(ino) && !self.handles.contains_key(ino))
                .copied()
                .collect();
            if doomed.is_empty() {
                return;
            }
            for ino in doomed {
                self.nodes.remove(&ino);
            }
        }
    }

    /// ENOSPC unless `extra_blocks` more blocks fit.
    fn check_space(&self, extra_blocks: u64) -> io::Result<()> {
        let needed = extra_blocks.saturating_mul(BLOCK_BYTES);
        if self.used_bytes().saturating_add(needed) > self.capacity {
            return Err(errno(libc::ENOSPC));
        }
        Ok(())
    }

    fn check_fault(&mut self, class: FaultClass, path: &Path) -> io::Result<()> {
        if self.faults.should_fail(class, path) {
            return Err(errno(libc::EIO));
        }
        Ok(())
    }

    pub(super) fn read(
        &mut self,
        ino: Ino,
        path: &Path,
        buf: &mut [u8],
        at: u64,
    ) -> io::Result<()> {
        self.faults.count(path, |c| c.reads += 1);
        at.checked_add(buf.len() as u64)
            .ok_or(errno(libc::EINVAL))?;
        self.check_fault(FaultClass::Read, path)?;
        self.file(ino)?.live.read(buf, at);
        Ok(())
    }

    fn check_alignment(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        let aligned = offset.is_multiple_of(DIRECT_IO_ALIGNMENT_BYTES)
            && (buf.len() as u64).is_multiple_of(DIRECT_IO_ALIGNMENT_BYTES);
        if self.mode == IoMode::Direct && !aligned {
            return Err(errno(libc::EINVAL));
        }
        Ok(())
    }

    /// `write_at` (`durable == false`) and `write_durable_at`.
    pub(super) fn write(
        &mut self,
        ino: Ino,
        path: &Path,
        buf: &[u8],
        offset: u64,
        durable: bool,
    ) -> io::Result<()> {
        self.faults.count(path, |c| match durable {
            true => c.durable_writes += 1,
            false => c.writes += 1,
        });
        self.check_alignment(buf, offset)?;
        let range = check_range(offset, buf.len() as u64)?;
        self.check_fault(FaultClass::Write, path)?;
        if buf.is_empty() {
            return Ok(());
        }
        self.check_space(self.file(ino)?.live.missing_blocks(&range))?;
        let sector = self.sector_bytes;
        let file = self.file_mut(ino)?;
        let old_len = file.live.len();
        file.live.write(buf, offset);
        let mut changes = sector_changes(&file.live, range.clone(), sector);
        if file.live.len() > old_len {
            changes.push(Change::Len(file.live.len()));
        }
        if !durable {
            file.pending.extend(changes.into_iter().map(Pending::new));
            return Ok(());
        }
        if self.faults.should_fail(FaultClass::Sync, path) {
            let failed = changes.into_iter().map(|change| Pending {
                failed: !change.is_size(),
                change,
            });
            self.file_mut(ino)?.pending.extend(failed);
            return Err(errno(libc::EIO));
        }
        make_durable(self.file_mut(ino)?, changes);
        Ok(())
    }

    pub(super) fn sync_data(&mut self, ino: Ino, path: &Path) -> io::Result<()> {
        self.faults.count(path, |c| c.syncs += 1);
        if self.faults.should_fail(FaultClass::Sync, path) {
            for pending in &mut self.file_mut(ino)?.pending {
                pending.failed = !pending.change.is_size();
            }
            return Err(errno(libc::EIO));
        }
        self.file(ino)?;
        self.sync_file(ino);
        Ok(())
    }

    /// Makes every pending change of a file durable, in order, except the data changes of
    /// failed syncs.
    fn sync_file(&mut self, ino: Ino) {
        if let Ok(file) = self.file_mut(ino) {
            commit(file, |pending| !pending.failed);
        }
    }

    pub(super) fn dir_synced(&mut self, path: &Path) -> io::Result<()> {
        self.faults.count(path, |c| c.dir_syncs += 1);
        self.check_fault(FaultClass::Sync, path)?;
        self.sync_dir(path)
    }

    pub(super) fn punch_hole(
        &mut self,
        ino: Ino,
        path: &Path,
        offset: u64,
        length: u64,
    ) -> io::Result<()> {
        self.faults.count(path, |c| c.punches += 1);
        if length == 0 {
            return Err(errno(libc::EINVAL));
        }
        let range = check_range(offset, length)?;
        self.check_fault(FaultClass::Write, path)?;
        let sector = self.sector_bytes;
        let file = self.file_mut(ino)?;
        let clipped = range.start..range.end.min(file.live.len());
        let mut blocks = file.live.allocated_in(&clipped);
        blocks.extend(file.durable.allocated_in(&clipped));
        blocks.sort_unstable();
        blocks.dedup();
        file.live.punch(range);
        let changes = punch_changes(&file.live, &blocks, clipped, sector);
        file.pending.extend(changes.into_iter().map(Pending::new));
        Ok(())
    }

    pub(super) fn allocate(
        &mut self,
        ino: Ino,
        path: &Path,
        offset: u64,
        length: u64,
    ) -> io::Result<()> {
        self.faults.count(path, |c| c.allocates += 1);
        if length == 0 {
            return Err(errno(libc::EINVAL));
        }
        let range = check_range(offset, length)?;
        self.check_fault(FaultClass::Write, path)?;
        let missing = self.file(ino)?.live.missing_block_indexes(&range);
        self.check_space(missing.len() as u64)?;
        let file = self.file_mut(ino)?;
        let old_len = file.live.len();
        file.live.allocate(range);
        let mut changes: Vec<Change> = missing
            .into_iter()
            .map(|block| Change::Alloc { block })
            .collect();
        if file.live.len() > old_len {
            changes.push(Change::Len(file.live.len()));
        }
        file.pending.extend(changes.into_iter().map(Pending::new));
        Ok(())
    }

    pub(super) fn set_len(&mut self, ino: Ino, path: &Path, len: u64) -> io::Result<()> {
        self.faults.count(path, |c| c.set_lens += 1);
        if len > MAX_FILE_BYTES {
            return Err(errno(libc::EFBIG));
        }
        self.check_fault(FaultClass::Write, path)?;
        let sector = self.sector_bytes;
        let file = self.file_mut(ino)?;
        let old_len = file.live.len();
        file.live.set_len(len);
        if len > old_len {
            file.pending.push(Pending::new(Change::Len(len)));
        } else if len < old_len {
            let changes = truncate_changes(file, len, sector);
            file.pending.extend(changes.into_iter().map(Pending::new));
        }
        Ok(())
    }
}

/// Changes recording a punch of `range` (already clipped to the size) into `live`, for the
/// `blocks` of the range that either copy had allocated (punching a hole in a hole is no
/// change): a whole block is freed; a partial one gets its sectors rewritten.
fn punch_changes(live: &Contents, blocks: &[u64], range: Range<u64>, sector: u64) -> Vec<Change> {
    let mut changes = Vec::new();
    for &block in blocks {
        let start = block * BLOCK_BYTES;
        let part = range.start.max(start)..range.end.min(start + BLOCK_BYTES);
        if part == (start..start + BLOCK_BYTES) {
            changes.push(Change::Dealloc { block });
        } else {
            changes.extend(sector_changes(live, part, sector));
        }
    }
    changes
}

/// Changes recording a truncation to `len` (already applied to the live copy): the size, then
/// the zeros the kernel wrote over the rest of the block the new end falls in, if either copy
/// has that block.
fn truncate_changes(file: &FileNode, len: u64, sector: u64) -> Vec<Change> {
    let mut changes = vec![Change::Truncate(len)];
    let tail = len..len.next_multiple_of(BLOCK_BYTES);
    let block_start = tail.start - tail.start % BLOCK_BYTES;
    let has_block = |c: &Contents| !c.allocated_in(&(block_start..block_start + 1)).is_empty();
    if !tail.is_empty() && (has_block(&file.live) || has_block(&file.durable)) {
        changes.extend(sector_changes(&file.live, tail, sector));
    }
    changes
}

/// Applies a durable write's `changes` to the durable copy, after every pending size change
/// (the inode's size is journaled metadata: committing it commits the older sizes, in order,
/// so the durable size becomes the live one), and updates the older pending changes.
fn make_durable(file: &mut FileNode, changes: Vec<Change>) {
    commit(file, |pending| pending.change.is_size());
    for change in &changes {
        change.apply(&mut file.durable);
        file.pending = survivors(std::mem::take(&mut file.pending), change);
    }
}

/// Applies the pending changes `chosen` picks to the durable copy, oldest first, and removes
/// them; the others (older ones) become what can still reach the disk after them.
fn commit(file: &mut FileNode, chosen: impl Fn(&Pending) -> bool) {
    let mut left: Vec<Pending> = Vec::new();
    for pending in std::mem::take(&mut file.pending) {
        if !chosen(&pending) {
            left.push(pending);
            continue;
        }
        pending.change.apply(&mut file.durable);
        if !left.is_empty() {
            left = survivors(left, &pending.change);
        }
    }
    file.pending = left;
}

/// What of the `older` pending changes can still reach the disk once `newer` is durable.
fn survivors(older: Vec<Pending>, newer: &Change) -> Vec<Pending> {
    let mut out = Vec::with_capacity(older.len());
    for pending in older {
        match pending.change.fate_after(newer) {
            Fate::Keep => out.push(pending),
            Fate::Drop => {}
            Fate::Replace(changes) => out.extend(changes.into_iter().map(|change| Pending {
                change,
                failed: pending.failed,
            })),
        }
    }
    out
}

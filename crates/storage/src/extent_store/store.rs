//! `ExtentStore`: finds, opens, creates and evicts egroups, and splits reads and write batches
//! into per-egroup work that runs concurrently.

use super::egroup::Egroup;
use super::extent_lock::{ExtentLocks, EVERY_EXTENT};
use super::format::{egroup_dir, egroup_file_name, parse_egroup_file_name};
use super::journal::Journal;
use super::{io_error, ExtentError, ExtentStoreConfig};
use crate::fs::Filesystem;
use crate::join::try_join_all;
use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};
use std::io;
use std::path::PathBuf;
use std::rc::Rc;

/// A vdisk's extent store on one node's disks. Single-threaded: one shard controller owns the
/// egroups of its ranges; concurrent tasks of that thread may share it (no `RefCell` borrow is
/// held across an await; an egroup in use is never evicted; a write batch locks the extents
/// of an egroup it writes, so two batches never interleave inside one extent, while different
/// extents and egroups proceed in parallel).
///
/// Memory, for the README's sizing section:
/// - per **known** egroup (one that exists on disk; learned by listing each disk's vdisk
///   directory once, then kept up to date on create): one `u64` in a hash set, about 10 bytes
///   (up to 20 right after the set grows). Looking up an egroup that does not exist costs
///   neither memory nor a syscall.
/// - per **open** egroup: 20 KiB of checksum entries (4 extents × 256 blocks × 20 bytes), its
///   file handle and path, about 20.3 KiB in all. At most `max_open_egroups` stay open when
///   idle; egroups in use by running operations (or waiting for `sync` after a failed write)
///   are never evicted, so the count can exceed it by the number of egroups in use.
/// - per write batch in progress: the merged content of partial blocks (4 KiB each) and one
///   1 MiB read buffer per extent normalized, for at most `max_writing_egroups` egroups at a
///   time.
pub struct ExtentStore<F: Filesystem> {
    pub(super) fs: F,
    pub(super) config: ExtentStoreConfig,
    /// The egroups that exist, per disk; `None` until listed (first use, or after `close_all`).
    known: RefCell<Option<Known>>,
    listing: tokio::sync::Mutex<()>,
    open: RefCell<HashMap<u64, Rc<Slot<F::File>>>>,
    clock: Cell<u64>,
    /// Listings made so far: the generation of the newest.
    listings_made: Cell<u64>,
    /// The block log and its overlay, when the store writes format 3's log (`journal`).
    pub(super) journal: Option<Journal<F>>,
}

pub(super) struct Slot<D> {
    egroup: tokio::sync::OnceCell<Egroup<D>>,
    /// Held by writers on the extents they write, by recovery and by a read re-checking a
    /// checksum mismatch on every extent.
    pub(super) lock: ExtentLocks,
    last_use: Cell<u64>,
}

impl<D> Slot<D> {
    fn evictable(&self) -> bool {
        self.egroup
            .get()
            .is_none_or(|e| e.needs_recovery.get() == 0)
    }
}

struct Known {
    disks: Vec<HashSet<u64>>,
    dir_exists: Vec<bool>,
    /// Whether the listed directories (and their parents) have been synced since listing.
    /// Reads do not need it; a write does, before it relies on a listed file (`apply`).
    dirs_synced: bool,
    /// Which listing this is: `close_all` drops a listing and the next use makes another, so
    /// a sync that began on one must not mark the next one synced.
    generation: u64,
}

impl Known {
    pub(super) fn find(&self, egroup: u64) -> Option<usize> {
        self.disks.iter().position(|set| set.contains(&egroup))
    }
}

impl<F: Filesystem> ExtentStore<F> {
    /// Does no I/O: the disks' vdisk directories are listed on first use.
    ///
    /// # Panics
    /// If `config.disks` is empty (a configuration error, checked before any I/O).
    pub fn new(fs: F, config: ExtentStoreConfig) -> Self {
        assert!(
            !config.disks.is_empty(),
            "an extent store needs at least one disk"
        );
        let journal = config
            .journal
            .clone()
            .map(|journal| Journal::new(journal, config.disks.len()));
        ExtentStore {
            fs,
            journal,
            config,
            known: RefCell::new(None),
            listing: tokio::sync::Mutex::new(()),
            open: RefCell::new(HashMap::new()),
            clock: Cell::new(0),
            listings_made: Cell::new(0),
        }
    }

    /// Number of egroups known to exist (the location set), for tests and stats.
    pub fn cached_egroups(&self) -> usize {
        self.known
            .borrow()
            .as_ref()
            .map_or(0, |k| k.disks.iter().map(HashSet::len).sum())
    }

    /// Number of egroups open (checksum tables in memory).
    pub fn open_egroups(&self) -> usize {
        self.open.borrow().len()
    }

    /// Lists each disk's vdisk directory once. Tries to make the listed entries durable too
    /// (after a kill -9 a listed file may still lack a durable directory entry); a failed
    /// directory sync does not fail the listing, since reads do not depend on it: writes call
    /// [`Self::ensure_durable_listing`], which retries it.
    pub(super) async fn ensure_listing(&self) -> Result<(), ExtentError> {
        if self.known.borrow().is_some() {
            return Ok(());
        }
        let _guard = self.listing.lock().await;
        if self.known.borrow().is_some() {
            return Ok(());
        }
        self.listings_made.set(self.listings_made.get() + 1);
        let mut known = Known {
            disks: Vec::new(),
            dir_exists: Vec::new(),
            dirs_synced: false,
            generation: self.listings_made.get(),
        };
        for disk in &self.config.disks {
            let dir = egroup_dir(&disk.path, self.config.vdisk);
            let mut set = HashSet::new();
            let exists = match self.fs.list_dir(&dir).await {
                Ok(entries) => {
                    for entry in entries.iter().filter(|e| !e.is_dir) {
                        let Some(egroup) = parse_egroup_file_name(&entry.name) else {
                            continue;
                        };
                        if let Some(first) = known.find(egroup) {
                            tracing::error!(egroup, duplicate = %dir.join(&entry.name).display(),
                                used = %self.config.disks[first].path.display(),
                                "extent group found on two disks: using the first");
                            continue;
                        }
                        set.insert(egroup);
                    }
                    true
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => false,
                Err(e) => return Err(io_error(&dir, None, e)),
            };
            known.disks.push(set);
            known.dir_exists.push(exists);
        }
        known.dirs_synced = match self.sync_listed_dirs(&known.dir_exists).await {
            Ok(()) => true,
            Err(error) => {
                tracing::warn!(vdisk = %self.config.vdisk, %error,
                    "syncing the extent store's directories failed: reads go on, writes retry it");
                false
            }
        };
        *self.known.borrow_mut() = Some(known);
        Ok(())
    }

    /// The listing, with its directories durable: a write may rely on every listed file.
    pub(super) async fn ensure_durable_listing(&self) -> Result<(), ExtentError> {
        loop {
            self.ensure_listing().await?;
            let (dir_exists, generation) = match self.known.borrow().as_ref() {
                Some(known) if !known.dirs_synced => (known.dir_exists.clone(), known.generation),
                _ => return Ok(()),
            };
            self.sync_listed_dirs(&dir_exists).await?;
            match self.known.borrow_mut().as_mut() {
                Some(known) if known.generation == generation => {
                    known.dirs_synced = true;
                    return Ok(());
                }
                // Listed again while this sync ran: the new listing may name other directories.
                _ => continue,
            }
        }
    }

    /// Syncs each existing vdisk directory and its two parents.
    async fn sync_listed_dirs(&self, dir_exists: &[bool]) -> Result<(), ExtentError> {
        for (disk, _) in self
            .config
            .disks
            .iter()
            .zip(dir_exists)
            .filter(|(_, e)| **e)
        {
            let dir = egroup_dir(&disk.path, self.config.vdisk);
            for synced in dir.ancestors().take(3) {
                self.fs
                    .sync_dir(synced)
                    .await
                    .map_err(|e| io_error(synced, None, e))?;
            }
        }
        Ok(())
    }

    pub(super) fn find(&self, egroup: u64) -> Option<usize> {
        self.known.borrow().as_ref().and_then(|k| k.find(egroup))
    }

    fn remember(&self, disk: usize, egroup: u64) {
        if let Some(known) = self.known.borrow_mut().as_mut() {
            known.disks[disk].insert(egroup);
            known.dir_exists[disk] = true;
        }
    }

    /// Known egroups in `[first, last]`, sorted.
    pub(super) fn known_in(&self, first: u64, last: u64) -> Vec<u64> {
        let known = self.known.borrow();
        let Some(known) = known.as_ref() else {
            return Vec::new();
        };
        let total: usize = known.disks.iter().map(HashSet::len).sum();
        let mut out: Vec<u64> = if last - first < total as u64 {
            (first..=last)
                .filter(|g| known.find(*g).is_some())
                .collect()
        } else {
            let all = known.disks.iter().flat_map(|set| set.iter().copied());
            all.filter(|g| (first..=last).contains(g)).collect()
        };
        out.sort_unstable();
        out
    }

    /// Where the egroup's file is, or would be created on the first disk.
    pub(super) fn egroup_path(&self, egroup: u64) -> PathBuf {
        self.path(self.find(egroup).unwrap_or(0), egroup)
    }

    /// Calls `f` with each open egroup of `egroups`.
    pub(super) fn for_each_open(
        &self,
        egroups: &HashSet<u64>,
        mut f: impl FnMut(&Egroup<F::File>),
    ) {
        for (egroup, slot) in self.open.borrow().iter() {
            if egroups.contains(egroup) {
                if let Some(open) = slot.egroup.get() {
                    f(open);
                }
            }
        }
    }

    fn path(&self, disk: usize, egroup: u64) -> PathBuf {
        egroup_dir(&self.config.disks[disk].path, self.config.vdisk).join(egroup_file_name(egroup))
    }

    /// The egroup's slot, opened (or being opened) in the open set. Holding it pins it.
    pub(super) fn pin(&self, egroup: u64) -> Rc<Slot<F::File>> {
        self.clock.set(self.clock.get() + 1);
        let now = self.clock.get();
        if let Some(slot) = self.open.borrow().get(&egroup) {
            slot.last_use.set(now);
            return slot.clone();
        }
        self.evict_if_full();
        let slot = Rc::new(Slot {
            egroup: tokio::sync::OnceCell::new(),
            lock: ExtentLocks::default(),
            last_use: Cell::new(now),
        });
        self.open.borrow_mut().insert(egroup, slot.clone());
        slot
    }

    /// Back to `max_open_egroups` once concurrent operations have released their egroups.
    pub(super) fn trim(&self) {
        if self.open.borrow().len() > self.config.max_open_egroups {
            self.evict_down_to(self.config.max_open_egroups.max(1));
        }
    }

    /// Makes room for one more egroup.
    fn evict_if_full(&self) {
        self.evict_down_to(self.config.max_open_egroups.max(1) - 1);
    }

    /// Evicts least recently used egroups that nobody uses and that need no recovery until at
    /// most `limit` are open (or none is evictable).
    fn evict_down_to(&self, limit: usize) {
        let mut open = self.open.borrow_mut();
        while open.len() > limit {
            let victim = open
                .iter()
                .filter(|(_, slot)| Rc::strong_count(slot) == 1 && slot.evictable())
                .min_by_key(|(_, slot)| slot.last_use.get())
                .map(|(&egroup, _)| egroup);
            match victim {
                Some(egroup) => open.remove(&egroup),
                None => break,
            };
        }
    }

    /// The open egroup; `None` if it does not exist and `create` is false.
    pub(super) async fn load<'s>(
        &self,
        slot: &'s Slot<F::File>,
        egroup: u64,
        create: bool,
    ) -> Result<Option<&'s Egroup<F::File>>, ExtentError> {
        if let Some(open) = slot.egroup.get() {
            return Ok(Some(open));
        }
        if !create && self.find(egroup).is_none() {
            return Ok(None);
        }
        let open = slot
            .egroup
            .get_or_try_init(|| self.open_or_create(egroup))
            .await?;
        Ok(Some(open))
    }

    /// The egroup, opened or created, with the journal's entries for it applied.
    async fn open_or_create(&self, egroup: u64) -> Result<Egroup<F::File>, ExtentError> {
        let open = self.open_or_create_file(egroup).await?;
        if let Some(journal) = &self.journal {
            journal.overlay.borrow().apply_to(&open);
        }
        Ok(open)
    }

    async fn open_or_create_file(&self, egroup: u64) -> Result<Egroup<F::File>, ExtentError> {
        let vdisk = self.config.vdisk;
        if let Some(disk) = self.find(egroup) {
            return Egroup::open(&self.fs, &self.path(disk, egroup), vdisk, egroup).await;
        }
        // An earlier owner of this range (another store) may have created it since the listing.
        for disk in 0..self.config.disks.len() {
            let path = self.path(disk, egroup);
            if self
                .fs
                .exists(&path)
                .await
                .map_err(|e| io_error(&path, None, e))?
            {
                let open = Egroup::open(&self.fs, &path, vdisk, egroup).await?;
                open.found_unlisted();
                self.remember(disk, egroup);
                return Ok(open);
            }
        }
        let disk = self.choose_disk().await;
        let dir = egroup_dir(&self.config.disks[disk].path, vdisk);
        let dir_exists = self
            .known
            .borrow()
            .as_ref()
            .is_some_and(|k| k.dir_exists[disk]);
        if !dir_exists {
            self.fs
                .create_dir_all(&dir)
                .await
                .map_err(|e| io_error(&dir, None, e))?;
        }
        let created = Egroup::create(&self.fs, &self.path(disk, egroup), vdisk, egroup).await?;
        self.remember(disk, egroup);
        Ok(created)
    }

    /// The disk with the most free space (the first on ties or errors).
    async fn choose_disk(&self) -> usize {
        let mut best = (0, 0u64);
        if self.config.disks.len() > 1 {
            for (index, disk) in self.config.disks.iter().enumerate() {
                let free = self.fs.free_bytes(&disk.path).await.unwrap_or(0);
                if free > best.1 {
                    best = (index, free);
                }
            }
        }
        best.0
    }

    /// Retries what failed writes left undone: rewrites and re-syncs every egroup whose write
    /// or sync failed (see `apply`). A no-op when nothing failed.
    pub async fn sync(&self) -> Result<(), ExtentError> {
        let pending: Vec<Rc<Slot<F::File>>> = self
            .open
            .borrow()
            .values()
            .filter(|slot| !slot.evictable())
            .cloned()
            .collect();
        try_join_all(pending.iter().map(|slot| async move {
            let _guard = slot.lock.lock(EVERY_EXTENT).await;
            match slot.egroup.get() {
                Some(open) => open.recover(&self.fs).await,
                None => Ok(()),
            }
        }))
        .await
        .map(|_| ())
    }

    /// Forgets open egroups and the location set (re-listed on next use), e.g. when a shard
    /// hands its ranges over. Egroups in use, or waiting for a `sync` after a failure, stay.
    ///
    /// # Panics
    /// If the journal holds entries no table has yet: [`Self::checkpoint`] first, or the next
    /// owner of the ranges would read tables without them.
    pub fn close_all(&self) {
        if let Some(journal) = &self.journal {
            assert_eq!(
                journal.overlay.borrow().blocks(),
                0,
                "close_all with block log entries not checkpointed"
            );
        }
        self.open
            .borrow_mut()
            .retain(|_, slot| Rc::strong_count(slot) > 1 || !slot.evictable());
        *self.known.borrow_mut() = None;
    }
}

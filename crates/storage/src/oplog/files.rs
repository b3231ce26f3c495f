//! Directory-level operations and segment freeing.
//!
//! `FileOpener`/`FileIo` cover positional I/O on open files only; creating, listing, syncing
//! and removing directory entries, file lengths and truncation go through `std::fs` here.
//! Blocking calls that may wait for the disk (fsync, truncate) run on tokio's blocking pool,
//! like `StdFile::sync_data`, so the reactor keeps serving.

use super::commit::Failure;
use super::error::io_error;
use super::{Inner, OplogError};
use crate::disk::FileOpener;
use std::io;
use std::path::{Path, PathBuf};
use std::rc::Rc;

/// Runs a blocking filesystem call off the reactor when inside a tokio runtime.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> io::Result<T> + Send + 'static,
) -> io::Result<T> {
    match tokio::runtime::Handle::try_current() {
        Ok(_) => tokio::task::spawn_blocking(f)
            .await
            .map_err(|e| io::Error::other(format!("blocking filesystem task failed: {e}")))?,
        Err(_) => f(),
    }
}

/// fsync of a directory: makes creations and removals of its entries durable.
pub(super) async fn sync_dir(dir: &Path) -> Result<(), OplogError> {
    let path = dir.to_path_buf();
    blocking(move || std::fs::File::open(&path)?.sync_all())
        .await
        .map_err(|e| io_error(dir, e))
}

/// Creates the log directory (and missing ancestors) if needed, making each new entry
/// durable in its parent: a directory lost in a crash would take its segments with it.
pub(super) async fn create_dir(dir: &Path) -> Result<(), OplogError> {
    let missing: Vec<&Path> = dir
        .ancestors()
        .take_while(|p| !p.as_os_str().is_empty() && !p.is_dir())
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    std::fs::create_dir_all(dir).map_err(|e| io_error(dir, e))?;
    // Outermost first, so each parent is synced after its new child exists.
    for created in missing.iter().rev() {
        if let Some(parent) = created.parent().filter(|p| !p.as_os_str().is_empty()) {
            sync_dir(parent).await?;
        }
    }
    Ok(())
}

/// Cuts a segment at `len` (a torn tail) and makes the new length durable before anything
/// is appended after the log, so the garbage cannot reappear in the middle of the log.
pub(super) async fn truncate(path: &Path, len: u64) -> Result<(), OplogError> {
    let owned = path.to_path_buf();
    blocking(move || {
        let file = std::fs::OpenOptions::new().write(true).open(&owned)?;
        file.set_len(len)?;
        file.sync_all()
    })
    .await
    .map_err(|e| io_error(path, e))
}

pub(super) fn file_len(path: &Path) -> Result<u64, OplogError> {
    std::fs::metadata(path)
        .map(|m| m.len())
        .map_err(|e| io_error(path, e))
}

/// The segment files of a log directory as (first seq, path), oldest first, and its spare
/// files as (serial, path). Other entries are left alone.
pub(super) struct Listing {
    pub segments: Vec<(u64, PathBuf)>,
    pub spares: Vec<(u64, PathBuf)>,
}

pub(super) fn list_segments(dir: &Path) -> Result<Listing, OplogError> {
    let mut listing = Listing {
        segments: Vec::new(),
        spares: Vec::new(),
    };
    for entry in std::fs::read_dir(dir).map_err(|e| io_error(dir, e))? {
        let entry = entry.map_err(|e| io_error(dir, e))?;
        let name = entry.file_name();
        let name = name.to_str();
        if let Some(seq) = name.and_then(super::format::parse_segment_name) {
            listing.segments.push((seq, entry.path()));
        } else if let Some(serial) = name.and_then(super::format::parse_spare_name) {
            listing.spares.push((serial, entry.path()));
        } else {
            tracing::warn!(path = %entry.path().display(), "ignoring a non-segment file in the oplog directory")
        }
    }
    listing.segments.sort_unstable_by_key(|(seq, _)| *seq);
    listing.spares.sort_unstable_by_key(|(serial, _)| *serial);
    Ok(listing)
}

/// Segments kept for reuse instead of being deleted. Writing into a file whose blocks are
/// already allocated makes a commit's `fdatasync` a data flush only; appending to a new file
/// also commits the filesystem journal (new blocks, new size) at every sync.
pub(super) const MAX_SPARE_SEGMENTS: usize = 2;

/// Renames `from` to `to` and makes the rename durable.
async fn rename_durably(dir: &Path, from: &Path, to: &Path) -> Result<(), OplogError> {
    std::fs::rename(from, to).map_err(|e| io_error(from, e))?;
    sync_dir(dir).await
}

/// Removes a segment file and makes the removal durable before the next (newer) one goes:
/// were a newer removal to survive a crash and an older one not, replay could resurrect a
/// record whose successor is gone (rule 2).
async fn remove_segment_file(dir: &Path, path: &Path) -> Result<(), OplogError> {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        // Never created: its first commit failed before the file existed.
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io_error(path, e)),
    }
    sync_dir(dir).await
}

/// Undoes `State::freeing` however `free_segments` ends.
struct FreeingGuard<'a, O: FileOpener>(&'a Inner<O>);

impl<O: FileOpener> Drop for FreeingGuard<'_, O> {
    fn drop(&mut self) {
        if let Ok(mut state) = self.0.state.try_borrow_mut() {
            state.freeing = false;
        }
    }
}

/// A segment chosen for deletion, already out of the segment table.
struct Victim {
    id: u64,
    path: PathBuf,
    bytes: u64,
    /// The file was created (a segment whose first commit failed has none).
    existed: bool,
    /// Someone may still read the file (the current drain batch, or a read holding its
    /// handle): it must not be reused, only unlinked, which keeps it readable for them.
    pinned: bool,
}

impl<O: FileOpener> Inner<O> {
    /// Deletes segments from the oldest while the oldest holds no live entry and no batch
    /// bound for it (rule 2). Returns how many went; 0 also when another task is freeing
    /// (it re-checks after each deletion, so it sees what changed meanwhile). A failed
    /// deletion fails the log: no newer segment may go before it.
    pub(super) async fn free_segments(&self) -> Result<usize, OplogError> {
        if !self.begin_freeing() {
            return Ok(0);
        }
        let _guard = FreeingGuard(self);
        let mut freed = 0;
        while let Some(victim) = self.take_free_segment() {
            if let Err(error) = self.retire_segment_file(&victim).await {
                tracing::error!(path = %victim.path.display(), %error, "cannot free an oplog segment; the log takes no more writes");
                self.fail_log(Failure::from_error(&error, &self.config.dir));
                return Err(error);
            }
            tracing::debug!(path = %victim.path.display(), "freed oplog segment {}", victim.id);
            self.state.borrow_mut().usage -= victim.bytes;
            freed += 1;
        }
        if freed > 0 {
            self.space.notify_waiters();
        }
        Ok(freed)
    }

    /// Keeps a freed segment's file as a spare while there is room (its records are stale:
    /// replay never reads spares, and a reused spare's old records have lower sequence
    /// numbers than anything written into it again), else deletes it. Either way the change is
    /// durable before the next, newer segment goes (rule 2).
    async fn retire_segment_file(&self, victim: &Victim) -> Result<(), OplogError> {
        let spare = {
            let mut state = self.state.borrow_mut();
            let reusable =
                victim.existed && !victim.pinned && state.spares.len() < MAX_SPARE_SEGMENTS;
            reusable.then(|| {
                state.spare_serial += 1;
                super::format::spare_path(&self.config.dir, state.spare_serial)
            })
        };
        match spare {
            Some(spare) => {
                rename_durably(&self.config.dir, &victim.path, &spare).await?;
                self.state.borrow_mut().spares.push(spare);
                Ok(())
            }
            None => remove_segment_file(&self.config.dir, &victim.path).await,
        }
    }

    /// Gives a new segment the file of a spare, renamed to the segment's name. `None` when
    /// there is no spare (the caller creates the file).
    pub(super) async fn reuse_spare(&self, path: &Path) -> Result<Option<O::File>, OplogError> {
        let Some(spare) = self.state.borrow_mut().spares.pop() else {
            return Ok(None);
        };
        rename_durably(&self.config.dir, &spare, path).await?;
        let file = self
            .opener
            .open(path, false)
            .map_err(|e| io_error(path, e))?;
        Ok(Some(file))
    }

    fn begin_freeing(&self) -> bool {
        let mut state = self.state.borrow_mut();
        if state.freeing {
            return false;
        }
        state.freeing = true;
        true
    }

    /// Takes the oldest segment out of the table if it may go. Taking it out before the
    /// deletion awaits keeps new records from being appended to it meanwhile.
    fn take_free_segment(&self) -> Option<Victim> {
        let mut state = self.state.borrow_mut();
        let state = &mut *state;
        let (&id, segment) = state.segments.iter().next()?;
        if state.index.segment_is_live(id) || segment.batches > 0 {
            return None;
        }
        let segment = state.segments.remove(&id)?;
        if state.active == Some(id) {
            state.active = None;
        }
        let existed = segment.file.is_some();
        let drain_reads_it = state.drain_pinned.contains(&id);
        // A read that holds the handle across an await (a future asynchronous FileIo) must
        // keep seeing this file's bytes, not a reuse's.
        let held = segment
            .file
            .as_ref()
            .is_some_and(|f| Rc::strong_count(f) > 1);
        let pinned = drain_reads_it || held;
        if let Some(file) = segment.file {
            // The current drain batch may still read it; an unlinked file stays readable.
            if drain_reads_it {
                state.retired.insert(id, (file, segment.path.clone()));
            }
        }
        Some(Victim {
            id,
            path: segment.path,
            bytes: segment.bytes,
            existed,
            pinned,
        })
    }

    /// Deletes every segment, then the directory. Only for an empty, idle log.
    pub(super) async fn destroy(&self) -> Result<(), OplogError> {
        {
            let state = self.state.borrow();
            if !state.index.is_empty() || !state.pending.is_empty() || state.committing {
                return Err(OplogError::NotEmpty {
                    path: self.config.dir.clone(),
                    live_bytes: state.index.live_bytes(),
                });
            }
        }
        self.free_segments().await?;
        let left = self.state.borrow().segments.len();
        if left > 0 {
            // Another task is freeing concurrently; the caller broke the "idle" contract.
            return Err(OplogError::NotEmpty {
                path: self.config.dir.clone(),
                live_bytes: 0,
            });
        }
        self.state.borrow_mut().retired.clear();
        let spares = std::mem::take(&mut self.state.borrow_mut().spares);
        for spare in spares {
            std::fs::remove_file(&spare).map_err(|e| io_error(&spare, e))?;
        }
        std::fs::remove_dir(&self.config.dir).map_err(|e| io_error(&self.config.dir, e))?;
        match self.config.dir.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => sync_dir(parent).await,
            _ => Ok(()),
        }
    }
}

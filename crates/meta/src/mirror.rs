//! The embedded store's second copy: `meta.mirror.redb` beside `meta.redb`, holding the same
//! records byte for byte (CRCs included), updated right after every commit of the store.
//!
//! Why: the store names every vdisk. A damaged or lost `meta.redb` would otherwise stop the
//! node (damage) or leave every vdisk's data unaccounted for (loss), though the data itself
//! is intact. With the mirror, a `meta.redb` that is missing, or that fails to open as
//! damaged (redb's open, then `recover`, which reads every record and commits once), is
//! written anew from the mirror if the mirror passes the same checks; the damaged file is kept
//! aside as `meta.redb.damaged-<unix seconds>`. Only when both copies are damaged does the
//! open fail.
//!
//! Order: the store commits first, the mirror second, so after a crash between the two the
//! mirror is at most one transaction behind; at every open it is rewritten from the store.
//! A mirror update that fails (a full disk, say) marks it stale: the next commit rewrites it
//! whole instead of applying one transaction to a copy that missed one.

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use redb::{Database, ReadableDatabase, ReadableTable};

use crate::embedded::close_quietly;
use crate::engine::{
    storage_error, SpaceReserve, FORMAT_VERSION, KV, META, META_FORMAT, META_REVISION,
    UNCHECKED_FORMAT_VERSION,
};
use crate::error::MetaError;
use crate::record;
use crate::types::{EventKind, WatchEvent};

/// `DIR/meta.redb` -> `DIR/meta.mirror.redb`.
pub(crate) fn mirror_path(path: &Path) -> PathBuf {
    let stem = path
        .file_stem()
        .map_or_else(|| "meta".into(), |s| s.to_string_lossy().into_owned());
    path.with_file_name(format!("{stem}.mirror.redb"))
}

/// Every table entry of a store, raw (records keep their CRCs).
struct Snapshot {
    meta: Vec<(String, i64)>,
    records: Vec<(Vec<u8>, Vec<u8>)>,
    revision: i64,
}

fn corrupt(path: &Path, detail: impl Into<String>) -> MetaError {
    MetaError::Corrupt {
        path: path.to_path_buf(),
        detail: detail.into(),
    }
}

/// Reads `db` whole. With `verify`, also checks what `recover` checks at open: a known
/// format, a revision, and every record against its CRC and the revision.
fn snapshot(db: &Database, path: &Path, verify: bool) -> Result<Snapshot, MetaError> {
    let err = |e: redb::Error| storage_error(path, e);
    let rtx = db.begin_read().map_err(|e| err(e.into()))?;
    let meta_table = rtx.open_table(META).map_err(|e| err(e.into()))?;
    let mut meta = Vec::new();
    for entry in meta_table.iter().map_err(|e| err(e.into()))? {
        let (k, v) = entry.map_err(|e| err(e.into()))?;
        meta.push((k.value().to_string(), v.value()));
    }
    let get = |name: &str| meta.iter().find(|(k, _)| k == name).map(|(_, v)| *v);
    let format = get(META_FORMAT);
    let revision = get(META_REVISION).unwrap_or(0);
    if verify {
        if format != Some(FORMAT_VERSION) && format != Some(UNCHECKED_FORMAT_VERSION) {
            return Err(corrupt(path, format!("format version {format:?}")));
        }
        if revision < 1 {
            return Err(corrupt(path, format!("invalid store revision {revision}")));
        }
    }
    let kv = rtx.open_table(KV).map_err(|e| err(e.into()))?;
    let mut records = Vec::new();
    for entry in kv.iter().map_err(|e| err(e.into()))? {
        let (k, v) = entry.map_err(|e| err(e.into()))?;
        let (key, bytes) = (k.value().to_vec(), v.value().to_vec());
        if verify {
            let decoded = if format == Some(FORMAT_VERSION) {
                record::decode(&key, &bytes)
            } else {
                record::decode_unchecked(&key, &bytes)
            };
            let kv = decoded.map_err(|d| corrupt(path, d))?;
            if kv.mod_revision.0 > revision {
                return Err(corrupt(
                    path,
                    format!(
                        "key {:?} has mod revision {} above the store revision {revision}",
                        String::from_utf8_lossy(&key),
                        kv.mod_revision.0
                    ),
                ));
            }
        }
        records.push((key, bytes));
    }
    Ok(Snapshot {
        meta,
        records,
        revision,
    })
}

/// Opens an existing store file and checks all of it. Whatever is wrong with the file
/// itself is `Corrupt`; `Storage` is left for the disk's own errors (permissions, I/O).
fn read_checked(path: &Path) -> Result<Snapshot, MetaError> {
    let checked = crate::embedded::without_panics(path, || {
        Database::open(path).map_err(|e| storage_error(path, e))
    })
    .and_then(|db| {
        let read = crate::embedded::without_panics(path, || snapshot(&db, path, true));
        close_quietly(db);
        read
    });
    checked.map_err(|error| damage_or_error(path, error))
}

fn damage_or_error(path: &Path, error: MetaError) -> MetaError {
    let MetaError::Storage { source, .. } = &error else {
        return error;
    };
    let from_the_disk = match source.downcast_ref::<redb::Error>() {
        Some(redb::Error::Io(e)) => !matches!(
            e.kind(),
            std::io::ErrorKind::InvalidData | std::io::ErrorKind::UnexpectedEof
        ),
        Some(redb::Error::LockProtocolMismatch) | None => true,
        Some(_) => false,
    };
    if from_the_disk {
        error
    } else {
        corrupt(path, source.to_string())
    }
}

/// Writes `snapshot` as a new store file at `target`: into `target.tmp`, committed (redb
/// syncs it), renamed over `target`, directory synced. A failed attempt removes its
/// temporary file (on a full disk it would otherwise keep the space it got).
fn write_fresh(target: &Path, snapshot: &Snapshot) -> Result<(), MetaError> {
    let tmp = PathBuf::from(format!("{}.tmp", target.display()));
    let written = write_to(target, &tmp, snapshot);
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

fn write_to(target: &Path, tmp: &Path, snapshot: &Snapshot) -> Result<(), MetaError> {
    let err = |e: redb::Error| storage_error(target, e);
    let io_err = |e: std::io::Error| storage_error(target, redb::StorageError::Io(e));
    match std::fs::remove_file(tmp) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io_err(e)),
        _ => {}
    }
    {
        let db = Database::create(tmp).map_err(|e| err(e.into()))?;
        let wtx = db.begin_write().map_err(|e| err(e.into()))?;
        {
            let mut meta = wtx.open_table(META).map_err(|e| err(e.into()))?;
            for (k, v) in &snapshot.meta {
                meta.insert(k.as_str(), *v).map_err(|e| err(e.into()))?;
            }
            let mut kv = wtx.open_table(KV).map_err(|e| err(e.into()))?;
            for (k, v) in &snapshot.records {
                kv.insert(k.as_slice(), v.as_slice())
                    .map_err(|e| err(e.into()))?;
            }
        }
        wtx.commit().map_err(|e| err(e.into()))?;
    }
    std::fs::rename(tmp, target).map_err(io_err)?;
    sync_parent(target).map_err(io_err)
}

fn sync_parent(path: &Path) -> std::io::Result<()> {
    match path.parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(dir) => std::fs::File::open(dir)?.sync_all(),
        None => Ok(()),
    }
}

/// What is wrong with the store file at `path`, if `error` (from opening it) says the file is
/// damaged and its mirror exists to stand in for it; else `error` itself.
pub(crate) fn damage(path: &Path, error: MetaError) -> Result<String, MetaError> {
    match damage_or_error(path, error) {
        MetaError::Corrupt { detail, .. } if mirror_path(path).exists() => Ok(detail),
        other => Err(other),
    }
}

/// Before the store at `path` is created anew because it is missing: if its mirror is there,
/// the store is written from it instead (and the open fails if the mirror is damaged: a new,
/// empty store would leave every vdisk unaccounted for).
pub(crate) fn restore_if_missing(path: &Path) -> Result<(), MetaError> {
    if path.exists() || !mirror_path(path).exists() {
        return Ok(());
    }
    tracing::error!(path = %path.display(),
        "the metadata store is missing; restoring it from its mirror");
    restore(path, "the file is missing")
}

/// The store at `path` failed to open with `damage`: keeps it aside and writes it anew from
/// its mirror, or fails if the mirror cannot stand in for it.
pub(crate) fn restore_damaged(path: &Path, damage: String) -> Result<(), MetaError> {
    let mirror = mirror_path(path);
    // Checked before anything moves: with both copies damaged, nothing is touched.
    read_checked(&mirror).map_err(|error| cannot_replace(path, &damage, error))?;
    let seconds = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let aside = (0..)
        .map(|n| match n {
            0 => PathBuf::from(format!("{}.damaged-{seconds}", path.display())),
            n => PathBuf::from(format!("{}.damaged-{seconds}-{n}", path.display())),
        })
        .find(|candidate| !candidate.exists())
        .expect("an unused name");
    std::fs::rename(path, &aside).map_err(|e| storage_error(path, redb::StorageError::Io(e)))?;
    tracing::error!(path = %path.display(), kept_as = %aside.display(), %damage,
        "the metadata store is damaged; restoring it from its mirror");
    restore(path, &damage)
}

fn restore(path: &Path, damage: &str) -> Result<(), MetaError> {
    let mirror = mirror_path(path);
    let snapshot = read_checked(&mirror).map_err(|error| cannot_replace(path, damage, error))?;
    write_fresh(path, &snapshot)?;
    tracing::warn!(path = %path.display(), mirror = %mirror.display(), revision = snapshot.revision,
        records = snapshot.records.len(), "metadata store restored from its mirror");
    Ok(())
}

fn cannot_replace(path: &Path, damage: &str, mirror_error: MetaError) -> MetaError {
    let why = match mirror_error {
        MetaError::Corrupt { detail, .. } => format!("it is damaged too: {detail}"),
        other => other.to_string(),
    };
    corrupt(
        path,
        format!(
            "{damage}; its mirror {} cannot replace it: {why}",
            mirror_path(path).display()
        ),
    )
}

/// The open mirror of a store, kept in step with its commits.
pub(crate) struct Mirror {
    path: PathBuf,
    /// `None` while stale (see the module doc).
    open: Option<(Database, SpaceReserve)>,
    /// Whether the last failure was logged (once per failing streak).
    failing: bool,
}

impl Mirror {
    /// Rewrites the mirror of the store at `path` (open as `db`) from it, and opens it.
    pub(crate) fn rebuild(db: &Database, path: &Path) -> Mirror {
        let mut mirror = Mirror {
            path: mirror_path(path),
            open: None,
            failing: false,
        };
        mirror.refresh(db, path);
        mirror
    }

    fn refresh(&mut self, db: &Database, store_path: &Path) {
        self.close();
        let result = crate::embedded::without_panics(&self.path, || {
            let snapshot = snapshot(db, store_path, false)?;
            write_fresh(&self.path, &snapshot)?;
            Database::open(&self.path).map_err(|e| storage_error(&self.path, e))
        });
        match result {
            Ok(opened) => {
                self.open = Some((opened, SpaceReserve::open(&self.path)));
                if std::mem::take(&mut self.failing) {
                    tracing::info!(path = %self.path.display(), "the metadata store's mirror is up to date again");
                }
            }
            Err(error) => self.failed(&error),
        }
    }

    fn close(&mut self) {
        if let Some((db, _reserve)) = self.open.take() {
            close_quietly(db);
        }
    }

    fn failed(&mut self, error: &MetaError) {
        self.close();
        if !std::mem::replace(&mut self.failing, true) {
            tracing::warn!(path = %self.path.display(), %error,
                "cannot update the metadata store's mirror; will rewrite it at the next change");
        }
    }

    /// Applies one committed transaction (`events` at `revision`) of the store `db`.
    pub(crate) fn apply(
        &mut self,
        db: &Database,
        store_path: &Path,
        revision: i64,
        events: &[WatchEvent],
    ) {
        let Some((mirror, reserve)) = &self.open else {
            return self.refresh(db, store_path);
        };
        let path = &self.path;
        let result = crate::embedded::without_panics(path, || {
            let err = |e: redb::Error| storage_error(path, e);
            let wtx = mirror.begin_write().map_err(|e| err(e.into()))?;
            {
                let mut kv = wtx.open_table(KV).map_err(|e| err(e.into()))?;
                for event in events {
                    let key = event.kv.key.as_slice();
                    match event.kind {
                        EventKind::Put => kv
                            .insert(key, record::encode(&event.kv).as_slice())
                            .map(drop),
                        EventKind::Delete => kv.remove(key).map(drop),
                    }
                    .map_err(|e| err(e.into()))?;
                }
                let mut meta = wtx.open_table(META).map_err(|e| err(e.into()))?;
                meta.insert(META_REVISION, revision)
                    .map_err(|e| err(e.into()))?;
            }
            wtx.commit().map_err(|e| err(e.into()))
        });
        match result {
            Ok(()) => reserve.renew(path),
            Err(error) => self.failed(&error),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mirror_sits_beside_the_store() {
        assert_eq!(
            mirror_path(Path::new("/d/meta.redb")),
            PathBuf::from("/d/meta.mirror.redb")
        );
        assert_eq!(
            mirror_path(Path::new("x.redb")),
            PathBuf::from("x.mirror.redb")
        );
    }
}

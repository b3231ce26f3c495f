//! `EmbeddedMetaStore`: the single-node MetaStore, one redb file.
//!
//! Durability: every mutation is one redb write transaction committed with
//! `Durability::Immediate`, so once a call returns `Ok` the change survives
//! kill -9 and power loss. Reads and lease calls never write.
//!
//! Leases live in memory (deadline per lease); each key's lease id is
//! persisted. Expiry is enforced twice: lazily at the start of every call
//! (so a key is never visible past its lease's deadline), and by a tokio
//! task spawned at `open` when a runtime is current, so that expired keys
//! also vanish (and watchers hear of it) while nobody calls the store.
//! On open, all leases of the previous process count as expired and their
//! keys are deleted: a single-node restart loses every lease.

use std::fmt;
use std::path::Path;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use redb::{Database, ReadableTable, ReadableTableMetadata};
use tokio::runtime::Handle;
use tokio::sync::Notify;

use crate::engine::{
    check_key, check_range, storage_error, Inner, SpaceReserve, State, FORMAT_VERSION, KV, META,
    META_FORMAT, META_LEASE_EPOCH, META_REVISION, UNCHECKED_FORMAT_VERSION,
};
use crate::error::MetaError;
use crate::lease::LeaseTable;
use crate::mirror::{self, Mirror};
use crate::record;
use crate::release::{open_after_release, UserHandles};
use crate::store::MetaStore;
use crate::types::{KeyRange, KeyValue, LeaseId, Revision, Txn, TxnOp, TxnOpResult, TxnResponse};
use crate::watch::{Watch, WatchHub};

/// Tunables of the embedded store. The defaults suit the control plane.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EmbeddedOptions {
    /// Events kept in memory for `watch` with a start revision; older start
    /// revisions fail with `MetaError::Compacted`.
    pub watch_history_events: usize,
    /// Events a watcher may have unread before it is dropped with
    /// `MetaError::WatchLagged` (writers never wait for watchers).
    pub watch_channel_capacity: usize,
    /// Longest compare list / branch of a transaction; 128 is etcd's default
    /// `--max-txn-ops`, so a txn that works here also works on etcd.
    pub max_txn_ops: usize,
}

impl Default for EmbeddedOptions {
    fn default() -> Self {
        EmbeddedOptions {
            watch_history_events: 10_000,
            watch_channel_capacity: 1024,
            max_txn_ops: 128,
        }
    }
}

/// The embedded MetaStore. Cheap to clone (clones share one open file); the
/// file is closed when the last clone is dropped, which also ends every
/// watch with `MetaError::Closed`. Background work may hold the file for a
/// moment after that; a reopen in this process waits for it to close.
///
/// Calls run on tokio's blocking pool when a runtime is current (a commit
/// waits for fsync, which must not stall an async worker), inline otherwise.
#[derive(Clone)]
pub struct EmbeddedMetaStore {
    inner: Arc<Inner>,
    /// Lets a reopen tell "released by this process, closing" from "still held".
    _handles: Arc<UserHandles>,
}

impl fmt::Debug for EmbeddedMetaStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EmbeddedMetaStore")
            .field("path", &self.inner.path)
            .finish_non_exhaustive()
    }
}

impl EmbeddedMetaStore {
    /// Open (or create) the store at `path` with default options.
    pub fn open(path: &Path) -> Result<Self, MetaError> {
        Self::open_with(path, EmbeddedOptions::default())
    }

    /// Open (or create) the store at `path`. Fails with
    /// `MetaError::AlreadyOpen` if another process (or another handle in this
    /// one) has the file open.
    pub fn open_with(path: &Path, options: EmbeddedOptions) -> Result<Self, MetaError> {
        if options.watch_channel_capacity == 0 || options.max_txn_ops == 0 {
            return Err(MetaError::invalid(
                "watch_channel_capacity and max_txn_ops must be at least 1",
            ));
        }
        mirror::restore_if_missing(path)?;
        // Opening is also the check of the whole file (redb's open, then `recover` reads every
        // record and writes once): whatever damage it meets, the mirror may stand in for.
        let already_open = |e: &MetaError| matches!(e, MetaError::AlreadyOpen { .. });
        let (db, reserve, (revision, epoch, dropped)) =
            match open_after_release(path, already_open, || open_file(path)) {
                Err(error) => match mirror::damage(path, error) {
                    Ok(damage) => {
                        mirror::restore_damaged(path, damage)?;
                        open_file(path)?
                    }
                    Err(error) => return Err(error),
                },
                opened => opened?,
            };
        let mirror = Mirror::rebuild(&db, path);
        if dropped > 0 {
            tracing::info!(
                path = %path.display(),
                keys = dropped,
                "deleted keys attached to leases of the previous process"
            );
        }
        let leases = LeaseTable::new(epoch);
        let inner = Arc::new(Inner {
            path: path.to_path_buf(),
            db,
            max_txn_ops: options.max_txn_ops,
            lease_deadlines: leases.deadlines(),
            state: Mutex::new(State {
                revision,
                leases,
                mirror,
                hub: WatchHub::new(
                    revision,
                    options.watch_history_events,
                    options.watch_channel_capacity,
                ),
            }),
            expiry_wake: Arc::new(Notify::new()),
            reserve,
        });
        spawn_expiry_task(&inner);
        Ok(EmbeddedMetaStore {
            inner,
            _handles: UserHandles::register(path),
        })
    }

    /// The file backing this store.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// Run `f` against the store off the async worker threads.
    async fn run<T, F>(&self, f: F) -> Result<T, MetaError>
    where
        T: Send + 'static,
        F: FnOnce(&Inner) -> Result<T, MetaError> + Send + 'static,
    {
        let inner = Arc::clone(&self.inner);
        // A panic inside redb (damage it trusted) is this call's Corrupt error; the state
        // mutex it held is poisoned, so later calls fail with `Poisoned`.
        let call = move || without_panics(&inner.path, || f(&inner));
        match Handle::try_current() {
            Ok(handle) => match handle.spawn_blocking(call).await {
                Ok(result) => result,
                Err(e) if e.is_cancelled() => Err(MetaError::Closed),
                Err(_) => Err(MetaError::Poisoned),
            },
            Err(_) => call(),
        }
    }
}

/// An open store file, its space reserve, and what `recover` found: (revision, lease epoch,
/// keys dropped).
type OpenedFile = (Database, SpaceReserve, (Revision, i64, usize));

/// Opens (or creates) the store file and prepares it (`recover`).
fn open_file(path: &Path) -> Result<OpenedFile, MetaError> {
    let db = without_panics(path, || {
        Database::create(path).map_err(|e| storage_error(path, e))
    })?;
    sync_directory_entries(path).map_err(|e| storage_error(path, redb::StorageError::Io(e)))?;
    // Before the first commit: the disk may already be full.
    let reserve = SpaceReserve::open(path);
    match without_panics(path, || recover(&db, path)) {
        Ok(recovered) => {
            reserve.renew(path);
            Ok((db, reserve, recovered))
        }
        Err(error) => {
            close_quietly(db);
            Err(error)
        }
    }
}

/// Closes a store file after a failure. redb writes on close, and after a panic inside it
/// (damage it trusted) closing panics too: that must not take the process down.
pub(crate) fn close_quietly(db: Database) {
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(db)));
}

/// Runs `call` (opening the file, checking it, or one operation on it), turning a panic into
/// `MetaError::Corrupt`: redb trusts what it reads from its own pages, and some damage (a
/// flipped byte in a page of the store-wide table) makes it panic rather than return an error.
pub(crate) fn without_panics<T>(
    path: &Path,
    call: impl FnOnce() -> Result<T, MetaError>,
) -> Result<T, MetaError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(call)).unwrap_or_else(|panic| {
        let what = panic
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| panic.downcast_ref::<&str>().copied())
            .unwrap_or("no message");
        Err(MetaError::Corrupt {
            path: path.to_path_buf(),
            detail: format!("the file's structure is damaged (reading it failed: {what})"),
        })
    })
}

/// Rewrites every format-1 record (no CRC) in format 2.
fn upgrade_records(
    kv: &mut redb::Table<&[u8], &[u8]>,
    err: impl Fn(redb::Error) -> MetaError,
    corrupt: impl Fn(String) -> MetaError,
) -> Result<usize, MetaError> {
    let mut records = Vec::new();
    for entry in kv.iter().map_err(|e| err(e.into()))? {
        let (k, v) = entry.map_err(|e| err(e.into()))?;
        records.push(record::decode_unchecked(k.value(), v.value()).map_err(&corrupt)?);
    }
    for record in &records {
        kv.insert(record.key.as_slice(), record::encode(record).as_slice())
            .map_err(|e| err(e.into()))?;
    }
    Ok(records.len())
}

/// Prepare the file on open: create the tables on first use, check the
/// format, bump the lease epoch, and delete keys of the previous process's
/// leases. One durable transaction. Returns (revision, lease epoch, keys dropped).
fn recover(db: &Database, path: &Path) -> Result<(Revision, i64, usize), MetaError> {
    let err = |e: redb::Error| storage_error(path, e);
    let corrupt = |detail: String| MetaError::Corrupt {
        path: path.to_path_buf(),
        detail,
    };
    let wtx = db.begin_write().map_err(|e| err(e.into()))?;
    let result = {
        let mut meta = wtx.open_table(META).map_err(|e| err(e.into()))?;
        let mut kv = wtx.open_table(KV).map_err(|e| err(e.into()))?;
        let get = |meta: &redb::Table<&str, i64>, name: &str| {
            meta.get(name)
                .map(|g| g.map(|v| v.value()))
                .map_err(|e| err(e.into()))
        };
        match get(&meta, META_FORMAT)? {
            Some(FORMAT_VERSION) => {}
            Some(UNCHECKED_FORMAT_VERSION) => {
                let records = upgrade_records(&mut kv, err, corrupt)?;
                meta.insert(META_FORMAT, FORMAT_VERSION)
                    .map_err(|e| err(e.into()))?;
                tracing::info!(path = %path.display(), records,
                    "upgraded the metadata store to format {FORMAT_VERSION}: every record carries a CRC");
            }
            Some(v) => {
                return Err(corrupt(format!(
                    "format version {v}, this build reads version {FORMAT_VERSION}"
                )))
            }
            None => {
                if !kv.is_empty().map_err(|e| err(e.into()))? {
                    return Err(corrupt("keys present but no format version".into()));
                }
                meta.insert(META_FORMAT, FORMAT_VERSION)
                    .map_err(|e| err(e.into()))?;
                // etcd's first revision is 1, so the first write is revision 2.
                meta.insert(META_REVISION, 1).map_err(|e| err(e.into()))?;
            }
        }
        let mut revision = match get(&meta, META_REVISION)? {
            Some(r) if r >= 1 => Revision(r),
            other => return Err(corrupt(format!("invalid store revision {other:?}"))),
        };
        let epoch = get(&meta, META_LEASE_EPOCH)?.unwrap_or(0) + 1;
        meta.insert(META_LEASE_EPOCH, epoch)
            .map_err(|e| err(e.into()))?;

        // Decoding every record also checks the whole table on open.
        let mut leased = Vec::new();
        for entry in kv.iter().map_err(|e| err(e.into()))? {
            let (k, v) = entry.map_err(|e| err(e.into()))?;
            let rec = record::decode(k.value(), v.value()).map_err(corrupt)?;
            if rec.mod_revision > revision {
                return Err(corrupt(format!(
                    "key {:?} has mod revision {} above the store revision {revision}",
                    String::from_utf8_lossy(&rec.key),
                    rec.mod_revision
                )));
            }
            if rec.lease.is_some() {
                leased.push(rec.key);
            }
        }
        if !leased.is_empty() {
            revision = revision.next();
            for k in &leased {
                kv.remove(k.as_slice()).map_err(|e| err(e.into()))?;
            }
            meta.insert(META_REVISION, revision.0)
                .map_err(|e| err(e.into()))?;
        }
        (revision, epoch, leased.len())
    };
    wtx.commit().map_err(|e| err(e.into()))?;
    Ok(result)
}

/// Reap expired leases while the store lives, so watchers see the deletes
/// without waiting for the next call. Holds only a `Weak`, so dropping the
/// store ends the task. Without a current runtime, expiry stays lazy.
fn spawn_expiry_task(inner: &Arc<Inner>) {
    let Ok(handle) = Handle::try_current() else {
        return;
    };
    let weak: Weak<Inner> = Arc::downgrade(inner);
    let wake = Arc::clone(&inner.expiry_wake);
    handle.spawn(async move {
        // Upper bound on a sleep, so a missed wake-up costs at most this long.
        const IDLE: Duration = Duration::from_secs(1);
        loop {
            let sleep_for = {
                let Some(inner) = weak.upgrade() else { return };
                let next = match inner.state.lock() {
                    Ok(st) => match st.leases.next_deadline() {
                        Ok(next) => next,
                        Err(_) => return,
                    },
                    Err(_) => return,
                };
                next.map_or(IDLE, |d| {
                    d.saturating_duration_since(Instant::now()).min(IDLE)
                })
            };
            tokio::select! {
                _ = wake.notified() => {}
                _ = tokio::time::sleep(sleep_for) => {}
            }
            let Some(inner) = weak.upgrade() else { return };
            // `state()` reaps whatever is due; it may fsync, so off the worker.
            let reaped = tokio::task::spawn_blocking(move || inner.state().map(drop)).await;
            match reaped {
                Ok(Ok(())) => {}
                Ok(Err(MetaError::Poisoned)) | Err(_) => return,
                Ok(Err(e)) => tracing::warn!(error = %e, "lease expiry failed; will retry"),
            }
        }
    });
}

impl MetaStore for EmbeddedMetaStore {
    async fn get(&self, key: &[u8]) -> Result<Option<KeyValue>, MetaError> {
        check_key(key)?;
        let key = key.to_vec();
        self.run(move |inner| inner.get(&key)).await
    }

    async fn range(
        &self,
        range: KeyRange,
        limit: Option<usize>,
    ) -> Result<Vec<KeyValue>, MetaError> {
        self.run(move |inner| inner.range(&range, limit)).await
    }

    async fn put(
        &self,
        key: impl Into<Vec<u8>> + Send,
        value: impl Into<Vec<u8>> + Send,
        lease: Option<LeaseId>,
    ) -> Result<Revision, MetaError> {
        let txn = Txn::new().and_then([TxnOp::put(key, value, lease)]);
        self.run(move |inner| inner.txn(&txn).map(|r| r.revision))
            .await
    }

    async fn delete(&self, range: KeyRange) -> Result<u64, MetaError> {
        check_range(&range)?;
        let txn = Txn::new().and_then([TxnOp::delete(range)]);
        let resp = self.run(move |inner| inner.txn(&txn)).await?;
        Ok(resp
            .results
            .iter()
            .map(|r| match r {
                TxnOpResult::Delete { deleted } => *deleted,
                _ => 0,
            })
            .sum())
    }

    async fn txn(&self, txn: Txn) -> Result<TxnResponse, MetaError> {
        self.run(move |inner| inner.txn(&txn)).await
    }

    async fn grant_lease(&self, ttl: Duration) -> Result<LeaseId, MetaError> {
        self.run(move |inner| {
            let id = inner.state()?.leases.grant(ttl, Instant::now())?;
            // The new deadline may be earlier than the one the task sleeps on.
            inner.expiry_wake.notify_one();
            Ok(id)
        })
        .await
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<(), MetaError> {
        // Neither the state lock nor the blocking pool: see `Deadlines`.
        self.inner.lease_deadlines.keep_alive(lease, Instant::now())
    }

    async fn revoke_lease(&self, lease: LeaseId) -> Result<(), MetaError> {
        self.run(move |inner| {
            let mut st = inner.state()?;
            inner.revoke_locked(&mut st, lease)
        })
        .await
    }

    async fn watch(
        &self,
        range: KeyRange,
        start_revision: Option<Revision>,
    ) -> Result<Watch, MetaError> {
        check_range(&range)?;
        self.run(move |inner| {
            let mut st = inner.state()?;
            let current = st.revision;
            st.hub.subscribe(range, start_revision, current)
        })
        .await
    }

    async fn current_revision(&self) -> Result<Revision, MetaError> {
        self.run(|inner| Ok(inner.state()?.revision)).await
    }
}

/// Makes the store file's directory entry, and its directory's own entry, durable: redb syncs
/// the file's contents, but a power cut could otherwise lose the newly created file (or the
/// data directory) itself, and with it every vdisk record.
fn sync_directory_entries(path: &Path) -> std::io::Result<()> {
    let parents = path
        .ancestors()
        .skip(1)
        .take(2)
        .filter(|p| !p.as_os_str().is_empty());
    for dir in parents {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

//! The synchronous core of the embedded store: one redb write transaction per
//! mutation, with the in-memory state (revision, leases, watchers) updated
//! only after the commit succeeded.
//!
//! Every function here runs with the state mutex held. redb would serialize
//! writers on its own; the mutex exists because the revision counter, the
//! lease index and the watch hub must change in the same order as the
//! commits, and because lease expiry is checked before each operation.

use std::collections::HashSet;
use std::ops::Bound;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use tokio::sync::Notify;

use crate::error::MetaError;
use crate::lease::{Deadlines, LeaseTable};
use crate::mirror::Mirror;
use crate::record;
use crate::types::{
    Compare, CompareTarget, EventKind, KeyRange, KeyValue, LeaseId, Revision, Txn, TxnOp,
    TxnOpResult, TxnResponse, WatchEvent,
};
use crate::watch::WatchHub;

/// Key -> encoded record (see `record.rs`).
pub(crate) const KV: TableDefinition<&[u8], &[u8]> = TableDefinition::new("kv");
/// Store-wide counters.
pub(crate) const META: TableDefinition<&str, i64> = TableDefinition::new("meta");
pub(crate) const META_FORMAT: &str = "format_version";
pub(crate) const META_REVISION: &str = "revision";
pub(crate) const META_LEASE_EPOCH: &str = "lease_epoch";
/// Format 2: every record carries a CRC (`record.rs`).
pub(crate) const FORMAT_VERSION: i64 = 2;
/// Format 1: records without a CRC, upgraded on open.
pub(crate) const UNCHECKED_FORMAT_VERSION: i64 = 1;

pub(crate) struct State {
    pub(crate) revision: Revision,
    pub(crate) leases: LeaseTable,
    /// The store's second copy, updated after each commit (`mirror.rs`).
    pub(crate) mirror: Mirror,
    pub(crate) hub: WatchHub,
}

pub(crate) struct Inner {
    pub(crate) path: PathBuf,
    pub(crate) db: Database,
    pub(crate) max_txn_ops: usize,
    pub(crate) state: Mutex<State>,
    /// The lease deadlines of `state.leases`, reachable without the state lock.
    pub(crate) lease_deadlines: Arc<Deadlines>,
    /// Wakes the expiry task: on a grant (maybe an earlier deadline) and on drop.
    pub(crate) expiry_wake: Arc<Notify>,
    pub(crate) reserve: SpaceReserve,
}

/// Disk space kept allocated for the store file beyond its end (`fallocate` with
/// `FALLOC_FL_KEEP_SIZE`), renewed after every commit. redb grows the file and writes its
/// pages into that space, so a commit does not need free space on the filesystem: when data
/// fills the disk, metadata updates (deleting a vdisk to free space among them) still work.
/// Without it, one commit failing with ENOSPC would also make redb fail every later call
/// until the file is reopened.
pub(crate) struct SpaceReserve {
    file: Option<std::fs::File>,
    /// Whether the last attempt failed (logged once per failing streak).
    failing: std::sync::atomic::AtomicBool,
}

/// Bytes kept allocated beyond the end of the store file: many times a control-plane commit.
pub(crate) const RESERVE_BYTES: u64 = 4 << 20;

impl SpaceReserve {
    pub(crate) fn open(path: &Path) -> SpaceReserve {
        let file = std::fs::OpenOptions::new().write(true).open(path);
        if let Err(error) = &file {
            tracing::warn!(path = %path.display(), %error,
                "cannot open the metadata store to reserve space for it");
        }
        let reserve = SpaceReserve {
            file: file.ok(),
            failing: std::sync::atomic::AtomicBool::new(false),
        };
        reserve.renew(path);
        reserve
    }

    /// Allocates the file's holes and `RESERVE_BYTES` past its end (best effort: where the
    /// filesystem cannot, the store works as before).
    pub(crate) fn renew(&self, path: &Path) {
        use std::os::fd::AsRawFd;
        use std::sync::atomic::Ordering;
        let Some(file) = &self.file else { return };
        let result = file.metadata().and_then(|meta| {
            let end = i64::try_from(meta.len() + RESERVE_BYTES).unwrap_or(i64::MAX);
            // SAFETY: fallocate on an open descriptor; no memory is passed.
            let r = unsafe { libc::fallocate(file.as_raw_fd(), libc::FALLOC_FL_KEEP_SIZE, 0, end) };
            if r == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
        match result {
            Ok(()) => {
                if self.failing.swap(false, Ordering::Relaxed) {
                    tracing::info!(path = %path.display(), "space for the metadata store is reserved again");
                }
            }
            Err(error) if error.raw_os_error() == Some(libc::EOPNOTSUPP) => {}
            Err(error) => {
                if !self.failing.swap(true, Ordering::Relaxed) {
                    tracing::warn!(path = %path.display(), %error,
                        "cannot reserve disk space for the metadata store; on a full disk its updates may fail");
                }
            }
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Let the expiry task notice that the store is gone.
        self.expiry_wake.notify_one();
    }
}

/// Map any redb error to ours, keeping the file path for the operator.
pub(crate) fn storage_error(path: &Path, err: impl Into<redb::Error>) -> MetaError {
    let path = path.to_path_buf();
    match err.into() {
        redb::Error::DatabaseAlreadyOpen => MetaError::AlreadyOpen { path },
        redb::Error::Corrupted(detail) => MetaError::Corrupt { path, detail },
        other => MetaError::Storage {
            path,
            source: Arc::new(other),
        },
    }
}

impl Inner {
    pub(crate) fn err(&self, err: impl Into<redb::Error>) -> MetaError {
        storage_error(&self.path, err)
    }

    fn corrupt(&self, detail: String) -> MetaError {
        MetaError::Corrupt {
            path: self.path.clone(),
            detail,
        }
    }

    /// Lock the state, first deleting the keys of every lease past its
    /// deadline: no call ever observes a key whose lease has expired, even if
    /// the background expiry task has not run yet.
    pub(crate) fn state(&self) -> Result<MutexGuard<'_, State>, MetaError> {
        let mut st = self.state.lock().map_err(|_| MetaError::Poisoned)?;
        for id in st.leases.expired(Instant::now())? {
            self.revoke_locked(&mut st, id)?;
        }
        Ok(st)
    }

    /// Delete the lease's keys in one transaction (one revision), then forget it.
    pub(crate) fn revoke_locked(&self, st: &mut State, id: LeaseId) -> Result<(), MetaError> {
        let keys = st.leases.keys(id)?;
        if !keys.is_empty() {
            let txn =
                Txn::new().and_then(keys.into_iter().map(|k| TxnOp::delete(KeyRange::Key(k))));
            // Internal: skips validate() (a lease may hold more keys than max_txn_ops).
            self.execute(st, &txn)?;
        }
        st.leases.remove(id)
    }

    pub(crate) fn get(&self, key: &[u8]) -> Result<Option<KeyValue>, MetaError> {
        let _st = self.state()?;
        let rtx = self.db.begin_read().map_err(|e| self.err(e))?;
        let table = rtx.open_table(KV).map_err(|e| self.err(e))?;
        self.read(&table, key)
    }

    pub(crate) fn range(
        &self,
        range: &KeyRange,
        limit: Option<usize>,
    ) -> Result<Vec<KeyValue>, MetaError> {
        check_limit(limit)?;
        check_range(range)?;
        let _st = self.state()?;
        let rtx = self.db.begin_read().map_err(|e| self.err(e))?;
        let table = rtx.open_table(KV).map_err(|e| self.err(e))?;
        Ok(self.scan(&table, range, limit)?.0)
    }

    pub(crate) fn txn(&self, txn: &Txn) -> Result<TxnResponse, MetaError> {
        self.validate(txn)?;
        let mut st = self.state()?;
        self.execute(&mut st, txn)
    }

    fn read(
        &self,
        table: &impl ReadableTable<&'static [u8], &'static [u8]>,
        key: &[u8],
    ) -> Result<Option<KeyValue>, MetaError> {
        match table.get(key).map_err(|e| self.err(e))? {
            None => Ok(None),
            Some(guard) => record::decode(key, guard.value())
                .map(Some)
                .map_err(|d| self.corrupt(d)),
        }
    }

    /// Keys in `range`, at most `limit`; the flag says whether more matched.
    fn scan(
        &self,
        table: &impl ReadableTable<&'static [u8], &'static [u8]>,
        range: &KeyRange,
        limit: Option<usize>,
    ) -> Result<(Vec<KeyValue>, bool), MetaError> {
        if range.is_empty() {
            return Ok((Vec::new(), false));
        }
        let (start, end) = range.bounds();
        let upper = match &end {
            Some(e) => Bound::Excluded(e.as_slice()),
            None => Bound::Unbounded,
        };
        let iter = table
            .range::<&[u8]>((Bound::Included(start.as_slice()), upper))
            .map_err(|e| self.err(e))?;
        let mut kvs = Vec::new();
        for entry in iter {
            let (k, v) = entry.map_err(|e| self.err(e))?;
            if limit.is_some_and(|l| kvs.len() >= l) {
                return Ok((kvs, true));
            }
            kvs.push(record::decode(k.value(), v.value()).map_err(|d| self.corrupt(d))?);
        }
        Ok((kvs, false))
    }

    /// Evaluate the compares and run one branch in a single redb write
    /// transaction. Nothing in memory changes unless the commit succeeded.
    pub(crate) fn execute(&self, st: &mut State, txn: &Txn) -> Result<TxnResponse, MetaError> {
        let wtx = self.db.begin_write().map_err(|e| self.err(e))?;
        let rev = st.revision.next();
        let mut events = Vec::new();
        let (succeeded, results) = {
            let mut table = wtx.open_table(KV).map_err(|e| self.err(e))?;
            let mut succeeded = true;
            for c in &txn.compares {
                if !compare_holds(c, self.read(&table, &c.key)?.as_ref()) {
                    succeeded = false;
                    break;
                }
            }
            let ops = if succeeded {
                &txn.success
            } else {
                &txn.failure
            };
            let mut results = Vec::with_capacity(ops.len());
            for op in ops {
                let result = match op {
                    TxnOp::Put { key, value, lease } => {
                        if let Some(id) = lease {
                            if !st.leases.contains(*id) {
                                return Err(MetaError::LeaseNotFound(*id));
                            }
                        }
                        let prev = self.read(&table, key)?;
                        let kv = KeyValue {
                            key: key.clone(),
                            value: value.clone(),
                            create_revision: prev.as_ref().map_or(rev, |p| p.create_revision),
                            mod_revision: rev,
                            version: prev.as_ref().map_or(1, |p| p.version + 1),
                            lease: *lease,
                        };
                        table
                            .insert(key.as_slice(), record::encode(&kv).as_slice())
                            .map_err(|e| self.err(e))?;
                        events.push(WatchEvent {
                            kind: EventKind::Put,
                            kv,
                            prev,
                        });
                        TxnOpResult::Put
                    }
                    TxnOp::Delete { range } => {
                        let (doomed, _) = self.scan(&table, range, None)?;
                        let deleted = doomed.len() as u64;
                        for old in doomed {
                            table.remove(old.key.as_slice()).map_err(|e| self.err(e))?;
                            events.push(WatchEvent {
                                kind: EventKind::Delete,
                                kv: KeyValue {
                                    key: old.key.clone(),
                                    value: Vec::new(),
                                    create_revision: Revision(0),
                                    mod_revision: rev,
                                    version: 0,
                                    lease: None,
                                },
                                prev: Some(old),
                            });
                        }
                        TxnOpResult::Delete { deleted }
                    }
                    TxnOp::Get { range } => TxnOpResult::Get {
                        kvs: self.scan(&table, range, None)?.0,
                    },
                };
                results.push(result);
            }
            (succeeded, results)
        };

        if events.is_empty() {
            // Read-only outcome: no revision, no fsync (etcd bumps the
            // revision only for transactions that changed something).
            wtx.abort().map_err(|e| self.err(e))?;
            return Ok(TxnResponse {
                succeeded,
                revision: st.revision,
                results,
            });
        }
        {
            let mut meta = wtx.open_table(META).map_err(|e| self.err(e))?;
            meta.insert(META_REVISION, rev.0).map_err(|e| self.err(e))?;
        }
        // Durability::Immediate (redb's default): commit returns after fsync.
        wtx.commit().map_err(|e| self.err(e))?;
        self.reserve.renew(&self.path);
        st.mirror.apply(&self.db, &self.path, rev.0, &events);

        st.revision = rev;
        st.leases.apply(&events);
        st.hub.publish(&events);
        Ok(TxnResponse {
            succeeded,
            revision: rev,
            results,
        })
    }

    /// Reject what etcd would reject, so code tested against the embedded
    /// store does not fail only in production.
    fn validate(&self, txn: &Txn) -> Result<(), MetaError> {
        let max = self.max_txn_ops;
        for (what, len) in [
            ("compares", txn.compares.len()),
            ("success ops", txn.success.len()),
            ("failure ops", txn.failure.len()),
        ] {
            if len > max {
                return Err(MetaError::invalid(format!(
                    "transaction has {len} {what}, more than the limit of {max}"
                )));
            }
        }
        for c in &txn.compares {
            check_key(&c.key)?;
        }
        validate_branch(&txn.success)?;
        validate_branch(&txn.failure)
    }
}

pub(crate) fn check_key(key: &[u8]) -> Result<(), MetaError> {
    if key.is_empty() {
        return Err(MetaError::invalid("key must not be empty"));
    }
    Ok(())
}

/// etcd reads a limit of 0 as "no limit"; refuse it rather than surprise.
pub(crate) fn check_limit(limit: Option<usize>) -> Result<(), MetaError> {
    if limit == Some(0) {
        return Err(MetaError::invalid(
            "range limit must be at least 1 (use None for no limit)",
        ));
    }
    Ok(())
}

pub(crate) fn check_range(range: &KeyRange) -> Result<(), MetaError> {
    match range {
        KeyRange::Key(k) => check_key(k),
        KeyRange::Prefix(_) | KeyRange::Range { .. } => Ok(()),
    }
}

/// etcd's `checkIntervals`: within one branch, no key is put twice and no put
/// falls inside a delete's range (the result would depend on op order).
fn validate_branch(ops: &[TxnOp]) -> Result<(), MetaError> {
    let mut puts = HashSet::new();
    let mut deletes = Vec::new();
    for op in ops {
        match op {
            TxnOp::Put { key, .. } => {
                check_key(key)?;
                if !puts.insert(key.as_slice()) {
                    return Err(MetaError::invalid(format!(
                        "transaction puts key {:?} twice",
                        String::from_utf8_lossy(key)
                    )));
                }
            }
            TxnOp::Delete { range } => {
                check_range(range)?;
                deletes.push(range);
            }
            TxnOp::Get { range } => check_range(range)?,
        }
    }
    for key in puts {
        if deletes.iter().any(|r| r.contains(key)) {
            return Err(MetaError::invalid(format!(
                "transaction both puts and deletes key {:?}",
                String::from_utf8_lossy(key)
            )));
        }
    }
    Ok(())
}

/// etcd's compare semantics: an absent key has version/create/mod revision 0
/// and no lease, and any value compare on it is false.
fn compare_holds(c: &Compare, kv: Option<&KeyValue>) -> bool {
    match (&c.target, kv) {
        (CompareTarget::Value(_), None) => false,
        (CompareTarget::Value(v), Some(kv)) => c.op.holds(kv.value.as_slice(), v.as_slice()),
        (CompareTarget::Version(v), kv) => c.op.holds(&kv.map_or(0, |k| k.version), v),
        (CompareTarget::CreateRevision(r), kv) => {
            c.op.holds(&kv.map_or(Revision(0), |k| k.create_revision), r)
        }
        (CompareTarget::ModRevision(r), kv) => {
            c.op.holds(&kv.map_or(Revision(0), |k| k.mod_revision), r)
        }
        (CompareTarget::Lease(l), kv) => {
            let stored = kv.and_then(|k| k.lease).map_or(0, |id| id.0);
            c.op.holds(&stored, &l.map_or(0, |id| id.0))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::CompareOp;

    #[test]
    fn branch_validation_matches_etcd() {
        let dup = [TxnOp::put("/a", "1", None), TxnOp::put("/a", "2", None)];
        assert!(validate_branch(&dup).is_err());
        let overlap = [
            TxnOp::delete(KeyRange::prefix("/")),
            TxnOp::put("/a", "1", None),
        ];
        assert!(validate_branch(&overlap).is_err());
        let fine = [
            TxnOp::delete(KeyRange::prefix("/x/")),
            TxnOp::put("/a", "1", None),
            TxnOp::get(KeyRange::key("/a")),
        ];
        assert!(validate_branch(&fine).is_ok());
        assert!(validate_branch(&[TxnOp::put("", "1", None)]).is_err());
    }

    #[test]
    fn absent_key_compares() {
        assert!(compare_holds(&Compare::absent("/k"), None));
        assert!(!compare_holds(&Compare::exists("/k"), None));
        assert!(compare_holds(
            &Compare::version("/k", CompareOp::Equal, 0),
            None
        ));
        assert!(!compare_holds(
            &Compare::value("/k", CompareOp::NotEqual, "x"),
            None
        ));
        assert!(compare_holds(
            &Compare::lease("/k", CompareOp::Equal, None),
            None
        ));
    }
}

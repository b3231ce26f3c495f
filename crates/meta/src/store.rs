//! The `MetaStore` trait: etcd v3's KV, lease and watch API, trimmed to what
//! Ashlar's control plane needs.

use std::future::Future;
use std::time::Duration;

use crate::error::MetaError;
use crate::types::{KeyRange, KeyValue, LeaseId, Revision, Txn, TxnResponse};
use crate::watch::Watch;

/// Strongly consistent cluster metadata with etcd's data model.
///
/// Every method maps onto one etcd v3 RPC (see docs/metastore.md). Methods
/// return `Send` futures so callers can hold them across `tokio::spawn`.
/// The trait is not object safe (it uses return-position `impl Future`);
/// make callers generic over `M: MetaStore`.
pub trait MetaStore: Send + Sync + 'static {
    /// The key, if present.
    fn get(&self, key: &[u8]) -> impl Future<Output = Result<Option<KeyValue>, MetaError>> + Send;

    /// Keys in `range`, ascending, at most `limit` of them (`None` = all;
    /// `Some(0)` is rejected, since etcd would read it as "no limit").
    /// To page, ask again from just past the last key returned.
    ///
    /// To list and then watch without missing a change, read with a
    /// [`Txn`] holding a [`crate::TxnOp::Get`] instead: its
    /// [`TxnResponse::revision`] is the revision the read saw, so watching
    /// from `revision.next()` continues exactly where the read ended.
    fn range(
        &self,
        range: KeyRange,
        limit: Option<usize>,
    ) -> impl Future<Output = Result<Vec<KeyValue>, MetaError>> + Send;

    /// Create or overwrite `key`; returns the revision of the write.
    /// A lease that does not exist fails with [`MetaError::LeaseNotFound`].
    fn put(
        &self,
        key: impl Into<Vec<u8>> + Send,
        value: impl Into<Vec<u8>> + Send,
        lease: Option<LeaseId>,
    ) -> impl Future<Output = Result<Revision, MetaError>> + Send;

    /// Delete every key in `range`; returns how many were deleted. Deleting
    /// nothing does not bump the revision (as in etcd).
    fn delete(&self, range: KeyRange) -> impl Future<Output = Result<u64, MetaError>> + Send;

    /// Run an etcd-style compare-and-swap transaction atomically.
    fn txn(&self, txn: Txn) -> impl Future<Output = Result<TxnResponse, MetaError>> + Send;

    /// Create a lease that ends `ttl` after the last keep-alive.
    fn grant_lease(&self, ttl: Duration)
        -> impl Future<Output = Result<LeaseId, MetaError>> + Send;

    /// Restart the lease's TTL. Fails with [`MetaError::LeaseNotFound`] once it expired.
    fn keep_alive(&self, lease: LeaseId) -> impl Future<Output = Result<(), MetaError>> + Send;

    /// End the lease now, deleting its keys in one transaction.
    fn revoke_lease(&self, lease: LeaseId) -> impl Future<Output = Result<(), MetaError>> + Send;

    /// Stream changes to keys in `range`, in revision order, starting at
    /// `start_revision` (inclusive) or, when `None` (or `Revision(0)`), with
    /// the next change after now. Fails with [`MetaError::Compacted`] when
    /// `start_revision` is older than the store still remembers.
    fn watch(
        &self,
        range: KeyRange,
        start_revision: Option<Revision>,
    ) -> impl Future<Output = Result<Watch, MetaError>> + Send;

    /// The store's current revision.
    fn current_revision(&self) -> impl Future<Output = Result<Revision, MetaError>> + Send;
}

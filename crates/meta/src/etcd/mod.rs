//! `EtcdMetaStore`: the MetaStore on an etcd v3 cluster, spoken to over gRPC
//! (plain HTTP/2, no TLS yet) with hand-written protobuf messages.
//!
//! Each trait method is one etcd RPC (docs/metastore.md has the table), sent
//! to the endpoint that answered last and, if it cannot be reached, to the
//! next one. Every request has a deadline. Lease keep-alives travel on a
//! connection of their own, so no amount of other traffic delays them.

mod client;
mod convert;
mod lease;
mod proto;
mod watch;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use client::{Call, Client, RpcKind};
use convert::{header_revision, kv_from_etcd, range_request, range_to_etcd};
use proto::path;

pub use client::RequestCounts;

// The embedded store's argument checks, so both stores reject the same calls.
use crate::engine::{check_key, check_limit, check_range};
use crate::error::MetaError;
use crate::store::MetaStore;
use crate::types::{KeyRange, KeyValue, LeaseId, Revision, Txn, TxnResponse};
use crate::watch::Watch;

/// Default for [`EtcdOptions::connect_timeout`].
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Default for [`EtcdOptions::request_timeout`].
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Default for [`EtcdOptions::http2_keep_alive_interval`]; etcd refuses
/// pings more often than every 5 s.
pub const DEFAULT_HTTP2_KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(10);

/// Where etcd is and how long to wait for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdOptions {
    /// Client URLs of etcd members (`http://host:2379`), tried in order.
    pub endpoints: Vec<String>,
    /// Longest wait for a TCP connection to one endpoint.
    pub connect_timeout: Duration,
    /// Longest wait for one request on one endpoint (and for an HTTP/2 ping
    /// answer). With several endpoints, a read may take this long per endpoint.
    pub request_timeout: Duration,
    /// How often an open connection is pinged to notice a dead peer (which a
    /// watch would otherwise wait on forever).
    pub http2_keep_alive_interval: Duration,
    /// Events a watcher may have unread before it is dropped with
    /// `MetaError::WatchLagged`, as in the embedded store.
    pub watch_channel_capacity: usize,
}

impl EtcdOptions {
    /// Options with default timeouts for a comma-separated endpoint list
    /// (`http://h1:2379,http://h2:2379`; `h1:2379` means `http://h1:2379`).
    pub fn new(endpoints: &str) -> Result<Self, MetaError> {
        let endpoints = endpoints
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(normalize_endpoint)
            .collect::<Result<Vec<_>, _>>()?;
        if endpoints.is_empty() {
            return Err(MetaError::invalid("no etcd endpoint given"));
        }
        Ok(EtcdOptions {
            endpoints,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            http2_keep_alive_interval: DEFAULT_HTTP2_KEEP_ALIVE_INTERVAL,
            watch_channel_capacity: 1024,
        })
    }
}

fn normalize_endpoint(e: &str) -> Result<String, MetaError> {
    if e.starts_with("https://") {
        return Err(MetaError::invalid(format!(
            "etcd endpoint {e}: TLS is not supported yet; use http://"
        )));
    }
    if e.starts_with("http://") {
        Ok(e.to_string())
    } else if e.contains("://") {
        Err(MetaError::invalid(format!(
            "etcd endpoint {e}: only http:// URLs are supported"
        )))
    } else {
        Ok(format!("http://{e}"))
    }
}

/// The MetaStore on etcd. Cheap to clone (clones share connections); when
/// the last clone is dropped, every watch ends with `MetaError::Closed`.
#[derive(Clone)]
pub struct EtcdMetaStore {
    inner: Arc<Inner>,
}

struct Inner {
    /// Shared with watch tasks, which resume lost watches through it.
    client: Arc<Client>,
    watch_channel_capacity: usize,
    /// Never sends; watch tasks see it dropped with the store.
    shutdown: tokio::sync::watch::Sender<()>,
}

impl fmt::Debug for EtcdMetaStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdMetaStore")
            .field("endpoints", &self.inner.client.endpoints())
            .finish_non_exhaustive()
    }
}

impl EtcdMetaStore {
    /// Connect and check that some endpoint answers (one Range request), so
    /// a wrong or dead address fails here with `MetaError::Unavailable`.
    /// Must run inside a tokio runtime.
    pub async fn connect(options: EtcdOptions) -> Result<Self, MetaError> {
        let store = Self::connect_lazy(options)?;
        store.current_revision().await?;
        Ok(store)
    }

    /// Like [`EtcdMetaStore::connect`], without contacting etcd until the
    /// first call. Fails without a current tokio runtime.
    pub fn connect_lazy(options: EtcdOptions) -> Result<Self, MetaError> {
        if options.watch_channel_capacity == 0 {
            return Err(MetaError::invalid(
                "watch_channel_capacity must be at least 1",
            ));
        }
        let client = Arc::new(Client::new(&options)?);
        let (shutdown, _) = tokio::sync::watch::channel(());
        Ok(EtcdMetaStore {
            inner: Arc::new(Inner {
                client,
                watch_channel_capacity: options.watch_channel_capacity,
                shutdown,
            }),
        })
    }

    /// Requests sent to etcd so far, by kind.
    pub fn request_counts(&self) -> RequestCounts {
        self.inner.client.counts()
    }

    /// Discard history before `revision` (etcd's Compact): watches from an
    /// older revision then fail with `MetaError::Compacted`. etcd keeps all
    /// history unless it is compacted, by this call or by its
    /// `--auto-compaction-*` flags.
    pub async fn compact(&self, revision: Revision) -> Result<(), MetaError> {
        let req = proto::CompactionRequest {
            revision: revision.0,
            physical: true,
        };
        let _: proto::CompactionResponse = self
            .inner
            .client
            .unary(Call::read(RpcKind::Compact), path::COMPACT, req)
            .await?;
        Ok(())
    }

    fn client(&self) -> &Client {
        &self.inner.client
    }
}

impl MetaStore for EtcdMetaStore {
    async fn get(&self, key: &[u8]) -> Result<Option<KeyValue>, MetaError> {
        let mut kvs = self.range(KeyRange::key(key), None).await?;
        Ok(kvs.pop())
    }

    async fn range(
        &self,
        range: KeyRange,
        limit: Option<usize>,
    ) -> Result<Vec<KeyValue>, MetaError> {
        check_limit(limit)?;
        check_range(&range)?;
        let Some((key, range_end)) = range_to_etcd(&range) else {
            return Ok(Vec::new());
        };
        let resp: proto::RangeResponse = self
            .client()
            .unary(
                Call::read(RpcKind::Range),
                path::RANGE,
                range_request(key, range_end, limit),
            )
            .await?;
        Ok(resp.kvs.into_iter().map(kv_from_etcd).collect())
    }

    async fn put(
        &self,
        key: impl Into<Vec<u8>> + Send,
        value: impl Into<Vec<u8>> + Send,
        lease: Option<LeaseId>,
    ) -> Result<Revision, MetaError> {
        let key = key.into();
        check_key(&key)?;
        let req = proto::PutRequest {
            key,
            value: value.into(),
            lease: convert::lease_to_etcd(lease),
        };
        let resp: proto::PutResponse = self
            .client()
            .unary(Call::write(RpcKind::Put, lease), path::PUT, req)
            .await?;
        Ok(header_revision(resp.header.as_ref()))
    }

    async fn delete(&self, range: KeyRange) -> Result<u64, MetaError> {
        check_range(&range)?;
        let Some((key, range_end)) = range_to_etcd(&range) else {
            return Ok(0);
        };
        let resp: proto::DeleteRangeResponse = self
            .client()
            .unary(
                Call::write(RpcKind::DeleteRange, None),
                path::DELETE_RANGE,
                proto::DeleteRangeRequest { key, range_end },
            )
            .await?;
        Ok(u64::try_from(resp.deleted).unwrap_or(0))
    }

    async fn txn(&self, txn: Txn) -> Result<TxnResponse, MetaError> {
        let call = Call::write(RpcKind::Txn, convert::first_lease(&txn));
        let resp: proto::TxnResponse = self
            .client()
            .unary(call, path::TXN, convert::txn_to_etcd(&txn))
            .await?;
        convert::txn_from_etcd(resp)
    }

    async fn grant_lease(&self, ttl: Duration) -> Result<LeaseId, MetaError> {
        lease::grant(self.client(), ttl).await
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<(), MetaError> {
        lease::keep_alive(self.client(), lease).await
    }

    async fn revoke_lease(&self, lease: LeaseId) -> Result<(), MetaError> {
        lease::revoke(self.client(), lease).await
    }

    async fn watch(
        &self,
        range: KeyRange,
        start_revision: Option<Revision>,
    ) -> Result<Watch, MetaError> {
        check_range(&range)?;
        let spec = watch::WatchSpec {
            range,
            start: start_revision,
            capacity: self.inner.watch_channel_capacity,
            shutdown: self.inner.shutdown.subscribe(),
        };
        watch::open(&self.inner.client, spec).await
    }

    async fn current_revision(&self) -> Result<Revision, MetaError> {
        // Any read carries the revision in its header; a count returns no key.
        let req = proto::RangeRequest {
            count_only: true,
            ..range_request(vec![0], Vec::new(), None)
        };
        let resp: proto::RangeResponse = self
            .client()
            .unary(Call::read(RpcKind::Range), path::RANGE, req)
            .await?;
        Ok(header_revision(resp.header.as_ref()))
    }
}

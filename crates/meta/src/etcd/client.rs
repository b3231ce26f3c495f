//! gRPC plumbing: one HTTP/2 connection per endpoint for ordinary requests
//! plus one more per endpoint for lease keep-alives, failover across
//! endpoints, a deadline on every request, and counters of requests issued.

use std::error::Error as _;
use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use http::uri::PathAndQuery;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};

use super::EtcdOptions;
use crate::error::MetaError;
use crate::types::LeaseId;

/// The kinds of etcd request the store issues, for [`RequestCounts`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RpcKind {
    Range,
    Put,
    DeleteRange,
    Txn,
    Compact,
    Watch,
    LeaseGrant,
    LeaseRevoke,
    LeaseKeepAlive,
}

const KINDS: usize = 9;

/// How many requests of each kind the store has sent to etcd (every attempt,
/// including those retried on another endpoint), so tests and metrics can
/// check that the data path issues none per client I/O.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RequestCounts {
    pub range: u64,
    pub put: u64,
    pub delete_range: u64,
    pub txn: u64,
    pub compact: u64,
    pub watch: u64,
    pub lease_grant: u64,
    pub lease_revoke: u64,
    pub lease_keep_alive: u64,
}

impl RequestCounts {
    pub fn total(&self) -> u64 {
        self.range
            + self.put
            + self.delete_range
            + self.txn
            + self.compact
            + self.watch
            + self.lease_grant
            + self.lease_revoke
            + self.lease_keep_alive
    }
}

/// Whether a request may be sent again to another endpoint after it may
/// already have reached one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Retry {
    /// Reads and keep-alives: repeating them changes nothing.
    Always,
    /// Writes: only when it certainly never left this host (the connection
    /// could not be made), so one call never applies a write twice.
    IfNotSent,
}

/// What a call is, for failover, counting and error messages.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Call {
    pub kind: RpcKind,
    pub retry: Retry,
    /// The lease a "lease not found" answer refers to.
    pub lease: Option<LeaseId>,
    /// Send on the lease keep-alive connection instead of the shared one.
    pub keep_alive_channel: bool,
}

impl Call {
    pub(crate) fn read(kind: RpcKind) -> Self {
        Call {
            kind,
            retry: Retry::Always,
            lease: None,
            keep_alive_channel: false,
        }
    }

    pub(crate) fn write(kind: RpcKind, lease: Option<LeaseId>) -> Self {
        Call {
            kind,
            retry: Retry::IfNotSent,
            lease,
            keep_alive_channel: false,
        }
    }
}

struct Member {
    url: String,
    channel: Channel,
    /// A connection of its own, so keep-alives never queue behind other
    /// requests (HTTP/2 flow control, tonic's request buffer) and a lease
    /// does not expire because the store is busy.
    keep_alive: Channel,
}

pub(crate) struct Client {
    members: Vec<Member>,
    /// The endpoint that answered last; calls start there.
    preferred: AtomicUsize,
    request_timeout: Duration,
    counts: [AtomicU64; KINDS],
}

impl Client {
    /// Channels connect lazily: nothing is sent until the first call.
    pub(crate) fn new(options: &EtcdOptions) -> Result<Self, MetaError> {
        if options.endpoints.is_empty() {
            return Err(MetaError::invalid("no etcd endpoint given"));
        }
        // tonic spawns a task per connection and would panic without a runtime.
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(MetaError::invalid(
                "the etcd store must be created inside a tokio runtime",
            ));
        }
        let members = options
            .endpoints
            .iter()
            .map(|url| {
                let endpoint = Endpoint::from_shared(url.clone())
                    .map_err(|e| MetaError::invalid(format!("etcd endpoint {url:?}: {e}")))?
                    .connect_timeout(options.connect_timeout)
                    .tcp_nodelay(true)
                    // Detects a dead connection under an open watch; etcd
                    // refuses pings on idle connections more often than every
                    // 5 s (--grpc-keepalive-min-time), hence not while idle.
                    .http2_keep_alive_interval(options.http2_keep_alive_interval)
                    .keep_alive_timeout(options.request_timeout)
                    .keep_alive_while_idle(false);
                Ok(Member {
                    url: url.clone(),
                    channel: endpoint.connect_lazy(),
                    keep_alive: endpoint.connect_lazy(),
                })
            })
            .collect::<Result<Vec<_>, MetaError>>()?;
        Ok(Client {
            members,
            preferred: AtomicUsize::new(0),
            request_timeout: options.request_timeout,
            counts: Default::default(),
        })
    }

    pub(crate) fn endpoints(&self) -> String {
        let urls: Vec<&str> = self.members.iter().map(|m| m.url.as_str()).collect();
        urls.join(",")
    }

    pub(crate) fn request_timeout(&self) -> Duration {
        self.request_timeout
    }

    pub(crate) fn counts(&self) -> RequestCounts {
        let c = |k: RpcKind| self.counts[k as usize].load(Ordering::Relaxed);
        RequestCounts {
            range: c(RpcKind::Range),
            put: c(RpcKind::Put),
            delete_range: c(RpcKind::DeleteRange),
            txn: c(RpcKind::Txn),
            compact: c(RpcKind::Compact),
            watch: c(RpcKind::Watch),
            lease_grant: c(RpcKind::LeaseGrant),
            lease_revoke: c(RpcKind::LeaseRevoke),
            lease_keep_alive: c(RpcKind::LeaseKeepAlive),
        }
    }

    /// A unary RPC with failover and a deadline.
    pub(crate) async fn unary<Req, Resp>(
        &self,
        call: Call,
        path: &'static str,
        req: Req,
    ) -> Result<Resp, MetaError>
    where
        Req: prost::Message + Clone + Send + Sync + 'static,
        Resp: prost::Message + Default + Send + Sync + 'static,
    {
        self.call(call, |channel| unary(channel, path, req.clone()))
            .await
            .map(|(resp, _)| resp)
    }

    /// Run `f` on one endpoint after another, starting with the one that
    /// answered last, until one answers or retrying would be unsafe. Each
    /// attempt gets the request timeout. Returns the answer and the endpoint
    /// that gave it.
    pub(crate) async fn call<T, F, Fut>(
        &self,
        call: Call,
        mut f: F,
    ) -> Result<(T, String), MetaError>
    where
        F: FnMut(Channel) -> Fut,
        Fut: Future<Output = Result<T, Status>>,
    {
        let n = self.members.len();
        let first = self.preferred.load(Ordering::Relaxed) % n;
        let mut failures = Vec::new();
        for i in 0..n {
            let idx = (first + i) % n;
            let member = &self.members[idx];
            let channel = if call.keep_alive_channel {
                member.keep_alive.clone()
            } else {
                member.channel.clone()
            };
            self.counts[call.kind as usize].fetch_add(1, Ordering::Relaxed);
            let outcome = tokio::time::timeout(self.request_timeout, f(channel)).await;
            // `maybe_sent`: the request may have reached etcd (and a write been applied).
            let (failure, maybe_sent) = match outcome {
                Ok(Ok(value)) => {
                    self.preferred.store(idx, Ordering::Relaxed);
                    return Ok((value, member.url.clone()));
                }
                Ok(Err(status)) if is_connect_error(&status) => (
                    format!("{}: cannot connect: {}", member.url, root_cause(&status)),
                    false,
                ),
                Ok(Err(status)) if is_transient(&status) => {
                    (format!("{}: {}", member.url, status.message()), true)
                }
                Ok(Err(status)) => return Err(rejected(&status, &member.url, call.lease)),
                Err(_) => (
                    format!(
                        "{}: no answer within {:?} (request timeout)",
                        member.url, self.request_timeout
                    ),
                    true,
                ),
            };
            tracing::debug!(endpoint = %member.url, %failure, "etcd request failed");
            failures.push(failure);
            if maybe_sent && call.retry == Retry::IfNotSent {
                return Err(self.unavailable(failures.join("; "), true));
            }
        }
        Err(self.unavailable(failures.join("; "), false))
    }

    fn unavailable(&self, reason: String, maybe_applied: bool) -> MetaError {
        let reason = if maybe_applied {
            format!("{reason}; the write may or may not have been applied")
        } else {
            reason
        };
        MetaError::Unavailable {
            endpoints: self.endpoints(),
            reason,
        }
    }
}

/// tonic refuses answers over 4 MiB by default, which a range over many keys
/// can exceed; etcd's own Go client accepts up to 2 GiB, and so do we.
const MAX_RESPONSE_BYTES: usize = i32::MAX as usize;

type Codec<Req, Resp> = tonic_prost::ProstCodec<Req, Resp>;

/// A gRPC client on `channel` once it can take a request.
async fn ready<Req, Resp>(
    channel: Channel,
) -> Result<(tonic::client::Grpc<Channel>, Codec<Req, Resp>), Status>
where
    Req: prost::Message + Send + Sync + 'static,
    Resp: prost::Message + Default + Send + Sync + 'static,
{
    let mut grpc = tonic::client::Grpc::new(channel).max_decoding_message_size(MAX_RESPONSE_BYTES);
    grpc.ready()
        .await
        .map_err(|e| Status::from_error(e.into()))?;
    Ok((grpc, Codec::default()))
}

/// One unary gRPC request on `channel`.
async fn unary<Req, Resp>(channel: Channel, path: &'static str, req: Req) -> Result<Resp, Status>
where
    Req: prost::Message + Send + Sync + 'static,
    Resp: prost::Message + Default + Send + Sync + 'static,
{
    let (mut grpc, codec) = ready::<Req, Resp>(channel).await?;
    let resp = grpc
        .unary(
            tonic::Request::new(req),
            PathAndQuery::from_static(path),
            codec,
        )
        .await?;
    Ok(resp.into_inner())
}

/// Open a bidirectional stream: `first` is sent at once, and the request side
/// then stays open (etcd ends a watch when the client half-closes) until the
/// returned stream is dropped.
pub(crate) async fn open_stream<Req, Resp>(
    channel: Channel,
    path: &'static str,
    first: Req,
    keep_open: bool,
) -> Result<tonic::Streaming<Resp>, Status>
where
    Req: prost::Message + Send + Sync + 'static,
    Resp: prost::Message + Default + Send + Sync + 'static,
{
    use futures_util::StreamExt;
    let (mut grpc, codec) = ready::<Req, Resp>(channel).await?;
    let once = futures_util::stream::iter([first]);
    let requests = if keep_open {
        once.chain(futures_util::stream::pending()).boxed()
    } else {
        once.boxed()
    };
    let resp = grpc
        .streaming(
            tonic::Request::new(requests),
            PathAndQuery::from_static(path),
            codec,
        )
        .await?;
    Ok(resp.into_inner())
}

/// The connection could not be made, so the request never left this host.
fn is_connect_error(status: &Status) -> bool {
    let mut source = status.source();
    while let Some(err) = source {
        if err.is::<tonic::ConnectError>() {
            return true;
        }
        source = err.source();
    }
    false
}

/// The innermost error under `status` ("Connection refused (os error 111)"
/// rather than tonic's "tcp connect error"), which says what to fix.
fn root_cause(status: &Status) -> String {
    let mut cause: &dyn std::error::Error = status;
    while let Some(inner) = cause.source() {
        cause = inner;
    }
    match cause.to_string() {
        s if s.is_empty() => status.message().to_string(),
        s => s,
    }
}

/// Worth trying another endpoint: a broken connection, or a member that
/// cannot serve right now (no leader, proposal timed out, shutting down).
fn is_transient(status: &Status) -> bool {
    matches!(
        status.code(),
        Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled | Code::Unknown
    ) && !status.message().contains("lease not found")
}

/// An answer from etcd that no other endpoint would answer differently.
pub(crate) fn rejected(status: &Status, endpoint: &str, lease: Option<LeaseId>) -> MetaError {
    let message = status.message();
    match (status.code(), lease) {
        (Code::NotFound, Some(id)) if message.contains("lease not found") => {
            MetaError::LeaseNotFound(id)
        }
        (Code::InvalidArgument, _) => MetaError::invalid(format!("etcd at {endpoint}: {message}")),
        (code, _) => MetaError::Etcd {
            endpoint: endpoint.to_string(),
            code: format!("{code:?}"),
            message: message.to_string(),
        },
    }
}

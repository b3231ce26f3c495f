//! Watches: one gRPC stream per watch, pumped by a task into the channel
//! behind [`Watch`].

use tokio::sync::mpsc;
use tonic::Streaming;

use super::client::{open_stream, Call, Client, RpcKind};
use super::convert::{event_from_etcd, header_revision, range_request};
use super::proto::{self, path, watch_request::RequestUnion};
use crate::error::MetaError;
use crate::types::{KeyRange, Revision};
use crate::watch::{Watch, WatchItem};

/// Everything a watch task needs; it holds no reference to the store, so
/// dropping the store (its `shutdown` sender) ends the watch.
pub(crate) struct WatchSpec {
    pub range: KeyRange,
    pub start: Option<Revision>,
    pub capacity: usize,
    pub shutdown: tokio::sync::watch::Receiver<()>,
}

pub(crate) async fn open(client: &Client, spec: WatchSpec) -> Result<Watch, MetaError> {
    let start = match spec.start {
        None | Some(Revision(0)) => 0,
        Some(r) if r.0 < 0 => {
            return Err(MetaError::invalid(format!(
                "watch start revision {r} is negative"
            )))
        }
        Some(r) => r.0,
    };
    let (tx, rx) = mpsc::channel(spec.capacity + 1);
    let Some((key, range_end)) = super::convert::range_to_etcd(&spec.range) else {
        // Nothing can ever match: a watch that ends only with the store.
        let mut shutdown = spec.shutdown;
        tokio::spawn(async move {
            tokio::select! {
                _ = tx.closed() => {}
                _ = shutdown.changed() => {}
            }
        });
        return Ok(Watch::from_receiver(rx));
    };
    let create = proto::WatchRequest {
        request_union: Some(RequestUnion::CreateRequest(proto::WatchCreateRequest {
            key: key.clone(),
            range_end: range_end.clone(),
            start_revision: start,
            prev_kv: true,
        })),
    };
    let ((mut stream, current), endpoint) = client
        .call(Call::read(RpcKind::Watch), |channel| {
            let create = create.clone();
            async move {
                let mut stream =
                    open_stream::<_, proto::WatchResponse>(channel, path::WATCH, create, true)
                        .await?;
                let created = stream.message().await?.ok_or_else(|| {
                    tonic::Status::unavailable("etcd closed the watch stream before creating it")
                })?;
                Ok((stream, created))
            }
        })
        .await?;
    if !current.created || current.canceled {
        return Err(MetaError::Etcd {
            endpoint,
            code: "watch refused".to_string(),
            message: current.cancel_reason,
        });
    }
    // etcd reports a compacted start revision only later, on the stream; a
    // read at the start revision fails right away in exactly that case.
    let now = header_revision(current.header.as_ref());
    if start > 0 && start <= now.0 {
        let probe = proto::RangeRequest {
            revision: start,
            count_only: true,
            ..range_request(key, range_end, Some(1))
        };
        let read = client
            .unary::<_, proto::RangeResponse>(Call::read(RpcKind::Range), path::RANGE, probe)
            .await;
        match read {
            Ok(_) => {}
            Err(MetaError::Etcd { message, .. }) if message.contains("compacted") => {
                return Err(compaction_notice(client, &mut stream, Revision(start)).await);
            }
            Err(e) => return Err(e),
        }
    }
    tokio::spawn(pump(
        stream,
        tx,
        Pump {
            next_revision: Revision(start),
            capacity: spec.capacity,
            shutdown: spec.shutdown,
            endpoint,
        },
    ));
    Ok(Watch::from_receiver(rx))
}

/// Wait for the compaction message etcd is about to send on `stream`.
async fn compaction_notice(
    client: &Client,
    stream: &mut Streaming<proto::WatchResponse>,
    requested: Revision,
) -> MetaError {
    let deadline = client.request_timeout();
    loop {
        match tokio::time::timeout(deadline, stream.message()).await {
            Ok(Ok(Some(resp))) if resp.compact_revision > 0 => {
                return MetaError::Compacted {
                    requested,
                    oldest: Revision(resp.compact_revision),
                }
            }
            Ok(Ok(Some(_))) => continue,
            Ok(Ok(None)) | Ok(Err(_)) | Err(_) => {
                return MetaError::Compacted {
                    requested,
                    oldest: requested.next(),
                }
            }
        }
    }
}

struct Pump {
    /// The first revision not yet delivered, for a `Compacted` error.
    next_revision: Revision,
    capacity: usize,
    shutdown: tokio::sync::watch::Receiver<()>,
    endpoint: String,
}

/// Move events from the gRPC stream to the watcher's channel until either
/// side ends. Like the embedded store, a watcher that falls `capacity`
/// events behind is dropped with `WatchLagged` instead of holding up etcd.
async fn pump(mut stream: Streaming<proto::WatchResponse>, tx: mpsc::Sender<WatchItem>, p: Pump) {
    let Pump {
        mut next_revision,
        capacity,
        mut shutdown,
        endpoint,
    } = p;
    loop {
        let msg = tokio::select! {
            _ = tx.closed() => return,
            // Sender dropped: the store is gone; dropping `tx` says Closed.
            _ = shutdown.changed() => return,
            msg = stream.message() => msg,
        };
        let resp = match msg {
            Ok(Some(resp)) => resp,
            Ok(None) => {
                let _ = tx.try_send(Err(lost(&endpoint, "etcd ended the watch stream")));
                return;
            }
            Err(status) => {
                let _ = tx.try_send(Err(lost(&endpoint, status.message())));
                return;
            }
        };
        if resp.canceled {
            let err = if resp.compact_revision > 0 {
                MetaError::Compacted {
                    requested: next_revision,
                    oldest: Revision(resp.compact_revision),
                }
            } else {
                lost(
                    &endpoint,
                    &format!("etcd cancelled the watch: {}", resp.cancel_reason),
                )
            };
            let _ = tx.try_send(Err(err));
            return;
        }
        for ev in resp.events {
            let item = event_from_etcd(ev);
            if let Ok(ev) = &item {
                next_revision = ev.revision().next();
            }
            // One slot is reserved for the terminal error.
            if tx.capacity() <= 1 {
                let _ = tx.try_send(Err(MetaError::WatchLagged { capacity }));
                return;
            }
            let failed = item.is_err();
            if tx.try_send(item).is_err() || failed {
                return;
            }
        }
    }
}

fn lost(endpoint: &str, reason: &str) -> MetaError {
    MetaError::Unavailable {
        endpoints: endpoint.to_string(),
        reason: format!("watch lost: {reason}"),
    }
}

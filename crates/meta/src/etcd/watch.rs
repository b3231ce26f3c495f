//! Watches: one gRPC stream per watch, pumped by a task into the channel
//! behind [`Watch`].

use std::sync::Arc;
use std::time::Instant;

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

/// The keys a watch covers, in etcd's spelling.
#[derive(Clone)]
struct Target {
    key: Vec<u8>,
    range_end: Vec<u8>,
}

/// A stream whose watch etcd has created, with the `created` answer.
struct Created {
    stream: Streaming<proto::WatchResponse>,
    answer: proto::WatchResponse,
    endpoint: String,
}

pub(crate) async fn open(client: &Arc<Client>, spec: WatchSpec) -> Result<Watch, MetaError> {
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
    let target = Target { key, range_end };
    let mut created = create(client, &target, start).await?;
    // etcd reports a compacted start revision only later, on the stream; a
    // read at the start revision fails right away in exactly that case.
    let now = header_revision(created.answer.header.as_ref());
    if start > 0 && start <= now.0 {
        let probe = proto::RangeRequest {
            revision: start,
            count_only: true,
            ..range_request(target.key.clone(), target.range_end.clone(), Some(1))
        };
        let read = client
            .unary::<_, proto::RangeResponse>(Call::read(RpcKind::Range), path::RANGE, probe)
            .await;
        match read {
            Ok(_) => {}
            Err(MetaError::Etcd { message, .. }) if message.contains("compacted") => {
                return Err(compaction_notice(client, &mut created.stream, Revision(start)).await);
            }
            Err(e) => return Err(e),
        }
    }
    let pump = Pump {
        client: Arc::clone(client),
        target,
        // A watch from "now" covers the revisions after the one etcd was at.
        next_revision: if start > 0 {
            Revision(start)
        } else {
            now.next()
        },
        capacity: spec.capacity,
        shutdown: spec.shutdown,
        tx,
    };
    tokio::spawn(pump.run(created));
    Ok(Watch::from_receiver(rx))
}

/// Open a watch stream on some endpoint and wait for etcd to create it.
async fn create(client: &Client, target: &Target, start: i64) -> Result<Created, MetaError> {
    let request = proto::WatchRequest {
        request_union: Some(RequestUnion::CreateRequest(proto::WatchCreateRequest {
            key: target.key.clone(),
            range_end: target.range_end.clone(),
            start_revision: start,
            prev_kv: true,
        })),
    };
    let ((stream, answer), endpoint) = client
        .call(Call::read(RpcKind::Watch), |channel| {
            let request = request.clone();
            async move {
                let mut stream =
                    open_stream::<_, proto::WatchResponse>(channel, path::WATCH, request, true)
                        .await?;
                let answer = stream.message().await?.ok_or_else(|| {
                    tonic::Status::unavailable("etcd closed the watch stream before creating it")
                })?;
                Ok((stream, answer))
            }
        })
        .await?;
    if !answer.created || (answer.canceled && answer.compact_revision == 0) {
        return Err(MetaError::Etcd {
            endpoint,
            code: "watch refused".to_string(),
            message: answer.cancel_reason,
        });
    }
    Ok(Created {
        stream,
        answer,
        endpoint,
    })
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

/// Streams lost in quick succession (each within a request timeout of its
/// creation) before the watch gives up: members that keep dropping a watch
/// at once are not worth retrying forever, while a watch that lives for
/// months may be resumed any number of times.
const MAX_RESUMES: usize = 3;

/// The task that moves events from the gRPC stream to the watcher's
/// channel. Like the embedded store, a watcher that falls `capacity` events
/// behind is dropped with `WatchLagged` instead of holding up etcd. When the
/// stream is lost (a member died or became unreachable), the watch resumes
/// from the first undelivered revision on whichever endpoint answers, so
/// the watcher sees every event exactly once.
struct Pump {
    client: Arc<Client>,
    target: Target,
    /// The first revision not yet delivered.
    next_revision: Revision,
    capacity: usize,
    /// Sender dropped with the store; dropping `tx` then says Closed.
    shutdown: tokio::sync::watch::Receiver<()>,
    tx: mpsc::Sender<WatchItem>,
}

impl Pump {
    async fn run(mut self, created: Created) {
        let Created {
            mut stream,
            mut endpoint,
            ..
        } = created;
        let mut resumes = 0;
        let mut since = Instant::now();
        loop {
            let msg = tokio::select! {
                _ = self.tx.closed() => return,
                _ = self.shutdown.changed() => return,
                msg = stream.message() => msg,
            };
            let resp = match msg {
                Ok(Some(resp)) => resp,
                Ok(None) | Err(_) => {
                    let why = match msg {
                        Err(status) => format!("{endpoint}: {}", status.message()),
                        _ => format!("{endpoint} ended the watch stream"),
                    };
                    if since.elapsed() > self.client.request_timeout() {
                        resumes = 0;
                    }
                    resumes += 1;
                    let resumed = if resumes > MAX_RESUMES {
                        Err(MetaError::Unavailable {
                            endpoints: self.client.endpoints(),
                            reason: format!("lost {MAX_RESUMES} times in quick succession"),
                        })
                    } else {
                        tracing::debug!(%why, revision = %self.next_revision, "etcd watch lost; resuming");
                        tokio::select! {
                            _ = self.tx.closed() => return,
                            _ = self.shutdown.changed() => return,
                            c = create(&self.client, &self.target, self.next_revision.0) => c,
                        }
                    };
                    match resumed {
                        Ok(created) => {
                            since = Instant::now();
                            stream = created.stream;
                            endpoint = created.endpoint;
                            continue;
                        }
                        Err(e) => return self.end(lost_for_good(why, e)),
                    }
                }
            };
            if resp.canceled {
                let err = if resp.compact_revision > 0 {
                    MetaError::Compacted {
                        requested: self.next_revision,
                        oldest: Revision(resp.compact_revision),
                    }
                } else {
                    MetaError::Etcd {
                        endpoint,
                        code: "watch cancelled".to_string(),
                        message: resp.cancel_reason,
                    }
                };
                return self.end(err);
            }
            for ev in resp.events {
                let ev = match event_from_etcd(ev) {
                    Ok(ev) => ev,
                    Err(e) => return self.end(e),
                };
                self.next_revision = ev.revision().next();
                // One slot is reserved for the terminal error.
                if self.tx.capacity() <= 1 {
                    let capacity = self.capacity;
                    return self.end(MetaError::WatchLagged { capacity });
                }
                if self.tx.try_send(Ok(ev)).is_err() {
                    return;
                }
            }
        }
    }

    fn end(self, err: MetaError) {
        let _ = self.tx.try_send(Err(err));
    }
}

fn lost_for_good(why: String, err: MetaError) -> MetaError {
    match err {
        MetaError::Unavailable { endpoints, reason } => MetaError::Unavailable {
            endpoints,
            reason: format!("watch lost ({why}) and not resumed: {reason}"),
        },
        other => other,
    }
}

//! The node's HTTP JSON API, stats pages and Prometheus metrics.

use crate::cluster::NodeMeta;
use crate::metrics::render_metrics;
use crate::ownership::NodeOwnership;
use crate::registry::NodeEngine;
use ashlar_cluster::{NodeId, NodeStatus};
use ashlar_engine::{EngineError, VdiskInfo};
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;

#[derive(Clone)]
pub struct ApiState {
    pub engine: Arc<NodeEngine>,
    pub nbd_listen: std::net::SocketAddr,
    /// The node's metadata store, where the cluster's nodes are listed.
    pub meta: NodeMeta,
    pub node_id: NodeId,
    /// In a cluster: who owns each vdisk, released on delete.
    pub ownership: NodeOwnership,
}

pub fn router(state: ApiState) -> Router {
    Router::new()
        .route("/api/v1/vdisks", get(list_vdisks).post(create_vdisk))
        .route(
            "/api/v1/vdisks/{name}",
            get(show_vdisk).patch(update_vdisk).delete(delete_vdisk),
        )
        .route("/api/v1/node", get(node_info))
        .route("/api/v1/nodes", get(list_nodes))
        .route(
            "/api/v1/nodes/{id}/drain",
            post(crate::drain::start).delete(crate::drain::cancel),
        )
        .route("/api/v1/cluster", get(cluster_status))
        .route("/stats/vdisks", get(vdisk_stats))
        .route("/stats/cache", get(cache_stats))
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .fallback(|| async {
            ApiError(
                StatusCode::NOT_FOUND,
                "no such endpoint; see /api/v1/vdisks, /api/v1/nodes, /api/v1/cluster, /stats/vdisks, /stats/cache, /metrics"
                    .into(),
            )
        })
        .with_state(state)
}

/// The API's error: a status and `{"error": "one clear line"}`.
pub(crate) struct ApiError(pub(crate) StatusCode, pub(crate) String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.0, Json(json!({ "error": self.1 }))).into_response()
    }
}

impl From<EngineError> for ApiError {
    fn from(error: EngineError) -> Self {
        let status = match &error {
            EngineError::NotFound(_) => StatusCode::NOT_FOUND,
            EngineError::AlreadyExists(_)
            | EngineError::InUse { .. }
            | EngineError::ShrinkRefused { .. } => StatusCode::CONFLICT,
            EngineError::InvalidName { .. }
            | EngineError::InvalidSize(_)
            | EngineError::InvalidShards(_)
            | EngineError::InvalidReplicationFactor(_) => StatusCode::BAD_REQUEST,
            EngineError::Stopping | EngineError::Offline { .. } => StatusCode::SERVICE_UNAVAILABLE,
            EngineError::Meta(_) | EngineError::Storage(_) => StatusCode::INTERNAL_SERVER_ERROR,
        };
        ApiError(status, error.to_string())
    }
}

fn with_uri(state: &ApiState, info: VdiskInfo) -> Value {
    let mut value = serde_json::to_value(&info).unwrap_or(Value::Null);
    value["nbd_uri"] = json!(format!("nbd://{}/{}", state.nbd_listen, info.name));
    value
}

/// A vdisk as the API shows it: its NBD URI, and in a cluster its ownership.
async fn vdisk_json(state: &ApiState, info: VdiskInfo) -> Result<Value, ApiError> {
    let id = info.id;
    let mut value = with_uri(state, info);
    let view = state
        .ownership
        .view(id)
        .await
        .map_err(|e| ApiError(StatusCode::SERVICE_UNAVAILABLE, e))?;
    if let Some(view) = view {
        value["ownership"] = serde_json::to_value(view).unwrap_or(Value::Null);
    }
    Ok(value)
}

async fn list_vdisks(State(state): State<ApiState>) -> Result<Json<Value>, ApiError> {
    let mut vdisks = Vec::new();
    for info in state.engine.list_vdisks() {
        vdisks.push(vdisk_json(&state, info).await?);
    }
    Ok(Json(Value::Array(vdisks)))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateRequest {
    name: String,
    size_bytes: u64,
    shards: Option<u32>,
    /// Copies kept (1 by default; 2 or 3 in a cluster).
    replication_factor: Option<u8>,
}

async fn create_vdisk(
    State(state): State<ApiState>,
    body: Result<Json<CreateRequest>, axum::extract::rejection::JsonRejection>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let Json(request) = body.map_err(|e| ApiError(StatusCode::BAD_REQUEST, e.body_text()))?;
    let replication_factor = request.replication_factor.unwrap_or(1);
    if replication_factor > 1 && !state.meta.is_clustered() {
        return Err(ApiError(
            StatusCode::BAD_REQUEST,
            format!(
                "replication factor {replication_factor} needs a cluster: this node runs alone \
                 (start nodes with --etcd to keep copies on several nodes)"
            ),
        ));
    }
    let info = state
        .engine
        .create_replicated_vdisk(
            &request.name,
            request.size_bytes,
            request.shards,
            replication_factor,
        )
        .await?;
    Ok((StatusCode::CREATED, Json(with_uri(&state, info))))
}

async fn show_vdisk(
    State(state): State<ApiState>,
    Path(name): Path<String>,
) -> Result<Json<Value>, ApiError> {
    if state.meta.is_clustered() {
        // Another node may have created it since this one started: any node shows any
        // vdisk of the cluster (and may serve it).
        if let Err(error) = state.engine.learn(&name).await {
            tracing::warn!(vdisk = %name, %error, "could not start a vdisk from the catalog");
        }
    }
    let info = state.engine.vdisk(&name)?;
    Ok(Json(vdisk_json(&state, info).await?))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct UpdateRequest {
    size_bytes: Option<u64>,
    #[serde(default)]
    allow_shrink: bool,
    shards: Option<u32>,
}

async fn update_vdisk(
    State(state): State<ApiState>,
    Path(name): Path<String>,
    body: Result<Json<UpdateRequest>, axum::extract::rejection::JsonRejection>,
) -> Result<Json<Value>, ApiError> {
    let Json(request) = body.map_err(|e| ApiError(StatusCode::BAD_REQUEST, e.body_text()))?;
    let mut info = state.engine.vdisk(&name)?;
    if let Some(size_bytes) = request.size_bytes {
        info = state
            .engine
            .resize(&name, size_bytes, request.allow_shrink)
            .await?;
    }
    if let Some(shards) = request.shards {
        info = state.engine.set_shards(&name, shards).await?;
    }
    Ok(Json(with_uri(&state, info)))
}

#[derive(Deserialize)]
struct DeleteQuery {
    #[serde(default)]
    force: bool,
}

async fn delete_vdisk(
    State(state): State<ApiState>,
    Path(name): Path<String>,
    Query(query): Query<DeleteQuery>,
) -> Result<Json<Value>, ApiError> {
    let id = state.engine.vdisk(&name)?.id;
    state
        .ownership
        .check_delete(&name, id)
        .await
        .map_err(|e| ApiError(StatusCode::CONFLICT, e))?;
    state.engine.delete_vdisk(&name, query.force).await?;
    state.ownership.released(id).await;
    Ok(Json(json!({ "deleted": name })))
}

async fn node_info(State(state): State<ApiState>) -> Json<Value> {
    let config = state.engine.config();
    Json(json!({
        "version": env!("CARGO_PKG_VERSION"),
        "nbd_listen": state.nbd_listen.to_string(),
        "reactors": config.reactors,
        "cache_bytes": config.cache_bytes,
        "oplog_bytes_per_vdisk": config.oplog_bytes_per_vdisk,
        // A drain step's data (`--drain-batch`) and what all of them hold (`--drain-memory`).
        "drain_batch_bytes": config.drain_batch_bytes,
        "drain_memory_bytes": config.drain_memory_bytes,
        // How a drain step writes the extent store (`--max-writing-egroups`,
        // `--writes-in-flight-per-egroup`).
        "max_writing_egroups": config.max_writing_egroups_per_shard,
        "writes_in_flight_per_egroup": config.writes_in_flight_per_egroup,
        "disks": config.disks.iter().map(|d| json!({"path": d.path.display().to_string(), "tier": d.tier.name()})).collect::<Vec<_>>(),
        "disk_io": config.fs.name(),
        "direct_io": match &config.fs {
            ashlar_storage::fs::NodeFs::Uring(fs) => fs.config().prefer_direct,
            _ => false,
        },
        // Each reactor's io_uring limits (`--io-bounce-pool`, `--io-max-in-flight`).
        "disk_io_limits": match &config.fs {
            ashlar_storage::fs::NodeFs::Uring(fs) => json!({
                "bounce_pool_bytes": fs.config().bounce_pool_bytes,
                "max_in_flight_ops": fs.config().max_in_flight_ops,
            }),
            _ => Value::Null,
        },
        // Freed large read buffers kept for reuse, and their limit (`--io-read-buffers`).
        "read_buffers_kept_bytes": ashlar_storage::fs::large_buffers::free_bytes(),
        "read_buffers_kept_limit_bytes": ashlar_storage::fs::large_buffers::free_limit_bytes(),
        // Memory mapped for small (up to 32 KiB) read buffers, cached blocks among them, and
        // its limit (the caches plus the front-ends' request budgets).
        "small_read_buffers_mapped_bytes": ashlar_storage::fs::small_buffers::mapped_bytes(),
        "small_read_buffers_limit_bytes": ashlar_storage::fs::small_buffers::limit_bytes(),
        // Files opened through the page cache because their filesystem refused O_DIRECT.
        "buffered_fallback_opens": ashlar_storage::fs::uring::buffered_fallback_opens(),
        // Per reactor: `io_uring_enter` calls that submitted disk operations, and how many
        // they submitted (a drain step's writes go in batches).
        "disk_io_submissions": disk_io_submissions(&state.engine).await,
        // Data startup found that no vdisk accounts for, moved aside rather than deleted.
        "quarantined": state.engine.quarantined().iter().map(|p| p.display().to_string()).collect::<Vec<_>>(),
        // Requests this node sent to etcd, by kind (none on a single node): client I/O
        // never adds to them.
        "etcd_requests": etcd_requests(&state.meta),
    }))
}

/// Each reactor's io_uring submission counters (`null` for a reactor that has done no disk
/// I/O through io_uring, has stopped, or does not answer within a second: the page never
/// waits on a stuck reactor).
async fn disk_io_submissions(engine: &NodeEngine) -> Value {
    const REACTOR_ANSWER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);
    let mut reactors = Vec::new();
    for reactor in engine.reactors().handles() {
        let asked = reactor.run(|| async { ashlar_storage::fs::uring::thread_stats() });
        let stats = tokio::time::timeout(REACTOR_ANSWER_TIMEOUT, asked)
            .await
            .ok()
            .and_then(Result::ok)
            .flatten();
        reactors.push(stats.map_or(Value::Null, |stats| {
            json!({
                "submit_calls": stats.submit_calls,
                "entries_submitted": stats.entries_submitted,
            })
        }));
    }
    Value::Array(reactors)
}

/// The cluster's nodes, up and down. A single node owns every vdisk it serves; in a cluster
/// `vdisks_owned` counts ownership claims in the metadata store.
async fn list_nodes(State(state): State<ApiState>) -> Result<Json<Value>, ApiError> {
    let nodes = ashlar_cluster::list_nodes(&state.meta).await.map_err(|e| {
        ApiError(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("listing nodes: {e}"),
        )
    })?;
    let single_node = !state.meta.is_clustered();
    let nodes = nodes
        .into_iter()
        .map(|status| {
            let local = status.record.node_id == state.node_id;
            let owned = if single_node && local {
                state.engine.list_vdisks().len()
            } else {
                status.vdisks_owned
            };
            node_json(status, local, owned)
        })
        .collect();
    Ok(Json(Value::Array(nodes)))
}

fn node_json(status: NodeStatus, local: bool, vdisks_owned: usize) -> Value {
    let NodeStatus {
        record,
        state,
        draining,
        ..
    } = status;
    json!({
        "node_id": record.node_id,
        "state": state,
        "draining": draining,
        "local": local,
        "addresses": record.addresses,
        "storage_only": record.storage_only,
        "capacity_bytes": record.capacity_bytes(),
        "free_bytes": record.free_bytes(),
        "disks": record.disks,
        "vdisks_owned": vdisks_owned,
        "software_version": record.software_version,
        "started_at_unix_ms": record.started_at_unix_ms,
    })
}

fn etcd_requests(meta: &NodeMeta) -> Value {
    match meta {
        NodeMeta::Etcd(store) => {
            let c = store.request_counts();
            json!({
                "total": c.total(), "range": c.range, "put": c.put,
                "delete_range": c.delete_range, "txn": c.txn, "watch": c.watch,
                "lease_grant": c.lease_grant, "lease_revoke": c.lease_revoke,
                "lease_keep_alive": c.lease_keep_alive,
            })
        }
        NodeMeta::Embedded(_) => Value::Null,
    }
}

async fn cluster_status(State(state): State<ApiState>) -> Result<Json<Value>, ApiError> {
    if !state.meta.is_clustered() {
        return Err(ApiError(
            StatusCode::NOT_FOUND,
            "this node runs alone (started without --etcd): there is no cluster; `ashlar vdisk \
             list` and `ashlar node list` describe it"
                .into(),
        ));
    }
    let status = crate::cluster_status::gather(&state.meta)
        .await
        .map_err(|e| ApiError(StatusCode::SERVICE_UNAVAILABLE, e))?;
    Ok(Json(serde_json::to_value(status).unwrap_or(Value::Null)))
}

async fn vdisk_stats(State(state): State<ApiState>) -> Json<Value> {
    Json(json!({ "vdisks": state.engine.vdisk_stats() }))
}

async fn cache_stats(State(state): State<ApiState>) -> Json<Value> {
    let (total, per_reactor) = state.engine.cache_stats();
    Json(json!({ "total": total, "per_reactor": per_reactor }))
}

async fn metrics(State(state): State<ApiState>) -> impl IntoResponse {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        render_metrics(&state.engine),
    )
}

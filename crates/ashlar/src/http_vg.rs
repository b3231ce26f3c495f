//! HTTP API of volume groups, beside the vdisk routes: `/api/v1/volume-groups`, and the
//! node-wide iSCSI discovery authentication: `/api/v1/iscsi/discovery-auth`.

use crate::iscsi::NodeVolumeGroups;
use crate::registry::NodeEngine;
use crate::volume_groups::{change, Attachment, Chap, DiscoveryAuth, VgError, VolumeGroupRecord};
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;

#[derive(Clone)]
pub struct VgState {
    pub engine: Arc<NodeEngine>,
    pub groups: NodeVolumeGroups,
    pub iscsi_listen: std::net::SocketAddr,
}

pub fn router(state: VgState) -> Router {
    Router::new()
        .route("/api/v1/volume-groups", get(list).post(create))
        .route("/api/v1/volume-groups/{name}", get(show).delete(remove))
        .route("/api/v1/volume-groups/{name}/disks", post(add_disk))
        .route(
            "/api/v1/volume-groups/{name}/disks/{vdisk}",
            delete(remove_disk),
        )
        .route("/api/v1/volume-groups/{name}/attachments", post(attach))
        .route(
            "/api/v1/volume-groups/{name}/attachments/{initiator}",
            delete(detach),
        )
        .route(
            "/api/v1/iscsi/discovery-auth",
            get(show_discovery_auth).post(set_discovery_auth),
        )
        .with_state(state)
}

struct ApiError(StatusCode, String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.0, Json(json!({ "error": self.1 }))).into_response()
    }
}

impl From<VgError> for ApiError {
    fn from(error: VgError) -> Self {
        let status = match &error {
            VgError::NotFound(_) => StatusCode::NOT_FOUND,
            VgError::AlreadyExists(_) | VgError::Conflict(_) => StatusCode::CONFLICT,
            VgError::Invalid(_) => StatusCode::BAD_REQUEST,
            VgError::Meta(_) | VgError::Corrupt { .. } => StatusCode::INTERNAL_SERVER_ERROR,
        };
        ApiError(status, error.to_string())
    }
}

fn bad_json(error: axum::extract::rejection::JsonRejection) -> ApiError {
    ApiError(StatusCode::BAD_REQUEST, error.body_text())
}

/// A group as the API shows it: secrets are never returned, only CHAP user names.
fn view(state: &VgState, group: &VolumeGroupRecord) -> Value {
    let attachments: Vec<Value> = group
        .attachments
        .iter()
        .map(|a| {
            let mut v = json!({ "initiator": a.initiator });
            if let Some(chap) = &a.chap {
                v["chap_user"] = json!(chap.user);
            }
            if let Some(mutual) = &a.mutual_chap {
                v["mutual_chap_user"] = json!(mutual.user);
            }
            v
        })
        .collect();
    json!({
        "name": group.name,
        "iqn": group.iqn(),
        "portal": state.iscsi_listen.to_string(),
        "disks": group.disks,
        "attachments": attachments,
        "created_unix_seconds": group.created_unix_seconds,
    })
}

async fn list(State(state): State<VgState>) -> Json<Value> {
    let groups: Vec<Value> = state
        .groups
        .list()
        .iter()
        .map(|g| view(&state, g))
        .collect();
    Json(Value::Array(groups))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateRequest {
    name: String,
}

async fn create(
    State(state): State<VgState>,
    body: Result<Json<CreateRequest>, axum::extract::rejection::JsonRejection>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let Json(request) = body.map_err(bad_json)?;
    let group = state.groups.create(&request.name).await?;
    Ok((StatusCode::CREATED, Json(view(&state, &group))))
}

async fn show(
    State(state): State<VgState>,
    Path(name): Path<String>,
) -> Result<Json<Value>, ApiError> {
    Ok(Json(view(&state, &state.groups.get(&name)?)))
}

async fn remove(
    State(state): State<VgState>,
    Path(name): Path<String>,
) -> Result<Json<Value>, ApiError> {
    state.groups.delete(&name).await?;
    Ok(Json(json!({ "deleted": name })))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DiskRequest {
    vdisk: String,
}

async fn add_disk(
    State(state): State<VgState>,
    Path(name): Path<String>,
    body: Result<Json<DiskRequest>, axum::extract::rejection::JsonRejection>,
) -> Result<Json<Value>, ApiError> {
    let Json(request) = body.map_err(bad_json)?;
    // The vdisk must exist now; a vdisk deleted later makes the target fail logins.
    state
        .engine
        .vdisk(&request.vdisk)
        .map_err(|e| ApiError(StatusCode::NOT_FOUND, e.to_string()))?;
    let group = state
        .groups
        .update(&name, |g| change::add_disk(g, &request.vdisk))
        .await?;
    Ok(Json(view(&state, &group)))
}

async fn remove_disk(
    State(state): State<VgState>,
    Path((name, vdisk)): Path<(String, String)>,
) -> Result<Json<Value>, ApiError> {
    let group = state
        .groups
        .update(&name, |g| change::remove_disk(g, &vdisk))
        .await?;
    Ok(Json(view(&state, &group)))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AttachRequest {
    initiator: String,
    chap: Option<Chap>,
    mutual_chap: Option<Chap>,
}

async fn attach(
    State(state): State<VgState>,
    Path(name): Path<String>,
    body: Result<Json<AttachRequest>, axum::extract::rejection::JsonRejection>,
) -> Result<Json<Value>, ApiError> {
    let Json(request) = body.map_err(bad_json)?;
    let attachment = Attachment {
        initiator: request.initiator,
        chap: request.chap,
        mutual_chap: request.mutual_chap,
    };
    let group = state
        .groups
        .update(&name, |g| change::attach(g, &attachment))
        .await?;
    Ok(Json(view(&state, &group)))
}

async fn detach(
    State(state): State<VgState>,
    Path((name, initiator)): Path<(String, String)>,
) -> Result<Json<Value>, ApiError> {
    let group = state
        .groups
        .update(&name, |g| change::detach(g, &initiator))
        .await?;
    Ok(Json(view(&state, &group)))
}

/// The discovery authentication as the API shows it: CHAP user names, never secrets.
fn discovery_view(auth: &DiscoveryAuth) -> Value {
    json!({
        "chap_user": auth.chap.as_ref().map(|c| c.user.clone()),
        "mutual_chap_user": auth.mutual_chap.as_ref().map(|c| c.user.clone()),
    })
}

async fn show_discovery_auth(State(state): State<VgState>) -> Json<Value> {
    Json(discovery_view(&state.groups.discovery_auth()))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DiscoveryAuthRequest {
    chap: Option<Chap>,
    mutual_chap: Option<Chap>,
}

/// Replaces what SendTargets discovery sessions must prove; `{}` lets anyone discover.
async fn set_discovery_auth(
    State(state): State<VgState>,
    body: Result<Json<DiscoveryAuthRequest>, axum::extract::rejection::JsonRejection>,
) -> Result<Json<Value>, ApiError> {
    let Json(request) = body.map_err(bad_json)?;
    let auth = DiscoveryAuth {
        chap: request.chap,
        mutual_chap: request.mutual_chap,
    };
    state.groups.set_discovery_auth(auth.clone()).await?;
    Ok(Json(discovery_view(&auth)))
}

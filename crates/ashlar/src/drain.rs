//! `ashlar node drain NODE`: empties a node before it is removed (docs/cluster-metadata.md,
//! "Drain"). The API records the drain in etcd; the curators move every claim and copy the
//! node holds (`crate::curator`); the CLI follows `GET /api/v1/cluster` until no vdisk's data
//! or claim is left on the node, with a progress line.

use crate::client::{approximate_size, ApiTarget, Client};
use crate::http::{ApiError, ApiState};
use anyhow::{bail, Result};
use ashlar_cluster::NodeId;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use serde_json::{json, Value};
use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

fn parse_node(text: &str) -> Result<NodeId, ApiError> {
    text.parse()
        .map_err(|e| ApiError(StatusCode::BAD_REQUEST, format!("node id {text}: {e}")))
}

fn cluster_only(state: &ApiState) -> Result<(), ApiError> {
    if state.meta.is_clustered() {
        return Ok(());
    }
    Err(ApiError(
        StatusCode::NOT_FOUND,
        "this node runs alone (started without --etcd): there is no other node to drain to".into(),
    ))
}

fn unavailable(what: &str, e: impl std::fmt::Display) -> ApiError {
    ApiError(StatusCode::SERVICE_UNAVAILABLE, format!("{what}: {e}"))
}

/// `POST /api/v1/nodes/{id}/drain`.
pub async fn start(
    State(state): State<ApiState>,
    Path(id): Path<String>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    cluster_only(&state)?;
    let node = parse_node(&id)?;
    let nodes = ashlar_cluster::list_nodes(&state.meta)
        .await
        .map_err(|e| unavailable("listing nodes", e))?;
    if !nodes.iter().any(|n| n.record.node_id == node) {
        return Err(ApiError(
            StatusCode::NOT_FOUND,
            format!("node {node} is not a member of this cluster (`ashlar node list`)"),
        ));
    }
    let now_unix_ms = crate::replication::unix_ms();
    let record = ashlar_cluster::start_drain(&state.meta, node, now_unix_ms)
        .await
        .map_err(|e| unavailable("recording the drain", e))?;
    tracing::info!(%node, "drain requested: the node's claims and copies move to other nodes");
    Ok((
        StatusCode::ACCEPTED,
        Json(json!({ "node": node, "started_unix_ms": record.started_unix_ms })),
    ))
}

/// `DELETE /api/v1/nodes/{id}/drain`.
pub async fn cancel(
    State(state): State<ApiState>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    cluster_only(&state)?;
    let node = parse_node(&id)?;
    let cancelled = ashlar_cluster::cancel_drain(&state.meta, node)
        .await
        .map_err(|e| unavailable("removing the drain", e))?;
    tracing::info!(%node, cancelled, "drain cancelled");
    Ok(Json(json!({ "node": node, "cancelled": cancelled })))
}

/// What is left on `node` in a `GET /api/v1/cluster` answer: vdisks it owns or holds a copy
/// of, and the bytes the resyncs of those moving now have done and have to do.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Left {
    pub vdisks: Vec<String>,
    pub resync_done_bytes: u64,
    pub resync_total_bytes: u64,
}

pub fn left_on(status: &Value, node: &str) -> Left {
    let mut left = Left::default();
    for vdisk in status["vdisks"].as_array().into_iter().flatten() {
        let on_node = vdisk["owner"] == node
            || vdisk["copies"]
                .as_array()
                .is_some_and(|copies| copies.iter().any(|c| c == node));
        if let Some(resync) = vdisk.get("resync") {
            left.resync_done_bytes += resync["done_bytes"].as_u64().unwrap_or(0);
            left.resync_total_bytes += resync["total_bytes"].as_u64().unwrap_or(0);
        }
        if on_node {
            left.vdisks
                .push(vdisk["name"].as_str().unwrap_or("?").to_string());
        }
    }
    left
}

/// `ashlar node drain NODE`: asks for the drain, then (unless `no_wait`) shows its progress
/// until the node holds nothing, or gives up after `timeout`.
pub fn run_cli(
    target: &ApiTarget,
    node: &str,
    cancel: bool,
    no_wait: bool,
    timeout: Duration,
) -> Result<()> {
    let client = Client::new(target)?;
    let path = format!("/api/v1/nodes/{node}/drain");
    if cancel {
        let answer = client.request("DELETE", &path, None)?;
        if answer["cancelled"] == true {
            println!("drain of node {node} cancelled; moves already made stay");
        } else {
            println!("node {node} was not being drained");
        }
        return Ok(());
    }
    client.request("POST", &path, Some(json!({})))?;
    println!("node {node} is draining: it claims no vdisk and gets no new copy");
    if no_wait {
        return Ok(());
    }
    let interactive = std::io::stderr().is_terminal();
    let started = Instant::now();
    let mut initial: Option<usize> = None;
    let mut last_line = String::new();
    loop {
        let status = client.request("GET", "/api/v1/cluster", None)?;
        let left = left_on(&status, node);
        let total = *initial.get_or_insert(left.vdisks.len());
        if left.vdisks.is_empty() {
            if interactive {
                eprintln!();
            }
            println!(
                "node {node} holds no vdisk's data or claim: it can be stopped and removed \
                 (`ashlar node drain {node} --cancel` lets it take vdisks again)"
            );
            return Ok(());
        }
        let line = progress_line(total, &left);
        if interactive {
            eprint!("\r{line:<100}");
            let _ = std::io::stderr().flush();
        } else if line != last_line {
            eprintln!("{line}");
        }
        last_line = line;
        if started.elapsed() >= timeout {
            if interactive {
                eprintln!();
            }
            bail!(
                "node {node} still holds {} after {:?}: {} (see `ashlar cluster status`; the \
                 drain goes on in the background)",
                plural(left.vdisks.len()),
                timeout,
                left.vdisks.join(", ")
            );
        }
        std::thread::sleep(Duration::from_secs(1));
    }
}

fn plural(n: usize) -> String {
    if n == 1 {
        "1 vdisk".into()
    } else {
        format!("{n} vdisks")
    }
}

fn progress_line(total: usize, left: &Left) -> String {
    const WIDTH: usize = 30;
    let moved = total.saturating_sub(left.vdisks.len());
    let filled = (moved * WIDTH).checked_div(total).unwrap_or(0);
    let mut line = format!(
        "[{}{}] {moved}/{total} vdisks moved off",
        "#".repeat(filled),
        " ".repeat(WIDTH - filled)
    );
    if left.resync_total_bytes > 0 {
        line.push_str(&format!(
            "; copying {} of {}",
            approximate_size(left.resync_done_bytes),
            approximate_size(left.resync_total_bytes)
        ));
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_is_left_counts_claims_and_copies_on_the_node() {
        let status = json!({ "vdisks": [
            { "name": "a", "owner": "n1", "copies": ["n1", "n2"] },
            { "name": "b", "owner": null, "copies": ["n2", "n3"],
              "resync": { "done_bytes": 10, "total_bytes": 40 } },
            { "name": "c", "owner": "n3", "copies": ["n3", "n1"] },
            { "name": "d", "owner": "n2", "copies": [] },
        ]});
        let left = left_on(&status, "n1");
        assert_eq!(left.vdisks, vec!["a".to_string(), "c".to_string()]);
        assert_eq!((left.resync_done_bytes, left.resync_total_bytes), (10, 40));
        assert!(left_on(&status, "n9").vdisks.is_empty());
        let line = progress_line(4, &left);
        assert!(line.contains("2/4 vdisks moved off"), "{line}");
        assert!(line.contains(&"#".repeat(15)), "{line}");
    }
}

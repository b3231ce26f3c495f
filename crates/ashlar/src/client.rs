//! The CLI side of `ashlar vdisk ...`: one HTTP request to the node, one line of output or a
//! table, one clear line on error.

use crate::api_token::{client_token, TokenSource, TOKEN_ENV, TOKEN_FILE_NAME};
use crate::args::{NodeAction, VdiskCommand, DEFAULT_DATA_DIR};
use anyhow::{anyhow, bail, Context, Result};
use ashlar_core::{format_size, parse_size};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Which node the CLI talks to, and the API token file it was given (if any).
pub struct ApiTarget {
    pub server: String,
    pub token_file: Option<PathBuf>,
}

pub(crate) struct Client {
    agent: ureq::Agent,
    base: String,
    /// The `Authorization` header value, and where its token came from (for a 401's message).
    authorization: Option<(String, TokenSource)>,
}

impl Client {
    pub(crate) fn new(target: &ApiTarget) -> Result<Self> {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(120)))
            .build()
            .into();
        let env_token = std::env::var(TOKEN_ENV).ok();
        let token = client_token(
            target.token_file.as_deref(),
            env_token.as_deref(),
            Path::new(DEFAULT_DATA_DIR),
        )?;
        Ok(Client {
            agent,
            base: target.server.trim_end_matches('/').to_string(),
            authorization: token
                .map(|(token, source)| (format!("Bearer {}", token.as_str()), source)),
        })
    }

    fn with_token<B>(&self, request: ureq::RequestBuilder<B>) -> ureq::RequestBuilder<B> {
        match &self.authorization {
            Some((value, _)) => request.header("Authorization", value),
            None => request,
        }
    }

    /// The one line a 401 gets: how to pass the token, or which one was refused.
    fn unauthorized(&self) -> anyhow::Error {
        match &self.authorization {
            None => anyhow!(
                "the node at {} requires an API token: pass --api-token-file PATH (e.g. the \
                 node's DATA_DIR/{TOKEN_FILE_NAME}) or set {TOKEN_ENV}",
                self.base
            ),
            Some((_, source)) => anyhow!(
                "the node at {} refused the API token from {source}: pass the node's token \
                 with --api-token-file PATH or {TOKEN_ENV}",
                self.base
            ),
        }
    }

    pub(crate) fn request(&self, method: &str, path: &str, body: Option<Value>) -> Result<Value> {
        let url = format!("{}{}", self.base, path);
        let result = match (method, body) {
            ("GET", _) => self.with_token(self.agent.get(&url)).call(),
            ("DELETE", _) => self.with_token(self.agent.delete(&url)).call(),
            ("POST", Some(body)) => self.with_token(self.agent.post(&url)).send_json(&body),
            ("PATCH", Some(body)) => self.with_token(self.agent.patch(&url)).send_json(&body),
            _ => bail!("internal error: bad request {method} {path}"),
        };
        let mut response = result.map_err(|e| {
            anyhow!("cannot reach the Ashlar node at {} ({e}); is `ashlar node` running? (set --server or ASHLAR_SERVER)", self.base)
        })?;
        let status = response.status();
        if status == ureq::http::StatusCode::UNAUTHORIZED {
            return Err(self.unauthorized());
        }
        let text = response
            .body_mut()
            .read_to_string()
            .context("reading the node's answer")?;
        let value: Value = if text.trim().is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text)
                .with_context(|| format!("the node answered {status} with non-JSON: {text}"))?
        };
        if !status.is_success() {
            let message = value.get("error").and_then(Value::as_str).unwrap_or(&text);
            bail!("{message}");
        }
        Ok(value)
    }
}

fn parse_size_arg(text: &str) -> Result<u64> {
    parse_size(text).map_err(|e| anyhow!("--size: {e}"))
}

pub fn run(target: &ApiTarget, command: VdiskCommand) -> Result<()> {
    let client = Client::new(target)?;
    match command {
        VdiskCommand::Create {
            name,
            size,
            shards,
            rf,
        } => {
            let size_bytes = parse_size_arg(&size)?;
            let body = json!({"name": name, "size_bytes": size_bytes, "shards": shards,
                "replication_factor": rf});
            let vdisk = client.request("POST", "/api/v1/vdisks", Some(body))?;
            println!(
                "created vdisk {} ({}, {} shards, rf {})",
                name,
                format_size(size_bytes),
                vdisk["shards"],
                vdisk["replication_factor"]
            );
        }
        VdiskCommand::List { json } => {
            let vdisks = client.request("GET", "/api/v1/vdisks", None)?;
            print_json_or(&vdisks, json, print_table)?;
        }
        VdiskCommand::Show { name, json } => {
            let vdisk = client.request("GET", &format!("/api/v1/vdisks/{name}"), None)?;
            print_json_or(&vdisk, json, print_details)?;
        }
        VdiskCommand::Resize {
            name,
            size,
            allow_shrink,
        } => {
            let size_bytes = parse_size_arg(&size)?;
            client.request(
                "PATCH",
                &format!("/api/v1/vdisks/{name}"),
                Some(json!({"size_bytes": size_bytes, "allow_shrink": allow_shrink})),
            )?;
            println!("resized vdisk {name} to {}", format_size(size_bytes));
        }
        VdiskCommand::Set { name, shards } => {
            client.request(
                "PATCH",
                &format!("/api/v1/vdisks/{name}"),
                Some(json!({"shards": shards})),
            )?;
            println!("vdisk {name} now has {shards} shards");
        }
        VdiskCommand::Delete { name, force } => {
            client.request(
                "DELETE",
                &format!("/api/v1/vdisks/{name}?force={force}"),
                None,
            )?;
            println!("deleted vdisk {name}");
        }
    }
    Ok(())
}

/// Prints the node's answer as JSON when asked to, else as text for people.
pub(crate) fn print_json_or(value: &Value, json: bool, print_text: fn(&Value)) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(value)?);
    } else {
        print_text(value);
    }
    Ok(())
}

/// `ashlar node list` (the cluster's nodes as the node at `--server` sees them) and
/// `ashlar node drain`.
pub fn run_node(target: &ApiTarget, action: NodeAction) -> Result<()> {
    match action {
        NodeAction::List { json } => {
            let client = Client::new(target)?;
            let nodes = client.request("GET", "/api/v1/nodes", None)?;
            print_json_or(&nodes, json, print_nodes)?;
        }
        NodeAction::Drain {
            node,
            cancel,
            no_wait,
            timeout_s,
        } => crate::drain::run_cli(
            target,
            &node,
            cancel,
            no_wait,
            std::time::Duration::from_secs(timeout_s),
        )?,
    }
    Ok(())
}

/// Disk space rounded to one decimal in the largest fitting binary unit (`251.9G`): exact
/// sizes (`format_size`) of real filesystems are unreadable.
pub(crate) fn approximate_size(bytes: u64) -> String {
    const UNITS: [(u32, &str); 5] = [(50, "P"), (40, "T"), (30, "G"), (20, "M"), (10, "K")];
    UNITS
        .iter()
        .find(|(shift, _)| bytes >= 1u64 << shift)
        .map_or(bytes.to_string(), |(shift, name)| {
            format!("{:.1}{name}", bytes as f64 / (1u64 << shift) as f64)
        })
}

fn bytes_of(value: &Value, field: &str) -> String {
    value[field]
        .as_u64()
        .map(approximate_size)
        .unwrap_or_default()
}

fn print_nodes(nodes: &Value) {
    println!(
        "{:<32} {:<22} {:<5} {:<12} {:>5} {:>10} {:>10} {:>6}",
        "ID", "ADDRESS", "STATE", "STORAGE-ONLY", "DISKS", "CAPACITY", "FREE", "VDISKS"
    );
    for node in nodes.as_array().into_iter().flatten() {
        // The node answering marks itself, so an operator knows which one `--server` reached.
        let mut local = if node["local"].as_bool() == Some(true) {
            " (this node)".to_string()
        } else {
            String::new()
        };
        if node["draining"].as_bool() == Some(true) {
            local.push_str(" (draining)");
        }
        println!(
            "{:<32} {:<22} {:<5} {:<12} {:>5} {:>10} {:>10} {:>6}{local}",
            node["node_id"].as_str().unwrap_or(""),
            node["addresses"]["http"].as_str().unwrap_or(""),
            node["state"].as_str().unwrap_or(""),
            if node["storage_only"].as_bool() == Some(true) {
                "yes"
            } else {
                "no"
            },
            node["disks"].as_array().map_or(0, Vec::len),
            bytes_of(node, "capacity_bytes"),
            bytes_of(node, "free_bytes"),
            node["vdisks_owned"].to_string(),
        );
    }
}

fn size_of(vdisk: &Value) -> String {
    vdisk["size_bytes"]
        .as_u64()
        .map(format_size)
        .unwrap_or_default()
}

fn print_table(vdisks: &Value) {
    let list = vdisks.as_array().map(Vec::as_slice).unwrap_or_default();
    // A node in a cluster reports each vdisk's ownership: then the table shows who serves it.
    let clustered = list.iter().any(|vdisk| vdisk["ownership"].is_object());
    let ownership_header = if clustered {
        format!(" {:<32} {:>5}", "OWNER", "EPOCH")
    } else {
        String::new()
    };
    println!(
        "{:<24} {:>10} {:>6} {:>3} {:>11} {:<8}{ownership_header}",
        "NAME", "SIZE", "SHARDS", "RF", "CONNECTIONS", "STATE"
    );
    for vdisk in list {
        let ownership = if clustered {
            let (owner, epoch) = owner_and_epoch(&vdisk["ownership"]);
            format!(" {owner:<32} {epoch:>5}")
        } else {
            String::new()
        };
        println!(
            "{:<24} {:>10} {:>6} {:>3} {:>11} {:<8}{ownership}",
            vdisk["name"].as_str().unwrap_or(""),
            size_of(vdisk),
            vdisk["shards"].to_string(),
            vdisk["replication_factor"].to_string(),
            vdisk["connections"].to_string(),
            vdisk["state"].as_str().unwrap_or("")
        );
    }
}

/// The owning node (`-` when nobody holds the vdisk) and the epoch of its claim (`-` when
/// unowned: the last epoch granted is in `vdisk show`).
fn owner_and_epoch(ownership: &Value) -> (String, String) {
    let owner = ownership["owner"].as_str().unwrap_or("-").to_string();
    let epoch = ownership["owner_epoch"]
        .as_u64()
        .map_or_else(|| "-".to_string(), |epoch| epoch.to_string());
    (owner, epoch)
}

fn print_details(vdisk: &Value) {
    let name = vdisk["name"].as_str().unwrap_or("");
    println!("name:         {name}");
    println!("id:           {}", vdisk["id"]);
    println!(
        "size:         {} ({} bytes)",
        size_of(vdisk),
        vdisk["size_bytes"]
    );
    println!("shards:       {}", vdisk["shards"]);
    println!("rf:           {}", vdisk["replication_factor"]);
    println!("block size:   {}", vdisk["block_size_bytes"]);
    println!("connections:  {}", vdisk["connections"]);
    println!("state:        {}", vdisk["state"].as_str().unwrap_or(""));
    if let Some(status) = vdisk["status"].as_str() {
        println!("status:       {status}");
    }
    if let Some(uri) = vdisk["nbd_uri"].as_str() {
        println!("nbd:          {uri}");
    }
    let ownership = &vdisk["ownership"];
    if ownership.is_object() {
        let (owner, epoch) = owner_and_epoch(ownership);
        println!("owner:        {owner} (epoch {epoch})");
        println!(
            "last owner:   {} (highest epoch granted {})",
            ownership["last_owner"].as_str().unwrap_or("-"),
            ownership["epoch"]
        );
    }
}

#[cfg(test)]
mod tests {
    use super::approximate_size;

    #[test]
    fn sizes_are_rounded_to_one_decimal() {
        assert_eq!(approximate_size(512), "512");
        assert_eq!(approximate_size(1536), "1.5K");
        assert_eq!(approximate_size(270_553_174_016), "252.0G");
        assert_eq!(approximate_size(3 << 40), "3.0T");
    }
}

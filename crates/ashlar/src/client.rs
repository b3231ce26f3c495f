//! The CLI side of `ashlar vdisk ...`: one HTTP request to the node, one line of output or a
//! table, one clear line on error.

use crate::args::VdiskCommand;
use anyhow::{anyhow, bail, Context, Result};
use ashlar_core::{format_size, parse_size};
use serde_json::{json, Value};
use std::time::Duration;

pub(crate) struct Client {
    agent: ureq::Agent,
    base: String,
}

impl Client {
    pub(crate) fn new(server: &str) -> Self {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(120)))
            .build()
            .into();
        Client {
            agent,
            base: server.trim_end_matches('/').to_string(),
        }
    }

    pub(crate) fn request(&self, method: &str, path: &str, body: Option<Value>) -> Result<Value> {
        let url = format!("{}{}", self.base, path);
        let result = match (method, body) {
            ("GET", _) => self.agent.get(&url).call(),
            ("DELETE", _) => self.agent.delete(&url).call(),
            ("POST", Some(body)) => self.agent.post(&url).send_json(&body),
            ("PATCH", Some(body)) => self.agent.patch(&url).send_json(&body),
            _ => bail!("internal error: bad request {method} {path}"),
        };
        let mut response = result.map_err(|e| {
            anyhow!("cannot reach the Ashlar node at {} ({e}); is `ashlar node` running? (set --server or ASHLAR_SERVER)", self.base)
        })?;
        let status = response.status();
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

pub fn run(server: &str, command: VdiskCommand) -> Result<()> {
    let client = Client::new(server);
    match command {
        VdiskCommand::Create { name, size, shards } => {
            let size_bytes = parse_size_arg(&size)?;
            let vdisk = client.request(
                "POST",
                "/api/v1/vdisks",
                Some(json!({"name": name, "size_bytes": size_bytes, "shards": shards})),
            )?;
            println!(
                "created vdisk {} ({}, {} shards)",
                name,
                format_size(size_bytes),
                vdisk["shards"]
            );
        }
        VdiskCommand::List { json } => {
            let vdisks = client.request("GET", "/api/v1/vdisks", None)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&vdisks)?);
            } else {
                print_table(&vdisks);
            }
        }
        VdiskCommand::Show { name, json } => {
            let vdisk = client.request("GET", &format!("/api/v1/vdisks/{name}"), None)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&vdisk)?);
            } else {
                print_details(&vdisk);
            }
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

fn size_of(vdisk: &Value) -> String {
    vdisk["size_bytes"]
        .as_u64()
        .map(format_size)
        .unwrap_or_default()
}

fn print_table(vdisks: &Value) {
    println!(
        "{:<24} {:>10} {:>6} {:>3} {:>11} {:<8}",
        "NAME", "SIZE", "SHARDS", "RF", "CONNECTIONS", "STATE"
    );
    for vdisk in vdisks.as_array().into_iter().flatten() {
        println!(
            "{:<24} {:>10} {:>6} {:>3} {:>11} {:<8}",
            vdisk["name"].as_str().unwrap_or(""),
            size_of(vdisk),
            vdisk["shards"].to_string(),
            vdisk["replication_factor"].to_string(),
            vdisk["connections"].to_string(),
            vdisk["state"].as_str().unwrap_or("")
        );
    }
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
}

//! `ashlar cluster status`: the report of `GET /api/v1/cluster`.

use crate::args::ClusterCommand;
use crate::client::{approximate_size, print_json_or, ApiTarget, Client};
use anyhow::Result;
use serde_json::Value;

pub fn run(target: &ApiTarget, command: ClusterCommand) -> Result<()> {
    let client = Client::new(target)?;
    match command {
        ClusterCommand::Status { json } => {
            let status = client.request("GET", "/api/v1/cluster", None)?;
            print_json_or(&status, json, print_status)?;
        }
    }
    Ok(())
}

fn count(value: &Value, field: &str) -> u64 {
    value[field].as_u64().unwrap_or(0)
}

fn print_status(status: &Value) {
    println!(
        "nodes: {} up, {} down",
        count(status, "nodes_up"),
        count(status, "nodes_down")
    );
    let tolerance = match status["fault_tolerance"].as_u64() {
        Some(n) => format!("{n} node failure(s)"),
        None => "no data yet".into(),
    };
    println!(
        "vdisks: {} under-replicated, {} rebuilding, {} unavailable; fault tolerance: {tolerance}",
        count(status, "under_replicated"),
        count(status, "rebuilding"),
        count(status, "unavailable")
    );
    println!(
        "\n{:<24} {:>2} {:<17} {:>6} {:<32}",
        "VDISK", "RF", "HEALTH", "COPIES", "OWNER"
    );
    for vdisk in status["vdisks"].as_array().into_iter().flatten() {
        let copies = vdisk["copies"].as_array().map_or(0, Vec::len);
        println!(
            "{:<24} {:>2} {:<17} {:>6} {:<32}",
            vdisk["name"].as_str().unwrap_or("?"),
            count(vdisk, "replication_factor"),
            vdisk["health"].as_str().unwrap_or("?"),
            format!("{}/{}", count(vdisk, "copies_up"), copies),
            vdisk["owner"].as_str().unwrap_or("-"),
        );
        if let Some(resync) = vdisk.get("resync") {
            let eta = match resync["eta_seconds"].as_u64() {
                Some(seconds) => format!("{seconds} s left"),
                None => "starting".into(),
            };
            println!(
                "    rebuilding: {} of {} at {}/s, {eta}",
                approximate_size(count(resync, "done_bytes")),
                approximate_size(count(resync, "total_bytes")),
                approximate_size(count(resync, "rate_bytes_per_second")),
            );
        }
    }
}

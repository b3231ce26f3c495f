//! The CLI side of `ashlar vg ...`: one HTTP request to the node per command.

use crate::args_vg::VgCommand;
use crate::client::{ApiTarget, Client};
use anyhow::{anyhow, Result};
use serde_json::{json, Value};

/// Splits `USER:SECRET` (the secret may contain ':').
fn parse_chap(flag: &str, text: &str) -> Result<Value> {
    let (user, secret) = text
        .split_once(':')
        .ok_or_else(|| anyhow!("{flag}: expected USER:SECRET"))?;
    Ok(json!({"user": user, "secret": secret}))
}

/// Escapes a path segment (initiator names contain ':').
fn segment(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (b as char).to_string()
            }
            other => format!("%{other:02X}"),
        })
        .collect()
}

pub fn run(target: &ApiTarget, command: VgCommand) -> Result<()> {
    let client = Client::new(target)?;
    let base = "/api/v1/volume-groups";
    match command {
        VgCommand::Create { name } => {
            let group = client.request("POST", base, Some(json!({"name": name})))?;
            println!(
                "created volume group {name} (target {})",
                group["iqn"].as_str().unwrap_or("")
            );
        }
        VgCommand::AddDisk { name, vdisk } => {
            let group = client.request(
                "POST",
                &format!("{base}/{}/disks", segment(&name)),
                Some(json!({"vdisk": vdisk})),
            )?;
            let lun = group["disks"]
                .as_array()
                .map_or(0, |d| d.len())
                .saturating_sub(1);
            println!("added vdisk {vdisk} to volume group {name} as LUN {lun}");
        }
        VgCommand::RemoveDisk { name, vdisk } => {
            client.request(
                "DELETE",
                &format!("{base}/{}/disks/{}", segment(&name), segment(&vdisk)),
                None,
            )?;
            println!("removed vdisk {vdisk} from volume group {name}");
        }
        VgCommand::Attach {
            name,
            initiator,
            chap,
            mutual_chap,
        } => {
            let mut body = json!({"initiator": initiator});
            if let Some(chap) = chap {
                body["chap"] = parse_chap("--chap", &chap)?;
            }
            if let Some(mutual) = mutual_chap {
                body["mutual_chap"] = parse_chap("--mutual-chap", &mutual)?;
            }
            client.request(
                "POST",
                &format!("{base}/{}/attachments", segment(&name)),
                Some(body),
            )?;
            println!("attached initiator {initiator} to volume group {name}");
        }
        VgCommand::Detach { name, initiator } => {
            client.request(
                "DELETE",
                &format!(
                    "{base}/{}/attachments/{}",
                    segment(&name),
                    segment(&initiator)
                ),
                None,
            )?;
            println!("detached initiator {initiator} from volume group {name}");
        }
        VgCommand::Show { name, json } => {
            let group = client.request("GET", &format!("{base}/{}", segment(&name)), None)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&group)?);
            } else {
                print_details(&group);
            }
        }
        VgCommand::List { json } => {
            let groups = client.request("GET", base, None)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&groups)?);
            } else {
                println!("{:<24} {:>5} {:>11} TARGET", "NAME", "LUNS", "INITIATORS");
                for group in groups.as_array().into_iter().flatten() {
                    println!(
                        "{:<24} {:>5} {:>11} {}",
                        group["name"].as_str().unwrap_or(""),
                        group["disks"].as_array().map_or(0, |d| d.len()),
                        group["attachments"].as_array().map_or(0, |a| a.len()),
                        group["iqn"].as_str().unwrap_or("")
                    );
                }
            }
        }
        VgCommand::Delete { name } => {
            client.request("DELETE", &format!("{base}/{}", segment(&name)), None)?;
            println!("deleted volume group {name}");
        }
        VgCommand::DiscoveryAuth {
            chap,
            mutual_chap,
            off,
        } => discovery_auth(&client, chap, mutual_chap, off)?,
    }
    Ok(())
}

/// `vg discovery-auth`: sets (with --chap or --off) or shows the discovery authentication.
fn discovery_auth(
    client: &Client,
    chap: Option<String>,
    mutual_chap: Option<String>,
    off: bool,
) -> Result<()> {
    let path = "/api/v1/iscsi/discovery-auth";
    let shown = if off || chap.is_some() {
        let mut body = json!({});
        if let Some(chap) = chap {
            body["chap"] = parse_chap("--chap", &chap)?;
        }
        if let Some(mutual) = mutual_chap {
            body["mutual_chap"] = parse_chap("--mutual-chap", &mutual)?;
        }
        client.request("POST", path, Some(body))?
    } else {
        client.request("GET", path, None)?
    };
    match shown["chap_user"].as_str() {
        None => println!("discovery: open (no CHAP)"),
        Some(user) => match shown["mutual_chap_user"].as_str() {
            None => println!("discovery: CHAP user {user}"),
            Some(mutual) => println!("discovery: CHAP user {user}, mutual CHAP user {mutual}"),
        },
    }
    Ok(())
}

fn print_details(group: &Value) {
    println!("name:     {}", group["name"].as_str().unwrap_or(""));
    println!("target:   {}", group["iqn"].as_str().unwrap_or(""));
    println!("portal:   {}", group["portal"].as_str().unwrap_or(""));
    for (lun, disk) in group["disks"].as_array().into_iter().flatten().enumerate() {
        println!("lun {lun}:    {}", disk.as_str().unwrap_or(""));
    }
    for attachment in group["attachments"].as_array().into_iter().flatten() {
        let mut auth = String::new();
        if let Some(user) = attachment["chap_user"].as_str() {
            auth.push_str(&format!(" (CHAP user {user}"));
            if let Some(mutual) = attachment["mutual_chap_user"].as_str() {
                auth.push_str(&format!(", mutual CHAP user {mutual}"));
            }
            auth.push(')');
        }
        println!(
            "initiator: {}{auth}",
            attachment["initiator"].as_str().unwrap_or("")
        );
    }
}

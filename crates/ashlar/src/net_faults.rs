//! `--test-net-faults FILE` (hidden; tests only): faults this node injects into the
//! node-to-node connections it opens, read from a file the test rewrites (this machine's
//! kernel has no netem). One line per peer node-to-node address:
//!
//! ```text
//! 127.0.0.1:4011 delay_ms=20 jitter_ms=5 loss_ppm=1000 cut=1
//! ```
//!
//! Every key is optional; a peer not named has no faults; `#` starts a comment. The file is
//! read again every [`RELOAD_INTERVAL`]; a line that does not parse keeps the last good
//! table (logged once per change of the file).

use ashlar_transport::{LinkFaults, OutgoingFaults};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

pub const RELOAD_INTERVAL: Duration = Duration::from_millis(100);

/// The faults the file's `text` names, per peer address.
pub fn parse(text: &str) -> Result<HashMap<SocketAddr, LinkFaults>, String> {
    let mut links = HashMap::new();
    for (number, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let bad = |what: String| format!("line {}: {what}", number + 1);
        let mut words = line.split_whitespace();
        let address = words.next().unwrap_or("");
        let address: SocketAddr = address
            .parse()
            .map_err(|_| bad(format!("'{address}' is not an address:port")))?;
        let mut faults = LinkFaults::default();
        for word in words {
            let (key, value) = word
                .split_once('=')
                .ok_or_else(|| bad(format!("'{word}' is not key=value")))?;
            let number: u64 = value
                .parse()
                .map_err(|_| bad(format!("'{value}' is not a number")))?;
            match key {
                "delay_ms" => faults.delay = Duration::from_millis(number),
                "jitter_ms" => faults.jitter = Duration::from_millis(number),
                "loss_ppm" if number <= 1_000_000 => faults.loss_per_million = number as u32,
                "cut" if number <= 1 => faults.cut = number == 1,
                _ => return Err(bad(format!("unknown key or value '{word}'"))),
            }
        }
        links.insert(address, faults);
    }
    Ok(links)
}

/// Keeps `faults` as `file` says, for as long as the node runs.
pub fn follow(file: PathBuf, faults: OutgoingFaults) {
    tokio::spawn(async move {
        let mut last: Option<String> = None;
        loop {
            let text = std::fs::read_to_string(&file).unwrap_or_default();
            if last.as_deref() != Some(text.as_str()) {
                match parse(&text) {
                    Ok(links) => {
                        tracing::warn!(file = %file.display(), links = links.len(),
                            "test network faults applied to this node's outgoing node-to-node connections");
                        faults.set_all(links);
                    }
                    Err(error) => {
                        tracing::warn!(file = %file.display(), %error, "test network faults not applied")
                    }
                }
                last = Some(text);
            }
            tokio::time::sleep(RELOAD_INTERVAL).await;
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_name_each_peers_faults_and_bad_ones_are_refused() {
        let links = parse(
            "# a comment\n127.0.0.1:4011 delay_ms=20 jitter_ms=5 loss_ppm=1000\n\n10.0.0.2:7 cut=1\n",
        )
        .unwrap();
        let first = links[&"127.0.0.1:4011".parse().unwrap()];
        assert_eq!(first.delay, Duration::from_millis(20));
        assert_eq!(first.jitter, Duration::from_millis(5));
        assert_eq!(first.loss_per_million, 1000);
        assert!(!first.cut);
        assert!(links[&"10.0.0.2:7".parse().unwrap()].cut);
        assert!(parse("").unwrap().is_empty());
        for bad in [
            "localhost delay_ms=1",
            "127.0.0.1:1 delay=1",
            "127.0.0.1:1 cut=2",
            "127.0.0.1:1 loss_ppm=x",
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }
}

//! Throwaway etcd members for tests: Debian's `etcd` binary on free loopback
//! ports, each with a temporary data directory, killed when dropped.

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use tempfile::TempDir;

pub struct EtcdServer {
    child: Child,
    /// The client URL, `http://127.0.0.1:PORT`.
    pub url: String,
    _dir: TempDir,
}

/// What etcd 3.4 logs once its client port serves requests.
const READY: &str = "ready to serve client requests";

fn etcd_binary() -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join("etcd"))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "the etcd binary is not on PATH: these tests need a real etcd; \
                 install Debian's etcd-server package (apt-get install etcd-server)"
            )
        })
}

/// A port nobody listens on right now (the OS picks it).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind an ephemeral port")
        .port()
}

/// A spawned member whose log is being read for the ready line.
struct Starting {
    child: Child,
    url: String,
    dir: TempDir,
    /// `Ok` once ready, `Err(log)` if etcd exited first.
    ready: mpsc::Receiver<Result<(), String>>,
}

fn spawn_member(bin: &Path, name: &str, client: String, peer: &str, cluster: &str) -> Starting {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut child = Command::new(bin)
        .arg(format!("--name={name}"))
        .arg(format!("--data-dir={}", dir.path().join("data").display()))
        .arg(format!("--listen-client-urls={client}"))
        .arg(format!("--advertise-client-urls={client}"))
        .arg(format!("--listen-peer-urls={peer}"))
        .arg(format!("--initial-advertise-peer-urls={peer}"))
        .arg(format!("--initial-cluster={cluster}"))
        .arg("--heartbeat-interval=10")
        .arg("--election-timeout=100")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("start {}: {e}", bin.display()));
    let stderr = child.stderr.take().expect("piped stderr");
    let (tx, ready) = mpsc::channel();
    // Keeps draining the pipe after the ready line, so etcd never blocks on
    // a full pipe.
    std::thread::spawn(move || {
        let mut log = String::new();
        let mut waiting = Some(tx.clone());
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if waiting.is_some() {
                log.push_str(&line);
                log.push('\n');
            }
            if line.contains(READY) {
                if let Some(tx) = waiting.take() {
                    let _ = tx.send(Ok(()));
                }
            }
        }
        let _ = tx.send(Err(log));
    });
    Starting {
        child,
        url: client,
        dir,
        ready,
    }
}

impl EtcdServer {
    /// The etcd process id (tests freeze it with SIGSTOP to cut every node off at once).
    #[allow(dead_code)]
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Start a one-member etcd and return once it serves clients.
    pub fn start() -> Self {
        Self::start_cluster(1).pop().expect("one member")
    }

    /// Start a one-member etcd serving clients on `client_port`, for a test that must name
    /// etcd's address before etcd runs (a node started first). Panics if it does not start.
    pub fn start_on_port(client_port: u16) -> Self {
        let bin = etcd_binary();
        let peer = format!("http://127.0.0.1:{}", free_port());
        let client = format!("http://127.0.0.1:{client_port}");
        let starting = spawn_member(&bin, "m0", client, &peer, &format!("m0={peer}"));
        // Owned before waiting, so the process is killed if it does not become ready.
        let server = EtcdServer {
            child: starting.child,
            url: starting.url,
            _dir: starting.dir,
        };
        match starting.ready.recv_timeout(Duration::from_secs(30)) {
            Ok(Ok(())) => server,
            Ok(Err(log)) => panic!("etcd did not start on port {client_port}:\n{log}"),
            Err(_) => panic!("etcd on port {client_port}: no {READY:?} within 30 s"),
        }
    }

    /// Start an etcd cluster of `n` members and return once all serve
    /// clients. A short election timeout makes a leader emerge at once and
    /// lowers the minimum lease TTL to 1 s.
    pub fn start_cluster(n: usize) -> Vec<Self> {
        let bin = etcd_binary();
        let mut last_log = String::new();
        // Another process may take a port between our probe and etcd's bind.
        for _ in 0..5 {
            let ports: Vec<(String, String)> = (0..n)
                .map(|_| {
                    (
                        format!("http://127.0.0.1:{}", free_port()),
                        format!("http://127.0.0.1:{}", free_port()),
                    )
                })
                .collect();
            let cluster = ports
                .iter()
                .enumerate()
                .map(|(i, (_, peer))| format!("m{i}={peer}"))
                .collect::<Vec<_>>()
                .join(",");
            let starting: Vec<Starting> = ports
                .into_iter()
                .enumerate()
                .map(|(i, (client, peer))| {
                    spawn_member(&bin, &format!("m{i}"), client, &peer, &cluster)
                })
                .collect();
            let mut members = Vec::new();
            let mut failure = None;
            for s in starting {
                match s.ready.recv_timeout(Duration::from_secs(30)) {
                    Ok(Ok(())) => {}
                    Ok(Err(log)) => failure = failure.or(Some(log)),
                    Err(_) => failure = failure.or(Some(format!("no {READY:?} within 30 s"))),
                }
                members.push(EtcdServer {
                    child: s.child,
                    url: s.url,
                    _dir: s.dir,
                });
            }
            match failure {
                None => return members,
                Some(log) => {
                    drop(members);
                    last_log = log;
                    if !last_log.contains("address already in use") {
                        panic!("etcd did not start:\n{last_log}");
                    }
                }
            }
        }
        panic!("etcd could not bind free ports in 5 tries:\n{last_log}");
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

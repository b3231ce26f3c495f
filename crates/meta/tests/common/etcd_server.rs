//! A throwaway etcd for tests: Debian's `etcd` binary on free loopback
//! ports with a temporary data directory, killed when dropped.

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::PathBuf;
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

impl EtcdServer {
    /// Start etcd and return once it serves clients. A short election timeout
    /// makes it elect itself at once and lowers its minimum lease TTL to 1 s.
    pub fn start() -> Self {
        let bin = etcd_binary();
        let mut last_log = String::new();
        // Another process may take a port between our probe and etcd's bind.
        for _ in 0..5 {
            let dir = tempfile::tempdir().expect("tempdir");
            let client = format!("http://127.0.0.1:{}", free_port());
            let peer = format!("http://127.0.0.1:{}", free_port());
            let mut child = Command::new(&bin)
                .arg("--name=test")
                .arg(format!("--data-dir={}", dir.path().join("data").display()))
                .arg(format!("--listen-client-urls={client}"))
                .arg(format!("--advertise-client-urls={client}"))
                .arg(format!("--listen-peer-urls={peer}"))
                .arg(format!("--initial-advertise-peer-urls={peer}"))
                .arg(format!("--initial-cluster=test={peer}"))
                .arg("--heartbeat-interval=10")
                .arg("--election-timeout=100")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap_or_else(|e| panic!("start {}: {e}", bin.display()));
            let stderr = child.stderr.take().expect("piped stderr");
            let (tx, rx) = mpsc::channel();
            // Keeps draining the pipe after the ready line, so etcd never
            // blocks on a full pipe.
            std::thread::spawn(move || {
                let mut log = String::new();
                let mut ready = Some(tx.clone());
                for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                    if ready.is_some() {
                        log.push_str(&line);
                        log.push('\n');
                    }
                    if line.contains(READY) {
                        if let Some(tx) = ready.take() {
                            let _ = tx.send(Ok(()));
                        }
                    }
                }
                let _ = tx.send(Err(log));
            });
            match rx.recv_timeout(Duration::from_secs(30)) {
                Ok(Ok(())) => {
                    return EtcdServer {
                        child,
                        url: client,
                        _dir: dir,
                    }
                }
                Ok(Err(log)) => {
                    let _ = child.wait();
                    last_log = log;
                    if last_log.contains("address already in use") {
                        continue;
                    }
                    panic!("etcd exited before serving clients:\n{last_log}");
                }
                Err(_) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    panic!("etcd did not report {READY:?} within 30 s");
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

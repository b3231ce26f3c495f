//! `Cluster`: a one-member etcd and N `ashlar node` processes, each in a network namespace of
//! its own (a `NetLab` host) with its own address, for multi-host tests on one machine.
//!
//! Host 0 of the lab runs etcd (client port 2379); node `i` (0-based) runs in host `i + 1`
//! with `--etcd http://<etcd ip>:2379 --advertise <its ip>` and NBD, HTTP and iSCSI on its own
//! address (ports 10809, 10810, 3260, the product defaults, since every host has its own
//! address). The test process reaches all of them through the lab's bridge.
//!
//! The nodes listen beyond loopback, so their API requires a token: every node gets the same
//! one (`--api-token-file <temp dir>/api-token`), which `cli` and `try_nodes` send.
//!
//! Each process's stdout and stderr go to `<temp dir>/<name>.log` (appended over restarts);
//! when a test panics the tail of every log is printed. Dropping the cluster kills everything
//! and removes the temporary directory; the lab then removes namespaces, veths and bridge.

// The lab and the verifying writer live beside this file (common/netns.rs, common/acked.rs);
// they are submodules so that common/mod.rs needs one line for all three.
#[path = "acked.rs"]
pub mod acked;
#[path = "netns.rs"]
pub mod netns;

use super::{ashlar, CmdOut, BIN};
use netns::NetLab;
use serde_json::Value;
use std::fs::OpenOptions;
use std::io::Write;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const ETCD_PORT: u16 = 2379;
pub const NBD_PORT: u16 = 10809;
pub const HTTP_PORT: u16 = 10810;
pub const ISCSI_PORT: u16 = 3260;
pub const NODE_PORT: u16 = 10811;

/// How long etcd or a node may take to serve after being started.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// What a cluster is made of.
#[derive(Clone, Debug)]
pub struct ClusterOptions {
    /// `ashlar node` processes (each in a namespace of its own).
    pub nodes: usize,
    /// `--node-lease-ttl-ms` of every node: a killed or cut-off node is listed down this long
    /// after its last keep-alive.
    pub lease_ttl_ms: u64,
    /// Extra `ashlar node` arguments of every node.
    pub node_args: Vec<String>,
    /// Nodes (0-based) started with `--storage-only`.
    pub storage_only: Vec<usize>,
}

impl Default for ClusterOptions {
    fn default() -> Self {
        ClusterOptions {
            nodes: 3,
            lease_ttl_ms: 3000,
            node_args: Vec::new(),
            storage_only: Vec::new(),
        }
    }
}

/// A process the cluster runs in a lab host: how to start it, its log, and the running child.
struct Service {
    name: String,
    host: usize,
    program: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
    log: PathBuf,
    child: Option<Child>,
    starts: u32,
}

impl Service {
    fn spawn(&mut self, lab: &NetLab) {
        assert!(self.child.is_none(), "{} is already running", self.name);
        self.starts += 1;
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap_or_else(|e| panic!("opening {}: {e}", self.log.display()));
        let _ = writeln!(
            &log,
            "----- test harness: start #{} of {} -----",
            self.starts, self.name
        );
        let mut command = Command::new(&self.program);
        for key in super::TOKEN_VARIABLES {
            command.env_remove(key);
        }
        command
            .args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .env_remove("ASHLAR_SERVER")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        self.child = Some(lab.run_in(self.host, command));
    }

    /// `Err(status)` if the process has exited.
    fn check_alive(&mut self) -> Result<(), String> {
        match self.child.as_mut().map(|c| c.try_wait()) {
            Some(Ok(None)) => Ok(()),
            Some(Ok(Some(status))) => {
                self.child = None;
                Err(format!("{} exited ({status})", self.name))
            }
            Some(Err(e)) => Err(format!("{}: {e}", self.name)),
            None => Err(format!("{} is not running", self.name)),
        }
    }

    fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn sigterm(&mut self, limit: Duration) -> std::process::ExitStatus {
        let mut child = self
            .child
            .take()
            .unwrap_or_else(|| panic!("{} is not running", self.name));
        unsafe {
            libc::kill(child.id() as i32, libc::SIGTERM);
        }
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("{} did not exit within {limit:?} of SIGTERM", self.name);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Polls `url` (from the test process) until it answers 200 with a body `ready` accepts;
    /// panics with the log's tail if the process exits first or `START_TIMEOUT` passes.
    fn wait_ready(&mut self, url: &str, ready: impl Fn(&str) -> bool) {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Err(e) = self.check_alive() {
                panic!("{e} while starting; its log:\n{}", self.tail(40));
            }
            if let Ok((200, body)) = http_get_url(url, 2) {
                if ready(&body) {
                    return;
                }
            }
            if Instant::now() > deadline {
                panic!(
                    "{}: {url} not ready within {START_TIMEOUT:?}; its log:\n{}",
                    self.name,
                    self.tail(40)
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The last `lines` lines of the log.
    fn tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }
}

pub struct Cluster {
    etcd: Service,
    nodes: Vec<Service>,
    options: ClusterOptions,
    /// Logs and the nodes' data directories; removed on drop.
    root: tempfile::TempDir,
    /// etcd's data directory, on tmpfs when there is one: etcd syncs every write, and a busy
    /// shared disk would otherwise stall it (and lease expiry) for many seconds.
    _etcd_dir: tempfile::TempDir,
    /// Declared last: dropped after the processes above are killed.
    lab: NetLab,
}

/// The API token every node of a test cluster requires (written to `<temp dir>/api-token`).
pub const API_TOKEN: &str = "ashlar-test-cluster-api-token-0123456789";

/// GET `url` from the test process, bounded to `secs`: (status, body).
pub fn http_get_url(url: &str, secs: u64) -> Result<(u16, String), String> {
    http_get_url_with(url, None, secs)
}

/// GET `url` with `Authorization: Bearer <token>` when a token is given.
pub fn http_get_url_with(
    url: &str,
    token: Option<&str>,
    secs: u64,
) -> Result<(u16, String), String> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(secs)))
        .build()
        .into();
    let mut request = agent.get(url);
    if let Some(token) = token {
        request = request.header("Authorization", format!("Bearer {token}"));
    }
    let mut response = request.call().map_err(|e| format!("GET {url}: {e}"))?;
    let status = response.status().as_u16();
    let body = response
        .body_mut()
        .read_to_string()
        .map_err(|e| format!("GET {url}: reading the body: {e}"))?;
    Ok((status, body))
}

impl Cluster {
    /// etcd and `nodes` nodes with the default options; returns once every node serves.
    pub fn start(nodes: usize) -> Cluster {
        Cluster::start_with(ClusterOptions {
            nodes,
            ..ClusterOptions::default()
        })
    }

    pub fn start_with(options: ClusterOptions) -> Cluster {
        assert!(options.nodes >= 1, "a cluster needs a node");
        let lab = NetLab::new(options.nodes + 1);
        let root = tempfile::Builder::new()
            .prefix("ashlar-cluster-")
            .tempdir()
            .expect("creating a temporary directory");
        let etcd_dir = tempfile::Builder::new()
            .prefix("ashlar-cluster-etcd-")
            .tempdir_in("/dev/shm")
            .or_else(|_| {
                tempfile::Builder::new()
                    .prefix("ashlar-cluster-etcd-")
                    .tempdir()
            })
            .expect("creating etcd's data directory");
        let etcd_ip = lab.ip(0);
        let client = format!("http://{etcd_ip}:{ETCD_PORT}");
        let peer = format!("http://{etcd_ip}:2380");
        let etcd_program = super::find_in_path("etcd").unwrap_or_else(|| {
            panic!("the etcd binary is not on PATH: install Debian's etcd-server package")
        });
        let etcd = Service {
            name: "etcd".into(),
            host: 0,
            program: etcd_program,
            args: vec![
                "--name=m0".into(),
                format!("--data-dir={}", etcd_dir.path().join("data").display()),
                format!("--listen-client-urls={client}"),
                format!("--advertise-client-urls={client}"),
                format!("--listen-peer-urls={peer}"),
                format!("--initial-advertise-peer-urls={peer}"),
                format!("--initial-cluster=m0={peer}"),
                // A leader at once, and a minimum lease TTL of 1 s.
                "--heartbeat-interval=10".into(),
                "--election-timeout=100".into(),
            ],
            env: Vec::new(),
            log: root.path().join("etcd.log"),
            child: None,
            starts: 0,
        };
        let rust_log = std::env::var("ASHLAR_TEST_RUST_LOG").unwrap_or_else(|_| "info".into());
        let token_file = write_api_token(root.path());
        let nodes = (0..options.nodes)
            .map(|i| {
                let ip = lab.ip(i + 1);
                let data_dir = root.path().join(format!("node{i}"));
                let mut args: Vec<String> = vec![
                    "node".into(),
                    "--data-dir".into(),
                    data_dir.display().to_string(),
                    "--etcd".into(),
                    client.clone(),
                    "--advertise".into(),
                    ip.to_string(),
                    "--nbd-listen".into(),
                    format!("{ip}:{NBD_PORT}"),
                    "--http-listen".into(),
                    format!("{ip}:{HTTP_PORT}"),
                    "--iscsi-listen".into(),
                    format!("{ip}:{ISCSI_PORT}"),
                    "--node-listen".into(),
                    format!("{ip}:{NODE_PORT}"),
                    "--node-lease-ttl-ms".into(),
                    options.lease_ttl_ms.to_string(),
                    "--api-token-file".into(),
                    token_file.display().to_string(),
                ];
                // Small, as in the single-node tests: several nodes share two cores.
                for (flag, value) in [
                    ("--reactors", "1"),
                    ("--cache-size", "32M"),
                    ("--oplog-size", "64M"),
                ] {
                    if !options.node_args.iter().any(|a| a == flag) {
                        args.extend([flag.to_string(), value.to_string()]);
                    }
                }
                if let Ok(mode) = std::env::var("ASHLAR_TEST_DIRECT_IO") {
                    if !options.node_args.iter().any(|a| a == "--direct-io") {
                        args.extend(["--direct-io".to_string(), mode]);
                    }
                }
                if options.storage_only.contains(&i) {
                    args.push("--storage-only".into());
                }
                args.extend(options.node_args.iter().cloned());
                Service {
                    name: format!("node{i}"),
                    host: i + 1,
                    program: PathBuf::from(BIN),
                    args,
                    env: vec![("RUST_LOG".into(), rust_log.clone())],
                    log: root.path().join(format!("node{i}.log")),
                    child: None,
                    starts: 0,
                }
            })
            .collect();
        let mut cluster = Cluster {
            etcd,
            nodes,
            options,
            root,
            _etcd_dir: etcd_dir,
            lab,
        };
        cluster.start_etcd();
        for i in 0..cluster.nodes.len() {
            cluster.nodes[i].spawn(&cluster.lab);
        }
        for i in 0..cluster.nodes.len() {
            cluster.wait_serving(i);
        }
        cluster
    }

    fn start_etcd(&mut self) {
        self.etcd.spawn(&self.lab);
        let url = format!("{}/health", self.etcd_url());
        self.etcd.wait_ready(&url, |body| body.contains("true"));
    }

    /// Waits until node `i` answers GET /healthz (it serves HTTP once registered in etcd).
    fn wait_serving(&mut self, i: usize) {
        let url = format!("{}/healthz", self.http(i));
        self.nodes[i].wait_ready(&url, |body| body.trim() == "ok");
    }

    pub fn lab(&self) -> &NetLab {
        &self.lab
    }

    pub fn options(&self) -> &ClusterOptions {
        &self.options
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// The lab host node `i` runs in.
    pub fn host_of(&self, i: usize) -> usize {
        self.nodes[i].host
    }

    pub fn ip(&self, i: usize) -> Ipv4Addr {
        self.lab.ip(self.nodes[i].host)
    }

    pub fn etcd_ip(&self) -> Ipv4Addr {
        self.lab.ip(0)
    }

    pub fn etcd_url(&self) -> String {
        format!("http://{}:{ETCD_PORT}", self.etcd_ip())
    }

    /// `http://<ip>:10810`, node `i`'s API (`--server` of the CLI).
    pub fn http(&self, i: usize) -> String {
        format!("http://{}:{HTTP_PORT}", self.ip(i))
    }

    pub fn nbd_addr(&self, i: usize) -> SocketAddr {
        SocketAddr::from((self.ip(i), NBD_PORT))
    }

    pub fn nbd_uri(&self, i: usize, vdisk: &str) -> String {
        format!("nbd://{}:{NBD_PORT}/{vdisk}", self.ip(i))
    }

    pub fn data_dir(&self, i: usize) -> PathBuf {
        self.root.path().join(format!("node{i}"))
    }

    pub fn log_path(&self, i: usize) -> &Path {
        &self.nodes[i].log
    }

    /// Everything node `i` printed (all starts).
    pub fn log(&self, i: usize) -> String {
        std::fs::read_to_string(&self.nodes[i].log).unwrap_or_default()
    }

    /// Node `i`'s id (`DATA_DIR/node-id`, created at its first start).
    pub fn node_id(&self, i: usize) -> String {
        super::read_node_id(&self.data_dir(i))
    }

    pub fn pid(&self, i: usize) -> u32 {
        self.pid_if_running(i)
            .unwrap_or_else(|| panic!("node {i} is not running"))
    }

    /// Node `i`'s pid, unless it was stopped through the cluster.
    pub fn pid_if_running(&self, i: usize) -> Option<u32> {
        self.nodes[i].child.as_ref().map(Child::id)
    }

    /// True while node `i`'s process runs.
    pub fn is_running(&mut self, i: usize) -> bool {
        self.nodes[i].check_alive().is_ok()
    }

    /// The file holding [`API_TOKEN`], which every node requires.
    pub fn api_token_file(&self) -> PathBuf {
        self.root.path().join(API_TOKEN_FILE)
    }

    /// `ashlar --server <node i> --api-token-file <the cluster's> args...`.
    pub fn cli(&self, i: usize, args: &[&str]) -> CmdOut {
        let server = self.http(i);
        let token_file = self.api_token_file().display().to_string();
        let mut all = vec![
            "--server",
            server.as_str(),
            "--api-token-file",
            token_file.as_str(),
        ];
        all.extend_from_slice(args);
        ashlar(&all)
    }

    pub fn create_vdisk(&self, i: usize, name: &str, size: &str) {
        self.cli(i, &["vdisk", "create", name, "--size", size])
            .assert_ok(&format!("vdisk create {name} on node {i}"));
    }

    /// GET /api/v1/nodes from node `asked`.
    pub fn try_nodes(&self, asked: usize) -> Result<Vec<Value>, String> {
        let url = format!("{}/api/v1/nodes", self.http(asked));
        match http_get_url_with(&url, Some(API_TOKEN), 5)? {
            (200, body) => match serde_json::from_str::<Value>(&body) {
                Ok(Value::Array(nodes)) => Ok(nodes),
                _ => Err(format!("GET {url}: not a JSON array: {body}")),
            },
            (status, body) => Err(format!("GET {url}: {status} {body}")),
        }
    }

    pub fn nodes_seen_by(&self, asked: usize) -> Vec<Value> {
        self.try_nodes(asked).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Node `i`'s entry in `nodes` (by node id).
    pub fn entry_of<'a>(&self, nodes: &'a [Value], i: usize) -> Option<&'a Value> {
        let id = self.node_id(i);
        nodes.iter().find(|n| n["node_id"] == id.as_str())
    }

    /// A node other than `except` that runs and is neither cut off nor blocked from etcd, to
    /// ask about the others.
    pub fn witness(&mut self, except: usize) -> usize {
        (0..self.nodes.len())
            .find(|&j| {
                let host = self.nodes[j].host;
                j != except
                    && self.is_running(j)
                    && self.lab.is_up(host)
                    && !self.lab.blocked_from(host).contains(&0)
            })
            .unwrap_or_else(|| panic!("no running, connected node besides node {except}"))
    }

    /// Polls GET /api/v1/nodes (on another running, connected node) every 100 ms until node
    /// `i` is listed in `state` ("up" or "down"); returns how long that took. Panics with the
    /// last answer after `limit`.
    pub fn wait_state(&mut self, i: usize, state: &str, limit: Duration) -> Duration {
        let asked = self.witness(i);
        let start = Instant::now();
        loop {
            let answer = self.try_nodes(asked);
            if let Ok(nodes) = &answer {
                if self.entry_of(nodes, i).is_some_and(|e| e["state"] == state) {
                    return start.elapsed();
                }
            }
            assert!(
                start.elapsed() < limit,
                "node {i} ({}) not listed {state} by node {asked} within {limit:?}: {answer:#?}",
                self.node_id(i)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// How long a lost node may take to be listed down: its lease TTL plus slack.
    pub fn down_limit(&self) -> Duration {
        Duration::from_millis(self.options.lease_ttl_ms) + Duration::from_secs(10)
    }

    pub fn wait_up(&mut self, i: usize) -> Duration {
        self.wait_state(i, "up", Duration::from_secs(30))
    }

    pub fn wait_down(&mut self, i: usize) -> Duration {
        let limit = self.down_limit();
        self.wait_state(i, "down", limit)
    }

    /// SIGKILL node `i` and reap it.
    pub fn kill9(&mut self, i: usize) {
        self.nodes[i].kill9();
    }

    /// SIGTERM node `i` and wait (up to 15 s) for its exit.
    pub fn stop(&mut self, i: usize) -> std::process::ExitStatus {
        self.nodes[i].sigterm(Duration::from_secs(15))
    }

    /// Starts the stopped node `i` again (same data directory, address and arguments) and
    /// returns once it serves.
    pub fn restart(&mut self, i: usize) {
        if self.nodes[i].check_alive().is_ok() {
            panic!("restart({i}) needs a stopped node: kill9 or stop it first");
        }
        self.nodes[i].spawn(&self.lab);
        self.wait_serving(i);
    }

    /// Takes node `i`'s host off the network (links down): it reaches neither etcd nor the
    /// other nodes, and the test process does not reach it.
    pub fn partition(&self, i: usize) {
        self.lab.cut(self.nodes[i].host);
    }

    /// Cuts node `i` off from etcd and from every other node, but not from the test process:
    /// clients in the test process still reach it (the old owner of a split brain).
    pub fn isolate(&self, i: usize) {
        let host = self.nodes[i].host;
        self.lab.block(host, 0);
        for other in &self.nodes {
            if other.host != host {
                self.lab.block(host, other.host);
            }
        }
    }

    /// Cuts node `i` off from etcd only.
    pub fn cut_from_etcd(&self, i: usize) {
        self.lab.block(self.nodes[i].host, 0);
    }

    /// Cuts nodes `i` and `j` off from each other only.
    pub fn cut_between(&self, i: usize, j: usize) {
        self.lab.block(self.nodes[i].host, self.nodes[j].host);
    }

    /// Undoes `partition`, `isolate`, `cut_from_etcd` and `cut_between` for node `i`.
    pub fn heal(&self, i: usize) {
        let host = self.nodes[i].host;
        self.lab.heal(host);
        self.lab.unblock_all(host);
    }

    pub fn kill9_etcd(&mut self) {
        self.etcd.kill9();
    }

    /// Starts etcd again on its data directory and waits until it is healthy.
    pub fn restart_etcd(&mut self) {
        self.start_etcd();
    }

    /// Prints the last `lines` lines of etcd's and every node's log to stderr.
    pub fn dump_logs(&self, lines: usize) {
        for service in std::iter::once(&self.etcd).chain(&self.nodes) {
            eprintln!(
                "===== {} ({}): last {lines} lines of {} =====\n{}",
                service.name,
                self.lab.host(service.host).ip,
                service.log.display(),
                service.tail(lines)
            );
        }
        eprintln!("===== end of cluster logs =====");
    }
}

const API_TOKEN_FILE: &str = "api-token";

/// Writes [`API_TOKEN`] to `dir/api-token` with mode 0600 (nodes refuse a file others can
/// read) and returns its path.
fn write_api_token(dir: &Path) -> PathBuf {
    use std::os::unix::fs::OpenOptionsExt;
    let path = dir.join(API_TOKEN_FILE);
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .unwrap_or_else(|e| panic!("creating {}: {e}", path.display()));
    writeln!(file, "{API_TOKEN}").unwrap();
    path
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            node.kill9();
        }
        self.etcd.kill9();
        if std::thread::panicking() {
            self.dump_logs(60);
        }
        // ASHLAR_TEST_KEEP_CLUSTER_LOGS=DIR keeps every log in DIR/<lab name prefix>/.
        if let Ok(dir) = std::env::var("ASHLAR_TEST_KEEP_CLUSTER_LOGS") {
            let to = Path::new(&dir).join(self.lab.name_prefix());
            let _ = std::fs::create_dir_all(&to);
            for service in std::iter::once(&self.etcd).chain(&self.nodes) {
                let _ = std::fs::copy(&service.log, to.join(format!("{}.log", service.name)));
            }
        }
    }
}

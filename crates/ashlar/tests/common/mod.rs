//! Harness of the end-to-end tests: a real `ashlar node` process on free loopback ports with a
//! temporary data directory, the CLI, a tiny HTTP client, bounded runs of external tools (fio,
//! nbdinfo, qemu-img, ...) and a hand-written NBD client (`nbd`).
//!
//! Every external command runs under `timeout`, every socket has a deadline, and a node is
//! SIGKILLed when its `Node` is dropped, so a failing test cannot hang the suite or leave a
//! process behind. When a test panics, the node's stderr log is printed.
//!
//! To diagnose a test: `ASHLAR_TEST_RUST_LOG` sets the node's `RUST_LOG` (default `info`), and
//! `ASHLAR_TEST_KEEP_LOG=FILE` copies the node's whole log to FILE when its `Node` is dropped.

#![allow(dead_code)]

pub mod cluster;
pub mod iscsi;
pub mod nbd;
pub mod writes;

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_ashlar");
pub const KIB: u64 = 1024;
pub const MIB: u64 = 1024 * 1024;
pub const GIB: u64 = 1024 * MIB;

/// How long a node may take to answer GET /healthz after it was started.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// A free TCP port on 127.0.0.1, chosen at random below the kernel's ephemeral range.
///
/// Not a port the kernel hands out (bind to port 0): a port from the ephemeral range can
/// become the source port of some outgoing connection while a test's node is down, and the
/// restarted node then cannot listen on it again (seen in CI: "Address already in use" on
/// each of three restarts).
pub fn free_port() -> u16 {
    let ephemeral_first = ephemeral_port_range_start();
    let first: u16 = 10_000;
    assert!(
        ephemeral_first > first + 1_000,
        "the ephemeral port range starts at {ephemeral_first}: too low to pick test ports below it"
    );
    for _ in 0..1_000 {
        let mut random = [0u8; 2];
        getrandom::fill(&mut random).expect("reading random bytes");
        let port = first + u16::from_le_bytes(random) % (ephemeral_first - first);
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port between {first} and {ephemeral_first} after 1,000 tries");
}

/// The first port of `net.ipv4.ip_local_port_range` (32768 when it cannot be read).
fn ephemeral_port_range_start() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

/// Panics with an actionable message when `tool` is not on PATH: tests never skip silently.
pub fn require_tool(tool: &str) {
    if find_in_path(tool).is_none() {
        let package = match tool {
            "nbdinfo" | "nbdcopy" | "nbdfuse" | "nbdsh" => "libnbd-bin",
            "qemu-img" | "qemu-io" | "qemu-nbd" => "qemu-utils",
            "iscsi-ls" | "iscsi-inq" | "iscsi-readcapacity16" | "iscsi-test-cu" => "libiscsi-bin",
            "iscsiadm" => "open-iscsi",
            "mkfs.ext4" | "e2fsck" => "e2fsprogs",
            "fusermount3" => "fuse3",
            "losetup" | "mount" | "umount" => "mount",
            "timeout" | "cmp" | "sync" => "coreutils",
            other => other,
        };
        panic!("`{tool}` is not installed: install {package} (CI's .ci/run does)");
    }
}

pub fn find_in_path(tool: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    for dir in std::env::split_paths(&path).chain(
        ["/usr/sbin", "/sbin"].iter().map(PathBuf::from), // root tools when PATH lacks them
    ) {
        let candidate = dir.join(tool);
        if let Ok(meta) = std::fs::metadata(&candidate) {
            use std::os::unix::fs::PermissionsExt;
            if meta.is_file() && meta.permissions().mode() & 0o111 != 0 {
                return Some(candidate);
            }
        }
    }
    None
}

/// Runs `program args...` under `timeout -k 5 SECS` and returns its output. A command that
/// overran its time shows as exit status 124 (or 137), which callers' assertions report.
pub fn run_bounded<S: AsRef<std::ffi::OsStr>>(program: &str, args: &[S], secs: u64) -> Output {
    require_tool("timeout");
    require_tool(program);
    let program_path = find_in_path(program).unwrap();
    Command::new("timeout")
        .arg("-k")
        .arg("5")
        .arg(secs.to_string())
        .arg(program_path)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("running {program}: {e}"))
}

/// Like `run_bounded`, with environment variables set.
pub fn run_bounded_env<S: AsRef<std::ffi::OsStr>>(
    program: &str,
    args: &[S],
    env: &[(&str, &str)],
    secs: u64,
) -> Output {
    run_bounded_in(None, program, args, env, secs)
}

/// The variables that give the CLI an API token: removed from every command the tests run,
/// so a developer's shell cannot change what a test sees, unless the test sets them itself.
pub const TOKEN_VARIABLES: [&str; 2] = ["ASHLAR_API_TOKEN", "ASHLAR_API_TOKEN_FILE"];

/// Like `run_bounded_env`, in the working directory `dir` (default: the test's).
pub fn run_bounded_in<S: AsRef<std::ffi::OsStr>>(
    dir: Option<&Path>,
    program: &str,
    args: &[S],
    env: &[(&str, &str)],
    secs: u64,
) -> Output {
    require_tool("timeout");
    let program_path = if Path::new(program).is_absolute() {
        PathBuf::from(program)
    } else {
        require_tool(program);
        find_in_path(program).unwrap()
    };
    let mut command = Command::new("timeout");
    command
        .arg("-k")
        .arg("5")
        .arg(secs.to_string())
        .arg(program_path)
        .args(args)
        .stdin(Stdio::null());
    if let Some(dir) = dir {
        command.current_dir(dir);
    }
    for key in TOKEN_VARIABLES {
        command.env_remove(key);
    }
    for (key, value) in env {
        command.env(key, value);
    }
    command
        .output()
        .unwrap_or_else(|e| panic!("running {program}: {e}"))
}

/// The result of a command, with lossy UTF-8 text.
#[derive(Debug)]
pub struct CmdOut {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl CmdOut {
    pub fn from_output(output: Output) -> CmdOut {
        CmdOut {
            status: output.status,
            stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
        }
    }

    pub fn code(&self) -> Option<i32> {
        self.status.code()
    }

    /// Panics (with everything the command printed) unless it exited 0.
    pub fn assert_ok(&self, what: &str) -> &Self {
        assert!(
            self.status.success(),
            "{what} failed ({}):\nstdout:\n{}\nstderr:\n{}",
            self.status,
            self.stdout,
            self.stderr
        );
        self
    }

    /// Asserts the CLI's error convention: exit 1, one line on stderr starting `error:`, that
    /// contains `needle`, and nothing on stdout.
    pub fn assert_cli_error(&self, needle: &str) {
        assert_eq!(
            self.code(),
            Some(1),
            "expected exit 1 with an error containing {needle:?}; got {}:\nstdout:\n{}\nstderr:\n{}",
            self.status,
            self.stdout,
            self.stderr
        );
        let stderr = self.stderr.trim_end();
        assert!(
            stderr.starts_with("error:"),
            "stderr must start with 'error:': {stderr:?}"
        );
        assert_eq!(
            stderr.lines().count(),
            1,
            "the error must be one line: {stderr:?}"
        );
        assert!(
            stderr.contains(needle),
            "stderr should contain {needle:?}: {stderr:?}"
        );
        assert!(
            self.stdout.trim().is_empty(),
            "nothing on stdout on error: {:?}",
            self.stdout
        );
    }
}

/// The vdisk names, sorted, in the output of `ashlar vdisk list --json`; panics unless the
/// command succeeded.
pub fn vdisk_names(out: &CmdOut) -> Vec<String> {
    out.assert_ok("vdisk list --json");
    let list: serde_json::Value = serde_json::from_str(&out.stdout)
        .unwrap_or_else(|e| panic!("vdisk list --json ({e}): {}", out.stdout));
    let mut names: Vec<String> = list
        .as_array()
        .expect("an array")
        .iter()
        .map(|v| v["name"].as_str().unwrap().to_string())
        .collect();
    names.sort();
    names
}

/// Runs the `ashlar` binary with exactly `args` (no `--server` added), bounded to 60 s.
pub fn ashlar(args: &[&str]) -> CmdOut {
    ashlar_env(args, &[])
}

pub fn ashlar_env(args: &[&str], env: &[(&str, &str)]) -> CmdOut {
    CmdOut::from_output(run_bounded_env(BIN, args, env, 60))
}

/// `ashlar args...` in the working directory `dir` (where the CLI looks for
/// `./ashlar-data/api-token`), bounded to 60 s.
pub fn ashlar_in(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> CmdOut {
    CmdOut::from_output(run_bounded_in(Some(dir), BIN, args, env, 60))
}

/// A running (or stopped) `ashlar node` with its own data directory and ports.
pub struct Node {
    child: Option<Child>,
    /// Holds the data directory and the logs; removed on drop.
    pub root: tempfile::TempDir,
    pub data_dir: PathBuf,
    pub nbd_port: u16,
    pub http_port: u16,
    /// The address `--http-listen` binds (loopback unless a test asks for another).
    pub http_ip: IpAddr,
    pub iscsi_port: u16,
    /// Node-to-node traffic (`--node-listen`), used in cluster mode.
    pub node_port: u16,
    extra_args: Vec<String>,
    /// `RUST_LOG` of the node process.
    pub rust_log: String,
    stderr_path: PathBuf,
    stdout_path: PathBuf,
    starts: u32,
}

impl Node {
    /// A node with the suite's small limits and no vdisk.
    pub fn start() -> Node {
        Node::start_with(&[])
    }

    /// A node with additional `ashlar node` arguments (e.g. `--ensure-vdisk`).
    pub fn start_with(extra_args: &[&str]) -> Node {
        Node::start_in(None, extra_args)
    }

    /// A node keeping its data in `data_dir` (default: a fresh directory of its own).
    pub fn start_in(data_dir: Option<PathBuf>, extra_args: &[&str]) -> Node {
        Node::start_http_on(IpAddr::from([127, 0, 0, 1]), data_dir, extra_args)
    }

    /// A node whose HTTP API listens on `http_ip` (on its free port). The harness still
    /// reaches it at 127.0.0.1, so `http_ip` must cover loopback: 127.x.y.z or 0.0.0.0.
    pub fn start_http_on(http_ip: IpAddr, data_dir: Option<PathBuf>, extra_args: &[&str]) -> Node {
        let root = tempfile::Builder::new()
            .prefix("ashlar-e2e-")
            .tempdir()
            .expect("creating a temporary directory");
        let data_dir = data_dir.unwrap_or_else(|| root.path().join("data"));
        let stderr_path = root.path().join("node.stderr.log");
        let stdout_path = root.path().join("node.stdout.log");
        let mut node = Node {
            child: None,
            data_dir,
            nbd_port: 0,
            http_port: 0,
            http_ip,
            iscsi_port: 0,
            node_port: 0,
            extra_args: extra_args.iter().map(|s| s.to_string()).collect(),
            rust_log: std::env::var("ASHLAR_TEST_RUST_LOG").unwrap_or_else(|_| "info".to_string()),
            stderr_path,
            stdout_path,
            root,
            starts: 0,
        };
        // Another process may grab a port between our probe and the node's bind: retry then.
        for attempt in 0..5 {
            node.nbd_port = free_port();
            node.http_port = free_port();
            while node.http_port == node.nbd_port {
                node.http_port = free_port();
            }
            node.iscsi_port = free_port();
            while node.iscsi_port == node.nbd_port || node.iscsi_port == node.http_port {
                node.iscsi_port = free_port();
            }
            node.node_port = free_port();
            while [node.nbd_port, node.http_port, node.iscsi_port].contains(&node.node_port) {
                node.node_port = free_port();
            }
            match node.spawn_and_wait() {
                Ok(()) => return node,
                Err(log) if attempt < 4 && log.contains("cannot listen") => continue,
                Err(log) => panic!("ashlar node did not become ready:\n{log}"),
            }
        }
        unreachable!()
    }

    fn spawn_and_wait(&mut self) -> Result<(), String> {
        assert!(self.child.is_none(), "node already running");
        self.starts += 1;
        let stderr = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.stderr_path)
            .unwrap();
        let _ = writeln!(
            &stderr,
            "----- test harness: start #{} of the node -----",
            self.starts
        );
        // Each start gets a fresh stdout file, to check this start's banner.
        let stdout = File::create(&self.stdout_path).unwrap();
        let mut command = Command::new(BIN);
        command
            .arg("node")
            .arg("--data-dir")
            .arg(&self.data_dir)
            .arg("--nbd-listen")
            .arg(format!("127.0.0.1:{}", self.nbd_port))
            .arg("--http-listen")
            .arg(SocketAddr::new(self.http_ip, self.http_port).to_string())
            .arg("--iscsi-listen")
            .arg(format!("127.0.0.1:{}", self.iscsi_port))
            .arg("--node-listen")
            .arg(format!("127.0.0.1:{}", self.node_port))
            .args(["--reactors", "2", "--oplog-size", "64M"])
            .args(if self.extra_args.iter().any(|a| a == "--cache-size") {
                &[][..]
            } else {
                &["--cache-size", "64M"][..]
            })
            // Two shards unless a test says otherwise, so the suite exercises requests that
            // cross reactors (the product default is one shard).
            .args(if self.extra_args.iter().any(|a| a == "--default-shards") {
                &[][..]
            } else {
                &["--default-shards", "2"][..]
            })
            // The suite runs once with O_DIRECT (the default) and once through the page cache
            // (scripts/test.sh sets ASHLAR_TEST_DIRECT_IO=off for the second run).
            .args(match std::env::var("ASHLAR_TEST_DIRECT_IO") {
                Ok(mode) if !self.extra_args.iter().any(|a| a == "--direct-io") => {
                    vec!["--direct-io".to_string(), mode]
                }
                _ => vec![],
            })
            .args(&self.extra_args)
            .env("RUST_LOG", &self.rust_log)
            .env_remove("ASHLAR_SERVER")
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr);
        for key in TOKEN_VARIABLES {
            command.env_remove(key);
        }
        let child = command.spawn().expect("spawning ashlar node");
        self.child = Some(child);
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                self.child = None;
                return Err(format!(
                    "the node exited during startup ({status}); its log:\n{}",
                    self.log()
                ));
            }
            if let Ok((200, body)) = http_get_timeout(self.http_port, "/healthz", 2) {
                if body.trim() == "ok" {
                    break;
                }
            }
            if Instant::now() > deadline {
                self.kill9();
                return Err(format!(
                    "GET /healthz did not answer within {READY_TIMEOUT:?}; log:\n{}",
                    self.log()
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let stdout = std::fs::read_to_string(&self.stdout_path).unwrap_or_default();
        assert!(
            stdout.contains("Ashlar node ready"),
            "the node answers /healthz but did not print 'Ashlar node ready' on stdout: {stdout:?}"
        );
        Ok(())
    }

    pub fn pid(&self) -> i32 {
        self.child.as_ref().expect("node is not running").id() as i32
    }

    /// True while the node process has not exited.
    pub fn is_running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(child) => child.try_wait().unwrap().is_none(),
            None => false,
        }
    }

    /// Panics with the log unless the node process is still alive.
    pub fn assert_alive(&mut self) {
        if let Some(child) = self.child.as_mut() {
            if let Some(status) = child.try_wait().unwrap() {
                self.child = None;
                panic!("the node died ({status}); its log:\n{}", self.log());
            }
        } else {
            panic!("the node is not running");
        }
    }

    /// Sends SIGTERM and waits up to 15 s for the exit; SIGKILLs and panics if it hangs.
    pub fn sigterm_and_wait(&mut self) -> ExitStatus {
        self.sigterm_and_wait_for(Duration::from_secs(15))
    }

    pub fn sigterm_and_wait_for(&mut self, limit: Duration) -> ExitStatus {
        let pid = self.pid();
        unsafe {
            libc::kill(pid, libc::SIGTERM);
        }
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                self.child = None;
                return status;
            }
            if Instant::now() > deadline {
                self.kill9();
                panic!(
                    "the node did not exit within {limit:?} of SIGTERM; log:\n{}",
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL (no chance to flush anything) and reap.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the node again on the same data directory and ports.
    pub fn restart(&mut self) {
        if self.child.is_some() {
            assert!(
                !self.is_running(),
                "restart() needs a stopped node (call kill9 or sigterm_and_wait first)"
            );
            self.child = None;
        }
        // The ports were ours a moment ago; wait a little if something else grabbed one.
        let mut last = String::new();
        for _ in 0..3 {
            match self.spawn_and_wait() {
                Ok(()) => return,
                Err(log) => {
                    last = log;
                    std::thread::sleep(Duration::from_millis(500));
                }
            }
        }
        panic!("the node did not restart:\n{last}");
    }

    /// Everything the node wrote on stderr (all starts).
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }

    pub fn stdout(&self) -> String {
        std::fs::read_to_string(&self.stdout_path).unwrap_or_default()
    }

    pub fn server_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.http_port)
    }

    pub fn nbd_addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.nbd_port))
    }

    pub fn uri(&self, vdisk: &str) -> String {
        format!("nbd://127.0.0.1:{}/{}", self.nbd_port, vdisk)
    }

    /// `ashlar --server URL args...`
    pub fn cli(&self, args: &[&str]) -> CmdOut {
        let url = self.server_url();
        let mut all = vec!["--server", url.as_str()];
        all.extend_from_slice(args);
        ashlar(&all)
    }

    /// Creates a vdisk through the CLI and asserts it worked.
    pub fn create_vdisk(&self, name: &str, size: &str) {
        self.cli(&["vdisk", "create", name, "--size", size])
            .assert_ok(&format!("vdisk create {name}"));
    }

    pub fn create_vdisk_shards(&self, name: &str, size: &str, shards: u32) {
        self.cli(&[
            "vdisk",
            "create",
            name,
            "--size",
            size,
            "--shards",
            &shards.to_string(),
        ])
        .assert_ok(&format!("vdisk create {name}"));
    }

    /// `vdisk show NAME --json`, parsed.
    pub fn show(&self, name: &str) -> serde_json::Value {
        let out = self.cli(&["vdisk", "show", name, "--json"]);
        out.assert_ok("vdisk show --json");
        serde_json::from_str(&out.stdout)
            .unwrap_or_else(|e| panic!("vdisk show --json is not JSON ({e}): {}", out.stdout))
    }

    /// The vdisk's id as the 16-hex-digit directory name of its extent files.
    pub fn vdisk_dir_name(&self, name: &str) -> String {
        let id = self.show(name)["id"]
            .as_u64()
            .expect("vdisk show --json has a numeric id");
        format!("{id:016x}")
    }

    /// The file of egroup `egroup` of the vdisk whose extent directory is `vdisk_dir`
    /// (`vdisk_dir_name`), on the node's default disk.
    pub fn egroup_path(&self, vdisk_dir: &str, egroup: u64) -> PathBuf {
        self.data_dir
            .join("disk0/extents")
            .join(vdisk_dir)
            .join(format!("{egroup:016x}.egroup"))
    }

    /// Opens egroup `egroup` of the vdisk for reading and writing (to damage it on purpose).
    pub fn open_egroup(&self, vdisk_dir: &str, egroup: u64) -> File {
        let path = self.egroup_path(vdisk_dir, egroup);
        OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap_or_else(|e| panic!("the egroup file {}: {e}", path.display()))
    }

    pub fn http_get(&self, path: &str) -> (u16, String) {
        http_get(self.http_port, path)
    }

    pub fn http_json(&self, path: &str) -> serde_json::Value {
        let (status, body) = self.http_get(path);
        assert_eq!(status, 200, "GET {path}: {body}");
        serde_json::from_str(&body)
            .unwrap_or_else(|e| panic!("GET {path} is not JSON ({e}): {body}"))
    }

    /// The entry of `vdisk` in GET /stats/vdisks.
    pub fn vdisk_stats(&self, vdisk: &str) -> serde_json::Value {
        let stats = self.http_json("/stats/vdisks");
        stats["vdisks"]
            .as_array()
            .expect("/stats/vdisks has a vdisks array")
            .iter()
            .find(|v| v["name"] == vdisk)
            .cloned()
            .unwrap_or_else(|| panic!("/stats/vdisks has no entry for {vdisk}: {stats}"))
    }

    /// Prints the tail of the node's log; used when a test fails.
    pub fn dump_log(&self) {
        let log = self.log();
        let lines: Vec<&str> = log.lines().collect();
        let start = lines.len().saturating_sub(200);
        eprintln!(
            "===== ashlar node stderr ({}; last {} lines) =====",
            self.stderr_path.display(),
            lines.len() - start
        );
        for line in &lines[start..] {
            eprintln!("{line}");
        }
        eprintln!("===== end of node stderr =====");
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill9();
        if let Ok(to) = std::env::var("ASHLAR_TEST_KEEP_LOG") {
            let _ = std::fs::copy(&self.stderr_path, to);
        }
        if std::thread::panicking() {
            self.dump_log();
        }
    }
}

/// GET over a plain TcpStream (HTTP/1.0, so no chunked encoding); bounded to 10 s.
pub fn http_get(port: u16, path: &str) -> (u16, String) {
    http_get_timeout(port, path, 10).unwrap_or_else(|e| panic!("GET {path}: {e}"))
}

pub fn http_get_timeout(port: u16, path: &str, secs: u64) -> std::io::Result<(u16, String)> {
    let limit = Duration::from_secs(secs);
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let mut stream = TcpStream::connect_timeout(&addr, limit)?;
    stream.set_read_timeout(Some(limit))?;
    stream.set_write_timeout(Some(limit))?;
    write!(
        stream,
        "GET {path} HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n"
    )?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response)?;
    let text = String::from_utf8_lossy(&response).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("bad HTTP response {text:?}"),
        )
    })?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("bad status line {head:?}"),
            )
        })?;
    Ok((status, body.to_string()))
}

/// fio's result: the process output and its JSON report.
pub struct Fio {
    pub out: CmdOut,
    pub json: serde_json::Value,
}

impl Fio {
    pub fn jobs(&self) -> Vec<serde_json::Value> {
        self.json["jobs"].as_array().cloned().unwrap_or_default()
    }

    /// Sum over jobs of `read`/`write` `io_bytes`.
    pub fn io_bytes(&self, direction: &str) -> u64 {
        self.jobs()
            .iter()
            .map(|j| j[direction]["io_bytes"].as_u64().unwrap_or(0))
            .sum()
    }

    /// Exit status 0, every job's error 0, and no verification complaint anywhere.
    pub fn assert_ok(&self, what: &str) {
        let text = format!("{}\n{}", self.out.stdout, self.out.stderr);
        let lower = text.to_lowercase();
        assert!(
            self.out.status.success() && !lower.contains("verify") && !lower.contains("err="),
            "fio ({what}) failed ({}):\n{text}\nreport: {}",
            self.out.status,
            self.json
        );
        let jobs = self.jobs();
        assert!(
            !jobs.is_empty(),
            "fio ({what}) gave no JSON report:\n{text}"
        );
        for job in &jobs {
            assert_eq!(
                job["error"].as_i64(),
                Some(0),
                "fio ({what}) job {} reported an error:\n{text}\n{job}",
                job["jobname"]
            );
        }
    }
}

/// Runs fio with `args` plus a JSON report (`--output-format=json --output=...`), bounded to
/// 300 s. Does not assert: see `Fio::assert_ok`.
pub fn run_fio(args: &[String]) -> Fio {
    require_tool("fio");
    let report = tempfile::NamedTempFile::new().unwrap();
    let mut all: Vec<String> = args.to_vec();
    all.push("--output-format=json".into());
    all.push(format!("--output={}", report.path().display()));
    let out = CmdOut::from_output(run_bounded("fio", &all, 300));
    let text = std::fs::read_to_string(report.path()).unwrap_or_default();
    let json = parse_fio_json(&text);
    Fio { out, json }
}

/// fio's JSON report, skipping any log lines printed before it.
pub fn parse_fio_json(text: &str) -> serde_json::Value {
    match text.find('{') {
        Some(start) => serde_json::from_str(&text[start..]).unwrap_or(serde_json::Value::Null),
        None => serde_json::Value::Null,
    }
}

/// The arguments of a verifying fio job on an NBD export.
pub fn fio_args(uri: &str, name: &str, extra: &[&str]) -> Vec<String> {
    let mut args = vec![
        format!("--name={name}"),
        "--ioengine=nbd".to_string(),
        format!("--uri={uri}"),
        "--verify=crc32c".to_string(),
        "--verify_fatal=1".to_string(),
        // No verify state files in the working directory.
        "--verify_state_save=0".to_string(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

/// Deterministic pseudo-random bytes (xorshift64*), so failures reproduce.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    pub fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let v = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }

    pub fn bytes(&mut self, len: usize) -> Vec<u8> {
        let mut buf = vec![0u8; len];
        self.fill(&mut buf);
        buf
    }
}

/// Bytes allocated on disk under `path` (st_blocks × 512, like `du`).
pub fn allocated_bytes(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let meta = match std::fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(_) => return 0,
    };
    let mut total = meta.blocks() * 512;
    if meta.is_dir() {
        for entry in std::fs::read_dir(path).unwrap().flatten() {
            total += allocated_bytes(&entry.path());
        }
    }
    total
}

/// A human description of an exit status, including the signal.
pub fn describe(status: &ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit code {code}"),
        (None, Some(signal)) => format!("killed by signal {signal}"),
        _ => format!("{status}"),
    }
}

/// Polls `condition` every 50 ms until it holds or `limit` passes.
pub fn wait_until(limit: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if condition() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Polls GET /stats/vdisks every 50 ms in a thread and keeps the maxima of a vdisk's
/// `connections` and `oplog_live_bytes` (data in the oplog), to see what happened while a client ran.
pub struct StatsWatcher {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<(u64, u64)>>,
}

impl StatsWatcher {
    pub fn start(node: &Node, vdisk: &str) -> StatsWatcher {
        use std::sync::atomic::Ordering;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let port = node.http_port;
        let vdisk = vdisk.to_string();
        let thread = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let (mut connections, mut oplog) = (0, 0);
                while !stop.load(Ordering::SeqCst) {
                    if let Ok((200, body)) = http_get_timeout(port, "/stats/vdisks", 5) {
                        let stats: serde_json::Value =
                            serde_json::from_str(&body).unwrap_or_default();
                        for v in stats["vdisks"].as_array().into_iter().flatten() {
                            if v["name"] == vdisk.as_str() {
                                connections =
                                    connections.max(v["connections"].as_u64().unwrap_or(0));
                                oplog = oplog.max(v["oplog_live_bytes"].as_u64().unwrap_or(0));
                            }
                        }
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
                (connections, oplog)
            })
        };
        StatsWatcher {
            stop,
            thread: Some(thread),
        }
    }

    /// Stops polling; returns (max connections, max oplog usage in bytes).
    pub fn finish(mut self) -> (u64, u64) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        self.thread.take().unwrap().join().unwrap()
    }
}

impl Drop for StatsWatcher {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The lease TTL of nodes started by [`cluster_node`]: short, so a killed node is down soon.
pub const CLUSTER_LEASE_TTL_MS: u64 = 2000;

/// A node on loopback that keeps its metadata in the etcd at `etcd_url` and joins the
/// cluster there, with a short lease TTL.
pub fn cluster_node(etcd_url: &str, extra: &[&str]) -> Node {
    cluster_node_with_lease(etcd_url, CLUSTER_LEASE_TTL_MS, extra)
}

/// [`cluster_node`] with a lease TTL of `lease_ttl_ms`.
pub fn cluster_node_with_lease(etcd_url: &str, lease_ttl_ms: u64, extra: &[&str]) -> Node {
    let ttl = lease_ttl_ms.to_string();
    let mut args = vec![
        "--etcd",
        etcd_url,
        "--advertise",
        "127.0.0.1",
        "--node-lease-ttl-ms",
        ttl.as_str(),
    ];
    args.extend_from_slice(extra);
    Node::start_with(&args)
}

/// The node's persistent id (its data directory's `node-id` file).
pub fn node_id(node: &Node) -> String {
    read_node_id(&node.data_dir)
}

/// The id in `data_dir`'s `node-id` file: its first field (version 2 adds a CRC after it).
pub fn read_node_id(data_dir: &Path) -> String {
    let path = data_dir.join("node-id");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    text.split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string()
}

/// `vdisk show NAME --json`'s ownership (owner, owner_epoch, epoch, last_owner) as `asked`
/// sees it.
pub fn ownership(asked: &Node, vdisk: &str) -> serde_json::Value {
    asked.show(vdisk)["ownership"].clone()
}

/// The state (`up`, `down`) `asked` lists the node `id` in (`ashlar node list --json`).
pub fn node_state(asked: &Node, id: &str) -> String {
    let out = asked.cli(&["node", "list", "--json"]);
    out.assert_ok("node list");
    let nodes: serde_json::Value = serde_json::from_str(&out.stdout).expect("JSON");
    let node = nodes
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["node_id"] == id)
        .expect("listed")
        .clone();
    node["state"].as_str().unwrap().to_string()
}

/// Mounts powercut-fs (the suite's FUSE filesystem that loses what was not made durable at
/// a cut) over `backing` at `mountpoint`. Needs root and /dev/fuse.
pub fn mount_powercut(backing: &Path, mountpoint: &Path) -> ashlar_powercut_fs::PowercutFs {
    let options = ashlar_powercut_fs::MountOptions {
        // The host does not crash: the backing files need no fsync of their own.
        fsync_backing: false,
        sector_bytes: 4096,
        ..ashlar_powercut_fs::MountOptions::default()
    };
    ashlar_powercut_fs::PowercutFs::mount_with(backing, mountpoint, &options)
        .unwrap_or_else(|e| panic!("mounting powercut-fs (needs root and /dev/fuse): {e}"))
}

//! `NetLab`: a private network of Linux network namespaces ("hosts") on one bridge, for tests
//! that need several machines with their own addresses on this one machine.
//!
//! ```text
//!   root namespace (the test process)          host 0 (netns)      host 1 (netns) ...
//!   bridge ashl<tag>b  10.A.B.254/24 ──┬── ashl<tag>r0 ═══ ashl<tag>n0 10.A.B.1/24
//!                                      └── ashl<tag>r1 ═══ ashl<tag>n1 10.A.B.2/24
//! ```
//!
//! Every name carries a tag made of the test process's pid and a per-process counter, so test
//! binaries running in parallel (and tests in one binary) never collide; the /24 subnet is
//! picked free (no address of the machine in it) and held with an `flock` on a file in
//! /tmp/ashlar-netlab while the lab lives. The test process reaches every host through the
//! bridge's address; `cut` takes a host's link down (both veth ends: this kernel has no netem
//! and there is no iptables), `heal` brings it back. Dropping the lab (also when the test
//! panics) SIGKILLs every process in its namespaces and deletes namespaces, veths and bridge.
//! A new lab also removes what labs of dead test processes (SIGKILLed, so no drop ran) left.
//!
//! Needs root and iproute2's `ip`; without them `NetLab::new` panics with what is missing:
//! these tests never skip.

use crate::common::{find_in_path, require_tool, run_bounded, CmdOut};
use std::collections::BTreeSet;
use std::fs::File;
use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;

/// Every namespace and interface name of a lab starts with this.
pub const PREFIX: &str = "ashl";

/// Where the subnet locks live.
const LOCK_DIR: &str = "/tmp/ashlar-netlab";

static LABS: AtomicU32 = AtomicU32::new(0);

/// One host of a lab: a network namespace with one veth into the bridge.
#[derive(Clone, Debug)]
pub struct Host {
    /// The namespace's name (`ip netns list`).
    pub netns: String,
    /// The veth end in the root namespace (on the bridge).
    pub veth_outside: String,
    /// The veth end inside the namespace.
    pub veth_inside: String,
    pub ip: Ipv4Addr,
}

pub struct NetLab {
    tag: String,
    bridge: String,
    /// The first three octets of the lab's /24.
    subnet: [u8; 3],
    hosts: Vec<Host>,
    /// Host pairs (lower index first) cut from each other by `block`.
    blocked: Mutex<BTreeSet<(usize, usize)>>,
    /// Held (flock) while the lab lives: the subnet is ours.
    _subnet_lock: File,
}

/// Runs `ip args...` (bounded to 20 s); `Err` carries the command and its stderr.
pub fn ip(args: &[&str]) -> Result<String, String> {
    let out = run_bounded("ip", args, 20);
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "`ip {}` failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn ip_ok(args: &[&str]) {
    if let Err(e) = ip(args) {
        panic!("{e}");
    }
}

/// Base 36, zero-padded to `width` digits (names must fit in 15 bytes).
pub fn base36(mut n: u64, width: usize) -> String {
    let digits = b"0123456789abcdefghijklmnopqrstuvwxyz";
    let mut out = vec![b'0'; width];
    for slot in out.iter_mut().rev() {
        *slot = digits[(n % 36) as usize];
        n /= 36;
    }
    String::from_utf8(out).unwrap()
}

/// The pid encoded in a name of ours (`ashl` + 5 base-36 digits of pid + ...).
fn pid_of_name(name: &str) -> Option<u32> {
    let digits = name.strip_prefix(PREFIX)?.get(..5)?;
    u32::from_str_radix(digits, 36).ok()
}

/// Names of the namespaces (`ip netns list`) and links (`ip -o link`) whose name starts with
/// `prefix`.
pub fn names_with_prefix(prefix: &str) -> (Vec<String>, Vec<String>) {
    let netns = ip(&["netns", "list"])
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with(prefix))
        .map(str::to_string)
        .collect();
    // "7: ashl0abcd01r0@if6: <BROADCAST,...": the name is the second field, before any '@'.
    let links = ip(&["-o", "link", "show"])
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_whitespace().nth(1))
        .map(|n| n.trim_end_matches(':').split('@').next().unwrap_or(""))
        .filter(|n| n.starts_with(prefix))
        .map(str::to_string)
        .collect();
    (netns, links)
}

/// SIGKILLs every process in namespace `netns` and waits (up to 5 s) until none is left.
fn kill_all_in(netns: &str) {
    for _ in 0..100 {
        let pids: Vec<i32> = ip(&["netns", "pids", netns])
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect();
        if pids.is_empty() {
            return;
        }
        for pid in pids {
            unsafe {
                libc::kill(pid, libc::SIGKILL);
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// Removes namespaces and links of labs whose test process is gone.
fn sweep_dead_labs() {
    let (netns, links) = names_with_prefix(PREFIX);
    let dead = |name: &String| {
        pid_of_name(name).is_some_and(|pid| !std::path::Path::new(&format!("/proc/{pid}")).exists())
    };
    for ns in netns.iter().filter(|n| dead(n)) {
        kill_all_in(ns);
        let _ = ip(&["netns", "delete", ns]);
    }
    for link in links.iter().filter(|n| dead(n)) {
        let _ = ip(&["link", "delete", link]);
    }
}

/// Panics with a clear message unless this process can build a lab.
pub fn require_root_and_ip() {
    if find_in_path("ip").is_none() {
        panic!(
            "`ip` is not installed: the multi-host tests build network namespaces with \
             iproute2; install it (apt-get install iproute2; CI's .ci/run does)"
        );
    }
    if unsafe { libc::geteuid() } != 0 {
        panic!(
            "the multi-host tests create network namespaces, veths and a bridge and must run \
             as root (uid 0); this process runs as uid {}",
            unsafe { libc::geteuid() }
        );
    }
}

/// Takes a free /24 in 10.240.0.0/12 (no address of the machine in it, nobody else's lock).
fn claim_subnet(seed: u64) -> ([u8; 3], File) {
    std::fs::create_dir_all(LOCK_DIR).unwrap_or_else(|e| panic!("creating {LOCK_DIR}: {e}"));
    let used = ip(&["-o", "-4", "addr", "show"]).unwrap_or_else(|e| panic!("{e}"))
        + &ip(&["-4", "route", "show"]).unwrap_or_default();
    for k in 0..4096u64 {
        let index = (seed + k) % 4096;
        let subnet = [10, 240 + (index / 256) as u8, (index % 256) as u8];
        let prefix = format!("{}.{}.{}.", subnet[0], subnet[1], subnet[2]);
        if used.contains(&prefix) {
            continue;
        }
        let path = format!("{LOCK_DIR}/{}.{}.{}", subnet[0], subnet[1], subnet[2]);
        let file = File::create(&path).unwrap_or_else(|e| panic!("creating {path}: {e}"));
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return (subnet, file);
        }
    }
    panic!("no free /24 in 10.240.0.0/12 for a test network");
}

impl NetLab {
    /// A bridge and `hosts` namespaces on it (at most 250), host `i` at 10.A.B.(i+1).
    pub fn new(hosts: usize) -> NetLab {
        assert!((1..=250).contains(&hosts), "a lab has 1 to 250 hosts");
        require_root_and_ip();
        sweep_dead_labs();
        let pid = std::process::id();
        let count = LABS.fetch_add(1, Ordering::SeqCst);
        let tag = format!("{}{}", base36(pid as u64, 5), base36(count as u64, 2));
        let (subnet, lock) = claim_subnet(pid as u64 * 7 + count as u64 * 131);
        let mut lab = NetLab {
            bridge: format!("{PREFIX}{tag}b"),
            tag,
            subnet,
            hosts: Vec::new(),
            blocked: Mutex::default(),
            _subnet_lock: lock,
        };
        // From here on, a panic drops the lab, which removes what was created so far.
        let bridge = lab.bridge.clone();
        ip_ok(&["link", "add", &bridge, "type", "bridge"]);
        let bridge_ip = format!("{}/24", lab.bridge_ip());
        ip_ok(&["addr", "add", &bridge_ip, "dev", &bridge]);
        ip_ok(&["link", "set", &bridge, "up"]);
        for i in 0..hosts {
            let host = Host {
                netns: format!("{PREFIX}{}h{i}", lab.tag),
                veth_outside: format!("{PREFIX}{}r{i}", lab.tag),
                veth_inside: format!("{PREFIX}{}n{i}", lab.tag),
                ip: Ipv4Addr::new(subnet[0], subnet[1], subnet[2], i as u8 + 1),
            };
            lab.hosts.push(host.clone());
            ip_ok(&["netns", "add", &host.netns]);
            ip_ok(&[
                "link",
                "add",
                &host.veth_outside,
                "type",
                "veth",
                "peer",
                "name",
                &host.veth_inside,
                "netns",
                &host.netns,
            ]);
            let address = format!("{}/24", host.ip);
            let ns = host.netns.as_str();
            ip_ok(&["-n", ns, "addr", "add", &address, "dev", &host.veth_inside]);
            ip_ok(&["-n", ns, "link", "set", "lo", "up"]);
            ip_ok(&["-n", ns, "link", "set", &host.veth_inside, "up"]);
            ip_ok(&["link", "set", &host.veth_outside, "master", &bridge, "up"]);
        }
        lab
    }

    /// What every name of this lab contains (after `PREFIX`).
    pub fn tag(&self) -> &str {
        &self.tag
    }

    /// The common prefix of all this lab's namespace and interface names.
    pub fn name_prefix(&self) -> String {
        format!("{PREFIX}{}", self.tag)
    }

    pub fn bridge(&self) -> &str {
        &self.bridge
    }

    /// The root namespace's (the test process's) address on the lab network.
    pub fn bridge_ip(&self) -> Ipv4Addr {
        Ipv4Addr::new(self.subnet[0], self.subnet[1], self.subnet[2], 254)
    }

    pub fn hosts(&self) -> &[Host] {
        &self.hosts
    }

    pub fn host(&self, host: usize) -> &Host {
        &self.hosts[host]
    }

    pub fn ip(&self, host: usize) -> Ipv4Addr {
        self.hosts[host].ip
    }

    /// Spawns `command` inside host `host`'s namespace (the child joins it with setns(2)
    /// between fork and exec, as `ip netns exec` does), keeping the command's arguments,
    /// environment and stdio. The lab kills it on drop if it still runs then.
    pub fn run_in(&self, host: usize, mut command: Command) -> Child {
        let path = format!("/run/netns/{}", self.hosts[host].netns);
        let netns = File::open(&path).unwrap_or_else(|e| panic!("opening {path}: {e}"));
        let fd = netns.as_raw_fd();
        // Safety: setns is a single system call, safe between fork and exec.
        unsafe {
            command.pre_exec(move || {
                if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        command
            .spawn()
            .unwrap_or_else(|e| panic!("spawning {command:?} in {path}: {e}"))
    }

    /// Runs `program args...` in host `host` to completion (bounded by `timeout`, like
    /// `run_bounded`).
    pub fn output_in(&self, host: usize, program: &str, args: &[&str], secs: u64) -> CmdOut {
        require_tool(program);
        let mut command = Command::new("timeout");
        command
            .args(["-k", "5", &secs.to_string()])
            .arg(find_in_path(program).unwrap())
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let child = self.run_in(host, command);
        CmdOut::from_output(child.wait_with_output().expect("waiting for the command"))
    }

    /// Takes host `host` off the network: both ends of its veth down. Its processes keep
    /// running; nothing reaches them and they reach nothing but their own `lo`.
    pub fn cut(&self, host: usize) {
        self.set_link(host, "down");
    }

    /// Brings host `host`'s link back up.
    pub fn heal(&self, host: usize) {
        self.set_link(host, "up");
    }

    fn set_link(&self, host: usize, state: &str) {
        let h = &self.hosts[host];
        ip_ok(&["-n", &h.netns, "link", "set", &h.veth_inside, state]);
        ip_ok(&["link", "set", &h.veth_outside, state]);
    }

    /// Cuts hosts `a` and `b` off from each other only, both ways, with a blackhole route to
    /// the other's address in each namespace (no iptables here): their packets to each other
    /// are dropped, everything else (the bridge, the test process, other hosts) still works.
    pub fn block(&self, a: usize, b: usize) {
        assert_ne!(a, b, "a host cannot be cut from itself");
        if self.blocked.lock().unwrap().insert((a.min(b), a.max(b))) {
            self.blackhole(a, b, "add");
            self.blackhole(b, a, "add");
        }
    }

    /// Undoes `block(a, b)`.
    pub fn unblock(&self, a: usize, b: usize) {
        if self.blocked.lock().unwrap().remove(&(a.min(b), a.max(b))) {
            self.blackhole(a, b, "delete");
            self.blackhole(b, a, "delete");
        }
    }

    /// Undoes every `block` involving `host`.
    pub fn unblock_all(&self, host: usize) {
        let pairs: Vec<_> = self.blocked.lock().unwrap().iter().copied().collect();
        for (a, b) in pairs.into_iter().filter(|&(a, b)| a == host || b == host) {
            self.unblock(a, b);
        }
    }

    /// The hosts `host` is blocked from.
    pub fn blocked_from(&self, host: usize) -> Vec<usize> {
        let blocked = self.blocked.lock().unwrap();
        blocked
            .iter()
            .filter_map(|&(a, b)| (a == host).then_some(b).or((b == host).then_some(a)))
            .collect()
    }

    fn blackhole(&self, from: usize, to: usize, action: &str) {
        let target = format!("{}/32", self.hosts[to].ip);
        ip_ok(&[
            "-n",
            &self.hosts[from].netns,
            "route",
            action,
            "blackhole",
            &target,
        ]);
    }

    /// True when the host's link (inside end) is up.
    pub fn is_up(&self, host: usize) -> bool {
        let h = &self.hosts[host];
        ip(&["-n", &h.netns, "-o", "link", "show", &h.veth_inside])
            .map(|s| s.contains(",UP"))
            .unwrap_or(false)
    }
}

impl Drop for NetLab {
    fn drop(&mut self) {
        for host in &self.hosts {
            kill_all_in(&host.netns);
            // Deleting the namespace deletes its veth end, and with it the pair.
            let _ = ip(&["netns", "delete", &host.netns]);
            let _ = ip(&["link", "delete", &host.veth_outside]);
        }
        let _ = ip(&["link", "delete", &self.bridge]);
    }
}

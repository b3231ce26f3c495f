//! An idle node uses next to no CPU: after a burst of client I/O (which starts the reactors'
//! poll window), with the client still connected but silent, the node must go to sleep.

mod common;

use common::nbd::NbdConn;
use common::{Node, Rng, MIB};
use std::time::Duration;

/// CPU time (user + system, all threads) the process has used, in clock ticks.
fn cpu_ticks(pid: i32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("read stat");
    // Fields after the command name (which may hold spaces) start after the last ')'.
    let fields: Vec<&str> = stat[stat.rfind(')').expect("stat format") + 2..]
        .split_whitespace()
        .collect();
    // utime and stime are fields 14 and 15 of the whole line: 11 and 12 after the name.
    let utime: u64 = fields[11].parse().expect("utime");
    let stime: u64 = fields[12].parse().expect("stime");
    utime + stime
}

#[test]
fn a_node_sleeps_once_its_clients_go_quiet() {
    let node = Node::start_with(&["--ensure-vdisk", "quiet:64M", "--poll-window-us", "50"]);
    let mut conn = NbdConn::connect(node.nbd_addr(), "quiet").expect("connect");
    let mut rng = Rng::new(7);
    // Writes, then reads twice so the second pass is answered from the cache inline.
    for i in 0..256u64 {
        conn.write_ok(i * 64 * 1024, &rng.bytes(4096));
    }
    for _ in 0..2 {
        for i in 0..256u64 {
            conn.read_ok(i * 64 * 1024, 4096);
        }
    }
    // Let the idle drain (500 ms after the last write) run and finish.
    std::thread::sleep(Duration::from_secs(2));
    let before = cpu_ticks(node.pid());
    std::thread::sleep(Duration::from_secs(3));
    let used = cpu_ticks(node.pid()) - before;
    // 10 ticks are 0.1 s of CPU in 3 s (about 3 % of one core): a reactor still polling
    // would use ~300.
    assert!(
        used <= 10,
        "an idle node used {used} ticks of CPU in 3 s; is a reactor still polling?"
    );
    // The connection still works after the node slept.
    let data = Rng::new(8).bytes(4096);
    conn.write_ok(3 * MIB, &data);
    assert_eq!(conn.read_ok(3 * MIB, 4096), data);
    conn.disconnect();
}

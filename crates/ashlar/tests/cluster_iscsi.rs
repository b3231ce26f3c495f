//! iSCSI logins claim vdisk ownership like NBD opens do, end to end with a real etcd and two
//! `ashlar node --etcd` processes on loopback: logging in to a volume group's target on a
//! node claims its vdisks there (epoch 1) and I/O works; a login to the same target on the
//! other node is redirected to the owner's portal (status 0x0101, and libiscsi follows it);
//! once the owner is killed the other node turns the login away with "service unavailable"
//! (the data is on the dead node only) while it still claims and serves a group of its own;
//! the owner restarted claims again at epoch 2 with its data intact. An owner whose lease
//! lapsed (etcd frozen) answers LUN I/O with CHECK CONDITION / NOT READY at once, and the
//! same session works again after the node claims the vdisk again. A replicated target fails
//! over: its owner killed, a login at another node serves every acknowledged write.

mod common;
// Shared with other test binaries, each of which uses a part of it.
#[allow(dead_code)]
#[path = "../../meta/tests/common/etcd_server.rs"]
mod etcd_server;

use common::iscsi::{login, open, target_iqn, LoginError, LoginSpec, Session, INITIATOR};
use common::{
    cluster_node, node_id, node_state, ownership, run_bounded, wait_until, CmdOut, Node, Rng,
    CLUSTER_LEASE_TTL_MS,
};
use etcd_server::EtcdServer;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// qemu-img's initiator name when none is configured.
const QEMU_INITIATOR: &str = "iqn.2008-11.org.linux-kvm";
const VDISK_SIZE: usize = 8 << 20;
const GOOD: u8 = 0x00;
const CHECK_CONDITION: u8 = 0x02;

fn url(node: &Node, group: &str) -> String {
    format!(
        "iscsi://127.0.0.1:{}/{}/0",
        node.iscsi_port,
        target_iqn(group)
    )
}

/// Volume group `group` of one new vdisk `vdisk`, attached to qemu's and the test's
/// initiator. Made before the other node starts: a node loads the groups when it starts.
fn group_of_one(node: &Node, group: &str, vdisk: &str) {
    node.create_vdisk(vdisk, &format!("{}M", VDISK_SIZE >> 20));
    node.cli(&["vg", "create", group]).assert_ok("vg create");
    node.cli(&["vg", "add-disk", group, vdisk])
        .assert_ok("vg add-disk");
    for initiator in [INITIATOR, QEMU_INITIATOR] {
        node.cli(&["vg", "attach", group, "--initiator", initiator])
            .assert_ok("vg attach");
    }
}

fn pattern_file(dir: &Path, seed: u64) -> PathBuf {
    let path = dir.join(format!("pattern-{seed}"));
    std::fs::write(&path, Rng::new(seed).bytes(VDISK_SIZE)).unwrap();
    path
}

fn qemu_img(args: &[&str]) -> CmdOut {
    CmdOut::from_output(run_bounded("qemu-img", args, 120))
}

/// Writes the file to the LUN through qemu's libiscsi driver (one login).
fn write_lun(file: &Path, lun_url: &str) -> CmdOut {
    let file = file.to_str().unwrap();
    qemu_img(&["convert", "-n", "-f", "raw", "-O", "raw", file, lun_url])
}

/// Compares the LUN with the file through qemu's libiscsi driver (one login).
fn compare_lun(file: &Path, lun_url: &str) -> CmdOut {
    let file = file.to_str().unwrap();
    qemu_img(&["compare", "-f", "raw", "-F", "raw", file, lun_url])
}

/// A login of the test initiator to `group`'s target at `node`.
fn login_to(node: &Node, group: &str) -> Result<Session, LoginError> {
    let target = target_iqn(group);
    let spec = LoginSpec {
        initiator: INITIATOR,
        target: Some(&target),
        chap: None,
        mutual: None,
        digests: false,
    };
    login(node.iscsi_port, &spec)
}

#[test]
fn a_login_claims_the_target_and_other_nodes_redirect_to_its_owner() {
    let etcd = EtcdServer::start();
    let mut a = cluster_node(&etcd.url, &[]);
    group_of_one(&a, "db", "shared");
    group_of_one(&a, "other", "fresh");
    let b = cluster_node(&etcd.url, &[]);
    let (id_a, id_b) = (node_id(&a), node_id(&b));
    assert!(ownership(&b, "shared")["owner"].is_null());

    // The first login, on A, claims the LUN's vdisk for A; I/O works.
    let dir = tempfile::tempdir().unwrap();
    let pattern = pattern_file(dir.path(), 1);
    write_lun(&pattern, &url(&a, "db")).assert_ok("write through A");
    compare_lun(&pattern, &url(&a, "db")).assert_ok("read back through A");
    let owned = ownership(&b, "shared");
    assert_eq!(owned["owner"], id_a.as_str(), "{owned}");
    assert_eq!(owned["owner_epoch"], 1, "{owned}");

    // On B the login is redirected to A's portal, without a portal group tag (RFC 7143
    // 13.8); libiscsi follows the redirection and reads A's data.
    match login_to(&b, "db") {
        Err(LoginError::Redirected { status, address }) => {
            assert_eq!(status, 0x0101, "target moved temporarily");
            assert_eq!(address, format!("127.0.0.1:{}", a.iscsi_port));
        }
        Err(other) => panic!("B must redirect the login to A: {other:?}"),
        Ok(_) => panic!("B logged in to a target whose vdisk A owns"),
    }
    compare_lun(&pattern, &url(&b, "db")).assert_ok("read through B, redirected to A");
    assert!(
        b.log().contains("iSCSI login redirected") && b.log().contains(&id_a),
        "B logs the redirection to A:\n{}",
        b.log()
    );
    let owned = ownership(&b, "shared");
    assert_eq!(
        owned["owner"],
        id_a.as_str(),
        "redirecting claims nothing: {owned}"
    );
    assert_eq!(owned["owner_epoch"], 1, "{owned}");

    // A dies: B turns the login away (A's data is on A only) and says why in its log.
    a.kill9();
    assert!(
        wait_until(Duration::from_secs(20), || node_state(&b, &id_a) == "down"),
        "A not listed down"
    );
    match login_to(&b, "db") {
        Err(LoginError::Status(status)) => assert_eq!(status, 0x0301, "service unavailable"),
        Err(other) => panic!("B must refuse the login: {other:?}"),
        Ok(_) => panic!("B served A's vdisk from its own disks"),
    }
    let log = b.log();
    assert!(
        log.contains("service unavailable")
            && log.contains(&format!("data is on node {id_a}"))
            && log.contains("which is down"),
        "B logs why it refused:\n{log}"
    );
    assert!(!compare_lun(&pattern, &url(&b, "db")).status.success());
    assert!(ownership(&b, "shared")["owner"].is_null());

    // B still claims and serves a group whose vdisk no node served before.
    let other_pattern = pattern_file(dir.path(), 2);
    write_lun(&other_pattern, &url(&b, "other")).assert_ok("write through B");
    compare_lun(&other_pattern, &url(&b, "other")).assert_ok("read back through B");
    assert_eq!(ownership(&b, "fresh")["owner"], id_b.as_str());

    // A comes back: its login claims its vdisk again at epoch 2, the data intact; and A
    // redirects logins to B's group to B.
    a.restart();
    compare_lun(&pattern, &url(&a, "db")).assert_ok("read through A after its restart");
    let owned = ownership(&b, "shared");
    assert_eq!(owned["owner"], id_a.as_str(), "{owned}");
    assert_eq!(owned["owner_epoch"], 2, "{owned}");
    compare_lun(&other_pattern, &url(&a, "other")).assert_ok("read through A, redirected to B");
    assert_eq!(ownership(&a, "fresh")["owner"], id_b.as_str());
}

/// (sense key, ASC, ASCQ) of a fixed-format sense.
fn sense_of(sense: &[u8]) -> (u8, u8, u8) {
    assert!(sense.len() >= 14, "sense data: {sense:?}");
    (sense[2] & 0x0f, sense[12], sense[13])
}

#[test]
fn an_owner_whose_lease_lapsed_fails_lun_io_until_it_claims_again() {
    let etcd = EtcdServer::start();
    let a = cluster_node(&etcd.url, &[]);
    group_of_one(&a, "db", "shared");
    let mut session = open(a.iscsi_port, INITIATOR, Some(&target_iqn("db")));
    let block = Rng::new(3).bytes(4096);
    assert_eq!(session.write16(0, 0, &block).status, GOOD);
    assert_eq!(ownership(&a, "shared")["owner_epoch"], 1);

    // Freeze etcd: no keep-alive answers, so A's lease is no longer surely valid after
    // one TTL. The logged-in session's commands then fail at once: NOT READY, LOGICAL UNIT
    // IS IN PROCESS OF BECOMING READY (not a medium error, not a hang).
    let pid = etcd.pid().to_string();
    assert!(run_bounded("kill", &["-STOP", pid.as_str()], 5)
        .status
        .success());
    std::thread::sleep(Duration::from_millis(CLUSTER_LEASE_TTL_MS + 1500));
    let asked = Instant::now();
    let write = session.write16(0, 8, &block);
    let read = session.read16(0, 0, 8);
    assert!(
        asked.elapsed() < Duration::from_secs(5),
        "{:?}",
        asked.elapsed()
    );
    for (what, reply) in [("write", &write), ("read", &read)] {
        assert_eq!(reply.status, CHECK_CONDITION, "{what} on a lapsed claim");
        assert_eq!(sense_of(&reply.sense), (0x02, 0x04, 0x01), "{what}");
    }
    assert!(run_bounded("kill", &["-CONT", pid.as_str()], 5)
        .status
        .success());

    // etcd answers again: A claims the vdisk again, at a higher epoch, and the same
    // session's commands succeed.
    assert!(
        wait_until(Duration::from_secs(30), || session
            .write16(0, 8, &block)
            .status
            == GOOD),
        "the session never worked again"
    );
    let read = session.read16(0, 0, 16);
    assert_eq!(read.status, GOOD);
    assert_eq!(read.data, [block.as_slice(), block.as_slice()].concat());
    let owned = ownership(&a, "shared");
    assert!(owned["owner_epoch"].as_u64() > Some(1), "{owned}");
    assert!(a.log().contains("claiming the vdisk again"), "{}", a.log());
}

#[test]
fn a_replicated_target_fails_over_to_another_node_with_every_write() {
    let etcd = EtcdServer::start();
    let mut a = cluster_node(&etcd.url, &[]);
    let b = cluster_node(&etcd.url, &[]);
    let _c = cluster_node(&etcd.url, &["--storage-only"]);
    a.cli(&["vdisk", "create", "mirrored", "--size", "8M", "--rf", "2"])
        .assert_ok("vdisk create --rf 2");
    a.cli(&["vg", "create", "db"]).assert_ok("vg create");
    a.cli(&["vg", "add-disk", "db", "mirrored"])
        .assert_ok("vg add-disk");
    a.cli(&["vg", "attach", "db", "--initiator", QEMU_INITIATOR])
        .assert_ok("vg attach");
    // B started before the group existed: it learns groups when it starts.
    let mut b = b;
    b.sigterm_and_wait();
    b.restart();
    let (id_a, id_b) = (node_id(&a), node_id(&b));

    let dir = tempfile::tempdir().unwrap();
    let first = pattern_file(dir.path(), 5);
    write_lun(&first, &url(&a, "db")).assert_ok("write through A");
    assert_eq!(ownership(&b, "mirrored")["owner"], id_a.as_str());

    // A dies mid-life: the initiator logs in again at B's portal. B takes the target over
    // (getting the vdisk's copy from the storage-only node) with every acknowledged write.
    a.kill9();
    assert!(
        wait_until(Duration::from_secs(20), || node_state(&b, &id_a) == "down"),
        "A not listed down"
    );
    compare_lun(&first, &url(&b, "db")).assert_ok("read through B after A died");
    let owned = ownership(&b, "mirrored");
    assert_eq!(owned["owner"], id_b.as_str(), "{owned}");
    // Writes go on through B, at RF 2.
    let second = pattern_file(dir.path(), 6);
    write_lun(&second, &url(&b, "db")).assert_ok("write through B");
    compare_lun(&second, &url(&b, "db")).assert_ok("read back through B");
    assert_eq!(owned["copies"].as_array().map(Vec::len), Some(2), "{owned}");
}

//! iSCSI logins claim vdisk ownership like NBD opens do, end to end with a real etcd and two
//! `ashlar node --etcd` processes on loopback: logging in to a volume group's target on a
//! node claims its vdisks there (epoch 1) and I/O works; a login to the same target on the
//! other node is redirected to the owner's portal (status 0x0101, and libiscsi follows it);
//! once the owner is killed the other node turns the login away with "service unavailable"
//! (the data is on the dead node only) while it still claims and serves a group of its own;
//! the owner restarted claims again at epoch 2 with its data intact. An owner whose lease
//! lapsed (etcd frozen) answers LUN I/O, TEST UNIT READY, PERSISTENT RESERVE IN and OUT and
//! RESERVE(6) with CHECK
//! CONDITION / NOT READY at once, and the same session works again after the node claims the
//! vdisk again. A replicated target fails over: its owner killed, a login at another node
//! serves every acknowledged write, each nexus's first command there gets UNIT ATTENTION
//! 29/00 (the unit is served anew), and a persistent reservation made through the old owner
//! holds there. Failback: once the
//! target's preferred node (the first that served it) is up again for the configured time,
//! the node serving the target ends its sessions and releases it, and the initiator's next
//! login is redirected to the preferred node, which serves every acknowledged write.

mod common;
// Shared with other test binaries, each of which uses a part of it.
#[allow(dead_code)]
#[path = "../../meta/tests/common/etcd_server.rs"]
mod etcd_server;

use ashlar_iscsi::pdu::{async_event, op, Pdu, NO_TAG};
use common::iscsi::{
    login, open, open_isid, target_iqn, LoginError, LoginSpec, Session, INITIATOR,
};
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
const RESERVATION_CONFLICT: u8 = 0x18;
/// PERSISTENT RESERVE OUT service actions and the WRITE EXCLUSIVE type.
const PR_REGISTER: u8 = 0;
const PR_RESERVE: u8 = 1;
const PR_RELEASE: u8 = 2;
const WRITE_EXCLUSIVE: u8 = 1;
/// PERSISTENT RESERVE IN service actions.
const PR_READ_KEYS: u8 = 0;
const PR_READ_RESERVATION: u8 = 1;

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

/// Volume group `db` of one new vdisk `mirrored` kept at RF 2, attached to qemu's and the
/// test's initiator.
fn replicated_group(node: &Node) {
    node.cli(&["vdisk", "create", "mirrored", "--size", "8M", "--rf", "2"])
        .assert_ok("vdisk create --rf 2");
    node.cli(&["vg", "create", "db"]).assert_ok("vg create");
    node.cli(&["vg", "add-disk", "db", "mirrored"])
        .assert_ok("vg add-disk");
    for initiator in [QEMU_INITIATOR, INITIATOR] {
        node.cli(&["vg", "attach", "db", "--initiator", initiator])
            .assert_ok("vg attach");
    }
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

/// The reply is CHECK CONDITION / UNIT ATTENTION, POWER ON, RESET, OR BUS DEVICE RESET
/// OCCURRED (06/29/00): what a node serving a unit anew tells each nexus once.
fn assert_unit_attention(reply: &common::iscsi::Reply, what: &str) {
    assert_eq!(reply.status, CHECK_CONDITION, "{what}: {reply:?}");
    assert_eq!(sense_of(&reply.sense), (0x06, 0x29, 0x00), "{what}");
}

#[test]
fn an_owner_whose_lease_lapsed_fails_lun_io_until_it_claims_again() {
    let etcd = EtcdServer::start();
    let a = cluster_node(&etcd.url, &[]);
    group_of_one(&a, "db", "shared");
    let mut session = open(a.iscsi_port, INITIATOR, Some(&target_iqn("db")));
    // A serves the unit for the first time: the nexus's first command gets the power-on
    // unit attention, as after a target's start.
    assert_unit_attention(&session.test_unit_ready(0), "first command after the claim");
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
    // Nor may the node change the unit's reservations: PERSISTENT RESERVE OUT and
    // RESERVE(6) get the same answer (the claim fences them as it fences I/O).
    let register = session.pr_out(0, PR_REGISTER, 0, 0, PR_KEY, false);
    let reserve6 = session.scsi(0, &[0x16, 0, 0, 0, 0, 0], &[], 0);
    // And a path checker's TEST UNIT READY finds the path not ready; PERSISTENT RESERVE IN
    // reads no state this node may hold stale.
    let ready = session.test_unit_ready(0);
    let keys_lapsed = session.pr_in(0, PR_READ_KEYS);
    assert!(
        asked.elapsed() < Duration::from_secs(5),
        "{:?}",
        asked.elapsed()
    );
    for (what, reply) in [
        ("write", &write),
        ("read", &read),
        ("PERSISTENT RESERVE OUT", &register),
        ("RESERVE(6)", &reserve6),
        ("TEST UNIT READY", &ready),
        ("PERSISTENT RESERVE IN", &keys_lapsed),
    ] {
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
    assert_eq!(session.test_unit_ready(0).status, GOOD);
    let keys = session.pr_in(0, PR_READ_KEYS);
    assert_eq!(keys.status, GOOD);
    assert_eq!(
        be32(&keys.data[4..8]),
        0,
        "the refused REGISTER left no key"
    );
    let owned = ownership(&a, "shared");
    assert!(owned["owner_epoch"].as_u64() > Some(1), "{owned}");
    assert!(a.log().contains("claiming the vdisk again"), "{}", a.log());
}

#[test]
fn a_replicated_target_fails_over_to_another_node_with_every_write_and_its_reservations() {
    let etcd = EtcdServer::start();
    let mut a = cluster_node(&etcd.url, &[]);
    let b = cluster_node(&etcd.url, &[]);
    let _c = cluster_node(&etcd.url, &["--storage-only"]);
    replicated_group(&a);
    // B started before the group existed: it learns groups when it starts.
    let mut b = b;
    b.sigterm_and_wait();
    b.restart();
    let (id_a, id_b) = (node_id(&a), node_id(&b));

    let dir = tempfile::tempdir().unwrap();
    let first = pattern_file(dir.path(), 5);
    write_lun(&first, &url(&a, "db")).assert_ok("write through A");
    assert_eq!(ownership(&b, "mirrored")["owner"], id_a.as_str());
    let first_block = std::fs::read(&first).unwrap()[..4096].to_vec();

    // Through A, after B started (B's copy of the reservations, loaded at its start, does
    // not hold this): the test initiator registers a key and reserves WRITE EXCLUSIVE.
    let mut holder = login_to(&a, "db").expect("login at A");
    assert_unit_attention(&holder.test_unit_ready(0), "first command at A");
    assert_eq!(
        holder.pr_out(0, PR_REGISTER, 0, 0, PR_KEY, false).status,
        GOOD
    );
    let reserve = holder.pr_out(0, PR_RESERVE, WRITE_EXCLUSIVE, PR_KEY, 0, false);
    assert_eq!(reserve.status, GOOD, "{reserve:?}");
    drop(holder);

    // A dies mid-life: the initiator logs in again at B's portal. B takes the target over
    // (getting the vdisk's copy from the storage-only node) with every acknowledged write.
    a.kill9();
    assert!(
        wait_until(Duration::from_secs(20), || node_state(&b, &id_a) == "down"),
        "A not listed down"
    );
    // The holder's I_T nexus (same initiator, same ISID) logs in at B, which claims the
    // target; another nexus of the same initiator (another ISID) holds no registration.
    let mut holder = login_to(&b, "db").expect("login at B after A died");
    assert_eq!(ownership(&b, "mirrored")["owner"], id_b.as_str());
    let mut other = open_isid(b.iscsi_port, INITIATOR, &target_iqn("db"), 2);
    // B serves the unit anew (A served it last): as after a power on, each nexus's first
    // command gets UNIT ATTENTION 29/00, ahead of any reservation conflict, and runs
    // normally when sent again. What A held in memory for the nexuses (unit attentions,
    // RESERVE(6)) is gone; the reset tells them to look again.
    assert_unit_attention(&holder.read16(0, 0, 8), "holder's first command at B");
    let read = holder.read16(0, 0, 8);
    assert_eq!(
        read.status, GOOD,
        "the holder's second command at B: {read:?}"
    );
    assert_eq!(read.data, first_block, "every acknowledged write");
    assert_unit_attention(
        &other.write16(0, 0, &first_block),
        "other's first command at B",
    );
    let refused = other.write16(0, 0, &first_block);
    assert_eq!(
        refused.status, RESERVATION_CONFLICT,
        "the reservation made through A holds on B: {refused:?}"
    );
    assert_eq!(
        holder.write16(0, 0, &first_block).status,
        GOOD,
        "the holder writes"
    );
    // Both nexuses read the same registration and reservation back.
    for session in [&mut holder, &mut other] {
        let keys = session.pr_in(0, PR_READ_KEYS);
        assert_eq!(keys.status, GOOD);
        assert_eq!(be32(&keys.data[4..8]), 8, "one key: {:?}", keys.data);
        assert_eq!(be64(&keys.data[8..16]), PR_KEY);
        let reservation = session.pr_in(0, PR_READ_RESERVATION);
        assert_eq!(reservation.status, GOOD);
        assert_eq!(
            be32(&reservation.data[4..8]),
            16,
            "a reservation: {:?}",
            reservation.data
        );
        assert_eq!(be64(&reservation.data[8..16]), PR_KEY);
        assert_eq!(reservation.data[21] & 0x0f, WRITE_EXCLUSIVE, "its type");
    }
    // The holder lets go (release, unregister), so qemu's writes below are not refused.
    let release = holder.pr_out(0, PR_RELEASE, WRITE_EXCLUSIVE, PR_KEY, 0, false);
    assert_eq!(release.status, GOOD, "{release:?}");
    assert_eq!(
        holder.pr_out(0, PR_REGISTER, 0, PR_KEY, 0, false).status,
        GOOD
    );
    drop((holder, other));

    compare_lun(&first, &url(&b, "db")).assert_ok("read through B after A died");
    let owned = ownership(&b, "mirrored");
    assert_eq!(owned["owner"], id_b.as_str(), "{owned}");
    // Writes go on through B, at RF 2.
    let second = pattern_file(dir.path(), 6);
    write_lun(&second, &url(&b, "db")).assert_ok("write through B");
    compare_lun(&second, &url(&b, "db")).assert_ok("read back through B");
    assert_eq!(owned["copies"].as_array().map(Vec::len), Some(2), "{owned}");
}

/// The reservation key the test initiator registers.
const PR_KEY: u64 = 0x00ab_cdef_0123_4567;

fn be32(bytes: &[u8]) -> u32 {
    u32::from_be_bytes(bytes.try_into().unwrap())
}

fn be64(bytes: &[u8]) -> u64 {
    u64::from_be_bytes(bytes.try_into().unwrap())
}

/// Waits until the target closes the session's connection, answering its NOP-In pings
/// meanwhile; the Asynchronous Messages it sent first, or `None` if it is still open after
/// `limit`. Any other PDU fails the test (the session is idle).
fn closed_by_target_within(session: &mut Session, limit: Duration) -> Option<Vec<Pdu>> {
    let deadline = Instant::now() + limit;
    let mut messages = Vec::new();
    while Instant::now() < deadline {
        match session.raw.recv() {
            Ok(pdu) if pdu.bhs.opcode() == op::NOP_IN && pdu.bhs.itt() == NO_TAG => {
                session.answer_ping(&pdu)
            }
            Ok(pdu) if pdu.bhs.opcode() == op::ASYNC_MESSAGE => messages.push(pdu),
            Ok(pdu) => panic!("unexpected PDU on an idle session: {:?}", pdu.bhs),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return Some(messages), // end of stream or reset: closed
        }
    }
    None
}

#[test]
fn a_target_fails_back_to_its_preferred_node_once_that_node_is_up_again() {
    let etcd = EtcdServer::start();
    let failback = ["--iscsi-failback-after-s", "3"];
    let a = cluster_node(&etcd.url, &failback);
    let mut b = cluster_node(&etcd.url, &failback);
    let mut c = cluster_node(&etcd.url, &failback);
    replicated_group(&a);
    // B and C started before the group existed: they learn groups when they start.
    for node in [&mut b, &mut c] {
        node.sigterm_and_wait();
        node.restart();
    }
    let (id_b, id_c) = (node_id(&b), node_id(&c));

    // The first login, at B, makes B the target's preferred node.
    let dir = tempfile::tempdir().unwrap();
    let first = pattern_file(dir.path(), 7);
    write_lun(&first, &url(&b, "db")).assert_ok("write through B");
    assert_eq!(ownership(&a, "mirrored")["owner"], id_b.as_str());
    assert!(b.log().contains("preferred node"), "{}", b.log());

    // B dies: the initiator's login at C's portal fails the target over to C, where every
    // acknowledged write is, and writes go on there.
    b.kill9();
    assert!(
        wait_until(Duration::from_secs(20), || node_state(&c, &id_b) == "down"),
        "B not listed down"
    );
    let mut session = login_to(&c, "db").expect("login at C after B died");
    assert_unit_attention(&session.read16(0, 0, 8), "first command at C");
    let read = session.read16(0, 0, 8);
    assert_eq!(read.status, GOOD);
    assert_eq!(read.data, std::fs::read(&first).unwrap()[..4096]);
    let second = pattern_file(dir.path(), 8);
    write_lun(&second, &url(&c, "db")).assert_ok("write through C");
    let owned = ownership(&a, "mirrored");
    assert_eq!(owned["owner"], id_c.as_str(), "{owned}");
    let failover_epoch = owned["owner_epoch"].as_u64().unwrap();

    // B comes back. Once C has seen it up for 3 s, C hands the target back: it ends the
    // session (the connection closes once its commands are answered) and releases the
    // vdisk. The hand-written initiator has no reconnect logic of its own, so the test
    // logs it in again at the portal it uses, C's, as open-iscsi or libiscsi would after
    // the connection dropped: C redirects it to B, which claims the target.
    b.restart();
    let messages = closed_by_target_within(&mut session, Duration::from_secs(40))
        .unwrap_or_else(|| panic!("C never ended the session:\n{}", c.log()));
    // Before closing, C said so in an Asynchronous Message (RFC 7143 11.9): AsyncEvent 2,
    // "the target will drop the connection" (CID 0, the test's), Time2Wait 0 (log in again
    // at once), Time2Retain 0 (no task kept), numbered like any status it sends.
    assert_eq!(messages.len(), 1, "one Async Message before the close");
    let message = &messages[0].bhs;
    assert_eq!(message.0[36], async_event::DROPPING_CONNECTION);
    assert_eq!(
        (message.u16_at(38), message.u16_at(40), message.u16_at(42)),
        (0, 0, 0),
        "CID, Time2Wait, Time2Retain"
    );
    let last_stat_sn = session.last_stat_sn.expect("the session had answers");
    assert_eq!(message.u32_at(24), last_stat_sn + 1, "the next StatSN");
    assert_eq!(message.u32_at(28), session.next_cmd_sn(), "ExpCmdSN");
    assert!(c.log().contains("handing the target back"), "{}", c.log());
    // A login made while C releases the target waits for it; the release is logged.
    assert!(
        wait_until(Duration::from_secs(10), || c
            .log()
            .contains("target handed back")),
        "{}",
        c.log()
    );
    match login_to(&c, "db") {
        Err(LoginError::Redirected { status, address }) => {
            assert_eq!(status, 0x0101, "target moved temporarily");
            assert_eq!(address, format!("127.0.0.1:{}", b.iscsi_port));
        }
        Err(other) => panic!("C must redirect the login to B: {other:?}"),
        Ok(_) => panic!("C still serves a target it handed back"),
    }
    let mut session = login_to(&b, "db").expect("login at B after the hand-back");
    assert_unit_attention(
        &session.read16(0, 0, 8),
        "first command at B after failback",
    );
    let read = session.read16(0, 0, 8);
    assert_eq!(read.status, GOOD);
    assert_eq!(
        read.data,
        std::fs::read(&second).unwrap()[..4096],
        "B serves the writes made through C"
    );
    drop(session);
    let owned = ownership(&a, "mirrored");
    assert_eq!(owned["owner"], id_b.as_str(), "{owned}");
    assert!(
        owned["owner_epoch"].as_u64() > Some(failover_epoch),
        "{owned}"
    );
    // libiscsi (qemu-img) configured with C's portal is redirected to B and reads every
    // acknowledged write.
    compare_lun(&second, &url(&c, "db")).assert_ok("read through C's portal after failback");
    assert_eq!(ownership(&a, "mirrored")["owner"], id_b.as_str());
}

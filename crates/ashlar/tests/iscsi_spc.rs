//! SPC-4 behaviour of the iSCSI target that needs more than one session or a node restart,
//! through the hand-written initiator: persistent reservations kept in the metadata store
//! across kill -9, unit attentions, NOP-In pings to quiet initiators, COMPARE AND WRITE
//! against concurrent writes, and CHAP for discovery sessions.

mod common;

use common::iscsi::{open, open_isid, target_iqn, Reply, Session, INITIATOR, INITIATOR_2};
use common::Node;
use std::time::{Duration, Instant};

const GOOD: u8 = 0x00;
const CHECK_CONDITION: u8 = 0x02;
const RESERVATION_CONFLICT: u8 = 0x18;

/// PERSISTENT RESERVE OUT service actions and types.
const REGISTER: u8 = 0;
const RESERVE: u8 = 1;
const RELEASE: u8 = 2;
const CLEAR: u8 = 3;
const PREEMPT: u8 = 4;
const WRITE_EXCLUSIVE: u8 = 1;
const WRITE_EXCLUSIVE_REGISTRANTS_ONLY: u8 = 5;

/// A node with group `group` holding vdisk `d0` of `size` as LUN 0, both test initiators
/// attached.
fn node_with_disk(group: &str, size: &str, extra_args: &[&str]) -> Node {
    let node = Node::start_with(extra_args);
    node.create_vdisk("d0", size);
    node.cli(&["vg", "create", group]).assert_ok("vg create");
    node.cli(&["vg", "add-disk", group, "d0"])
        .assert_ok("vg add-disk");
    for initiator in [INITIATOR, INITIATOR_2] {
        node.cli(&["vg", "attach", group, "--initiator", initiator])
            .assert_ok("vg attach");
    }
    node
}

fn session(node: &Node, group: &str, initiator: &str) -> Session {
    open(node.iscsi_port, initiator, Some(&target_iqn(group)))
}

/// Sense key, ASC and ASCQ of a fixed-format sense (from a response or REQUEST SENSE data).
fn sense_of(sense: &[u8]) -> (u8, u8, u8) {
    assert!(sense.len() >= 14, "fixed-format sense expected: {sense:?}");
    assert_eq!(
        sense[0] & 0x7f,
        0x70,
        "fixed format, current error: {sense:?}"
    );
    (sense[2] & 0x0f, sense[12], sense[13])
}

/// The command ended with CHECK CONDITION / UNIT ATTENTION and this ASC/ASCQ.
fn assert_unit_attention(reply: &Reply, asc: u8, ascq: u8, what: &str) {
    assert_eq!(reply.status, CHECK_CONDITION, "{what}: {reply:?}");
    assert_eq!(
        sense_of(&reply.sense),
        (0x06, asc, ascq),
        "{what}: {reply:?}"
    );
}

fn assert_good(reply: &Reply, what: &str) {
    assert_eq!(reply.status, GOOD, "{what}: {reply:?}");
}

fn block(byte: u8) -> Vec<u8> {
    vec![byte; 4096]
}

#[test]
fn persistent_reservations_survive_kill_9() {
    let mut node = node_with_disk("pr", "16M", &[]);
    let mut a = session(&node, "pr", INITIATOR);
    let mut b = session(&node, "pr", INITIATOR_2);
    assert_good(
        &a.pr_out(0, REGISTER, 0, 0, 0xaa, true),
        "A registers (APTPL)",
    );
    assert_good(
        &a.pr_out(0, RESERVE, WRITE_EXCLUSIVE, 0xaa, 0, false),
        "A reserves",
    );
    // B registers without APTPL: Ashlar keeps it all the same.
    assert_good(&b.pr_out(0, REGISTER, 0, 0, 0xbb, false), "B registers");
    assert_eq!(b.write16(0, 0, &block(1)).status, RESERVATION_CONFLICT);
    drop((a, b));

    node.kill9();
    node.restart();

    let mut a = session(&node, "pr", INITIATOR);
    let mut b = session(&node, "pr", INITIATOR_2);
    assert_eq!(
        b.write16(0, 0, &block(2)).status,
        RESERVATION_CONFLICT,
        "the reservation still holds after kill -9"
    );
    assert_good(&b.read16(0, 0, 8), "WRITE EXCLUSIVE lets others read");
    assert_good(&a.write16(0, 0, &block(3)), "the holder still writes");
    let keys = a.pr_in(0, 0);
    assert_good(&keys, "READ KEYS");
    let generation = u32::from_be_bytes(keys.data[0..4].try_into().unwrap());
    assert_eq!(generation, 2, "two REGISTERs");
    assert_eq!(&keys.data[4..8], &16u32.to_be_bytes(), "two keys");
    assert_eq!(&keys.data[8..16], &0xaau64.to_be_bytes());
    assert_eq!(&keys.data[16..24], &0xbbu64.to_be_bytes());
    let reservation = a.pr_in(0, 1);
    assert_good(&reservation, "READ RESERVATION");
    assert_eq!(&reservation.data[8..16], &0xaau64.to_be_bytes());
    assert_eq!(reservation.data[21] & 0x0f, WRITE_EXCLUSIVE);
    let capabilities = a.pr_in(0, 2);
    assert_good(&capabilities, "REPORT CAPABILITIES");
    assert_eq!(
        capabilities.data[2] & 0x01,
        1,
        "PTPL_C: persistence offered"
    );
    assert_eq!(
        capabilities.data[3] & 0x01,
        0,
        "PTPL_A: the last REGISTER (B's) had APTPL=0"
    );
    // Released and cleared: B writes again, and that too outlives a restart.
    assert_good(
        &a.pr_out(0, RELEASE, WRITE_EXCLUSIVE, 0xaa, 0, false),
        "release",
    );
    assert_good(&a.pr_out(0, CLEAR, 0, 0xaa, 0, false), "clear");
    drop((a, b));
    node.kill9();
    node.restart();
    let mut b = session(&node, "pr", INITIATOR_2);
    assert_good(&b.write16(0, 0, &block(4)), "nothing reserved after CLEAR");
    let keys = b.pr_in(0, 0);
    assert_eq!(&keys.data[4..8], &0u32.to_be_bytes(), "no keys after CLEAR");
}

#[test]
fn unit_attentions_after_resets_reservation_changes_and_resize() {
    let node = node_with_disk("ua", "16M", &[]);
    let mut a = session(&node, "ua", INITIATOR);
    let mut b = session(&node, "ua", INITIATOR_2);
    assert_good(&a.test_unit_ready(0), "no attention at first");

    // LOGICAL UNIT RESET: every nexus of the unit is told once, BUS DEVICE RESET FUNCTION
    // OCCURRED; INQUIRY and REPORT LUNS are not blocked, REQUEST SENSE reports and clears.
    assert_eq!(a.task_management(5, 0), 0, "LUN reset done");
    assert_unit_attention(&a.test_unit_ready(0), 0x29, 0x03, "A after LUN reset");
    assert_good(&a.test_unit_ready(0), "reported once");
    assert_good(
        &b.scsi(0, &[0x12, 0, 0, 0, 96, 0], &[], 96),
        "INQUIRY passes",
    );
    assert_good(
        &b.scsi(0, &[0xa0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0], &[], 256),
        "REPORT LUNS passes",
    );
    let sense = b.request_sense(0);
    assert_good(&sense, "REQUEST SENSE");
    assert_eq!(sense_of(&sense.data), (0x06, 0x29, 0x03), "{sense:?}");
    assert_eq!(sense_of(&b.request_sense(0).data), (0, 0, 0), "cleared");
    assert_good(&b.test_unit_ready(0), "B clear too");

    // PREEMPT removes A's registration: A (only) is told REGISTRATIONS PREEMPTED.
    assert_good(&a.pr_out(0, REGISTER, 0, 0, 0xa, false), "A registers");
    assert_good(&b.pr_out(0, REGISTER, 0, 0, 0xb, false), "B registers");
    assert_good(
        &a.pr_out(0, RESERVE, WRITE_EXCLUSIVE, 0xa, 0, false),
        "A reserves",
    );
    assert_good(
        &b.pr_out(0, PREEMPT, WRITE_EXCLUSIVE, 0xb, 0xa, false),
        "B preempts A",
    );
    assert_good(&b.test_unit_ready(0), "the preempting nexus is not told");
    assert_unit_attention(&a.write16(0, 0, &block(5)), 0x2a, 0x05, "A preempted");
    assert_eq!(
        a.write16(0, 0, &block(5)).status,
        RESERVATION_CONFLICT,
        "then the reservation applies"
    );

    // The holder changes the type (PREEMPT of its own key), then releases a registrants-only
    // reservation: registered A hears RESERVATIONS RELEASED each time.
    assert_good(
        &a.pr_out(0, REGISTER, 0, 0, 0xa2, false),
        "A registers again",
    );
    assert_good(
        &b.pr_out(
            0,
            PREEMPT,
            WRITE_EXCLUSIVE_REGISTRANTS_ONLY,
            0xb,
            0xb,
            false,
        ),
        "B changes the type",
    );
    assert_unit_attention(&a.test_unit_ready(0), 0x2a, 0x04, "type changed");
    assert_good(
        &b.pr_out(0, RELEASE, WRITE_EXCLUSIVE_REGISTRANTS_ONLY, 0xb, 0, false),
        "B releases",
    );
    assert_unit_attention(&a.test_unit_ready(0), 0x2a, 0x04, "released");
    // CLEAR: every other registrant hears RESERVATIONS PREEMPTED.
    assert_good(&b.pr_out(0, CLEAR, 0, 0xb, 0, false), "B clears");
    assert_unit_attention(&a.test_unit_ready(0), 0x2a, 0x03, "cleared");
    assert_good(&b.test_unit_ready(0), "the clearing nexus is not told");

    // vdisk resize: CAPACITY DATA HAS CHANGED for every nexus, and the new capacity.
    node.cli(&["vdisk", "resize", "d0", "--size", "32M"])
        .assert_ok("vdisk resize");
    assert_unit_attention(&a.test_unit_ready(0), 0x2a, 0x09, "A after resize");
    let sense = b.request_sense(0);
    assert_eq!(sense_of(&sense.data), (0x06, 0x2a, 0x09), "B after resize");
    let capacity = a.scsi(0, &[0x25, 0, 0, 0, 0, 0, 0, 0, 0, 0], &[], 8);
    assert_good(&capacity, "READ CAPACITY");
    assert_eq!(
        u32::from_be_bytes(capacity.data[0..4].try_into().unwrap()),
        (32 << 20) / 512 - 1
    );

    // TARGET WARM RESET: every nexus is told POWER ON, RESET, OR BUS DEVICE RESET OCCURRED.
    assert_eq!(b.task_management(6, 0), 0, "target warm reset done");
    assert_unit_attention(&a.test_unit_ready(0), 0x29, 0x00, "A after target reset");
    assert_unit_attention(&b.test_unit_ready(0), 0x29, 0x00, "B after target reset");
    assert_good(&a.test_unit_ready(0), "A clear");
    assert_good(&b.test_unit_ready(0), "B clear");
}

#[test]
fn nop_in_pings_drop_an_initiator_that_stops_answering() {
    let node = node_with_disk(
        "nop",
        "16M",
        &["--iscsi-nop-interval-s", "1", "--iscsi-nop-timeout-s", "2"],
    );
    let mut alive = session(&node, "nop", INITIATOR);
    let mut silent = session(&node, "nop", INITIATOR_2);
    // The silent one leaves a write waiting for its data: it must be aborted, not kept.
    let mut cdb = vec![0x8a, 0];
    cdb.extend_from_slice(&0u64.to_be_bytes());
    cdb.extend_from_slice(&128u32.to_be_bytes());
    cdb.extend_from_slice(&[0, 0]);
    send_write_without_data(&mut silent, &cdb, 128 * 512);

    let started = Instant::now();
    let mut pings = 0;
    while started.elapsed() < Duration::from_secs(6) {
        let ping = alive.next_ping();
        assert_ne!(ping.bhs.u32_at(20), 0xffff_ffff, "a ping wants an answer");
        alive.answer_ping(&ping);
        pings += 1;
    }
    assert!(pings >= 2, "pinged every second or so: {pings} pings");
    assert!(
        silent.raw.closed_by_target(),
        "the connection that stopped answering is dropped"
    );
    assert_good(
        &alive.write16(0, 0, &block(7)),
        "the other session carries on",
    );
    let read = alive.read16(0, 0, 8);
    assert_good(&read, "read back");
    assert_eq!(read.data, block(7));
    assert!(
        node.log().contains("did not answer a NOP-In ping"),
        "the drop is logged"
    );
}

/// Sends a WRITE with no immediate data and takes the R2T, never sending the data.
fn send_write_without_data(session: &mut Session, cdb: &[u8], length: u32) {
    use ashlar_iscsi::pdu::{op, Bhs, Pdu};
    let mut bhs = Bhs::new(op::SCSI_COMMAND);
    bhs.set_flags(0x80 | 0x20 | 0x01);
    bhs.set_itt(0x7777);
    bhs.set_u32_at(20, length);
    bhs.set_u32_at(24, 1); // the session's first CmdSN
    bhs.0[32..32 + cdb.len()].copy_from_slice(cdb);
    session
        .raw
        .send(&Pdu::new(bhs, bytes::Bytes::new()))
        .unwrap();
    let r2t = session.raw.recv().expect("an R2T");
    assert_eq!(r2t.bhs.opcode(), op::R2T);
}

#[test]
fn compare_and_write_is_atomic_against_concurrent_writes() {
    let node = node_with_disk("caw", "16M", &[]);
    let port = node.iscsi_port;
    let target = target_iqn("caw");
    let a = block(0xaa);
    let b = block(0xbb);
    let mut writer = open_isid(port, INITIATOR, &target, 1);
    assert_good(&writer.write16(0, 0, &a), "start from A");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // COMPARE AND WRITE A -> A: changes nothing if atomic. Were a write to slip between
    // its compare and its write, it would put back A over the writer's B.
    let comparers: Vec<_> = (1..=2u8)
        .map(|isid| {
            let (target, a, stop) = (target.clone(), a.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut session = open_isid(port, INITIATOR_2, &target, isid);
                let (mut matched, mut miscompared) = (0u32, 0u32);
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let reply = session.compare_and_write(0, 0, &a, &a);
                    match reply.status {
                        GOOD => matched += 1,
                        CHECK_CONDITION if reply.sense[2] & 0x0f == 0x0e => miscompared += 1,
                        _ => panic!("COMPARE AND WRITE: {reply:?}"),
                    }
                }
                (matched, miscompared)
            })
        })
        .collect();
    let mut rounds = 0;
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(8) {
        for (pattern, name) in [(&b, "B"), (&a, "A")] {
            assert_good(&writer.write16(0, 0, pattern), "write");
            let read = writer.read16(0, 0, 8);
            assert_good(&read, "read");
            assert!(
                read.data == *pattern,
                "round {rounds}: wrote {name}, then read {:#x}: a COMPARE AND WRITE \
                 interleaved with the write",
                read.data[0]
            );
        }
        rounds += 1;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (mut matched, mut miscompared) = (0, 0);
    for comparer in comparers {
        let (m, x) = comparer.join().expect("comparer thread");
        matched += m;
        miscompared += x;
    }
    println!(
        "{rounds} write rounds; COMPARE AND WRITE matched {matched}, miscompared {miscompared}"
    );
    assert!(rounds > 20, "the writer made progress: {rounds}");
    assert!(
        matched > 0 && miscompared > 0,
        "both outcomes happened: {matched} matched, {miscompared} miscompared"
    );
}

#[test]
fn discovery_chap_is_node_wide_and_survives_a_restart() {
    use common::iscsi::{login, LoginError, LoginSpec};
    let mut node = node_with_disk("disc", "16M", &[]);
    let port = node.iscsi_port;
    let discovery = |chap: Option<(&'static str, &'static str)>| {
        login(
            port,
            &LoginSpec {
                initiator: INITIATOR,
                target: None,
                chap,
                mutual: None,
                digests: false,
            },
        )
    };
    // Open by default.
    let mut open_session = discovery(None).expect("discovery without CHAP");
    assert!(open_session
        .send_targets()
        .contains(&("TargetName".to_string(), target_iqn("disc"))));
    node.cli(&["vg", "discovery-auth", "--chap", "disc:short"])
        .assert_cli_error("secret");
    node.cli(&["vg", "discovery-auth", "--chap", "disc:discovery-secret"])
        .assert_ok("vg discovery-auth --chap");
    let shown = node.cli(&["vg", "discovery-auth"]);
    shown.assert_ok("vg discovery-auth");
    assert!(shown.stdout.contains("CHAP user disc"), "{}", shown.stdout);
    assert!(
        !shown.stdout.contains("discovery-secret"),
        "{}",
        shown.stdout
    );

    node.sigterm_and_wait();
    node.restart();
    let refused = |result: Result<Session, LoginError>, what: &str| match result {
        Err(LoginError::Status(status)) => assert_eq!(status, 0x0201, "{what}"),
        Err(other) => panic!("{what}: {other:?}"),
        Ok(_) => panic!("{what}: logged in"),
    };
    refused(discovery(None), "no CHAP");
    refused(
        discovery(Some(("disc", "wrong-secret-123"))),
        "wrong secret",
    );
    let mut authenticated = discovery(Some(("disc", "discovery-secret"))).expect("right secret");
    assert!(authenticated
        .send_targets()
        .contains(&("TargetName".to_string(), target_iqn("disc"))));
    // Normal sessions follow their group's attachment (no CHAP here).
    let mut normal = session(&node, "disc", INITIATOR_2);
    assert_good(&normal.test_unit_ready(0), "normal session without CHAP");
    node.cli(&["vg", "discovery-auth", "--off"])
        .assert_ok("vg discovery-auth --off");
    discovery(None).expect("open again");
}

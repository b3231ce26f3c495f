//! The iSCSI target end to end: volume groups through the CLI, real initiators (libiscsi's
//! iscsi-ls, iscsi-inq, iscsi-readcapacity16 and iscsi-test-cu, qemu-img), login refusals
//! with their status codes, hostile PDUs beside a working session, and a Linux host attach
//! where the kernel allows it.

mod common;

use common::iscsi::{login, open, target_iqn, LoginError, LoginSpec, Raw, INITIATOR, INITIATOR_2};
use common::{run_bounded, CmdOut, Node, Rng};
use std::collections::BTreeMap;

/// qemu-img's initiator name when none is configured.
const QEMU_INITIATOR: &str = "iqn.2008-11.org.linux-kvm";

fn portal(node: &Node) -> String {
    format!("127.0.0.1:{}", node.iscsi_port)
}

fn url(node: &Node, group: &str, lun: u16) -> String {
    format!("iscsi://{}/{}/{lun}", portal(node), target_iqn(group))
}

/// A node with volume group `group` of the given vdisks, attached to both of libiscsi's test
/// initiators and qemu's.
fn node_with_group(group: &str, disks: &[(&str, &str)]) -> Node {
    let node = Node::start();
    for (name, size) in disks {
        node.create_vdisk(name, size);
    }
    node.cli(&["vg", "create", group]).assert_ok("vg create");
    for (name, _) in disks {
        node.cli(&["vg", "add-disk", group, name])
            .assert_ok("vg add-disk");
    }
    for initiator in [INITIATOR, INITIATOR_2, QEMU_INITIATOR] {
        node.cli(&["vg", "attach", group, "--initiator", initiator])
            .assert_ok("vg attach");
    }
    node
}

fn tool(program: &str, args: &[&str], secs: u64) -> CmdOut {
    CmdOut::from_output(run_bounded(program, args, secs))
}

#[test]
fn volume_group_cli_and_api() {
    let node = Node::start();
    node.create_vdisk("a", "16M");
    node.create_vdisk("b", "16M");
    node.cli(&["vg", "create", "db"]).assert_ok("vg create");
    node.cli(&["vg", "create", "db"])
        .assert_cli_error("already exists");
    node.cli(&["vg", "create", "Bad_Name"])
        .assert_cli_error("invalid volume group name");
    node.cli(&["vg", "add-disk", "db", "b"]).assert_ok("add b");
    node.cli(&["vg", "add-disk", "db", "a"]).assert_ok("add a");
    node.cli(&["vg", "add-disk", "db", "a"])
        .assert_cli_error("already in volume group");
    node.cli(&["vg", "add-disk", "db", "nope"])
        .assert_cli_error("nope");
    node.cli(&[
        "vg",
        "attach",
        "db",
        "--initiator",
        "iqn.1994-05.com.redhat:h1",
        "--chap",
        "user:secret-secret",
        "--mutual-chap",
        "target:other-secret-1",
    ])
    .assert_ok("vg attach");
    node.cli(&["vg", "attach", "db", "--initiator", "h1"])
        .assert_cli_error("invalid initiator name");
    node.cli(&[
        "vg",
        "attach",
        "db",
        "--initiator",
        "iqn.x:y",
        "--chap",
        "u:short",
    ])
    .assert_cli_error("secret");
    let shown = node.cli(&["vg", "show", "db", "--json"]);
    shown.assert_ok("vg show");
    let group: serde_json::Value = serde_json::from_str(&shown.stdout).unwrap();
    assert_eq!(group["iqn"], target_iqn("db"));
    assert_eq!(
        group["disks"],
        serde_json::json!(["b", "a"]),
        "LUN order kept"
    );
    assert_eq!(group["attachments"][0]["chap_user"], "user");
    assert_eq!(group["attachments"][0]["mutual_chap_user"], "target");
    assert!(
        !shown.stdout.contains("secret-secret"),
        "secrets never leave the node: {}",
        shown.stdout
    );
    let human = node.cli(&["vg", "show", "db"]);
    human.assert_ok("vg show");
    assert!(human.stdout.contains("lun 0:    b"), "{}", human.stdout);
    let list = node.cli(&["vg", "list"]);
    list.assert_ok("vg list");
    assert!(list.stdout.contains(&target_iqn("db")), "{}", list.stdout);
    // The records live in the metadata store: they survive a restart.
    node_restart_keeps_groups(node);
}

fn node_restart_keeps_groups(mut node: Node) {
    node.sigterm_and_wait();
    node.restart();
    let shown = node.cli(&["vg", "show", "db", "--json"]);
    shown.assert_ok("vg show after restart");
    let group: serde_json::Value = serde_json::from_str(&shown.stdout).unwrap();
    assert_eq!(group["disks"], serde_json::json!(["b", "a"]));
    node.cli(&["vg", "remove-disk", "db", "b"])
        .assert_ok("remove-disk");
    node.cli(&["vg", "remove-disk", "db", "b"])
        .assert_cli_error("not found");
    node.cli(&[
        "vg",
        "detach",
        "db",
        "--initiator",
        "iqn.1994-05.com.redhat:h1",
    ])
    .assert_ok("detach");
    node.cli(&["vg", "delete", "db"]).assert_ok("delete");
    node.cli(&["vg", "show", "db"])
        .assert_cli_error("not found");
    let (status, _) = node.http_get("/api/v1/volume-groups");
    assert_eq!(status, 200);
}

#[test]
fn libiscsi_tools_see_the_target() {
    let node = node_with_group("tools", &[("d0", "64M"), ("d1", "32M")]);
    node.create_vdisk("hidden", "16M");
    node.cli(&["vg", "create", "other"]).assert_ok("vg create");
    node.cli(&["vg", "add-disk", "other", "hidden"])
        .assert_ok("add");
    let ls = tool(
        "iscsi-ls",
        &["-i", INITIATOR, "-s", &format!("iscsi://{}", portal(&node))],
        30,
    );
    ls.assert_ok("iscsi-ls");
    assert!(ls.stdout.contains(&target_iqn("tools")), "{}", ls.stdout);
    assert!(
        !ls.stdout.contains(&target_iqn("other")),
        "discovery lists only groups the initiator is attached to: {}",
        ls.stdout
    );
    assert!(ls.stdout.contains("Lun:0"), "{}", ls.stdout);
    assert!(ls.stdout.contains("Lun:1"), "{}", ls.stdout);
    let stranger = tool(
        "iscsi-ls",
        &[
            "-i",
            "iqn.2000-01.com.example:stranger",
            &format!("iscsi://{}", portal(&node)),
        ],
        30,
    );
    assert!(
        !stranger.stdout.contains("iqn.2024-01.io.ashlar"),
        "an unattached initiator discovers nothing: {}",
        stranger.stdout
    );
    let inq = tool("iscsi-inq", &["-i", INITIATOR, &url(&node, "tools", 0)], 30);
    inq.assert_ok("iscsi-inq");
    assert!(inq.stdout.contains("Vendor:ASHLAR"), "{}", inq.stdout);
    let vpd = tool(
        "iscsi-inq",
        &[
            "-i",
            INITIATOR,
            "-e",
            "1",
            "-c",
            "178",
            &url(&node, "tools", 0),
        ],
        30,
    );
    vpd.assert_ok("iscsi-inq VPD 0xB2");
    assert!(vpd.stdout.contains("lbpu:1"), "{}", vpd.stdout);
    assert!(vpd.stdout.contains("provisioning type:2"), "{}", vpd.stdout);
    let cap = tool(
        "iscsi-readcapacity16",
        &["-i", INITIATOR, &url(&node, "tools", 1)],
        30,
    );
    cap.assert_ok("iscsi-readcapacity16");
    assert!(
        cap.stdout.contains(&format!("Total size:{}", 32 << 20)),
        "{}",
        cap.stdout
    );
    assert!(cap.stdout.contains("LBPME:1"), "{}", cap.stdout);
}

#[test]
fn qemu_img_converts_to_and_from_iscsi() {
    let node = node_with_group("qemu", &[("img", "24M")]);
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("source.raw");
    let back = dir.path().join("back.raw");
    let mut rng = Rng::new(8);
    let mut image = vec![0u8; 24 << 20];
    // Data with holes, so zero detection and sparse writes are exercised too.
    for chunk in image.chunks_mut(1 << 20).step_by(2) {
        rng.fill(chunk);
    }
    std::fs::write(&source, &image).unwrap();
    let target = url(&node, "qemu", 0);
    let to = tool(
        "qemu-img",
        &[
            "convert",
            "-n",
            "-f",
            "raw",
            "-O",
            "raw",
            source.to_str().unwrap(),
            &target,
        ],
        120,
    );
    assert!(
        !to.stderr.contains("Unable to load module iscsi"),
        "qemu-img has no iSCSI driver: install qemu-block-extra (CI's .ci/run does)"
    );
    to.assert_ok("qemu-img convert file -> iscsi");
    let from = tool(
        "qemu-img",
        &[
            "convert",
            "-f",
            "raw",
            "-O",
            "raw",
            &target,
            back.to_str().unwrap(),
        ],
        120,
    );
    from.assert_ok("qemu-img convert iscsi -> file");
    assert!(
        std::fs::read(&back).unwrap() == image,
        "the image read back over iSCSI differs"
    );
    let compare = tool(
        "qemu-img",
        &[
            "compare",
            "-f",
            "raw",
            "-F",
            "raw",
            source.to_str().unwrap(),
            &target,
        ],
        120,
    );
    compare.assert_ok("qemu-img compare file iscsi");
}

/// A vdisk of one shard runs on one reactor; sessions are accepted round-robin over the
/// node's two, so some log in on the other one and must move next to the shard after their
/// login (served where they landed, every command would cross reactors). Every session,
/// moved or not, reads and writes correctly.
#[test]
fn sessions_move_next_to_their_shards_and_keep_working() {
    let node = Node::start_with(&["--default-shards", "1"]);
    node.create_vdisk("one", "8M");
    node.cli(&["vg", "create", "moving"]).assert_ok("vg create");
    node.cli(&["vg", "add-disk", "moving", "one"])
        .assert_ok("vg add-disk");
    node.cli(&["vg", "attach", "moving", "--initiator", QEMU_INITIATOR])
        .assert_ok("vg attach");
    let dir = tempfile::tempdir().unwrap();
    let target = url(&node, "moving", 0);
    let mut rng = Rng::new(21);
    for round in 0..4 {
        let source = dir.path().join(format!("source{round}.raw"));
        let mut image = vec![0u8; 8 << 20];
        rng.fill(&mut image);
        std::fs::write(&source, &image).unwrap();
        let source = source.to_str().unwrap();
        tool(
            "qemu-img",
            &["convert", "-n", "-f", "raw", "-O", "raw", source, &target],
            120,
        )
        .assert_ok(&format!("round {round}: qemu-img convert file -> iscsi"));
        tool(
            "qemu-img",
            &["compare", "-f", "raw", "-F", "raw", source, &target],
            120,
        )
        .assert_ok(&format!("round {round}: qemu-img compare file iscsi"));
    }
    let moved = node
        .log()
        .matches("iSCSI session moved next to its shards")
        .count();
    assert!(
        moved >= 2,
        "of 8 sessions alternating over 2 reactors, {moved} moved to the shard's reactor"
    );
}

#[test]
fn login_refusals_have_the_right_status() {
    let node = node_with_group("secure", &[("s", "16M")]);
    node.cli(&[
        "vg",
        "attach",
        "secure",
        "--initiator",
        "iqn.2000-01.com.example:chap",
        "--chap",
        "alice:alice-secret-1",
        "--mutual-chap",
        "target:target-secret-1",
    ])
    .assert_ok("attach with CHAP");
    let target = target_iqn("secure");
    let spec = |initiator, chap, mutual| LoginSpec {
        initiator,
        target: Some(target.as_str()),
        chap,
        mutual,
        digests: false,
    };
    let status = |result: Result<common::iscsi::Session, LoginError>| match result {
        Ok(_) => 0,
        Err(LoginError::Status(status)) => status,
        Err(other) => panic!("login broke: {other:?}"),
    };
    let chap_initiator = "iqn.2000-01.com.example:chap";
    assert_eq!(
        status(login(
            node.iscsi_port,
            &spec(chap_initiator, Some(("alice", "alice-secret-1")), None)
        )),
        0,
        "right secret"
    );
    assert_eq!(
        status(login(
            node.iscsi_port,
            &spec(
                chap_initiator,
                Some(("alice", "alice-secret-1")),
                Some(("target", "target-secret-1"))
            )
        )),
        0,
        "mutual CHAP, the target proves itself"
    );
    assert_eq!(
        status(login(
            node.iscsi_port,
            &spec(chap_initiator, Some(("alice", "wrong-secret-99")), None)
        )),
        0x0201,
        "wrong CHAP secret: authentication failure"
    );
    assert_eq!(
        status(login(node.iscsi_port, &spec(chap_initiator, None, None))),
        0x0201,
        "CHAP required but not offered"
    );
    assert_eq!(
        status(login(
            node.iscsi_port,
            &spec("iqn.2000-01.com.example:stranger", None, None)
        )),
        0x0202,
        "unknown initiator: authorization failure"
    );
    let unknown = LoginSpec {
        initiator: INITIATOR,
        target: Some("iqn.2024-01.io.ashlar:nope"),
        chap: None,
        mutual: None,
        digests: false,
    };
    assert_eq!(
        status(login(node.iscsi_port, &unknown)),
        0x0203,
        "unknown target: not found"
    );
    // libiscsi's view: the wrong secret and the unknown initiator fail, the right one works.
    let with_secret = |secret: &str| {
        format!(
            "iscsi://alice%{secret}@{}/{}/0",
            portal(&node),
            target_iqn("secure")
        )
    };
    tool(
        "iscsi-inq",
        &["-i", chap_initiator, &with_secret("alice-secret-1")],
        30,
    )
    .assert_ok("iscsi-inq with CHAP");
    let wrong = tool(
        "iscsi-inq",
        &["-i", chap_initiator, &with_secret("wrong-secret-99")],
        30,
    );
    assert!(
        !wrong.status.success(),
        "wrong secret accepted: {}",
        wrong.stdout
    );
    let stranger = tool(
        "iscsi-inq",
        &[
            "-i",
            "iqn.2000-01.com.example:stranger",
            &url(&node, "secure", 0),
        ],
        30,
    );
    assert!(!stranger.status.success(), "unknown initiator accepted");
}

#[test]
fn raw_session_reads_writes_and_discovers() {
    let node = node_with_group("raw", &[("r0", "16M"), ("r1", "16M")]);
    let target = target_iqn("raw");
    let mut discovery = open(node.iscsi_port, INITIATOR, None);
    let listed = discovery.send_targets();
    assert!(
        listed
            .iter()
            .any(|(k, v)| k == "TargetName" && *v == target),
        "{listed:?}"
    );
    assert!(listed
        .iter()
        .any(|(k, v)| k == "TargetAddress" && v.starts_with(&portal(&node))));
    let mut session = open(node.iscsi_port, INITIATOR, Some(&target));
    assert_eq!(session.ping(b"hello"), b"hello");
    let mut rng = Rng::new(3);
    // 192 KiB: immediate data for the first 64 KiB, then R2T bursts.
    let data = rng.bytes(192 << 10);
    assert_eq!(session.write16(1, 8, &data).status, 0);
    let read = session.read16(1, 8, (data.len() / 512) as u32);
    assert_eq!(read.status, 0);
    assert!(read.data == data, "LUN 1 reads back what was written");
    let other = session.read16(0, 8, 1);
    assert!(other.data.iter().all(|&b| b == 0), "LUN 0 is another vdisk");
    // Past the end: CHECK CONDITION, ILLEGAL REQUEST, LBA OUT OF RANGE.
    let past = session.read16(0, (16 << 20) / 512, 1);
    assert_eq!(past.status, 0x02);
    assert_eq!(past.sense[2] & 0x0f, 0x05);
    assert_eq!((past.sense[12], past.sense[13]), (0x21, 0x00));
    // A LUN the target lacks.
    let missing = session.scsi(9, &[0, 0, 0, 0, 0, 0], &[], 0);
    assert_eq!(missing.status, 0x02);
    assert_eq!((missing.sense[12], missing.sense[13]), (0x25, 0x00));
    // The same with CRC32C header and data digests on every PDU.
    let with_digests = LoginSpec {
        initiator: INITIATOR_2,
        target: Some(&target),
        chap: None,
        mutual: None,
        digests: true,
    };
    let mut digested = login(node.iscsi_port, &with_digests)
        .unwrap_or_else(|e| panic!("login with digests: {e:?}"));
    assert_eq!(digested.ping(b"crc"), b"crc");
    let read = digested.read16(1, 8, (data.len() / 512) as u32);
    assert!(read.data == data, "read with digests");
    assert_eq!(digested.write16(1, 0, &data[..8192]).status, 0);
    // Solicited Data-Out with digests (read straight into the transfer's buffer).
    let rewritten = rng.bytes(192 << 10);
    assert_eq!(digested.write16(1, 64, &rewritten).status, 0);
    assert!(
        digested.read16(1, 64, 384).data == rewritten,
        "write with digests"
    );
    // A Data-Out with a corrupted data digest ends that connection only; its write changes
    // nothing.
    digested.write16_with_bad_data_out_digest(1, 64, &rng.bytes(192 << 10));
    assert!(digested.raw.closed_by_target(), "bad Data-Out data digest");
    assert!(
        session.read16(1, 64, 384).data == rewritten,
        "the bad write wrote nothing"
    );
    let mut digested = login(node.iscsi_port, &with_digests)
        .unwrap_or_else(|e| panic!("login with digests again: {e:?}"));
    // So does a corrupted data digest on a PDU read whole (a NOP-Out).
    let mut bhs = ashlar_iscsi::pdu::Bhs::new(ashlar_iscsi::pdu::op::NOP_OUT);
    bhs.0[0] |= 0x40;
    bhs.set_flags(0x80);
    bhs.set_itt(99);
    let mut wire = ashlar_iscsi::pdu::encode(
        &ashlar_iscsi::pdu::Pdu::new(bhs, bytes::Bytes::from_static(b"abcd")),
        digested.raw.digests,
    )
    .to_vec();
    let last = wire.len() - 1;
    wire[last] ^= 0xff;
    use std::io::Write;
    digested.raw.stream.write_all(&wire).unwrap();
    assert!(digested.raw.closed_by_target(), "bad data digest");
    assert_eq!(session.ping(b"unaffected"), b"unaffected");
    // A new login with the same initiator name and ISID reinstates the session: the old
    // connection is closed, the new one works.
    let mut again = open(node.iscsi_port, INITIATOR, Some(&target));
    assert!(session.raw.closed_by_target(), "the old session ends");
    assert_eq!(again.ping(b"new"), b"new");
    // LBA 16 still holds what the first write put there (the digest session rewrote 0..16).
    assert_eq!(again.read16(1, 16, 1).data, data[4096..4608]);
}

/// Garbage on some connections never disturbs a session on another.
#[test]
fn hostile_pdus_are_refused_and_others_keep_working() {
    let node = node_with_group("hostile", &[("h", "16M")]);
    let target = target_iqn("hostile");
    let mut good = open(node.iscsi_port, INITIATOR, Some(&target));
    let payload = vec![0x5au8; 4096];
    assert_eq!(good.write16(0, 0, &payload).status, 0);
    let mut rng = Rng::new(77);
    let mut attacks: Vec<(&str, Vec<u8>)> = vec![
        ("zeros", vec![0u8; 48]),
        ("a SCSI command before login", {
            let mut b = vec![0u8; 48];
            b[0] = 0x01;
            b
        }),
        ("a 16 MiB data segment announced", {
            let mut b = vec![0u8; 48];
            b[0] = 0x43;
            b[5..8].copy_from_slice(&[0xff, 0xff, 0xff]);
            b
        }),
        ("login with a bad stage and version", {
            let mut b = vec![0u8; 48];
            b[0] = 0x43;
            b[1] = 0x80 | 0x0c | 0x02;
            b[3] = 9;
            b
        }),
        ("half a header", vec![0x43u8; 20]),
    ];
    for i in 0..20 {
        let mut bytes = rng.bytes(48 + (i * 37) % 300);
        if i % 2 == 0 {
            bytes[0] = 0x43; // looks like a login
            bytes[4] = 0;
            bytes[5] = 0;
        }
        attacks.push(("random bytes", bytes));
    }
    for (what, bytes) in &attacks {
        let mut raw = Raw::connect(node.iscsi_port);
        use std::io::Write;
        let _ = raw.stream.write_all(bytes);
        let _ = raw.stream.shutdown(std::net::Shutdown::Write);
        assert!(
            raw.closed_by_target(),
            "the target kept a connection open after {what}"
        );
        // The good session is untouched after every attack.
        let read = good.read16(0, 0, 8);
        assert_eq!(read.status, 0, "after {what}");
        assert!(read.data == payload, "data changed after {what}");
    }
    // Hostile PDUs inside a logged-in session: an unknown opcode gets a Reject and the
    // session continues; a login in full feature phase ends only that session.
    let mut second = open(node.iscsi_port, INITIATOR_2, Some(&target));
    let mut bhs = ashlar_iscsi::pdu::Bhs::new(0x1c);
    bhs.set_itt(5);
    second
        .raw
        .send(&ashlar_iscsi::pdu::Pdu::new(bhs, bytes::Bytes::new()))
        .unwrap();
    let reject = second.raw.recv().expect("a Reject");
    assert_eq!(reject.bhs.opcode(), ashlar_iscsi::pdu::op::REJECT);
    assert_eq!(
        reject.bhs.0[2],
        ashlar_iscsi::pdu::reject::COMMAND_NOT_SUPPORTED
    );
    assert_eq!(second.ping(b"still here"), b"still here");
    let mut login_again = ashlar_iscsi::pdu::Bhs::new(0x03);
    login_again.0[0] |= 0x40;
    second
        .raw
        .send(&ashlar_iscsi::pdu::Pdu::new(
            login_again,
            bytes::Bytes::new(),
        ))
        .unwrap();
    assert!(second.raw.closed_by_target(), "login in full feature phase");
    assert_eq!(good.read16(0, 0, 8).status, 0);
    // Real initiators still get in.
    tool(
        "iscsi-inq",
        &["-i", INITIATOR, &url(&node, "hostile", 0)],
        30,
    )
    .assert_ok("iscsi-inq after the attacks");
    let mut node = node;
    node.assert_alive();
}

/// Families and suites of libiscsi's conformance tests, run one suite at a time.
#[test]
fn iscsi_test_cu_conformance() {
    common::require_tool("iscsi-test-cu");
    let node = node_with_group("cu", &[("cu0", "128M")]);
    let list = tool("iscsi-test-cu", &["--list"], 30);
    list.assert_ok("iscsi-test-cu --list");
    let suites: Vec<String> = list
        .stdout
        .lines()
        .filter(|l| {
            let parts: Vec<&str> = l.trim().split('.').collect();
            parts.len() == 2 && (parts[0] == "SCSI" || parts[0] == "iSCSI")
        })
        .map(|l| l.trim().to_string())
        .collect();
    assert!(suites.len() > 30, "suites listed: {suites:?}");
    // Tests that fail for a reason outside this target, with the reason.
    let known: BTreeMap<&str, &str> = [(
        "SCSI.GetLBAStatus.UnmapSingle",
        "expects the first descriptor of a request at LBA i+1 to start at i+8 (the next \
         physical block); SBC-3 5.5.2 says it starts at the requested LBA, as ours does",
    )]
    .into_iter()
    .collect();
    let target = url(&node, "cu", 0);
    #[derive(Default)]
    struct Count {
        run: u32,
        passed: u32,
        failed: u32,
        skipped: u32,
    }
    let mut families: BTreeMap<String, Count> = BTreeMap::new();
    let mut unexpected = Vec::new();
    for suite in &suites {
        let out = tool(
            "iscsi-test-cu",
            &["--dataloss", "-v", "--test", suite, &target],
            180,
        );
        assert!(
            out.status.code() != Some(124) && out.status.code() != Some(137),
            "{suite} hung (timeout):\n{}",
            out.stdout
        );
        let (run, passed, failed) = out
            .stdout
            .lines()
            .find(|l| l.trim_start().starts_with("tests"))
            .map(|l| {
                let n: Vec<u32> = l
                    .split_whitespace()
                    .filter_map(|w| w.parse().ok())
                    .collect();
                (n[1], n[2], n[3])
            })
            .unwrap_or_else(|| panic!("{suite}: no summary:\n{}\n{}", out.stdout, out.stderr));
        // Verbose output: "Test: NAME ..." then the test's messages; a test that printed
        // [SKIPPED] and passed did not really run.
        let skipped = out
            .stdout
            .split("Test: ")
            .skip(1)
            .filter(|chunk| chunk.contains("[SKIPPED]") && !chunk.contains("FAILED"))
            .count() as u32;
        let family = suite.split('.').next().unwrap().to_string();
        let count = families.entry(family).or_default();
        count.run += run;
        count.passed += passed;
        count.failed += failed;
        count.skipped += skipped;
        // "Suite X, Test Y had failures:" names each failed test.
        for line in out.stdout.lines().filter(|l| l.contains("had failures")) {
            let test = line
                .trim()
                .trim_start_matches("Suite ")
                .replace(", Test ", ".")
                .replace(" had failures:", "");
            let name = format!("{}.{test}", suite.split('.').next().unwrap());
            if !known.contains_key(name.as_str()) {
                unexpected.push(format!("{name}\n{}", out.stdout));
            }
        }
        println!(
            "{suite:<40} run {run:>3} passed {passed:>3} failed {failed:>2} skipped {skipped:>2}"
        );
    }
    for (family, c) in &families {
        println!(
            "FAMILY {family}: {} tests, {} passed, {} skipped by the suite (counted as passed by CUnit), {} failed",
            c.run,
            c.passed - c.skipped,
            c.skipped,
            c.failed
        );
    }
    for (name, why) in &known {
        println!("known failure {name}: {why}");
    }
    assert!(
        unexpected.is_empty(),
        "iscsi-test-cu failures:\n{}",
        unexpected.join("\n")
    );
}

/// Attaching the target to this Linux host needs the kernel's iSCSI initiator (iscsi_tcp).
#[test]
fn linux_host_attach_with_iscsiadm() {
    let kernel_initiator = std::path::Path::new("/sys/module/iscsi_tcp").exists()
        || std::path::Path::new("/sys/class/iscsi_transport/tcp").exists();
    if !kernel_initiator {
        // Nothing can load it either: this kernel ships no modules.
        let modules = std::path::Path::new("/lib/modules").exists();
        println!(
            "Linux host attach not possible here: the kernel has no iscsi_tcp module \
             (/sys/module/iscsi_tcp absent, /lib/modules {}), so open-iscsi cannot create a \
             session; the iSCSI target is covered by libiscsi and qemu-img instead",
            if modules { "present" } else { "absent" }
        );
        assert!(
            !modules,
            "kernel modules exist: load iscsi_tcp (modprobe iscsi_tcp) so this test can attach"
        );
        return;
    }
    common::require_tool("iscsiadm");
    common::require_tool("mkfs.ext4");
    let node = node_with_group("host", &[("fs", "64M")]);
    let name = std::fs::read_to_string("/etc/iscsi/initiatorname.iscsi")
        .expect("open-iscsi's initiator name")
        .lines()
        .find_map(|l| l.strip_prefix("InitiatorName=").map(str::to_string))
        .expect("InitiatorName= in /etc/iscsi/initiatorname.iscsi");
    node.cli(&["vg", "attach", "host", "--initiator", &name])
        .assert_ok("attach the host");
    let p = portal(&node);
    tool("iscsiadm", &["-m", "discovery", "-t", "st", "-p", &p], 60)
        .assert_ok("iscsiadm discovery");
    let target = target_iqn("host");
    tool(
        "iscsiadm",
        &["-m", "node", "-T", &target, "-p", &p, "--login"],
        60,
    )
    .assert_ok("iscsiadm login");
    let device = format!("/dev/disk/by-path/ip-{p}-iscsi-{target}-lun-0");
    let ok = common::wait_until(std::time::Duration::from_secs(20), || {
        std::path::Path::new(&device).exists()
    });
    let mkfs = tool("mkfs.ext4", &["-q", "-F", &device], 120);
    let logout = tool(
        "iscsiadm",
        &["-m", "node", "-T", &target, "-p", &p, "--logout"],
        60,
    );
    assert!(ok, "{device} did not appear");
    mkfs.assert_ok("mkfs.ext4 on the iSCSI disk");
    logout.assert_ok("iscsiadm logout");
}

/// Writes, zeroes and discards through qemu's libiscsi driver, each verified by reading the
/// pattern back (qemu-io checks it and reports "Pattern verification failed").
#[test]
fn qemu_io_writes_and_verifies_patterns() {
    let node = node_with_group("qio", &[("q", "32M")]);
    let target = url(&node, "qio", 0);
    let commands = [
        "write -P 0x5a 1M 3M",
        "read -P 0x5a 1M 3M",
        "write -P 0xa5 4095k 3k",
        "read -P 0xa5 4095k 3k",
        "read -P 0x5a 1M 3071k",
        "write -z 2M 512k",
        "read -P 0 2M 512k",
        "discard 1M 1M",
        "read -P 0 1M 1M",
        "aio_write -P 0x11 8M 64k",
        "aio_write -P 0x22 9M 64k",
        "aio_flush",
        "read -P 0x11 8M 64k",
        "read -P 0x22 9M 64k",
        "flush",
    ];
    let mut args = vec!["-f", "raw"];
    for command in &commands {
        args.push("-c");
        args.push(command);
    }
    args.push(&target);
    let out = tool("qemu-io", &args, 120);
    out.assert_ok("qemu-io");
    assert!(
        !out.stdout.contains("Pattern verification failed") && !out.stdout.contains("failed:"),
        "qemu-io found wrong data:\n{}",
        out.stdout
    );
    assert_eq!(
        out.stdout.matches("read ").count(),
        7,
        "every read ran:\n{}",
        out.stdout
    );
}

/// fio's libiscsi engine would be the load generator with verification, but Debian's fio
/// (3.33) is built without it; qemu-io and qemu-img drive libiscsi with verification instead.
/// This test notices when that changes.
#[test]
fn fio_has_no_libiscsi_engine_here() {
    let help = tool("fio", &["--enghelp"], 30);
    help.assert_ok("fio --enghelp");
    assert!(
        help.stdout.contains("libaio") || help.stdout.contains("psync"),
        "fio --enghelp lists its engines: {}",
        help.stdout
    );
    assert!(
        !help.stdout.contains("libiscsi"),
        "this fio has the libiscsi engine: add a fio --ioengine=libiscsi --verify test here"
    );
}

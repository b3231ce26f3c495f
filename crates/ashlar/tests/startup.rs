//! What a node does at startup with data it cannot account for, and with a vdisk it cannot
//! start: it never deletes the data, and it always starts and serves everything else.

mod common;

use common::nbd::NbdConn;
use common::{Node, Rng};

/// Writes a recognisable pattern through our NBD client and returns it.
fn write_pattern(node: &Node, vdisk: &str, seed: u64) -> Vec<u8> {
    let data = Rng::new(seed).bytes(256 * 1024);
    let mut conn = NbdConn::connect(node.nbd_addr(), vdisk).expect("connect");
    conn.write_ok(0, &data);
    conn.disconnect();
    data
}

/// `meta.redb` gone, its mirror there: the node writes it anew from the mirror and serves
/// every vdisk as before.
#[test]
fn a_lost_metadata_file_is_restored_from_its_mirror() {
    let mut node = Node::start();
    node.create_vdisk("keepme", "64M");
    let written = write_pattern(&node, "keepme", 5);
    node.sigterm_and_wait();

    std::fs::remove_file(node.data_dir.join("meta.redb")).expect("removing meta.redb");
    node.restart();
    let log = node.log();
    assert!(
        log.contains("the metadata store is missing; restoring it from its mirror"),
        "the node did not say it restored the store; log:\n{log}"
    );
    assert!(
        !log.contains("no vdisk in the catalog accounts for"),
        "{log}"
    );
    let mut conn = NbdConn::connect(node.nbd_addr(), "keepme").expect("connect");
    assert_eq!(conn.read_ok(0, written.len() as u32), written);
    conn.disconnect();
}

/// Both copies of the metadata store gone: nothing names the vdisk any more, and its data is
/// set aside, never deleted.
#[test]
fn losing_the_metadata_file_and_its_mirror_sets_data_aside_instead_of_deleting_it() {
    let mut node = Node::start();
    node.create_vdisk("keepme", "64M");
    let dir_name = node.vdisk_dir_name("keepme");
    let written = write_pattern(&node, "keepme", 7);
    node.sigterm_and_wait();

    for file in ["meta.redb", "meta.mirror.redb"] {
        std::fs::remove_file(node.data_dir.join(file)).expect("removing the store");
    }
    node.restart();

    let log = node.log();
    assert!(
        log.contains("no vdisk in the catalog accounts for"),
        "the node did not say it set data aside; log:\n{log}"
    );
    let quarantine = node.data_dir.join("disk0").join("quarantine");
    let aside: Vec<String> = std::fs::read_dir(&quarantine)
        .unwrap_or_else(|e| panic!("{} missing: {e}", quarantine.display()))
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        aside.iter().any(|n| n.contains(&format!("-{dir_name}-"))),
        "the vdisk's directories were not set aside: {aside:?}"
    );
    // The bytes are all there, in the oplog or the extent store files that were set aside.
    let files: Vec<_> = file_listing(&quarantine)
        .into_iter()
        .map(|(path, _)| path)
        .collect();
    for (i, needle) in written.chunks(4096).enumerate() {
        assert!(
            files.iter().any(|f| std::fs::read(f)
                .unwrap()
                .windows(needle.len())
                .any(|w| w == needle)),
            "block {i} of the written data is not in the set-aside files {files:?}"
        );
    }
    // The node serves: a new vdisk works.
    node.create_vdisk("fresh", "16M");
    write_pattern(&node, "fresh", 8);
}

#[test]
fn a_vdisk_that_cannot_start_is_offline_and_the_others_are_served() {
    let mut node = Node::start();
    node.create_vdisk("healthy", "64M");
    node.create_vdisk("broken", "64M");
    let healthy = write_pattern(&node, "healthy", 1);
    write_pattern(&node, "broken", 2);
    let broken_dir = node.vdisk_dir_name("broken");
    node.sigterm_and_wait();

    // Its oplog area becomes a plain file: nothing can replay or create a log there.
    let oplog = node.data_dir.join("disk0").join("oplog").join(&broken_dir);
    std::fs::remove_dir_all(&oplog).ok();
    std::fs::write(&oplog, b"not a directory").unwrap();
    node.restart();

    let shown = node.show("broken");
    assert_eq!(shown["state"], "offline", "broken vdisk: {shown}");
    assert!(
        shown["status"].as_str().is_some_and(|s| !s.is_empty()),
        "an offline vdisk says why: {shown}"
    );
    let listed = node.cli(&["vdisk", "list"]);
    listed.assert_ok("vdisk list");
    assert!(
        listed
            .stdout
            .lines()
            .any(|l| l.starts_with("broken") && l.contains("offline")),
        "vdisk list shows the state: {}",
        listed.stdout
    );
    assert!(
        NbdConn::connect(node.nbd_addr(), "broken").is_err(),
        "an offline vdisk must not be served"
    );
    assert_eq!(node.show("healthy")["state"], "online");
    let mut conn = NbdConn::connect(node.nbd_addr(), "healthy").expect("connect healthy");
    assert_eq!(conn.read_ok(0, healthy.len() as u32), healthy);
    conn.disconnect();
    // Its data was not touched, and the operator can still delete it.
    assert!(
        oplog.is_file(),
        "the broken vdisk's files must stay as they were"
    );
    node.cli(&["vdisk", "delete", "broken"])
        .assert_ok("deleting an offline vdisk");
}

/// Every file under `dir` with its size, sorted: what a start must leave alone.
fn file_listing(dir: &std::path::Path) -> Vec<(std::path::PathBuf, u64)> {
    let mut files = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let entry = entry.unwrap();
            if entry.file_type().unwrap().is_dir() {
                dirs.push(entry.path());
            } else {
                files.push((entry.path(), entry.metadata().unwrap().len()));
            }
        }
    }
    files.sort();
    files
}

/// Changes the vdisk's size inside its record in the store file at `path` (every copy of the
/// record: redb leaves older copies in pages it no longer uses), keeping valid JSON: only the
/// record's CRC can tell. Returns the file as it was.
fn damage_size_in_record(path: &std::path::Path) -> Vec<u8> {
    let intact = std::fs::read(path).unwrap();
    let needle = br#""name":"keepme","size_bytes":6"#;
    let mut damaged = intact.clone();
    let mut found = 0;
    for at in 0..intact.len().saturating_sub(needle.len()) {
        if &intact[at..at + needle.len()] == needle {
            damaged[at + needle.len() - 1] = b'3'; // 64 MiB reads as 34 MiB: valid, and wrong
            found += 1;
        }
    }
    assert!(found > 0, "the vdisk's record in {}", path.display());
    std::fs::write(path, &damaged).unwrap();
    intact
}

fn start_node_once(node: &Node) -> common::CmdOut {
    let (nbd, http) = (common::free_port(), common::free_port());
    common::ashlar(&[
        "node",
        "--data-dir",
        node.data_dir.to_str().unwrap(),
        "--nbd-listen",
        &format!("127.0.0.1:{nbd}"),
        "--http-listen",
        &format!("127.0.0.1:{http}"),
        "--iscsi-listen",
        &format!("127.0.0.1:{}", common::free_port()),
    ])
}

/// A byte changed inside a vdisk's record in `meta.redb` is caught by the record's CRC; the
/// node keeps the damaged file aside, restores the store from its mirror and serves the
/// vdisk with every byte written.
#[test]
fn a_damaged_metadata_record_is_restored_from_the_mirror() {
    let mut node = Node::start();
    node.create_vdisk("keepme", "64M");
    let written = write_pattern(&node, "keepme", 13);
    node.sigterm_and_wait();

    damage_size_in_record(&node.data_dir.join("meta.redb"));
    node.restart();
    let log = node.log();
    assert!(
        log.contains("the metadata store is damaged; restoring it from its mirror")
            && log.contains("CRC")
            && log.contains("keepme"),
        "the log does not say what was damaged and what was done; log:\n{log}"
    );
    let kept: Vec<_> = std::fs::read_dir(&node.data_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("meta.redb.damaged-"))
        .collect();
    assert_eq!(kept.len(), 1, "the damaged file was not kept aside");
    let mut conn = NbdConn::connect(node.nbd_addr(), "keepme").expect("connect");
    assert_eq!(conn.read_ok(0, written.len() as u32), written);
    conn.disconnect();
}

/// The same damage in `meta.redb` and in its mirror: the node refuses to start with one line
/// naming the file, the damage and the key, and touches no data; with the files restored,
/// every written byte reads back.
#[test]
fn a_metadata_record_damaged_in_both_copies_stops_the_node_before_it_touches_any_data() {
    let mut node = Node::start();
    node.create_vdisk("keepme", "64M");
    let written = write_pattern(&node, "keepme", 11);
    node.sigterm_and_wait();

    let meta = node.data_dir.join("meta.redb");
    let mirror = node.data_dir.join("meta.mirror.redb");
    let intact = damage_size_in_record(&meta);
    let intact_mirror = damage_size_in_record(&mirror);
    let disk = node.data_dir.join("disk0");
    let before = file_listing(&disk);

    let out = start_node_once(&node);
    assert_ne!(out.code(), Some(0), "the node started on a damaged store");
    let said = format!("{}{}", out.stdout, out.stderr);
    assert!(
        said.contains("meta.redb")
            && said.contains("CRC")
            && said.contains("keepme")
            && said.contains("meta.mirror.redb cannot replace it"),
        "the error does not name the file, the damage, the key and the mirror:\n{said}"
    );
    assert!(!said.contains("panicked"), "{said}");
    assert_eq!(
        file_listing(&disk),
        before,
        "a failed start changed the data"
    );

    std::fs::write(&mirror, &intact_mirror).unwrap();
    std::fs::write(&meta, &intact).unwrap();
    node.restart();
    let mut conn = NbdConn::connect(node.nbd_addr(), "keepme").expect("connect");
    assert_eq!(conn.read_ok(0, written.len() as u32), written);
    conn.disconnect();
}

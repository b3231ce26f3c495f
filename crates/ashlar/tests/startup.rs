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

#[test]
fn losing_the_metadata_file_sets_data_aside_instead_of_deleting_it() {
    let mut node = Node::start();
    node.create_vdisk("keepme", "64M");
    let dir_name = node.vdisk_dir_name("keepme");
    let written = write_pattern(&node, "keepme", 7);
    node.sigterm_and_wait();

    std::fs::remove_file(node.data_dir.join("meta.redb")).expect("removing meta.redb");
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
    let mut files = Vec::new();
    let mut dirs = vec![quarantine.clone()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else {
                files.push(path);
            }
        }
    }
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

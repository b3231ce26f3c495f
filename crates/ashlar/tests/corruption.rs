//! A flipped byte in an extent group file: the read of that block fails with EIO (the bad data
//! is never returned), other blocks of the same extent still read correctly, and the node logs
//! the vdisk, offset and file.

mod common;

use common::nbd::{NbdConn, EIO};
use common::{describe, run_bounded, CmdOut, Node, Rng, MIB};
use std::os::unix::fs::FileExt;

const BLOCK: u64 = 4096;
/// The egroup header: one header block and four checksum blocks before the data.
const DATA_START: u64 = 5 * BLOCK;

#[test]
fn flipped_byte_in_extent_file_gives_eio_and_a_log_line() {
    let mut node = Node::start();
    node.create_vdisk("corrupt", "64M");
    let data = Rng::new(99).bytes(MIB as usize);
    {
        // 1 MiB at offset 0, aligned: it bypasses the oplog into the extent store.
        let mut conn = NbdConn::connect(node.nbd_addr(), "corrupt").unwrap();
        conn.write_ok(0, &data);
        assert_eq!(conn.read_ok(0, MIB as u32), data);
        conn.disconnect();
    }
    let dir_name = node.vdisk_dir_name("corrupt");
    // Stop cleanly so nothing is cached or pending.
    let status = node.sigterm_and_wait();
    assert!(status.success(), "SIGTERM: {}", describe(&status));

    let egroup = node
        .data_dir
        .join("disk0/extents")
        .join(&dir_name)
        .join(format!("{:016x}.egroup", 0));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&egroup)
        .unwrap_or_else(|e| panic!("the egroup file {}: {e}", egroup.display()));
    // The documented layout: extent 0's data starts after the 20 KiB header.
    let mut on_disk = vec![0u8; MIB as usize];
    file.read_exact_at(&mut on_disk, DATA_START).unwrap();
    assert!(
        on_disk == data,
        "extent 0 of {} does not hold the written data at file offset {DATA_START}",
        egroup.display()
    );
    let mut byte = [0u8; 1];
    file.read_exact_at(&mut byte, DATA_START + 100).unwrap();
    file.write_all_at(&[byte[0] ^ 0x5a], DATA_START + 100)
        .unwrap();
    file.sync_all().unwrap();
    drop(file);

    node.restart();
    let mut conn = NbdConn::connect(node.nbd_addr(), "corrupt").unwrap();
    // The corrupted block: EIO, every time (the bad data must not have been cached).
    for _ in 0..2 {
        assert_eq!(
            conn.read(0, BLOCK as u32).unwrap(),
            Err(EIO),
            "reading the corrupted block must fail with EIO"
        );
    }
    // A read covering it fails too; a sub-block read inside it as well.
    assert_eq!(conn.read(0, MIB as u32).unwrap(), Err(EIO));
    assert_eq!(conn.read(96, 16).unwrap(), Err(EIO));
    // Other blocks of the same extent are fine.
    for block in [1u64, 7, 255] {
        let offset = block * BLOCK;
        assert_eq!(
            conn.read_ok(offset, BLOCK as u32),
            &data[offset as usize..(offset + BLOCK) as usize],
            "block {block} of the corrupted extent"
        );
    }
    assert_eq!(
        conn.read_ok(BLOCK, (MIB - BLOCK) as u32),
        &data[BLOCK as usize..],
        "the rest of the extent"
    );
    conn.disconnect();

    // A real client sees an I/O error too.
    let qemu = CmdOut::from_output(run_bounded(
        "qemu-io",
        &["-f", "raw", "-c", "read 0 4k", &node.uri("corrupt")],
        60,
    ));
    assert!(
        qemu.stderr.contains("Input/output error") || qemu.stdout.contains("Input/output error"),
        "qemu-io read of the corrupted block: {qemu:?}"
    );
    let qemu = CmdOut::from_output(run_bounded(
        "qemu-io",
        &["-f", "raw", "-c", "read 4k 4k", &node.uri("corrupt")],
        60,
    ));
    qemu.assert_ok("qemu-io read of a good block");

    node.assert_alive();
    let stats = node.vdisk_stats("corrupt");
    assert!(
        stats["errors"].as_u64().unwrap() >= 4,
        "failed reads are counted: {stats}"
    );
    // The log names the vdisk, the offset and the file.
    let log = node.log();
    let line = log
        .lines()
        .find(|l| l.contains(egroup.to_str().unwrap()))
        .unwrap_or_else(|| panic!("no log line names {}:\n{log}", egroup.display()));
    assert!(
        line.contains(&dir_name) || line.contains("corrupt"),
        "the line names the vdisk: {line}"
    );
    assert!(
        line.contains("offset=0") || line.contains("offset 0"),
        "{line}"
    );
    assert!(line.to_lowercase().contains("checksum"), "{line}");
}

/// A partial (sub-block) write acknowledged into a block whose old data is corrupt: the oplog
/// must still drain (no wedged writers, re-sharding and restarts keep working) and the block
/// must keep failing reads rather than serve a guessed remainder.
#[test]
fn partial_write_into_a_corrupt_block_does_not_wedge_the_oplog() {
    let mut node = Node::start();
    node.create_vdisk("c", "64M");
    {
        let mut conn = NbdConn::connect(node.nbd_addr(), "c").unwrap();
        conn.write_ok(0, &vec![0x11u8; MIB as usize]);
        conn.disconnect();
    }
    let dir_name = node.vdisk_dir_name("c");
    assert!(node.sigterm_and_wait().success());
    let egroup = node
        .data_dir
        .join("disk0/extents")
        .join(dir_name)
        .join(format!("{:016x}.egroup", 0));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&egroup)
        .unwrap();
    file.write_all_at(&[0xee], DATA_START + 100).unwrap();
    node.restart();
    let mut conn = NbdConn::connect(node.nbd_addr(), "c").unwrap();
    assert_eq!(
        conn.write(100, &[0x22u8; 512]).unwrap(),
        0,
        "the write itself is acknowledged"
    );
    // The drain runs when writes pause; the oplog must empty.
    let drained = common::wait_until(std::time::Duration::from_secs(20), || {
        node.vdisk_stats("c")["oplog_live_bytes"].as_u64() == Some(0)
    });
    assert!(drained, "oplog never drained: {}", node.vdisk_stats("c"));
    assert_eq!(
        conn.read(0, BLOCK as u32).unwrap(),
        Err(EIO),
        "the damaged block stays unreadable"
    );
    assert_eq!(
        conn.read(BLOCK, BLOCK as u32).unwrap(),
        Ok(vec![0x11u8; BLOCK as usize])
    );
    conn.disconnect();
    node.cli(&["vdisk", "set", "c", "--shards", "1"])
        .assert_ok("re-shard after the drain");
    node.kill9();
    node.restart();
    let mut conn = NbdConn::connect(node.nbd_addr(), "c").unwrap();
    conn.write_ok(0, &vec![0x33u8; BLOCK as usize]);
    assert_eq!(
        conn.read_ok(0, BLOCK as u32),
        vec![0x33u8; BLOCK as usize],
        "a full overwrite heals the block"
    );
}

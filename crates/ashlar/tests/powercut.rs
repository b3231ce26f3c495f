//! Power cuts under a real node. Its data directory sits on powercut-fs, the test suite's FUSE
//! filesystem that keeps every write and directory-entry change not yet made durable (fsync,
//! fsyncdir, RWF_DSYNC) in memory and, at a cut, applies a random subset of them in random
//! order, each write kept or dropped per aligned 4 KiB (a page, the unit Ashlar assumes
//! atomic). kill -9 alone cannot show a missing fsync (the page cache survives it); this can.
//!
//! After the cut the filesystem is mounted again over what reached "the disk", the node is
//! restarted and every block must hold the newest acknowledged write, or the write in flight
//! at the cut, and nothing else; and the node must come up.

mod common;

use ashlar_powercut_fs::CutPolicy;
use common::writes::{check_after_restart, write_until_stopped};
use common::{mount_powercut, Node, MIB};

/// Writes of `sizes` into `[0, region)` of a fresh vdisk until a power cut with `seed`, then
/// a restart and a check of every block.
fn power_cut_during_writes(sizes: &'static [u64], region: u64, seed: u64) {
    let dirs = tempfile::Builder::new()
        .prefix("ashlar-powercut-")
        .tempdir()
        .unwrap();
    let backing = dirs.path().join("backing");
    let mountpoint = dirs.path().join("mnt");
    // The data directory exists durably before the node starts (as an operator's would).
    std::fs::create_dir_all(backing.join("data")).unwrap();
    std::fs::create_dir_all(&mountpoint).unwrap();
    let mut fs = Some(mount_powercut(&backing, &mountpoint));
    let mut node = Node::start_in(Some(mountpoint.join("data")), &[]);
    node.create_vdisk("cut", "256M");
    let run = write_until_stopped(
        &mut node,
        "cut",
        sizes,
        region,
        |_| {},
        |node| {
            // The process dies with the power: nothing it did after this point counts.
            node.kill9();
            let fs = fs.take().expect("mounted");
            let report = fs
                .cut(CutPolicy::RandomSubset { seed })
                .expect("cutting the power");
            eprintln!("power cut (seed {seed}): {report:?}");
        },
    );
    let remounted = mount_powercut(&backing, &mountpoint);
    node.restart();
    check_after_restart(&node, "cut", &run);
    drop(node);
    drop(remounted);
}

#[test]
fn power_cut_during_small_random_writes_keeps_acknowledged_data() {
    for seed in [1, 2] {
        power_cut_during_writes(&[4096, 8192], 16 * MIB, seed);
    }
}

#[test]
fn power_cut_during_mixed_overwrites_keeps_acknowledged_data() {
    // Small writes (oplog) and whole-extent writes (straight to the extent store) overwriting
    // each other, so drains and bypass writes are cut half done too.
    for seed in [3, 4] {
        power_cut_during_writes(&[4096, 65536, MIB], 8 * MIB, seed);
    }
}

//! Real NBD clients against a node: qemu-img (convert, compare), nbdcopy and nbdinfo (size,
//! block-status map, export list), and a resize seen by a new connection.

mod common;

use common::nbd::NbdConn;
use common::{run_bounded, CmdOut, Node, Rng, MIB};
use std::path::Path;

fn tool(program: &str, args: &[&str], secs: u64) -> CmdOut {
    CmdOut::from_output(run_bounded(program, args, secs))
}

/// A sparse raw image of `size` bytes with random data at scattered places (some not
/// aligned to anything) and holes everywhere else. Returns the data ranges written.
fn make_sparse_image(path: &Path, size: u64, seed: u64) -> Vec<(u64, u64)> {
    use std::os::unix::fs::FileExt;
    let file = std::fs::File::create(path).unwrap();
    file.set_len(size).unwrap();
    let mut rng = Rng::new(seed);
    let ranges = [
        (0, 64 * 1024),
        (3 * MIB + 4096, 512 * 1024),
        (17 * MIB + 123, 1000),
        (40 * MIB, 2 * MIB),
        (97 * MIB + 512, 777 * 1024),
        (150 * MIB - 4096, 8192),
        (size - MIB, MIB),
    ];
    let ranges: Vec<(u64, u64)> = ranges
        .into_iter()
        .filter(|(offset, length)| offset + length <= size)
        .collect();
    for &(offset, length) in &ranges {
        file.write_all_at(&rng.bytes(length as usize), offset)
            .unwrap();
    }
    ranges
}

fn assert_same_files(a: &Path, b: &Path) {
    let left = std::fs::read(a).unwrap();
    let right = std::fs::read(b).unwrap();
    assert_eq!(
        left.len(),
        right.len(),
        "{} and {} differ in size",
        a.display(),
        b.display()
    );
    if let Some(i) = left.iter().zip(&right).position(|(x, y)| x != y) {
        panic!(
            "{} and {} differ first at byte {i}",
            a.display(),
            b.display()
        );
    }
}

#[test]
fn qemu_img_convert_and_compare_round_trip() {
    let node = Node::start();
    node.create_vdisk("qraw", "256M");
    node.create_vdisk("qqcow", "256M");
    let dir = node.root.path();
    let raw = dir.join("image.raw");
    make_sparse_image(&raw, 256 * MIB, 1);
    let raw = raw.to_str().unwrap();

    // Raw image into the existing vdisk (-n: do not create the target).
    let target = node.uri("qraw");
    tool(
        "qemu-img",
        &["convert", "-n", "-f", "raw", "-O", "raw", raw, &target],
        120,
    )
    .assert_ok("qemu-img convert raw -> vdisk");
    let compare = tool(
        "qemu-img",
        &["compare", "-f", "raw", "-F", "raw", raw, &target],
        120,
    );
    compare.assert_ok("qemu-img compare image vdisk");
    assert!(
        compare.stdout.contains("Images are identical"),
        "{}",
        compare.stdout
    );

    // And back out into a new file.
    let back = dir.join("back.raw");
    tool(
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
    )
    .assert_ok("qemu-img convert vdisk -> file");
    assert_same_files(Path::new(raw), &back);

    // A qcow2 image (sparse, clusters only where data is) into the second vdisk.
    let qcow = dir.join("image.qcow2");
    let qcow = qcow.to_str().unwrap();
    tool(
        "qemu-img",
        &["convert", "-f", "raw", "-O", "qcow2", raw, qcow],
        120,
    )
    .assert_ok("qemu-img convert raw -> qcow2");
    let target = node.uri("qqcow");
    tool(
        "qemu-img",
        &["convert", "-n", "-f", "qcow2", "-O", "raw", qcow, &target],
        120,
    )
    .assert_ok("qemu-img convert qcow2 -> vdisk");
    let compare = tool(
        "qemu-img",
        &["compare", "-f", "qcow2", "-F", "raw", qcow, &target],
        120,
    );
    compare.assert_ok("qemu-img compare qcow2 vdisk");
    assert!(
        compare.stdout.contains("Images are identical"),
        "{}",
        compare.stdout
    );

    // A difference must be noticed: change one byte through the vdisk and compare again.
    let mut conn = NbdConn::connect(node.nbd_addr(), "qqcow").unwrap();
    let mut block = conn.read_ok(40 * MIB, 4096);
    block[10] ^= 0xff;
    conn.write_ok(40 * MIB, &block);
    conn.disconnect();
    let compare = tool(
        "qemu-img",
        &["compare", "-f", "qcow2", "-F", "raw", qcow, &target],
        120,
    );
    assert_eq!(
        compare.code(),
        Some(1),
        "qemu-img compare must report the changed byte: {}{}",
        compare.stdout,
        compare.stderr
    );
    // qemu-img names the start of the chunk it compared.
    let at: u64 = compare
        .stdout
        .split("Content mismatch at offset ")
        .nth(1)
        .and_then(|rest| rest.trim().trim_end_matches('!').parse().ok())
        .unwrap_or_else(|| panic!("no mismatch offset in {:?}", compare.stdout));
    assert!(
        (40 * MIB..=40 * MIB + 10).contains(&at),
        "mismatch reported at {at}, the byte changed is at {}",
        40 * MIB + 10
    );
}

#[test]
fn nbdcopy_round_trip() {
    let node = Node::start();
    node.create_vdisk("copy", "64M");
    let dir = node.root.path();
    let source = dir.join("source.raw");
    make_sparse_image(&source, 64 * MIB, 2);
    let uri = node.uri("copy");
    tool("nbdcopy", &[source.to_str().unwrap(), &uri], 120).assert_ok("nbdcopy file -> vdisk");
    let back = dir.join("back.raw");
    std::fs::File::create(&back)
        .unwrap()
        .set_len(64 * MIB)
        .unwrap();
    tool("nbdcopy", &[&uri, back.to_str().unwrap()], 120).assert_ok("nbdcopy vdisk -> file");
    let cmp = tool(
        "cmp",
        &[source.to_str().unwrap(), back.to_str().unwrap()],
        60,
    );
    cmp.assert_ok("cmp source back");
    assert_same_files(&source, &back);
}

/// `nbdinfo --map` lines: (start, length, type, description).
fn parse_map(text: &str) -> Vec<(u64, u64, u32, String)> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            assert!(fields.len() >= 4, "unexpected nbdinfo --map line {line:?}");
            (
                fields[0].parse().unwrap(),
                fields[1].parse().unwrap(),
                fields[2].parse().unwrap(),
                fields[3..].join(" "),
            )
        })
        .collect()
}

#[test]
fn nbdinfo_map_size_and_list() {
    let node = Node::start();
    node.create_vdisk("mapped", "64M");
    node.create_vdisk("other-disk", "16M");
    let uri = node.uri("mapped");

    // A fresh vdisk is one hole.
    let map = tool("nbdinfo", &["--map", &uri], 60);
    map.assert_ok("nbdinfo --map (fresh)");
    let extents = parse_map(&map.stdout);
    assert_eq!(
        extents,
        vec![(0, 64 * MIB, 3, "hole,zero".to_string())],
        "{}",
        map.stdout
    );

    // Write a few MiB at two places.
    let mut rng = Rng::new(3);
    let mut conn = NbdConn::connect(node.nbd_addr(), "mapped").unwrap();
    conn.write_ok(8 * MIB, &rng.bytes(3 * MIB as usize));
    conn.write_ok(40 * MIB + 64 * 1024, &rng.bytes(256 * 1024));
    conn.disconnect();

    let map = tool("nbdinfo", &["--map", &uri], 60);
    map.assert_ok("nbdinfo --map");
    let extents = parse_map(&map.stdout);
    // The map covers the export exactly, in order.
    let mut next = 0;
    for (start, length, _, _) in &extents {
        assert_eq!(*start, next, "gap or overlap in the map:\n{}", map.stdout);
        next = start + length;
    }
    assert_eq!(
        next,
        64 * MIB,
        "the map must cover the export:\n{}",
        map.stdout
    );
    let data: Vec<(u64, u64)> = extents
        .iter()
        .filter(|e| e.2 & 1 == 0)
        .map(|e| (e.0, e.1))
        .collect();
    let holes: u64 = extents.iter().filter(|e| e.2 & 1 == 1).map(|e| e.1).sum();
    assert!(
        extents.iter().any(|e| e.3.contains("hole")) && extents.iter().any(|e| e.3 == "data"),
        "both data and holes:\n{}",
        map.stdout
    );
    // Allocation is tracked per 4 KiB block: the data ranges are exactly what was written.
    assert_eq!(
        data,
        vec![(8 * MIB, 3 * MIB), (40 * MIB + 64 * 1024, 256 * 1024)],
        "{}",
        map.stdout
    );
    assert_eq!(holes, 64 * MIB - 3 * MIB - 256 * 1024);

    // --json reports the size.
    let info = tool("nbdinfo", &["--json", &uri], 60);
    info.assert_ok("nbdinfo --json");
    let json: serde_json::Value = serde_json::from_str(&info.stdout).unwrap();
    let export = &json["exports"][0];
    assert_eq!(export["export-size"], 64 * MIB, "{json}");
    assert_eq!(export["export-name"], "mapped");
    assert_eq!(export["can_multi_conn"], true);

    // --list lists every vdisk.
    let list = tool(
        "nbdinfo",
        &[
            "--list",
            "--json",
            &format!("nbd://127.0.0.1:{}", node.nbd_port),
        ],
        60,
    );
    list.assert_ok("nbdinfo --list");
    let json: serde_json::Value = serde_json::from_str(&list.stdout).unwrap();
    let mut names: Vec<(String, u64)> = json["exports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["export-name"].as_str().unwrap().to_string(),
                e["export-size"].as_u64().unwrap(),
            )
        })
        .collect();
    names.sort();
    assert_eq!(
        names,
        vec![
            ("mapped".to_string(), 64 * MIB),
            ("other-disk".to_string(), 16 * MIB)
        ]
    );
}

#[test]
fn resize_is_seen_by_a_new_connection() {
    let node = Node::start();
    node.create_vdisk("grow", "64M");
    let uri = node.uri("grow");
    let size = |node: &Node| -> u64 {
        let out = tool("nbdinfo", &["--size", &node.uri("grow")], 60);
        out.assert_ok("nbdinfo --size");
        out.stdout.trim().parse().unwrap()
    };
    assert_eq!(size(&node), 64 * MIB);
    let mut conn = NbdConn::connect(node.nbd_addr(), "grow").unwrap();
    let data = Rng::new(4).bytes(MIB as usize);
    conn.write_ok(63 * MIB, &data);
    // Past the end: refused.
    assert_eq!(conn.write(64 * MIB, &data).unwrap(), common::nbd::ENOSPC);
    conn.disconnect();

    node.cli(&["vdisk", "resize", "grow", "--size", "192M"])
        .assert_ok("vdisk resize");
    assert_eq!(node.show("grow")["size_bytes"], 192 * MIB);
    assert_eq!(size(&node), 192 * MIB, "nbdinfo on a new connection");
    let mut conn = NbdConn::connect(node.nbd_addr(), "grow").unwrap();
    assert_eq!(conn.size, 192 * MIB);
    // The old data is still there and the new space is usable (and reads as zeros first).
    assert_eq!(conn.read_ok(63 * MIB, MIB as u32), data);
    assert_eq!(conn.read_ok(150 * MIB, 4096), vec![0u8; 4096]);
    conn.write_ok(191 * MIB, &data);
    assert_eq!(conn.read_ok(191 * MIB, MIB as u32), data);
    conn.disconnect();
    let info = tool("nbdinfo", &["--json", &uri], 60);
    info.assert_ok("nbdinfo --json");
    assert!(info.stdout.contains(&format!("{}", 192 * MIB)));
}

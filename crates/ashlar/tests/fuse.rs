//! A real filesystem on a vdisk: nbdfuse exposes the vdisk as a file, a loop device turns it
//! into a block device, ext4 is created, mounted, written and read; then everything is torn
//! down, the node restarted, and the files read again through a fresh mount.
//!
//! Needs root, /dev/fuse and loop devices (CI runs as root and has them). Without them the
//! test fails with a message saying what is missing: it never skips silently.

mod common;

use common::{require_tool, run_bounded, CmdOut, Node, Rng, MIB};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

fn run(program: &str, args: &[&str], secs: u64) -> CmdOut {
    CmdOut::from_output(run_bounded(program, args, secs))
}

/// Everything mounted or attached, undone in reverse order on drop (also when a test fails).
struct Stack {
    nbdfuse: Option<Child>,
    fuse_dir: PathBuf,
    loop_device: Option<String>,
    mounted: Option<PathBuf>,
}

impl Stack {
    /// nbdfuse URI at `fuse_dir`, losetup its file, and mount (making ext4 first if asked).
    fn up(uri: &str, fuse_dir: &Path, mnt: &Path, mkfs: bool) -> Stack {
        std::fs::create_dir_all(fuse_dir).unwrap();
        std::fs::create_dir_all(mnt).unwrap();
        let log = fuse_dir.with_extension("log");
        let child = Command::new("nbdfuse")
            .arg(fuse_dir)
            .arg(uri)
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&log).unwrap())
            .stderr(std::fs::File::create(log.with_extension("err")).unwrap())
            .spawn()
            .expect("starting nbdfuse");
        let mut stack = Stack {
            nbdfuse: Some(child),
            fuse_dir: fuse_dir.to_path_buf(),
            loop_device: None,
            mounted: None,
        };
        let file = fuse_dir.join("nbd");
        let ready = common::wait_until(Duration::from_secs(20), || {
            std::fs::metadata(&file).is_ok_and(|m| m.len() == 256 * MIB)
        });
        assert!(
            ready,
            "nbdfuse did not expose {} (256 MiB) within 20 s: {}",
            file.display(),
            std::fs::read_to_string(log.with_extension("err")).unwrap_or_default()
        );
        let out = run("losetup", &["-f", "--show", file.to_str().unwrap()], 60);
        out.assert_ok("losetup -f --show");
        let device = out.stdout.trim().to_string();
        assert!(device.starts_with("/dev/loop"), "losetup said {device:?}");
        stack.loop_device = Some(device.clone());
        if mkfs {
            run("mkfs.ext4", &["-q", "-F", &device], 120).assert_ok("mkfs.ext4");
        }
        run("mount", &[&device, mnt.to_str().unwrap()], 60).assert_ok("mount");
        stack.mounted = Some(mnt.to_path_buf());
        stack
    }

    /// Unmount, check the filesystem, detach, unmount FUSE, wait for nbdfuse; asserting each.
    fn down(mut self) {
        let mnt = self.mounted.take().unwrap();
        run("umount", &[mnt.to_str().unwrap()], 60).assert_ok("umount");
        let device = self.loop_device.take().unwrap();
        let fsck = run("e2fsck", &["-f", "-n", &device], 120);
        fsck.assert_ok("e2fsck -f -n after a clean unmount");
        run("losetup", &["-d", &device], 60).assert_ok("losetup -d");
        run("fusermount3", &["-u", self.fuse_dir.to_str().unwrap()], 60)
            .assert_ok("fusermount3 -u");
        let mut child = self.nbdfuse.take().unwrap();
        let exited = common::wait_until(Duration::from_secs(10), || {
            child.try_wait().unwrap().is_some()
        });
        if !exited {
            let _ = child.kill();
        }
        let _ = child.wait();
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        if let Some(mnt) = self.mounted.take() {
            let _ = run("umount", &[mnt.to_str().unwrap()], 30);
            let _ = run("umount", &["-l", mnt.to_str().unwrap()], 30);
        }
        if let Some(device) = self.loop_device.take() {
            let _ = run("losetup", &["-d", &device], 30);
        }
        if self.nbdfuse.is_some() {
            let _ = run("fusermount3", &["-u", self.fuse_dir.to_str().unwrap()], 30);
        }
        if let Some(mut child) = self.nbdfuse.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn files(seed: u64) -> Vec<(String, Vec<u8>)> {
    let mut rng = Rng::new(seed);
    let mut files = vec![
        (
            "hello.txt".to_string(),
            b"hello from an ashlar vdisk\n".to_vec(),
        ),
        ("big.bin".to_string(), rng.bytes(12 * MIB as usize)),
    ];
    for i in 0..100 {
        let len = 1 + rng.below(20000) as usize;
        files.push((format!("dir/small-{i:03}"), rng.bytes(len)));
    }
    files
}

#[test]
fn ext4_on_nbdfuse_and_a_loop_device() {
    assert!(
        unsafe { libc::geteuid() } == 0,
        "this test needs root for losetup and mount (CI runs as root)"
    );
    assert!(
        Path::new("/dev/fuse").exists(),
        "/dev/fuse is missing: FUSE is needed (CI has it)"
    );
    assert!(
        Path::new("/dev/loop-control").exists(),
        "/dev/loop-control is missing: loop devices are needed (CI has them)"
    );
    for tool in [
        "nbdfuse",
        "fusermount3",
        "losetup",
        "mkfs.ext4",
        "e2fsck",
        "mount",
        "umount",
    ] {
        require_tool(tool);
    }
    let mut node = Node::start();
    node.create_vdisk("fs", "256M");
    let uri = node.uri("fs");
    let fuse_dir = node.root.path().join("fuse");
    let mnt = node.root.path().join("mnt");
    let expected = files(5);

    let stack = Stack::up(&uri, &fuse_dir, &mnt, true);
    std::fs::create_dir_all(mnt.join("dir")).unwrap();
    for (name, data) in &expected {
        std::fs::write(mnt.join(name), data).unwrap();
    }
    unsafe { libc::sync() };
    for (name, data) in &expected {
        assert!(&std::fs::read(mnt.join(name)).unwrap() == data, "{name}");
    }
    stack.down();
    let stats = node.vdisk_stats("fs");
    assert!(
        stats["write_bytes"].as_u64().unwrap() > 12 * MIB,
        "the filesystem's writes reached the vdisk: {stats}"
    );

    // Restart the node, mount again: the files come back from the vdisk itself.
    let status = node.sigterm_and_wait();
    assert!(status.success(), "{status}");
    node.restart();
    let stack = Stack::up(&uri, &fuse_dir, &mnt, false);
    for (name, data) in &expected {
        let got = std::fs::read(mnt.join(name))
            .unwrap_or_else(|e| panic!("{name} after remount on a restarted node: {e}"));
        assert!(
            &got == data,
            "{name} differs after remount on a restarted node"
        );
    }
    stack.down();
}

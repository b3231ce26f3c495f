//! The test-side handle: spawns the daemon, waits for the mount, sends it commands.

use std::io::{self, BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::protocol::{CutPolicy, CutReport, PendingStatus};

/// Name of the daemon binary.
pub const BINARY_NAME: &str = "ashlar-powercut-fs";
/// Environment variable that names the daemon binary explicitly.
pub const BINARY_ENV: &str = "ASHLAR_POWERCUT_FS_BIN";

const MOUNT_TIMEOUT: Duration = Duration::from_secs(30);
const COMMAND_TIMEOUT: Duration = Duration::from_secs(120);

/// Finds the `ashlar-powercut-fs` binary for a test.
///
/// In order: `$ASHLAR_POWERCUT_FS_BIN`; the binary next to the running test executable
/// (`target/<profile>/`, the test being in `target/<profile>/deps/`), which `cargo test
/// --workspace` has built; otherwise it runs `cargo build -p ashlar-powercut-fs` (with
/// `--release` when the test runs from a `release` dir) for the same target dir and returns
/// the result. That build needs `cargo` (`$CARGO`, which cargo sets for tests, or the one on
/// `PATH`).
///
/// Note: a binary found next to the test executable is used as it is; after changing this
/// crate, run `cargo test --workspace` or build `-p ashlar-powercut-fs` so it is not stale.
pub fn binary_path() -> io::Result<PathBuf> {
    // Found (or built) once per test process; concurrent callers wait for the first.
    static FOUND: Mutex<Option<PathBuf>> = Mutex::new(None);
    let mut found = FOUND.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(path) = found.as_ref() {
        return Ok(path.clone());
    }
    let path = find_or_build_binary()?;
    *found = Some(path.clone());
    Ok(path)
}

fn find_or_build_binary() -> io::Result<PathBuf> {
    if let Some(path) = std::env::var_os(BINARY_ENV) {
        let path = PathBuf::from(path);
        if path.is_file() {
            return Ok(path);
        }
        return Err(io::Error::other(format!(
            "{BINARY_ENV}={} is not a file",
            path.display()
        )));
    }
    let exe = std::env::current_exe()?;
    let mut profile_dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
    if profile_dir.file_name().is_some_and(|n| n == "deps") {
        profile_dir.pop();
    }
    let candidate = profile_dir.join(BINARY_NAME);
    if candidate.is_file() {
        return Ok(candidate);
    }
    // Build it into the same target dir.
    let target_dir = profile_dir
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default();
    let release = profile_dir.file_name().is_some_and(|n| n == "release");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.args(["build", "-p", "ashlar-powercut-fs", "--bin", BINARY_NAME])
        .arg("--target-dir")
        .arg(&target_dir);
    if release {
        cmd.arg("--release");
    }
    if let Some(dir) = option_env!("CARGO_MANIFEST_DIR") {
        cmd.current_dir(dir);
    }
    let status = cmd
        .status()
        .map_err(|e| io::Error::other(format!("running cargo to build {BINARY_NAME}: {e}")))?;
    if !status.success() || !candidate.is_file() {
        return Err(io::Error::other(format!(
            "{BINARY_NAME} is not next to the test executable ({}) and `cargo build -p ashlar-powercut-fs` did not produce it ({status})",
            candidate.display()
        )));
    }
    Ok(candidate)
}

/// Checks what mounting needs, with an error that says what is missing.
pub fn check_environment() -> io::Result<()> {
    let dev = Path::new("/dev/fuse");
    if !dev.exists() {
        return Err(io::Error::other(
            "powercut-fs needs /dev/fuse, which is missing (load the fuse module, or give the container the device)",
        ));
    }
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    if !root
        && !Path::new("/usr/bin/fusermount3").exists()
        && !Path::new("/bin/fusermount3").exists()
    {
        return Err(io::Error::other(
            "powercut-fs needs root, or fusermount3 (Debian package fuse3) to mount as another user",
        ));
    }
    Ok(())
}

/// Is `path` a mount point now (per /proc/self/mountinfo)?
pub fn is_mounted(path: &Path) -> bool {
    let Ok(path) = path.canonicalize() else {
        return false;
    };
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    let want = path
        .to_string_lossy()
        .replace('\\', "\\134")
        .replace(' ', "\\040")
        .replace('\t', "\\011")
        .replace('\n', "\\012");
    info.lines()
        .any(|l| l.split(' ').nth(4) == Some(want.as_str()))
}

/// How to mount, for [`PowercutFs::mount_with`].
#[derive(Clone, Debug)]
pub struct MountOptions {
    /// The daemon binary; `None`: [`binary_path`].
    pub binary: Option<PathBuf>,
    /// fsync the backing file (and directory) when data (names) become durable. The simulation
    /// does not need it (the host does not crash); turning it off makes a node that fsyncs
    /// often much faster on the mount. Default: on.
    pub fsync_backing: bool,
    /// A cut keeps or drops each aligned piece of this many bytes of a write whole (a power
    /// of two from 512 to 65536). Default: 512, a disk's smallest sector.
    pub sector_bytes: u64,
}

impl Default for MountOptions {
    fn default() -> MountOptions {
        MountOptions {
            binary: None,
            fsync_backing: true,
            sector_bytes: 512,
        }
    }
}

/// A mounted powercut filesystem. Dropping it unmounts cleanly (everything pending becomes
/// durable, as a clean shutdown would); [`PowercutFs::cut`] is the power cut.
pub struct PowercutFs {
    child: Option<Child>,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    backing: PathBuf,
    mountpoint: PathBuf,
}

impl PowercutFs {
    /// Mounts `backing` at `mountpoint` with the binary [`binary_path`] finds, and returns once
    /// the mount is live.
    pub fn mount(
        backing: impl AsRef<Path>,
        mountpoint: impl AsRef<Path>,
    ) -> io::Result<PowercutFs> {
        PowercutFs::mount_with(backing, mountpoint, &MountOptions::default())
    }

    /// Like [`PowercutFs::mount`] with an explicit binary (the crate's own tests pass
    /// `env!("CARGO_BIN_EXE_ashlar-powercut-fs")`).
    pub fn mount_with_binary(
        binary: &Path,
        backing: impl AsRef<Path>,
        mountpoint: impl AsRef<Path>,
    ) -> io::Result<PowercutFs> {
        let options = MountOptions {
            binary: Some(binary.to_path_buf()),
            ..MountOptions::default()
        };
        PowercutFs::mount_with(backing, mountpoint, &options)
    }

    /// Mounts with explicit [`MountOptions`].
    pub fn mount_with(
        backing: impl AsRef<Path>,
        mountpoint: impl AsRef<Path>,
        options: &MountOptions,
    ) -> io::Result<PowercutFs> {
        check_environment()?;
        let binary = match &options.binary {
            Some(b) => b.clone(),
            None => binary_path()?,
        };
        let binary = binary.as_path();
        let backing = backing.as_ref().to_path_buf();
        let mountpoint = mountpoint.as_ref().to_path_buf();
        if is_mounted(&mountpoint) {
            return Err(io::Error::other(format!(
                "{} is already a mount point",
                mountpoint.display()
            )));
        }
        let mut child = Command::new(binary)
            .arg(&backing)
            .arg(&mountpoint)
            .arg("--unmount-on-eof")
            .arg("--sector-bytes")
            .arg(options.sector_bytes.to_string())
            .args(if options.fsync_backing {
                &[][..]
            } else {
                &["--no-backing-fsync"][..]
            })
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| io::Error::other(format!("starting {}: {e}", binary.display())))?;
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().expect("piped");
        let (tx, lines) = mpsc::channel();
        std::thread::Builder::new()
            .name("powercut-fs-stdout".into())
            .spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            })?;
        let mut fs = PowercutFs {
            child: Some(child),
            stdin,
            lines,
            backing,
            mountpoint,
        };
        match fs.lines.recv_timeout(MOUNT_TIMEOUT) {
            Ok(line) if line == "ready" => {}
            Ok(line) => {
                fs.kill();
                return Err(io::Error::other(format!(
                    "powercut-fs: unexpected first line {line:?}"
                )));
            }
            Err(_) => {
                let status = fs.kill();
                return Err(io::Error::other(format!(
                    "powercut-fs did not mount {} at {} ({status}); its stderr is above",
                    fs.backing.display(),
                    fs.mountpoint.display()
                )));
            }
        }
        if !is_mounted(&fs.mountpoint) {
            fs.kill();
            return Err(io::Error::other(format!(
                "powercut-fs said ready but {} is not in /proc/self/mountinfo",
                fs.mountpoint.display()
            )));
        }
        Ok(fs)
    }

    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    pub fn backing(&self) -> &Path {
        &self.backing
    }

    /// The daemon's process id.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    fn command(&mut self, line: &str) -> io::Result<String> {
        let stdin = self
            .stdin
            .as_mut()
            .ok_or_else(|| io::Error::other("powercut-fs already finished"))?;
        writeln!(stdin, "{line}")?;
        stdin.flush()?;
        let deadline = Instant::now() + COMMAND_TIMEOUT;
        let answer = self
            .lines
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .map_err(|_| io::Error::other(format!("powercut-fs gave no answer to {line:?}")))?;
        if let Some(msg) = answer.strip_prefix("error ") {
            return Err(io::Error::other(format!("powercut-fs: {msg}")));
        }
        Ok(answer)
    }

    /// What is not yet durable now.
    pub fn pending(&mut self) -> io::Result<PendingStatus> {
        let line = self.command("status")?;
        PendingStatus::parse(&line).map_err(io::Error::other)
    }

    /// Cuts the power: the backing dir keeps what `policy` says of the pending state, the mount
    /// is detached (processes still using it get ENOTCONN/EIO) and the daemon exits. Mount
    /// the backing dir again with [`PowercutFs::mount`] to go on.
    pub fn cut(mut self, policy: CutPolicy) -> io::Result<CutReport> {
        let line = self.command(&format!("cut {}", policy.to_command()))?;
        let report = CutReport::parse(&line).map_err(io::Error::other);
        self.wait_exit()?;
        report
    }

    /// Unmounts cleanly: everything pending becomes durable first.
    pub fn unmount(mut self) -> io::Result<()> {
        let line = self.command("unmount")?;
        self.wait_exit()?;
        if line != "unmounted" {
            return Err(io::Error::other(format!(
                "powercut-fs: unexpected answer {line:?}"
            )));
        }
        Ok(())
    }

    fn wait_exit(&mut self) -> io::Result<()> {
        self.stdin = None;
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        let deadline = Instant::now() + COMMAND_TIMEOUT;
        loop {
            if let Some(status) = child.try_wait()? {
                if !status.success() {
                    return Err(io::Error::other(format!(
                        "powercut-fs exited with {status}"
                    )));
                }
                break;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err(io::Error::other(
                    "powercut-fs did not exit after finishing; killed",
                ));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        if is_mounted(&self.mountpoint) {
            return Err(io::Error::other(format!(
                "{} is still mounted after powercut-fs exited",
                self.mountpoint.display()
            )));
        }
        Ok(())
    }

    fn kill(&mut self) -> String {
        self.stdin = None;
        match self.child.take() {
            Some(mut child) => {
                let _ = child.kill();
                match child.wait() {
                    Ok(s) => s.to_string(),
                    Err(e) => e.to_string(),
                }
            }
            None => "not running".into(),
        }
    }
}

impl Drop for PowercutFs {
    fn drop(&mut self) {
        if self.child.is_none() {
            return;
        }
        let ok = self.command("unmount").is_ok() && self.wait_exit().is_ok();
        if !ok {
            self.kill();
            // A killed daemon leaves the mount dead but attached.
            let c = std::ffi::CString::new(self.mountpoint.as_os_str().as_encoded_bytes());
            if let Ok(c) = c {
                // SAFETY: umount2 on a NUL-terminated path.
                unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
            }
        }
    }
}

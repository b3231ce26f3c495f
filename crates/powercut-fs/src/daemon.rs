//! The `ashlar-powercut-fs` daemon: mounts, serves, and ends by a cut or a clean unmount.

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{Arc, Mutex};

use fuser::{Config, MountOption, Session};

use crate::fuse::PowercutFilesystem;
use crate::model::State;
use crate::protocol::CutPolicy;

const USAGE: &str = "usage: ashlar-powercut-fs BACKING_DIR MOUNTPOINT [--seed N] [--sector-bytes N] [--no-backing-fsync] [--unmount-on-eof]

Mounts a passthrough view of BACKING_DIR at MOUNTPOINT that keeps every write not yet made
durable (fsync, fdatasync, fsyncdir) in memory, and simulates a power cut on request.

Control (one command per line on stdin, one answer per line on stdout):
  cut drop-all | cut keep-all | cut random SEED | cut random-writes SEED
  status
  unmount                 clean unmount: everything pending becomes durable
Signals: SIGUSR1 cuts (random subset with --seed N, else drop-all);
         SIGTERM, SIGINT, SIGHUP unmount cleanly.
  --seed N             seed of the SIGUSR1 cut
  --sector-bytes N     a cut keeps or drops each aligned N-byte piece of a write whole
                       (power of two, 512..65536; default 512)
  --no-backing-fsync   do not fsync the backing files when data becomes durable (faster; the
                       simulation does not need it unless the host itself crashes)
  --unmount-on-eof     unmount cleanly when stdin reaches end of file (the test library's mode:
                       the mount goes away when the test process dies)";

struct Args {
    backing: PathBuf,
    mountpoint: PathBuf,
    seed: Option<u64>,
    fsync_backing: bool,
    unmount_on_eof: bool,
}

fn parse_args(args: Vec<String>) -> Result<Args, String> {
    let mut positional = Vec::new();
    let mut seed = None;
    let mut fsync_backing = true;
    let mut unmount_on_eof = false;
    let mut it = args.into_iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--seed" => {
                let v = it.next().ok_or("--seed needs a value")?;
                seed = Some(v.parse::<u64>().map_err(|e| format!("--seed {v}: {e}"))?);
            }
            "--no-backing-fsync" => fsync_backing = false,
            "--sector-bytes" => {
                let v = it.next().ok_or("--sector-bytes needs a value")?;
                let bytes = v
                    .parse::<u64>()
                    .map_err(|e| format!("--sector-bytes {v}: {e}"))?;
                crate::model::set_sector_bytes(bytes)?;
            }
            "--unmount-on-eof" => unmount_on_eof = true,
            "-h" | "--help" => return Err(String::new()),
            a if a.starts_with("--") => return Err(format!("unknown option {a}")),
            _ => positional.push(PathBuf::from(arg)),
        }
    }
    if positional.len() != 2 {
        return Err("want BACKING_DIR and MOUNTPOINT".into());
    }
    let mountpoint = positional.pop().expect("two");
    let backing = positional.pop().expect("two");
    Ok(Args {
        backing,
        mountpoint,
        seed,
        fsync_backing,
        unmount_on_eof,
    })
}

enum Action {
    Cut(CutPolicy),
    Unmount,
}

struct Control {
    state: Arc<Mutex<State>>,
    mountpoint: PathBuf,
    /// Held from the start of a cut or unmount to the process exit, so only one happens.
    finishing: Mutex<()>,
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

impl Control {
    /// Ends the daemon: applies the cut or makes everything durable, detaches the mount, says
    /// so on stdout, exits. Exiting closes /dev/fuse, which aborts the connection: anything
    /// still using the old mount gets ENOTCONN.
    fn finish(&self, action: Action) -> ! {
        let _finishing = self.finishing.lock().unwrap_or_else(|p| p.into_inner());
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let line = if st.dead {
            "error already finished".to_string()
        } else {
            match action {
                Action::Cut(policy) => {
                    let report = st.cut(policy);
                    eprintln!("powercut-fs: power cut ({policy}): {report}");
                    report.to_line()
                }
                Action::Unmount => match st.shutdown() {
                    Ok(()) => {
                        eprintln!("powercut-fs: clean unmount, everything pending made durable");
                        "unmounted".to_string()
                    }
                    Err(e) => {
                        eprintln!("powercut-fs: clean unmount could not make everything durable: errno {}", e.0);
                        format!("error clean unmount: errno {}", e.0)
                    }
                },
            }
        };
        // Requests from now on see `dead` and fail; none touches the backing dir again.
        drop(st);
        lazy_unmount(&self.mountpoint);
        say(&line);
        std::process::exit(0)
    }
}

/// Detaches the mount even if files on it are still open (their users get errors).
fn lazy_unmount(mountpoint: &Path) {
    let Ok(c) = std::ffi::CString::new(mountpoint.as_os_str().as_encoded_bytes()) else {
        return;
    };
    // SAFETY: umount2 on a NUL-terminated path.
    if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) } == 0 {
        return;
    }
    let err = std::io::Error::last_os_error();
    match err.raw_os_error() {
        Some(libc::EPERM) => {
            let status = std::process::Command::new("fusermount3")
                .arg("-u")
                .arg("-z")
                .arg(mountpoint)
                .status();
            if !matches!(status, Ok(s) if s.success()) {
                eprintln!(
                    "powercut-fs: fusermount3 -u -z {} failed: {status:?}",
                    mountpoint.display()
                );
            }
        }
        // Not mounted any more: unmounted from outside.
        Some(libc::EINVAL) | Some(libc::ENOENT) => {}
        _ => eprintln!("powercut-fs: unmounting {}: {err}", mountpoint.display()),
    }
}

fn signal_set() -> libc::sigset_t {
    // SAFETY: sigemptyset/sigaddset initialise a sigset_t we own.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for sig in [libc::SIGUSR1, libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
            libc::sigaddset(&mut set, sig);
        }
        set
    }
}

fn raise_fd_limit() {
    // SAFETY: getrlimit/setrlimit with a struct we own.
    unsafe {
        let mut lim: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

/// The binary's `main`.
pub fn main(args: Vec<String>) -> ExitCode {
    let args = match parse_args(args) {
        Ok(a) => a,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("ashlar-powercut-fs: {e}");
            }
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    // Signals are taken by one thread with sigwait; block them before any thread starts so
    // that every thread inherits the mask.
    let set = signal_set();
    // SAFETY: blocks signals in the calling (only) thread.
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    raise_fd_limit();

    let state = match State::load(&args.backing, args.fsync_backing) {
        Ok(s) => Arc::new(Mutex::new(s)),
        Err(e) => {
            eprintln!(
                "ashlar-powercut-fs: backing dir {}: {e}",
                args.backing.display()
            );
            return ExitCode::from(1);
        }
    };
    let mut config = Config::default();
    config.mount_options = vec![
        MountOption::FSName(format!("powercut:{}", args.backing.display())),
        MountOption::Subtype("powercut".into()),
        MountOption::DefaultPermissions,
        MountOption::RW,
    ];
    let session = match Session::new(
        PowercutFilesystem::new(state.clone()),
        &args.mountpoint,
        &config,
    ) {
        Ok(s) => s,
        Err(e) => {
            eprintln!(
                "ashlar-powercut-fs: mounting at {}: {e}",
                args.mountpoint.display()
            );
            return ExitCode::from(1);
        }
    };
    let mountpoint = args
        .mountpoint
        .canonicalize()
        .unwrap_or(args.mountpoint.clone());
    let control = Arc::new(Control {
        state,
        mountpoint,
        finishing: Mutex::new(()),
    });

    let default_cut = match args.seed {
        Some(seed) => CutPolicy::RandomSubset { seed },
        None => CutPolicy::DropAll,
    };
    {
        let control = control.clone();
        std::thread::Builder::new()
            .name("signals".into())
            .spawn(move || loop {
                let mut sig: libc::c_int = 0;
                // SAFETY: sigwait on a set blocked in every thread.
                if unsafe { libc::sigwait(&set, &mut sig) } != 0 {
                    continue;
                }
                match sig {
                    libc::SIGUSR1 => control.finish(Action::Cut(default_cut)),
                    _ => control.finish(Action::Unmount),
                }
            })
            .expect("spawning the signal thread");
    }
    {
        let control = control.clone();
        let unmount_on_eof = args.unmount_on_eof;
        std::thread::Builder::new()
            .name("control".into())
            .spawn(move || {
                for line in std::io::stdin().lock().lines() {
                    let Ok(line) = line else { break };
                    let line = line.trim();
                    if let Some(policy) = line.strip_prefix("cut ") {
                        match CutPolicy::parse(policy) {
                            Ok(p) => control.finish(Action::Cut(p)),
                            Err(e) => say(&format!("error {e}")),
                        }
                    } else if line == "unmount" {
                        control.finish(Action::Unmount);
                    } else if line == "status" {
                        let st = control.state.lock().unwrap_or_else(|p| p.into_inner());
                        if st.dead {
                            say("error finished");
                        } else {
                            say(&st.status().to_line());
                        }
                    } else if !line.is_empty() {
                        say(&format!("error unknown command {line:?}"));
                    }
                }
                if unmount_on_eof {
                    control.finish(Action::Unmount);
                }
            })
            .expect("spawning the control thread");
    }

    eprintln!(
        "powercut-fs: {} mounted at {} (pid {}); pending writes are lost at a cut",
        args.backing.display(),
        control.mountpoint.display(),
        std::process::id()
    );
    say("ready");
    if let Err(e) = session.run() {
        eprintln!("powercut-fs: session ended: {e}");
    }
    // The kernel ended the session: unmounted from outside (or our own finish is under way,
    // in which case this waits for it to exit).
    control.finish(Action::Unmount)
}

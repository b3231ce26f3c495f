//! When this process has dropped every handle of a store, reopening it must work at once.
//!
//! The file closes when the last reference to the open store goes. Besides the caller's
//! handles, the lease-expiry task and blocking calls whose futures were dropped hold
//! references for a few milliseconds; if the caller's last handle goes during such a window,
//! the file closes a little later on another thread, and an immediate reopen would meet redb's
//! "already open". `UserHandles` tells the two cases apart: a reopen waits for a store whose
//! caller handles are all gone (its release is under way), and fails at once for a store some
//! caller still holds (a real second open).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

/// Longest wait for a released store's file to close. Closing follows the end of one blocking
/// call (a lease reap or a single commit), so this is far more than it ever needs.
const RELEASE_WAIT: Duration = Duration::from_secs(10);
const RELEASE_POLL: Duration = Duration::from_millis(2);

/// Shared by every caller handle of one open store; registered by path while alive.
#[derive(Debug)]
pub(crate) struct UserHandles;

/// One entry per store path this process has opened (a node opens one; the entries of closed
/// stores are kept, since a store's file may still be closing after its last handle went).
static REGISTERED: Mutex<Vec<(PathBuf, Weak<UserHandles>)>> = Mutex::new(Vec::new());

impl UserHandles {
    pub(crate) fn register(path: &Path) -> Arc<UserHandles> {
        let handles = Arc::new(UserHandles);
        let mut registered = REGISTERED.lock().unwrap_or_else(|e| e.into_inner());
        let weak = Arc::downgrade(&handles);
        match registered.iter_mut().find(|(known, _)| known == path) {
            Some(entry) => entry.1 = weak,
            None => registered.push((path.to_path_buf(), weak)),
        }
        handles
    }
}

/// True if this process opened `path` and has since dropped every caller handle of it.
fn released_here(path: &Path) -> bool {
    let registered = REGISTERED.lock().unwrap_or_else(|e| e.into_inner());
    registered
        .iter()
        .any(|(known, weak)| known == path && weak.strong_count() == 0)
}

/// Runs `open` again while it reports `already_open` for a file this process has released,
/// until the release completes (or `RELEASE_WAIT` passes).
pub(crate) fn open_after_release<T, E>(
    path: &Path,
    already_open: impl Fn(&E) -> bool,
    mut open: impl FnMut() -> Result<T, E>,
) -> Result<T, E> {
    let deadline = Instant::now() + RELEASE_WAIT;
    loop {
        match open() {
            Err(error)
                if already_open(&error) && released_here(path) && Instant::now() < deadline =>
            {
                std::thread::sleep(RELEASE_POLL);
            }
            result => return result,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_only_for_stores_whose_handles_are_all_gone() {
        let path = Path::new("/nonexistent/release-test/meta.redb");
        let handles = UserHandles::register(path);
        let mut attempts = 0;
        let held: Result<(), &str> = open_after_release(
            path,
            |_| true,
            || {
                attempts += 1;
                Err("already open")
            },
        );
        assert_eq!(held, Err("already open"));
        assert_eq!(attempts, 1, "a store still held fails at once");

        drop(handles);
        let mut attempts = 0;
        let released = open_after_release(
            path,
            |_| true,
            || {
                attempts += 1;
                if attempts < 3 {
                    Err("already open")
                } else {
                    Ok(())
                }
            },
        );
        assert_eq!(released, Ok(()));
        assert_eq!(attempts, 3, "a released store is waited for");
    }
}

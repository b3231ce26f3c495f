//! Reactors: one pinned thread per core, each running a tokio current-thread runtime and a
//! `LocalSet`. A controller lives on exactly one reactor and never moves; a client connection
//! may move once, right after its handshake, to a reactor that runs one of its vdisk's
//! shards (see the node's accept loop). Other threads reach them only by message.

use crate::spin_policy::{SpinPolicy, SpinStart};
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::error::TrySendError;
use tokio::sync::{mpsc, oneshot, Notify};

/// Work sent to a reactor: runs on the reactor thread inside its `LocalSet`, so it may
/// `spawn_local` tasks that own `!Send` state.
type Job = Box<dyn FnOnce() + Send + 'static>;

/// Index of a reactor (0-based); reactor i is pinned to CPU `i % online CPUs`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ReactorId(pub usize);

/// A cheap, cloneable way to run code on one reactor.
#[derive(Clone)]
pub struct ReactorHandle {
    pub id: ReactorId,
    jobs: mpsc::Sender<Job>,
}

#[derive(Debug, thiserror::Error)]
#[error("reactor {0} has stopped")]
pub struct ReactorStopped(pub usize);

impl ReactorHandle {
    /// Runs `make` on the reactor and returns what the future it builds resolves to.
    pub async fn run<T, F, Fut>(&self, make: F) -> Result<T, ReactorStopped>
    where
        T: Send + 'static,
        F: FnOnce() -> Fut + Send + 'static,
        Fut: std::future::Future<Output = T> + 'static,
    {
        let (reply, result) = oneshot::channel();
        let job: Job = Box::new(move || {
            tokio::task::spawn_local(async move {
                let _ = reply.send(make().await);
            });
        });
        self.jobs
            .send(job)
            .await
            .map_err(|_| ReactorStopped(self.id.0))?;
        result.await.map_err(|_| ReactorStopped(self.id.0))
    }

    /// Starts `make`'s future on the reactor without waiting for it (used for connections).
    pub fn spawn_detached<F, Fut>(&self, make: F) -> Result<(), ReactorStopped>
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + 'static,
    {
        let job: Job = Box::new(move || {
            tokio::task::spawn_local(make());
        });
        self.jobs
            .try_send(job)
            .map_err(|_| ReactorStopped(self.id.0))
    }
}

/// Work handed back to a reactor by another one (typically: complete a reply channel).
type Completion = Box<dyn FnOnce() + Send + 'static>;

/// Completions queued per reactor before senders deliver theirs directly instead. The queue
/// holds at most one entry per request in flight towards other reactors, so this bound is
/// reached only under extreme load, and overflowing it costs a wakeup, not correctness.
pub const REPLY_ROUTE_QUEUE_LIMIT: usize = 4096;

/// The way back to one reactor for replies computed on another.
///
/// Waking a task that lives on another reactor costs a syscall (an eventfd write) per wake,
/// and often a context switch. Replies sent through the route land in one queue drained by
/// one task on the owning reactor, so a burst of replies costs one wakeup, and the waiting
/// request tasks are then woken locally, for free.
#[derive(Clone)]
pub struct ReplyRoute {
    reactor: ReactorId,
    completions: mpsc::Sender<Completion>,
}

thread_local! {
    static CURRENT_ROUTE: RefCell<Option<ReplyRoute>> = const { RefCell::new(None) };
}

/// The route back to the reactor this code runs on; `None` off the reactors (tests, tools).
pub fn current_route() -> Option<ReplyRoute> {
    CURRENT_ROUTE.with(|route| route.borrow().clone())
}

/// The reactor this code runs on, if any.
pub fn current_reactor() -> Option<ReactorId> {
    CURRENT_ROUTE.with(|route| route.borrow().as_ref().map(|r| r.reactor))
}

impl ReplyRoute {
    /// Runs `deliver` on the route's reactor: at once when already there, else through its
    /// completion queue, or at once anyway when that queue is full or its reactor stopped
    /// (the wake then simply costs more).
    pub fn deliver(&self, deliver: impl FnOnce() + Send + 'static) {
        if current_reactor() == Some(self.reactor) {
            return deliver();
        }
        match self.completions.try_send(Box::new(deliver)) {
            Ok(()) => {}
            Err(TrySendError::Full(job) | TrySendError::Closed(job)) => job(),
        }
    }
}

thread_local! {
    /// When this reactor last served client I/O; `None` off the reactors.
    static ACTIVITY: RefCell<Option<Rc<Activity>>> = const { RefCell::new(None) };
}

#[derive(Default)]
struct Activity {
    /// The last client I/O on this reactor, and what it was.
    last: Cell<Option<(Instant, SpinStart)>>,
    polling: Cell<bool>,
    wake_poller: Notify,
}

/// Marks client I/O on this reactor, a request arriving or its reply going out: it keeps
/// polling for what comes next for its poll window instead of sleeping at once (see
/// [`ReactorPool::start`]), unless such spins have been missing lately
/// ([`crate::spin_policy`]).
pub fn note_client_io(what: SpinStart) {
    let _ = ACTIVITY.try_with(|activity| {
        if let Some(activity) = activity.borrow().as_ref() {
            activity.last.set(Some((Instant::now(), what)));
            if !activity.polling.get() {
                activity.wake_poller.notify_one();
            }
        }
    });
}

/// Keeps the reactor polling its sockets (the runtime polls with a zero timeout while a task
/// yields) until no client I/O has happened for `window`, then lets it sleep. A sleeping
/// reactor is woken by an interrupt to its CPU, which on virtual machines costs tens of
/// microseconds per request; polling spends CPU for latency only while clients are active,
/// and only after the kinds of I/O whose spins have been catching something.
async fn poll_while_active(activity: Rc<Activity>, window: Duration) {
    let mut policy = SpinPolicy::default();
    loop {
        activity.polling.set(false);
        activity.wake_poller.notified().await;
        activity.polling.set(true);
        let Some(mut spin) = activity.last.get() else {
            continue;
        };
        if !policy.should_spin(spin.1) {
            continue;
        }
        loop {
            // Disk completions that landed wake their waiters now, not at the next epoll.
            ashlar_storage::fs::uring::reap_completions();
            tokio::task::yield_now().await;
            let Some(last) = activity.last.get() else {
                break;
            };
            if last.0 != spin.0 {
                policy.caught(spin.1);
                spin = last;
                if !policy.should_spin(spin.1) {
                    break;
                }
            } else if spin.0.elapsed() >= window {
                policy.missed(spin.1);
                break;
            }
        }
    }
}

/// Runs completions routed to this reactor, a burst at a time.
async fn run_completions(mut completions: mpsc::Receiver<Completion>) {
    let mut burst = Vec::new();
    while completions
        .recv_many(&mut burst, REPLY_ROUTE_QUEUE_LIMIT)
        .await
        > 0
    {
        for completion in burst.drain(..) {
            completion();
        }
    }
}

/// All reactors of the node. Dropping it (or calling `stop`) ends their threads once their
/// tasks have been told to stop by their owners.
pub struct ReactorPool {
    handles: Vec<ReactorHandle>,
    threads: Vec<JoinHandle<()>>,
    stop: Vec<oneshot::Sender<()>>,
}

/// Jobs queued per reactor before senders wait. Jobs are control-plane work (create a shard,
/// accept a connection), so a small bound is plenty.
pub const REACTOR_JOB_QUEUE_LIMIT: usize = 1024;

impl ReactorPool {
    /// Starts `count` reactors, reactor `i` pinned to `cpus[i % cpus.len()]` (empty: the
    /// CPUs this process may run on, [`allowed_cpus`]). After client I/O each keeps polling
    /// for `poll_window` before it sleeps (zero: sleep at once).
    pub fn start(
        count: usize,
        poll_window: Duration,
        cpus: &[usize],
    ) -> std::io::Result<ReactorPool> {
        assert!(count > 0, "a node needs at least one reactor");
        let cpus = if cpus.is_empty() {
            allowed_cpus()
        } else {
            cpus.to_vec()
        };
        let mut pool = ReactorPool {
            handles: Vec::new(),
            threads: Vec::new(),
            stop: Vec::new(),
        };
        for index in 0..count {
            let cpu = cpus[index % cpus.len()];
            let (jobs_tx, jobs_rx) = mpsc::channel::<Job>(REACTOR_JOB_QUEUE_LIMIT);
            let (stop_tx, stop_rx) = oneshot::channel();
            let thread = std::thread::Builder::new()
                .name(format!("reactor-{index}"))
                .spawn(move || reactor_main(index, cpu, poll_window, jobs_rx, stop_rx))?;
            pool.handles.push(ReactorHandle {
                id: ReactorId(index),
                jobs: jobs_tx,
            });
            pool.threads.push(thread);
            pool.stop.push(stop_tx);
        }
        Ok(pool)
    }

    pub fn handles(&self) -> &[ReactorHandle] {
        &self.handles
    }

    pub fn get(&self, id: ReactorId) -> &ReactorHandle {
        &self.handles[id.0 % self.handles.len()]
    }

    pub fn len(&self) -> usize {
        self.handles.len()
    }

    pub fn is_empty(&self) -> bool {
        self.handles.is_empty()
    }

    /// Stops every reactor thread and waits for it. Tasks still running are dropped.
    pub fn stop(mut self) {
        self.stop_threads();
    }

    fn stop_threads(&mut self) {
        for stop in self.stop.drain(..) {
            let _ = stop.send(());
        }
        let current = std::thread::current().id();
        for thread in self.threads.drain(..) {
            // The pool's last owner can be a task on one of its own reactors (a node that
            // fails to start drops everything from a task); that thread cannot wait for
            // itself, and it ends on its own once its loop sees the stop signal.
            if thread.thread().id() != current {
                let _ = thread.join();
            }
        }
    }
}

impl Drop for ReactorPool {
    fn drop(&mut self) {
        self.stop_threads();
    }
}

fn reactor_main(
    index: usize,
    cpu: usize,
    poll_window: Duration,
    mut jobs: mpsc::Receiver<Job>,
    stop: oneshot::Receiver<()>,
) {
    pin_to_cpu(cpu);
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            tracing::error!(reactor = index, %error, "cannot start reactor runtime");
            return;
        }
    };
    let local = tokio::task::LocalSet::new();
    let (route_tx, route_rx) = mpsc::channel(REPLY_ROUTE_QUEUE_LIMIT);
    CURRENT_ROUTE.with(|route| {
        *route.borrow_mut() = Some(ReplyRoute {
            reactor: ReactorId(index),
            completions: route_tx,
        })
    });
    let activity = Rc::new(Activity::default());
    if !poll_window.is_zero() {
        ACTIVITY.with(|slot| *slot.borrow_mut() = Some(activity.clone()));
    }
    local.block_on(&runtime, async move {
        tokio::task::spawn_local(run_completions(route_rx));
        // Disk operations started in one turn go to the kernel together.
        tokio::task::spawn_local(ashlar_storage::fs::uring::run_submitter());
        if !poll_window.is_zero() {
            tokio::task::spawn_local(poll_while_active(activity, poll_window));
        }
        let run_jobs = async {
            while let Some(job) = jobs.recv().await {
                job();
            }
        };
        tokio::select! {
            _ = run_jobs => {}
            _ = stop => {}
        }
    });
}

fn online_cpus() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

/// The CPUs this process may run on (its affinity mask: all online CPUs unless `taskset` or
/// a cpuset narrowed it), ascending; `[0]` if the mask cannot be read.
pub fn allowed_cpus() -> Vec<usize> {
    // SAFETY: cpu_set_t is plain data; sched_getaffinity(0, ...) fills it for this thread,
    // which has the process's mask (reactors pin themselves only after this is read).
    let cpus: Vec<usize> = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return vec![0];
        }
        (0..libc::CPU_SETSIZE as usize)
            .filter(|cpu| libc::CPU_ISSET(*cpu, &set))
            .collect()
    };
    if cpus.is_empty() {
        vec![0]
    } else {
        cpus
    }
}

fn pin_to_cpu(cpu: usize) {
    // SAFETY: cpu_set_t is plain data; sched_setaffinity(0, ...) affects only this thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            tracing::debug!(cpu, "could not pin reactor thread; continuing unpinned");
        }
    }
}

/// Default reactor count: one per CPU this process may run on.
pub fn default_reactor_count() -> usize {
    online_cpus()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jobs_run_on_their_reactor_thread() {
        let pool = ReactorPool::start(2, Duration::ZERO, &[]).unwrap();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        for handle in pool.handles() {
            let name = runtime
                .block_on(
                    handle.run(|| async { std::thread::current().name().map(str::to_string) }),
                )
                .unwrap();
            assert_eq!(
                name.as_deref(),
                Some(format!("reactor-{}", handle.id.0).as_str())
            );
        }
        pool.stop();
    }

    #[test]
    fn a_pool_dropped_by_one_of_its_own_reactors_stops_without_a_panic() {
        let pool = ReactorPool::start(2, Duration::ZERO, &[]).unwrap();
        let handle = pool.handles()[0].clone();
        let owner = std::sync::Arc::new(std::sync::Mutex::new(Some(pool)));
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let dropped = runtime.block_on(handle.run(move || async move {
            drop(owner.lock().unwrap().take());
            true
        }));
        // A panic in the drop (joining its own thread) would lose the reply.
        assert!(
            matches!(dropped, Ok(true)),
            "the reply was lost: {dropped:?}"
        );
    }
}

//! Reactors: one pinned thread per core, each running a tokio current-thread runtime and a
//! `LocalSet`. Controllers and client connections live on exactly one reactor and are never
//! moved; other threads reach them only by message.

use std::thread::JoinHandle;
use tokio::sync::{mpsc, oneshot};

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
    pub fn start(count: usize) -> std::io::Result<ReactorPool> {
        assert!(count > 0, "a node needs at least one reactor");
        let cpus = online_cpus();
        let mut pool = ReactorPool {
            handles: Vec::new(),
            threads: Vec::new(),
            stop: Vec::new(),
        };
        for index in 0..count {
            let (jobs_tx, jobs_rx) = mpsc::channel::<Job>(REACTOR_JOB_QUEUE_LIMIT);
            let (stop_tx, stop_rx) = oneshot::channel();
            let thread = std::thread::Builder::new()
                .name(format!("reactor-{index}"))
                .spawn(move || reactor_main(index, index % cpus, jobs_rx, stop_rx))?;
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
        for thread in self.threads.drain(..) {
            let _ = thread.join();
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
    local.block_on(&runtime, async move {
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
        let pool = ReactorPool::start(2).unwrap();
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
}

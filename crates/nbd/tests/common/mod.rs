//! Shared test scaffolding: a server on 127.0.0.1 port 0 inside a current-thread runtime
//! and `LocalSet`, the memory device, and the hand-written client.
#![allow(dead_code)]

pub mod client;
pub mod memory;

use ashlar_nbd::{serve_connection, NbdLimits};
use client::{Client, Mode, EXPECTED_FLAGS};
use memory::{MemoryDevice, MemoryRegistry};
use std::cell::RefCell;
use std::future::Future;
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub const MEM_SIZE: u64 = 16 << 20;
pub const SMALL_SIZE: u64 = 1 << 20;

/// Runs a test body on a current-thread runtime inside a `LocalSet`, as the node does,
/// failing it if it takes more than a minute.
pub fn run<F: Future>(body: F) -> F::Output {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let local = tokio::task::LocalSet::new();
    local.block_on(&runtime, async {
        tokio::time::timeout(Duration::from_secs(60), body)
            .await
            .expect("test timed out")
    })
}

/// Two exports: `mem` (16 MiB) and `small` (1 MiB).
pub fn registry() -> Rc<MemoryRegistry> {
    let mut registry = MemoryRegistry::default();
    registry.add("mem", "memory export", MemoryDevice::new(MEM_SIZE));
    registry.add("small", "a small one", MemoryDevice::new(SMALL_SIZE));
    Rc::new(registry)
}

type Outcomes = Rc<RefCell<Vec<Result<(), String>>>>;

/// A server accepting on loopback; every connection runs `serve_connection` in its own
/// local task, as the node does.
pub struct TestServer {
    pub addr: SocketAddr,
    pub registry: Rc<MemoryRegistry>,
    shutdown: watch::Sender<bool>,
    outcomes: Outcomes,
    tasks: Rc<RefCell<Vec<JoinHandle<()>>>>,
    accept: JoinHandle<()>,
}

impl TestServer {
    pub async fn start(registry: Rc<MemoryRegistry>, limits: NbdLimits) -> TestServer {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (shutdown, shutdown_rx) = watch::channel(false);
        let outcomes: Outcomes = Rc::default();
        let tasks: Rc<RefCell<Vec<JoinHandle<()>>>> = Rc::default();
        let accept = tokio::task::spawn_local(accept_loop(
            listener,
            registry.clone(),
            limits,
            shutdown_rx,
            outcomes.clone(),
            tasks.clone(),
        ));
        TestServer {
            addr,
            registry,
            shutdown,
            outcomes,
            tasks,
            accept,
        }
    }

    pub async fn default() -> TestServer {
        Self::start(registry(), NbdLimits::default()).await
    }

    pub fn device(&self, name: &str) -> MemoryDevice {
        self.registry.device(name)
    }

    /// Waits until `count` connections have ended and returns their results so far.
    pub async fn ended(&self, count: usize) -> Vec<Result<(), String>> {
        for _ in 0..500 {
            if self.outcomes.borrow().len() >= count {
                return self.outcomes.borrow().clone();
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!(
            "only {} of {count} connections ended",
            self.outcomes.borrow().len()
        );
    }

    pub fn trigger_shutdown(&self) {
        let _ = self.shutdown.send(true);
    }

    /// Shuts down and checks that no connection task panicked.
    pub async fn stop(self) -> Vec<Result<(), String>> {
        self.trigger_shutdown();
        self.accept.abort();
        let tasks: Vec<_> = self.tasks.borrow_mut().drain(..).collect();
        for task in tasks {
            let joined = tokio::time::timeout(Duration::from_secs(40), task)
                .await
                .expect("connection ends");
            assert!(joined.is_ok(), "connection task panicked: {joined:?}");
        }
        self.outcomes.borrow().clone()
    }
}

async fn accept_loop(
    listener: TcpListener,
    registry: Rc<MemoryRegistry>,
    limits: NbdLimits,
    shutdown: watch::Receiver<bool>,
    outcomes: Outcomes,
    tasks: Rc<RefCell<Vec<JoinHandle<()>>>>,
) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let (registry, limits, shutdown, outcomes) = (
            registry.clone(),
            limits.clone(),
            shutdown.clone(),
            outcomes.clone(),
        );
        let task = tokio::task::spawn_local(async move {
            let result = serve_connection(stream, registry, limits, shutdown).await;
            outcomes
                .borrow_mut()
                .push(result.map_err(|e| e.to_string()));
        });
        tasks.borrow_mut().push(task);
    }
}

/// A well-behaved client on a fresh connection: GO, write, read back, flush, disconnect.
pub async fn assert_healthy(addr: SocketAddr) {
    for mode in [client::SIMPLE, client::STRUCTURED] {
        let (mut c, size) = Client::connect(addr, "mem", mode).await;
        assert_eq!(size, MEM_SIZE);
        let pattern: Vec<u8> = (0..8192u32).map(|i| (i % 251) as u8 + 1).collect();
        assert_eq!(c.write(1 << 20, &pattern, 0).await, 0);
        let answer = c.read(1 << 20, 8192).await;
        assert_eq!(answer.error, 0);
        assert_eq!(answer.data, pattern);
        assert_eq!(c.call(client::CMD_FLUSH, 0, 0, 0, &[]).await.error, 0);
        c.disconnect().await;
        assert!(c.closed_by_server().await);
    }
}

/// Transmission flags sanity shared by tests.
pub fn assert_flags(flags: u16) {
    assert_eq!(flags, EXPECTED_FLAGS);
}

pub fn mode(structured: bool, allocation: bool) -> Mode {
    Mode {
        structured,
        allocation,
    }
}

/// Deterministic pseudo-random bytes (xorshift), so failures reproduce.
pub fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

//! Helpers shared by the extent-store integration tests, and [`CrashFs`] (crash_fs.rs), the
//! in-memory disk the crash tests run on.
#![allow(dead_code)]

mod crash_fs;
mod model;

pub use crash_fs::CrashFs;
#[allow(unused_imports)] // not every test binary models a workload
pub use model::{apply_model, write_batch, TestOp};
use std::future::Future;

/// The filesystem the crash tests run on: the one-line switch to `fs::sim::SimFs`.
pub type TestFs = CrashFs;

/// Runs a future on a current-thread runtime inside a `LocalSet`, as a reactor does.
pub fn run_local<F: Future>(future: F) -> F::Output {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    tokio::task::LocalSet::new().block_on(&runtime, future)
}

/// Deterministic pseudo-random numbers (xorshift64*).
#[derive(Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    pub fn chance(&mut self, one_in: u64) -> bool {
        self.below(one_in) == 0
    }
}

/// Deterministic bytes: different seeds give different contents.
pub fn pattern(seed: u64, length: usize) -> Vec<u8> {
    let mut rng = Rng::new(seed ^ 0x5555);
    (0..length).map(|_| (rng.next() >> 24) as u8).collect()
}

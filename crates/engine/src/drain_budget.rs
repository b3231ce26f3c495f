//! The node-wide bound on memory that drain steps hold.
//!
//! A drain step reads the oplog data it moves into memory before writing it to the extent
//! store, and larger steps are much cheaper per block: each extent group a step touches costs
//! two syncs and its checksum-block writes whatever the number of blocks it receives, so a
//! step that brings many blocks to each group costs far fewer disk operations per block
//! (bench/results/20261126-224500-vm). Steps are therefore large (`--drain-batch`), and the
//! sum over every shard of the node (and the drains of startup recovery and hand-overs) is
//! bounded by one budget (`--drain-memory`): a step takes what it wants if that much is
//! free, else what is free (at least [`MIN_DRAIN_STEP_BYTES`], waiting for that much), so
//! many draining shards share the budget with smaller steps instead of waiting in line.

use std::sync::Arc;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The smallest step a drain takes from the budget (it waits until this much is free).
pub const MIN_DRAIN_STEP_BYTES: u64 = 1 << 20;

/// Default of `EngineConfig::drain_memory_bytes` (the node's `--drain-memory`).
pub const DEFAULT_DRAIN_MEMORY_BYTES: u64 = 256 << 20;

/// Default of `EngineConfig::drain_batch_bytes` (the node's `--drain-batch`).
pub const DEFAULT_DRAIN_BATCH_BYTES: u64 = 128 << 20;

/// Bytes of drain data the whole node may hold at once. Cloning shares the budget.
#[derive(Clone, Debug)]
pub struct DrainBudget {
    semaphore: Arc<Semaphore>,
    total_bytes: u64,
}

/// Bytes taken from a [`DrainBudget`], given back when dropped.
#[derive(Debug)]
pub struct DrainAllowance {
    bytes: u64,
    _permit: OwnedSemaphorePermit,
}

impl DrainAllowance {
    /// How much data the step may read.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl DrainBudget {
    /// A budget of `total_bytes` (at least [`MIN_DRAIN_STEP_BYTES`]).
    pub fn new(total_bytes: u64) -> Self {
        let total_bytes = total_bytes.max(MIN_DRAIN_STEP_BYTES);
        let permits = usize::try_from(total_bytes)
            .unwrap_or(usize::MAX)
            .min(Semaphore::MAX_PERMITS);
        DrainBudget {
            semaphore: Arc::new(Semaphore::new(permits)),
            total_bytes: permits as u64,
        }
    }

    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    /// Bytes no step holds now.
    pub fn free_bytes(&self) -> u64 {
        self.semaphore.available_permits() as u64
    }

    /// Takes `want` bytes if they are free, else whatever is free, but at least
    /// [`MIN_DRAIN_STEP_BYTES`] (or `want` if smaller), waiting until that much is free and
    /// then taking whatever more has become free, up to `want`. Never more than the budget.
    pub async fn take(&self, want: u64) -> DrainAllowance {
        let want = want.clamp(1, self.total_bytes);
        let floor = want.min(MIN_DRAIN_STEP_BYTES);
        let first = want.min(self.free_bytes()).max(floor);
        let mut permit = self
            .semaphore
            .clone()
            .acquire_many_owned(permits(first))
            .await
            .expect("the drain budget's semaphore is never closed");
        let mut bytes = u64::from(permits(first));
        let more = (want - bytes).min(self.free_bytes());
        if more > 0 {
            if let Ok(extra) = self.semaphore.clone().try_acquire_many_owned(permits(more)) {
                permit.merge(extra);
                bytes += u64::from(permits(more));
            }
        }
        DrainAllowance {
            bytes,
            _permit: permit,
        }
    }
}

/// Semaphore permits for `bytes` (one per byte; a single take is at most 4 GiB).
fn permits(bytes: u64) -> u32 {
    u32::try_from(bytes).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[tokio::test]
    async fn a_step_takes_what_it_wants_while_that_much_is_free() {
        let budget = DrainBudget::new(256 * MIB);
        let step = budget.take(128 * MIB).await;
        assert_eq!(step.bytes(), 128 * MIB);
        assert_eq!(budget.free_bytes(), 128 * MIB);
        drop(step);
        assert_eq!(budget.free_bytes(), 256 * MIB);
    }

    #[tokio::test]
    async fn later_steps_shrink_to_what_is_left() {
        let budget = DrainBudget::new(256 * MIB);
        let first = budget.take(200 * MIB).await;
        let second = budget.take(128 * MIB).await;
        assert_eq!(second.bytes(), 56 * MIB);
        assert_eq!(budget.free_bytes(), 0);
        drop((first, second));
        assert_eq!(budget.free_bytes(), 256 * MIB);
    }

    #[tokio::test]
    async fn a_step_waits_when_less_than_the_minimum_is_free() {
        let budget = DrainBudget::new(4 * MIB);
        let held = budget.take(4 * MIB - 4096).await;
        let waiting = {
            let budget = budget.clone();
            tokio::spawn(async move { budget.take(8 * MIB).await.bytes() })
        };
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "4 KiB free is less than a step");
        drop(held);
        // Once the budget is free again the step takes all of it, never more.
        assert_eq!(waiting.await.unwrap(), 4 * MIB);
    }

    #[tokio::test]
    async fn small_wants_and_huge_wants_are_bounded() {
        let budget = DrainBudget::new(2 * MIB);
        assert_eq!(budget.take(4096).await.bytes(), 4096);
        assert_eq!(budget.take(u64::MAX).await.bytes(), 2 * MIB);
        assert_eq!(DrainBudget::new(0).total_bytes(), MIN_DRAIN_STEP_BYTES);
    }
}

//! Tasks that end with their owner.

use tokio::task::JoinHandle;

/// Aborts the task when dropped, so a connection's helper tasks never outlive it.
#[derive(Debug)]
pub struct AbortOnDrop<T>(pub JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

//! Runs futures concurrently inside one task (a hand-rolled `join_all`): the per-extent I/Os
//! of one request stay in flight together on an asynchronous filesystem.

use std::future::Future;
use std::pin::Pin;
use std::task::Poll;

/// Polls every future until all are done; outputs in input order.
pub(crate) async fn join_all<F: Future>(futures: impl IntoIterator<Item = F>) -> Vec<F::Output> {
    let mut pending: Vec<Pin<Box<F>>> = futures.into_iter().map(Box::pin).collect();
    let mut outputs: Vec<Option<F::Output>> = pending.iter().map(|_| None).collect();
    let mut left = pending.len();
    std::future::poll_fn(|cx| {
        for (future, output) in pending.iter_mut().zip(outputs.iter_mut()) {
            if output.is_none() {
                if let Poll::Ready(value) = future.as_mut().poll(cx) {
                    *output = Some(value);
                    left -= 1;
                }
            }
        }
        if left == 0 {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    })
    .await;
    outputs.into_iter().flatten().collect()
}

/// `join_all` of fallible futures: the first error (in input order), after all are done.
pub(crate) async fn try_join_all<T, E, F>(futures: impl IntoIterator<Item = F>) -> Result<Vec<T>, E>
where
    F: Future<Output = Result<T, E>>,
{
    join_all(futures).await.into_iter().collect()
}

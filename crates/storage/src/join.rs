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

/// What [`try_run_windowed`] does once a future has failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AfterError {
    /// Starts nothing more: for independent units of work that a retry redoes whole.
    StopStarting,
    /// Starts every future still: for parts of one unit whose recovery assumes all of them
    /// were issued (an egroup phase's writes, docs/extent-store-format.md "Writes").
    StartTheRest,
}

/// Runs the futures in order with at most `width` (at least 1) in flight, starting the next as
/// one finishes. After the first error, `after_error` says whether more start; those in
/// flight always finish, then the first error is returned.
pub(crate) async fn try_run_windowed<E, F>(
    futures: impl IntoIterator<Item = F>,
    width: usize,
    after_error: AfterError,
) -> Result<(), E>
where
    F: Future<Output = Result<(), E>>,
{
    let width = width.max(1);
    let mut source = futures.into_iter();
    let mut source_done = false;
    let mut running: Vec<Pin<Box<F>>> = Vec::with_capacity(width);
    let mut first_error: Option<E> = None;
    std::future::poll_fn(|cx| loop {
        let starting = first_error.is_none() || after_error == AfterError::StartTheRest;
        while !source_done && starting && running.len() < width {
            match source.next() {
                Some(future) => running.push(Box::pin(future)),
                None => source_done = true,
            }
        }
        let before = running.len();
        running.retain_mut(|future| match future.as_mut().poll(cx) {
            Poll::Ready(result) => {
                if let Err(error) = result {
                    first_error.get_or_insert(error);
                }
                false
            }
            Poll::Pending => true,
        });
        let starting = first_error.is_none() || after_error == AfterError::StartTheRest;
        if running.is_empty() && (source_done || !starting) {
            return Poll::Ready(());
        }
        if running.len() == before {
            return Poll::Pending;
        }
    })
    .await;
    first_error.map_or(Ok(()), Err)
}

#[cfg(test)]
mod tests {
    use super::{try_run_windowed, AfterError};
    use std::cell::Cell;

    /// Each future yields once and fails if its id is in `failing`; `peak` records the most in
    /// flight at once.
    async fn step(
        id: u32,
        live: &Cell<usize>,
        peak: &Cell<usize>,
        failing: &[u32],
    ) -> Result<(), u32> {
        live.set(live.get() + 1);
        peak.set(peak.get().max(live.get()));
        tokio::task::yield_now().await;
        live.set(live.get() - 1);
        if failing.contains(&id) {
            Err(id)
        } else {
            Ok(())
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn keeps_at_most_width_in_flight_and_runs_all() {
        let (live, peak, started) = (Cell::new(0), Cell::new(0), Cell::new(0));
        let futures = (0..10).map(|id| {
            started.set(started.get() + 1);
            step(id, &live, &peak, &[])
        });
        assert_eq!(
            try_run_windowed(futures, 3, AfterError::StopStarting).await,
            Ok(())
        );
        assert_eq!(started.get(), 10);
        assert_eq!(peak.get(), 3);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn starts_nothing_after_an_error_and_returns_it() {
        let (live, peak, started) = (Cell::new(0), Cell::new(0), Cell::new(0));
        let futures = (0..10).map(|id| {
            started.set(started.get() + 1);
            step(id, &live, &peak, &[1])
        });
        assert_eq!(
            try_run_windowed(futures, 2, AfterError::StopStarting).await,
            Err(1)
        );
        assert_eq!(
            started.get(),
            2,
            "the window held 0 and 1; nothing started after 1 failed"
        );
        assert_eq!(live.get(), 0, "every started future finished");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn can_start_every_future_after_an_error_and_return_the_first() {
        let (live, peak, started) = (Cell::new(0), Cell::new(0), Cell::new(0));
        let futures = (0..10).map(|id| {
            started.set(started.get() + 1);
            step(id, &live, &peak, &[1, 7])
        });
        assert_eq!(
            try_run_windowed(futures, 2, AfterError::StartTheRest).await,
            Err(1)
        );
        assert_eq!(started.get(), 10, "every future started despite the errors");
        assert_eq!(peak.get(), 2, "still at most the width in flight");
        assert_eq!(live.get(), 0, "every started future finished");
    }
}

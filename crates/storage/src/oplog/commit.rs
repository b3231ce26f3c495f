//! Admission, pending batches and group commit.
//!
//! A writer first waits for space (capacity) and for room in the pending records (the commit
//! batch limit), then appends its record to the pending batch of its segment and waits for
//! that batch to become durable. The first writer that finds no commit under way becomes the
//! committer and commits the oldest pending batch with one `write_at` and one `sync_data`;
//! records arriving meanwhile form the next batch. When a commit is durable, the next pending
//! batch's commit is started on a task of its own *before* the finished batch's writers are
//! woken, so the disk is not idle while they run (they are many, and each goes on to answer
//! its client). When nothing is pending, the chain stops; a writer of the next batch then
//! starts it again (`hand_over`), so nothing ever polls. The log must therefore be used
//! inside a tokio `LocalSet`, as every single-threaded owner in Ashlar is.
//!
//! Failure: if a commit fails (or its committer is dropped mid-commit), every writer of that
//! batch and of every pending batch gets the error, and the log stops taking records: the
//! segment tail may hold a partial batch, and appending after it would bury it in the middle
//! of the log. Reopening cuts it off as a torn tail.

use super::error::io_error;
use super::format::{encode_record, Header, RecordKind};
use super::{IndexUpdate, Inner, OplogError};
use crate::disk::{FileIo, FileOpener};
use std::cell::RefCell;
use std::io;
use std::path::PathBuf;
use std::rc::Rc;
use tokio::sync::Notify;

/// Records bound for one segment, written by one `write_at` at `file_offset`.
pub(super) struct Batch {
    segment: u64,
    file_offset: u64,
    buf: Vec<u8>,
    updates: Vec<IndexUpdate>,
    /// Shared with the batch's writers; `Rc::strong_count` > 1 means one still waits.
    signal: Rc<BatchSignal>,
}

impl Batch {
    fn new(segment: u64, file_offset: u64) -> Self {
        Batch {
            segment,
            file_offset,
            buf: Vec::new(),
            updates: Vec::new(),
            signal: Rc::default(),
        }
    }
}

/// How a batch's writers learn its outcome (`notify_waiters`) or that it is their turn to
/// commit (`notify_one`).
#[derive(Default)]
pub(super) struct BatchSignal {
    outcome: RefCell<Option<Result<(), Failure>>>,
    notify: Notify,
}

impl BatchSignal {
    fn complete(&self, outcome: Result<(), Failure>) {
        *self.outcome.borrow_mut() = Some(outcome);
        self.notify.notify_waiters();
    }

    fn outcome(&self) -> Option<Result<(), Failure>> {
        self.outcome.borrow().clone()
    }
}

/// Why a batch failed, kept so every writer of the batch gets its own `OplogError`.
#[derive(Clone, Debug)]
pub(super) struct Failure {
    path: PathBuf,
    no_space: bool,
    kind: io::ErrorKind,
    message: String,
}

impl Failure {
    pub(super) fn from_error(error: &OplogError, fallback: &std::path::Path) -> Self {
        let (path, no_space, kind) = match error {
            OplogError::Io { path, source } => (path.clone(), false, source.kind()),
            OplogError::NoSpace { path } => (path.clone(), true, io::ErrorKind::StorageFull),
            _ => (fallback.to_path_buf(), false, io::ErrorKind::Other),
        };
        Failure {
            path,
            no_space,
            kind,
            message: error.to_string(),
        }
    }

    fn to_error(&self) -> OplogError {
        if self.no_space {
            return OplogError::NoSpace {
                path: self.path.clone(),
            };
        }
        OplogError::Io {
            path: self.path.clone(),
            source: io::Error::new(self.kind, self.message.clone()),
        }
    }
}

/// What a writer waits for before it may append.
enum Wait {
    Space,
    Room,
}

impl<O: FileOpener + 'static> Inner<O> {
    /// Appends one record and returns once it is durable and indexed.
    pub(super) async fn submit(
        self: &Rc<Self>,
        kind: RecordKind,
        offset: u64,
        length: u32,
        payload: &[u8],
    ) -> Result<(), OplogError> {
        let bytes = match kind {
            RecordKind::Write => super::format::write_record_bytes(u64::from(length)),
            RecordKind::Zero | RecordKind::Barrier => super::format::HEADER_BYTES,
        };
        if bytes > self.config.capacity_bytes {
            return Err(OplogError::TooLarge {
                length: bytes,
                capacity: self.config.capacity_bytes,
            });
        }
        self.reserve(bytes).await?;
        // No await between the last admission check in `reserve` and the append.
        let signal = self.append(kind, offset, length, payload);
        self.wait_durable(&signal).await
    }

    /// Waits until `bytes` more fit in the capacity and in the pending batch limit.
    async fn reserve(self: &Rc<Self>, bytes: u64) -> Result<(), OplogError> {
        let mut space_waiter: Option<SpaceWaiter<'_, O>> = None;
        loop {
            let wait = {
                let state = self.state.borrow();
                if let Some(reason) = &state.failed {
                    return Err(self.failed_error(reason));
                }
                // An empty log takes any record that passed the TooLarge check.
                let space = state.usage == 0 || state.usage + bytes <= self.config.capacity_bytes;
                let room = state.pending_bytes == 0
                    || state.pending_bytes + bytes <= self.config.max_commit_batch_bytes as u64;
                match (space, room) {
                    (true, true) => return Ok(()),
                    (false, _) => Wait::Space,
                    (true, false) => Wait::Room,
                }
            };
            // A batch nobody commits (its writers were all dropped) must not block admission.
            if let Some(batch) = self.take_front() {
                self.commit(batch).await;
                continue;
            }
            match wait {
                Wait::Room => self.batch_room.notified().await,
                Wait::Space => {
                    if space_waiter.is_none() {
                        space_waiter = Some(SpaceWaiter::new(self));
                    }
                    // Registered before freeing, which awaits: a wake-up meanwhile is kept.
                    let notified = self.space.notified();
                    tokio::pin!(notified);
                    notified.as_mut().enable();
                    // Segments whose records were all superseded need no drain to go.
                    if self.free_segments().await? == 0 {
                        notified.await;
                    }
                }
            }
        }
    }

    /// Gives the record a sequence number and a place in the active segment and adds it to
    /// that segment's pending batch.
    fn append(
        &self,
        kind: RecordKind,
        offset: u64,
        length: u32,
        payload: &[u8],
    ) -> Rc<BatchSignal> {
        let mut state = self.state.borrow_mut();
        let state = &mut *state;
        let seq = state.next_seq;
        state.next_seq += 1;
        let header = Header::new(kind, seq, offset, length);
        let bytes = header.record_bytes();
        let (segment_id, file_offset) = {
            let (id, segment) =
                state.segment_for(bytes, seq, &self.config.dir, self.config.segment_bytes);
            let file_offset = segment.bytes;
            segment.bytes += bytes;
            (id, file_offset)
        };
        let same_segment = state
            .pending
            .back()
            .is_some_and(|b| b.segment == segment_id);
        if !same_segment {
            if let Some(segment) = state.segments.get_mut(&segment_id) {
                segment.batches += 1;
            }
            state.pending.push_back(Batch::new(segment_id, file_offset));
        }
        state.usage += bytes;
        state.pending_bytes += bytes;
        let Some(batch) = state.pending.back_mut() else {
            // Unreachable: a batch was pushed above if none matched.
            return Rc::default();
        };
        encode_record(&header, payload, &mut batch.buf);
        batch
            .updates
            .push(IndexUpdate::for_record(&header, segment_id, file_offset));
        batch.signal.clone()
    }

    /// Waits for the batch behind `signal`, committing batches whenever nobody else is.
    async fn wait_durable(self: &Rc<Self>, signal: &Rc<BatchSignal>) -> Result<(), OplogError> {
        loop {
            if let Some(outcome) = signal.outcome() {
                self.hand_over().await;
                return outcome.map_err(|failure| failure.to_error());
            }
            if let Some(batch) = self.take_front() {
                self.commit(batch).await;
                continue;
            }
            signal.notify.notified().await;
        }
    }

    /// Called by a writer whose batch is done: makes sure the next pending batch has a
    /// committer. One of its writers is woken to commit it; a batch whose writers were all
    /// dropped is committed here, so it cannot stall the batches behind it.
    async fn hand_over(self: &Rc<Self>) {
        loop {
            let next = {
                let state = self.state.borrow();
                if state.committing {
                    return;
                }
                match state.pending.front() {
                    None => return,
                    Some(batch) => (Rc::strong_count(&batch.signal) > 1, batch.signal.clone()),
                }
            };
            match next {
                (true, signal) => {
                    signal.notify.notify_one();
                    return;
                }
                (false, _) => {
                    if let Some(batch) = self.take_front() {
                        self.commit(batch).await;
                    }
                }
            }
        }
    }

    /// Makes the caller the committer of the oldest pending batch, if no commit is under way.
    fn take_front(&self) -> Option<Batch> {
        let batch = {
            let mut state = self.state.borrow_mut();
            if state.committing {
                return None;
            }
            let batch = state.pending.pop_front()?;
            state.committing = true;
            state.pending_bytes -= batch.buf.len() as u64;
            batch
        };
        self.batch_room.notify_waiters();
        Some(batch)
    }

    /// Writes and syncs one batch, then indexes its records in sequence order and wakes its
    /// writers. On error the log fails (see the module comment).
    async fn commit(self: &Rc<Self>, batch: Batch) {
        let mut guard = CommitGuard {
            inner: self,
            segment: batch.segment,
            signal: batch.signal.clone(),
            armed: true,
        };
        let result = self.write_batch(&batch).await;
        guard.armed = false;
        match result {
            Ok(()) => self.finish(batch),
            Err(error) => {
                tracing::error!(dir = %self.config.dir.display(), %error, "oplog commit failed; the log takes no more writes");
                let failure = Failure::from_error(&error, &self.config.dir);
                self.fail_commit(batch.segment, &batch.signal, failure);
            }
        }
    }

    async fn write_batch(&self, batch: &Batch) -> Result<(), OplogError> {
        let (file, path) = self.segment_file_for_commit(batch.segment).await?;
        file.write_at(&batch.buf, batch.file_offset)
            .await
            .map_err(|e| io_error(&path, e))?;
        file.sync_data().await.map_err(|e| io_error(&path, e))
    }

    /// The segment's open file; the first commit into a new segment creates it and syncs the
    /// directory, so the file cannot vanish in a crash after its records were acknowledged
    /// (rule 3).
    async fn segment_file_for_commit(
        &self,
        segment: u64,
    ) -> Result<(Rc<O::File>, PathBuf), OplogError> {
        let (file, path) = {
            let state = self.state.borrow();
            let Some(s) = state.segments.get(&segment) else {
                // A segment with a pending batch is never freed; this would be a bug.
                return Err(
                    self.failed_error(&format!("segment {segment} vanished before its commit"))
                );
            };
            (s.file.clone(), s.path.clone())
        };
        if let Some(file) = file {
            return Ok((file, path));
        }
        let file = match self.reuse_spare(&path).await? {
            Some(file) => Rc::new(file),
            None => {
                let file = self
                    .opener
                    .open(&path, true)
                    .map_err(|e| io_error(&path, e))?;
                super::files::sync_dir(&self.config.dir).await?;
                Rc::new(file)
            }
        };
        if let Some(s) = self.state.borrow_mut().segments.get_mut(&segment) {
            s.file = Some(file.clone());
        }
        Ok((file, path))
    }

    /// Starts committing the next pending batch, if any and if no commit is under way, on a
    /// task of its own.
    fn start_next_commit(self: &Rc<Self>) {
        if let Some(next) = self.take_front() {
            tokio::task::spawn_local(commit_task(self.clone(), next));
        }
    }

    fn finish(self: &Rc<Self>, batch: Batch) {
        let space_waiters = {
            let mut state = self.state.borrow_mut();
            for update in &batch.updates {
                update.apply(&mut state.index);
            }
            if let Some(segment) = state.segments.get_mut(&batch.segment) {
                segment.batches -= 1;
            }
            state.committing = false;
            state.space_waiters
        };
        // Queued ahead of the writers that `complete` wakes, so it runs first.
        self.start_next_commit();
        batch.signal.complete(Ok(()));
        if self.needs_drain() {
            self.drain.notify_waiters();
        }
        if space_waiters > 0 {
            self.space.notify_waiters();
        }
    }

    /// Fails the committing batch, then the whole log.
    fn fail_commit(&self, segment: u64, signal: &BatchSignal, failure: Failure) {
        {
            let mut state = self.state.borrow_mut();
            if let Some(s) = state.segments.get_mut(&segment) {
                s.batches -= 1;
            }
            state.committing = false;
        }
        signal.complete(Err(failure.clone()));
        self.fail_log(failure);
    }
}

/// Methods that start no task, so `Drop` guards may call them.
impl<O: FileOpener> Inner<O> {
    /// Stops the log taking records: fails every pending batch and wakes every waiter so
    /// they see it. A commit under way (if any) finishes normally.
    pub(super) fn fail_log(&self, failure: Failure) {
        let pending = {
            let Ok(mut state) = self.state.try_borrow_mut() else {
                return;
            };
            if state.failed.is_none() {
                state.failed = Some(failure.message.clone());
            }
            state.pending_bytes = 0;
            let pending: Vec<Batch> = state.pending.drain(..).collect();
            for batch in &pending {
                if let Some(s) = state.segments.get_mut(&batch.segment) {
                    s.batches -= 1;
                }
            }
            pending
        };
        for batch in pending {
            batch.signal.complete(Err(failure.clone()));
        }
        self.batch_room.notify_waiters();
        self.space.notify_waiters();
        self.drain.notify_waiters();
    }
}

async fn commit_task<O: FileOpener + 'static>(inner: Rc<Inner<O>>, batch: Batch) {
    inner.commit(batch).await;
}

/// Fails the log if the committer's future is dropped mid-commit: whether the batch reached
/// the file is unknown.
struct CommitGuard<'a, O: FileOpener> {
    inner: &'a Inner<O>,
    segment: u64,
    signal: Rc<BatchSignal>,
    armed: bool,
}

impl<O: FileOpener> Drop for CommitGuard<'_, O> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let failure = Failure {
            path: self.inner.config.dir.clone(),
            no_space: false,
            kind: io::ErrorKind::Interrupted,
            message: "a commit was abandoned midway (its writer was dropped)".into(),
        };
        if let Ok(mut state) = self.inner.state.try_borrow_mut() {
            if let Some(s) = state.segments.get_mut(&self.segment) {
                s.batches -= 1;
            }
            state.committing = false;
        }
        self.signal.complete(Err(failure.clone()));
        self.inner.fail_log(failure);
    }
}

/// Counts a writer waiting for space while it lives, so `needs_drain()` asks for a drain.
struct SpaceWaiter<'a, O: FileOpener> {
    inner: &'a Inner<O>,
}

impl<'a, O: FileOpener> SpaceWaiter<'a, O> {
    fn new(inner: &'a Inner<O>) -> Self {
        inner.state.borrow_mut().space_waiters += 1;
        inner.drain.notify_waiters();
        SpaceWaiter { inner }
    }
}

impl<O: FileOpener> Drop for SpaceWaiter<'_, O> {
    fn drop(&mut self) {
        if let Ok(mut state) = self.inner.state.try_borrow_mut() {
            state.space_waiters -= 1;
        }
    }
}

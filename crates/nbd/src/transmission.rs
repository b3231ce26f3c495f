//! The transmission phase. The reader (this task) reads requests continuously, validates
//! each, and spawns one local task per request; replies go through the writer task and may
//! complete out of order. Two things stop reading (backpressure), both held until the
//! request's reply is written: a semaphore of `max_in_flight` permits, taken before a request
//! is read, and the request's payload bytes from the budget (`budget.rs`), taken after its
//! header and before its payload is read or the read executed.

use crate::budget::Ledger;
use crate::execute::{execute, Outcome};
use crate::limits::Effective;
use crate::negotiate::Session;
use crate::proto::{self, Command, DecodeError, RequestHeader, REQUEST_HEADER_LEN};
use crate::reply::{self, Encoded};
use crate::request::{validate, Params};
use crate::signal::{wait_readable, wait_shutdown, Readiness};
use crate::violation::{Violation, ViolationLog};
use crate::writer::{write_replies, Outgoing, Slot};
use crate::NbdError;
use ashlar_core::buffers::receive::{receive_payload, PayloadSource};
use ashlar_core::buffers::DiskBuf;
use ashlar_core::BlockDevice;
use bytes::Bytes;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncBufRead, AsyncReadExt, AsyncWrite};
use tokio::sync::{mpsc, watch, Semaphore};
use tokio::task::JoinHandle;

/// A write larger than the advertised maximum but at most this big is read and thrown away
/// so the client gets an error and the connection survives; the protocol says payloads up to
/// 32 MiB should not be treated as an attack. Anything larger closes the connection.
const MAX_SKIPPED_PAYLOAD: u32 = 32 << 20;

/// On shutdown, how long replies to in-flight requests may take to go out before the
/// connection is dropped anyway (a client that stopped reading must not stall shutdown).
const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);

/// Why the reader stopped.
enum End {
    /// NBD_CMD_DISC, or the client closed its side between requests.
    ClientDone,
    Shutdown,
    /// The writer failed (the client is gone); nothing more can be answered.
    WriterGone,
}

/// What every request task needs, shared by `Rc` (tasks stay on this thread).
struct Connection<D> {
    device: D,
    params: Params,
    context_id: u32,
    replies: mpsc::Sender<Outgoing>,
}

/// Serves requests until the client disconnects, breaks the protocol, or the server shuts
/// down; in-flight requests are answered before a clean return.
pub(crate) async fn serve<D, Rd, Wr>(
    mut reader: Rd,
    writer: Wr,
    session: Session<D>,
    limits: &Effective,
    shutdown: &mut watch::Receiver<bool>,
    log: &mut ViolationLog,
) -> Result<(), NbdError>
where
    D: BlockDevice + 'static,
    Rd: PayloadSource,
    Wr: AsyncWrite + Unpin + 'static,
{
    let (replies, queue) = mpsc::channel(limits.max_in_flight);
    let writer = tokio::task::spawn_local(write_replies(queue, writer));
    let params = Params {
        structured: session.structured,
        allocation: session.allocation_context.is_some(),
        min_block: limits.min_block,
        max_request: limits.max_request,
    };
    let connection = Rc::new(Connection {
        device: session.device,
        params,
        context_id: session.allocation_context.unwrap_or(0),
        replies,
    });
    let permits = Arc::new(Semaphore::new(limits.max_in_flight));
    let ledger = Ledger::new(limits.budget.clone(), limits.allowance);
    let ended = read_requests(&mut reader, &connection, &permits, &ledger, shutdown, log).await;
    // Request tasks hold their own clones; the writer ends once the last one has replied.
    drop(connection);
    finish(writer, ended).await
}

async fn read_requests<D, Rd>(
    reader: &mut Rd,
    connection: &Rc<Connection<D>>,
    permits: &Arc<Semaphore>,
    ledger: &Rc<Ledger>,
    shutdown: &mut watch::Receiver<bool>,
    log: &mut ViolationLog,
) -> Result<End, NbdError>
where
    D: BlockDevice + 'static,
    Rd: PayloadSource,
{
    let replies = &connection.replies;
    let max_request = connection.params.max_request;
    loop {
        if *shutdown.borrow() {
            return Ok(End::Shutdown);
        }
        if replies.is_closed() {
            return Ok(End::WriterGone);
        }
        // With a permit free and the next header already received (a busy connection), the
        // request starts without the waits below: setting up each costs more than the
        // request's own work on a cached read.
        let ready_permit = permits.clone().try_acquire_owned().ok();
        let header_buffered =
            ready_permit.is_some() && buffered_bytes(reader)? >= REQUEST_HEADER_LEN;
        let (permit, header) = match ready_permit {
            Some(permit) if header_buffered => (permit, read_header(reader, log).await?),
            ready_permit => {
                let permit = match ready_permit {
                    Some(permit) => permit,
                    None => tokio::select! {
                        biased;
                        _ = replies.closed() => return Ok(End::WriterGone),
                        _ = wait_shutdown(shutdown) => return Ok(End::Shutdown),
                        permit = permits.clone().acquire_owned() => match permit {
                            Ok(permit) => permit,
                            Err(_) => return Ok(End::WriterGone), // never closed; be safe anyway
                        },
                    },
                };
                let ready = tokio::select! {
                    biased;
                    _ = replies.closed() => return Ok(End::WriterGone),
                    ready = wait_readable(reader, shutdown) => ready?,
                };
                match ready {
                    Readiness::Data => {}
                    Readiness::Eof => return Ok(End::ClientDone),
                    Readiness::Shutdown => return Ok(End::Shutdown),
                }
                // A request has started; only shutdown cuts it short (it is then dropped
                // unanswered).
                let header = tokio::select! {
                    biased;
                    _ = wait_shutdown(shutdown) => return Ok(End::Shutdown),
                    header = read_header(reader, log) => header?,
                };
                (permit, header)
            }
        };
        if header.command == Command::Disc {
            return Ok(End::ClientDone);
        }
        // The payload's bytes are reserved before the payload is read (or the read executed):
        // without budget, the connection stops reading here until some is released.
        let bytes = payload_bytes(&header, max_request);
        let charge = match ledger.try_take(bytes) {
            Some(charge) => charge,
            None => tokio::select! {
                biased;
                _ = replies.closed() => return Ok(End::WriterGone),
                _ = wait_shutdown(shutdown) => return Ok(End::Shutdown),
                charge = ledger.take(bytes) => charge,
            },
        };
        let payload = if header.command == Command::Write {
            tokio::select! {
                biased;
                _ = wait_shutdown(shutdown) => return Ok(End::Shutdown),
                payload = read_write_payload(reader, &header, max_request, log) => payload?,
            }
        } else {
            Bytes::new()
        };
        let slot = Slot {
            in_flight: permit,
            budget: charge,
        };
        dispatch(connection, header, payload, slot, log);
    }
}

/// Bytes the reader holds already received, without waiting (nor reading the socket if
/// none are buffered and it is not known readable). A read error is returned as the wait for
/// the next message would return it: it may not be there to be read again.
fn buffered_bytes<Rd: AsyncBufRead + Unpin>(reader: &mut Rd) -> std::io::Result<usize> {
    let mut context = std::task::Context::from_waker(std::task::Waker::noop());
    match std::pin::Pin::new(reader).poll_fill_buf(&mut context) {
        std::task::Poll::Ready(Ok(buffered)) => Ok(buffered.len()),
        std::task::Poll::Ready(Err(error)) => Err(error),
        std::task::Poll::Pending => Ok(0),
    }
}

/// Payload bytes a request holds in memory, to be reserved from the budget: a WRITE's data
/// and a READ's reply data. Requests larger than the maximum hold none (an oversized write's
/// payload is skipped, an oversized read is refused), nor do the other commands.
fn payload_bytes(header: &RequestHeader, max_request: u32) -> u32 {
    match header.command {
        Command::Write | Command::Read if header.length <= max_request => header.length,
        _ => 0,
    }
}

async fn read_header<Rd: AsyncBufRead + Unpin>(
    reader: &mut Rd,
    log: &mut ViolationLog,
) -> Result<RequestHeader, NbdError> {
    let mut raw = [0u8; REQUEST_HEADER_LEN];
    if let Err(error) = reader.read_exact(&mut raw).await {
        return Err(truncated(error, "a request header", log));
    }
    match proto::decode_request_header(&raw) {
        Ok(header) => Ok(header),
        Err(DecodeError::BadMagic(magic)) => {
            log.report(
                Violation::RequestMagic,
                &format_args!("request magic {magic:#x}"),
            );
            Err(NbdError::BadRequestMagic(magic as u32))
        }
        Err(DecodeError::Short) => Err(NbdError::Truncated("a request header")),
    }
}

/// Reads a write's payload, or skips it when it is too large to accept but small enough to
/// skip (validation then refuses the request); closes the connection for anything larger,
/// since reading it would let one request hold the connection for gigabytes.
async fn read_write_payload<Rd: PayloadSource>(
    reader: &mut Rd,
    header: &RequestHeader,
    max_request: u32,
    log: &mut ViolationLog,
) -> Result<Bytes, NbdError> {
    let length = header.length;
    let read = if length <= max_request {
        read_payload(reader, length as usize).await
    } else if length <= MAX_SKIPPED_PAYLOAD {
        skip_payload(reader, u64::from(length))
            .await
            .map(|()| Bytes::new())
    } else {
        log.report(
            Violation::PayloadTooLarge,
            &format_args!("write of {length} bytes"),
        );
        return Err(NbdError::PayloadTooLarge {
            length,
            limit: max_request,
        });
    };
    read.map_err(|error| truncated(error, "a write payload", log))
}

/// Reads exactly `length` bytes into a 4 KiB-aligned buffer of the node's pools, not
/// zero-filled first, so the disk can write from it without a copy (O_DIRECT); most of a
/// large payload goes there straight from the socket.
async fn read_payload<Rd: PayloadSource>(reader: &mut Rd, length: usize) -> std::io::Result<Bytes> {
    let mut buf = DiskBuf::for_overwrite(length);
    receive_payload(reader, buf.as_mut_slice()).await?;
    Ok(buf.into_bytes())
}

async fn skip_payload<Rd: AsyncBufRead + Unpin>(
    reader: &mut Rd,
    length: u64,
) -> std::io::Result<()> {
    let skipped = tokio::io::copy(&mut reader.take(length), &mut tokio::io::sink()).await?;
    if skipped < length {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    Ok(())
}

fn truncated(error: std::io::Error, what: &'static str, log: &mut ViolationLog) -> NbdError {
    let error = NbdError::reading(what)(error);
    if matches!(error, NbdError::Truncated(_)) {
        log.report(
            Violation::Truncated,
            &format_args!("client left in the middle of {what}"),
        );
    }
    error
}

/// Validates a request and starts its task; a refused request is answered without calling
/// the device.
fn dispatch<D: BlockDevice + 'static>(
    connection: &Rc<Connection<D>>,
    header: RequestHeader,
    payload: Bytes,
    slot: Slot,
    log: &mut ViolationLog,
) {
    let refused = validate(&header, &connection.params, connection.device.size_bytes()).err();
    let refused = refused.map(|rejection| {
        let (command, offset, length) = (header.command, header.offset, header.length);
        let message = &rejection.message;
        log.report(
            rejection.violation,
            &format_args!("{command:?} [{offset}, +{length}): {message}"),
        );
        Outcome::Failed {
            errno: rejection.errno,
            message: rejection.message,
        }
    });
    if refused.is_none() && header.command == Command::Read && header.length > 0 {
        if let Some(result) = connection.device.read_now(header.offset, header.length) {
            let outcome = crate::execute::read_outcome(result, header.offset, header.length);
            let reply = encode(connection, &header, outcome);
            // The in-flight permit normally guarantees room; should the queue be full anyway, the reply
            // waits for room rather than being lost. Closed means the writer is gone.
            if let Err(mpsc::error::TrySendError::Full(outgoing)) =
                connection.replies.try_send(Outgoing { reply, slot })
            {
                let replies = connection.replies.clone();
                tokio::task::spawn_local(async move {
                    let _ = replies.send(outgoing).await;
                });
            }
            return;
        }
    }
    let connection = connection.clone();
    tokio::task::spawn_local(async move {
        let outcome = match refused {
            Some(outcome) => outcome,
            None => execute(&connection.device, &header, payload).await,
        };
        let reply = encode(&connection, &header, outcome);
        // Fails only when the writer is gone (client left); the slot is released either way.
        let _ = connection.replies.send(Outgoing { reply, slot }).await;
    });
}

fn encode<D>(connection: &Connection<D>, header: &RequestHeader, outcome: Outcome) -> Encoded {
    reply::encode(
        header,
        outcome,
        connection.params.structured,
        connection.context_id,
    )
}

/// Waits for the writer as the way the reader stopped calls for.
async fn finish(
    mut writer: JoinHandle<std::io::Result<()>>,
    ended: Result<End, NbdError>,
) -> Result<(), NbdError> {
    let joined = match ended {
        // Protocol violation or broken stream: hard disconnect, pending replies are dropped.
        Err(error) => {
            writer.abort();
            return Err(error);
        }
        Ok(End::Shutdown) => match tokio::time::timeout(SHUTDOWN_GRACE, &mut writer).await {
            Ok(joined) => joined,
            Err(_) => {
                writer.abort();
                return Ok(());
            }
        },
        Ok(End::ClientDone | End::WriterGone) => writer.await,
    };
    match joined {
        Ok(Ok(())) => Ok(()),
        Ok(Err(error)) if peer_gone(&error) => Ok(()),
        Ok(Err(error)) => Err(NbdError::Io(error)),
        Err(join_error) => Err(NbdError::Io(std::io::Error::other(join_error))),
    }
}

/// Write errors that only mean the client has already left.
fn peer_gone(error: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        error.kind(),
        BrokenPipe | ConnectionReset | ConnectionAborted | NotConnected
    )
}

//! The transmission phase: requests are read continuously and served concurrently (up to the
//! in-flight limit); replies may complete out of order and are written by one writer task, so
//! two replies never interleave.

use crate::negotiate::Negotiated;
use crate::wire::*;
use crate::{NbdError, NbdLimits};
use ashlar_core::{BlockDevice, BlockStatusRun, IoError};
use bytes::{Bytes, BytesMut};
use std::net::SocketAddr;
use std::rc::Rc;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, watch, Semaphore};

/// Bytes of replies gathered into one socket write when several are ready at once.
const REPLY_BATCH_BYTES: usize = 256 * 1024;

struct Connection<D> {
    device: D,
    structured_replies: bool,
    base_allocation: bool,
    replies: mpsc::Sender<Vec<u8>>,
}

fn error_code(command: u16, error: &IoError) -> u32 {
    match error {
        IoError::Io(_) => EIO,
        IoError::OutOfRange { .. } if matches!(command, CMD_WRITE | CMD_WRITE_ZEROES) => ENOSPC,
        IoError::OutOfRange { .. } | IoError::Invalid(_) => EINVAL,
        IoError::NoSpace => ENOSPC,
        IoError::ShuttingDown => ESHUTDOWN,
    }
}

pub async fn transmit<D: BlockDevice + Clone + 'static>(
    stream: TcpStream,
    negotiated: Negotiated<D>,
    limits: NbdLimits,
    mut shutdown: watch::Receiver<bool>,
    peer: SocketAddr,
) -> Result<(), NbdError> {
    let (read_half, write_half) = stream.into_split();
    let mut reader = BufReader::with_capacity(128 * 1024, read_half);
    let in_flight_limit = limits.max_in_flight_requests.max(1);
    let (reply_tx, reply_rx) = mpsc::channel(in_flight_limit);
    let writer = tokio::task::spawn_local(write_replies(write_half, reply_rx));
    let connection = Rc::new(Connection {
        device: negotiated.device,
        structured_replies: negotiated.structured_replies,
        base_allocation: negotiated.base_allocation,
        replies: reply_tx,
    });
    let permits = std::sync::Arc::new(Semaphore::new(in_flight_limit));
    let outcome = loop {
        let permit = tokio::select! {
            permit = permits.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => break Ok(()),
            },
            _ = shutdown.wait_for(|stop| *stop) => break Ok(()),
        };
        let mut header = [0u8; REQUEST_HEADER_BYTES];
        let read = tokio::select! {
            read = reader.read_exact(&mut header) => read,
            _ = shutdown.wait_for(|stop| *stop) => break Ok(()),
        };
        match read {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => break Ok(()),
            Err(e) => break Err(NbdError::Io(e)),
        }
        let Some(request) = parse_request(&header) else {
            tracing::warn!(%peer, "bad request magic; closing the connection");
            break Err(NbdError::Protocol("bad request magic".into()));
        };
        if request.kind == CMD_DISC {
            break Ok(());
        }
        let payload = if request.kind == CMD_WRITE {
            if request.length > limits.max_request_bytes {
                tracing::warn!(%peer, length = request.length, max = limits.max_request_bytes,
                    "write payload larger than the advertised maximum; closing the connection");
                break Err(NbdError::Protocol(format!(
                    "write of {} bytes exceeds the maximum",
                    request.length
                )));
            }
            let mut data = BytesMut::zeroed(request.length as usize);
            if let Err(e) = reader.read_exact(&mut data).await {
                break if e.kind() == std::io::ErrorKind::UnexpectedEof {
                    Ok(())
                } else {
                    Err(NbdError::Io(e))
                };
            }
            Some(data.freeze())
        } else {
            None
        };
        let connection = connection.clone();
        tokio::task::spawn_local(async move {
            let reply = serve(&connection, request, payload).await;
            let _ = connection.replies.send(reply).await;
            drop(permit);
        });
    };
    // Let in-flight requests finish and their replies go out before closing.
    let _ = permits.acquire_many(in_flight_limit as u32).await;
    drop(connection);
    let _ = writer.await;
    outcome
}

async fn serve<D: BlockDevice>(
    connection: &Connection<D>,
    request: Request,
    payload: Option<Bytes>,
) -> Vec<u8> {
    let device = &connection.device;
    let cookie = request.cookie;
    let simple = |result: Result<(), IoError>| -> Vec<u8> {
        match result {
            Ok(()) => simple_reply(0, cookie).to_vec(),
            Err(error) => {
                log_failure(&request, &error);
                simple_reply(error_code(request.kind, &error), cookie).to_vec()
            }
        }
    };
    match request.kind {
        CMD_READ => read_reply(
            connection,
            request,
            device.read(request.offset, request.length).await,
        ),
        CMD_WRITE => {
            let data = payload.unwrap_or_default();
            simple(
                device
                    .write(request.offset, data, request.flags & CMD_FLAG_FUA != 0)
                    .await,
            )
        }
        CMD_FLUSH => simple(device.flush().await),
        CMD_TRIM => simple(device.trim(request.offset, request.length).await),
        CMD_WRITE_ZEROES => {
            let may_punch_hole = request.flags & CMD_FLAG_NO_HOLE == 0;
            simple(
                device
                    .write_zeroes(request.offset, request.length, may_punch_hole)
                    .await,
            )
        }
        CMD_BLOCK_STATUS if connection.structured_replies && connection.base_allocation => {
            let result = device.block_status(request.offset, request.length).await;
            block_status_reply(request, result)
        }
        CMD_BLOCK_STATUS => error_reply(
            connection,
            request,
            EINVAL,
            "base:allocation was not negotiated",
        ),
        other => {
            tracing::warn!(command = other, "unknown NBD command");
            error_reply(connection, request, EINVAL, "unknown command")
        }
    }
}

fn log_failure(request: &Request, error: &IoError) {
    match error {
        IoError::OutOfRange { .. } | IoError::Invalid(_) => {
            tracing::debug!(command = request.kind, offset = request.offset, length = request.length, %error, "request refused")
        }
        _ => {
            tracing::warn!(command = request.kind, offset = request.offset, length = request.length, %error, "request failed")
        }
    }
}

fn error_reply<D>(
    connection: &Connection<D>,
    request: Request,
    code: u32,
    message: &str,
) -> Vec<u8> {
    if connection.structured_replies && matches!(request.kind, CMD_READ | CMD_BLOCK_STATUS) {
        error_chunk(code, request.cookie, message)
    } else {
        simple_reply(code, request.cookie).to_vec()
    }
}

fn read_reply<D>(
    connection: &Connection<D>,
    request: Request,
    result: Result<Bytes, IoError>,
) -> Vec<u8> {
    match result {
        Ok(data) if connection.structured_replies => {
            let mut out = Vec::with_capacity(28 + data.len());
            out.extend_from_slice(&chunk_header(
                REPLY_FLAG_DONE,
                REPLY_TYPE_OFFSET_DATA,
                request.cookie,
                8 + data.len() as u32,
            ));
            out.extend_from_slice(&request.offset.to_be_bytes());
            out.extend_from_slice(&data);
            out
        }
        Ok(data) => {
            let mut out = Vec::with_capacity(16 + data.len());
            out.extend_from_slice(&simple_reply(0, request.cookie));
            out.extend_from_slice(&data);
            out
        }
        Err(error) => {
            log_failure(&request, &error);
            error_reply(
                connection,
                request,
                error_code(request.kind, &error),
                &error.to_string(),
            )
        }
    }
}

fn block_status_reply(request: Request, result: Result<Vec<BlockStatusRun>, IoError>) -> Vec<u8> {
    let runs = match result {
        Ok(runs) if !runs.is_empty() => runs,
        Ok(_) => return error_chunk(EINVAL, request.cookie, "empty block status range"),
        Err(error) => {
            return error_chunk(
                error_code(request.kind, &error),
                request.cookie,
                &error.to_string(),
            )
        }
    };
    let mut descriptors = Vec::new();
    let mut covered = 0u64;
    for run in runs {
        let length = run.length.min(request.length as u64 - covered);
        if length == 0 {
            break;
        }
        let flags = if run.hole { STATE_HOLE } else { 0 } | if run.zero { STATE_ZERO } else { 0 };
        descriptors.extend_from_slice(&(length as u32).to_be_bytes());
        descriptors.extend_from_slice(&flags.to_be_bytes());
        covered += length;
        if request.flags & CMD_FLAG_REQ_ONE != 0 {
            break;
        }
    }
    let mut out = chunk_header(
        REPLY_FLAG_DONE,
        REPLY_TYPE_BLOCK_STATUS,
        request.cookie,
        4 + descriptors.len() as u32,
    )
    .to_vec();
    out.extend_from_slice(&BASE_ALLOCATION_ID.to_be_bytes());
    out.extend_from_slice(&descriptors);
    out
}

async fn write_replies(mut socket: OwnedWriteHalf, mut replies: mpsc::Receiver<Vec<u8>>) {
    let mut batch = Vec::with_capacity(REPLY_BATCH_BYTES);
    while let Some(reply) = replies.recv().await {
        batch.extend_from_slice(&reply);
        while batch.len() < REPLY_BATCH_BYTES {
            match replies.try_recv() {
                Ok(more) => batch.extend_from_slice(&more),
                Err(_) => break,
            }
        }
        if socket.write_all(&batch).await.is_err() {
            // The client went away; keep draining so request tasks never block on us.
            while replies.recv().await.is_some() {}
            return;
        }
        batch.clear();
    }
    let _ = socket.shutdown().await;
}

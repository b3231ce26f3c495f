//! The handshake and option haggling (fixed newstyle only).

use crate::wire::*;
use crate::{ExportRegistry, NbdError, NbdLimits};
use ashlar_core::BlockDevice;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Largest option payload we read; export names and queries are far smaller.
const MAX_OPTION_BYTES: u32 = 64 * 1024;
/// Options one client may send before it must pick an export.
const MAX_OPTIONS: usize = 256;

/// What the client chose, ready for the transmission phase.
pub struct Negotiated<D> {
    pub device: D,
    pub structured_replies: bool,
    pub base_allocation: bool,
}

struct State {
    no_zeroes: bool,
    structured_replies: bool,
    base_allocation: bool,
}

pub fn transmission_flags() -> u16 {
    TRANSMIT_HAS_FLAGS
        | TRANSMIT_SEND_FLUSH
        | TRANSMIT_SEND_FUA
        | TRANSMIT_SEND_TRIM
        | TRANSMIT_SEND_WRITE_ZEROES
        | TRANSMIT_CAN_MULTI_CONN
}

/// Runs the handshake. `Ok(None)`: the client ended it (abort or disconnect) cleanly.
pub async fn negotiate<R: ExportRegistry>(
    stream: &mut TcpStream,
    registry: &R,
    limits: &NbdLimits,
) -> Result<Option<Negotiated<R::Device>>, NbdError> {
    let mut greeting = Vec::with_capacity(18);
    greeting.extend_from_slice(&NBDMAGIC.to_be_bytes());
    greeting.extend_from_slice(&IHAVEOPT.to_be_bytes());
    greeting.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    stream.write_all(&greeting).await?;
    let client_flags = stream.read_u32().await?;
    if client_flags & CLIENT_FIXED_NEWSTYLE == 0 {
        return Err(NbdError::Protocol(
            "client does not support fixed newstyle negotiation".into(),
        ));
    }
    if client_flags & !(CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES) != 0 {
        return Err(NbdError::Protocol(format!(
            "unknown client flags {client_flags:#x}"
        )));
    }
    let mut state = State {
        no_zeroes: client_flags & CLIENT_NO_ZEROES != 0,
        structured_replies: false,
        base_allocation: false,
    };
    for _ in 0..MAX_OPTIONS {
        let magic = stream.read_u64().await?;
        if magic != IHAVEOPT {
            return Err(NbdError::Protocol(format!("bad option magic {magic:#x}")));
        }
        let option = stream.read_u32().await?;
        let length = stream.read_u32().await?;
        if length > MAX_OPTION_BYTES {
            return Err(NbdError::Protocol(format!(
                "option {option} has an oversized payload of {length} bytes"
            )));
        }
        let mut data = vec![0u8; length as usize];
        stream.read_exact(&mut data).await?;
        match handle_option(stream, registry, limits, &mut state, option, &data).await? {
            Step::Continue => {}
            Step::Abort => return Ok(None),
            Step::Transmit(device) => {
                return Ok(Some(Negotiated {
                    device,
                    structured_replies: state.structured_replies,
                    base_allocation: state.base_allocation,
                }))
            }
        }
    }
    Err(NbdError::Protocol(format!(
        "more than {MAX_OPTIONS} options without choosing an export"
    )))
}

enum Step<D> {
    Continue,
    Abort,
    Transmit(D),
}

async fn reply(
    stream: &mut TcpStream,
    option: u32,
    kind: u32,
    data: &[u8],
) -> Result<(), NbdError> {
    stream.write_all(&option_reply(option, kind, data)).await?;
    Ok(())
}

async fn handle_option<R: ExportRegistry>(
    stream: &mut TcpStream,
    registry: &R,
    limits: &NbdLimits,
    state: &mut State,
    option: u32,
    data: &[u8],
) -> Result<Step<R::Device>, NbdError> {
    match option {
        OPT_EXPORT_NAME => {
            let name = String::from_utf8_lossy(data).into_owned();
            let device = registry.open_export(&name).map_err(|reason| {
                NbdError::Protocol(format!("unknown export '{name}': {reason}"))
            })?;
            let mut out = Vec::with_capacity(134);
            out.extend_from_slice(&device.size_bytes().to_be_bytes());
            out.extend_from_slice(&transmission_flags().to_be_bytes());
            if !state.no_zeroes {
                out.extend_from_slice(&[0u8; 124]);
            }
            stream.write_all(&out).await?;
            Ok(Step::Transmit(device))
        }
        OPT_ABORT => {
            let _ = reply(stream, option, REP_ACK, &[]).await;
            Ok(Step::Abort)
        }
        OPT_LIST => {
            if !data.is_empty() {
                reply(
                    stream,
                    option,
                    REP_ERR_INVALID,
                    b"NBD_OPT_LIST takes no data",
                )
                .await?;
                return Ok(Step::Continue);
            }
            for export in registry.list_exports() {
                let mut entry = Vec::new();
                entry.extend_from_slice(&(export.name.len() as u32).to_be_bytes());
                entry.extend_from_slice(export.name.as_bytes());
                entry.extend_from_slice(export.description.as_bytes());
                reply(stream, option, REP_SERVER, &entry).await?;
            }
            reply(stream, option, REP_ACK, &[]).await?;
            Ok(Step::Continue)
        }
        OPT_INFO | OPT_GO => info_or_go(stream, registry, limits, option, data).await,
        OPT_STRUCTURED_REPLY => {
            if !data.is_empty() {
                reply(
                    stream,
                    option,
                    REP_ERR_INVALID,
                    b"NBD_OPT_STRUCTURED_REPLY takes no data",
                )
                .await?;
            } else {
                state.structured_replies = true;
                reply(stream, option, REP_ACK, &[]).await?;
            }
            Ok(Step::Continue)
        }
        OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => {
            meta_context(stream, registry, state, option, data).await?;
            Ok(Step::Continue)
        }
        _ => {
            reply(stream, option, REP_ERR_UNSUP, b"option not supported").await?;
            Ok(Step::Continue)
        }
    }
}

/// Reads `u32 length + bytes` at `*at`, advancing it.
fn take_string(data: &[u8], at: &mut usize) -> Option<String> {
    let length = u32::from_be_bytes(data.get(*at..*at + 4)?.try_into().ok()?) as usize;
    *at += 4;
    let bytes = data.get(*at..at.checked_add(length)?)?;
    *at += length;
    Some(String::from_utf8_lossy(bytes).into_owned())
}

async fn info_or_go<R: ExportRegistry>(
    stream: &mut TcpStream,
    registry: &R,
    limits: &NbdLimits,
    option: u32,
    data: &[u8],
) -> Result<Step<R::Device>, NbdError> {
    let mut at = 0;
    let parsed = take_string(data, &mut at).and_then(|name| {
        let count = u16::from_be_bytes(data.get(at..at + 2)?.try_into().ok()?) as usize;
        let requests = data.get(at + 2..at + 2 + 2 * count)?;
        (at + 2 + 2 * count == data.len()).then_some((name, requests.to_vec()))
    });
    let Some((name, requests)) = parsed else {
        reply(
            stream,
            option,
            REP_ERR_INVALID,
            b"malformed NBD_OPT_INFO/GO payload",
        )
        .await?;
        return Ok(Step::Continue);
    };
    let device = match registry.open_export(&name) {
        Ok(device) => device,
        Err(reason) => {
            tracing::info!(export = %name, %reason, "client asked for an unknown export");
            reply(stream, option, REP_ERR_UNKNOWN, reason.as_bytes()).await?;
            return Ok(Step::Continue);
        }
    };
    let mut export = INFO_EXPORT.to_be_bytes().to_vec();
    export.extend_from_slice(&device.size_bytes().to_be_bytes());
    export.extend_from_slice(&transmission_flags().to_be_bytes());
    reply(stream, option, REP_INFO, &export).await?;
    let mut block_size = INFO_BLOCK_SIZE.to_be_bytes().to_vec();
    for value in [
        limits.min_block_size,
        limits.preferred_block_size,
        limits.max_request_bytes,
    ] {
        block_size.extend_from_slice(&value.to_be_bytes());
    }
    reply(stream, option, REP_INFO, &block_size).await?;
    for pair in requests.chunks(2) {
        match u16::from_be_bytes([pair[0], pair[1]]) {
            INFO_NAME => {
                let mut info = INFO_NAME.to_be_bytes().to_vec();
                info.extend_from_slice(name.as_bytes());
                reply(stream, option, REP_INFO, &info).await?;
            }
            INFO_DESCRIPTION => {
                let description = registry
                    .list_exports()
                    .into_iter()
                    .find(|e| e.name == name)
                    .map(|e| e.description)
                    .unwrap_or_default();
                let mut info = INFO_DESCRIPTION.to_be_bytes().to_vec();
                info.extend_from_slice(&description.as_bytes()[..description.len().min(4096)]);
                reply(stream, option, REP_INFO, &info).await?;
            }
            _ => {}
        }
    }
    reply(stream, option, REP_ACK, &[]).await?;
    Ok(if option == OPT_GO {
        Step::Transmit(device)
    } else {
        Step::Continue
    })
}

async fn meta_context<R: ExportRegistry>(
    stream: &mut TcpStream,
    registry: &R,
    state: &mut State,
    option: u32,
    data: &[u8],
) -> Result<(), NbdError> {
    let mut at = 0;
    let parsed = take_string(data, &mut at).and_then(|name| {
        let count = u32::from_be_bytes(data.get(at..at + 4)?.try_into().ok()?);
        at += 4;
        let mut queries = Vec::new();
        for _ in 0..count {
            queries.push(take_string(data, &mut at)?);
        }
        (at == data.len()).then_some((name, queries))
    });
    let Some((name, queries)) = parsed else {
        return reply(
            stream,
            option,
            REP_ERR_INVALID,
            b"malformed meta context payload",
        )
        .await;
    };
    if option == OPT_SET_META_CONTEXT && !state.structured_replies {
        return reply(
            stream,
            option,
            REP_ERR_INVALID,
            b"negotiate structured replies first",
        )
        .await;
    }
    if registry.open_export(&name).is_err() {
        return reply(stream, option, REP_ERR_UNKNOWN, b"unknown export").await;
    }
    let wants_allocation = if option == OPT_LIST_META_CONTEXT && queries.is_empty() {
        true
    } else {
        queries
            .iter()
            .any(|q| q == BASE_ALLOCATION || (option == OPT_LIST_META_CONTEXT && q == "base:"))
    };
    if option == OPT_SET_META_CONTEXT {
        state.base_allocation = wants_allocation;
    }
    if wants_allocation {
        let mut context = BASE_ALLOCATION_ID.to_be_bytes().to_vec();
        context.extend_from_slice(BASE_ALLOCATION.as_bytes());
        reply(stream, option, REP_META_CONTEXT, &context).await?;
    }
    reply(stream, option, REP_ACK, &[]).await
}

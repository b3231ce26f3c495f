//! The fixed newstyle handshake, up to the start of transmission. Option logic lives in
//! `negotiate`; this file only moves bytes.

use crate::limits::Effective;
use crate::negotiate::{self, Negotiation, Session, Step};
use crate::proto::{self, DecodeError, OPTION_HEADER_LEN, REP_ERR_TOO_BIG};
use crate::signal::{wait_readable, Readiness};
use crate::violation::{Violation, ViolationLog};
use crate::{ExportRegistry, NbdError};
use tokio::io::{AsyncBufRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::watch;

/// Largest option payload read into memory. Real options are tiny (an export name and a few
/// queries, each string at most 4 KiB); anything bigger is treated as an attack.
pub(crate) const MAX_OPTION_BYTES: u32 = 64 * 1024;

/// Options answered per handshake. Real clients send a handful; the cap stops a client from
/// spending the whole handshake timeout making the server list exports.
pub(crate) const MAX_OPTIONS: usize = 256;

/// How the handshake ended.
pub(crate) enum HandshakeEnd<D> {
    Transmission(Session<D>),
    /// The client aborted or left between options, or the server is shutting down.
    Closed,
}

/// Runs the handshake on `stream` until the client selects an export, leaves, or breaks
/// the protocol. The caller bounds it in time.
pub(crate) async fn handshake<S, R>(
    stream: &mut S,
    registry: &R,
    limits: &Effective,
    shutdown: &mut watch::Receiver<bool>,
    log: &mut ViolationLog,
) -> Result<HandshakeEnd<R::Device>, NbdError>
where
    S: AsyncBufRead + AsyncWrite + Unpin,
    R: ExportRegistry,
{
    stream.write_all(&proto::encode_greeting()).await?;
    stream.flush().await?;
    // Like between options, a client that leaves (or a shutdown) before the flags is no error.
    match wait_readable(stream, shutdown).await? {
        Readiness::Data => {}
        Readiness::Eof | Readiness::Shutdown => return Ok(HandshakeEnd::Closed),
    }
    let mut flags = [0u8; 4];
    stream
        .read_exact(&mut flags)
        .await
        .map_err(NbdError::reading("client flags"))?;
    let no_zeroes = negotiate::accept_client_flags(u32::from_be_bytes(flags), log)?;
    let mut state = Negotiation::new(no_zeroes);
    for _ in 0..MAX_OPTIONS {
        // Between options the client may simply leave; that is not an error.
        match wait_readable(stream, shutdown).await? {
            Readiness::Data => {}
            Readiness::Eof | Readiness::Shutdown => return Ok(HandshakeEnd::Closed),
        }
        let (option, data) = read_option(stream, log).await?;
        let mut out = Vec::new();
        let step = if *shutdown.borrow() {
            negotiate::answer_during_shutdown(option, &mut out)
        } else {
            negotiate::answer(option, &data, &mut state, registry, limits, &mut out, log).await
        };
        if !out.is_empty() {
            stream.write_all(&out).await?;
            stream.flush().await?;
        }
        match step {
            Step::Continue => {}
            Step::Close => return Ok(HandshakeEnd::Closed),
            Step::Enter(session) => return Ok(HandshakeEnd::Transmission(session)),
            Step::Fail(error) => return Err(error),
        }
    }
    log.report(
        Violation::TooManyOptions,
        &format_args!("more than {MAX_OPTIONS} options"),
    );
    Err(NbdError::TooManyOptions(MAX_OPTIONS))
}

/// Reads one option header and its (bounded) payload.
async fn read_option<S>(stream: &mut S, log: &mut ViolationLog) -> Result<(u32, Vec<u8>), NbdError>
where
    S: AsyncBufRead + AsyncWrite + Unpin,
{
    let mut raw = [0u8; OPTION_HEADER_LEN];
    stream
        .read_exact(&mut raw)
        .await
        .map_err(NbdError::reading("an option header"))?;
    let header = match proto::decode_option_header(&raw) {
        Ok(header) => header,
        Err(DecodeError::BadMagic(magic)) => {
            log.report(
                Violation::OptionMagic,
                &format_args!("option magic {magic:#x}"),
            );
            return Err(NbdError::BadOptionMagic(magic));
        }
        Err(DecodeError::Short) => return Err(NbdError::Truncated("an option header")),
    };
    if header.length > MAX_OPTION_BYTES {
        let (option, length) = (header.option, header.length);
        log.report(
            Violation::OptionTooLarge,
            &format_args!("option {option} with {length} bytes"),
        );
        // Best effort: tell the client why before hanging up.
        let mut out = Vec::new();
        proto::put_option_reply(
            &mut out,
            option,
            REP_ERR_TOO_BIG,
            b"option payload too large",
        );
        let _ = stream.write_all(&out).await;
        let _ = stream.flush().await;
        return Err(NbdError::OptionTooLarge {
            option,
            length,
            limit: MAX_OPTION_BYTES,
        });
    }
    let mut data = vec![0u8; header.length as usize];
    stream
        .read_exact(&mut data)
        .await
        .map_err(NbdError::reading("an option payload"))?;
    Ok((header.option, data))
}

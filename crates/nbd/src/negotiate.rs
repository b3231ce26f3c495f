//! Answers to handshake options. No I/O here: each handler appends its reply bytes to a
//! buffer and says what the handshake loop does next, which keeps the option logic testable
//! and lets the loop write every reply to one option with a single `write_all`.

use crate::limits::Effective;
use crate::options::{self, MetaMode};
use crate::proto::*;
use crate::violation::{Violation, ViolationLog};
use crate::{ExportRegistry, NbdError};
use ashlar_core::BlockDevice;

/// Context id this server gives `base:allocation` (ids are opaque to clients).
pub(crate) const ALLOCATION_CONTEXT_ID: u32 = 1;

/// What was agreed for the transmission phase.
pub(crate) struct Session<D> {
    pub device: D,
    pub export: String,
    pub structured: bool,
    /// Context id to use in block status replies, if `base:allocation` was selected for
    /// this export.
    pub allocation_context: Option<u32>,
}

/// What the handshake loop does after an option was answered.
pub(crate) enum Step<D> {
    Continue,
    /// The client aborted (or must be dropped without an error, e.g. during shutdown).
    Close,
    Enter(Session<D>),
    Fail(NbdError),
}

/// The last `NBD_OPT_SET_META_CONTEXT`: it only counts for the export it named.
struct MetaSelection {
    export: String,
    allocation: bool,
}

/// Handshake state carried between options.
pub(crate) struct Negotiation {
    structured: bool,
    no_zeroes: bool,
    meta: Option<MetaSelection>,
}

impl Negotiation {
    pub fn new(no_zeroes: bool) -> Self {
        Self {
            structured: false,
            no_zeroes,
            meta: None,
        }
    }

    fn allocation_context_for(&self, export: &str) -> Option<u32> {
        match &self.meta {
            Some(m) if m.allocation && m.export == export => Some(ALLOCATION_CONTEXT_ID),
            _ => None,
        }
    }
}

/// Checks the client flags word; returns whether the client asked for no zero padding.
pub(crate) fn accept_client_flags(flags: u32, log: &mut ViolationLog) -> Result<bool, NbdError> {
    let known = FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES;
    if flags & !known != 0 || flags & FLAG_C_FIXED_NEWSTYLE == 0 {
        log.report(
            Violation::ClientFlags,
            &format_args!("client flags {flags:#x}"),
        );
        return Err(NbdError::ClientFlags(flags));
    }
    Ok(flags & FLAG_C_NO_ZEROES != 0)
}

/// Answers one option while the server is shutting down: only a clean way out is offered.
pub(crate) fn answer_during_shutdown<D>(option: u32, out: &mut Vec<u8>) -> Step<D> {
    match option {
        OPT_ABORT => {
            put_option_reply(out, option, REP_ACK, &[]);
            Step::Close
        }
        // EXPORT_NAME cannot be answered with an error: drop the connection.
        OPT_EXPORT_NAME => Step::Close,
        _ => {
            put_option_reply(out, option, REP_ERR_SHUTDOWN, b"server is shutting down");
            Step::Continue
        }
    }
}

/// Answers one option.
pub(crate) async fn answer<R: ExportRegistry>(
    option: u32,
    data: &[u8],
    state: &mut Negotiation,
    registry: &R,
    limits: &Effective,
    out: &mut Vec<u8>,
    log: &mut ViolationLog,
) -> Step<R::Device> {
    match option {
        OPT_EXPORT_NAME => export_name(data, state, registry, out).await,
        OPT_ABORT => {
            put_option_reply(out, option, REP_ACK, &[]);
            Step::Close
        }
        OPT_LIST => list(data, registry, out, log),
        OPT_INFO | OPT_GO => info_or_go(option, data, state, registry, limits, out, log).await,
        OPT_STRUCTURED_REPLY => structured_reply(data, state, out, log),
        OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => {
            meta_context(option, data, state, registry, out, log).await
        }
        _ => {
            // Not a violation: clients probe for options (STARTTLS, extended headers, ...).
            tracing::debug!(peer = log.peer(), option, "unsupported NBD option");
            let message = format!("option {option} is not supported");
            put_option_reply(out, option, REP_ERR_UNSUP, message.as_bytes());
            Step::Continue
        }
    }
}

fn invalid<D>(
    option: u32,
    error: &dyn std::fmt::Display,
    out: &mut Vec<u8>,
    log: &mut ViolationLog,
) -> Step<D> {
    log.report(
        Violation::MalformedOption,
        &format_args!("option {option}: {error}"),
    );
    put_option_reply(out, option, REP_ERR_INVALID, error.to_string().as_bytes());
    Step::Continue
}

async fn export_name<R: ExportRegistry>(
    data: &[u8],
    state: &Negotiation,
    registry: &R,
    out: &mut Vec<u8>,
) -> Step<R::Device> {
    // This option cannot be answered with an error, so any failure ends the session.
    let name = match options::parse_export_name(data) {
        Ok(name) => name,
        Err(error) => {
            let name = String::from_utf8_lossy(data).into_owned();
            return Step::Fail(NbdError::UnknownExport {
                name,
                reason: error.to_string(),
            });
        }
    };
    let device = match registry.open_export(&name).await {
        Ok(device) => device,
        Err(reason) => return Step::Fail(NbdError::UnknownExport { name, reason }),
    };
    out.extend_from_slice(&encode_export_name_reply(
        device.size_bytes(),
        TRANSMISSION_FLAGS,
        state.no_zeroes,
    ));
    let allocation_context = state.allocation_context_for(&name);
    Step::Enter(Session {
        device,
        export: name,
        structured: state.structured,
        allocation_context,
    })
}

fn list<R: ExportRegistry>(
    data: &[u8],
    registry: &R,
    out: &mut Vec<u8>,
    log: &mut ViolationLog,
) -> Step<R::Device> {
    if let Err(error) = options::expect_empty(data) {
        return invalid(OPT_LIST, &error, out, log);
    }
    for export in registry.list_exports() {
        put_option_reply(
            out,
            OPT_LIST,
            REP_SERVER,
            &rep_server_payload(&export.name, &export.description),
        );
    }
    put_option_reply(out, OPT_LIST, REP_ACK, &[]);
    Step::Continue
}

fn structured_reply<D>(
    data: &[u8],
    state: &mut Negotiation,
    out: &mut Vec<u8>,
    log: &mut ViolationLog,
) -> Step<D> {
    if let Err(error) = options::expect_empty(data) {
        return invalid(OPT_STRUCTURED_REPLY, &error, out, log);
    }
    state.structured = true;
    put_option_reply(out, OPT_STRUCTURED_REPLY, REP_ACK, &[]);
    Step::Continue
}

async fn info_or_go<R: ExportRegistry>(
    option: u32,
    data: &[u8],
    state: &Negotiation,
    registry: &R,
    limits: &Effective,
    out: &mut Vec<u8>,
    log: &mut ViolationLog,
) -> Step<R::Device> {
    let request = match options::parse_go(data) {
        Ok(request) => request,
        Err(error) => return invalid(option, &error, out, log),
    };
    let device = match registry.open_export(&request.name).await {
        Ok(device) => device,
        Err(reason) => {
            put_option_reply(out, option, REP_ERR_UNKNOWN, clamp_str(&reason).as_bytes());
            return Step::Continue;
        }
    };
    put_option_reply(
        out,
        option,
        REP_INFO,
        &info_export(device.size_bytes(), TRANSMISSION_FLAGS),
    );
    if request.info_requests.contains(&INFO_NAME) {
        put_option_reply(
            out,
            option,
            REP_INFO,
            &info_string(INFO_NAME, &request.name),
        );
    }
    if request.info_requests.contains(&INFO_DESCRIPTION) {
        if let Some(export) = registry
            .list_exports()
            .into_iter()
            .find(|e| e.name == request.name)
        {
            put_option_reply(
                out,
                option,
                REP_INFO,
                &info_string(INFO_DESCRIPTION, &export.description),
            );
        }
    }
    // Sent even when not requested: the maximum may be below the protocol's default, and
    // clients ignore information they did not ask for.
    let sizes = info_block_size(limits.min_block, limits.preferred_block, limits.max_request);
    put_option_reply(out, option, REP_INFO, &sizes);
    put_option_reply(out, option, REP_ACK, &[]);
    if option != OPT_GO {
        return Step::Continue;
    }
    let allocation_context = state.allocation_context_for(&request.name);
    Step::Enter(Session {
        device,
        export: request.name,
        structured: state.structured,
        allocation_context,
    })
}

async fn meta_context<R: ExportRegistry>(
    option: u32,
    data: &[u8],
    state: &mut Negotiation,
    registry: &R,
    out: &mut Vec<u8>,
    log: &mut ViolationLog,
) -> Step<R::Device> {
    let mode = if option == OPT_SET_META_CONTEXT {
        MetaMode::Set
    } else {
        MetaMode::List
    };
    if mode == MetaMode::Set {
        // A SET replaces the previous selection even when it fails.
        state.meta = None;
    }
    if !state.structured {
        let error = "structured replies must be negotiated first";
        return invalid(option, &error, out, log);
    }
    let request = match options::parse_meta(data) {
        Ok(request) => request,
        Err(error) => return invalid(option, &error, out, log),
    };
    if let Err(reason) = registry.open_export(&request.export).await {
        put_option_reply(out, option, REP_ERR_UNKNOWN, clamp_str(&reason).as_bytes());
        return Step::Continue;
    }
    let allocation = options::selects_allocation(&request.queries, mode);
    if allocation {
        // Listing carries no usable id; the protocol asks for zero there.
        let id = if mode == MetaMode::Set {
            ALLOCATION_CONTEXT_ID
        } else {
            0
        };
        put_option_reply(
            out,
            option,
            REP_META_CONTEXT,
            &meta_context_payload(id, BASE_ALLOCATION),
        );
    }
    if mode == MetaMode::Set {
        state.meta = Some(MetaSelection {
            export: request.export,
            allocation,
        });
    }
    put_option_reply(out, option, REP_ACK, &[]);
    Step::Continue
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log() -> ViolationLog {
        ViolationLog::new("test".into())
    }

    #[test]
    fn client_flags_must_be_fixed_newstyle_and_known() {
        assert_eq!(accept_client_flags(1, &mut log()).ok(), Some(false));
        assert_eq!(accept_client_flags(3, &mut log()).ok(), Some(true));
        for bad in [0, 2, 4 | 1, 1 << 31] {
            assert!(
                matches!(accept_client_flags(bad, &mut log()), Err(NbdError::ClientFlags(f)) if f == bad)
            );
        }
    }

    #[test]
    fn shutdown_offers_only_a_way_out() {
        let mut out = Vec::new();
        assert!(matches!(
            answer_during_shutdown::<()>(OPT_GO, &mut out),
            Step::Continue
        ));
        assert_eq!(&out[12..16], &REP_ERR_SHUTDOWN.to_be_bytes());
        out.clear();
        assert!(matches!(
            answer_during_shutdown::<()>(OPT_ABORT, &mut out),
            Step::Close
        ));
        assert_eq!(&out[12..16], &REP_ACK.to_be_bytes());
        out.clear();
        assert!(matches!(
            answer_during_shutdown::<()>(OPT_EXPORT_NAME, &mut out),
            Step::Close
        ));
        assert!(out.is_empty());
    }
}

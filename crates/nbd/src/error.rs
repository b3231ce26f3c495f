//! Why a connection ended other than by the client's or the server's orderly choice.

use std::time::Duration;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum NbdError {
    #[error("socket error: {0}")]
    Io(#[from] std::io::Error),
    #[error("client disconnected in the middle of {0}")]
    Truncated(&'static str),
    #[error("handshake not completed within {0:?}")]
    HandshakeTimeout(Duration),
    #[error("client flags {0:#x} rejected (fixed newstyle required, no unknown flags)")]
    ClientFlags(u32),
    #[error("bad option magic {0:#018x}")]
    BadOptionMagic(u64),
    #[error("option {option} carries {length} bytes, more than the {limit}-byte limit")]
    OptionTooLarge {
        option: u32,
        length: u32,
        limit: u32,
    },
    #[error("more than {0} options in one handshake")]
    TooManyOptions(usize),
    #[error("export {name:?} is not available: {reason}")]
    UnknownExport { name: String, reason: String },
    #[error("bad request magic {0:#010x}")]
    BadRequestMagic(u32),
    #[error("write payload of {length} bytes is larger than the {limit}-byte limit")]
    PayloadTooLarge { length: u32, limit: u32 },
}

impl NbdError {
    /// Maps a failed read of `what`: end of stream means the client went away mid-message.
    pub(crate) fn reading(what: &'static str) -> impl FnOnce(std::io::Error) -> NbdError {
        move |error| {
            if error.kind() == std::io::ErrorKind::UnexpectedEof {
                NbdError::Truncated(what)
            } else {
                NbdError::Io(error)
            }
        }
    }
}

//! Encoding a request's outcome as a simple reply or a structured reply. Pure functions.

use crate::execute::Outcome;
use crate::proto::{self, Command, ReplyHead, RequestHeader, EINVAL, EOVERFLOW};
use bytes::Bytes;

/// One complete reply: `head` then `data` go out back to back, never interleaved with
/// another reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Encoded {
    pub head: ReplyHead,
    pub data: Bytes,
}

impl Encoded {
    fn head(head: ReplyHead) -> Self {
        Self {
            head,
            data: Bytes::new(),
        }
    }
}

/// Encodes `outcome` for the request `header`. `context_id` is the id negotiated for
/// `base:allocation` (only used with extents).
pub(crate) fn encode(
    header: &RequestHeader,
    outcome: Outcome,
    structured: bool,
    context_id: u32,
) -> Encoded {
    if structured {
        encode_structured(header, outcome, context_id)
    } else {
        encode_simple(header.cookie, outcome)
    }
}

fn encode_simple(cookie: u64, outcome: Outcome) -> Encoded {
    match outcome {
        Outcome::Done => Encoded::head(proto::encode_simple_reply(cookie, 0)),
        Outcome::Data(data) => Encoded {
            head: proto::encode_simple_reply(cookie, 0),
            data,
        },
        Outcome::Failed { errno, .. } => Encoded::head(proto::encode_simple_reply(cookie, errno)),
        // Validation refuses block status without structured replies; stay safe regardless.
        Outcome::Extents(_) => Encoded::head(proto::encode_simple_reply(cookie, EINVAL)),
    }
}

fn encode_structured(header: &RequestHeader, outcome: Outcome, context_id: u32) -> Encoded {
    let cookie = header.cookie;
    match outcome {
        // A simple reply is allowed for anything but READ when there is no payload.
        Outcome::Done if header.command != Command::Read => {
            Encoded::head(proto::encode_simple_reply(cookie, 0))
        }
        Outcome::Done => Encoded::head(proto::encode_none_chunk(cookie)),
        Outcome::Data(data) => encode_read_data(cookie, header.offset, data),
        Outcome::Extents(extents) => Encoded::head(proto::encode_block_status_chunk(
            cookie, context_id, &extents,
        )),
        Outcome::Failed { errno, message } => {
            Encoded::head(proto::encode_error_chunk(cookie, errno, &message))
        }
    }
}

/// Reads that returned only zeroes go out as a hole (12 bytes instead of the data).
fn encode_read_data(cookie: u64, offset: u64, data: Bytes) -> Encoded {
    if data.is_empty() {
        return Encoded::head(proto::encode_none_chunk(cookie));
    }
    if is_all_zero(&data) {
        if let Ok(len) = u32::try_from(data.len()) {
            return Encoded::head(proto::encode_offset_hole(cookie, offset, len));
        }
    }
    match proto::encode_offset_data_head(cookie, offset, data.len()) {
        Some(head) => Encoded { head, data },
        None => Encoded::head(proto::encode_error_chunk(
            cookie,
            EOVERFLOW,
            "read too large for one chunk",
        )),
    }
}

/// Checks 64 bytes at a time so the compiler can vectorise, stopping at the first non-zero
/// block (real data usually fails in the first one).
fn is_all_zero(data: &[u8]) -> bool {
    let chunks = data.chunks_exact(64);
    let tail = chunks.remainder();
    chunks
        .into_iter()
        .all(|c| c.iter().fold(0u8, |acc, b| acc | b) == 0)
        && tail.iter().all(|b| *b == 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::*;

    fn header(command: Command) -> RequestHeader {
        RequestHeader {
            flags: 0,
            command,
            cookie: 7,
            offset: 4096,
            length: 128,
        }
    }

    fn reply_type(e: &Encoded) -> u16 {
        u16::from_be_bytes([e.head[6], e.head[7]])
    }

    #[test]
    fn simple_replies() {
        let e = encode(
            &header(Command::Read),
            Outcome::Data(Bytes::from(vec![1; 128])),
            false,
            1,
        );
        assert_eq!(e.head, encode_simple_reply(7, 0));
        assert_eq!(e.data.len(), 128);
        let e = encode(
            &header(Command::Write),
            Outcome::Failed {
                errno: ENOSPC,
                message: "x".into(),
            },
            false,
            1,
        );
        assert_eq!(e.head, encode_simple_reply(7, ENOSPC));
        assert!(e.data.is_empty());
    }

    #[test]
    fn structured_read_data_hole_and_empty() {
        let mut data = vec![0u8; 128];
        data[100] = 1;
        let e = encode(
            &header(Command::Read),
            Outcome::Data(Bytes::from(data)),
            true,
            1,
        );
        assert_eq!(reply_type(&e), REPLY_TYPE_OFFSET_DATA);
        assert_eq!(e.data.len(), 128);
        let e = encode(
            &header(Command::Read),
            Outcome::Data(Bytes::from(vec![0u8; 128])),
            true,
            1,
        );
        assert_eq!(e.head, encode_offset_hole(7, 4096, 128));
        assert!(e.data.is_empty());
        let e = encode(&header(Command::Read), Outcome::Data(Bytes::new()), true, 1);
        assert_eq!(e.head, encode_none_chunk(7));
    }

    #[test]
    fn structured_errors_and_done() {
        let e = encode(
            &header(Command::Read),
            Outcome::Failed {
                errno: EIO,
                message: "disk".into(),
            },
            true,
            1,
        );
        assert_eq!(reply_type(&e), REPLY_TYPE_ERROR);
        let e = encode(&header(Command::Flush), Outcome::Done, true, 1);
        assert_eq!(e.head, encode_simple_reply(7, 0));
        let e = encode(&header(Command::Read), Outcome::Done, true, 1);
        assert_eq!(e.head, encode_none_chunk(7));
        let e = encode(
            &header(Command::BlockStatus),
            Outcome::Extents(vec![(128, 3)]),
            true,
            9,
        );
        assert_eq!(e.head, encode_block_status_chunk(7, 9, &[(128, 3)]));
    }

    #[test]
    fn zero_detection() {
        assert!(is_all_zero(&[0; 200]));
        let mut v = vec![0u8; 200];
        v[199] = 1;
        assert!(!is_all_zero(&v));
        v[199] = 0;
        v[3] = 1;
        assert!(!is_all_zero(&v));
    }
}

//! Frames: everything after the handshake. A frame is a 24-byte header and a payload.
//!
//! ```text
//! offset size field
//!      0    1 kind            1 request, 2 response, 3 error, 4 ping, 5 pong
//!      1    1 flags           none defined in version 1: must be 0
//!      2    2 reserved        must be 0
//!      4    4 payload_len     bytes of payload after the header, <= the connection's limit
//!      8    8 request_id      u64; non-zero for request, response, error
//!     16    4 payload_crc32c  CRC32C of the payload (0 for an empty payload)
//!     20    4 header_crc32c   CRC32C of bytes 0..20
//! ```
//! All integers little-endian.

use crate::error::{ProtocolError, RemoteError};
use crate::ids::RequestId;
use bytes::{Buf, BufMut, Bytes, BytesMut};

pub const FRAME_HEADER_BYTES: usize = 24;
/// The protocol's ceiling on one frame's payload; a node's configured limit is at most this.
pub const FRAME_PAYLOAD_BYTES_MAX: u32 = 64 << 20;
/// Bytes of an error frame's payload before its message: the code.
const ERROR_CODE_BYTES: usize = 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameKind {
    /// Client to server: run the handler on the payload.
    Request = 1,
    /// Server to client: the handler's answer to the request with the same id.
    Response = 2,
    /// Server to client: the handler failed; payload is a u32 code and a UTF-8 message.
    Error = 3,
    /// Client to server: are you there? Empty payload.
    Ping = 4,
    /// Server to client: the answer to the ping with the same id. Empty payload.
    Pong = 5,
}

impl FrameKind {
    fn from_u8(byte: u8) -> Result<FrameKind, ProtocolError> {
        Ok(match byte {
            1 => FrameKind::Request,
            2 => FrameKind::Response,
            3 => FrameKind::Error,
            4 => FrameKind::Ping,
            5 => FrameKind::Pong,
            other => return Err(ProtocolError::UnknownFrameKind(other)),
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            FrameKind::Request => "request",
            FrameKind::Response => "response",
            FrameKind::Error => "error",
            FrameKind::Ping => "ping",
            FrameKind::Pong => "pong",
        }
    }

    fn needs_request_id(self) -> bool {
        matches!(
            self,
            FrameKind::Request | FrameKind::Response | FrameKind::Error
        )
    }

    fn is_empty_only(self) -> bool {
        matches!(self, FrameKind::Ping | FrameKind::Pong)
    }
}

/// One decoded frame. For pings and pongs `request_id` is the ping's sequence number.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub kind: FrameKind,
    pub request_id: RequestId,
    pub payload: Bytes,
}

impl Frame {
    pub fn new(kind: FrameKind, request_id: RequestId, payload: Bytes) -> Frame {
        Frame {
            kind,
            request_id,
            payload,
        }
    }

    /// An error frame answering `request_id`.
    pub fn error(request_id: RequestId, error: &RemoteError) -> Frame {
        let mut payload = BytesMut::with_capacity(ERROR_CODE_BYTES + error.message.len());
        payload.put_u32_le(error.code);
        payload.put_slice(error.message.as_bytes());
        Frame::new(FrameKind::Error, request_id, payload.freeze())
    }

    /// The bytes this frame takes on the wire.
    pub fn wire_len(&self) -> usize {
        FRAME_HEADER_BYTES + self.payload.len()
    }
}

/// The code and message of an error frame's payload. A message that is not UTF-8 is kept
/// with replacement characters: it is for people, not for decisions.
pub fn decode_error_payload(payload: &[u8]) -> Result<RemoteError, ProtocolError> {
    if payload.len() < ERROR_CODE_BYTES {
        return Err(ProtocolError::ShortErrorPayload { len: payload.len() });
    }
    let (code, message) = payload.split_at(ERROR_CODE_BYTES);
    let code = u32::from_le_bytes(code.try_into().expect("split at 4"));
    Ok(RemoteError {
        code,
        message: String::from_utf8_lossy(message).into_owned(),
    })
}

/// Appends `frame` to `dst`. Panics if the payload exceeds the protocol's ceiling: callers
/// check the connection's (smaller) limit first, so a larger payload is a programmer error.
pub fn encode_frame(frame: &Frame, dst: &mut BytesMut) {
    let payload_len = u32::try_from(frame.payload.len())
        .ok()
        .filter(|&len| len <= FRAME_PAYLOAD_BYTES_MAX);
    let payload_len = payload_len.expect("frame payload exceeds FRAME_PAYLOAD_BYTES_MAX");
    assert!(
        !frame.kind.needs_request_id() || frame.request_id.0 != 0,
        "request id 0 on a {} frame",
        frame.kind.name()
    );
    assert!(
        !frame.kind.is_empty_only() || payload_len == 0,
        "payload on a {} frame",
        frame.kind.name()
    );
    let mut header = [0u8; FRAME_HEADER_BYTES];
    header[0] = frame.kind as u8;
    // Bytes 1..4 (flags, reserved) stay 0.
    header[4..8].copy_from_slice(&payload_len.to_le_bytes());
    header[8..16].copy_from_slice(&frame.request_id.0.to_le_bytes());
    header[16..20].copy_from_slice(&crc32c::crc32c(&frame.payload).to_le_bytes());
    let header_crc = crc32c::crc32c(&header[..20]);
    header[20..24].copy_from_slice(&header_crc.to_le_bytes());
    dst.reserve(frame.wire_len());
    dst.put_slice(&header);
    dst.put_slice(&frame.payload);
}

/// A checked frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FrameHeader {
    kind: FrameKind,
    payload_len: u32,
    request_id: RequestId,
    payload_crc: u32,
}

fn decode_header(
    header: &[u8; FRAME_HEADER_BYTES],
    max_payload_bytes: u32,
) -> Result<FrameHeader, ProtocolError> {
    let u32_at = |at: usize| u32::from_le_bytes(header[at..at + 4].try_into().expect("4 bytes"));
    // The header CRC first: a corrupted kind or length is reported as what it is.
    let stored = u32_at(20);
    let computed = crc32c::crc32c(&header[..20]);
    if stored != computed {
        return Err(ProtocolError::HeaderChecksum { stored, computed });
    }
    let kind = FrameKind::from_u8(header[0])?;
    if header[1] != 0 {
        return Err(ProtocolError::UnknownFlags(header[1]));
    }
    let reserved = u16::from_le_bytes([header[2], header[3]]);
    if reserved != 0 {
        return Err(ProtocolError::NonZeroReserved(u64::from(reserved)));
    }
    let payload_len = u32_at(4);
    if payload_len > max_payload_bytes {
        return Err(ProtocolError::FrameTooLarge {
            len: payload_len,
            max: max_payload_bytes,
        });
    }
    let request_id = RequestId(u64::from_le_bytes(
        header[8..16].try_into().expect("8 bytes"),
    ));
    if kind.needs_request_id() && request_id.0 == 0 {
        return Err(ProtocolError::ZeroRequestId { kind: kind.name() });
    }
    if kind.is_empty_only() && payload_len != 0 {
        return Err(ProtocolError::NonEmptyPayload {
            kind: kind.name(),
            len: payload_len,
        });
    }
    Ok(FrameHeader {
        kind,
        payload_len,
        request_id,
        payload_crc: u32_at(16),
    })
}

/// Takes the next whole frame off the front of `src`. `Ok(None)`: not all of it has arrived
/// (nothing is consumed). An error leaves `src` unspecified: the connection is closed.
/// Checks the header as soon as it is complete, so an oversized length is refused before
/// its payload is waited for.
pub fn decode_frame(
    src: &mut BytesMut,
    max_payload_bytes: u32,
) -> Result<Option<Frame>, ProtocolError> {
    let Some(header) = src.get(..FRAME_HEADER_BYTES) else {
        return Ok(None);
    };
    let header = decode_header(header.try_into().expect("header length"), max_payload_bytes)?;
    let payload_len = usize::try_from(header.payload_len).expect("u32 fits usize");
    if src.len() < FRAME_HEADER_BYTES + payload_len {
        return Ok(None);
    }
    src.advance(FRAME_HEADER_BYTES);
    let payload = src.split_to(payload_len).freeze();
    let computed = crc32c::crc32c(&payload);
    if computed != header.payload_crc {
        return Err(ProtocolError::PayloadChecksum {
            request_id: header.request_id,
            stored: header.payload_crc,
            computed,
        });
    }
    Ok(Some(Frame::new(header.kind, header.request_id, payload)))
}

/// Bytes `src` must hold before [`decode_frame`] can return the frame it starts with: lets a
/// reader size its next read. Assumes the header is valid; `decode_frame` checks it.
pub fn frame_bytes_needed(src: &[u8]) -> usize {
    match src.get(4..8) {
        Some(len) => {
            FRAME_HEADER_BYTES + u32::from_le_bytes(len.try_into().expect("4 bytes")) as usize
        }
        None => FRAME_HEADER_BYTES,
    }
}

#[cfg(test)]
#[path = "frame_tests.rs"]
mod tests;

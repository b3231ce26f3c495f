//! NBD wire constants and the big-endian encoding and decoding of fixed-layout messages, as
//! pure functions so they can be tested without sockets.
//!
//! Every multi-byte field on the wire is big-endian; the encoders spell this out with
//! `to_be_bytes` / `from_be_bytes` rather than relying on a buffer helper's default.

/// `NBDMAGIC`: first 8 bytes the server sends.
pub const NBD_MAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`: second greeting word, and the magic of every option the client sends.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

// Handshake flags (server) and client flags.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

// Transmission flags.
pub const FLAG_HAS_FLAGS: u16 = 1 << 0;
pub const FLAG_SEND_FLUSH: u16 = 1 << 2;
pub const FLAG_SEND_FUA: u16 = 1 << 3;
pub const FLAG_SEND_TRIM: u16 = 1 << 5;
pub const FLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const FLAG_CAN_MULTI_CONN: u16 = 1 << 8;

/// What this server advertises for every export. Multi-conn is safe because a
/// `BlockDevice` write is durable (and visible to every handle) when it resolves.
pub const TRANSMISSION_FLAGS: u16 = FLAG_HAS_FLAGS
    | FLAG_SEND_FLUSH
    | FLAG_SEND_FUA
    | FLAG_SEND_TRIM
    | FLAG_SEND_WRITE_ZEROES
    | FLAG_CAN_MULTI_CONN;

// Options.
pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;
pub const OPT_LIST_META_CONTEXT: u32 = 9;
pub const OPT_SET_META_CONTEXT: u32 = 10;

// Option reply types; errors have bit 31 set.
pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
pub const REP_META_CONTEXT: u32 = 4;
const REP_ERR: u32 = 1 << 31;
pub const REP_ERR_UNSUP: u32 = REP_ERR | 1;
pub const REP_ERR_INVALID: u32 = REP_ERR | 3;
pub const REP_ERR_UNKNOWN: u32 = REP_ERR | 6;
pub const REP_ERR_SHUTDOWN: u32 = REP_ERR | 7;
pub const REP_ERR_TOO_BIG: u32 = REP_ERR | 9;

// Information types of NBD_OPT_INFO / NBD_OPT_GO.
pub const INFO_EXPORT: u16 = 0;
pub const INFO_NAME: u16 = 1;
pub const INFO_DESCRIPTION: u16 = 2;
pub const INFO_BLOCK_SIZE: u16 = 3;

// Command flags.
pub const CMD_FLAG_FUA: u16 = 1 << 0;
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;

// Structured reply flags and chunk types.
pub const REPLY_FLAG_DONE: u16 = 1 << 0;
pub const REPLY_TYPE_NONE: u16 = 0;
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
pub const REPLY_TYPE_ERROR: u16 = (1 << 15) | 1;

// Error values of the transmission phase.
pub const EIO: u32 = 5;
pub const EINVAL: u32 = 22;
pub const ENOSPC: u32 = 28;
pub const EOVERFLOW: u32 = 75;
pub const ESHUTDOWN: u32 = 108;

// `base:allocation` status flags.
pub const STATE_HOLE: u32 = 1 << 0;
pub const STATE_ZERO: u32 = 1 << 1;

pub const BASE_ALLOCATION: &str = "base:allocation";

/// Longest string (export name, context name, message) the protocol allows.
pub const MAX_STRING_BYTES: usize = 4096;

pub const OPTION_HEADER_LEN: usize = 16;
pub const REQUEST_HEADER_LEN: usize = 28;
pub const SIMPLE_REPLY_LEN: usize = 16;
pub const CHUNK_HEADER_LEN: usize = 20;

/// A transmission-phase command, as far as this server knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    Read,
    Write,
    Disc,
    Flush,
    Trim,
    Cache,
    WriteZeroes,
    BlockStatus,
    Unknown(u16),
}

impl Command {
    pub fn from_wire(value: u16) -> Self {
        match value {
            0 => Self::Read,
            1 => Self::Write,
            2 => Self::Disc,
            3 => Self::Flush,
            4 => Self::Trim,
            5 => Self::Cache,
            6 => Self::WriteZeroes,
            7 => Self::BlockStatus,
            other => Self::Unknown(other),
        }
    }
}

/// A decoded request header (the payload of a write follows it on the wire).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHeader {
    pub flags: u16,
    pub command: Command,
    pub cookie: u64,
    pub offset: u64,
    pub length: u32,
}

/// A decoded option header (its payload of `length` bytes follows on the wire).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionHeader {
    pub option: u32,
    pub length: u32,
}

/// Why bytes could not be decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("message too short")]
    Short,
    #[error("bad magic {0:#x}")]
    BadMagic(u64),
}

/// Reads big-endian fields from a byte slice, failing instead of panicking when it runs out.
pub struct Cursor<'a> {
    rest: &'a [u8],
}

impl<'a> Cursor<'a> {
    pub fn new(bytes: &'a [u8]) -> Self {
        Self { rest: bytes }
    }

    pub fn remaining(&self) -> usize {
        self.rest.len()
    }

    pub fn bytes(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let (head, tail) = self.rest.split_at_checked(n).ok_or(DecodeError::Short)?;
        self.rest = tail;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.bytes(N)?);
        Ok(out)
    }

    pub fn u16(&mut self) -> Result<u16, DecodeError> {
        self.array().map(u16::from_be_bytes)
    }

    pub fn u32(&mut self) -> Result<u32, DecodeError> {
        self.array().map(u32::from_be_bytes)
    }

    pub fn u64(&mut self) -> Result<u64, DecodeError> {
        self.array().map(u64::from_be_bytes)
    }
}

/// The server's first message: magic, `IHAVEOPT`, handshake flags.
pub fn encode_greeting() -> Vec<u8> {
    let mut out = Vec::with_capacity(18);
    out.extend_from_slice(&NBD_MAGIC.to_be_bytes());
    out.extend_from_slice(&IHAVEOPT.to_be_bytes());
    out.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    out
}

pub fn decode_option_header(bytes: &[u8]) -> Result<OptionHeader, DecodeError> {
    let mut cur = Cursor::new(bytes);
    let magic = cur.u64()?;
    if magic != IHAVEOPT {
        return Err(DecodeError::BadMagic(magic));
    }
    Ok(OptionHeader {
        option: cur.u32()?,
        length: cur.u32()?,
    })
}

/// Appends one option reply (header plus `data`) to `out`.
pub fn put_option_reply(out: &mut Vec<u8>, option: u32, reply_type: u32, data: &[u8]) {
    out.extend_from_slice(&OPTION_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&reply_type.to_be_bytes());
    out.extend_from_slice(&wire_len(data.len()).to_be_bytes());
    out.extend_from_slice(data);
}

/// Payload of `NBD_REP_SERVER`: name length, name, then the description as free text.
pub fn rep_server_payload(name: &str, description: &str) -> Vec<u8> {
    let name = clamp_str(name);
    let description = clamp_str(description);
    let mut out = Vec::with_capacity(4 + name.len() + description.len());
    out.extend_from_slice(&wire_len(name.len()).to_be_bytes());
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(description.as_bytes());
    out
}

/// Payload of `NBD_REP_META_CONTEXT`: context id, then the name.
pub fn meta_context_payload(id: u32, name: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + name.len());
    out.extend_from_slice(&id.to_be_bytes());
    out.extend_from_slice(name.as_bytes());
    out
}

/// `NBD_REP_INFO` payload for `NBD_INFO_EXPORT`: size and transmission flags.
pub fn info_export(size: u64, flags: u16) -> Vec<u8> {
    let mut out = Vec::with_capacity(12);
    out.extend_from_slice(&INFO_EXPORT.to_be_bytes());
    out.extend_from_slice(&size.to_be_bytes());
    out.extend_from_slice(&flags.to_be_bytes());
    out
}

/// `NBD_REP_INFO` payload for a string item (`NBD_INFO_NAME`, `NBD_INFO_DESCRIPTION`).
pub fn info_string(info_type: u16, text: &str) -> Vec<u8> {
    let text = clamp_str(text);
    let mut out = Vec::with_capacity(2 + text.len());
    out.extend_from_slice(&info_type.to_be_bytes());
    out.extend_from_slice(text.as_bytes());
    out
}

/// `NBD_REP_INFO` payload for `NBD_INFO_BLOCK_SIZE`.
pub fn info_block_size(minimum: u32, preferred: u32, maximum: u32) -> Vec<u8> {
    let mut out = Vec::with_capacity(14);
    out.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    out.extend_from_slice(&minimum.to_be_bytes());
    out.extend_from_slice(&preferred.to_be_bytes());
    out.extend_from_slice(&maximum.to_be_bytes());
    out
}

/// Reply to `NBD_OPT_EXPORT_NAME`: size, flags and (unless the client opted out) 124 zeroes.
pub fn encode_export_name_reply(size: u64, flags: u16, no_zeroes: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(10 + 124);
    out.extend_from_slice(&size.to_be_bytes());
    out.extend_from_slice(&flags.to_be_bytes());
    if !no_zeroes {
        out.resize(out.len() + 124, 0);
    }
    out
}

pub fn decode_request_header(bytes: &[u8]) -> Result<RequestHeader, DecodeError> {
    let mut cur = Cursor::new(bytes);
    let magic = cur.u32()?;
    if magic != REQUEST_MAGIC {
        return Err(DecodeError::BadMagic(u64::from(magic)));
    }
    Ok(RequestHeader {
        flags: cur.u16()?,
        command: Command::from_wire(cur.u16()?),
        cookie: cur.u64()?,
        offset: cur.u64()?,
        length: cur.u32()?,
    })
}

/// A reply's header (and, for chunks without data, its whole payload): in place up to 32
/// bytes, which covers every reply but error messages and long block-status lists, so a
/// read's reply allocates nothing for its header.
pub type ReplyHead = smallvec::SmallVec<[u8; 32]>;

pub fn encode_simple_reply(cookie: u64, error: u32) -> ReplyHead {
    let mut out = ReplyHead::with_capacity(SIMPLE_REPLY_LEN);
    out.extend_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&error.to_be_bytes());
    out.extend_from_slice(&cookie.to_be_bytes());
    out
}

fn put_chunk_header(out: &mut ReplyHead, flags: u16, chunk_type: u16, cookie: u64, length: u32) {
    out.extend_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&flags.to_be_bytes());
    out.extend_from_slice(&chunk_type.to_be_bytes());
    out.extend_from_slice(&cookie.to_be_bytes());
    out.extend_from_slice(&length.to_be_bytes());
}

/// Final `NBD_REPLY_TYPE_NONE` chunk (success without content).
pub fn encode_none_chunk(cookie: u64) -> ReplyHead {
    let mut out = ReplyHead::with_capacity(CHUNK_HEADER_LEN);
    put_chunk_header(&mut out, REPLY_FLAG_DONE, REPLY_TYPE_NONE, cookie, 0);
    out
}

/// Header of a final `NBD_REPLY_TYPE_OFFSET_DATA` chunk; the `data_len` bytes follow it.
/// Returns `None` when the chunk length would not fit the 32-bit field.
pub fn encode_offset_data_head(cookie: u64, offset: u64, data_len: usize) -> Option<ReplyHead> {
    let length = u32::try_from(data_len.checked_add(8)?).ok()?;
    let mut out = ReplyHead::with_capacity(CHUNK_HEADER_LEN + 8);
    put_chunk_header(
        &mut out,
        REPLY_FLAG_DONE,
        REPLY_TYPE_OFFSET_DATA,
        cookie,
        length,
    );
    out.extend_from_slice(&offset.to_be_bytes());
    Some(out)
}

/// Final `NBD_REPLY_TYPE_OFFSET_HOLE` chunk: `hole_len` bytes at `offset` read as zeroes.
pub fn encode_offset_hole(cookie: u64, offset: u64, hole_len: u32) -> ReplyHead {
    let mut out = ReplyHead::with_capacity(CHUNK_HEADER_LEN + 12);
    put_chunk_header(
        &mut out,
        REPLY_FLAG_DONE,
        REPLY_TYPE_OFFSET_HOLE,
        cookie,
        12,
    );
    out.extend_from_slice(&offset.to_be_bytes());
    out.extend_from_slice(&hole_len.to_be_bytes());
    out
}

/// Final `NBD_REPLY_TYPE_ERROR` chunk with a human-readable message.
pub fn encode_error_chunk(cookie: u64, error: u32, message: &str) -> ReplyHead {
    let message = clamp_str(message);
    let mut out = ReplyHead::with_capacity(CHUNK_HEADER_LEN + 6 + message.len());
    put_chunk_header(
        &mut out,
        REPLY_FLAG_DONE,
        REPLY_TYPE_ERROR,
        cookie,
        wire_len(6 + message.len()),
    );
    out.extend_from_slice(&error.to_be_bytes());
    // clamp_str keeps the message within MAX_STRING_BYTES, so it fits 16 bits.
    out.extend_from_slice(&(message.len() as u16).to_be_bytes());
    out.extend_from_slice(message.as_bytes());
    out
}

/// Final `NBD_REPLY_TYPE_BLOCK_STATUS` chunk: context id, then (length, flags) descriptors.
pub fn encode_block_status_chunk(
    cookie: u64,
    context_id: u32,
    extents: &[(u32, u32)],
) -> ReplyHead {
    let payload_len = 4 + 8 * extents.len();
    let mut out = ReplyHead::with_capacity(CHUNK_HEADER_LEN + payload_len);
    put_chunk_header(
        &mut out,
        REPLY_FLAG_DONE,
        REPLY_TYPE_BLOCK_STATUS,
        cookie,
        wire_len(payload_len),
    );
    out.extend_from_slice(&context_id.to_be_bytes());
    for (length, flags) in extents {
        out.extend_from_slice(&length.to_be_bytes());
        out.extend_from_slice(&flags.to_be_bytes());
    }
    out
}

/// Cuts a string to the protocol's string limit on a character boundary.
pub fn clamp_str(text: &str) -> &str {
    if text.len() <= MAX_STRING_BYTES {
        return text;
    }
    let mut end = MAX_STRING_BYTES;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// Length fields are 32 bits; everything this server builds is far smaller, but saturate
/// rather than wrap so a bug can never desynchronise the stream silently.
fn wire_len(len: usize) -> u32 {
    u32::try_from(len).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greeting_layout() {
        let g = encode_greeting();
        assert_eq!(&g[..8], b"NBDMAGIC");
        assert_eq!(&g[8..16], b"IHAVEOPT");
        assert_eq!(&g[16..], &[0, 3]);
    }

    #[test]
    fn option_header_round_trip_and_bad_magic() {
        let mut raw = IHAVEOPT.to_be_bytes().to_vec();
        raw.extend_from_slice(&7u32.to_be_bytes());
        raw.extend_from_slice(&300u32.to_be_bytes());
        assert_eq!(
            decode_option_header(&raw),
            Ok(OptionHeader {
                option: 7,
                length: 300
            })
        );
        assert_eq!(decode_option_header(&raw[..10]), Err(DecodeError::Short));
        raw[0] ^= 1;
        assert!(matches!(
            decode_option_header(&raw),
            Err(DecodeError::BadMagic(_))
        ));
    }

    #[test]
    fn option_reply_layout() {
        let mut out = Vec::new();
        put_option_reply(&mut out, OPT_GO, REP_ERR_UNKNOWN, b"nope");
        assert_eq!(&out[..8], &[0, 3, 0xe8, 0x89, 0x04, 0x55, 0x65, 0xa9]);
        assert_eq!(&out[8..12], &7u32.to_be_bytes());
        assert_eq!(&out[12..16], &0x8000_0006u32.to_be_bytes());
        assert_eq!(&out[16..20], &4u32.to_be_bytes());
        assert_eq!(&out[20..], b"nope");
    }

    #[test]
    fn request_header_decodes_fields_big_endian() {
        let mut raw = vec![0x25, 0x60, 0x95, 0x13, 0x00, 0x01, 0x00, 0x01];
        raw.extend_from_slice(&0x0102_0304_0506_0708u64.to_be_bytes());
        raw.extend_from_slice(&4096u64.to_be_bytes());
        raw.extend_from_slice(&512u32.to_be_bytes());
        let h = decode_request_header(&raw).unwrap();
        assert_eq!(h.flags, CMD_FLAG_FUA);
        assert_eq!(h.command, Command::Write);
        assert_eq!(h.cookie, 0x0102_0304_0506_0708);
        assert_eq!((h.offset, h.length), (4096, 512));
        raw[3] = 0x14;
        assert_eq!(
            decode_request_header(&raw),
            Err(DecodeError::BadMagic(0x2560_9514))
        );
        assert_eq!(Command::from_wire(99), Command::Unknown(99));
    }

    #[test]
    fn export_name_reply_honours_no_zeroes() {
        assert_eq!(
            encode_export_name_reply(1 << 20, TRANSMISSION_FLAGS, false).len(),
            134
        );
        let short = encode_export_name_reply(1 << 20, TRANSMISSION_FLAGS, true);
        assert_eq!(short.len(), 10);
        assert_eq!(&short[..8], &(1u64 << 20).to_be_bytes());
    }

    #[test]
    fn simple_reply_layout() {
        let r = encode_simple_reply(0xabcd, EIO);
        assert_eq!(&r[..4], &[0x67, 0x44, 0x66, 0x98]);
        assert_eq!(&r[4..8], &5u32.to_be_bytes());
        assert_eq!(&r[8..], &0xabcdu64.to_be_bytes());
    }

    #[test]
    fn chunk_layouts() {
        let d = encode_offset_data_head(9, 4096, 512).unwrap();
        assert_eq!(&d[..4], &[0x66, 0x8e, 0x33, 0xef]);
        assert_eq!(&d[4..6], &REPLY_FLAG_DONE.to_be_bytes());
        assert_eq!(&d[6..8], &REPLY_TYPE_OFFSET_DATA.to_be_bytes());
        assert_eq!(&d[8..16], &9u64.to_be_bytes());
        assert_eq!(&d[16..20], &520u32.to_be_bytes());
        assert_eq!(&d[20..28], &4096u64.to_be_bytes());
        assert!(encode_offset_data_head(1, 0, u32::MAX as usize).is_none());

        let h = encode_offset_hole(1, 8, 16);
        assert_eq!(h.len(), 32);
        assert_eq!(&h[16..20], &12u32.to_be_bytes());

        let e = encode_error_chunk(1, EINVAL, "bad");
        assert_eq!(&e[6..8], &0x8001u16.to_be_bytes());
        assert_eq!(&e[16..20], &9u32.to_be_bytes());
        assert_eq!(&e[20..24], &22u32.to_be_bytes());
        assert_eq!(&e[24..26], &3u16.to_be_bytes());
        assert_eq!(&e[26..], b"bad");

        let b = encode_block_status_chunk(1, 1, &[(4096, STATE_HOLE | STATE_ZERO), (512, 0)]);
        assert_eq!(&b[16..20], &20u32.to_be_bytes());
        assert_eq!(&b[24..28], &4096u32.to_be_bytes());
        assert_eq!(&b[28..32], &3u32.to_be_bytes());

        let n = encode_none_chunk(5);
        assert_eq!(n.len(), CHUNK_HEADER_LEN);
    }

    #[test]
    fn strings_are_clamped_on_char_boundaries() {
        let long = "é".repeat(3000); // 6000 bytes
        let clamped = clamp_str(&long);
        assert!(clamped.len() <= MAX_STRING_BYTES);
        assert!(clamped.len() >= MAX_STRING_BYTES - 1);
        let e = encode_error_chunk(1, EIO, &long);
        assert_eq!(e.len(), CHUNK_HEADER_LEN + 6 + clamped.len());
    }

    #[test]
    fn info_payloads() {
        assert_eq!(info_export(1, TRANSMISSION_FLAGS).len(), 12);
        assert_eq!(info_block_size(1, 4096, 1 << 25).len(), 14);
        assert_eq!(info_string(INFO_NAME, "mem"), vec![0, 1, b'm', b'e', b'm']);
        let s = rep_server_payload("a", "desc");
        assert_eq!(s, vec![0, 0, 0, 1, b'a', b'd', b'e', b's', b'c']);
        assert_eq!(
            meta_context_payload(1, "x:y"),
            vec![0, 0, 0, 1, b'x', b':', b'y']
        );
    }
}

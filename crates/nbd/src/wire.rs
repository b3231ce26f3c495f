//! NBD wire constants and encoders (big-endian, as the protocol requires). Pure functions.

pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
pub const CLIENT_FIXED_NEWSTYLE: u32 = 1 << 0;
pub const CLIENT_NO_ZEROES: u32 = 1 << 1;

pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;
pub const OPT_LIST_META_CONTEXT: u32 = 9;
pub const OPT_SET_META_CONTEXT: u32 = 10;

pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
pub const REP_META_CONTEXT: u32 = 4;
pub const REP_ERR_UNSUP: u32 = (1 << 31) + 1;
pub const REP_ERR_INVALID: u32 = (1 << 31) + 3;
pub const REP_ERR_UNKNOWN: u32 = (1 << 31) + 6;

pub const INFO_EXPORT: u16 = 0;
pub const INFO_NAME: u16 = 1;
pub const INFO_DESCRIPTION: u16 = 2;
pub const INFO_BLOCK_SIZE: u16 = 3;

pub const TRANSMIT_HAS_FLAGS: u16 = 1 << 0;
pub const TRANSMIT_SEND_FLUSH: u16 = 1 << 2;
pub const TRANSMIT_SEND_FUA: u16 = 1 << 3;
pub const TRANSMIT_SEND_TRIM: u16 = 1 << 5;
pub const TRANSMIT_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const TRANSMIT_CAN_MULTI_CONN: u16 = 1 << 8;

pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;
pub const CMD_TRIM: u16 = 4;
pub const CMD_WRITE_ZEROES: u16 = 6;
pub const CMD_BLOCK_STATUS: u16 = 7;

pub const CMD_FLAG_FUA: u16 = 1 << 0;
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;

pub const REPLY_FLAG_DONE: u16 = 1 << 0;
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
pub const REPLY_TYPE_ERROR: u16 = (1 << 15) + 1;

pub const STATE_HOLE: u32 = 1 << 0;
pub const STATE_ZERO: u32 = 1 << 1;

pub const EIO: u32 = 5;
pub const EINVAL: u32 = 22;
pub const ENOSPC: u32 = 28;
pub const EOVERFLOW: u32 = 75;
pub const ESHUTDOWN: u32 = 108;

/// The one metadata context we offer.
pub const BASE_ALLOCATION: &str = "base:allocation";
/// Its id on this connection (any non-zero value chosen by the server).
pub const BASE_ALLOCATION_ID: u32 = 1;

pub const REQUEST_HEADER_BYTES: usize = 28;

/// A transmission-phase request header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    pub flags: u16,
    pub kind: u16,
    pub cookie: u64,
    pub offset: u64,
    pub length: u32,
}

/// Parses a request header; `None` if the magic is wrong.
pub fn parse_request(header: &[u8; REQUEST_HEADER_BYTES]) -> Option<Request> {
    let u16_at = |at: usize| u16::from_be_bytes([header[at], header[at + 1]]);
    let magic = u32::from_be_bytes([header[0], header[1], header[2], header[3]]);
    if magic != REQUEST_MAGIC {
        return None;
    }
    Some(Request {
        flags: u16_at(4),
        kind: u16_at(6),
        cookie: u64::from_be_bytes(header[8..16].try_into().ok()?),
        offset: u64::from_be_bytes(header[16..24].try_into().ok()?),
        length: u32::from_be_bytes(header[24..28].try_into().ok()?),
    })
}

pub fn option_reply(option: u32, reply_type: u32, data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(20 + data.len());
    out.extend_from_slice(&OPTION_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&reply_type.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
    out
}

pub fn simple_reply(error: u32, cookie: u64) -> [u8; 16] {
    let mut out = [0u8; 16];
    out[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    out[4..8].copy_from_slice(&error.to_be_bytes());
    out[8..16].copy_from_slice(&cookie.to_be_bytes());
    out
}

pub fn chunk_header(flags: u16, kind: u16, cookie: u64, length: u32) -> [u8; 20] {
    let mut out = [0u8; 20];
    out[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    out[4..6].copy_from_slice(&flags.to_be_bytes());
    out[6..8].copy_from_slice(&kind.to_be_bytes());
    out[8..16].copy_from_slice(&cookie.to_be_bytes());
    out[16..20].copy_from_slice(&length.to_be_bytes());
    out
}

/// A final structured error chunk with a short message.
pub fn error_chunk(error: u32, cookie: u64, message: &str) -> Vec<u8> {
    let message = &message.as_bytes()[..message.len().min(4096)];
    let mut out = chunk_header(
        REPLY_FLAG_DONE,
        REPLY_TYPE_ERROR,
        cookie,
        6 + message.len() as u32,
    )
    .to_vec();
    out.extend_from_slice(&error.to_be_bytes());
    out.extend_from_slice(&(message.len() as u16).to_be_bytes());
    out.extend_from_slice(message);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_round_trip_and_bad_magic() {
        let mut header = [0u8; REQUEST_HEADER_BYTES];
        header[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        header[4..6].copy_from_slice(&CMD_FLAG_FUA.to_be_bytes());
        header[6..8].copy_from_slice(&CMD_WRITE.to_be_bytes());
        header[8..16].copy_from_slice(&7u64.to_be_bytes());
        header[16..24].copy_from_slice(&4096u64.to_be_bytes());
        header[24..28].copy_from_slice(&512u32.to_be_bytes());
        let request = parse_request(&header).unwrap();
        assert_eq!(
            request,
            Request {
                flags: CMD_FLAG_FUA,
                kind: CMD_WRITE,
                cookie: 7,
                offset: 4096,
                length: 512
            }
        );
        header[0] ^= 1;
        assert!(parse_request(&header).is_none());
    }

    #[test]
    fn replies_have_their_documented_layout() {
        let reply = option_reply(OPT_GO, REP_ACK, b"");
        assert_eq!(reply.len(), 20);
        assert_eq!(&reply[0..8], &OPTION_REPLY_MAGIC.to_be_bytes());
        let simple = simple_reply(EIO, 9);
        assert_eq!(&simple[4..8], &EIO.to_be_bytes());
        let error = error_chunk(EINVAL, 3, "bad");
        assert_eq!(error.len(), 20 + 6 + 3);
        assert_eq!(&error[6..8], &REPLY_TYPE_ERROR.to_be_bytes());
    }
}

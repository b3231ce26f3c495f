//! Forwarding messages inside node-to-node request payloads (docs/forwarding.md, version 1):
//! pure encode and decode. All integers little-endian.
//!
//! ```text
//! offset size field
//!      0    1 kind: 16 I/O, 17 hand over, 18 copy read
//!      1    1 version: 1
//!      2    1 op: 1 read, 2 write, 3 flush, 4 trim, 5 write zeroes, 6 block status (I/O)
//!      3    1 flags: bit 0 FUA, bit 1 may punch holes; other bits zero
//!      4    4 length in bytes (I/O, copy read; for a write, the data's length)
//!      8    8 vdisk id
//!     16    8 vdisk offset (I/O, copy read)
//!     24    4 CRC32C of the data (write; zero otherwise)
//!     28    4 reserved, zero
//!     32    - data: `length` bytes (write only)
//! ```
//!
//! A hand-over (17) may carry the asking node's id (u128, 16 bytes) as its data: the owner
//! then first makes that node a complete copy if it holds none (docs/forwarding.md). An
//! empty one names nobody (an earlier version).
//!
//! Answers: a read's data, a block status's runs (u32 count, then per run a u64 length and a
//! u8 of flags, bit 0 hole, bit 1 zero), else an empty payload. A failure is the transport's
//! remote error with one of the `*_CODE` codes below.

use ashlar_cluster::NodeId;
use ashlar_core::{BlockStatusRun, IoError, VdiskId};
use bytes::{Buf, BufMut, Bytes, BytesMut};

pub const FORWARD_VERSION: u8 = 1;
pub const HEADER_BYTES: usize = 32;
/// A hand-over's data: the asking node's id.
const NODE_ID_BYTES: u32 = 16;

pub const KIND_IO: u8 = 16;
pub const KIND_HAND_OVER: u8 = 17;
pub const KIND_COPY_READ: u8 = 18;

const FLAG_FUA: u8 = 1;
const FLAG_MAY_PUNCH: u8 = 2;

/// The owner's disk or copies failed the request (EIO).
pub const IO_CODE: u32 = 16;
/// The request reaches past the end of the vdisk, or is malformed.
pub const INVALID_CODE: u32 = 17;
/// The owner has no space left.
pub const NO_SPACE_CODE: u32 = 18;
/// The vdisk is being deleted or the owner is stopping.
pub const SHUTTING_DOWN_CODE: u32 = 19;
/// The node does not serve the vdisk (any more): the forwarder finds its owner again.
pub const NOT_SERVING_CODE: u32 = 20;
/// The message did not decode.
pub const MALFORMED_CODE: u32 = 21;
/// A hand-over was refused because clients of the owner itself use the vdisk.
pub const BUSY_CODE: u32 = 22;

/// Whether a node-to-node payload is a forwarding message (else it is a replication one).
pub fn is_forwarding(payload: &[u8]) -> bool {
    matches!(
        payload.first(),
        Some(&KIND_IO) | Some(&KIND_HAND_OVER) | Some(&KIND_COPY_READ)
    )
}

/// One client request, as the owner runs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ForwardOp {
    Read { length: u32 },
    Write { data: Bytes, fua: bool },
    Flush,
    Trim { length: u32 },
    WriteZeroes { length: u32, may_punch_hole: bool },
    BlockStatus { length: u32 },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ForwardMessage {
    Io {
        vdisk: VdiskId,
        offset: u64,
        op: ForwardOp,
    },
    /// The sender (`asker`) has carried the vdisk's client I/O for a while: the owner gives
    /// its claim up so the sender can claim it (`docs/forwarding.md`, migration), once the
    /// sender holds a complete copy.
    HandOver {
        vdisk: VdiskId,
        asker: Option<NodeId>,
    },
    /// The owner's copy failed its checksums: read this copy's blocks below its serving gate
    /// (a copy serves no client, but holds every acknowledged write).
    CopyRead {
        vdisk: VdiskId,
        offset: u64,
        length: u32,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ForwardWireError {
    #[error("message of {0} bytes is shorter than the {HEADER_BYTES}-byte header")]
    Short(usize),
    #[error("unknown forwarding message version {0} (this node speaks {FORWARD_VERSION})")]
    Version(u8),
    #[error("unknown forwarding message kind {0}")]
    Kind(u8),
    #[error("unknown forwarded op {0}")]
    Op(u8),
    #[error("non-zero reserved bytes or unknown flags")]
    Reserved,
    #[error("data length {actual} does not match the header's {declared}")]
    Length { declared: u32, actual: usize },
    #[error("data CRC mismatch")]
    Crc,
    #[error("malformed block status answer")]
    Runs,
}

pub fn encode(message: &ForwardMessage) -> Bytes {
    let mut out = BytesMut::with_capacity(HEADER_BYTES);
    match message {
        ForwardMessage::HandOver { vdisk, asker } => {
            let length = if asker.is_some() { NODE_ID_BYTES } else { 0 };
            header(&mut out, KIND_HAND_OVER, 0, 0, length, *vdisk, 0, 0);
            if let Some(asker) = asker {
                out.put_u128_le(asker.value());
            }
        }
        ForwardMessage::CopyRead {
            vdisk,
            offset,
            length,
        } => {
            header(&mut out, KIND_COPY_READ, 0, 0, *length, *vdisk, *offset, 0);
        }
        ForwardMessage::Io { vdisk, offset, op } => {
            let (code, flags, length, data) = match op {
                ForwardOp::Read { length } => (1, 0, *length, None),
                ForwardOp::Write { data, fua } => {
                    let flags = if *fua { FLAG_FUA } else { 0 };
                    (2, flags, data.len() as u32, Some(data))
                }
                ForwardOp::Flush => (3, 0, 0, None),
                ForwardOp::Trim { length } => (4, 0, *length, None),
                ForwardOp::WriteZeroes {
                    length,
                    may_punch_hole,
                } => {
                    let flags = if *may_punch_hole { FLAG_MAY_PUNCH } else { 0 };
                    (5, flags, *length, None)
                }
                ForwardOp::BlockStatus { length } => (6, 0, *length, None),
            };
            let crc = data.map_or(0, |d| crc32c::crc32c(d));
            header(&mut out, KIND_IO, code, flags, length, *vdisk, *offset, crc);
            if let Some(data) = data {
                out.extend_from_slice(data);
            }
        }
    }
    out.freeze()
}

#[allow(clippy::too_many_arguments)]
fn header(
    out: &mut BytesMut,
    kind: u8,
    op: u8,
    flags: u8,
    length: u32,
    vdisk: VdiskId,
    offset: u64,
    crc: u32,
) {
    out.put_u8(kind);
    out.put_u8(FORWARD_VERSION);
    out.put_u8(op);
    out.put_u8(flags);
    out.put_u32_le(length);
    out.put_u64_le(vdisk.0);
    out.put_u64_le(offset);
    out.put_u32_le(crc);
    out.put_u32_le(0);
}

pub fn decode(payload: &Bytes) -> Result<ForwardMessage, ForwardWireError> {
    if payload.len() < HEADER_BYTES {
        return Err(ForwardWireError::Short(payload.len()));
    }
    let mut head = &payload[..HEADER_BYTES];
    let kind = head.get_u8();
    let version = head.get_u8();
    let op = head.get_u8();
    let flags = head.get_u8();
    let length = head.get_u32_le();
    let vdisk = VdiskId(head.get_u64_le());
    let offset = head.get_u64_le();
    let crc = head.get_u32_le();
    let reserved = head.get_u32_le();
    if version != FORWARD_VERSION {
        return Err(ForwardWireError::Version(version));
    }
    if kind == KIND_IO && !(1..=6).contains(&op) {
        return Err(ForwardWireError::Op(op));
    }
    if reserved != 0 || flags & !(FLAG_FUA | FLAG_MAY_PUNCH) != 0 {
        return Err(ForwardWireError::Reserved);
    }
    let data = payload.slice(HEADER_BYTES..);
    if kind == KIND_HAND_OVER {
        if op != 0 || flags != 0 || offset != 0 || crc != 0 {
            return Err(ForwardWireError::Reserved);
        }
        let asker = match (length, data.len()) {
            (0, 0) => None,
            (NODE_ID_BYTES, 16) => {
                let id = u128::from_le_bytes(data[..16].try_into().expect("16 bytes"));
                Some(NodeId::new(id).ok_or(ForwardWireError::Reserved)?)
            }
            (declared, actual) => return Err(ForwardWireError::Length { declared, actual }),
        };
        return Ok(ForwardMessage::HandOver { vdisk, asker });
    }
    if kind == KIND_COPY_READ {
        if op != 0 || flags != 0 || crc != 0 || !data.is_empty() {
            return Err(ForwardWireError::Reserved);
        }
        return Ok(ForwardMessage::CopyRead {
            vdisk,
            offset,
            length,
        });
    }
    if kind != KIND_IO {
        return Err(ForwardWireError::Kind(kind));
    }
    let is_write = op == 2;
    if !is_write && (crc != 0 || !data.is_empty()) {
        return Err(ForwardWireError::Reserved);
    }
    let op = match op {
        1 => ForwardOp::Read { length },
        2 => {
            if data.len() != length as usize {
                return Err(ForwardWireError::Length {
                    declared: length,
                    actual: data.len(),
                });
            }
            if crc32c::crc32c(&data) != crc {
                return Err(ForwardWireError::Crc);
            }
            ForwardOp::Write {
                data,
                fua: flags & FLAG_FUA != 0,
            }
        }
        3 => ForwardOp::Flush,
        4 => ForwardOp::Trim { length },
        5 => ForwardOp::WriteZeroes {
            length,
            may_punch_hole: flags & FLAG_MAY_PUNCH != 0,
        },
        6 => ForwardOp::BlockStatus { length },
        other => return Err(ForwardWireError::Op(other)),
    };
    Ok(ForwardMessage::Io { vdisk, offset, op })
}

pub fn encode_runs(runs: &[BlockStatusRun]) -> Bytes {
    let mut out = BytesMut::with_capacity(4 + runs.len() * 9);
    out.put_u32_le(runs.len() as u32);
    for run in runs {
        out.put_u64_le(run.length);
        out.put_u8(u8::from(run.hole) | (u8::from(run.zero) << 1));
    }
    out.freeze()
}

pub fn decode_runs(payload: &[u8]) -> Result<Vec<BlockStatusRun>, ForwardWireError> {
    let mut buf = payload;
    if buf.len() < 4 {
        return Err(ForwardWireError::Runs);
    }
    let count = buf.get_u32_le() as usize;
    if buf.len() != count * 9 {
        return Err(ForwardWireError::Runs);
    }
    let mut runs = Vec::with_capacity(count);
    for _ in 0..count {
        let length = buf.get_u64_le();
        let flags = buf.get_u8();
        if flags & !3 != 0 {
            return Err(ForwardWireError::Runs);
        }
        runs.push(BlockStatusRun {
            length,
            hole: flags & 1 != 0,
            zero: flags & 2 != 0,
        });
    }
    Ok(runs)
}

/// The remote error code an owner answers an I/O error with.
pub fn error_code(error: &IoError) -> u32 {
    match error {
        IoError::Io(_) => IO_CODE,
        IoError::OutOfRange { .. } | IoError::Invalid(_) => INVALID_CODE,
        IoError::NoSpace => NO_SPACE_CODE,
        IoError::ShuttingDown => SHUTTING_DOWN_CODE,
        IoError::NotServing(_) => NOT_SERVING_CODE,
    }
}

/// The I/O error a forwarder gives its client for an owner's remote error.
pub fn io_error(code: u32, message: String) -> IoError {
    match code {
        INVALID_CODE => IoError::Invalid(message),
        NO_SPACE_CODE => IoError::NoSpace,
        SHUTTING_DOWN_CODE => IoError::ShuttingDown,
        NOT_SERVING_CODE => IoError::NotServing(message),
        _ => IoError::Io(message),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(message: ForwardMessage) {
        let bytes = encode(&message);
        assert!(is_forwarding(&bytes));
        assert_eq!(decode(&bytes).unwrap(), message);
    }

    #[test]
    fn every_message_round_trips() {
        let vdisk = VdiskId(0x1234_5678_9abc);
        round_trip(ForwardMessage::HandOver { vdisk, asker: None });
        round_trip(ForwardMessage::HandOver {
            vdisk,
            asker: NodeId::new(0x0102_0304_0506_0708_090a_0b0c_0d0e_0f10),
        });
        round_trip(ForwardMessage::CopyRead {
            vdisk,
            offset: 8192,
            length: 1 << 20,
        });
        for op in [
            ForwardOp::Read { length: 4096 },
            ForwardOp::Write {
                data: Bytes::from(vec![7u8; 8192]),
                fua: true,
            },
            ForwardOp::Write {
                data: Bytes::new(),
                fua: false,
            },
            ForwardOp::Flush,
            ForwardOp::Trim { length: 1 << 20 },
            ForwardOp::WriteZeroes {
                length: 512,
                may_punch_hole: true,
            },
            ForwardOp::BlockStatus { length: 65536 },
        ] {
            round_trip(ForwardMessage::Io {
                vdisk,
                offset: 1 << 30,
                op,
            });
        }
    }

    #[test]
    fn damaged_messages_are_refused() {
        let message = ForwardMessage::Io {
            vdisk: VdiskId(1),
            offset: 0,
            op: ForwardOp::Write {
                data: Bytes::from(vec![1u8; 4096]),
                fua: false,
            },
        };
        let good = encode(&message).to_vec();
        let with = |at: usize, value: u8| {
            let mut bytes = good.clone();
            bytes[at] = value;
            decode(&Bytes::from(bytes))
        };
        assert_eq!(with(1, 2), Err(ForwardWireError::Version(2)));
        assert_eq!(with(0, 15), Err(ForwardWireError::Kind(15)));
        assert_eq!(with(2, 9), Err(ForwardWireError::Op(9)));
        assert_eq!(with(3, 4), Err(ForwardWireError::Reserved));
        assert_eq!(with(29, 1), Err(ForwardWireError::Reserved));
        assert_eq!(with(40, 0), Err(ForwardWireError::Crc));
        assert!(matches!(
            decode(&Bytes::from(good[..HEADER_BYTES + 100].to_vec())),
            Err(ForwardWireError::Length { .. })
        ));
        assert_eq!(
            decode(&Bytes::from(good[..10].to_vec())),
            Err(ForwardWireError::Short(10))
        );
    }

    #[test]
    fn block_status_runs_round_trip_and_damage_is_refused() {
        let runs = vec![
            BlockStatusRun {
                length: 4096,
                hole: true,
                zero: true,
            },
            BlockStatusRun {
                length: 1 << 20,
                hole: false,
                zero: false,
            },
        ];
        let bytes = encode_runs(&runs);
        assert_eq!(decode_runs(&bytes).unwrap(), runs);
        assert_eq!(
            decode_runs(&bytes[..bytes.len() - 1]),
            Err(ForwardWireError::Runs)
        );
    }

    #[test]
    fn errors_keep_their_meaning_across_the_wire() {
        for error in [
            IoError::Io("disk".into()),
            IoError::Invalid("bad".into()),
            IoError::NoSpace,
            IoError::ShuttingDown,
            IoError::NotServing("moved".into()),
        ] {
            let back = io_error(error_code(&error), "m".into());
            assert_eq!(
                std::mem::discriminant(&back),
                std::mem::discriminant(&error)
            );
        }
    }
}

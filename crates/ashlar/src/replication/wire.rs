//! The replication messages inside node-to-node request payloads (docs/replication.md,
//! version 1): pure encode and decode. All integers little-endian.
//!
//! ```text
//! offset size field
//!      0    1 kind: 1 record, 2 fence, 3 push, 4 digest
//!      1    1 version: 1
//!      2    2 reserved, zero
//!      4    4 shard index            (record; zero in a fence)
//!      8    8 vdisk id
//!     16    8 owner epoch
//!     24    8 stream                 (record; zero in a fence)
//!     32    8 seq                    (record)
//!     40    8 prev seq               (record; 0 for a stream's first record)
//!     48    8 vdisk offset           (record)
//!     56    8 length in bytes        (record)
//!     64    1 op: 1 write, 2 zero    (record)
//!     65    3 reserved, zero
//!     68    4 CRC32C of the data     (write; zero otherwise)
//!     72    - data: `length` bytes   (write only)
//! ```
//!
//! A push (a claimant without a copy asks a node holding one to send it everything) has the
//! target node's id at 24 (16 bytes, u128) and the length of its node-to-node address at 40
//! (u16); the address (UTF-8, `host:port`) follows the header. Everything else is zero.
//!
//! A digest request (a claimant asks a copy what its content is, to send only what differs)
//! has the first byte's vdisk offset at 48 and the length at 56; everything else is zero. Its
//! answer is one [`ChunkDigest`] per 1 MiB chunk of the range (33 bytes each: a state, 0
//! zeros, 1 data, 2 unreadable, then the SHA-256 of the chunk's bytes for data, else zeros).
//!
//! A fence's answer is the copy's [`CopyIdentity`] (16 bytes, a u128: see
//! `ashlar_storage::copy_identity`); an answer of any other length (an empty one from a node
//! of an earlier version) names no identity.
//!
//! Any other successful answer is an empty payload; a refusal is the transport's remote error with
//! one of the `*_CODE` codes below and a message for the log.

use ashlar_cluster::NodeId;
use ashlar_core::VdiskId;
use ashlar_engine::replication::{ReplicaOp, ReplicaRecord};
pub use ashlar_storage::copy_identity::CopyIdentity;
use bytes::{BufMut, Bytes, BytesMut};

pub const WIRE_VERSION: u8 = 1;
pub const HEADER_BYTES: usize = 72;

const KIND_RECORD: u8 = 1;
const KIND_FENCE: u8 = 2;
const KIND_PUSH: u8 = 3;
const KIND_DIGEST: u8 = 4;
const OP_WRITE: u8 = 1;
const OP_ZERO: u8 = 2;

/// The replica has seen a higher owner epoch: the sender no longer owns the vdisk.
pub const FENCED_CODE: u32 = 1;
/// The replica could not apply the record (its disk failed, the vdisk is unknown, ...).
pub const FAILED_CODE: u32 = 2;
/// The message did not decode.
pub const MALFORMED_CODE: u32 = 3;
/// The replica does not hold the record before this one (it was down or restarted while the
/// owner wrote): its copy is stale and must be resynchronized before it takes records again.
pub const STALE_CODE: u32 = 4;

/// One replication message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    /// Apply this record (written by the owner at `epoch`).
    Record { epoch: u64, record: ReplicaRecord },
    /// From now on refuse records of epochs below `epoch` (a new owner, before it serves).
    Fence { vdisk: VdiskId, epoch: u64 },
    /// Resync node `target` at `address` from this copy, at `epoch` (what differs is sent).
    Push {
        vdisk: VdiskId,
        epoch: u64,
        target: NodeId,
        address: String,
    },
    /// Answer the digest of each 1 MiB chunk of `[offset, offset + length)` of this copy.
    Digest {
        vdisk: VdiskId,
        epoch: u64,
        offset: u64,
        length: u64,
    },
}

/// What one 1 MiB chunk of a copy holds, as far as a resync needs to know.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChunkDigest {
    /// Every byte is zero.
    Zeros,
    /// The SHA-256 of the chunk's bytes.
    Data([u8; 32]),
    /// The copy could not read the chunk (damage): it differs from any good copy.
    Unreadable,
}

/// Bytes per chunk digest in a digest answer.
pub const DIGEST_BYTES: usize = 33;

const IDENTITY_BYTES: usize = 16;

pub fn encode_fence_answer(identity: CopyIdentity) -> Bytes {
    Bytes::copy_from_slice(&identity.0.to_le_bytes())
}

/// The identity in a fence's answer; `None` for any other length (an earlier version's
/// empty answer): the claimant then compares the whole copy.
pub fn decode_fence_answer(payload: &[u8]) -> Option<CopyIdentity> {
    let bytes: [u8; IDENTITY_BYTES] = payload.try_into().ok()?;
    Some(CopyIdentity(u128::from_le_bytes(bytes)))
}

pub fn encode_digests(digests: &[ChunkDigest]) -> Bytes {
    let mut out = BytesMut::with_capacity(digests.len() * DIGEST_BYTES);
    for digest in digests {
        match digest {
            ChunkDigest::Zeros => {
                out.put_u8(0);
                out.put_bytes(0, 32);
            }
            ChunkDigest::Data(hash) => {
                out.put_u8(1);
                out.put_slice(hash);
            }
            ChunkDigest::Unreadable => {
                out.put_u8(2);
                out.put_bytes(0, 32);
            }
        }
    }
    out.freeze()
}

/// Decodes a digest answer that must hold `count` digests.
pub fn decode_digests(payload: &[u8], count: usize) -> Result<Vec<ChunkDigest>, WireError> {
    if payload.len() != count * DIGEST_BYTES {
        return Err(WireError::Digests {
            expected: count,
            bytes: payload.len(),
        });
    }
    payload
        .chunks_exact(DIGEST_BYTES)
        .map(|entry| {
            let hash: [u8; 32] = entry[1..].try_into().expect("32 bytes");
            match entry[0] {
                0 if hash == [0; 32] => Ok(ChunkDigest::Zeros),
                1 => Ok(ChunkDigest::Data(hash)),
                2 if hash == [0; 32] => Ok(ChunkDigest::Unreadable),
                _ => Err(WireError::Digests {
                    expected: count,
                    bytes: payload.len(),
                }),
            }
        })
        .collect()
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("message of {0} bytes is shorter than the {HEADER_BYTES}-byte header")]
    Short(usize),
    #[error("unknown replication message version {0} (this node speaks {WIRE_VERSION})")]
    Version(u8),
    #[error("unknown message kind {0}")]
    Kind(u8),
    #[error("unknown record op {0}")]
    Op(u8),
    #[error("non-zero reserved bytes")]
    Reserved,
    #[error("write of {length} bytes carries {carried} bytes of data")]
    Length { length: u64, carried: usize },
    #[error("data CRC32C {got:#010x} does not match the header's {expected:#010x}")]
    Crc { expected: u32, got: u32 },
    #[error("record seq {seq} does not follow prev seq {prev}")]
    Order { seq: u64, prev: u64 },
    #[error("push to an invalid node id or address")]
    Target,
    #[error("digest answer of {bytes} bytes is not {expected} valid chunk digests")]
    Digests { expected: usize, bytes: usize },
}

pub fn encode(message: &Message) -> Bytes {
    let mut out = BytesMut::with_capacity(HEADER_BYTES + data_len(message));
    let (kind, shard, vdisk, epoch) = match message {
        Message::Record { epoch, record } => (KIND_RECORD, record.shard, record.vdisk, *epoch),
        Message::Fence { vdisk, epoch } => (KIND_FENCE, 0, *vdisk, *epoch),
        Message::Push { vdisk, epoch, .. } => (KIND_PUSH, 0, *vdisk, *epoch),
        Message::Digest { vdisk, epoch, .. } => (KIND_DIGEST, 0, *vdisk, *epoch),
    };
    out.put_u8(kind);
    out.put_u8(WIRE_VERSION);
    out.put_u16_le(0);
    out.put_u32_le(shard);
    out.put_u64_le(vdisk.0);
    out.put_u64_le(epoch);
    match message {
        Message::Record { record, .. } => {
            let (offset, length) = record.op.range();
            out.put_u64_le(record.stream);
            out.put_u64_le(record.seq);
            out.put_u64_le(record.prev_seq);
            out.put_u64_le(offset);
            out.put_u64_le(length);
            let (op, crc) = match &record.op {
                ReplicaOp::Write { data, .. } => (OP_WRITE, crc32c::crc32c(data)),
                ReplicaOp::Zero { .. } => (OP_ZERO, 0),
            };
            out.put_u8(op);
            out.put_bytes(0, 3);
            out.put_u32_le(crc);
            if let ReplicaOp::Write { data, .. } = &record.op {
                out.put_slice(data);
            }
        }
        Message::Fence { .. } => out.put_bytes(0, HEADER_BYTES - 24),
        Message::Push {
            target, address, ..
        } => {
            out.put_u128_le(target.value());
            out.put_u16_le(address.len() as u16);
            out.put_bytes(0, HEADER_BYTES - 42);
            out.put_slice(address.as_bytes());
        }
        Message::Digest { offset, length, .. } => {
            out.put_bytes(0, 24);
            out.put_u64_le(*offset);
            out.put_u64_le(*length);
            out.put_bytes(0, HEADER_BYTES - 64);
        }
    }
    debug_assert!(out.len() >= HEADER_BYTES);
    out.freeze()
}

fn data_len(message: &Message) -> usize {
    match message {
        Message::Record {
            record:
                ReplicaRecord {
                    op: ReplicaOp::Write { data, .. },
                    ..
                },
            ..
        } => data.len(),
        _ => 0,
    }
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
}

/// Decodes a message; the data of a write is a slice of `payload` (no copy), CRC-checked.
pub fn decode(payload: &Bytes) -> Result<Message, WireError> {
    let bytes = &payload[..];
    if bytes.len() < HEADER_BYTES {
        return Err(WireError::Short(bytes.len()));
    }
    if bytes[1] != WIRE_VERSION {
        return Err(WireError::Version(bytes[1]));
    }
    if bytes[2..4] != [0, 0] || bytes[65..68] != [0, 0, 0] {
        return Err(WireError::Reserved);
    }
    let vdisk = VdiskId(u64_at(bytes, 8));
    let epoch = u64_at(bytes, 16);
    match bytes[0] {
        KIND_FENCE => {
            if bytes[24..].iter().any(|&b| b != 0) || u32_at(bytes, 4) != 0 {
                return Err(WireError::Reserved);
            }
            Ok(Message::Fence { vdisk, epoch })
        }
        KIND_RECORD => decode_record(payload, vdisk, epoch),
        KIND_PUSH => decode_push(bytes, vdisk, epoch),
        KIND_DIGEST => {
            let unused_zero = bytes[24..48].iter().chain(&bytes[64..]).all(|&b| b == 0);
            if !unused_zero || u32_at(bytes, 4) != 0 {
                return Err(WireError::Reserved);
            }
            Ok(Message::Digest {
                vdisk,
                epoch,
                offset: u64_at(bytes, 48),
                length: u64_at(bytes, 56),
            })
        }
        other => Err(WireError::Kind(other)),
    }
}

fn decode_push(bytes: &[u8], vdisk: VdiskId, epoch: u64) -> Result<Message, WireError> {
    if u32_at(bytes, 4) != 0 || bytes[42..HEADER_BYTES].iter().any(|&b| b != 0) {
        return Err(WireError::Reserved);
    }
    let target = u128::from_le_bytes(bytes[24..40].try_into().expect("16 bytes"));
    let length = usize::from(u16::from_le_bytes([bytes[40], bytes[41]]));
    let address = &bytes[HEADER_BYTES..];
    if address.len() != length {
        return Err(WireError::Target);
    }
    Ok(Message::Push {
        vdisk,
        epoch,
        target: NodeId::new(target).ok_or(WireError::Target)?,
        address: String::from_utf8(address.to_vec()).map_err(|_| WireError::Target)?,
    })
}

fn decode_record(payload: &Bytes, vdisk: VdiskId, epoch: u64) -> Result<Message, WireError> {
    let bytes = &payload[..];
    let (seq, prev_seq) = (u64_at(bytes, 32), u64_at(bytes, 40));
    if seq <= prev_seq {
        return Err(WireError::Order {
            seq,
            prev: prev_seq,
        });
    }
    let (offset, length) = (u64_at(bytes, 48), u64_at(bytes, 56));
    let carried = bytes.len() - HEADER_BYTES;
    let op = match bytes[64] {
        OP_WRITE => {
            if length != carried as u64 || length == 0 {
                return Err(WireError::Length { length, carried });
            }
            let data = payload.slice(HEADER_BYTES..);
            let (expected, got) = (u32_at(bytes, 68), crc32c::crc32c(&data));
            if expected != got {
                return Err(WireError::Crc { expected, got });
            }
            ReplicaOp::Write { offset, data }
        }
        OP_ZERO => {
            if carried != 0 || u32_at(bytes, 68) != 0 {
                return Err(WireError::Length { length, carried });
            }
            ReplicaOp::Zero { offset, length }
        }
        other => return Err(WireError::Op(other)),
    };
    let record = ReplicaRecord {
        vdisk,
        shard: u32_at(bytes, 4),
        stream: u64_at(bytes, 24),
        seq,
        prev_seq,
        op,
    };
    Ok(Message::Record { epoch, record })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_record() -> Message {
        Message::Record {
            epoch: 7,
            record: ReplicaRecord {
                vdisk: VdiskId(42),
                shard: 3,
                stream: 9,
                seq: 101,
                prev_seq: 99,
                op: ReplicaOp::Write {
                    offset: 8192,
                    data: Bytes::from(vec![0xab; 4096]),
                },
            },
        }
    }

    #[test]
    fn a_fence_answer_carries_the_copy_identity_and_an_empty_one_none() {
        let identity = CopyIdentity(0x0102_0304_0506_0708_090a_0b0c_0d0e_0f10);
        let bytes = encode_fence_answer(identity);
        assert_eq!(bytes.len(), 16);
        assert_eq!(bytes[0], 0x10, "little-endian");
        assert_eq!(decode_fence_answer(&bytes), Some(identity));
        assert_eq!(decode_fence_answer(&[]), None);
        assert_eq!(decode_fence_answer(&bytes[..15]), None);
    }

    #[test]
    fn every_message_decodes_to_itself() {
        let zero = Message::Record {
            epoch: 1,
            record: ReplicaRecord {
                vdisk: VdiskId(1),
                shard: 0,
                stream: 1,
                seq: 1,
                prev_seq: 0,
                op: ReplicaOp::Zero {
                    offset: 0,
                    length: 1 << 20,
                },
            },
        };
        let fence = Message::Fence {
            vdisk: VdiskId(5),
            epoch: 3,
        };
        let push = Message::Push {
            vdisk: VdiskId(5),
            epoch: 4,
            target: NodeId::new(0xabc).unwrap(),
            address: "10.0.0.3:10811".into(),
        };
        let digest = Message::Digest {
            vdisk: VdiskId(5),
            epoch: 4,
            offset: 8 << 20,
            length: 3 << 20,
        };
        for message in [write_record(), zero, fence, push, digest] {
            let bytes = encode(&message);
            assert_eq!(decode(&bytes), Ok(message));
        }
        assert_eq!(encode(&write_record()).len(), HEADER_BYTES + 4096);
    }

    #[test]
    fn digest_answers_decode_to_themselves_and_damage_is_refused() {
        let digests = [
            ChunkDigest::Zeros,
            ChunkDigest::Data([7; 32]),
            ChunkDigest::Unreadable,
        ];
        let bytes = encode_digests(&digests);
        assert_eq!(bytes.len(), 3 * DIGEST_BYTES);
        assert_eq!(decode_digests(&bytes, 3), Ok(digests.to_vec()));
        assert!(decode_digests(&bytes, 2).is_err(), "count mismatch");
        let mut bad = bytes.to_vec();
        bad[0] = 9;
        assert!(decode_digests(&bad, 3).is_err(), "unknown state");
        let mut bad = bytes.to_vec();
        bad[2 * DIGEST_BYTES + 5] = 1;
        assert!(
            decode_digests(&bad, 3).is_err(),
            "a hash on an unreadable chunk"
        );
    }

    #[test]
    fn damaged_messages_are_refused_with_the_reason() {
        let good = encode(&write_record()).to_vec();
        let with = |at: usize, value: u8| {
            let mut bytes = good.clone();
            bytes[at] = value;
            decode(&Bytes::from(bytes))
        };
        assert_eq!(with(1, 2), Err(WireError::Version(2)));
        assert_eq!(with(0, 9), Err(WireError::Kind(9)));
        assert_eq!(with(64, 7), Err(WireError::Op(7)));
        assert_eq!(with(66, 1), Err(WireError::Reserved));
        assert!(matches!(
            with(HEADER_BYTES + 5, 0),
            Err(WireError::Crc { .. })
        ));
        // prev seq at or past seq.
        assert!(matches!(with(40, 200), Err(WireError::Order { .. })));
        assert_eq!(
            decode(&Bytes::from(good[..HEADER_BYTES - 1].to_vec())),
            Err(WireError::Short(HEADER_BYTES - 1))
        );
        // Data cut short.
        assert!(matches!(
            decode(&Bytes::from(good[..good.len() - 1].to_vec())),
            Err(WireError::Length { .. })
        ));
    }
}

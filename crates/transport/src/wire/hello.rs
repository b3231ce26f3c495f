//! Handshake messages: three fixed 92-byte messages before any frame.
//!
//! ```text
//! offset size field
//!      0    4 magic                    "ASHT" (0x54485341 as a little-endian u32)
//!      4    2 version                  2
//!      6    1 kind                     1 client hello, 2 server hello, 3 client proof
//!      7    1 lane                     client hello: 0 none, else the caller's lane + 1;
//!                                      server hello, proof: must be 0
//!      8    8 node_id                  the sender's node id
//!     16    4 max_frame_payload_bytes  hellos: the sender's frame limit; proof: 0
//!     20    4 max_in_flight_requests   hellos: the sender's in-flight limit; proof: 0
//!     24   32 nonce                    hellos: fresh random bytes; proof: 0
//!     56   32 mac                      client hello: 0; server hello, proof: HMAC-SHA256
//!     88    4 crc32c                   CRC32C of bytes 0..88
//! ```

use super::frame::FRAME_PAYLOAD_BYTES_MAX;
use super::PROTOCOL_VERSION;
use crate::error::ProtocolError;
use crate::ids::NodeId;

pub const HELLO_BYTES: usize = 92;
/// "ASHT" read as a little-endian u32.
pub const HELLO_MAGIC: u32 = u32::from_le_bytes(*b"ASHT");
pub const NONCE_BYTES: usize = 32;
pub const MAC_BYTES: usize = 32;
/// The part of a hello a MAC covers: everything before the MAC itself.
pub const HELLO_SIGNED_BYTES: usize = 56;

pub type Nonce = [u8; NONCE_BYTES];
pub type Mac = [u8; MAC_BYTES];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum HelloKind {
    ClientHello = 1,
    ServerHello = 2,
    ClientProof = 3,
}

impl HelloKind {
    fn from_u8(byte: u8) -> Result<HelloKind, ProtocolError> {
        Ok(match byte {
            1 => HelloKind::ClientHello,
            2 => HelloKind::ServerHello,
            3 => HelloKind::ClientProof,
            other => return Err(ProtocolError::UnknownHelloKind(other)),
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            HelloKind::ClientHello => "client hello",
            HelloKind::ServerHello => "server hello",
            HelloKind::ClientProof => "client proof",
        }
    }
}

/// One handshake message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    pub kind: HelloKind,
    pub node_id: NodeId,
    pub max_frame_payload_bytes: u32,
    pub max_in_flight_requests: u32,
    pub nonce: Nonce,
    pub mac: Mac,
    /// Client hello only: which of the caller's lanes (its reactor) the connection serves,
    /// so the server can serve it on the matching one of its own. 0: none.
    pub lane: u8,
}

impl Hello {
    pub fn encode(&self) -> [u8; HELLO_BYTES] {
        let mut out = [0u8; HELLO_BYTES];
        out[0..4].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
        out[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        out[6] = self.kind as u8;
        out[7] = self.lane;
        out[8..16].copy_from_slice(&self.node_id.0.to_le_bytes());
        out[16..20].copy_from_slice(&self.max_frame_payload_bytes.to_le_bytes());
        out[20..24].copy_from_slice(&self.max_in_flight_requests.to_le_bytes());
        out[24..56].copy_from_slice(&self.nonce);
        out[56..88].copy_from_slice(&self.mac);
        let crc = crc32c::crc32c(&out[..88]);
        out[88..92].copy_from_slice(&crc.to_le_bytes());
        out
    }

    /// Checks, in this order: magic (is this Ashlar at all), version (so a newer peer is told
    /// apart from a corrupt one), checksum, kind, the lane (0 but in a client hello), and
    /// the limits' ranges.
    pub fn decode(bytes: &[u8; HELLO_BYTES]) -> Result<Hello, ProtocolError> {
        let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
        let magic = u32_at(0);
        if magic != HELLO_MAGIC {
            return Err(ProtocolError::BadMagic { got: magic });
        }
        let version = u16::from_le_bytes([bytes[4], bytes[5]]);
        if version != PROTOCOL_VERSION {
            return Err(ProtocolError::UnsupportedVersion { got: version });
        }
        let stored = u32_at(88);
        let computed = crc32c::crc32c(&bytes[..88]);
        if stored != computed {
            return Err(ProtocolError::HelloChecksum { stored, computed });
        }
        let kind = HelloKind::from_u8(bytes[6])?;
        if bytes[7] != 0 && kind != HelloKind::ClientHello {
            return Err(ProtocolError::NonZeroReserved(u64::from(bytes[7])));
        }
        let hello = Hello {
            kind,
            node_id: NodeId(u64::from_le_bytes(
                bytes[8..16].try_into().expect("8 bytes"),
            )),
            max_frame_payload_bytes: u32_at(16),
            max_in_flight_requests: u32_at(20),
            nonce: bytes[24..56].try_into().expect("32 bytes"),
            mac: bytes[56..88].try_into().expect("32 bytes"),
            lane: bytes[7],
        };
        if kind != HelloKind::ClientProof {
            check_range(
                "max_frame_payload_bytes",
                hello.max_frame_payload_bytes,
                FRAME_PAYLOAD_BYTES_MAX,
            )?;
            check_range(
                "max_in_flight_requests",
                hello.max_in_flight_requests,
                u32::MAX,
            )?;
        }
        Ok(hello)
    }

    /// The bytes a MAC covers.
    pub fn signed_part(&self) -> [u8; HELLO_SIGNED_BYTES] {
        self.encode()[..HELLO_SIGNED_BYTES]
            .try_into()
            .expect("56 bytes")
    }
}

#[cfg(test)]
impl Hello {
    /// A client hello from `node` with small limits and a fixed nonce, for tests that
    /// script a peer by hand.
    pub(crate) fn for_test(node: u64) -> Hello {
        Hello {
            kind: HelloKind::ClientHello,
            node_id: NodeId(node),
            max_frame_payload_bytes: 1024,
            max_in_flight_requests: 8,
            nonce: [1; NONCE_BYTES],
            mac: [0; MAC_BYTES],
            lane: 0,
        }
    }
}

fn check_range(field: &'static str, got: u32, max: u32) -> Result<(), ProtocolError> {
    if (1..=max).contains(&got) {
        Ok(())
    } else {
        Err(ProtocolError::HelloFieldOutOfRange {
            field,
            got: got.into(),
            min: 1,
            max: max.into(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample(kind: HelloKind) -> Hello {
        Hello {
            kind,
            node_id: NodeId(0xAB),
            max_frame_payload_bytes: 1 << 20,
            max_in_flight_requests: 64,
            nonce: [7; NONCE_BYTES],
            mac: [9; MAC_BYTES],
            lane: 0,
        }
    }

    fn resealed(mut bytes: [u8; HELLO_BYTES]) -> [u8; HELLO_BYTES] {
        let crc = crc32c::crc32c(&bytes[..88]);
        bytes[88..92].copy_from_slice(&crc.to_le_bytes());
        bytes
    }

    #[test]
    fn layout_is_as_documented_and_round_trips() {
        let hello = sample(HelloKind::ServerHello);
        let bytes = hello.encode();
        assert_eq!(&bytes[0..4], b"ASHT");
        assert_eq!(&bytes[4..6], &[2, 0]);
        assert_eq!(bytes[6], 2);
        assert_eq!(&bytes[8..16], &0xABu64.to_le_bytes());
        assert_eq!(&bytes[24..56], &[7; 32]);
        assert_eq!(&bytes[56..88], &[9; 32]);
        assert_eq!(Hello::decode(&bytes), Ok(hello));
        assert_eq!(hello.signed_part(), bytes[..56]);
    }

    #[test]
    fn bad_magic_version_checksum_kind_and_limits_are_refused() {
        let good = sample(HelloKind::ClientHello).encode();
        let mut magic = good;
        magic[0] = b'X';
        assert!(matches!(
            Hello::decode(&magic),
            Err(ProtocolError::BadMagic { .. })
        ));
        let mut version = good;
        version[4] = 1;
        assert_eq!(
            Hello::decode(&version),
            Err(ProtocolError::UnsupportedVersion { got: 1 })
        );
        let message = ProtocolError::UnsupportedVersion { got: 1 }.to_string();
        assert!(
            message.contains("version 1 (this node speaks 2)"),
            "{message}"
        );
        let mut flipped = good;
        flipped[30] ^= 1;
        assert!(matches!(
            Hello::decode(&flipped),
            Err(ProtocolError::HelloChecksum { .. })
        ));
        let mut kind = good;
        kind[6] = 4;
        assert_eq!(
            Hello::decode(&resealed(kind)),
            Err(ProtocolError::UnknownHelloKind(4))
        );
        let mut lane_in_a_server_hello = sample(HelloKind::ServerHello).encode();
        lane_in_a_server_hello[7] = 3;
        assert_eq!(
            Hello::decode(&resealed(lane_in_a_server_hello)),
            Err(ProtocolError::NonZeroReserved(3))
        );
        let mut lane = good;
        lane[7] = 3;
        assert_eq!(Hello::decode(&resealed(lane)).map(|h| h.lane), Ok(3));
        let mut zero_limit = good;
        zero_limit[20..24].copy_from_slice(&0u32.to_le_bytes());
        assert!(matches!(
            Hello::decode(&resealed(zero_limit)),
            Err(ProtocolError::HelloFieldOutOfRange {
                field: "max_in_flight_requests",
                ..
            })
        ));
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::array::uniform32(any::<u8>()), tail in proptest::collection::vec(any::<u8>(), 60)) {
            let mut message = [0u8; HELLO_BYTES];
            message[..32].copy_from_slice(&bytes);
            message[32..].copy_from_slice(&tail);
            let _ = Hello::decode(&message);
            message[0..4].copy_from_slice(b"ASHT");
            message[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
            let _ = Hello::decode(&resealed(message));
        }
    }
}

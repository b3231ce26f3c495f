//! The iSCSI PDU codec (RFC 7143 section 11): the 48-byte Basic Header Segment, additional
//! header segments, the data segment padded to 4 bytes, and the optional CRC32C header and
//! data digests. Pure functions over byte slices: the connection reads a BHS, asks
//! [`frame_layout`] how much follows, reads that, and hands it to [`decode_rest`].

use bytes::{BufMut, Bytes, BytesMut};
use thiserror::Error;

/// Size of the Basic Header Segment.
pub const BHS_LEN: usize = 48;
/// Size of one CRC32C digest on the wire.
pub const DIGEST_LEN: usize = 4;
/// The reserved "no task" tag (ITT and TTT).
pub const NO_TAG: u32 = 0xffff_ffff;

/// Opcodes sent by an initiator.
pub mod op {
    pub const NOP_OUT: u8 = 0x00;
    pub const SCSI_COMMAND: u8 = 0x01;
    pub const TASK_MANAGEMENT: u8 = 0x02;
    pub const LOGIN: u8 = 0x03;
    pub const TEXT: u8 = 0x04;
    pub const DATA_OUT: u8 = 0x05;
    pub const LOGOUT: u8 = 0x06;
    pub const SNACK: u8 = 0x10;
    // Sent by the target.
    pub const NOP_IN: u8 = 0x20;
    pub const SCSI_RESPONSE: u8 = 0x21;
    pub const TASK_MANAGEMENT_RESPONSE: u8 = 0x22;
    pub const LOGIN_RESPONSE: u8 = 0x23;
    pub const TEXT_RESPONSE: u8 = 0x24;
    pub const DATA_IN: u8 = 0x25;
    pub const LOGOUT_RESPONSE: u8 = 0x26;
    pub const R2T: u8 = 0x31;
    pub const ASYNC_MESSAGE: u8 = 0x32;
    pub const REJECT: u8 = 0x3f;
}

/// AsyncEvent codes of an Asynchronous Message (RFC 7143 11.9.1).
pub mod async_event {
    /// A SCSI asynchronous event: sense data in the data segment.
    pub const SCSI_EVENT: u8 = 0;
    /// The target asks the initiator to log out within Parameter3 seconds.
    pub const REQUEST_LOGOUT: u8 = 1;
    /// The target will drop the connection whose CID is Parameter1; Parameter2 is
    /// Time2Wait, Parameter3 Time2Retain.
    pub const DROPPING_CONNECTION: u8 = 2;
    /// The target will drop every connection of the session (Time2Wait, Time2Retain).
    pub const DROPPING_ALL_CONNECTIONS: u8 = 3;
}

/// Reject reasons (RFC 7143 11.17.1).
pub mod reject {
    pub const DATA_DIGEST_ERROR: u8 = 0x02;
    pub const PROTOCOL_ERROR: u8 = 0x04;
    pub const COMMAND_NOT_SUPPORTED: u8 = 0x05;
    pub const IMMEDIATE_COMMAND_REJECT: u8 = 0x06;
    pub const TASK_IN_PROGRESS: u8 = 0x07;
    pub const INVALID_PDU_FIELD: u8 = 0x09;
}

/// Which digests a connection negotiated (both off during login).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Digests {
    pub header: bool,
    pub data: bool,
}

/// Why a byte sequence is not an acceptable PDU. Every variant ends the connection (error
/// recovery level 0: the initiator recovers by logging in again).
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum PduError {
    #[error("header digest mismatch (sent {sent:#010x}, computed {computed:#010x})")]
    HeaderDigest { sent: u32, computed: u32 },
    #[error("data digest mismatch (sent {sent:#010x}, computed {computed:#010x})")]
    DataDigest { sent: u32, computed: u32 },
    #[error("data segment of {length} bytes exceeds the {limit}-byte limit")]
    DataTooLong { length: u32, limit: u32 },
    #[error("{0} bytes of additional header segments are more than the protocol allows")]
    AhsTooLong(usize),
    #[error("PDU truncated: {0}")]
    Truncated(&'static str),
}

/// A 48-byte Basic Header Segment with typed accessors. Multi-byte fields are big endian.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Bhs(pub [u8; BHS_LEN]);

impl std::fmt::Debug for Bhs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bhs")
            .field("opcode", &format_args!("{:#04x}", self.opcode()))
            .field("flags", &format_args!("{:#04x}", self.flags()))
            .field("itt", &format_args!("{:#010x}", self.itt()))
            .field("data_len", &self.data_segment_length())
            .finish()
    }
}

impl Bhs {
    pub fn new(opcode: u8) -> Self {
        let mut bytes = [0u8; BHS_LEN];
        bytes[0] = opcode & 0x3f;
        Bhs(bytes)
    }
    pub fn opcode(&self) -> u8 {
        self.0[0] & 0x3f
    }
    /// The I bit: an immediate command (does not advance CmdSN).
    pub fn immediate(&self) -> bool {
        self.0[0] & 0x40 != 0
    }
    pub fn flags(&self) -> u8 {
        self.0[1]
    }
    pub fn set_flags(&mut self, flags: u8) {
        self.0[1] = flags;
    }
    /// The F (final) bit, bit 7 of byte 1.
    pub fn final_bit(&self) -> bool {
        self.0[1] & 0x80 != 0
    }
    pub fn total_ahs_bytes(&self) -> usize {
        usize::from(self.0[4]) * 4
    }
    pub fn data_segment_length(&self) -> u32 {
        u32::from_be_bytes([0, self.0[5], self.0[6], self.0[7]])
    }
    pub fn set_data_segment_length(&mut self, length: u32) {
        debug_assert!(length < 1 << 24);
        let b = length.to_be_bytes();
        self.0[5..8].copy_from_slice(&b[1..4]);
    }
    pub fn lun_field(&self) -> [u8; 8] {
        let mut lun = [0u8; 8];
        lun.copy_from_slice(&self.0[8..16]);
        lun
    }
    pub fn set_lun_field(&mut self, lun: [u8; 8]) {
        self.0[8..16].copy_from_slice(&lun);
    }
    pub fn itt(&self) -> u32 {
        self.u32_at(16)
    }
    pub fn set_itt(&mut self, itt: u32) {
        self.set_u32_at(16, itt);
    }
    pub fn u32_at(&self, offset: usize) -> u32 {
        u32::from_be_bytes([
            self.0[offset],
            self.0[offset + 1],
            self.0[offset + 2],
            self.0[offset + 3],
        ])
    }
    pub fn set_u32_at(&mut self, offset: usize, value: u32) {
        self.0[offset..offset + 4].copy_from_slice(&value.to_be_bytes());
    }
    pub fn u16_at(&self, offset: usize) -> u16 {
        u16::from_be_bytes([self.0[offset], self.0[offset + 1]])
    }
    pub fn set_u16_at(&mut self, offset: usize, value: u16) {
        self.0[offset..offset + 2].copy_from_slice(&value.to_be_bytes());
    }
}

/// A decoded PDU: its header, additional header segments and unpadded data segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pdu {
    pub bhs: Bhs,
    pub ahs: Bytes,
    pub data: Bytes,
}

impl Pdu {
    pub fn new(bhs: Bhs, data: Bytes) -> Self {
        Pdu {
            bhs,
            ahs: Bytes::new(),
            data,
        }
    }
}

/// An Asynchronous Message (RFC 7143 11.9) telling the initiator that the target will drop
/// connection `cid` (AsyncEvent 2): Parameter1 the CID, Parameter2 `time2wait` (seconds
/// before the initiator may log in again; 0: at once), Parameter3 `time2retain` (seconds the
/// target keeps the connection's tasks for reassignment; 0: none). F set, no LUN (not a SCSI
/// event), ITT reserved, no data segment. StatSN, ExpCmdSN and MaxCmdSN are stamped by the
/// connection's writer, as in every PDU the target sends.
pub fn dropping_connection(cid: u16, time2wait: u16, time2retain: u16) -> Pdu {
    let mut bhs = Bhs::new(op::ASYNC_MESSAGE);
    bhs.set_flags(0x80);
    bhs.set_itt(NO_TAG);
    bhs.0[36] = async_event::DROPPING_CONNECTION;
    bhs.set_u16_at(38, cid);
    bhs.set_u16_at(40, time2wait);
    bhs.set_u16_at(42, time2retain);
    Pdu::new(bhs, Bytes::new())
}

/// Where the parts of a PDU lie after its 48-byte BHS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameLayout {
    pub ahs_bytes: usize,
    pub header_digest: bool,
    pub data_bytes: usize,
    pub padding: usize,
    pub data_digest: bool,
}

impl FrameLayout {
    /// Bytes that follow the BHS.
    pub fn rest_len(&self) -> usize {
        self.ahs_bytes
            + if self.header_digest { DIGEST_LEN } else { 0 }
            + self.data_bytes
            + self.padding
            + if self.data_digest && self.data_bytes > 0 {
                DIGEST_LEN
            } else {
                0
            }
    }
}

fn padding(length: usize) -> usize {
    (4 - length % 4) % 4
}

/// How many bytes follow `bhs`, refusing a data segment over `max_data` bytes (our
/// MaxRecvDataSegmentLength, or the login limit) before any of it is read.
pub fn frame_layout(bhs: &Bhs, digests: Digests, max_data: u32) -> Result<FrameLayout, PduError> {
    let length = bhs.data_segment_length();
    if length > max_data {
        return Err(PduError::DataTooLong {
            length,
            limit: max_data,
        });
    }
    let data_bytes = length as usize;
    Ok(FrameLayout {
        ahs_bytes: bhs.total_ahs_bytes(),
        header_digest: digests.header,
        data_bytes,
        padding: padding(data_bytes),
        data_digest: digests.data,
    })
}

/// Checks the header digest `sent` (as it came on the wire) against the BHS and AHS.
pub fn check_header_digest(bhs: &Bhs, ahs: &[u8], sent: &[u8]) -> Result<(), PduError> {
    let sent = u32::from_le_bytes(sent.try_into().expect("4 bytes"));
    let computed = crc32c::crc32c_append(crc32c::crc32c(&bhs.0), ahs);
    if sent != computed {
        return Err(PduError::HeaderDigest { sent, computed });
    }
    Ok(())
}

/// Checks the data digest `sent` (as it came on the wire) against the data segment and its
/// padding.
pub fn check_data_digest(data: &[u8], padding: &[u8], sent: &[u8]) -> Result<(), PduError> {
    let sent = u32::from_le_bytes(sent.try_into().expect("4 bytes"));
    let computed = crc32c::crc32c_append(crc32c::crc32c(data), padding);
    if sent != computed {
        return Err(PduError::DataDigest { sent, computed });
    }
    Ok(())
}

/// Decodes what follows a BHS (exactly `layout.rest_len()` bytes), checking the digests.
pub fn decode_rest(bhs: Bhs, layout: FrameLayout, rest: Bytes) -> Result<Pdu, PduError> {
    if rest.len() != layout.rest_len() {
        return Err(PduError::Truncated("PDU body"));
    }
    let ahs = rest.slice(..layout.ahs_bytes);
    let mut at = layout.ahs_bytes;
    if layout.header_digest {
        check_header_digest(&bhs, &ahs, &rest[at..at + DIGEST_LEN])?;
        at += DIGEST_LEN;
    }
    let data = rest.slice(at..at + layout.data_bytes);
    at += layout.data_bytes;
    let padding = &rest[at..at + layout.padding];
    at += layout.padding;
    if layout.data_digest && layout.data_bytes > 0 {
        check_data_digest(&data, padding, &rest[at..at + DIGEST_LEN])?;
    }
    Ok(Pdu { bhs, ahs, data })
}

/// Decodes one whole PDU from the front of `bytes`: `Ok(None)` when more bytes are needed.
/// Used by tests and the fuzz harness; the connection reads the parts itself.
pub fn decode(
    bytes: &[u8],
    digests: Digests,
    max_data: u32,
) -> Result<Option<(Pdu, usize)>, PduError> {
    if bytes.len() < BHS_LEN {
        return Ok(None);
    }
    let bhs = Bhs(bytes[..BHS_LEN].try_into().expect("48 bytes"));
    let layout = frame_layout(&bhs, digests, max_data)?;
    let total = BHS_LEN + layout.rest_len();
    if bytes.len() < total {
        return Ok(None);
    }
    let rest = Bytes::copy_from_slice(&bytes[BHS_LEN..total]);
    decode_rest(bhs, layout, rest).map(|pdu| Some((pdu, total)))
}

/// Encodes a PDU (the BHS's AHS and data lengths are set from `pdu`).
pub fn encode(pdu: &Pdu, digests: Digests) -> Bytes {
    let mut out = BytesMut::with_capacity(encoded_len(pdu, digests));
    encode_into(pdu, digests, &mut out);
    out.freeze()
}

/// Bytes [`encode`] produces for `pdu`.
pub fn encoded_len(pdu: &Pdu, digests: Digests) -> usize {
    let digest = |on: bool| if on { DIGEST_LEN } else { 0 };
    let data = if pdu.data.is_empty() {
        0
    } else {
        pdu.data.len() + padding(pdu.data.len()) + digest(digests.data)
    };
    BHS_LEN + pdu.ahs.len() + digest(digests.header) + data
}

/// Appends `pdu` as [`encode`] frames it to `out` (a connection's write buffer: the data is
/// copied once, straight into it).
pub fn encode_into(pdu: &Pdu, digests: Digests, out: &mut BytesMut) {
    out.reserve(encoded_len(pdu, digests));
    encode_head_into(pdu, digests, out);
    if !pdu.data.is_empty() {
        out.put_slice(&pdu.data);
        out.put_slice(encode_tail(pdu, digests).as_slice());
    }
}

/// Appends what goes before `pdu`'s data segment: the BHS (with its lengths), the AHS and
/// the header digest.
pub fn encode_head_into(pdu: &Pdu, digests: Digests, out: &mut BytesMut) {
    let mut bhs = pdu.bhs;
    debug_assert!(pdu.ahs.len().is_multiple_of(4) && pdu.ahs.len() <= 255 * 4);
    bhs.0[4] = (pdu.ahs.len() / 4) as u8;
    bhs.set_data_segment_length(pdu.data.len() as u32);
    out.put_slice(&bhs.0);
    out.put_slice(&pdu.ahs);
    if digests.header {
        let crc = crc32c::crc32c_append(crc32c::crc32c(&bhs.0), &pdu.ahs);
        out.put_u32_le(crc);
    }
}

/// What follows a data segment: its padding and data digest (nothing without data).
#[derive(Debug, Clone, Copy, Default)]
pub struct Tail {
    bytes: [u8; 3 + DIGEST_LEN],
    len: usize,
}

impl Tail {
    pub fn as_slice(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

/// The padding and data digest that follow `pdu`'s data segment.
pub fn encode_tail(pdu: &Pdu, digests: Digests) -> Tail {
    let mut tail = Tail::default();
    if pdu.data.is_empty() {
        return tail;
    }
    let pad = padding(pdu.data.len());
    // The padding bytes are the zeros `bytes` starts with.
    tail.len = pad;
    if digests.data {
        let crc = crc32c::crc32c_append(crc32c::crc32c(&pdu.data), &[0u8; 3][..pad]);
        tail.bytes[pad..pad + DIGEST_LEN].copy_from_slice(&crc.to_le_bytes());
        tail.len += DIGEST_LEN;
    }
    tail
}

/// Serial number arithmetic (RFC 1982) on 32-bit sequence numbers: `a < b`.
pub fn sn_lt(a: u32, b: u32) -> bool {
    a != b && (b.wrapping_sub(a) as i32) > 0
}

/// `a <= b` in serial number arithmetic.
pub fn sn_le(a: u32, b: u32) -> bool {
    a == b || sn_lt(a, b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_dropping_connection_async_message_is_laid_out_as_rfc_7143_says() {
        let pdu = dropping_connection(0x0102, 0, 20);
        let bytes = encode(&pdu, Digests::default());
        let mut expected = [0u8; BHS_LEN];
        expected[0] = 0x32; // opcode, I bit clear
        expected[1] = 0x80; // F
        expected[16..20].copy_from_slice(&[0xff; 4]); // ITT reserved
        expected[36] = 2; // AsyncEvent: target will drop the connection
        expected[38..40].copy_from_slice(&[0x01, 0x02]); // Parameter1: CID
        expected[40..42].copy_from_slice(&[0, 0]); // Parameter2: Time2Wait
        expected[42..44].copy_from_slice(&[0, 20]); // Parameter3: Time2Retain
        assert_eq!(&bytes[..], &expected[..], "48 bytes, no data segment");
        let (decoded, used) = decode(&bytes, Digests::default(), 0).unwrap().unwrap();
        assert_eq!((decoded, used), (pdu, BHS_LEN));
    }

    fn sample(data: &[u8]) -> Pdu {
        let mut bhs = Bhs::new(op::NOP_OUT);
        bhs.0[0] |= 0x40;
        bhs.set_flags(0x80);
        bhs.set_itt(0x1234_5678);
        Pdu::new(bhs, Bytes::copy_from_slice(data))
    }

    #[test]
    fn crc32c_matches_rfc_example() {
        // RFC 7143 B.4: 32 bytes of zeros.
        assert_eq!(crc32c::crc32c(&[0u8; 32]), 0x8a91_36aa);
    }

    #[test]
    fn round_trip_with_and_without_digests() {
        for digests in [
            Digests::default(),
            Digests {
                header: true,
                data: true,
            },
        ] {
            for len in [0usize, 1, 3, 4, 5, 4096] {
                let pdu = sample(&vec![0xa5; len]);
                let wire = encode(&pdu, digests);
                assert_eq!(wire.len() % 4, 0);
                let (back, used) = decode(&wire, digests, 1 << 20).unwrap().unwrap();
                assert_eq!(used, wire.len());
                assert_eq!(back.data, pdu.data);
                assert_eq!(back.bhs.itt(), 0x1234_5678);
                assert_eq!(back.bhs.data_segment_length() as usize, len);
                assert!(decode(&wire[..wire.len() - 1], digests, 1 << 20)
                    .unwrap()
                    .is_none());
            }
        }
    }

    #[test]
    fn digest_errors_are_detected() {
        let digests = Digests {
            header: true,
            data: true,
        };
        let wire = encode(&sample(b"hello"), digests).to_vec();
        let mut bad_header = wire.clone();
        bad_header[20] ^= 1;
        assert!(matches!(
            decode(&bad_header, digests, 1024),
            Err(PduError::HeaderDigest { .. })
        ));
        let mut bad_data = wire.clone();
        bad_data[BHS_LEN + 4] ^= 1;
        assert!(matches!(
            decode(&bad_data, digests, 1024),
            Err(PduError::DataDigest { .. })
        ));
    }

    #[test]
    fn oversized_data_is_refused_before_reading() {
        let mut bhs = Bhs::new(op::SCSI_COMMAND);
        bhs.set_data_segment_length(0x00ff_ffff);
        assert!(matches!(
            frame_layout(&bhs, Digests::default(), 8192),
            Err(PduError::DataTooLong { .. })
        ));
    }

    #[test]
    fn serial_numbers_wrap() {
        assert!(sn_lt(1, 2));
        assert!(sn_lt(u32::MAX, 0));
        assert!(!sn_lt(0, u32::MAX));
        assert!(sn_le(5, 5));
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..600),
                                    header in any::<bool>(), data in any::<bool>()) {
            let _ = decode(&bytes, Digests { header, data }, 512);
        }

        #[test]
        fn any_payload_round_trips(payload in proptest::collection::vec(any::<u8>(), 0..300)) {
            let digests = Digests { header: true, data: true };
            let pdu = sample(&payload);
            let (back, _) = decode(&encode(&pdu, digests), digests, 1024).unwrap().unwrap();
            prop_assert_eq!(back.data, pdu.data);
        }
    }
}

use super::*;
use proptest::prelude::*;

const MAX: u32 = 1 << 20;

fn encoded(frame: &Frame) -> BytesMut {
    let mut buf = BytesMut::new();
    encode_frame(frame, &mut buf);
    buf
}

fn request(id: u64, payload: &'static [u8]) -> Frame {
    Frame::new(
        FrameKind::Request,
        RequestId(id),
        Bytes::from_static(payload),
    )
}

/// Rewrites the header CRC after a test changed header bytes, so the field under test is
/// what the decoder refuses rather than the checksum.
fn reseal(buf: &mut BytesMut) {
    let crc = crc32c::crc32c(&buf[..20]);
    buf[20..24].copy_from_slice(&crc.to_le_bytes());
}

#[test]
fn header_layout_is_as_documented() {
    let buf = encoded(&request(0x0102_0304_0506_0708, b"abc"));
    assert_eq!(buf.len(), FRAME_HEADER_BYTES + 3);
    assert_eq!(buf[0], 1);
    assert_eq!(&buf[1..4], &[0, 0, 0]);
    assert_eq!(&buf[4..8], &3u32.to_le_bytes());
    assert_eq!(&buf[8..16], &0x0102_0304_0506_0708u64.to_le_bytes());
    assert_eq!(&buf[16..20], &crc32c::crc32c(b"abc").to_le_bytes());
    assert_eq!(&buf[20..24], &crc32c::crc32c(&buf[..20]).to_le_bytes());
    assert_eq!(&buf[24..], b"abc");
}

#[test]
fn partial_input_waits_and_consumes_nothing() {
    let whole = encoded(&request(7, b"hello"));
    for cut in 0..whole.len() {
        let mut part = BytesMut::from(&whole[..cut]);
        assert_eq!(decode_frame(&mut part, MAX), Ok(None), "cut at {cut}");
        assert_eq!(part.len(), cut);
    }
}

#[test]
fn two_frames_back_to_back_decode_in_order() {
    let mut buf = encoded(&request(1, b"one"));
    encode_frame(
        &Frame::new(FrameKind::Pong, RequestId(9), Bytes::new()),
        &mut buf,
    );
    assert_eq!(
        decode_frame(&mut buf, MAX).unwrap().unwrap(),
        request(1, b"one")
    );
    let pong = decode_frame(&mut buf, MAX).unwrap().unwrap();
    assert_eq!(
        (pong.kind, pong.request_id),
        (FrameKind::Pong, RequestId(9))
    );
    assert!(buf.is_empty());
}

#[test]
fn flipped_payload_bit_is_a_payload_checksum_error() {
    let mut buf = encoded(&request(5, b"payload"));
    buf[FRAME_HEADER_BYTES + 2] ^= 0x10;
    let error = decode_frame(&mut buf, MAX).unwrap_err();
    assert!(
        matches!(
            error,
            ProtocolError::PayloadChecksum {
                request_id: RequestId(5),
                ..
            }
        ),
        "{error:?}"
    );
}

#[test]
fn flipped_header_bit_is_a_header_checksum_error() {
    let mut buf = encoded(&request(5, b"payload"));
    buf[9] ^= 0x01;
    assert!(matches!(
        decode_frame(&mut buf, MAX),
        Err(ProtocolError::HeaderChecksum { .. })
    ));
}

#[test]
fn oversize_length_is_refused_before_the_payload_arrives() {
    let mut buf = encoded(&request(5, b"x"));
    buf[4..8].copy_from_slice(&(MAX + 1).to_le_bytes());
    reseal(&mut buf);
    buf.truncate(FRAME_HEADER_BYTES);
    assert_eq!(
        decode_frame(&mut buf, MAX),
        Err(ProtocolError::FrameTooLarge {
            len: MAX + 1,
            max: MAX
        })
    );
}

#[test]
fn unknown_kind_flags_and_reserved_are_refused() {
    let cases: [(usize, u8, ProtocolError); 3] = [
        (0, 99, ProtocolError::UnknownFrameKind(99)),
        (1, 0x80, ProtocolError::UnknownFlags(0x80)),
        (3, 1, ProtocolError::NonZeroReserved(0x100)),
    ];
    for (at, value, expected) in cases {
        let mut buf = encoded(&request(5, b""));
        buf[at] = value;
        reseal(&mut buf);
        assert_eq!(decode_frame(&mut buf, MAX), Err(expected));
    }
}

#[test]
fn request_id_zero_and_ping_payload_are_refused() {
    let mut zero = encoded(&request(5, b""));
    zero[8..16].copy_from_slice(&0u64.to_le_bytes());
    reseal(&mut zero);
    assert_eq!(
        decode_frame(&mut zero, MAX),
        Err(ProtocolError::ZeroRequestId { kind: "request" })
    );

    let mut ping = encoded(&request(5, b"xy"));
    ping[0] = FrameKind::Ping as u8;
    reseal(&mut ping);
    assert_eq!(
        decode_frame(&mut ping, MAX),
        Err(ProtocolError::NonEmptyPayload {
            kind: "ping",
            len: 2
        })
    );
}

#[test]
fn error_payload_round_trips_and_short_one_is_refused() {
    let error = RemoteError::new(42, "no such vdisk");
    let frame = Frame::error(RequestId(3), &error);
    let mut buf = encoded(&frame);
    let decoded = decode_frame(&mut buf, MAX).unwrap().unwrap();
    assert_eq!(decoded.kind, FrameKind::Error);
    assert_eq!(decode_error_payload(&decoded.payload), Ok(error));
    assert_eq!(
        decode_error_payload(b"abc"),
        Err(ProtocolError::ShortErrorPayload { len: 3 })
    );
}

fn frame_strategy() -> impl Strategy<Value = Frame> {
    let kind = prop_oneof![
        Just(FrameKind::Request),
        Just(FrameKind::Response),
        Just(FrameKind::Error),
        Just(FrameKind::Ping),
        Just(FrameKind::Pong),
    ];
    (
        kind,
        1..u64::MAX,
        proptest::collection::vec(any::<u8>(), 0..2048),
    )
        .prop_map(|(kind, id, payload)| {
            let payload = if kind.is_empty_only() {
                Vec::new()
            } else {
                payload
            };
            Frame::new(kind, RequestId(id), Bytes::from(payload))
        })
}

proptest! {
    #[test]
    fn frames_round_trip(frames in proptest::collection::vec(frame_strategy(), 1..8)) {
        let mut buf = BytesMut::new();
        for frame in &frames {
            encode_frame(frame, &mut buf);
        }
        for frame in &frames {
            let decoded = decode_frame(&mut buf, MAX).unwrap();
            prop_assert_eq!(decoded.as_ref(), Some(frame));
        }
        prop_assert!(buf.is_empty());
    }

    #[test]
    fn arbitrary_bytes_never_panic_the_decoder(bytes in proptest::collection::vec(any::<u8>(), 0..256), max in 0..MAX) {
        let mut buf = BytesMut::from(&bytes[..]);
        // Decode until an error or a need for more input; every outcome but a panic is fine,
        // and each frame returned must have consumed input.
        while let Ok(Some(_)) = decode_frame(&mut buf, max) {
            prop_assert!(buf.len() < bytes.len());
        }
        let _ = decode_error_payload(&bytes);
    }

    #[test]
    fn any_single_bit_flip_is_detected(frame in frame_strategy(), bit in any::<usize>()) {
        let mut buf = encoded(&frame);
        let bit = bit % (buf.len() * 8);
        buf[bit / 8] ^= 1 << (bit % 8);
        // A flip in the length can make the frame look incomplete; that is not a wrong frame.
        let decoded = decode_frame(&mut buf, FRAME_PAYLOAD_BYTES_MAX);
        prop_assert!(!matches!(decoded, Ok(Some(_))), "flipped bit {} went unnoticed: {:?}", bit, decoded);
    }
}

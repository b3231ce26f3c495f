//! The wire format of `docs/node-protocol.md` (version 2): pure encode and decode, no I/O.
//! Every decoder takes untrusted bytes and returns a [`crate::ProtocolError`], never panics.

pub mod frame;
pub mod hello;

/// The protocol version this code speaks. Bump it with any change to a message layout.
pub const PROTOCOL_VERSION: u16 = 2;

#[cfg(test)]
mod tests {
    use super::frame::{encode_frame, Frame, FrameKind};
    use super::hello::{Hello, HelloKind};
    use super::PROTOCOL_VERSION;
    use crate::ids::RequestId;
    use bytes::{Bytes, BytesMut};

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|byte| format!("{byte:02x}")).collect()
    }

    /// The bytes of version 2, pinned (the CRCs were checked against an independent CRC32C
    /// implementation). If this fails, the wire format changed: bump
    /// `PROTOCOL_VERSION`, document the new version in `docs/node-protocol.md`, then update
    /// the expected bytes.
    #[test]
    fn version_2_bytes_are_pinned() {
        assert_eq!(PROTOCOL_VERSION, 2);
        let mut frame = BytesMut::new();
        encode_frame(
            &Frame::new(
                FrameKind::Request,
                RequestId(0x0102),
                Bytes::from_static(b"ab"),
            ),
            &mut frame,
        );
        assert_eq!(
            hex(&frame),
            "010000000200000002010000000000003629a2e2bc82b6b86162"
        );
        let hello = Hello {
            kind: HelloKind::ServerHello,
            max_frame_payload_bytes: 4096,
            max_in_flight_requests: 16,
            nonce: [0x11; 32],
            mac: [0x22; 32],
            ..Hello::for_test(7)
        };
        let expected = [
            "4153485402000200",
            "0700000000000000",
            "0010000010000000",
            &"11".repeat(32),
            &"22".repeat(32),
            "412ab38b",
        ]
        .concat();
        assert_eq!(hex(&hello.encode()), expected);
    }
}

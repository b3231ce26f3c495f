//! Every bound of a connection, in one place.

use crate::wire::frame::FRAME_PAYLOAD_BYTES_MAX;
use std::time::Duration;

/// Limits of one node's connections. Both sides announce their `max_frame_payload_bytes` and
/// `max_in_flight_requests` in the handshake and each side uses the smaller of the two, so a
/// well-behaved peer is never refused for size and never has more requests outstanding than
/// the server will run at once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransportLimits {
    /// Largest payload of one frame this node accepts (and sends). A frame announcing more is
    /// a protocol error that closes the connection; a call with a larger payload fails with
    /// `PayloadTooLarge` before anything is sent. Default 16 MiB; at most
    /// [`FRAME_PAYLOAD_BYTES_MAX`].
    pub max_frame_payload_bytes: u32,
    /// Requests sent and not yet answered on one connection (client), and handlers running at
    /// once for one connection (server). A caller beyond the limit waits for a slot; a server
    /// at the limit stops reading (TCP backpressure). Default 128.
    pub max_in_flight_requests: u32,
    /// Frames queued for the connection's writer. A full queue makes the sender (a caller,
    /// or a finished handler) wait. Default 256.
    pub send_queue_frames: u32,
    /// Timeout of [`crate::Connection::call_default`]. Default 5 s.
    pub request_timeout_ms: u64,
    /// Time from TCP connect until both sides are authenticated; a peer that takes longer is
    /// dropped. Default 5 s.
    pub handshake_timeout_ms: u64,
    /// A client that has received nothing for this long sends a ping. Default 1 s.
    pub ping_interval_ms: u64,
    /// A connection that has received nothing for this long (no response, no pong, no
    /// request), or whose writes have made no progress for this long, is closed and its
    /// pending calls fail. At least twice `ping_interval_ms`. Default 5 s.
    pub idle_timeout_ms: u64,
    /// Incoming connections a server holds at once, handshaking or served. At the limit it
    /// stops accepting; further connects wait in the kernel's backlog. Default 1024.
    pub max_incoming_connections: u32,
}

impl Default for TransportLimits {
    fn default() -> Self {
        Self {
            max_frame_payload_bytes: 16 << 20,
            max_in_flight_requests: 128,
            send_queue_frames: 256,
            request_timeout_ms: 5_000,
            handshake_timeout_ms: 5_000,
            ping_interval_ms: 1_000,
            idle_timeout_ms: 5_000,
            max_incoming_connections: 1024,
        }
    }
}

/// Keeps semaphores and channels far from their implementation maxima.
const IN_FLIGHT_REQUESTS_CAP: u32 = 1 << 16;

impl TransportLimits {
    /// Panics on a configuration no connection could run with: a programmer or operator
    /// error caught when the transport is built, not later on the data path.
    pub fn assert_valid(&self) {
        assert!(
            self.max_frame_payload_bytes > 0
                && self.max_frame_payload_bytes <= FRAME_PAYLOAD_BYTES_MAX,
            "max_frame_payload_bytes {} not in 1..={FRAME_PAYLOAD_BYTES_MAX}",
            self.max_frame_payload_bytes
        );
        assert!(
            (1..=IN_FLIGHT_REQUESTS_CAP).contains(&self.max_in_flight_requests),
            "max_in_flight_requests {} not in 1..={IN_FLIGHT_REQUESTS_CAP}",
            self.max_in_flight_requests
        );
        assert!(
            self.max_incoming_connections > 0,
            "max_incoming_connections is 0"
        );
        assert!(self.send_queue_frames > 0, "send_queue_frames is 0");
        assert!(self.request_timeout_ms > 0, "request_timeout_ms is 0");
        assert!(self.handshake_timeout_ms > 0, "handshake_timeout_ms is 0");
        assert!(self.ping_interval_ms > 0, "ping_interval_ms is 0");
        assert!(
            self.idle_timeout_ms >= 2 * self.ping_interval_ms,
            "idle_timeout_ms {} < 2 × ping_interval_ms {}: a live idle peer would be dropped",
            self.idle_timeout_ms,
            self.ping_interval_ms
        );
    }

    pub fn request_timeout(&self) -> Duration {
        Duration::from_millis(self.request_timeout_ms)
    }

    pub fn handshake_timeout(&self) -> Duration {
        Duration::from_millis(self.handshake_timeout_ms)
    }

    pub fn ping_interval(&self) -> Duration {
        Duration::from_millis(self.ping_interval_ms)
    }

    pub fn idle_timeout(&self) -> Duration {
        Duration::from_millis(self.idle_timeout_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid() {
        TransportLimits::default().assert_valid();
    }

    #[test]
    #[should_panic(expected = "idle_timeout_ms")]
    fn idle_shorter_than_two_pings_is_refused() {
        let limits = TransportLimits {
            ping_interval_ms: 1_000,
            idle_timeout_ms: 1_500,
            ..TransportLimits::default()
        };
        limits.assert_valid();
    }
}

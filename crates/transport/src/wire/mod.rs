//! The wire format of `docs/node-protocol.md` (version 1): pure encode and decode, no I/O.
//! Every decoder takes untrusted bytes and returns a [`crate::ProtocolError`], never panics.

pub mod frame;
pub mod hello;

/// The protocol version this code speaks. Bump it with any change to a message layout.
pub const PROTOCOL_VERSION: u16 = 1;

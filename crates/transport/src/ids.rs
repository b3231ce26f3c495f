//! Identifiers carried on the wire.

use std::fmt;

/// A node of the cluster, as it names itself in the handshake. Unique within a cluster; the
/// transport does not check membership beyond the cluster secret, so callers that expect a
/// particular node compare [`crate::Connection::peer`] with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub u64);

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "node-{}", self.0)
    }
}

/// Names one request on one connection, so its response can come back in any order. The
/// client assigns them from 1 upwards; 0 is never a request id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

impl RequestId {
    /// The first id a connection uses.
    pub const FIRST: RequestId = RequestId(1);

    #[must_use]
    pub fn next(self) -> RequestId {
        RequestId(
            self.0
                .checked_add(1)
                .expect("2^64 requests on one connection"),
        )
    }
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

//! Who a node is on the network: its id, its cluster's secret, its limits.

use crate::auth::ClusterSecret;
use crate::ids::NodeId;
use crate::limits::TransportLimits;

#[derive(Debug, Clone)]
pub struct TransportConfig {
    pub node_id: NodeId,
    pub secret: ClusterSecret,
    pub limits: TransportLimits,
}

impl TransportConfig {
    /// Panics on invalid limits (see [`TransportLimits::assert_valid`]).
    pub fn new(node_id: NodeId, secret: ClusterSecret, limits: TransportLimits) -> TransportConfig {
        limits.assert_valid();
        TransportConfig {
            node_id,
            secret,
            limits,
        }
    }
}

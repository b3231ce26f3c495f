//! Leases: grant, keep-alive (on its own connection) and revoke.

use std::time::Duration;

use super::client::{open_stream, Call, Client, RpcKind};
use super::proto::{self, path};
use crate::error::MetaError;
use crate::types::LeaseId;

/// etcd counts TTLs in whole seconds: round up, so a lease never ends
/// earlier than asked. etcd itself raises a TTL below its minimum (1.5 x the
/// election timeout, 2 s with default settings) to that minimum.
pub(crate) fn ttl_seconds(ttl: Duration) -> Result<i64, MetaError> {
    if ttl.is_zero() {
        return Err(MetaError::invalid("lease TTL must be greater than zero"));
    }
    let secs = ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0);
    i64::try_from(secs).map_err(|_| MetaError::invalid(format!("lease TTL {ttl:?} is too large")))
}

pub(crate) async fn grant(client: &Client, ttl: Duration) -> Result<LeaseId, MetaError> {
    let req = proto::LeaseGrantRequest {
        ttl: ttl_seconds(ttl)?,
        id: 0,
    };
    // Repeating a grant can at worst leave an unused lease that expires.
    let resp: proto::LeaseGrantResponse = client
        .unary(Call::read(RpcKind::LeaseGrant), path::LEASE_GRANT, req)
        .await?;
    if !resp.error.is_empty() || resp.id <= 0 {
        return Err(MetaError::Etcd {
            endpoint: client.endpoints(),
            code: "lease grant refused".to_string(),
            message: resp.error,
        });
    }
    Ok(LeaseId(resp.id))
}

/// One keep-alive round trip on the keep-alive connection. etcd answers an
/// unknown or expired lease with TTL 0 rather than an error.
pub(crate) async fn keep_alive(client: &Client, lease: LeaseId) -> Result<(), MetaError> {
    let call = Call {
        keep_alive_channel: true,
        lease: Some(lease),
        ..Call::read(RpcKind::LeaseKeepAlive)
    };
    let (resp, _) = client
        .call(call, |channel| async move {
            let req = proto::LeaseKeepAliveRequest { id: lease.0 };
            // The request side may close after one message: etcd answers it
            // before it sees the end of the stream.
            let mut stream = open_stream::<_, proto::LeaseKeepAliveResponse>(
                channel,
                path::LEASE_KEEP_ALIVE,
                req,
                false,
            )
            .await?;
            stream.message().await
        })
        .await?;
    match resp {
        Some(r) if r.ttl > 0 => Ok(()),
        Some(_) => Err(MetaError::LeaseNotFound(lease)),
        None => Err(MetaError::Unavailable {
            endpoints: client.endpoints(),
            reason: format!("etcd closed the keep-alive stream of lease {lease} without an answer"),
        }),
    }
}

pub(crate) async fn revoke(client: &Client, lease: LeaseId) -> Result<(), MetaError> {
    // Not repeated once sent: a second revoke would report LeaseNotFound for
    // a revoke that worked.
    let call = Call::write(RpcKind::LeaseRevoke, Some(lease));
    let _: proto::LeaseRevokeResponse = client
        .unary(
            call,
            path::LEASE_REVOKE,
            proto::LeaseRevokeRequest { id: lease.0 },
        )
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttl_rounds_up_to_whole_seconds() {
        assert_eq!(ttl_seconds(Duration::from_millis(300)).unwrap(), 1);
        assert_eq!(ttl_seconds(Duration::from_secs(2)).unwrap(), 2);
        assert_eq!(ttl_seconds(Duration::from_millis(2001)).unwrap(), 3);
        assert!(matches!(
            ttl_seconds(Duration::ZERO),
            Err(MetaError::InvalidArgument(_))
        ));
    }
}

//! Mapping between Ashlar's MetaStore types and etcd's messages.

use super::proto::{self, compare as pc, request_op::Request, response_op::Response};
use crate::error::MetaError;
use crate::types::{
    Compare, CompareOp, CompareTarget, EventKind, KeyRange, KeyValue, LeaseId, Revision, Txn,
    TxnOp, TxnOpResult, TxnResponse, WatchEvent,
};

/// etcd spells "no lease" as 0.
pub(crate) fn lease_to_etcd(lease: Option<LeaseId>) -> i64 {
    lease.map_or(0, |l| l.0)
}

fn lease_from_etcd(lease: i64) -> Option<LeaseId> {
    (lease != 0).then_some(LeaseId(lease))
}

/// `(key, range_end)` for etcd, or `None` when the range matches no key
/// (etcd has no way to say "nothing"; an inverted range would be read as
/// "from key on" when its end is `\0`).
pub(crate) fn range_to_etcd(range: &KeyRange) -> Option<(Vec<u8>, Vec<u8>)> {
    if range.is_empty() {
        return None;
    }
    let (key, end) = range.to_etcd();
    // `Range { start: "", end: "\0" }` holds only the empty key, which no
    // store accepts, but etcd would read `range_end == "\0"` as unbounded.
    if matches!(range, KeyRange::Range { end, .. } if end.as_slice() == [0]) {
        return None;
    }
    Some((key, end))
}

pub(crate) fn kv_from_etcd(kv: proto::KeyValue) -> KeyValue {
    KeyValue {
        key: kv.key,
        value: kv.value,
        create_revision: Revision(kv.create_revision),
        mod_revision: Revision(kv.mod_revision),
        version: kv.version,
        lease: lease_from_etcd(kv.lease),
    }
}

pub(crate) fn event_from_etcd(ev: proto::Event) -> Result<WatchEvent, MetaError> {
    let kind = if ev.kind == proto::EVENT_DELETE {
        EventKind::Delete
    } else {
        EventKind::Put
    };
    let kv = ev
        .kv
        .ok_or_else(|| malformed("a watch event without a key"))?;
    Ok(WatchEvent {
        kind,
        kv: kv_from_etcd(kv),
        prev: ev.prev_kv.map(kv_from_etcd),
    })
}

pub(crate) fn range_request(
    key: Vec<u8>,
    range_end: Vec<u8>,
    limit: Option<usize>,
) -> proto::RangeRequest {
    proto::RangeRequest {
        key,
        range_end,
        limit: limit.map_or(0, |l| i64::try_from(l).unwrap_or(i64::MAX)),
        ..Default::default()
    }
}

fn compare_to_etcd(c: &Compare) -> proto::Compare {
    let result = match c.op {
        CompareOp::Equal => pc::EQUAL,
        CompareOp::NotEqual => pc::NOT_EQUAL,
        CompareOp::Less => pc::LESS,
        CompareOp::Greater => pc::GREATER,
    };
    let (target, union) = match &c.target {
        CompareTarget::Value(v) => (pc::VALUE, pc::TargetUnion::Value(v.clone())),
        CompareTarget::Version(v) => (pc::VERSION, pc::TargetUnion::Version(*v)),
        CompareTarget::CreateRevision(r) => (pc::CREATE, pc::TargetUnion::CreateRevision(r.0)),
        CompareTarget::ModRevision(r) => (pc::MOD, pc::TargetUnion::ModRevision(r.0)),
        CompareTarget::Lease(l) => (pc::LEASE, pc::TargetUnion::Lease(lease_to_etcd(*l))),
    };
    proto::Compare {
        result,
        target,
        key: c.key.clone(),
        target_union: Some(union),
    }
}

/// A range etcd reads as matching nothing (`key >= range_end`), standing in
/// for an empty range inside a transaction, where the op cannot be left out
/// without shifting the positions of the results.
fn nothing() -> (Vec<u8>, Vec<u8>) {
    (vec![1], vec![1])
}

fn op_to_etcd(op: &TxnOp) -> proto::RequestOp {
    let request = match op {
        TxnOp::Put { key, value, lease } => Request::Put(proto::PutRequest {
            key: key.clone(),
            value: value.clone(),
            lease: lease_to_etcd(*lease),
        }),
        TxnOp::Delete { range } => {
            let (key, range_end) = range_to_etcd(range).unwrap_or_else(nothing);
            Request::DeleteRange(proto::DeleteRangeRequest { key, range_end })
        }
        TxnOp::Get { range } => {
            let (key, range_end) = range_to_etcd(range).unwrap_or_else(nothing);
            Request::Range(range_request(key, range_end, None))
        }
    };
    proto::RequestOp {
        request: Some(request),
    }
}

pub(crate) fn txn_to_etcd(txn: &Txn) -> proto::TxnRequest {
    proto::TxnRequest {
        compare: txn.compares.iter().map(compare_to_etcd).collect(),
        success: txn.success.iter().map(op_to_etcd).collect(),
        failure: txn.failure.iter().map(op_to_etcd).collect(),
    }
}

/// The first lease a transaction attaches, to name in `LeaseNotFound`:
/// etcd's error does not say which lease it could not find.
pub(crate) fn first_lease(txn: &Txn) -> Option<LeaseId> {
    txn.success
        .iter()
        .chain(&txn.failure)
        .find_map(|op| match op {
            TxnOp::Put { lease, .. } => *lease,
            _ => None,
        })
}

pub(crate) fn txn_from_etcd(resp: proto::TxnResponse) -> Result<TxnResponse, MetaError> {
    let results = resp
        .responses
        .into_iter()
        .map(|r| match r.response {
            Some(Response::Put(_)) => Ok(TxnOpResult::Put),
            Some(Response::DeleteRange(d)) => Ok(TxnOpResult::Delete {
                deleted: u64::try_from(d.deleted).unwrap_or(0),
            }),
            Some(Response::Range(r)) => Ok(TxnOpResult::Get {
                kvs: r.kvs.into_iter().map(kv_from_etcd).collect(),
            }),
            None => Err(malformed("a transaction result of an unknown kind")),
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(TxnResponse {
        succeeded: resp.succeeded,
        revision: header_revision(resp.header.as_ref()),
        results,
    })
}

pub(crate) fn header_revision(header: Option<&proto::ResponseHeader>) -> Revision {
    Revision(header.map_or(0, |h| h.revision))
}

/// etcd answered something this client cannot read.
pub(crate) fn malformed(what: &str) -> MetaError {
    MetaError::Etcd {
        endpoint: "etcd".to_string(),
        code: "malformed response".to_string(),
        message: format!("etcd sent {what}"),
    }
}

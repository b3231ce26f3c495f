//! The data model of the MetaStore, shaped after etcd v3's API so that an etcd
//! implementation is a field-by-field mapping of these types.

use std::fmt;

/// A store revision: a monotonic counter bumped once per mutating transaction,
/// exactly like etcd's `header.revision`. `Revision(0)` never names a real
/// write, which is why "key absent" is `create_revision == Revision(0)`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Revision(pub i64);

impl Revision {
    /// The revision following this one.
    pub fn next(self) -> Revision {
        Revision(self.0 + 1)
    }
}

impl fmt::Display for Revision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A lease identifier. Always positive: etcd uses 0 for "no lease", which
/// this API spells `Option<LeaseId>::None` instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LeaseId(pub i64);

impl fmt::Display for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // etcd prints lease ids in hex (`etcdctl lease list`); match it so ids
        // in our logs can be pasted into etcdctl.
        write!(f, "{:x}", self.0)
    }
}

/// One key with its value and etcd-style bookkeeping.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyValue {
    pub key: Vec<u8>,
    pub value: Vec<u8>,
    /// Revision of the put that created the key (since its last delete).
    pub create_revision: Revision,
    /// Revision of the last put (or, in a delete event, of the delete).
    pub mod_revision: Revision,
    /// Number of puts since creation: 1 after the creating put, reset by delete.
    pub version: i64,
    /// Lease the key is attached to; the key is deleted when the lease ends.
    pub lease: Option<LeaseId>,
}

/// A set of keys: the unit of `range`, `delete` and `watch`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum KeyRange {
    /// Exactly one key.
    Key(Vec<u8>),
    /// Every key starting with these bytes; an empty prefix means all keys.
    Prefix(Vec<u8>),
    /// Keys in `[start, end)`. A range with `end <= start` matches nothing.
    Range { start: Vec<u8>, end: Vec<u8> },
}

impl KeyRange {
    pub fn key(key: impl Into<Vec<u8>>) -> Self {
        KeyRange::Key(key.into())
    }

    pub fn prefix(prefix: impl Into<Vec<u8>>) -> Self {
        KeyRange::Prefix(prefix.into())
    }

    pub fn range(start: impl Into<Vec<u8>>, end: impl Into<Vec<u8>>) -> Self {
        KeyRange::Range {
            start: start.into(),
            end: end.into(),
        }
    }

    /// Whether `key` is in this range.
    pub fn contains(&self, key: &[u8]) -> bool {
        match self {
            KeyRange::Key(k) => k.as_slice() == key,
            KeyRange::Prefix(p) => key.starts_with(p),
            KeyRange::Range { start, end } => start.as_slice() <= key && key < end.as_slice(),
        }
    }

    /// Whether the range can match no key at all (an inverted `Range`).
    pub fn is_empty(&self) -> bool {
        matches!(self, KeyRange::Range { start, end } if end <= start)
    }

    /// The range as `[start, end)` with `None` meaning "no upper bound".
    pub fn bounds(&self) -> (Vec<u8>, Option<Vec<u8>>) {
        match self {
            KeyRange::Key(k) => {
                // The smallest key greater than `k` is `k` followed by a zero byte.
                let mut end = k.clone();
                end.push(0);
                (k.clone(), Some(end))
            }
            KeyRange::Prefix(p) => (p.clone(), prefix_end(p)),
            KeyRange::Range { start, end } => (start.clone(), Some(end.clone())),
        }
    }

    /// The range as etcd's `(key, range_end)` pair: an empty `range_end`
    /// means a single key, `range_end == "\0"` means "no upper bound", and an
    /// empty key is spelled `"\0"` (etcd rejects empty keys).
    /// Callers must check [`KeyRange::is_empty`] first: etcd cannot express
    /// an empty range.
    pub fn to_etcd(&self) -> (Vec<u8>, Vec<u8>) {
        let non_empty = |k: &[u8]| if k.is_empty() { vec![0] } else { k.to_vec() };
        match self {
            KeyRange::Key(k) => (k.clone(), Vec::new()),
            KeyRange::Prefix(p) => (non_empty(p), prefix_end(p).unwrap_or_else(|| vec![0])),
            KeyRange::Range { start, end } => (non_empty(start), end.clone()),
        }
    }
}

/// The smallest key greater than every key starting with `prefix`, or `None`
/// when there is none (empty prefix, or all bytes 0xff). Same rule as
/// etcd's `clientv3.GetPrefixRangeEnd`.
pub fn prefix_end(prefix: &[u8]) -> Option<Vec<u8>> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return Some(end);
        }
    }
    None
}

/// How a [`Compare`] relates the stored field to the given one
/// (`stored <op> given`), as etcd's `Compare.result`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CompareOp {
    Equal,
    NotEqual,
    Less,
    Greater,
}

impl CompareOp {
    pub(crate) fn holds<T: Ord + ?Sized>(self, stored: &T, given: &T) -> bool {
        match self {
            CompareOp::Equal => stored == given,
            CompareOp::NotEqual => stored != given,
            CompareOp::Less => stored < given,
            CompareOp::Greater => stored > given,
        }
    }
}

/// Which field of the key a [`Compare`] looks at, with the value to compare to.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum CompareTarget {
    /// Byte-wise comparison of the value. Like etcd, a value compare on an
    /// absent key is always false (absent is not the same as empty).
    Value(Vec<u8>),
    /// The key's version; 0 when absent.
    Version(i64),
    /// The key's create revision; 0 when absent.
    CreateRevision(Revision),
    /// The key's mod revision; 0 when absent.
    ModRevision(Revision),
    /// The key's lease; `None` when absent or not leased.
    Lease(Option<LeaseId>),
}

/// A condition on one key, evaluated inside a transaction.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Compare {
    pub key: Vec<u8>,
    pub op: CompareOp,
    pub target: CompareTarget,
}

impl Compare {
    pub fn new(key: impl Into<Vec<u8>>, op: CompareOp, target: CompareTarget) -> Self {
        Compare {
            key: key.into(),
            op,
            target,
        }
    }

    /// The key does not exist (etcd idiom: `create_revision == 0`).
    pub fn absent(key: impl Into<Vec<u8>>) -> Self {
        Self::new(
            key,
            CompareOp::Equal,
            CompareTarget::CreateRevision(Revision(0)),
        )
    }

    /// The key exists.
    pub fn exists(key: impl Into<Vec<u8>>) -> Self {
        Self::new(
            key,
            CompareOp::Greater,
            CompareTarget::CreateRevision(Revision(0)),
        )
    }

    pub fn value(key: impl Into<Vec<u8>>, op: CompareOp, value: impl Into<Vec<u8>>) -> Self {
        Self::new(key, op, CompareTarget::Value(value.into()))
    }

    pub fn version(key: impl Into<Vec<u8>>, op: CompareOp, version: i64) -> Self {
        Self::new(key, op, CompareTarget::Version(version))
    }

    pub fn create_revision(key: impl Into<Vec<u8>>, op: CompareOp, rev: Revision) -> Self {
        Self::new(key, op, CompareTarget::CreateRevision(rev))
    }

    /// The usual optimistic-concurrency guard: "nobody wrote the key since I
    /// read it at `rev`".
    pub fn mod_revision(key: impl Into<Vec<u8>>, op: CompareOp, rev: Revision) -> Self {
        Self::new(key, op, CompareTarget::ModRevision(rev))
    }

    /// Shorthand for the CAS guard `mod_revision == rev`; with
    /// `Revision(0)` it means "the key is absent".
    pub fn mod_revision_equals(key: impl Into<Vec<u8>>, rev: Revision) -> Self {
        Self::mod_revision(key, CompareOp::Equal, rev)
    }

    pub fn lease(key: impl Into<Vec<u8>>, op: CompareOp, lease: Option<LeaseId>) -> Self {
        Self::new(key, op, CompareTarget::Lease(lease))
    }
}

/// One operation of a transaction branch.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum TxnOp {
    Put {
        key: Vec<u8>,
        value: Vec<u8>,
        lease: Option<LeaseId>,
    },
    Delete {
        range: KeyRange,
    },
    /// Reads see the writes of earlier ops in the same branch (as in etcd).
    Get {
        range: KeyRange,
    },
}

impl TxnOp {
    pub fn put(key: impl Into<Vec<u8>>, value: impl Into<Vec<u8>>, lease: Option<LeaseId>) -> Self {
        TxnOp::Put {
            key: key.into(),
            value: value.into(),
            lease,
        }
    }

    pub fn delete(range: KeyRange) -> Self {
        TxnOp::Delete { range }
    }

    pub fn get(range: KeyRange) -> Self {
        TxnOp::Get { range }
    }
}

/// An etcd-style mini transaction: if every compare holds, run `success`,
/// else run `failure`; all of it atomically at one revision.
///
/// Like etcd, a branch may not put the same key twice nor put a key that a
/// delete in the same branch covers, and each list is limited in length
/// (etcd's `--max-txn-ops`, default 128).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Txn {
    pub compares: Vec<Compare>,
    pub success: Vec<TxnOp>,
    pub failure: Vec<TxnOp>,
}

impl Txn {
    pub fn new() -> Self {
        Self::default()
    }

    /// Conditions (named as in the etcd-client crate).
    pub fn when(mut self, compares: impl IntoIterator<Item = Compare>) -> Self {
        self.compares.extend(compares);
        self
    }

    /// Ops to run when every compare holds.
    pub fn and_then(mut self, ops: impl IntoIterator<Item = TxnOp>) -> Self {
        self.success.extend(ops);
        self
    }

    /// Ops to run when some compare fails.
    pub fn or_else(mut self, ops: impl IntoIterator<Item = TxnOp>) -> Self {
        self.failure.extend(ops);
        self
    }
}

/// The outcome of one [`TxnOp`], in the same position as the op.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TxnOpResult {
    Put,
    Delete { deleted: u64 },
    Get { kvs: Vec<KeyValue> },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TxnResponse {
    /// Whether the compares held (so `success` ran) or not (`failure` ran).
    pub succeeded: bool,
    /// Store revision after the transaction; unchanged if the branch wrote nothing.
    pub revision: Revision,
    pub results: Vec<TxnOpResult>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventKind {
    Put,
    Delete,
}

/// One change seen by a watcher.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchEvent {
    pub kind: EventKind,
    /// For puts, the new key-value. For deletes, only `key` and
    /// `mod_revision` (the delete's revision) are set, as in etcd.
    pub kv: KeyValue,
    /// The key-value before this change, when known (etcd needs the
    /// `prev_kv` watch option and may lose it to compaction; the embedded
    /// store always fills it in when the key existed).
    pub prev: Option<KeyValue>,
}

impl WatchEvent {
    /// The revision the change happened at.
    pub fn revision(&self) -> Revision {
        self.kv.mod_revision
    }
}

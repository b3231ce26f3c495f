//! The oplog (see docs/oplog-format.md).

//! The daemon's control protocol: one command per line on its stdin, one answer per line on
//! its stdout. Shared by the daemon and by [`crate::PowercutFs`].
//!
//! Commands: `cut drop-all`, `cut keep-all`, `cut random SEED`, `cut random-writes SEED`,
//! `status`, `unmount`. Answers: `ready`, `status k=v ...`, `cut k=v ...`, `unmounted`,
//! `error MESSAGE`.

use std::fmt;

/// What the "disk" keeps of the writes that were not made durable when the power goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CutPolicy {
    /// Every pending write and namespace change is lost: the backing dir stays exactly the
    /// durable state.
    DropAll,
    /// Every pending write and namespace change is kept, in order (a clean shutdown; useful as
    /// a control in tests).
    KeepAll,
    /// A seeded random subset of the pending data writes, size changes and hole punches,
    /// applied in random order, each write possibly torn at 512-byte sector granularity; plus a
    /// random subset of the pending directory-entry changes.
    RandomSubset { seed: u64 },
    /// Like `RandomSubset` for data, but every pending directory-entry change is lost.
    RandomWrites { seed: u64 },
}

impl CutPolicy {
    /// The policy as the control protocol spells it after `cut `.
    pub fn to_command(self) -> String {
        match self {
            CutPolicy::DropAll => "drop-all".to_string(),
            CutPolicy::KeepAll => "keep-all".to_string(),
            CutPolicy::RandomSubset { seed } => format!("random {seed}"),
            CutPolicy::RandomWrites { seed } => format!("random-writes {seed}"),
        }
    }

    /// Parses the words after `cut `.
    pub fn parse(text: &str) -> Result<CutPolicy, String> {
        let words: Vec<&str> = text.split_whitespace().collect();
        let seed = |w: Option<&&str>| -> Result<u64, String> {
            w.ok_or_else(|| "missing seed".to_string())?
                .parse::<u64>()
                .map_err(|e| format!("bad seed: {e}"))
        };
        match words.first().copied() {
            Some("drop-all") if words.len() == 1 => Ok(CutPolicy::DropAll),
            Some("keep-all") if words.len() == 1 => Ok(CutPolicy::KeepAll),
            Some("random") if words.len() == 2 => Ok(CutPolicy::RandomSubset { seed: seed(words.get(1))? }),
            Some("random-writes") if words.len() == 2 => Ok(CutPolicy::RandomWrites { seed: seed(words.get(1))? }),
            _ => Err(format!(
                "unknown cut policy {text:?} (want drop-all, keep-all, random SEED or random-writes SEED)"
            )),
        }
    }
}

impl fmt::Display for CutPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_command())
    }
}

/// What a cut did. "Writes" counts every pending data operation: writes, size changes
/// (truncate, extending fallocate) and hole punches.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CutReport {
    /// Pending data operations when the power went.
    pub writes_pending: u64,
    /// Applied whole.
    pub writes_kept: u64,
    /// Writes of which some 512-byte sectors were applied and some were not.
    pub writes_torn: u64,
    /// Not applied at all.
    pub writes_dropped: u64,
    /// Bytes of pending writes (payload of write requests only).
    pub bytes_pending: u64,
    /// Of those, bytes that reached the backing dir.
    pub bytes_kept: u64,
    /// Pending directory-entry changes (one per name whose live target differs from the
    /// durable one).
    pub namespace_pending: u64,
    pub namespace_kept: u64,
    pub namespace_dropped: u64,
}

impl CutReport {
    pub(crate) fn to_line(&self) -> String {
        format!(
            "cut writes_pending={} writes_kept={} writes_torn={} writes_dropped={} bytes_pending={} bytes_kept={} namespace_pending={} namespace_kept={} namespace_dropped={}",
            self.writes_pending,
            self.writes_kept,
            self.writes_torn,
            self.writes_dropped,
            self.bytes_pending,
            self.bytes_kept,
            self.namespace_pending,
            self.namespace_kept,
            self.namespace_dropped
        )
    }

    pub(crate) fn parse(line: &str) -> Result<CutReport, String> {
        let rest = line
            .strip_prefix("cut ")
            .ok_or_else(|| format!("not a cut report: {line:?}"))?;
        let mut r = CutReport::default();
        for (key, value) in pairs(rest)? {
            let slot = match key {
                "writes_pending" => &mut r.writes_pending,
                "writes_kept" => &mut r.writes_kept,
                "writes_torn" => &mut r.writes_torn,
                "writes_dropped" => &mut r.writes_dropped,
                "bytes_pending" => &mut r.bytes_pending,
                "bytes_kept" => &mut r.bytes_kept,
                "namespace_pending" => &mut r.namespace_pending,
                "namespace_kept" => &mut r.namespace_kept,
                "namespace_dropped" => &mut r.namespace_dropped,
                _ => continue,
            };
            *slot = value;
        }
        Ok(r)
    }
}

impl fmt::Display for CutReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} pending writes ({} bytes): {} kept, {} torn, {} dropped ({} bytes kept); {} pending directory entries: {} kept, {} dropped",
            self.writes_pending,
            self.bytes_pending,
            self.writes_kept,
            self.writes_torn,
            self.writes_dropped,
            self.bytes_kept,
            self.namespace_pending,
            self.namespace_kept,
            self.namespace_dropped
        )
    }
}

/// What is not yet durable right now.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PendingStatus {
    /// Pending data operations (writes, size changes, hole punches) over all files.
    pub writes: u64,
    /// Payload bytes of the pending writes.
    pub bytes: u64,
    /// Files with at least one pending data operation.
    pub files: u64,
    /// Pending directory-entry changes.
    pub namespace: u64,
}

impl PendingStatus {
    pub(crate) fn to_line(&self) -> String {
        format!(
            "status writes={} bytes={} files={} namespace={}",
            self.writes, self.bytes, self.files, self.namespace
        )
    }

    pub(crate) fn parse(line: &str) -> Result<PendingStatus, String> {
        let rest = line
            .strip_prefix("status ")
            .ok_or_else(|| format!("not a status line: {line:?}"))?;
        let mut s = PendingStatus::default();
        for (key, value) in pairs(rest)? {
            match key {
                "writes" => s.writes = value,
                "bytes" => s.bytes = value,
                "files" => s.files = value,
                "namespace" => s.namespace = value,
                _ => {}
            }
        }
        Ok(s)
    }
}

fn pairs(text: &str) -> Result<Vec<(&str, u64)>, String> {
    text.split_whitespace()
        .map(|kv| {
            let (k, v) = kv
                .split_once('=')
                .ok_or_else(|| format!("bad field {kv:?}"))?;
            let v = v
                .parse::<u64>()
                .map_err(|e| format!("bad value in {kv:?}: {e}"))?;
            Ok((k, v))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policies_round_trip() {
        for p in [
            CutPolicy::DropAll,
            CutPolicy::KeepAll,
            CutPolicy::RandomSubset { seed: 42 },
            CutPolicy::RandomWrites { seed: u64::MAX },
        ] {
            assert_eq!(CutPolicy::parse(&p.to_command()), Ok(p));
        }
        assert!(CutPolicy::parse("random").is_err());
        assert!(CutPolicy::parse("random x").is_err());
        assert!(CutPolicy::parse("everything").is_err());
    }

    #[test]
    fn reports_round_trip() {
        let r = CutReport {
            writes_pending: 9,
            writes_kept: 3,
            writes_torn: 2,
            writes_dropped: 4,
            bytes_pending: 4096,
            bytes_kept: 1024,
            namespace_pending: 5,
            namespace_kept: 1,
            namespace_dropped: 4,
        };
        assert_eq!(CutReport::parse(&r.to_line()), Ok(r));
        let s = PendingStatus {
            writes: 1,
            bytes: 2,
            files: 3,
            namespace: 4,
        };
        assert_eq!(PendingStatus::parse(&s.to_line()), Ok(s));
    }
}

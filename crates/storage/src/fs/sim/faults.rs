//! Programmable faults, delays and operation counters of the simulated disk.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// How many matching calls an injected failure applies to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Times {
    /// Every matching call until [`super::SimFs::clear_failures`].
    Always,
    /// The next `n` matching calls, then the rule is spent.
    Next(u64),
}

/// Which calls a failure rule applies to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FaultClass {
    /// `read_at`.
    Read,
    /// `write_at`, `write_durable_at`, `punch_hole`, `allocate`, `set_len`.
    Write,
    /// `sync_data`, `sync_dir`, and the flush half of `write_durable_at`.
    Sync,
}

#[derive(Clone, Debug)]
struct Rule {
    class: FaultClass,
    prefix: Option<PathBuf>,
    remaining: Option<u64>,
}

impl Rule {
    fn matches(&self, class: FaultClass, path: &Path) -> bool {
        self.class == class
            && self.remaining != Some(0)
            && self.prefix.as_ref().is_none_or(|p| path.starts_with(p))
    }
}

/// Counts of calls made, failed ones included. Namespace calls count under the path they
/// name (a rename under its source), file calls under the path the file was opened with.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OpCounts {
    pub reads: u64,
    /// `write_at` calls (not `write_durable_at`).
    pub writes: u64,
    pub durable_writes: u64,
    /// `sync_data` calls.
    pub syncs: u64,
    /// `sync_dir` calls.
    pub dir_syncs: u64,
    pub punches: u64,
    pub allocates: u64,
    pub set_lens: u64,
    /// `open` calls that created a file.
    pub creates: u64,
    pub renames: u64,
    /// `remove_file` and `remove_dir` calls.
    pub removes: u64,
}

impl OpCounts {
    fn add(&mut self, other: &OpCounts) {
        self.reads += other.reads;
        self.writes += other.writes;
        self.durable_writes += other.durable_writes;
        self.syncs += other.syncs;
        self.dir_syncs += other.dir_syncs;
        self.punches += other.punches;
        self.allocates += other.allocates;
        self.set_lens += other.set_lens;
        self.creates += other.creates;
        self.renames += other.renames;
        self.removes += other.removes;
    }
}

/// Failure rules, delays and counters. Paths here are normalized (absolute, no `.`/`..`).
#[derive(Debug, Default)]
pub(crate) struct Faults {
    rules: Vec<Rule>,
    delays: Vec<(Option<PathBuf>, Duration)>,
    counts: BTreeMap<PathBuf, OpCounts>,
}

impl Faults {
    pub(crate) fn add_rule(&mut self, class: FaultClass, prefix: Option<PathBuf>, times: Times) {
        let remaining = match times {
            Times::Always => None,
            Times::Next(0) => return,
            Times::Next(n) => Some(n),
        };
        self.rules.push(Rule {
            class,
            prefix,
            remaining,
        });
    }

    pub(crate) fn clear_rules(&mut self) {
        self.rules.clear();
    }

    /// Whether this call fails; a matching counted rule is used up by one.
    pub(crate) fn should_fail(&mut self, class: FaultClass, path: &Path) -> bool {
        let Some(rule) = self.rules.iter_mut().find(|r| r.matches(class, path)) else {
            return false;
        };
        if let Some(n) = rule.remaining.as_mut() {
            *n -= 1;
        }
        self.rules.retain(|r| r.remaining != Some(0));
        true
    }

    /// Sets the delay of every operation under `prefix` (replacing an earlier one for the
    /// same prefix); a zero delay removes it.
    pub(crate) fn set_delay(&mut self, prefix: Option<PathBuf>, delay: Duration) {
        self.delays.retain(|(p, _)| *p != prefix);
        if !delay.is_zero() {
            self.delays.push((prefix, delay));
        }
    }

    pub(crate) fn clear_delays(&mut self) {
        self.delays.clear();
    }

    /// The longest delay whose prefix matches `path`.
    pub(crate) fn delay_for(&self, path: &Path) -> Duration {
        self.delays
            .iter()
            .filter(|(p, _)| p.as_ref().is_none_or(|p| path.starts_with(p)))
            .map(|(_, d)| *d)
            .max()
            .unwrap_or(Duration::ZERO)
    }

    pub(crate) fn count(&mut self, path: &Path, bump: impl FnOnce(&mut OpCounts)) {
        match self.counts.get_mut(path) {
            Some(counts) => bump(counts),
            None => bump(self.counts.entry(path.to_path_buf()).or_default()),
        }
    }

    pub(crate) fn counts_under(&self, prefix: Option<&Path>) -> OpCounts {
        let mut total = OpCounts::default();
        for (path, counts) in &self.counts {
            if prefix.is_none_or(|p| path.starts_with(p)) {
                total.add(counts);
            }
        }
        total
    }

    pub(crate) fn reset_counts(&mut self) {
        self.counts.clear();
    }
}

//! Power cuts: what of the non-durable state the disk kept.

use super::contents::Change;
use super::state::{DirNode, Disk, FileNode, Ino, Node, ROOT};
use std::collections::{HashSet, VecDeque};

/// What survives a [`super::SimFs::power_cut`] besides the durable state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CutPolicy {
    /// Nothing that was not durable survives.
    DropAll,
    /// Everything survives, as if the kernel wrote every dirty page and committed every
    /// directory change before dying: a process crash (kill -9), not a power cut.
    KeepAll,
    /// Each pending data change (one sector of a write, one block of a punch or fallocate) is
    /// kept or dropped independently, the kept ones applied in a random order; size changes
    /// (metadata, journaled in order) keep a random prefix, interleaved with the data at
    /// random; each directory keeps a random prefix of its pending entry changes. The same
    /// seed on the same history gives the same outcome.
    Random { seed: u64 },
}

/// Counts of what a power cut kept and dropped.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CutReport {
    /// Pending data changes (sectors, allocated or punched blocks, sizes) kept.
    pub changes_kept: u64,
    pub changes_dropped: u64,
    /// Pending directory entry changes (create, rename half, remove) kept.
    pub entry_changes_kept: u64,
    pub entry_changes_dropped: u64,
    /// Files gone because no durable directory entry named them.
    pub files_lost: u64,
    /// Open handles that died with the process.
    pub handles_killed: u64,
}

/// SplitMix64: small, seedable, good enough to pick subsets and orders.
pub(super) struct Rng(u64);

impl Rng {
    pub(super) fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub(super) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..=max`.
    fn up_to(&mut self, max: usize) -> usize {
        (self.next() % (max as u64 + 1)) as usize
    }

    fn coin(&mut self) -> bool {
        self.next() & 1 == 1
    }
}

/// Decides, change by change, what the disk kept.
struct Chooser {
    policy: CutPolicy,
    rng: Rng,
}

impl Chooser {
    /// The kept changes of a file, in the order the disk applied them: a random subset of the
    /// data changes in a random order, interleaved with an ordered prefix of the size changes.
    fn file_changes(&mut self, changes: Vec<Change>, report: &mut CutReport) -> Vec<Change> {
        let total = changes.len() as u64;
        let kept = match self.policy {
            CutPolicy::DropAll => Vec::new(),
            CutPolicy::KeepAll => changes,
            CutPolicy::Random { .. } => self.random_changes(changes),
        };
        report.changes_kept += kept.len() as u64;
        report.changes_dropped += total - kept.len() as u64;
        kept
    }

    fn random_changes(&mut self, changes: Vec<Change>) -> Vec<Change> {
        let (mut sizes, data): (Vec<Change>, Vec<Change>) =
            changes.into_iter().partition(Change::is_size);
        let mut data: Vec<Change> = data.into_iter().filter(|_| self.rng.coin()).collect();
        for i in (1..data.len()).rev() {
            data.swap(i, self.rng.up_to(i));
        }
        sizes.truncate(self.rng.up_to(sizes.len()));
        let mut out = Vec::with_capacity(data.len() + sizes.len());
        let (mut data, mut sizes) = (data.into_iter().peekable(), sizes.into_iter().peekable());
        while data.peek().is_some() || sizes.peek().is_some() {
            let from_sizes = match (data.peek(), sizes.peek()) {
                (Some(_), Some(_)) => self.rng.coin(),
                (None, _) => true,
                (_, None) => false,
            };
            out.extend(if from_sizes {
                sizes.next()
            } else {
                data.next()
            });
        }
        out
    }

    /// How many of a directory's pending entry changes (oldest first) the disk kept.
    fn dir_prefix(&mut self, pending: usize, report: &mut CutReport) -> usize {
        let kept = match self.policy {
            CutPolicy::DropAll => 0,
            CutPolicy::KeepAll => pending,
            CutPolicy::Random { .. } => self.rng.up_to(pending),
        };
        report.entry_changes_kept += kept as u64;
        report.entry_changes_dropped += (pending - kept) as u64;
        kept
    }
}

impl Disk {
    /// Applies `policy` to every non-durable change, then makes live = durable, kills every
    /// handle and drops the files no durable entry reaches.
    pub(super) fn power_cut(&mut self, policy: CutPolicy) -> CutReport {
        let seed = match policy {
            CutPolicy::Random { seed } => seed,
            _ => 0,
        };
        let mut chooser = Chooser {
            policy,
            rng: Rng::new(seed),
        };
        let mut report = CutReport {
            handles_killed: self.handles.values().map(|&n| u64::from(n)).sum(),
            ..CutReport::default()
        };
        let mut inodes: Vec<Ino> = self.nodes.keys().copied().collect();
        inodes.sort_unstable();
        for ino in inodes {
            match self.nodes.get_mut(&ino) {
                Some(Node::File(file)) => cut_file(file, &mut chooser, &mut report),
                Some(Node::Dir(dir)) => cut_dir(dir, &mut chooser, &mut report),
                None => {}
            }
        }
        self.handles.clear();
        self.generation += 1;
        report.files_lost = self.drop_unreachable();
        report
    }

    /// Removes inodes the durable namespace does not reach from the root; counts files.
    fn drop_unreachable(&mut self) -> u64 {
        let mut reached = HashSet::from([ROOT]);
        let mut queue = VecDeque::from([ROOT]);
        while let Some(ino) = queue.pop_front() {
            if let Some(Node::Dir(dir)) = self.nodes.get(&ino) {
                for &child in dir.live.values() {
                    if reached.insert(child) {
                        queue.push_back(child);
                    }
                }
            }
        }
        let doomed: Vec<Ino> = self
            .nodes
            .keys()
            .filter(|ino| !reached.contains(ino))
            .copied()
            .collect();
        let mut files = 0;
        for ino in doomed {
            if let Some(Node::File(_)) = self.nodes.remove(&ino) {
                files += 1;
            }
        }
        files
    }
}

fn cut_file(file: &mut FileNode, chooser: &mut Chooser, report: &mut CutReport) {
    let changes = std::mem::take(&mut file.pending)
        .into_iter()
        .map(|p| p.change)
        .collect();
    let kept = chooser.file_changes(changes, report);
    if chooser.policy == CutPolicy::KeepAll {
        file.durable = file.live.clone();
        return;
    }
    for change in kept {
        change.apply(&mut file.durable);
    }
    file.durable.normalize();
    file.live = file.durable.clone();
}

fn cut_dir(dir: &mut DirNode, chooser: &mut Chooser, report: &mut CutReport) {
    let pending = std::mem::take(&mut dir.pending);
    let kept = chooser.dir_prefix(pending.len(), report);
    for op in &pending[..kept] {
        for (name, target) in op {
            match target {
                Some(ino) => dir.durable.insert(name.clone(), *ino),
                None => dir.durable.remove(name),
            };
        }
    }
    dir.live = dir.durable.clone();
}

//! Reading an egroup's blocks that live in the block log (format 3): runs of blocks whose
//! slots follow one another in one segment are read with one read, and every block is checked
//! against the one CRC32C its entry holds.

use super::block_log::{read_slots, segment_path, slot_offset, LogSlot};
use super::egroup::Egroup;
use super::format::BLOCK_LEN;
use super::table::{BlockState, Entry};
use super::ExtentError;
use crate::fs::{DiskFile, Filesystem};
use std::path::PathBuf;

impl<D: DiskFile> Egroup<D> {
    /// The directory of the block logs of this egroup's vdisk on its disk.
    fn log_dir(&self) -> PathBuf {
        self.path
            .parent()
            .map_or_else(|| PathBuf::from("log"), |dir| dir.join("log"))
    }

    /// Fills the blocks of `out` whose `entries` are in the block log from there (unchecked:
    /// `check_blocks` checks them with the others).
    pub(crate) async fn fill_from_log<F: Filesystem<File = D>>(
        &self,
        fs: &F,
        entries: &[Entry],
        out: &mut [u8],
    ) -> Result<(), ExtentError> {
        let mut i = 0;
        while i < entries.len() {
            if entries[i].state != BlockState::InLog {
                i += 1;
                continue;
            }
            let run = log_run(&entries[i..]);
            let slot = entries[i].log;
            self.read_slots(fs, slot, &mut out[i * BLOCK_LEN..(i + run) * BLOCK_LEN])
                .await?;
            i += run;
        }
        Ok(())
    }

    /// The content of `block`, in the log at `entry.log`, checked against its CRC.
    pub(crate) async fn read_log_block<F: Filesystem<File = D>>(
        &self,
        fs: &F,
        block: usize,
        entry: Entry,
    ) -> Result<Box<[u8]>, ExtentError> {
        let mut buf: Box<[u8]> = vec![0u8; BLOCK_LEN].into();
        self.read_slots(fs, entry.log, &mut buf).await?;
        self.check_log_block(block, &entry, &buf)?;
        Ok(buf)
    }

    /// `Corrupt` unless `data` (block `block` of the egroup) matches its entry's CRC.
    pub(crate) fn check_log_block(
        &self,
        block: usize,
        entry: &Entry,
        data: &[u8],
    ) -> Result<(), ExtentError> {
        let actual = crc32c::crc32c(data);
        if actual == entry.crc[0] {
            return Ok(());
        }
        Err(ExtentError::Corrupt {
            vdisk: self.vdisk,
            offset: self.vdisk_offset(block),
            path: segment_path(&self.log_dir(), entry.log.log, entry.log.segment),
            file_offset: slot_offset(entry.log.slot),
            expected: [entry.crc[0], entry.crc[0]],
            actual,
        })
    }

    /// Reads `out.len() / 4096` consecutive slots of one chunk from `first`.
    async fn read_slots<F: Filesystem<File = D>>(
        &self,
        fs: &F,
        first: LogSlot,
        out: &mut [u8],
    ) -> Result<(), ExtentError> {
        read_slots(fs, &self.log_dir(), first, out).await
    }
}

/// How many entries from the first (in the log) have slots that follow one another in one
/// segment: one read serves them.
fn log_run(entries: &[Entry]) -> usize {
    let first = entries[0].log;
    entries
        .iter()
        .enumerate()
        .take_while(|(i, e)| {
            e.state == BlockState::InLog
                && e.log.log == first.log
                && e.log.segment == first.segment
                && usize::from(e.log.slot) == usize::from(first.slot) + i
        })
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::extent_store::block_log::{LogId, SegmentSeq};

    fn at(segment: u32, slot: u16) -> Entry {
        Entry::in_log(
            LogSlot {
                log: LogId(1),
                segment: SegmentSeq(segment),
                slot,
            },
            0,
        )
    }

    #[test]
    fn runs_need_consecutive_slots_of_one_segment() {
        assert_eq!(log_run(&[at(1, 1), at(1, 2), at(1, 3), at(1, 5)]), 3);
        assert_eq!(log_run(&[at(1, 1), at(2, 2)]), 1);
        assert_eq!(log_run(&[at(1, 1), Entry::HOLE, at(1, 3)]), 1);
        // The last data slot of a chunk and the first of the next are not neighbours on disk
        // (two summary blocks lie between).
        assert_eq!(log_run(&[at(1, 254), at(1, 257)]), 1);
    }
}

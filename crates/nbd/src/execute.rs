//! Running one validated request on the device, and shaping its result for the reply.

use crate::proto::{Command, RequestHeader, CMD_FLAG_FUA, CMD_FLAG_NO_HOLE, CMD_FLAG_REQ_ONE, EIO};
use crate::proto::{STATE_HOLE, STATE_ZERO};
use crate::request::errno_for;
use ashlar_core::{BlockDevice, BlockStatusRun, IoResult};
use bytes::Bytes;

/// Most descriptors sent in one block status chunk (the protocol's recommended ceiling).
const MAX_EXTENTS: usize = 1 << 20;

/// The result of a request, before encoding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Outcome {
    Done,
    Data(Bytes),
    /// `(length, flags)` descriptors of `base:allocation`.
    Extents(Vec<(u32, u32)>),
    Failed {
        errno: u32,
        message: String,
    },
}

/// Runs a request that passed validation (so its range is inside the export).
pub(crate) async fn execute<D: BlockDevice>(
    device: &D,
    header: &RequestHeader,
    payload: Bytes,
) -> Outcome {
    let (offset, length) = (header.offset, header.length);
    let fua = header.flags & CMD_FLAG_FUA != 0;
    // Zero-length requests are legal but pointless; answer them without bothering the device.
    if length == 0
        && matches!(
            header.command,
            Command::Read | Command::Write | Command::Trim | Command::WriteZeroes
        )
    {
        return if header.command == Command::Read {
            Outcome::Data(Bytes::new())
        } else {
            Outcome::Done
        };
    }
    let result = match header.command {
        Command::Read => return read(device, offset, length).await,
        Command::Write => device.write(offset, payload, fua).await,
        Command::Flush => device.flush().await,
        Command::Trim => device.trim(offset, length).await,
        Command::WriteZeroes => {
            device
                .write_zeroes(offset, length, header.flags & CMD_FLAG_NO_HOLE == 0)
                .await
        }
        Command::BlockStatus => {
            let req_one = header.flags & CMD_FLAG_REQ_ONE != 0;
            return match device.block_status(offset, length).await {
                Ok(runs) => Outcome::Extents(extents(&runs, length, req_one)),
                Err(error) => failed(header.command, &error),
            };
        }
        // Only a hint; the protocol lets a server do nothing for it.
        Command::Cache => Ok(()),
        // Handled (or refused) before execution.
        Command::Disc | Command::Unknown(_) => Ok(()),
    };
    match result {
        Ok(()) => Outcome::Done,
        Err(error) => failed(header.command, &error),
    }
}

async fn read<D: BlockDevice>(device: &D, offset: u64, length: u32) -> Outcome {
    read_outcome(device.read(offset, length).await, offset, length)
}

/// Checks a read's data against the requested length and turns it into an outcome.
pub(crate) fn read_outcome(result: IoResult<Bytes>, offset: u64, length: u32) -> Outcome {
    match result {
        Ok(data) if data.len() == length as usize => Outcome::Data(data),
        Ok(data) => {
            // Sending it would desynchronise the stream; report an I/O error instead.
            let message = format!(
                "device returned {} bytes for a read of {length}",
                data.len()
            );
            tracing::error!(offset, length, "{message}");
            Outcome::Failed {
                errno: EIO,
                message,
            }
        }
        Err(error) => failed(Command::Read, &error),
    }
}

fn failed(command: Command, error: &ashlar_core::IoError) -> Outcome {
    tracing::debug!(?command, %error, "NBD request failed");
    Outcome::Failed {
        errno: errno_for(command, error),
        message: error.to_string(),
    }
}

/// Turns device runs into block status descriptors: never longer in total than the request,
/// never zero-length, neighbours with equal flags merged, at most one with REQ_ONE. A device
/// that reports nothing usable yields one "allocated, contents unknown" descriptor, which the
/// protocol allows for any range.
pub(crate) fn extents(runs: &[BlockStatusRun], length: u32, req_one: bool) -> Vec<(u32, u32)> {
    let mut out: Vec<(u32, u32)> = Vec::new();
    let mut left = length;
    for run in runs {
        let take = u32::try_from(run.length).unwrap_or(u32::MAX).min(left);
        if take == 0 {
            continue;
        }
        let flags = if run.hole { STATE_HOLE } else { 0 } | if run.zero { STATE_ZERO } else { 0 };
        let full = out.len() == MAX_EXTENTS;
        match out.last_mut() {
            Some(last) if last.1 == flags => last.0 += take,
            _ if full => break,
            _ => out.push((take, flags)),
        }
        left -= take;
        if left == 0 {
            break;
        }
    }
    if out.is_empty() {
        out.push((length, 0));
    }
    if req_one {
        out.truncate(1);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(length: u64, hole: bool, zero: bool) -> BlockStatusRun {
        BlockStatusRun { length, hole, zero }
    }

    #[test]
    fn extents_merge_and_clamp() {
        let runs = [
            run(4096, true, true),
            run(4096, true, true),
            run(8192, false, false),
            run(1 << 40, true, true),
        ];
        assert_eq!(
            extents(&runs, 20000, false),
            vec![(8192, 3), (8192, 0), (3616, 3)]
        );
        assert_eq!(extents(&runs, 20000, true), vec![(8192, 3)]);
        assert_eq!(extents(&runs, 100, true), vec![(100, 3)]);
    }

    #[test]
    fn extents_never_empty_or_zero_length() {
        assert_eq!(extents(&[], 512, false), vec![(512, 0)]);
        assert_eq!(extents(&[run(0, true, true)], 512, false), vec![(512, 0)]);
        assert_eq!(
            extents(&[run(0, false, false), run(512, false, true)], 512, false),
            vec![(512, 2)]
        );
    }
}

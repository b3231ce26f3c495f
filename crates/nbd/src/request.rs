//! Validation of transmission requests before any device call, and the mapping of device
//! errors to NBD error values. Pure functions.

use crate::proto::*;
use crate::violation::Violation;
use ashlar_core::{check_range, IoError};

/// What validation needs to know about the session.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Params {
    pub structured: bool,
    pub allocation: bool,
    pub min_block: u32,
    pub max_request: u32,
}

/// A request refused before reaching the device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Rejection {
    pub errno: u32,
    pub violation: Violation,
    pub message: String,
}

fn reject(errno: u32, violation: Violation, message: String) -> Result<(), Rejection> {
    Err(Rejection {
        errno,
        violation,
        message,
    })
}

/// Command flags a client may set on each command. FUA is accepted everywhere because the
/// protocol makes it valid for all commands once advertised (and it is a no-op where
/// nothing is written).
fn allowed_flags(command: Command) -> u16 {
    match command {
        Command::WriteZeroes => CMD_FLAG_FUA | CMD_FLAG_NO_HOLE,
        Command::BlockStatus => CMD_FLAG_FUA | CMD_FLAG_REQ_ONE,
        _ => CMD_FLAG_FUA,
    }
}

/// Whether the request carries an offset and length that address the export.
fn addresses_data(command: Command) -> bool {
    !matches!(
        command,
        Command::Flush | Command::Disc | Command::Unknown(_)
    )
}

/// Checks a request against the negotiated session and the export's current size.
pub(crate) fn validate(
    header: &RequestHeader,
    params: &Params,
    size: u64,
) -> Result<(), Rejection> {
    let (command, offset, length) = (header.command, header.offset, header.length);
    if let Command::Unknown(code) = command {
        return reject(
            EINVAL,
            Violation::UnknownCommand,
            format!("unknown command {code}"),
        );
    }
    let stray = header.flags & !allowed_flags(command);
    if stray != 0 {
        let message = format!("flags {stray:#x} are not valid for {command:?}");
        return reject(EINVAL, Violation::BadFlags, message);
    }
    if command == Command::BlockStatus && !(params.structured && params.allocation) {
        let message = "block status needs structured replies and base:allocation".to_string();
        return reject(EINVAL, Violation::NotNegotiated, message);
    }
    if command == Command::Flush && (offset != 0 || length != 0) {
        return reject(
            EINVAL,
            Violation::NonZeroFields,
            "flush offset and length must be zero".into(),
        );
    }
    check_payload_size(command, length, params)?;
    if addresses_data(command) {
        check_alignment(offset, length, params.min_block)?;
        check_bounds(command, offset, length, size)?;
    }
    if command == Command::BlockStatus && length == 0 {
        return reject(
            EINVAL,
            Violation::ZeroLength,
            "block status of zero bytes".into(),
        );
    }
    Ok(())
}

/// READ and WRITE move their length in one message, so it must fit the advertised maximum.
/// TRIM, WRITE_ZEROES and BLOCK_STATUS move no payload and may be larger.
fn check_payload_size(command: Command, length: u32, params: &Params) -> Result<(), Rejection> {
    if !matches!(command, Command::Read | Command::Write) || length <= params.max_request {
        return Ok(());
    }
    // With structured replies the protocol names EOVERFLOW for reads it will not serve in
    // one piece; everything else gets EINVAL.
    let errno = if command == Command::Read && params.structured {
        EOVERFLOW
    } else {
        EINVAL
    };
    let message = format!(
        "{length} bytes exceed the maximum request of {}",
        params.max_request
    );
    reject(errno, Violation::Oversized, message)
}

fn check_alignment(offset: u64, length: u32, min_block: u32) -> Result<(), Rejection> {
    let block = u64::from(min_block.max(1));
    if offset.is_multiple_of(block) && u64::from(length).is_multiple_of(block) {
        return Ok(());
    }
    let message = format!("[{offset}, +{length}) is not aligned to {block} bytes");
    reject(EINVAL, Violation::Misaligned, message)
}

fn check_bounds(command: Command, offset: u64, length: u32, size: u64) -> Result<(), Rejection> {
    match check_range(offset, u64::from(length), size) {
        Ok(()) => Ok(()),
        Err(error) => reject(
            errno_for(command, &error),
            Violation::OutOfRange,
            error.to_string(),
        ),
    }
}

/// The NBD error value for a device error. Past-the-end writes (WRITE, WRITE_ZEROES) are
/// ENOSPC and past-the-end reads, trims and status queries EINVAL, as the protocol asks.
pub(crate) fn errno_for(command: Command, error: &IoError) -> u32 {
    match error {
        // NBD has no "not ready, try again": EIO, as for any failed request.
        IoError::Io(_) | IoError::NotServing(_) => EIO,
        IoError::OutOfRange { .. } if matches!(command, Command::Write | Command::WriteZeroes) => {
            ENOSPC
        }
        IoError::OutOfRange { .. } | IoError::Invalid(_) => EINVAL,
        IoError::NoSpace => ENOSPC,
        IoError::ShuttingDown => ESHUTDOWN,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PARAMS: Params = Params {
        structured: true,
        allocation: true,
        min_block: 1,
        max_request: 1 << 20,
    };

    fn header(command: Command, flags: u16, offset: u64, length: u32) -> RequestHeader {
        RequestHeader {
            flags,
            command,
            cookie: 1,
            offset,
            length,
        }
    }

    fn errno(h: RequestHeader, params: &Params) -> Option<u32> {
        validate(&h, params, 1 << 20).err().map(|r| r.errno)
    }

    #[test]
    fn accepts_ordinary_requests() {
        for command in [
            Command::Read,
            Command::Write,
            Command::Trim,
            Command::WriteZeroes,
            Command::BlockStatus,
        ] {
            assert_eq!(
                errno(header(command, 0, 4096, 4096), &PARAMS),
                None,
                "{command:?}"
            );
        }
        assert_eq!(
            errno(header(Command::Flush, CMD_FLAG_FUA, 0, 0), &PARAMS),
            None
        );
        assert_eq!(
            errno(
                header(Command::WriteZeroes, CMD_FLAG_NO_HOLE, 0, 1 << 20),
                &PARAMS
            ),
            None
        );
        assert_eq!(
            errno(
                header(Command::BlockStatus, CMD_FLAG_REQ_ONE, 0, 1),
                &PARAMS
            ),
            None
        );
    }

    #[test]
    fn zero_length_is_fine_except_block_status() {
        assert_eq!(errno(header(Command::Read, 0, 1 << 20, 0), &PARAMS), None);
        assert_eq!(errno(header(Command::Write, 0, 0, 0), &PARAMS), None);
        assert_eq!(
            errno(header(Command::BlockStatus, 0, 0, 0), &PARAMS),
            Some(EINVAL)
        );
    }

    #[test]
    fn out_of_range_errors_follow_the_protocol() {
        let past = |command| errno(header(command, 0, (1 << 20) - 512, 1024), &PARAMS);
        assert_eq!(past(Command::Read), Some(EINVAL));
        assert_eq!(past(Command::Trim), Some(EINVAL));
        assert_eq!(past(Command::BlockStatus), Some(EINVAL));
        assert_eq!(past(Command::Write), Some(ENOSPC));
        assert_eq!(past(Command::WriteZeroes), Some(ENOSPC));
        assert_eq!(
            errno(header(Command::Read, 0, u64::MAX - 10, 4096), &PARAMS),
            Some(EINVAL)
        );
    }

    #[test]
    fn rejects_bad_commands_flags_and_sizes() {
        assert_eq!(
            errno(header(Command::Unknown(42), 0, 0, 0), &PARAMS),
            Some(EINVAL)
        );
        assert_eq!(
            errno(header(Command::Read, CMD_FLAG_NO_HOLE, 0, 1), &PARAMS),
            Some(EINVAL)
        );
        assert_eq!(
            errno(header(Command::Read, 1 << 4, 0, 1), &PARAMS),
            Some(EINVAL)
        );
        assert_eq!(
            errno(header(Command::Flush, 0, 1, 0), &PARAMS),
            Some(EINVAL)
        );
        assert_eq!(
            errno(header(Command::Read, 0, 0, (1 << 20) + 1), &PARAMS),
            Some(EOVERFLOW)
        );
        let simple = Params {
            structured: false,
            allocation: false,
            ..PARAMS
        };
        assert_eq!(
            errno(header(Command::Read, 0, 0, (1 << 20) + 1), &simple),
            Some(EINVAL)
        );
        assert_eq!(
            errno(header(Command::BlockStatus, 0, 0, 512), &simple),
            Some(EINVAL)
        );
        let no_context = Params {
            allocation: false,
            ..PARAMS
        };
        assert_eq!(
            errno(header(Command::BlockStatus, 0, 0, 512), &no_context),
            Some(EINVAL)
        );
    }

    #[test]
    fn enforces_minimum_block_alignment() {
        let aligned = Params {
            min_block: 512,
            ..PARAMS
        };
        assert_eq!(errno(header(Command::Read, 0, 512, 1024), &aligned), None);
        assert_eq!(
            errno(header(Command::Read, 0, 100, 512), &aligned),
            Some(EINVAL)
        );
        assert_eq!(
            errno(header(Command::Write, 0, 512, 100), &aligned),
            Some(EINVAL)
        );
        assert_eq!(errno(header(Command::Flush, 0, 0, 0), &aligned), None);
    }

    #[test]
    fn io_errors_map_to_nbd_values() {
        assert_eq!(errno_for(Command::Read, &IoError::Io("x".into())), EIO);
        assert_eq!(
            errno_for(Command::Write, &IoError::NotServing("x".into())),
            EIO
        );
        assert_eq!(
            errno_for(Command::Read, &IoError::Invalid("x".into())),
            EINVAL
        );
        assert_eq!(errno_for(Command::Write, &IoError::NoSpace), ENOSPC);
        assert_eq!(errno_for(Command::Flush, &IoError::ShuttingDown), ESHUTDOWN);
        let range = IoError::OutOfRange {
            offset: 0,
            length: 1,
            size: 0,
        };
        assert_eq!(errno_for(Command::Write, &range), ENOSPC);
        assert_eq!(errno_for(Command::Trim, &range), EINVAL);
    }
}

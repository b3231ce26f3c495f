//! A write command's data as it arrives (immediate data, then Data-Out PDUs in order), in a
//! 4 KiB-aligned buffer of the node's pools, so the disk writes from it without a copy.

use ashlar_core::buffers::DiskBuf;
use bytes::Bytes;

pub(crate) struct TransferBuffer {
    buf: DiskBuf,
    filled: usize,
}

impl TransferBuffer {
    /// Room for `capacity` bytes, none received yet.
    pub(crate) fn with_capacity(capacity: usize) -> TransferBuffer {
        TransferBuffer {
            buf: DiskBuf::for_overwrite(capacity),
            filled: 0,
        }
    }

    /// Bytes received so far.
    pub(crate) fn len(&self) -> usize {
        self.filled
    }

    /// Makes room for `additional` more bytes than received so far. Called once, when the
    /// data budget for the solicited bytes is granted: unsolicited data needs no budget, so
    /// until then the buffer holds at most FirstBurstLength.
    pub(crate) fn reserve(&mut self, additional: usize) {
        let needed = self.filled + additional;
        if needed <= self.buf.len() {
            return;
        }
        let mut grown = DiskBuf::for_overwrite(needed);
        grown.as_mut_slice()[..self.filled].copy_from_slice(&self.buf.as_slice()[..self.filled]);
        self.buf = grown;
    }

    /// Appends `data`; the caller has checked it fits the transfer (at most its expected length,
    /// for which room was made).
    pub(crate) fn extend_from_slice(&mut self, data: &[u8]) {
        let end = self.filled + data.len();
        assert!(
            end <= self.buf.len(),
            "Data-Out beyond the transfer's buffer"
        );
        self.buf.as_mut_slice()[self.filled..end].copy_from_slice(data);
        self.filled = end;
    }

    /// The bytes received, sharing the buffer.
    pub(crate) fn freeze(self) -> Bytes {
        let filled = self.filled;
        self.buf.into_bytes().slice(..filled)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_arrives_in_order_into_an_aligned_buffer_that_grows_once() {
        let mut transfer = TransferBuffer::with_capacity(8192);
        transfer.extend_from_slice(&[1; 8192]);
        transfer.reserve(3 * 8192);
        transfer.extend_from_slice(&[2; 3 * 8192]);
        assert_eq!(transfer.len(), 4 * 8192);
        let bytes = transfer.freeze();
        assert_eq!(bytes.as_ptr() as usize % 4096, 0);
        assert_eq!(bytes.len(), 4 * 8192);
        assert!(bytes[..8192].iter().all(|&b| b == 1));
        assert!(bytes[8192..].iter().all(|&b| b == 2));
    }
}

//! A write command's data as it arrives (immediate data, then Data-Out PDUs in order), in a
//! 4 KiB-aligned buffer of the node's pools, so the disk writes from it without a copy.

use ashlar_core::buffers::DiskBuf;
use bytes::Bytes;

pub(crate) struct TransferBuffer {
    buf: DiskBuf,
    filled: usize,
    /// `buf` is lent out to receive the next bytes (see [`TransferBuffer::lend`]).
    lent: bool,
}

/// A transfer's buffer lent out to receive its next bytes straight from the socket.
pub(crate) struct Receiving {
    buf: DiskBuf,
    at: usize,
    len: usize,
}

impl Receiving {
    /// Where the bytes go.
    pub(crate) fn target(&mut self) -> &mut [u8] {
        &mut self.buf.as_mut_slice()[self.at..self.at + self.len]
    }
}

impl TransferBuffer {
    /// Room for `capacity` bytes, none received yet.
    pub(crate) fn with_capacity(capacity: usize) -> TransferBuffer {
        TransferBuffer {
            buf: DiskBuf::for_overwrite(capacity),
            filled: 0,
            lent: false,
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
        assert!(!self.lent, "a lent transfer buffer grows");
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
        let mut receiving = self.lend(data.len());
        receiving.target().copy_from_slice(data);
        self.take_back(receiving);
    }

    /// Lends the buffer out to receive the next `len` bytes (the caller has checked they fit,
    /// as for [`TransferBuffer::extend_from_slice`]); [`TransferBuffer::take_back`] counts
    /// them in. Meanwhile the transfer holds no memory and does not grow or end.
    pub(crate) fn lend(&mut self, len: usize) -> Receiving {
        assert!(!self.lent, "a transfer buffer lent twice");
        let end = self.filled + len;
        assert!(
            end <= self.buf.len(),
            "Data-Out beyond the transfer's buffer"
        );
        self.lent = true;
        Receiving {
            buf: std::mem::replace(&mut self.buf, DiskBuf::zeroed(0)),
            at: self.filled,
            len,
        }
    }

    /// Takes back the buffer lent out, with its bytes received.
    pub(crate) fn take_back(&mut self, receiving: Receiving) {
        assert!(
            self.lent && receiving.at == self.filled,
            "a transfer buffer taken back that was not lent from here"
        );
        self.buf = receiving.buf;
        self.filled += receiving.len;
        self.lent = false;
    }

    /// The bytes received, sharing the buffer.
    pub(crate) fn freeze(self) -> Bytes {
        assert!(!self.lent, "a lent transfer buffer ends");
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

    #[test]
    fn data_received_in_place_counts_once_taken_back() {
        let mut transfer = TransferBuffer::with_capacity(3 * 4096);
        transfer.extend_from_slice(&[1; 4096]);
        let mut receiving = transfer.lend(8192);
        assert_eq!(
            transfer.len(),
            4096,
            "lent bytes count only once taken back"
        );
        receiving.target().fill(2);
        transfer.take_back(receiving);
        assert_eq!(transfer.len(), 3 * 4096);
        let bytes = transfer.freeze();
        assert!(bytes[..4096].iter().all(|&b| b == 1));
        assert!(bytes[4096..].iter().all(|&b| b == 2));
    }

    #[test]
    #[should_panic(expected = "beyond the transfer's buffer")]
    fn lending_past_the_buffer_is_refused() {
        let mut transfer = TransferBuffer::with_capacity(4096);
        let _ = transfer.lend(4097);
    }
}

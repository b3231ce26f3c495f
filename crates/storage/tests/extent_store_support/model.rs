//! A workload's operations and the image they leave, to compare an extent store against.

use ashlar_storage::extent_store::WriteBatch;

#[derive(Clone, Debug)]
pub enum TestOp {
    Write(u64, Vec<u8>),
    Zero(u64, u64),
}

impl TestOp {
    /// `(offset, length)` of the operation.
    pub fn range(&self) -> (u64, u64) {
        match self {
            TestOp::Write(at, data) => (*at, data.len() as u64),
            TestOp::Zero(at, length) => (*at, *length),
        }
    }
}

/// Applies `ops` to `image` (the vdisk from offset 0).
pub fn apply_model(image: &mut [u8], ops: &[TestOp]) {
    for op in ops {
        match op {
            TestOp::Write(at, data) => {
                image[*at as usize..*at as usize + data.len()].copy_from_slice(data)
            }
            TestOp::Zero(at, length) => image[*at as usize..(at + length) as usize].fill(0),
        }
    }
}

/// The operations as one write batch.
pub fn write_batch(ops: &[TestOp]) -> WriteBatch<'_> {
    let mut batch = WriteBatch::new();
    for op in ops {
        match op {
            TestOp::Write(at, data) => batch.write(*at, data),
            TestOp::Zero(at, length) => batch.write_zeroes(*at, *length),
        };
    }
    batch
}

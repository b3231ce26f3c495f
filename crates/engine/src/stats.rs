//! Lock-free I/O statistics: counters and latency histograms updated with relaxed atomics from
//! any reactor, read by the stats endpoints.

use serde::Serialize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Sub-buckets per power of two: 8 gives ≤ 12.5 % relative error on percentiles.
const SUB_BUCKET_BITS: u32 = 3;
const SUB_BUCKETS: usize = 1 << SUB_BUCKET_BITS;
const BUCKETS: usize = 64 * SUB_BUCKETS;

/// Latency histogram in nanoseconds with log-linear buckets.
pub struct LatencyHistogram {
    buckets: Box<[AtomicU64]>,
}

impl Default for LatencyHistogram {
    fn default() -> Self {
        LatencyHistogram {
            buckets: (0..BUCKETS).map(|_| AtomicU64::new(0)).collect(),
        }
    }
}

fn bucket_of(nanos: u64) -> usize {
    if nanos < SUB_BUCKETS as u64 {
        return nanos as usize;
    }
    let power = 63 - nanos.leading_zeros();
    let mantissa = (nanos >> (power - SUB_BUCKET_BITS)) as usize & (SUB_BUCKETS - 1);
    ((power - SUB_BUCKET_BITS + 1) as usize) * SUB_BUCKETS + mantissa
}

/// Upper bound (exclusive) in nanoseconds of a bucket's values.
fn bucket_upper_nanos(bucket: usize) -> u64 {
    if bucket < SUB_BUCKETS {
        return bucket as u64 + 1;
    }
    let power = (bucket / SUB_BUCKETS) as u32 + SUB_BUCKET_BITS - 1;
    let mantissa = (bucket % SUB_BUCKETS) as u64;
    let base = 1u64 << power;
    base + (mantissa + 1) * (base >> SUB_BUCKET_BITS)
}

impl LatencyHistogram {
    pub fn record(&self, latency: Duration) {
        let nanos = u64::try_from(latency.as_nanos()).unwrap_or(u64::MAX);
        self.buckets[bucket_of(nanos).min(BUCKETS - 1)].fetch_add(1, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> Vec<u64> {
        self.buckets
            .iter()
            .map(|b| b.load(Ordering::Relaxed))
            .collect()
    }

    /// Percentile (0..=100) of the values in `counts` (a snapshot or a difference of two), in µs.
    pub fn percentile_micros(counts: &[u64], percentile: f64) -> f64 {
        let total: u64 = counts.iter().sum();
        if total == 0 {
            return 0.0;
        }
        let rank = ((percentile / 100.0) * total as f64).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (bucket, count) in counts.iter().enumerate() {
            seen += count;
            if seen >= rank {
                return bucket_upper_nanos(bucket) as f64 / 1000.0;
            }
        }
        bucket_upper_nanos(BUCKETS - 1) as f64 / 1000.0
    }
}

/// Per-vdisk I/O counters.
#[derive(Default)]
pub struct VdiskCounters {
    pub read_ops: AtomicU64,
    pub write_ops: AtomicU64,
    pub read_bytes: AtomicU64,
    pub write_bytes: AtomicU64,
    pub errors: AtomicU64,
    pub read_latency: LatencyHistogram,
    pub write_latency: LatencyHistogram,
    /// Latencies of every read and write summed, in nanoseconds (a mean over any interval,
    /// which an online resync paces itself by).
    pub latency_nanos: AtomicU64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpKind {
    Read,
    Write,
}

impl VdiskCounters {
    pub fn record(&self, kind: OpKind, bytes: u64, latency: Duration, ok: bool) {
        if !ok {
            self.errors.fetch_add(1, Ordering::Relaxed);
        }
        let (ops, total, histogram) = match kind {
            OpKind::Read => (&self.read_ops, &self.read_bytes, &self.read_latency),
            OpKind::Write => (&self.write_ops, &self.write_bytes, &self.write_latency),
        };
        ops.fetch_add(1, Ordering::Relaxed);
        total.fetch_add(bytes, Ordering::Relaxed);
        histogram.record(latency);
        let nanos = u64::try_from(latency.as_nanos()).unwrap_or(u64::MAX);
        self.latency_nanos.fetch_add(nanos, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> CounterSnapshot {
        CounterSnapshot {
            read_ops: self.read_ops.load(Ordering::Relaxed),
            write_ops: self.write_ops.load(Ordering::Relaxed),
            read_bytes: self.read_bytes.load(Ordering::Relaxed),
            write_bytes: self.write_bytes.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
            read_latency: self.read_latency.snapshot(),
            write_latency: self.write_latency.snapshot(),
        }
    }
}

#[derive(Clone, Debug, Default)]
pub struct CounterSnapshot {
    pub read_ops: u64,
    pub write_ops: u64,
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub errors: u64,
    pub read_latency: Vec<u64>,
    pub write_latency: Vec<u64>,
}

/// Rates over the last sampling interval and cumulative latency percentiles.
#[derive(Clone, Debug, Default, Serialize)]
pub struct IoRates {
    pub read_iops: f64,
    pub write_iops: f64,
    pub read_bytes_per_second: f64,
    pub write_bytes_per_second: f64,
    pub read_latency_p50_us: f64,
    pub read_latency_p99_us: f64,
    pub write_latency_p50_us: f64,
    pub write_latency_p99_us: f64,
}

impl CounterSnapshot {
    /// Rates between `earlier` and `self` over `interval`; percentiles over that interval when
    /// it saw I/O, else over the whole life of the counters.
    pub fn rates_since(&self, earlier: &CounterSnapshot, interval: Duration) -> IoRates {
        let seconds = interval.as_secs_f64().max(1e-9);
        let per_second = |now: u64, then: u64| now.saturating_sub(then) as f64 / seconds;
        let window = |now: &Vec<u64>, then: &Vec<u64>| -> Vec<u64> {
            let diff: Vec<u64> = if then.len() == now.len() {
                now.iter()
                    .zip(then)
                    .map(|(a, b)| a.saturating_sub(*b))
                    .collect()
            } else {
                now.clone()
            };
            if diff.iter().any(|&c| c > 0) {
                diff
            } else {
                now.clone()
            }
        };
        let reads = window(&self.read_latency, &earlier.read_latency);
        let writes = window(&self.write_latency, &earlier.write_latency);
        IoRates {
            read_iops: per_second(self.read_ops, earlier.read_ops),
            write_iops: per_second(self.write_ops, earlier.write_ops),
            read_bytes_per_second: per_second(self.read_bytes, earlier.read_bytes),
            write_bytes_per_second: per_second(self.write_bytes, earlier.write_bytes),
            read_latency_p50_us: LatencyHistogram::percentile_micros(&reads, 50.0),
            read_latency_p99_us: LatencyHistogram::percentile_micros(&reads, 99.0),
            write_latency_p50_us: LatencyHistogram::percentile_micros(&writes, 50.0),
            write_latency_p99_us: LatencyHistogram::percentile_micros(&writes, 99.0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_monotonic_and_bound_their_values() {
        let mut last = 0;
        for nanos in [0u64, 1, 7, 8, 9, 100, 1_000, 65_535, 1 << 20, 1 << 40] {
            let bucket = bucket_of(nanos);
            assert!(bucket >= last);
            assert!(
                bucket_upper_nanos(bucket) > nanos,
                "{nanos} in bucket {bucket}"
            );
            last = bucket;
        }
    }

    #[test]
    fn percentiles_are_within_bucket_precision() {
        let histogram = LatencyHistogram::default();
        for micros in 1..=100u64 {
            histogram.record(Duration::from_micros(micros));
        }
        let counts = histogram.snapshot();
        let p50 = LatencyHistogram::percentile_micros(&counts, 50.0);
        let p99 = LatencyHistogram::percentile_micros(&counts, 99.0);
        assert!((50.0..=57.0).contains(&p50), "p50 {p50}");
        assert!((99.0..=113.0).contains(&p99), "p99 {p99}");
    }
}

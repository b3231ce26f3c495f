//! Prometheus text exposition of the engine's counters (format 0.0.4), written by hand: it is
//! a few lines and needs no extra dependency.

use crate::registry::NodeEngine;
use std::fmt::Write;

fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

pub fn render_metrics(engine: &NodeEngine) -> String {
    let mut out = String::new();
    let stats = engine.vdisk_stats();
    type Getter = fn(&ashlar_engine::VdiskStats) -> f64;
    let vdisk_metrics: [(&str, &str, &str, Getter); 12] = [
        (
            "ashlar_vdisk_read_ops_total",
            "counter",
            "Reads completed.",
            |s| s.read_ops as f64,
        ),
        (
            "ashlar_vdisk_write_ops_total",
            "counter",
            "Writes and write-zeroes completed.",
            |s| s.write_ops as f64,
        ),
        (
            "ashlar_vdisk_read_bytes_total",
            "counter",
            "Bytes read.",
            |s| s.read_bytes as f64,
        ),
        (
            "ashlar_vdisk_write_bytes_total",
            "counter",
            "Bytes written.",
            |s| s.write_bytes as f64,
        ),
        (
            "ashlar_vdisk_errors_total",
            "counter",
            "I/Os that failed.",
            |s| s.errors as f64,
        ),
        (
            "ashlar_vdisk_size_bytes",
            "gauge",
            "Provisioned size.",
            |s| s.size_bytes as f64,
        ),
        (
            "ashlar_vdisk_shards",
            "gauge",
            "Shard controllers serving the vdisk.",
            |s| s.shards as f64,
        ),
        (
            "ashlar_vdisk_connections",
            "gauge",
            "Connected clients.",
            |s| s.connections as f64,
        ),
        (
            "ashlar_vdisk_oplog_usage_bytes",
            "gauge",
            "Oplog segment bytes in use.",
            |s| s.oplog_usage_bytes as f64,
        ),
        (
            "ashlar_vdisk_oplog_live_bytes",
            "gauge",
            "Vdisk bytes whose newest data is only in the oplog (not yet drained).",
            |s| s.oplog_live_bytes as f64,
        ),
        (
            "ashlar_vdisk_read_latency_p99_seconds",
            "gauge",
            "Read latency, 99th percentile over the last interval.",
            |s| s.rates.read_latency_p99_us / 1e6,
        ),
        (
            "ashlar_vdisk_write_latency_p99_seconds",
            "gauge",
            "Write latency, 99th percentile over the last interval.",
            |s| s.rates.write_latency_p99_us / 1e6,
        ),
    ];
    for (name, kind, help, get) in vdisk_metrics {
        family(&mut out, name, kind, help);
        for s in &stats {
            let _ = writeln!(out, "{name}{{vdisk=\"{}\"}} {}", s.name, get(s));
        }
    }
    let (cache, _) = engine.cache_stats();
    family(
        &mut out,
        "ashlar_cache_hits_total",
        "counter",
        "Read cache hits by pool.",
    );
    let _ = writeln!(
        out,
        "ashlar_cache_hits_total{{pool=\"single_touch\"}} {}",
        cache.single_touch_hits
    );
    let _ = writeln!(
        out,
        "ashlar_cache_hits_total{{pool=\"multi_touch\"}} {}",
        cache.multi_touch_hits
    );
    family(
        &mut out,
        "ashlar_cache_misses_total",
        "counter",
        "Read cache misses.",
    );
    let _ = writeln!(out, "ashlar_cache_misses_total {}", cache.misses);
    family(
        &mut out,
        "ashlar_cache_bytes",
        "gauge",
        "Bytes held by each cache pool.",
    );
    let _ = writeln!(
        out,
        "ashlar_cache_bytes{{pool=\"single_touch\"}} {}",
        cache.single_touch_bytes
    );
    let _ = writeln!(
        out,
        "ashlar_cache_bytes{{pool=\"multi_touch\"}} {}",
        cache.multi_touch_bytes
    );
    family(
        &mut out,
        "ashlar_cache_capacity_bytes",
        "gauge",
        "Configured cache capacity.",
    );
    let _ = writeln!(out, "ashlar_cache_capacity_bytes {}", cache.capacity_bytes);
    out
}

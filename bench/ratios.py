#!/usr/bin/env python3
"""Ratios of Ashlar to the reference systems from one run's results.tsv (same run, same jobs).

Usage: ratios.py RESULTS_DIR/results.tsv  -> Markdown on stdout.

Reads results.tsv (one row per fio job, from ../shared/bench/peers/lib.sh), the fio JSON beside it
(json/, for p50 latencies) and pagecache.tsv (from cold.sh) if present. Every target row says
MET or missed; a row whose inputs were not measured in this run says "not measured", and rows
with no goal are shown for information.
"""
import json
import os
import sys

COLUMNS = ["system", "workload", "qd", "iops", "mibs", "mean_us", "p99_us", "srv_cpu_s", "total_ios",
           "fio_usr", "fio_sys", "fio_cpu_s", "client_cpu_s", "host_busy_s", "elapsed_s", "status"]


ISCSI_SYSTEMS = ["tgt-iscsi", "ashlar-iscsi", "ashlar-iscsi-nbd"]
ISCSI_ORDER = {w: i for i, w in enumerate(["randread4k", "randwrite4k", "seqread1m", "seqwrite1m"])}
COLD_SYSTEMS = ["ashlar-cold", "raw-cold", "raw-cold-flush", "raw-cold-dsync", "nbdkit-memory-cold", "nbdkit-file-fua-cold"]


def load(path):
    rows = {}
    for line in open(path):
        fields = line.rstrip("\n").split("\t")
        if len(fields) < len(COLUMNS) or fields[0] == "system":
            continue
        row = dict(zip(COLUMNS, fields))
        if row["status"] != "ok":
            continue
        rows[(row["system"], row["workload"], row["qd"])] = row
    return rows


def num(value):
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def iops_per_cpu(row):
    cpu, ios = num(row["srv_cpu_s"]), num(row["total_ios"])
    return ios / cpu if cpu and ios else None


P50_CACHE = {}


def p50_us(results_dir, row):
    """p50 total latency of a job: from fio's JSON, or from p50.tsv (run.sh keeps it when it
    deletes json/)."""
    path = os.path.join(results_dir, "json", f"{row['system']}.{row['workload']}.qd{row['qd']}.json")
    try:
        job = json.load(open(path))["jobs"][0]["mixed"]
        return job["lat_ns"]["percentile"]["50.000000"] / 1000
    except (OSError, KeyError, ValueError):
        pass
    if results_dir not in P50_CACHE:
        P50_CACHE[results_dir] = {}
        try:
            for line in open(os.path.join(results_dir, "p50.tsv")):
                f = line.rstrip("\n").split("\t")
                if len(f) == 4:
                    P50_CACHE[results_dir][tuple(f[:3])] = num(f[3])
        except OSError:
            pass
    return P50_CACHE[results_dir].get((row["system"], row["workload"], row["qd"]))


def load_pagecache(results_dir):
    rows = []
    try:
        lines = open(os.path.join(results_dir, "pagecache.tsv")).read().splitlines()
    except OSError:
        return rows
    if not lines:
        return rows
    keys = lines[0].split("\t")
    for line in lines[1:]:
        row = dict(zip(keys, line.split("\t")))
        if row.get("status") == "ok":
            rows.append(row)
    return rows


def ratio(a, b):
    return f"{a / b:.2f}x" if a is not None and b else "n/a"


def main():
    path = sys.argv[1]
    results_dir = os.path.dirname(path)
    rows = load(path)
    get = lambda s, w, q: rows.get((s, w, q))
    out = ["## Ashlar against its targets (same run)", "",
           "| target | Ashlar | reference | ratio | goal | met |", "|---|---:|---:|---:|---:|---|"]

    def target(name, ours, theirs, goal, higher_is_better=True, ref_label=""):
        """One row; goal None = information only (no verdict)."""
        sign = "≥" if higher_is_better else "≤"
        goal_cell = f"{sign} {goal}" if goal is not None else "-"
        if ours is None or theirs is None or not theirs:
            out.append(f"| {name} | n/a | n/a | n/a | {goal_cell} | not measured |")
            return
        r = ours / theirs
        if goal is None:
            verdict = "info"
        else:
            verdict = "MET" if (r >= goal if higher_is_better else r <= goal) else "missed"
        ref = f"{theirs:,.1f}" + (f" ({ref_label})" if ref_label else "")
        out.append(f"| {name} | {ours:,.1f} | {ref} | {r:.2f}x | {goal_cell} | {verdict} |")

    def field(row, key):
        return row and num(row[key])

    def p50(row):
        return row and p50_us(results_dir, row)

    # Cached reads (the matrix of ashlar.sh and nbdkit.sh).
    a, m = get("ashlar", "randread4k", "32"), get("nbdkit-memory", "randread4k", "32")
    target("4k randread QD32 cached: IOPS per server CPU-s vs nbdkit-memory",
           a and iops_per_cpu(a), m and iops_per_cpu(m), 1.5)
    a, f = get("ashlar-uncached", "randread4k", "32"), get("nbdkit-file", "randread4k", "32")
    target("4k randread QD32 uncached: IOPS vs nbdkit-file", field(a, "iops"), field(f, "iops"), 1.5)
    a, d = get("ashlar", "randwrite4k", "32"), get("raw-ext4-dsync", "randwrite4k", "32")
    target("4k randwrite QD32 durable: IOPS vs raw io_uring direct+dsync", field(a, "iops"), field(d, "iops"), 1.0)
    a, m = get("ashlar", "randread4k", "1"), get("nbdkit-memory", "randread4k", "1")
    target("4k randread QD1 p50 latency (µs) vs nbdkit-memory", p50(a), p50(m), 1.1, higher_is_better=False)

    # cold.sh, uncached stage: data larger than the node's cache, page cache dropped before each job.
    a, r = get("ashlar-cold", "randread4k", "32"), get("raw-cold", "randread4k", "32")
    target("cold 4k randread QD32: IOPS vs raw io_uring O_DIRECT", field(a, "iops"), field(r, "iops"), 0.8)
    a, r = get("ashlar-cold", "randread4k", "1"), get("raw-cold", "randread4k", "1")
    target("cold 4k randread QD1: IOPS vs raw io_uring O_DIRECT", field(a, "iops"), field(r, "iops"), None)
    target("cold 4k randread QD1: p50 latency (µs) vs raw io_uring O_DIRECT", p50(a), p50(r), None,
           higher_is_better=False)
    a, r = get("ashlar-cold", "seqread1m", "8"), get("raw-cold", "seqread1m", "8")
    target("cold 1M seqread QD8: MiB/s vs raw io_uring O_DIRECT", field(a, "mibs"), field(r, "mibs"), 0.8)
    a, r = get("ashlar-cold", "seqwrite1m", "8"), get("raw-cold", "seqwrite1m", "8")
    target("cold 1M seqwrite QD8 (Ashlar durable at ack): MiB/s vs raw io_uring O_DIRECT",
           field(a, "mibs"), field(r, "mibs"), 0.8)
    # What a server durable at acknowledgement can reach at all on this disk: raw with one
    # fdatasync per 8 writes (the fewest flushes 8 writes in flight allow), and Ashlar beside it.
    f = get("raw-cold-flush", "seqwrite1m", "8")
    target("(reference) raw 1M seqwrite QD8 with one fdatasync per 8 writes vs raw O_DIRECT",
           field(f, "mibs"), field(r, "mibs"), None)
    target("cold 1M seqwrite QD8: MiB/s vs raw with one fdatasync per 8 writes",
           field(a, "mibs"), field(f, "mibs"), None)

    # cold.sh, durable stage.
    a = get("ashlar-cold", "randwrite4k", "32")
    refs = [(field(get(s_, "randwrite4k", "32"), "iops"), s_) for s_ in ("raw-cold-dsync", "nbdkit-memory-cold")]
    refs = [(v, s_) for v, s_ in refs if v]
    best = min(refs) if len(refs) == 2 else (None, "")
    target("durable 4k randwrite QD32: IOPS vs min(raw dsync, nbdkit-memory)", field(a, "iops"), best[0], 0.8,
           ref_label=best[1])
    a, d = get("ashlar-cold", "randwrite4k", "1"), get("raw-cold-dsync", "randwrite4k", "1")
    target("durable 4k randwrite QD1: p50 latency (µs) vs raw io_uring direct+dsync", p50(a), p50(d), 1.5,
           higher_is_better=False)
    m = get("nbdkit-memory-cold", "randwrite4k", "1")
    target("durable 4k randwrite QD1: p50 latency (µs) vs nbdkit-memory", p50(a), p50(m), None,
           higher_is_better=False)
    # The simplest NBD server that is durable at reply, beside raw: how much of Ashlar's gap
    # to raw any durable NBD server pays on this machine.
    f = get("nbdkit-file-fua-cold", "randwrite4k", "1")
    target("durable 4k randwrite QD1: p50 latency (µs) vs nbdkit file + fua=force", p50(a), p50(f), None,
           higher_is_better=False)
    target("(reference) nbdkit file + fua=force QD1 p50 (µs) vs raw io_uring direct+dsync", p50(f), p50(d), None,
           higher_is_better=False)
    a32, f32 = get("ashlar-cold", "randwrite4k", "32"), get("nbdkit-file-fua-cold", "randwrite4k", "32")
    target("durable 4k randwrite QD32: IOPS vs nbdkit file + fua=force", field(a32, "iops"), field(f32, "iops"), None)

    # cold.sh, pagecache stage: bytes the page cache grew by / bytes read through the node.
    pagecache = load_pagecache(results_dir)
    on = [p for p in pagecache if p.get("direct_io") == "on"]
    p = on[-1] if on else None
    read = p and num(p["bytes_read"])
    mib = lambda v: v / 1048576 if v is not None else None
    target("page cache growth (meminfo Cached) reading through the node, MiB vs MiB read",
           mib(p and num(p["cached_growth"])), mib(read), 0.25, higher_is_better=False)
    target("node data files resident in the page cache (fincore) after that read, MiB vs MiB read",
           mib(p and num(p["fincore_growth"])), mib(read), None, higher_is_better=False)
    target("node RSS growth over that read, MiB vs MiB read", mib(p and num(p["rss_growth"])), mib(read), None,
           higher_is_better=False)
    for q in pagecache:
        if q.get("direct_io") != "on":
            target(f"(control, --direct-io {q['direct_io']}) page cache growth (meminfo Cached), MiB vs MiB read",
                   mib(num(q["cached_growth"])), mib(num(q["bytes_read"])), None, higher_is_better=False)

    # iscsi.sh (issue 8): Ashlar over iSCSI vs tgt, and vs Ashlar over NBD on the same vdisk.
    iscsi_jobs = sorted({(w, q) for s_, w, q in rows if s_ in ISCSI_SYSTEMS},
                        key=lambda k: (ISCSI_ORDER.get(k[0], 9), k[0], int(k[1])))
    for w, q in iscsi_jobs:
        a, t = get("ashlar-iscsi", w, q), get("tgt-iscsi", w, q)
        target(f"iSCSI {w} QD{q}: IOPS per server CPU-s vs tgt", a and iops_per_cpu(a), t and iops_per_cpu(t), 2.0)
    a, t = get("ashlar-iscsi", "randread4k", "1"), get("tgt-iscsi", "randread4k", "1")
    target("iSCSI 4k randread QD1: p50 latency (µs) vs tgt", p50(a), p50(t), 0.7, higher_is_better=False)
    for w, q in iscsi_jobs:
        a, n = get("ashlar-iscsi", w, q), get("ashlar-iscsi-nbd", w, q)
        target(f"iSCSI {w} QD{q}: Ashlar iSCSI IOPS vs Ashlar NBD (same vdisk)", field(a, "iops"), field(n, "iops"),
               0.85)

    two = get("ashlar-2shards", "randread4k", "32")
    m = get("nbdkit-memory", "randread4k", "32")
    if two and m and iops_per_cpu(two):
        qd1 = get("ashlar-2shards", "randread4k", "1")
        qd1_p50 = qd1 and p50_us(results_dir, qd1)
        out += ["", "For comparison, with the vdisk on two shards (`--default-shards 2`, half of the "
                "requests cross reactors), 4k randread QD32 cached gives "
                f"{iops_per_cpu(two):,.0f} IOPS per server CPU-s, "
                f"{ratio(iops_per_cpu(two), iops_per_cpu(m))} of nbdkit-memory's"
                + (f"; its QD1 p50 is {qd1_p50:.1f} µs." if qd1_p50 else ".")]

    systems = sorted({s for s, _, _ in rows if not s.startswith("ashlar") and not s.endswith("-cold")
                      and not s.endswith("-cold-dsync") and s not in ISCSI_SYSTEMS})
    if any(s_ == "ashlar" for s_, _, _ in rows):   # the matrix ran (STAGES with ashlar)
        out += ["", "## Ashlar IOPS as a ratio of each reference, per job", "",
                "| workload | QD | Ashlar IOPS | IOPS/srv-CPU-s | " + " | ".join(systems) + " |",
                "|---|---:|---:|---:|" + "---:|" * len(systems)]
    for (s, w, q), row in sorted(rows.items(), key=lambda kv: (kv[0][1], int(kv[0][2]))):
        if s != "ashlar":
            continue
        ours = num(row["iops"])
        cells = [ratio(ours, num(rows[(o, w, q)]["iops"])) if (o, w, q) in rows else "-" for o in systems]
        ipc = iops_per_cpu(row)
        out.append(f"| {w} | {q} | {ours:,.0f} | {ipc:,.0f} | " + " | ".join(cells) + " |" if ipc else
                   f"| {w} | {q} | {ours:,.0f} | - | " + " | ".join(cells) + " |")
    cold = [k for k in rows if k[0] in COLD_SYSTEMS]
    if cold:
        out += ["", "## Cold stage per job (cold.sh: page cache dropped before each job, data larger than the "
                "node's cache)", "",
                "| system | workload | QD | IOPS | MiB/s | p50 µs | p99 µs | srv CPU s | IO/srv-CPU-s |",
                "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        order = {w: i for i, w in enumerate(["randread4k", "seqread1m", "seqwrite1m", "randwrite4k"])}
        for s_, w, q in sorted(cold, key=lambda k: (order.get(k[1], 9), k[1], -int(k[2]), COLD_SYSTEMS.index(k[0]))):
            row = rows[(s_, w, q)]
            p = p50_us(results_dir, row)
            ipc = iops_per_cpu(row)
            out.append(f"| {s_} | {w} | {q} | {num(row['iops']):,.0f} | {num(row['mibs']):,.1f} | "
                       f"{f'{p:,.1f}' if p is not None else '-'} | {row['p99_us']} | {row['srv_cpu_s']} | "
                       f"{f'{ipc:,.0f}' if ipc else '-'} |")
    if iscsi_jobs:
        out += ["", "## iSCSI stage per job (iscsi.sh: tgt and Ashlar through fio's libiscsi engine, Ashlar "
                "also through fio's nbd engine on the same vdisk)", "",
                "| workload | QD | system | IOPS | MiB/s | p50 µs | p99 µs | srv CPU s | IO/srv-CPU-s | other s |",
                "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
        for w, q in iscsi_jobs:
            for s_ in ISCSI_SYSTEMS:
                row = get(s_, w, q)
                if not row:
                    out.append(f"| {w} | {q} | {s_} | not measured | | | | | | |")
                    continue
                p = p50_us(results_dir, row)
                ipc = iops_per_cpu(row)
                hb, sc, cc = num(row["host_busy_s"]), num(row["srv_cpu_s"]), num(row["client_cpu_s"])
                other = f"{max(0.0, hb - (sc or 0) - cc):.2f}" if hb is not None and cc is not None else "-"
                out.append(f"| {w} | {q} | {s_} | {num(row['iops']):,.0f} | {num(row['mibs']):,.1f} | "
                           f"{f'{p:,.1f}' if p is not None else '-'} | {row['p99_us']} | {row['srv_cpu_s']} | "
                           f"{f'{ipc:,.0f}' if ipc else '-'} | {other} |")
    pagecache = load_pagecache(results_dir)
    if pagecache:
        out += ["", "## Page cache growth while reading through the node (cold.sh)", "",
                "| --direct-io | read MiB | MiB/s | Cached grew MiB | node files in page cache MiB | "
                "node RSS grew MiB | cgroup cache grew MiB | node RSS after MiB |",
                "|---|---:|---:|---:|---:|---:|---:|---:|"]
        m = lambda v: f"{num(v) / 1048576:,.0f}" if num(v) is not None else "-"
        for q in pagecache:
            out.append(f"| {q['direct_io']} | {m(q['bytes_read'])} | {q['mibs']} | {m(q['cached_growth'])} | "
                       f"{m(q['fincore_growth'])} | {m(q['rss_growth'])} | {m(q['cgroup_cache_growth'])} | "
                       f"{m(q['rss_after'])} |")
    print("\n".join(out))


if __name__ == "__main__":
    main()

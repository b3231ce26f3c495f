#!/usr/bin/env python3
"""Ratios of Ashlar to the reference systems from one run's results.tsv (same run, same jobs).

Usage: ratios.py RESULTS_DIR/results.tsv  -> Markdown on stdout.
"""
import json
import os
import sys

COLUMNS = ["system", "workload", "qd", "iops", "mibs", "mean_us", "p99_us", "srv_cpu_s", "total_ios",
           "fio_usr", "fio_sys", "fio_cpu_s", "client_cpu_s", "host_busy_s", "elapsed_s", "status"]


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


def p50_us(results_dir, row):
    path = os.path.join(results_dir, "json", f"{row['system']}.{row['workload']}.qd{row['qd']}.json")
    try:
        job = json.load(open(path))["jobs"][0]["mixed"]
        return job["lat_ns"]["percentile"]["50.000000"] / 1000
    except (OSError, KeyError, ValueError):
        return None


def ratio(a, b):
    return f"{a / b:.2f}x" if a is not None and b else "n/a"


def main():
    path = sys.argv[1]
    results_dir = os.path.dirname(path)
    rows = load(path)
    get = lambda s, w, q: rows.get((s, w, q))
    out = ["## Ashlar against its targets (same run)", "",
           "| target | Ashlar | reference | ratio | goal | met |", "|---|---:|---:|---:|---:|---|"]

    def target(name, ours, theirs, goal, higher_is_better=True):
        if ours is None or theirs is None:
            out.append(f"| {name} | n/a | n/a | n/a | {goal} | not measured |")
            return
        r = ours / theirs
        met = r >= goal if higher_is_better else r <= goal
        out.append(f"| {name} | {ours:,.1f} | {theirs:,.1f} | {r:.2f}x | {'≥' if higher_is_better else '≤'} {goal} | {'yes' if met else 'NO'} |")

    a, m = get("ashlar", "randread4k", "32"), get("nbdkit-memory", "randread4k", "32")
    target("4k randread QD32 cached: IOPS per server CPU-s vs nbdkit-memory",
           a and iops_per_cpu(a), m and iops_per_cpu(m), 1.5)
    a, f = get("ashlar-uncached", "randread4k", "32"), get("nbdkit-file", "randread4k", "32")
    target("4k randread QD32 uncached: IOPS vs nbdkit-file", a and num(a["iops"]), f and num(f["iops"]), 1.5)
    a, d = get("ashlar", "randwrite4k", "32"), get("raw-ext4-dsync", "randwrite4k", "32")
    target("4k randwrite QD32 durable: IOPS vs raw io_uring direct+dsync", a and num(a["iops"]), d and num(d["iops"]), 1.0)
    a, m = get("ashlar", "randread4k", "1"), get("nbdkit-memory", "randread4k", "1")
    target("4k randread QD1 p50 latency (µs) vs nbdkit-memory", a and p50_us(results_dir, a),
           m and p50_us(results_dir, m), 1.1, higher_is_better=False)

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

    systems = sorted({s for s, _, _ in rows if not s.startswith("ashlar")})
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
    print("\n".join(out))


if __name__ == "__main__":
    main()

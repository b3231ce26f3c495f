#!/usr/bin/env python3
"""Issue 7's cluster targets from one peers run holding ashlar-rfN and ceph-bluestore-sN rows.

    bench/cluster-vs-ceph.py RESULTS_DIR > ratios.md

RESULTS_DIR is the run's directory (results.tsv and json/ from ../shared/bench/peers/lib.sh).
Latencies are fio's total latency (lat_ns, `--lat_percentiles=1`), the same for every row.
"""
import csv
import json
import sys
from pathlib import Path

run = Path(sys.argv[1])
rows = {}
with open(run / "results.tsv") as f:
    for row in csv.DictReader(f, delimiter="\t"):
        if row["status"] == "ok":
            rows[(row["system"], row["workload"], row["qd"])] = row


def p50_us(system, workload, qd):
    path = run / "json" / f"{system}.{workload}.qd{qd}.json"
    try:
        job = json.loads(path.read_text())["jobs"][0]["mixed"]
        return job["lat_ns"]["percentile"]["50.000000"] / 1000
    except (OSError, KeyError, ValueError):
        return None


def figure(system, workload, qd):
    row = rows.get((system, workload, qd))
    if row is None:
        return None
    iops = float(row["iops"])
    cpu = float(row["server_cpu_s"]) if row["server_cpu_s"] not in ("", "-") else None
    ios = float(row["total_ios"])
    return {
        "iops": iops,
        "p50": p50_us(system, workload, qd),
        "p99": float(row["lat_p99_us"]),
        "cpu": cpu,
        "per_cpu": ios / cpu if cpu else None,
    }


def fmt(value, digits=0):
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


jobs = [("randread4k", "1"), ("randread4k", "32"), ("randwrite4k", "1"),
        ("randwrite4k", "32"), ("randrw8k", "1"), ("randrw8k", "32")]
systems = sorted({key[0] for key in rows})
print(f"# Ashlar cluster beside Ceph, run {run.name}\n")
print("| system | job | IOPS | p50 us | p99 us | server CPU-s | IOPS per server CPU-s |")
print("|---|---|---:|---:|---:|---:|---:|")
for system in systems:
    for workload, qd in jobs:
        f = figure(system, workload, qd)
        if f:
            print(f"| {system} | {workload} QD{qd} | {fmt(f['iops'])} | {fmt(f['p50'], 1)} | "
                  f"{fmt(f['p99'], 1)} | {fmt(f['cpu'], 2)} | {fmt(f['per_cpu'])} |")

targets = [
    ("4 KiB random write QD32 IOPS", "randwrite4k", "32", "iops", ">=", 8.0),
    ("4 KiB random read QD32 IOPS", "randread4k", "32", "iops", ">=", 4.0),
    ("4 KiB random write QD1 p50", "randwrite4k", "1", "p50", "<=", 0.25),
    ("4 KiB random read QD1 p50", "randread4k", "1", "p50", "<=", 1 / 3),
    ("8 KiB 70/30 QD32 IOPS (no target)", "randrw8k", "32", "iops", None, None),
    ("IOPS per server CPU-s, 4 KiB random write QD32 (no target)", "randwrite4k", "32",
     "per_cpu", None, None),
]
print("\n## Against Ceph at the same replication factor\n")
print("| RF | measure | Ashlar | Ceph | ratio | target | met? |")
print("|---:|---|---:|---:|---:|---|---|")
for rf in ("2", "3"):
    for name, workload, qd, key, sense, goal in targets:
        ours = figure(f"ashlar-rf{rf}", workload, qd)
        theirs = figure(f"ceph-bluestore-s{rf}", workload, qd)
        if not ours or not theirs or ours[key] is None or not theirs[key]:
            print(f"| {rf} | {name} | - | - | - | | not measured |")
            continue
        ratio = ours[key] / theirs[key]
        if goal is None:
            verdict, target = "", ""
        else:
            met = ratio >= goal if sense == ">=" else ratio <= goal
            verdict, target = ("MET" if met else "missed"), f"{sense} {goal:.2f}x"
        print(f"| {rf} | {name} | {fmt(ours[key], 1)} | {fmt(theirs[key], 1)} | {ratio:.2f}x | "
              f"{target} | {verdict} |")

print("\n## Server CPU per acknowledged write, relative to RF 1 (target: RF 3 <= 3.75x)\n")
print("| job | RF 2 | RF 3 | RF 3 met? |")
print("|---|---:|---:|---|")
for workload, qd in [("randwrite4k", "1"), ("randwrite4k", "32")]:
    base = figure("ashlar-rf1", workload, qd)
    if not base or not base["per_cpu"]:
        continue
    cells = []
    for rf in ("2", "3"):
        f = figure(f"ashlar-rf{rf}", workload, qd)
        cells.append(base["per_cpu"] / f["per_cpu"] if f and f["per_cpu"] else None)
    met = "-" if cells[1] is None else ("MET" if cells[1] <= 3.75 else "missed")
    print(f"| {workload} QD{qd} | {fmt(cells[0], 2)}x | {fmt(cells[1], 2)}x | {met} |")

floor = figure("raw-ext4-dsync", "randwrite4k", "1")
if floor and floor["p50"]:
    print("\n## The disk's own floor for a durable write\n")
    print(f"raw fio io_uring direct=1 sync=dsync, 4 KiB random write QD1 on the same disk: p50 "
          f"{floor['p50']:.1f} us. One durable write on one node costs at least that; a QD1 "
          f"write p50 of 1/4 of Ceph's is below it wherever the row above asks for less.")
    for rf in ("2", "3"):
        theirs = figure(f"ceph-bluestore-s{rf}", "randwrite4k", "1")
        if theirs and theirs["p50"]:
            print(f"- RF {rf}: 1/4 of Ceph's p50 = {theirs['p50'] / 4:.1f} us, "
                  f"{theirs['p50'] / 4 / floor['p50']:.2f}x the raw dsync floor")

#!/usr/bin/env bash
# nbd-ab.sh — short fixed NBD jobs against one node, for A/B comparisons of two binaries:
# client IOPS, p50 latency and the node's CPU time per job (utime + stime from /proc),
# hence IOs per server CPU-second. Starts a single node (2 reactors, 3 GiB cache) with
# vdisk `bench` (1 GiB), fills it with 1 MiB writes and reads it twice (not measured), then
# runs each job of
# JOBS (rw:iodepth, 4 KiB blocks, random) for RUNTIME seconds (default 10).
#
#   bench/nbd-ab.sh BIN [NODE_ARGS...]      e.g. JOBS="randwrite:1 randread:1" bench/nbd-ab.sh B
#
# Prints one line per job: job iops p50_us cpu_s iops_per_cpu_s fio_cpus (the client's CPUs
# busy: near 1 means fio, not the node, set the pace). Reads are cached (the read
# pass leaves the vdisk in the node's cache); writes are durable when acknowledged. Alternate
# the binaries several times and compare medians: this machine is shared and noisy.
#
# PROBE, if set, is a command run 2 s into each job with `{pid}` replaced by the node's pid,
# e.g. PROBE='perf record -F 2999 -g -p {pid} -o /tmp/ab.perf -- sleep 4' for a profile.
set -euo pipefail
BIN=${1:?usage: nbd-ab.sh BIN [NODE_ARGS...]}
shift
JOBS=${JOBS:-"randwrite:1 randread:1 randwrite:32 randread:32"}
RUNTIME=${RUNTIME:-10}
DIR=/tmp/nbd-ab-node
rm -rf "$DIR"; mkdir -p "$DIR"
RUST_LOG=warn "$BIN" node --data-dir "$DIR" --nbd-listen 127.0.0.1:19102 \
    --http-listen 127.0.0.1:19103 --reactors 2 --cache-size 3G --ensure-vdisk bench:1G \
    "$@" > "$DIR.log" 2>&1 &
NODE=$!
trap 'kill $NODE 2>/dev/null; wait $NODE 2>/dev/null || true' EXIT
for _ in $(seq 50); do curl -sf http://127.0.0.1:19103/healthz >/dev/null && break; sleep 0.2; done
URI=nbd://127.0.0.1:19102/bench
# The 256 KiB read pass puts the vdisk in the node's cache (reads over 256 KiB are scans and
# fill nothing); the 4 KiB one touches every block again, so the cache's promotions (a 4 KiB
# copy and two pool updates each: about a sixth of the node's time while they last) are done
# before anything is measured, as in ashlar.sh's warm-up.
for pass in write:1M read:256k read:4k; do
    fio --name=fill --ioengine=nbd --uri="$URI" --rw="${pass%%:*}" --bs="${pass##*:}" \
        --iodepth=8 --size=1G --output-format=json > /dev/null
done
cpu_ticks() { awk '{print $14 + $15}' "/proc/$NODE/stat"; }
TICKS=$(getconf CLK_TCK)
for job in $JOBS; do
    rw=${job%%:*}; qd=${job##*:}
    before=$(cpu_ticks)
    fio --name="$rw$qd" --ioengine=nbd --uri="$URI" --rw="$rw" --bs=4k --iodepth="$qd" \
        --size=1G --time_based --runtime="$RUNTIME" --randrepeat=0 --output-format=json \
        > "$DIR.fio.json" &
    fio_pid=$!
    if [ -n "${PROBE:-}" ]; then
        sleep 2
        ${PROBE//\{pid\}/$NODE} > "$DIR.probe.log" 2>&1 || echo "probe failed: $DIR.probe.log" >&2
    fi
    wait "$fio_pid"
    after=$(cpu_ticks)
    python3 - "$job" "$before" "$after" "$TICKS" "$DIR.fio.json" <<'PY'
import json, sys
job, before, after, ticks = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
text = open(sys.argv[5]).read()
result = json.loads(text[text.index("{"):])["jobs"][0]
side = result["write"] if result["write"]["io_bytes"] else result["read"]
iops = side["iops"]
p50_us = side["clat_ns"]["percentile"]["50.000000"] / 1000
cpu_s = (after - before) / ticks
ios = side["total_ios"]
fio_cpu = (result["usr_cpu"] + result["sys_cpu"]) / 100
print(f"{job:14} iops {iops:9.0f} p50_us {p50_us:7.1f} cpu_s {cpu_s:6.2f} ios_per_cpu_s {ios / cpu_s if cpu_s else 0:9.0f} fio_cpus {fio_cpu:4.2f}")
PY
done

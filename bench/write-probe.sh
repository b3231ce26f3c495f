#!/usr/bin/env bash
# write-probe.sh — one node, one vdisk filled with 1 MiB writes and drained, the page cache
# dropped, then one fio nbd write job, and what the disk did meanwhile: the diagnostic behind
# the sequential-write notes in bench/results/*/NOTES.md (bench/run.sh gives the ratios
# against raw fio).
#
#   bench/write-probe.sh [RUNTIME_S]        (as root: it drops the page cache)
#
# Prints fio's MiB/s (all jobs together), the node's CPU ticks over the job, the first job's
# median completion latency, and from /sys/block/DEV/stat the disk's write requests, MiB
# written, flushes and the average number of write requests in flight (write time_in_queue /
# time).
# Knobs (environment): ASHLAR_BIN (target/release/ashlar), DATA_DIR (/var/tmp/ashlar-write-probe),
# VDISK_SIZE (4G), RW (write; randwrite), BS (1M), QD (8), JOBS (1; each job writes its own
# VDISK_SIZE / JOBS, e.g. JOBS=8 QD=1 for eight streams that never share an egroup),
# CACHE_SIZE (256M), NODE_ARGS (extra `ashlar node` flags), NBD_PORT (10941), HTTP_PORT (10942),
# PERF=1 (records the node during the job with call graphs: /tmp/write-probe.perf).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
RUNTIME_S=${1:-10}
ASHLAR_BIN=${ASHLAR_BIN:-$HERE/../target/release/ashlar}
DATA_DIR=${DATA_DIR:-/var/tmp/ashlar-write-probe}
VDISK_SIZE=${VDISK_SIZE:-4G}
NBD_PORT=${NBD_PORT:-10941}
HTTP_PORT=${HTTP_PORT:-10942}
JOBS=${JOBS:-1}

source "$HERE/probe-lib.sh"
probe_prepare
probe_start_node "$DATA_DIR.log" "${RUST_LOG:-info}"
# Until the oplog has (almost) drained: the job overwrites data in the extent store.
probe_fill_and_drain 1048576
probe_drop_caches

share=$(( $(numfmt --from=iec "$VDISK_SIZE") / JOBS / 1048576 ))M
disk0=$(cat "$stat_file")
ticks0=$(awk '{print $14 + $15}' "/proc/$NODE_PID/stat")
if [ "${PERF:-0}" = 1 ]; then
    perf record -F 1000 --call-graph dwarf,16384 -p "$NODE_PID" -o /tmp/write-probe.perf 2>/dev/null &
    perf_pid=$!
fi
fio --name=probe --ioengine=nbd --uri="$URI" --rw="${RW:-write}" --bs="${BS:-1M}" \
    --iodepth="${QD:-8}" --numjobs="$JOBS" --size="$share" --offset_increment="$share" \
    --runtime="$RUNTIME_S" --time_based --output-format=json \
    2>/dev/null | sed -n '/^{/,$p' > "$DATA_DIR.fio.json"
ticks1=$(awk '{print $14 + $15}' "/proc/$NODE_PID/stat")
if [ "${PERF:-0}" = 1 ]; then kill -INT "$perf_pid"; wait "$perf_pid" 2>/dev/null || true; fi
disk1=$(cat "$stat_file")
echo "MiB/s $(jq '[.jobs[].write.bw] | add / 1024 | floor' "$DATA_DIR.fio.json")  node CPU ticks $((ticks1 - ticks0))  p50 us (first job) $(jq '.jobs[0].write.clat_ns.percentile["50.000000"] / 1000 | floor' "$DATA_DIR.fio.json")"
# /sys/block/DEV/stat: field 5 writes, 7 sectors written, 8 write ticks (ms), 16 flushes.
echo "$disk0 $disk1" | awk -v rt="$RUNTIME_S" '{ n = NF / 2;
    printf "disk writes %d, MiB written %.0f, flushes %d, average writes in flight %.1f\n",
        $(n+5) - $5, ($(n+7) - $7) * 512 / 1048576, $(n+16) - $16, ($(n+8) - $8) / (rt * 1000) }'

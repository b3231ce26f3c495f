#!/usr/bin/env bash
# read-probe.sh — one node, one vdisk filled with 1 MiB writes, the page cache dropped, then
# one fio nbd read job, and what the node and the disk did meanwhile: a diagnostic behind the
# read-path notes in bench/results/*/NOTES.md (bench/run.sh gives the ratios against raw fio).
#
#   bench/read-probe.sh [RUNTIME_S]        (as root: it drops the page cache)
#
# Prints fio's IOPS, the node's CPU ticks over the job and its RSS after it, its busiest threads over 2 s halfway
# through (which reactor is the ceiling), and from /sys/block/DEV/stat the disk
# reads, sectors read and the average number of requests in flight (time_in_queue / time), and
# how busy the machine's CPUs and fio were.
# Knobs (environment): ASHLAR_BIN (target/release/ashlar), DATA_DIR (/var/tmp/ashlar-read-probe),
# VDISK_SIZE (4G), RW (read), BS (1M), QD (8), CACHE_SIZE (256M), NODE_ARGS (extra `ashlar node` flags),
# PERF=1 (perf record of the node for 5 s into $DATA_DIR.perf; PERF_CALLGRAPH=dwarf for call
# chains through libc), RESTART=1 (restart the node after the fill, before the job),
# NBD_PORT (10941),
# HTTP_PORT (10942).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
RUNTIME_S=${1:-10}
ASHLAR_BIN=${ASHLAR_BIN:-$HERE/../target/release/ashlar}
DATA_DIR=${DATA_DIR:-/var/tmp/ashlar-read-probe}
VDISK_SIZE=${VDISK_SIZE:-4G}
NBD_PORT=${NBD_PORT:-10941}
HTTP_PORT=${HTTP_PORT:-10942}

source "$HERE/probe-lib.sh"
probe_prepare
probe_start_node "$DATA_DIR.log" "${RUST_LOG:-info}"
# Until the oplog has drained into the extent store (cold reads come from there).
probe_fill_and_drain 0
if [ "${RESTART:-0}" = 1 ]; then
    # A node restarted on written data: nothing freed yet for its read buffers to reuse.
    kill "$NODE_PID"
    wait "$NODE_PID" || true
    probe_start_node "$DATA_DIR.log" "${RUST_LOG:-info}"
fi
probe_drop_caches

disk0=$(cat "$stat_file")
cpu0=$(head -1 /proc/stat)
ticks0=$(awk '{print $14 + $15}' "/proc/$NODE_PID/stat")
perf_pid=""
if [ "${PERF:-0}" = 1 ]; then
    (sleep 2; perf record -F 1999 --call-graph "${PERF_CALLGRAPH:-fp}" -p "$NODE_PID" -o "$DATA_DIR.perf" -- sleep 5 >/dev/null 2>&1) &
    perf_pid=$!
fi
fio --name=probe --ioengine=nbd --uri="$URI" --rw="${RW:-read}" --bs="${BS:-1M}" \
    --iodepth="${QD:-8}" --runtime="$RUNTIME_S" --time_based --output-format=json \
    2>/dev/null | sed -n '/^{/,$p' > "$DATA_DIR.fio.json" &
fio_pid=$!
sleep $((RUNTIME_S / 2))
probe_busiest_threads 2
wait $fio_pid
[ -z "$perf_pid" ] || wait "$perf_pid"
ticks1=$(awk '{print $14 + $15}' "/proc/$NODE_PID/stat")
cpu1=$(head -1 /proc/stat)
disk1=$(cat "$stat_file")
echo "IOPS $(jq '.jobs[0].read.iops | floor' "$DATA_DIR.fio.json")  node CPU ticks $((ticks1 - ticks0))  node RSS $(awk '/VmRSS/ {print int($2 / 1024)}' "/proc/$NODE_PID/status") MiB"
# /proc/stat's first line: user nice system idle iowait irq softirq steal (ticks, all CPUs).
echo "$cpu0 $cpu1" | awk -v hz="$(getconf CLK_TCK)" -v rt="$RUNTIME_S" -v cpus="$(nproc)" '{
    busy0 = $2 + $3 + $4 + $7 + $8 + $9; busy1 = $13 + $14 + $15 + $18 + $19 + $20
    printf "machine CPUs busy %.2f of %d", (busy1 - busy0) / hz / rt, cpus }'
jq -r '.jobs[0] | "  fio CPUs busy \((.usr_cpu + .sys_cpu) / 100 | . * 100 | floor / 100)"' "$DATA_DIR.fio.json"
# /sys/block/DEV/stat: field 1 reads, 3 sectors read, 11 time_in_queue (ms).
echo "$disk0 $disk1" | awk -v rt="$RUNTIME_S" '{ n = NF / 2;
    printf "disk reads %d, MiB read %.0f, average requests in flight %.1f\n",
        $(n+1) - $1, ($(n+3) - $3) * 512 / 1048576, ($(n+11) - $11) / (rt * 1000) }'

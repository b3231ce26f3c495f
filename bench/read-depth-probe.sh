#!/usr/bin/env bash
# read-depth-probe.sh — cold 1 MiB reads through one node at several queue depths, each beside
# raw fio on a file of the same size on the same filesystem, with what the disk did during each
# job: requests, average request size, average time a request spent in the disk and the
# average number in it. The probe behind bench/results/20261129-182310-vm/NOTES.md: when the
# node's requests are split (average size under 1 MiB) or the disk holds far fewer of them
# than fio keeps in flight, the time goes outside the disk.
#
#   bench/read-depth-probe.sh [RUNTIME_S]        (as root: it drops the page cache)
#
# Knobs (environment): ASHLAR_BIN (target/release/ashlar), DATA_DIR
# (/var/tmp/ashlar-depth-probe), VDISK_SIZE (4G), QDS ("1 2 8"), RW (read; randread),
# CACHE_SIZE (256M), NODE_ARGS (extra `ashlar node` flags), NBD_PORT (10951), HTTP_PORT (10952).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
RUNTIME_S=${1:-5}
ASHLAR_BIN=${ASHLAR_BIN:-$HERE/../target/release/ashlar}
DATA_DIR=${DATA_DIR:-/var/tmp/ashlar-depth-probe}
VDISK_SIZE=${VDISK_SIZE:-4G}
NBD_PORT=${NBD_PORT:-10951}
HTTP_PORT=${HTTP_PORT:-10952}
QDS=${QDS:-"1 2 8"}
RW=${RW:-read}

source "$HERE/probe-lib.sh"
probe_prepare
probe_start_node "$DATA_DIR.log" warn
RAW_FILE=$DATA_DIR/raw.img
trap 'kill $NODE_PID 2>/dev/null || true; rm -f "$RAW_FILE"' EXIT
probe_fill_and_drain 0
fio --name=fill --filename="$RAW_FILE" --size="$VDISK_SIZE" --rw=write --bs=1M --direct=1 \
    --ioengine=io_uring >/dev/null

# measured LABEL FIO-ARGS...: runs one cold fio job and prints its MiB/s and p50 beside the
# disk's counters over the job (/sys/block/DEV/stat: reads, sectors, read ticks, time in queue).
measured() {
    local label=$1 json=$DATA_DIR.depth.json before after t0 t1
    shift
    probe_drop_caches
    before=$(cat "$stat_file")
    t0=$(date +%s.%N)
    fio --name=job --bs=1M --rw="$RW" --runtime="$RUNTIME_S" --time_based \
        --output-format=json --output="$json" "$@" >/dev/null
    t1=$(date +%s.%N)
    after=$(cat "$stat_file")
    local fio_part
    fio_part=$(jq -r '"\(.jobs[0].read.bw / 1024 | floor) MiB/s, p50 \(.jobs[0].read.clat_ns.percentile["50.000000"] / 1000 | floor) us"' "$json")
    echo "$before $after $t0 $t1" | awk -v label="$label" -v fio_part="$fio_part" '{
        n = 17; reqs = $(n+1) - $1; sectors = $(n+3) - $3; ticks = $(n+4) - $4
        queue = $(n+11) - $11; seconds = $(2*n+2) - $(2*n+1)
        if (reqs == 0) reqs = 1
        printf "%-14s %s | disk: %d reads, average %.0f KiB, %.2f ms each, %.2f in the disk\n",
            label, fio_part, reqs, sectors / 2 / reqs, ticks / reqs, queue / seconds / 1000 }'
}

for qd in $QDS; do
    measured "QD$qd ashlar" --ioengine=nbd --uri="$URI" --iodepth="$qd"
    measured "QD$qd raw" --ioengine=io_uring --direct=1 --filename="$RAW_FILE" \
        --size="$VDISK_SIZE" --iodepth="$qd"
done

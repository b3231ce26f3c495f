#!/usr/bin/env bash
# durable-probe.sh — one node, one vdisk, one fio job of durable 4 KiB random writes, and what
# the node and the disk did meanwhile: the probe behind the "what is in the way" sections of
# bench/results/*/NOTES.md (a diagnostic, not a comparison: bench/run.sh gives the ratios).
#
#   bench/durable-probe.sh [RUNTIME_S]        (as root: it drops the page cache)
#
# Starts `ashlar node` on a fresh DATA_DIR with a VDISK_SIZE vdisk, fills it with 1 MiB writes
# (so drains overwrite written blocks, as in steady use), waits SETTLE_S for the oplog to drain,
# drops the page cache, then runs fio's nbd engine: 4 KiB random writes at QD for RUNTIME_S.
# Prints fio's IOPS and p50/p99, the node's CPU-seconds and IOPS per CPU-second, the disk's
# requests per second from /sys/block/DEV/stat, the busiest node threads halfway through (from
# /proc/PID/task), and
# the average drain step (items, read and total microseconds, from the node's debug log).
#
# Knobs (environment): ASHLAR_BIN (target/release/ashlar), DATA_DIR (/var/tmp/ashlar-probe),
# VDISK_SIZE (4G), QD (32), SETTLE_S (15), NODE_ARGS (extra `ashlar node` flags, e.g.
# "--max-writing-egroups 1" or "--default-shards 2"), FIO_ARGS (extra fio flags, e.g.
# "--write_lat_log=/tmp/lat --log_avg_msec=0"), FILL=0 (skip the fill), NBD_PORT (10923),
# HTTP_PORT (10924).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
RUNTIME_S=${1:-20}
ASHLAR_BIN=${ASHLAR_BIN:-$HERE/../target/release/ashlar}
DATA_DIR=${DATA_DIR:-/var/tmp/ashlar-probe}
VDISK_SIZE=${VDISK_SIZE:-4G}
QD=${QD:-32}
SETTLE_S=${SETTLE_S:-15}
NBD_PORT=${NBD_PORT:-10923}
HTTP_PORT=${HTTP_PORT:-10924}
LOG=$DATA_DIR.log
FIO_JSON=$DATA_DIR.fio.json

source "$HERE/probe-lib.sh"
probe_prepare
probe_start_node "$LOG" warn,ashlar_engine=debug
if [ "${FILL:-1}" = 1 ]; then
    fio --name=fill --ioengine=nbd --uri="$URI" --rw=write --bs=1M --iodepth=8 >/dev/null
fi
sleep "$SETTLE_S"
sync
echo 3 > /proc/sys/vm/drop_caches
sleep 1

cpu_ticks() { awk '{print $14 + $15}' "/proc/$NODE_PID/stat"; }
log_offset=$(stat -c %s "$LOG")
ticks0=$(cpu_ticks)
disk0=$(cat "$stat_file")
# shellcheck disable=SC2086 # FIO_ARGS is a list of flags
fio --name=durable --ioengine=nbd --uri="$URI" --rw=randwrite --bs=4k --iodepth="$QD" \
    --runtime="$RUNTIME_S" --time_based --output-format=json ${FIO_ARGS:-} 2>/dev/null \
    | sed -n '/^{/,$p' > "$FIO_JSON" &
fio_pid=$!
sleep $((RUNTIME_S / 2))
probe_busiest_threads 3
wait $fio_pid
ticks1=$(cpu_ticks)
disk1=$(cat "$stat_file")

hz=$(getconf CLK_TCK)
iops=$(jq '.jobs[0].write.iops' "$FIO_JSON")
p50=$(jq '.jobs[0].write.clat_ns.percentile["50.000000"]' "$FIO_JSON")
p99=$(jq '.jobs[0].write.clat_ns.percentile["99.000000"]' "$FIO_JSON")
awk -v iops="$iops" -v p50="$p50" -v p99="$p99" -v t0="$ticks0" -v t1="$ticks1" -v hz="$hz" -v rt="$RUNTIME_S" \
    'BEGIN { cpu = (t1 - t0) / hz; printf "IOPS %.0f  p50 %.0f us  p99 %.0f us  node CPU %.2f s  IOPS per CPU-s %.0f\n", iops, p50 / 1000, p99 / 1000, cpu, iops * rt / cpu }'
# /sys/block/DEV/stat: reads, writes (completed requests), sectors written, flushes, flush ms.
echo "$disk0 $disk1" | awk -v rt="$RUNTIME_S" -v disk="$disk" '{ n = NF / 2;
    printf "%s per second: reads %d, writes %d, MiB written %.0f, flushes %d (%d ms flushing)\n", disk,
        ($(n+1) - $1) / rt, ($(n+5) - $5) / rt, ($(n+7) - $7) * 512 / rt / 1048576,
        ($(n+16) - $16) / rt, ($(n+17) - $17) / rt }'
tail -c +"$log_offset" "$LOG" | grep -a "drain step" | sed 's/.*drain step//' | awk '
    { for (i = 1; i <= NF; i++) { split($i, kv, "="); sum[kv[1]] += kv[2] } steps++ }
    END { if (steps == 0) { print "no drain step during the job"; exit }
          printf "drain steps %d: on average %d items, read %d us, total %d us\n", steps,
              sum["items"] / steps, sum["read_us"] / steps, sum["total_us"] / steps }'

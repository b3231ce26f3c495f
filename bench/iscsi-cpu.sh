#!/usr/bin/env bash
# iscsi-cpu.sh — the server CPU of one fixed iSCSI job, for A/B comparisons of two binaries
# and for profiles (bench/results/20261126-123253-vm/NOTES.md). Starts a single node
# (2 reactors, 3 GiB cache) with vdisk `bench` (2 GiB) exported as LUN 0 of
# iqn.2024-01.io.ashlar:bench, runs fio's libiscsi engine once over 2 GiB (1 MiB blocks,
# QD8) and prints the node's task-clock for that job (`perf stat -p`), or records a perf
# profile of it.
#
#   bench/iscsi-cpu.sh BIN write|read|randwrite|randread [stat|profile]   (as root; profile -> /tmp/iscsi-cpu.perf)
#
# `read` (or FILL=1) fills the vdisk first, not measured: with FILL=1 a write job overwrites
# instead of creating extent group files. Alternate two binaries several times and
# compare medians: single runs on this shared machine vary by more than a few percent.
# NODE_ARGS adds flags to the node's command line (e.g. NODE_ARGS="--iscsi-first-burst 1M").
# BS, QD and RW=randwrite|randread change the measured job (default 1M, 8); RUNTIME=S makes
# it run S seconds instead of over 2 GiB (for small blocks). IOPS and node CPU per IO are
# printed too.
# Needs perf, curl, python3 and fio with the libiscsi engine (FIO_ISCSI, default: what
# ../shared/bench/peers/build-fio-libiscsi.sh builds).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
BIN=${1:?usage: iscsi-cpu.sh BIN write|read|randwrite|randread [stat|profile]}
RW=${2:?usage: iscsi-cpu.sh BIN write|read|randwrite|randread [stat|profile]}
MODE=${3:-stat}
FIO=${FIO_ISCSI:-$("$HERE/../../shared/bench/peers/build-fio-libiscsi.sh" 2>/dev/null)}
source "$HERE/iscsi-probe-lib.sh"
iscsi_probe_node "$BIN" /tmp/iscsi-cpu-node 19091 2G
job() { "$FIO" --name="$1" --ioengine=libiscsi --filename="$ISCSI_FN" --initiator="$INITIATOR" \
    --rw="$2" --bs="$3" --iodepth="$4" --size=2G --output-format=json "${@:5}"; }
LIMIT=()
if [ -n "${RUNTIME:-}" ]; then LIMIT=(--time_based --runtime="$RUNTIME"); fi
case "$RW" in read|randread) FILL=1 ;; esac
if [ "${FILL:-0}" = 1 ]; then job fill write 1M 8 >/dev/null; sleep 2; fi
if [ "$MODE" = profile ]; then
    perf record -F 1000 --call-graph dwarf,16384 -p "$NODE" -o /tmp/iscsi-cpu.perf 2>/dev/null &
else
    perf stat -e task-clock -p "$NODE" -o /tmp/iscsi-cpu.stat &
fi
PERF=$!
sleep 0.5
job measured "$RW" "${BS:-1M}" "${QD:-8}" "${LIMIT[@]}" > /tmp/iscsi-cpu.json
kill -INT "$PERF"; wait "$PERF" 2>/dev/null || true
KIND=${RW#rand}
read -r MIBS IOPS < <(python3 -c "t=open('/tmp/iscsi-cpu.json').read(); import json; \
j=json.loads(t[t.index('{'):])['jobs'][0]['$KIND']; print(round(j['bw']/1024), round(j['iops']))")
if [ "$MODE" = profile ]; then
    echo "$(basename "$BIN") $RW MiB/s=$MIBS profile=/tmp/iscsi-cpu.perf (perf report -i ... --no-children)"
else
    CLOCK=$(awk '/task-clock/{gsub(",","",$1); print $1}' /tmp/iscsi-cpu.stat)
    RUN_S=$(python3 -c "t=open('/tmp/iscsi-cpu.json').read(); import json; \
print(json.loads(t[t.index('{'):])['jobs'][0]['job_runtime']/1000)")
    echo "$(basename "$BIN") $RW bs=${BS:-1M} qd=${QD:-8} MiB/s=$MIBS IOPS=$IOPS task_clock_ms=$CLOCK" \
        "cpu_us_per_io=$(python3 -c "print(round($CLOCK * 1000 / ($IOPS * $RUN_S), 2))")"
fi

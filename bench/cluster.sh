#!/usr/bin/env bash
# cluster.sh — what replication costs: one etcd and three `ashlar node --etcd` processes on
# loopback (one disk, two CPUs: every copy shares them, so replication shows as CPU), one
# vdisk per replication factor (1, 2, 3), each claimed by node 1 and driven through node 1 by
# fio's nbd engine. For every job: IOPS, p50/p99 latency, CPU-seconds of all three node
# processes (and of each: node 1 owns every vdisk, nodes 2 and 3 hold copies), IOPS per
# server CPU-second, and the CPU per write relative to RF 1 (issue 7's
# goal: an RF 3 write costs at most 3.75x an RF 1 write, each copy at most 1.25x a local
# write).
#
#   bench/cluster.sh [OUT_DIR]            (as root; OUT_DIR default bench/results/<date>-<host>)
#
# Knobs: ASHLAR_BIN (target/release/ashlar), SIZE (1G per vdisk), RUNTIME (8 s per job),
# JOBS ("randwrite:1 randwrite:32 randread:32": fio rw and iodepth), RFS ("1 2 3"), SHARDS
# (shards per vdisk; default: the nodes' --default-shards),
# BASE_DIR (/var/tmp/ashlar-cluster-bench).
# PROBE, if set, is a command run 2 s into each job with `{pids}` replaced by the three node
# pids (comma-separated) and `{rf}` by the job's replication factor, e.g.
# PROBE='perf record -F 999 -g -p {pids} -o /tmp/cluster-rf{rf}.perf -- sleep 4' for profiles.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ASHLAR_BIN=${ASHLAR_BIN:-$HERE/../target/release/ashlar}
SIZE=${SIZE:-1G}
SHARDS=${SHARDS:-}
RUNTIME=${RUNTIME:-8}
JOBS=${JOBS:-"randwrite:1 randwrite:32 randread:32"}
RFS=${RFS:-"1 2 3"}
BASE_DIR=${BASE_DIR:-/var/tmp/ashlar-cluster-bench}
OUT_DIR=${1:-$HERE/results/$(date -u +%Y%m%d-%H%M%S)-$(hostname -s)}
ETCD_PORT=23791

source "$HERE/cluster-start.sh"
prepare_cluster_run "$BASE_DIR" "$OUT_DIR"
PORT_PREFIX=2 # node n listens on ports ${PORT_PREFIX}${n}809 (NBD), ...810 (HTTP), ...
start_cluster "$BASE_DIR" "$ETCD_PORT" "$PORT_PREFIX" 3000
NODE_PIDS=("${NODE_PID[1]}" "${NODE_PID[2]}" "${NODE_PID[3]}")
for rf in $RFS; do
    "$ASHLAR_BIN" --server http://127.0.0.1:${PORT_PREFIX}1810 vdisk create "rf$rf" --size "$SIZE" --rf "$rf" \
        ${SHARDS:+--shards "$SHARDS"} >/dev/null
    # Fill it (so reads read data) and claim it on node 1.
    fio --name=fill --ioengine=nbd --uri="nbd://127.0.0.1:${PORT_PREFIX}1809/rf$rf" --rw=write --bs=1M \
        --iodepth=8 --output-format=json > /dev/null
done
# Oplog bytes not yet drained, summed over the three nodes (owners' and copies' vdisks).
undrained_bytes() { local n; for n in 1 2 3; do curl -sf "http://127.0.0.1:${PORT_PREFIX}${n}810/metrics" || true; done |
    awk '/^ashlar_vdisk_oplog_live_bytes/ { total += $NF } END { printf "%.0f", total }'; }
# Waits (at most 120 s) until every node drained what the last job wrote: a job's CPU must
# not include an earlier job's drain (with 128M drain steps that takes seconds).
wait_drained() { local i; for i in $(seq 240); do
    [ "$(undrained_bytes)" = 0 ] && return 0; sleep 0.5; done
    echo "warning: $(undrained_bytes) oplog bytes still undrained after 120 s" >&2; }
wait_drained # the fills

# CPU ticks (user + system) of each node process, space-separated, node 1 first.
node_ticks() { for pid in "${NODE_PIDS[@]}"; do awk '{printf "%d ", $14 + $15}' "/proc/$pid/stat"; done; }
# Seconds between two node_ticks readings: "total node1 node2 node3".
cpu_seconds() { awk -v hz="$HZ" -v a="$1" -v b="$2" 'BEGIN { n = split(a, x, " "); split(b, y, " ")
    for (i = 1; i <= n; i++) { d[i] = (y[i] - x[i]) / hz; t += d[i] }
    printf "%.2f", t; for (i = 1; i <= n; i++) printf " %.2f", d[i] }'; }
HZ=$(getconf CLK_TCK)
TSV=$OUT_DIR/cluster.tsv
printf 'rf\tjob\tiops\tp50_us\tp99_us\tnode_cpu_s\tiops_per_cpu_s\tnode1_cpu_s\tnode2_cpu_s\tnode3_cpu_s\n' > "$TSV"
for job in $JOBS; do
    rw=${job%%:*}; qd=${job##*:}
    for rf in $RFS; do
        before=$(node_ticks)
        if [ -n "${PROBE:-}" ]; then
            probe=${PROBE//\{pids\}/$(IFS=,; echo "${NODE_PIDS[*]}")}
            (sleep 2; ${probe//\{rf\}/$rf} > "$OUT_DIR/probe-rf$rf.log" 2>&1) &
            probe_pid=$!
        fi
        json=$(fio --name="rf$rf" --ioengine=nbd --uri="nbd://127.0.0.1:${PORT_PREFIX}1809/rf$rf" --rw="$rw" \
            --bs=4k --iodepth="$qd" --runtime="$RUNTIME" --time_based --output-format=json \
            2>/dev/null | sed -n '/^{/,$p')
        [ -n "${PROBE:-}" ] && wait "$probe_pid"
        after=$(node_ticks)
        side=$([ "$rw" = randread ] && echo read || echo write)
        iops=$(jq ".jobs[0].$side.iops | floor" <<<"$json")
        p50=$(jq ".jobs[0].$side.clat_ns.percentile[\"50.000000\"] / 1000 | floor" <<<"$json")
        p99=$(jq ".jobs[0].$side.clat_ns.percentile[\"99.000000\"] / 1000 | floor" <<<"$json")
        read -r cpu cpu1 cpu2 cpu3 <<<"$(cpu_seconds "$before" "$after")"
        per_cpu=$(awk -v i="$iops" -v r="$RUNTIME" -v c="$cpu" 'BEGIN {printf "%.0f", i * r / c}')
        printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$rf" "$rw-qd$qd" "$iops" "$p50" "$p99" "$cpu" "$per_cpu" \
            "$cpu1" "$cpu2" "$cpu3" \
            | tee -a "$TSV"
        wait_drained
    done
done
# CPU per I/O relative to RF 1, per job.
{
    echo "CPU per I/O relative to RF 1 (issue 7 goal for writes: RF 3 <= 3.75x):"
    awk -F'\t' 'NR > 1 { key = $2; if ($1 == 1) base[key] = $7; rfs[NR] = $1; keys[NR] = key; per[NR] = $7 }
        END { for (i in keys) if (base[keys[i]] > 0 && per[i] > 0)
                  printf "  %s rf%s: %.2fx\n", keys[i], rfs[i], base[keys[i]] / per[i] }' "$TSV" | sort
} | tee "$OUT_DIR/cluster-ratios.txt"
echo "results in $OUT_DIR"

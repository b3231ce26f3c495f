#!/usr/bin/env bash
# run.sh — Ashlar beside the references in one run: raw fio (ext4 and tmpfs), raw fio with
# sync=dsync, nbdkit memory and file, and Ashlar (cached and uncached reads), same fio jobs;
# then the cold stages (cold.sh: page cache dropped before every job, data larger than the
# node's cache, durable writes, page-cache growth); then the ratios the targets are stated in,
# and the in-process sharding benchmark.
#   ./bench/run.sh                      # full run: RUNTIME=15 s per job (~25-30 min on 2 vCPUs)
#   RUNTIME=5 SIZE=1G ./bench/run.sh    # quicker matrix; the cold stages still use UNCACHED_SIZE
#   ASHLAR_BIN=target/release/ashlar STAGES="uncached durable pagecache" RUNTIME=5 \
#       UNCACHED_SIZE=1G PAGECACHE_READ=1G ./bench/run.sh   # the new stages only, a few minutes
# Writes bench/results/<date>-<host>/ (RESULTS.md, ratios.md, raw data).
#
# Knobs (environment):
#   STAGES="raw nbdkit dsync ashlar iscsi uncached durable pagecache shard"   which parts run:
#     raw       raw-ext4, raw-tmpfs: fio io_uring direct=1 (../shared/bench/peers/raw.sh)
#     nbdkit    nbdkit-memory, nbdkit-file through fio's nbd engine (peers/nbdkit.sh)
#     dsync     raw-ext4-dsync: io_uring direct=1 sync=dsync (raw-dsync.sh)
#     ashlar    ashlar, ashlar-uncached, ashlar-2shards: the peers' matrix (ashlar.sh)
#     iscsi     tgt-iscsi, ashlar-iscsi, ashlar-iscsi-nbd: fio libiscsi against tgt and Ashlar,
#               and fio nbd on the same Ashlar vdisk, 4k rand QD1/QD32, 1M seq QD8 (iscsi.sh)
#     uncached  raw-cold vs ashlar-cold: 4k randread QD32/QD1, 1M seqread/seqwrite QD8 with the
#               page cache dropped before each job, on UNCACHED_SIZE data; raw-cold-flush:
#               the seqwrite jobs with one fdatasync per QD writes (cold.sh)
#     durable   4k randwrite QD1/QD32: ashlar-cold vs raw-cold-dsync and nbdkit-memory-cold
#     pagecache page cache growth while reading PAGECACHE_READ through the node
#     shard     the in-process sharding benchmark (shard_bench)
#   RUNTIME=15 (s per fio job), SIZE=2G (matrix: files, images, vdisks), QDS, WORKLOADS, RAMP,
#     DATA_DIR: see ../shared/bench/peers/lib.sh (they apply to the matrix; the cold stages
#     use RUNTIME and their own sizes and jobs)
#   UNCACHED_SIZE=4G (cold vdisk, raw file and nbdkit-memory size), UNCACHED_CACHE=256M (the
#     node's --cache-size there), PAGECACHE_READ=4G, PAGECACHE_MODES="on" ("on off" adds a
#     buffered control), UNCACHED_JOBS, DURABLE_JOBS, DROP_CACHES=1, ...: see cold.sh
#   ASHLAR_BIN (default: build target/release/ashlar), SHARD_BENCH, ASHLAR_* (see ashlar.sh)
#   OUT_ROOT=bench/results   where the run's directory goes (e.g. /tmp for a trial run)
# The cold stages drop the page cache (`sync; echo 3 > /proc/sys/vm/drop_caches`: run as root).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
PEERS=$(cd "$HERE/../../shared/bench/peers" && pwd)
export RUNTIME=${RUNTIME:-15} SIZE=${SIZE:-2G}
ALL_STAGES="raw nbdkit dsync ashlar iscsi uncached durable pagecache shard"
STAGES=${STAGES:-$ALL_STAGES}
UNCACHED_SIZE=${UNCACHED_SIZE:-4G} PAGECACHE_READ=${PAGECACHE_READ:-4G}
has_stage() { case " $STAGES " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
only="" extra="" cold=""
for st in $STAGES; do
    case $st in
        raw|nbdkit) only="$only $st" ;;
        dsync) extra="$extra $HERE/raw-dsync.sh" ;;
        ashlar) extra="$extra $HERE/ashlar.sh" ;;
        iscsi) extra="$extra $HERE/iscsi.sh" ;;
        uncached|durable|pagecache) cold="$cold $st" ;;
        shard) ;;
        *) echo "unknown stage $st (known: raw nbdkit dsync ashlar iscsi uncached durable pagecache shard)" >&2; exit 2 ;;
    esac
done
[ -n "$cold" ] && extra="$extra $HERE/cold.sh"
if [ -z "${ASHLAR_BIN:-}" ]; then
    (cd "$HERE/.." && cargo build --release -p ashlar -p ashlar-engine --examples --bins)
    export ASHLAR_BIN=$HERE/../target/release/ashlar
fi
export ASHLAR_BIN
SHARD_BENCH=${SHARD_BENCH:-$HERE/../target/release/examples/shard_bench}
STAMP=$(date +%Y%m%d-%H%M%S)
OUT_DIR=${OUT_ROOT:-$HERE/results}/$STAMP-$(hostname -s)
mkdir -p "$OUT_DIR"
export RESULTS_DIR=$OUT_DIR/raw
export COLD_STAGES=${cold# } UNCACHED_SIZE PAGECACHE_READ
# ONLY=" " (not empty: run-all.sh treats an empty ONLY as "all peers") runs no peer script.
ONLY="${only:- }" EXTRA_SCRIPTS="${extra# }" OUT=$OUT_DIR/RESULTS.md "$PEERS/run-all.sh"
{ echo "# Ashlar benchmark $(date -u +%Y-%m-%dT%H:%MZ) on $(hostname -s): $(nproc) CPUs, $(awk '/MemTotal/{printf "%.0f GiB", $2/1048576}' /proc/meminfo), RUNTIME=${RUNTIME}s SIZE=$SIZE"\
"$([ -n "$cold" ] && echo " UNCACHED_SIZE=$UNCACHED_SIZE cache=${UNCACHED_CACHE:-256M} PAGECACHE_READ=$PAGECACHE_READ")"\
"$([ "$STAGES" = "$ALL_STAGES" ] || echo " STAGES=\"$STAGES\"")"; echo;
  python3 "$HERE/ratios.py" "$RESULTS_DIR/results.tsv"; } > "$OUT_DIR/ratios.md"
if has_stage shard; then
    "$SHARD_BENCH" >> "$OUT_DIR/ratios.md" 2>"$OUT_DIR/shard_bench.log" || echo "shard_bench failed (see shard_bench.log)" >> "$OUT_DIR/ratios.md"
fi
# p50 latencies (ratios.py's QD1 rows) are only in fio's JSON: keep them in p50.tsv, which
# ratios.py reads when json/ is gone, so ratios.md can be rebuilt from the committed results.
for j in "$RESULTS_DIR"/json/*.qd*.json; do
    [ -f "$j" ] || continue
    b=$(basename "$j" .json)   # SYSTEM.WORKLOAD.qdN
    jq -r --arg s "${b%%.*}" --arg w "$(echo "$b" | cut -d. -f2)" --arg q "${b##*.qd}" \
        '[$s, $w, $q, (.jobs[0].mixed.lat_ns.percentile["50.000000"] / 1000 | tostring)] | @tsv' "$j" 2>/dev/null  || true
done > "$RESULTS_DIR/p50.tsv"
rm -rf "$RESULTS_DIR/json"   # large; RESULTS.md, ratios.md, the TSVs and p50.tsv keep the figures
cat "$OUT_DIR/ratios.md"
echo "results in $OUT_DIR"

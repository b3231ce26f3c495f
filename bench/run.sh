#!/usr/bin/env bash
# run.sh — Ashlar beside the references in one run: raw fio (ext4 and tmpfs), raw fio with
# sync=dsync, nbdkit memory and file, and Ashlar (cached and uncached reads), same fio jobs,
# then the ratios the targets are stated in, and the in-process sharding benchmark.
#   ./bench/run.sh                      # RUNTIME=15 s per job
#   RUNTIME=5 SIZE=1G ./bench/run.sh    # quicker
# Writes bench/results/<date>-<host>/ (RESULTS.md, ratios.md, raw data).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
PEERS=$(cd "$HERE/../../shared/bench/peers" && pwd)
export RUNTIME=${RUNTIME:-15} SIZE=${SIZE:-2G}
if [ -z "${ASHLAR_BIN:-}" ]; then
    (cd "$HERE/.." && cargo build --release -p ashlar -p ashlar-engine --examples --bins)
    export ASHLAR_BIN=$HERE/../target/release/ashlar
fi
SHARD_BENCH=${SHARD_BENCH:-$HERE/../target/release/examples/shard_bench}
STAMP=$(date +%Y%m%d-%H%M%S)
OUT_DIR=$HERE/results/$STAMP-$(hostname -s)
mkdir -p "$OUT_DIR"
export RESULTS_DIR=$OUT_DIR/raw
ONLY="raw nbdkit" EXTRA_SCRIPTS="$HERE/raw-dsync.sh $HERE/ashlar.sh" OUT=$OUT_DIR/RESULTS.md \
    "$PEERS/run-all.sh"
{ echo "# Ashlar benchmark $(date -u +%Y-%m-%dT%H:%MZ) on $(hostname -s): $(nproc) CPUs, $(awk '/MemTotal/{printf "%.0f GiB", $2/1048576}' /proc/meminfo), RUNTIME=${RUNTIME}s SIZE=$SIZE"; echo;
  python3 "$HERE/ratios.py" "$RESULTS_DIR/results.tsv"; } > "$OUT_DIR/ratios.md"
"$SHARD_BENCH" >> "$OUT_DIR/ratios.md" 2>"$OUT_DIR/shard_bench.log" || echo "shard_bench failed (see shard_bench.log)" >> "$OUT_DIR/ratios.md"
rm -rf "$RESULTS_DIR/json"   # large; RESULTS.md, ratios.md and the TSV keep the figures
cat "$OUT_DIR/ratios.md"
echo "results in $OUT_DIR"

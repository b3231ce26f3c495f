#!/usr/bin/env bash
# seqwrite-after-mix-probe.sh — reproduces a slow first 1 MiB sequential write job after a
# mix of reads and random writes (found 2026-11-28 in bench/iscsi.sh's full job list: 240-306
# MiB/s, p99 ~100 ms, against 1,300-1,500 for the same job run again or after fewer jobs; base
# 8a142a7 shows it too). One node (2 reactors, 6G cache, vdisk 2G), a 1 MiB fill, then JOBS
# (rw:bs:iodepth, 8 s each, waiting for the oplog to drain after each), then 8 s of 1 MiB
# sequential writes at QD8: prints their MiB/s and p99, and the disk's counters.
# The profile of the slow job (PERF=1 writes /tmp/seqwrite-after-mix.perf, dwarf call graphs):
# glibc's `_int_malloc` 42-58 % of the node, mostly the `Box::pin` of each egroup's future in
# `join::try_run_windowed` under `ExtentStore::apply`, with the node's heap full of freed
# 4 KiB cache blocks. GLIBC_TUNABLES (e.g. glibc.malloc.mmap_threshold=16384) passes through.
# Since small read buffers (cached blocks) live in slots off the heap (`fs::small_buffers`,
# 2026-11-29), `_int_malloc` is ~2 % of the node here and the job runs 25-40 % faster, p99
# -35 % (bench/results/20261129-013000-vm); what remains is cache invalidation and the disk.
#
#   bench/seqwrite-after-mix-probe.sh        (BIN=target/release/ashlar by default)
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
BIN=${BIN:-$HERE/../target/release/ashlar}
JOBS=${JOBS:-"read:1M:8 read:4k:32 randread:4k:1 randread:4k:32 randwrite:4k:1 randwrite:4k:32 read:1M:8"}
D=${DATA_DIR:-/var/tmp/seqwrite-after-mix}
rm -rf "$D"; mkdir -p "$D"
RUST_LOG=warn GLIBC_TUNABLES=${GLIBC_TUNABLES:-} "$BIN" node --data-dir "$D" \
    --nbd-listen 127.0.0.1:19202 --http-listen 127.0.0.1:19203 --reactors 2 --cache-size 6G \
    --ensure-vdisk bench:2G > "$D.log" 2>&1 &
NODE=$!
trap 'kill $NODE 2>/dev/null; wait $NODE 2>/dev/null || true' EXIT
for _ in $(seq 50); do curl -sf http://127.0.0.1:19203/healthz >/dev/null && break; sleep 0.2; done
U=nbd://127.0.0.1:19202/bench
drained() {
    local live
    for _ in $(seq 40); do
        live=$(curl -s http://127.0.0.1:19203/stats/vdisks | jq '[.vdisks[].oplog_live_bytes] | add')
        [ "$live" -le 1048576 ] && return 0
        sleep 0.5
    done
}
fio --name=fill --ioengine=nbd --uri=$U --rw=write --bs=1M --iodepth=8 --size=2G >/dev/null
for job in $JOBS; do
    IFS=: read -r rw bs qd <<< "$job"
    fio --name=mix --ioengine=nbd --uri=$U --rw="$rw" --bs="$bs" --iodepth="$qd" --size=2G \
        --time_based --runtime=8 >/dev/null
    drained
done
[ -n "${PERF:-}" ] && (perf record -F 499 --call-graph dwarf,16384 -p $NODE \
    -o /tmp/seqwrite-after-mix.perf -- sleep 3 >/dev/null 2>&1 &)
dev=$(basename "$(df --output=source "$D" | tail -1)")
[ -e "/sys/block/$dev" ] || dev=$(lsblk -no pkname "/dev/$dev" | head -1)
disk() { awk '{print "writes", $5, "sectors", $7, "write_ms", $8}' "/sys/block/$dev/stat"; }
before=$(disk)
fio --name=seqwrite --ioengine=nbd --uri=$U --rw=write --bs=1M --iodepth=8 --size=2G \
    --time_based --runtime=8 --output-format=json > "$D.json" 2>/dev/null
python3 - "$D.json" <<'PY'
import json, sys
text = open(sys.argv[1]).read()
w = json.loads(text[text.index("{"):])["jobs"][0]["write"]
print("seqwrite1m QD8 MiB/s", int(w["bw"] / 1024), "p99 us", int(w["clat_ns"]["percentile"]["99.000000"] / 1000))
PY
echo "disk before: $before"; echo "disk after:  $(disk)"

#!/usr/bin/env bash
# cluster-restore.sh — issue 7's restore figures: how long a 3-node cluster takes to get a
# replicated vdisk back to full RF after a copy node is lost, and what a client gets
# meanwhile. etcd and three `ashlar node --etcd` processes on loopback (one disk, two CPUs),
# one RF 2 vdisk of SIZE filled through node 1 (its owner), then a fio job through node 1
# (4 KiB random 70 % reads, QD 16) for the whole run; after BASELINE_S seconds the other copy
# node is killed (-9). The owner's writes fail until the dead node's lease ends, then it
# claims the vdisk again with the third node in the dead one's place and resyncs it while it
# serves. Reported: the IOPS per second (fio's log), the baseline, the time from the kill to
# the end of the resync (the owner's log), and the client's IOPS during the resync against
# the baseline (issue 7's goal: >= 70 %).
#
#   bench/cluster-restore.sh [OUT_DIR]      (OUT_DIR default bench/results/<date>-<host>)
#
# Knobs: ASHLAR_BIN (target/release/ashlar), SIZE (4G), BASELINE_S (15), AFTER_S (seconds the
# job runs after the resync ended, 10), LEASE_TTL_MS (3000), NODE_ARGS (extra `ashlar node`
# flags for every node, e.g. "--resync-max-mib-s 64"), BASE_DIR (/var/tmp/ashlar-restore-bench).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ASHLAR_BIN=${ASHLAR_BIN:-$HERE/../target/release/ashlar}
SIZE=${SIZE:-4G}
BASELINE_S=${BASELINE_S:-15}
AFTER_S=${AFTER_S:-10}
LEASE_TTL_MS=${LEASE_TTL_MS:-3000}
NODE_ARGS=${NODE_ARGS:-}
BASE_DIR=${BASE_DIR:-/var/tmp/ashlar-restore-bench}
OUT_DIR=${1:-$HERE/results/$(date -u +%Y%m%d-%H%M%S)-$(hostname -s)}
ETCD_PORT=23891

source "$HERE/cluster-start.sh"
prepare_cluster_run "$BASE_DIR" "$OUT_DIR"
# shellcheck disable=SC2086
start_cluster "$BASE_DIR" "$ETCD_PORT" 3 "$LEASE_TTL_MS" $NODE_ARGS
sleep 2
CLI=("$ASHLAR_BIN" --server http://127.0.0.1:31810)
"${CLI[@]}" vdisk create restore --size "$SIZE" --rf 2 >/dev/null
URI=nbd://127.0.0.1:31809/restore
echo "filling $SIZE through node 1"
fio --name=fill --ioengine=nbd --uri="$URI" --rw=write --bs=1M --iodepth=8 --output-format=json > /dev/null
sleep 5
copies=$("${CLI[@]}" vdisk show restore --json | jq -r '.ownership.copies[]')
victim=""
for n in 1 2 3; do
    id=$(cut -d' ' -f1 "$BASE_DIR/node$n/node-id") # the id, then its CRC
    if grep -qx "$id" <<<"$copies" && [ "$n" != 1 ]; then victim=$n; fi
done
[ -n "$victim" ] || { echo "node 1 does not share the vdisk with another node: $copies" >&2; exit 1; }
echo "copies: $(tr '\n' ' ' <<<"$copies"); killing node $victim after ${BASELINE_S}s"

fio --name=client --ioengine=nbd --uri="$URI" --rw=randrw --rwmixread=70 --bs=4k --iodepth=16 \
    --time_based --runtime=3600 --continue_on_error=all --write_iops_log="$BASE_DIR/client" \
    --log_avg_msec=1000 --output-format=json > "$BASE_DIR/client.json" 2>"$BASE_DIR/client.err" &
FIO_PID=$!
fio_start=$(date +%s.%N)
sleep "$BASELINE_S"
kill_at=$(date +%s.%N)
kill -9 "${NODE_PID[$victim]}"
echo "node $victim killed at +$(awk -v a="$fio_start" -v b="$kill_at" 'BEGIN{printf "%.1f", b-a}')s"
resynced=""
for _ in $(seq 1800); do
    resynced=$(grep 'copies resynchronized from this node' "$BASE_DIR/node1.log" | tail -1 || true)
    [ -n "$resynced" ] && break
    sleep 1
done
[ -n "$resynced" ] || { echo "no resync ended within 30 min" >&2; exit 1; }
done_at=$(date -d "$(awk '{print $1}' <<<"$resynced")" +%s.%N)
resync_ms=$(grep -o 'elapsed_ms=[0-9]*' <<<"$resynced" | cut -d= -f2)
sleep "$AFTER_S"
kill -INT "$FIO_PID"; wait "$FIO_PID" || true

# Per-second IOPS (reads + writes) since fio started.
awk -F', *' '{ s = int($1 / 1000); iops[s] += $2; if (s > last) last = s }
    END { for (s = 0; s <= last; s++) printf "%d\t%d\n", s, iops[s] }' "$BASE_DIR"/client_iops.*.log \
    > "$OUT_DIR/restore-iops.tsv"
k=$(awk -v a="$fio_start" -v b="$kill_at" 'BEGIN{printf "%d", b-a}')
d=$(awk -v a="$fio_start" -v b="$done_at" 'BEGIN{printf "%d", b-a}')
r=$(awk -v d="$d" -v ms="$resync_ms" 'BEGIN{printf "%d", d - ms/1000}')
avg() { awk -F'\t' -v from="$1" -v to="$2" '$1 >= from && $1 < to { sum += $2; n++ }
    END { if (n) printf "%.0f", sum / n; else print "-" }' "$OUT_DIR/restore-iops.tsv"; }
baseline=$(avg 2 "$k")
outage=$(avg "$k" "$r")
during=$(avg "$r" "$d")
after=$(avg $((d + 1)) 100000)
{
    echo "node flags: ${NODE_ARGS:-defaults}"
    echo "RF 2 vdisk of $SIZE, client 4 KiB randrw 70/30 QD16 through the owner (node 1); node $victim (a copy) killed -9"
    echo "baseline IOPS (s 2..$k): $baseline"
    echo "kill at +${k}s; writes fail until the dead node is listed down and the owner claimed again"
    echo "claim again / resync start at +${r}s: $((r - k)) s after the kill, IOPS meanwhile $outage"
    echo "resync ended at +${d}s (took $((resync_ms / 1000)) s; owner's log: $(grep -o 'chunks_sent=[0-9]* chunks_same=[0-9]* data_bytes=[0-9]*' <<<"$resynced"))"
    echo "time to full RF after the node loss: $((d - k)) s"
    echo "client IOPS during the resync: $during ($(awk -v a="$during" -v b="$baseline" 'BEGIN{ if (b > 0) printf "%.0f", 100 * a / b; else print "-" }') % of baseline; goal >= 70 %)"
    echo "client IOPS after: $after"
} | tee "$OUT_DIR/restore.txt"
cp "$BASE_DIR/node1.log" "$OUT_DIR/restore-node1.log" 2>/dev/null || true

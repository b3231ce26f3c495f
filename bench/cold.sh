#!/usr/bin/env bash
# cold.sh — the storage-engine-v2 stages: Ashlar with data larger than its cache and the kernel
# page cache dropped before every job, beside raw fio on a file of the same size on the same
# filesystem, plus durable writes and the page cache the node leaves behind. Rows land in the
# same results.tsv as the peers' matrix (system names end in -cold, so they never collide).
#
# Stages (COLD_STAGES, any subset, in this order):
#   uncached  : UNCACHED_JOBS on `raw-cold` (fio io_uring, direct=1, on COLD_IMG of
#               UNCACHED_SIZE; its sequential-write jobs also as `raw-cold-flush`, with one
#               fdatasync per QD writes: the ceiling of a server durable at acknowledgement)
#               and on `ashlar-cold` (fio nbd engine against an `ashlar node`
#               with --cache-size UNCACHED_CACHE and --direct-io ASHLAR_DIRECT_IO serving a
#               vdisk of UNCACHED_SIZE). Both are filled with 1 MiB sequential writes first.
#   durable   : DURABLE_JOBS (4 KiB random writes) on `ashlar-cold` (durable at ack), on
#               `raw-cold-dsync` (io_uring direct=1 sync=dsync on COLD_IMG) and on
#               `nbdkit-memory-cold` (nbdkit memory plugin of UNCACHED_SIZE, filled: the NBD
#               transport's ceiling, as ../shared/bench/peers/nbdkit.sh runs it) and on
#               `nbdkit-file-fua-cold` (nbdkit's file plugin on COLD_IMG behind its fua filter
#               with fuamode=force: the simplest NBD server whose writes are durable at reply).
#   pagecache : after drop_caches (and a 1 MiB read to page fio itself back in), read
#               PAGECACHE_READ through the node (fio nbd, 1 MiB sequential reads, QD8; wraps
#               around if the vdisk is smaller) and record the growth of `Cached:`
#               (/proc/meminfo), of the node's data files in the page cache (fincore), of the
#               node's RSS (/proc/PID/status) and of this cgroup's `cache` (memory.stat, cgroup
#               v1, or `file` on v2, if readable) -> pagecache.tsv in RESULTS_DIR.
# Before every fio job: wait until the node's oplog has drained (or stopped shrinking), then
# `sync; echo 3 > /proc/sys/vm/drop_caches` (needs root), then COLD_SETTLE seconds.
#
# Knobs (environment; the common ones, RUNTIME, RAMP, DATA_DIR, FIO, are in lib.sh):
#   COLD_STAGES="uncached durable pagecache"
#   UNCACHED_SIZE=4G        vdisk, raw file and nbdkit-memory size (keep it > UNCACHED_CACHE)
#   UNCACHED_CACHE=256M     the node's --cache-size
#   UNCACHED_JOBS="randread4k:32 randread4k:1 seqread1m:8 seqwrite1m:8"   WORKLOAD:QD ...
#   UNCACHED_SYSTEMS="raw ashlar"
#   DURABLE_JOBS="randwrite4k:1 randwrite4k:32"
#   DURABLE_SYSTEMS="raw-dsync nbdkit-memory nbdkit-file-fua ashlar"
#   PAGECACHE_READ=4G       bytes read through the node in the pagecache stage
#   PAGECACHE_MODES="on"    --direct-io of the node for each pagecache measurement; "on off"
#                           adds a buffered control run (node restarted on the same data)
#   ASHLAR_BIN (default: target/release/ashlar), ASHLAR_DIRECT_IO=on, ASHLAR_REACTORS=2
#   ASHLAR_NODE_ARGS        extra `ashlar node` flags (e.g. "--experimental-block-log")
#   ASHLAR_SHARDS           the vdisk's shards (--default-shards; unset: the node's default, 1).
#                           One shard puts a single client's cold reads on one reactor
#                           (20261127-214500-vm/NOTES.md); 2 spreads them over both.
#   DROP_CACHES=1           0: do not drop the page cache (the rows are then not "cold")
#   COLD_SETTLE=2           seconds to wait after dropping the page cache
#   DRAIN_WAIT=120          at most this many seconds waiting for the node's oplog to drain
#   COLD_IMG=$DATA_DIR/cold.img (rewritten at the start of every run, as the vdisk is filled),
#   COLD_NBD_PORT=10823, COLD_HTTP_PORT=10824, COLD_NBDKIT_PORT=10812
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
PEERS=${PEERS:-$HERE/../../shared/bench/peers}
source "$PEERS/lib.sh"
init_results cold
COLD_STAGES=${COLD_STAGES:-"uncached durable pagecache"}
UNCACHED_SIZE=${UNCACHED_SIZE:-4G}
UNCACHED_CACHE=${UNCACHED_CACHE:-256M}
UNCACHED_JOBS=${UNCACHED_JOBS:-"randread4k:32 randread4k:1 seqread1m:8 seqwrite1m:8"}
UNCACHED_SYSTEMS=${UNCACHED_SYSTEMS:-"raw ashlar"}
DURABLE_JOBS=${DURABLE_JOBS:-"randwrite4k:1 randwrite4k:32"}
DURABLE_SYSTEMS=${DURABLE_SYSTEMS:-"raw-dsync nbdkit-memory nbdkit-file-fua ashlar"}
PAGECACHE_READ=${PAGECACHE_READ:-4G}
PAGECACHE_MODES=${PAGECACHE_MODES:-on}
ASHLAR_BIN=${ASHLAR_BIN:-$HERE/../target/release/ashlar}
ASHLAR_DIRECT_IO=${ASHLAR_DIRECT_IO:-on}
ASHLAR_REACTORS=${ASHLAR_REACTORS:-2}
ASHLAR_SHARDS=${ASHLAR_SHARDS:-}
DROP_CACHES=${DROP_CACHES:-1}
COLD_SETTLE=${COLD_SETTLE:-2}
DRAIN_WAIT=${DRAIN_WAIT:-120}
COLD_IMG=${COLD_IMG:-$DATA_DIR/cold.img}
COLD_NBD_PORT=${COLD_NBD_PORT:-10823}
COLD_HTTP_PORT=${COLD_HTTP_PORT:-10824}
COLD_NBDKIT_PORT=${COLD_NBDKIT_PORT:-10812}
ensure_pkgs fio jq time libnbd-bin nbdkit curl util-linux || { note cold "could not install packages"; exit 1; }

SIZE_BYTES=$(numfmt --from=iec "$UNCACHED_SIZE")
READ_BYTES=$(numfmt --from=iec "$PAGECACHE_READ")
NODE_PID="" NBDKIT_PID="" NODE_MODE="" RAW_REWRITTEN=""
NODE_DIR=$DATA_DIR/ashlar-cold
API=http://127.0.0.1:$COLD_HTTP_PORT
URI=nbd://127.0.0.1:$COLD_NBD_PORT/bench
cleanup() {
    kill_bounded
    stop_pid "$NBDKIT_PID" nbdkit; NBDKIT_PID=""
    stop_pid "$NODE_PID" ashlar; NODE_PID=""
    rm -rf "$NODE_DIR"
}
trap cleanup EXIT
trap 'exit 143' TERM INT

has() { case " $2 " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

DROP_WARNED=0
drop_caches() {
    [ "$DROP_CACHES" = 1 ] || return 0
    run_bounded 300 sync || log "sync did not finish in 300 s"
    if ! { echo 3 > /proc/sys/vm/drop_caches; } 2>/dev/null; then
        [ $DROP_WARNED = 1 ] || note cold "could not drop the page cache (not root?): the -cold rows are not cold"
        DROP_WARNED=1
    fi
    sleep "$COLD_SETTLE"
}

# wait_drained : until the node's oplog holds at most 1 MiB (a few records can stay below the
# drain trigger for good) or has not shrunk for 5 s; at most DRAIN_WAIT s
wait_drained() {
    [ -n "$NODE_PID" ] || return 0
    local t0 last="" same=0 used
    t0=$(date +%s)
    while [ $(( $(date +%s) - t0 )) -lt "$DRAIN_WAIT" ]; do
        used=$(curl -s -m 5 "$API/stats/vdisks" | jq -r '[.vdisks[].oplog_live_bytes] | add // 0' 2>/dev/null)
        [ -n "$used" ] || { log "no oplog figure from $API/stats/vdisks"; return 0; }
        [ "$used" -le 1048576 ] && return 0
        if [ "$used" = "$last" ]; then same=$((same + 1)); [ $same -ge 10 ] && return 0; else same=0; fi
        last=$used
        sleep 0.5
    done
    log "oplog still at $used bytes after ${DRAIN_WAIT}s"
}

# cold_case SYSTEM WORKLOAD:QD FIO_ENGINE_ARGS... : one run_case from a cold page cache
cold_case() {
    local sys=$1 job=$2; shift 2
    wait_drained
    drop_caches
    run_case "$sys" "${job%%:*}" "${job##*:}" "$@"
}

start_node() { # DIRECT_IO(on|off)
    port_free "$COLD_NBD_PORT" || { note ashlar-cold "port $COLD_NBD_PORT busy"; return 1; }
    mkdir -p "$NODE_DIR"
    RUST_LOG=warn "$ASHLAR_BIN" node --data-dir "$NODE_DIR" --nbd-listen 127.0.0.1:$COLD_NBD_PORT \
        --http-listen 127.0.0.1:$COLD_HTTP_PORT --reactors "$ASHLAR_REACTORS" \
        --cache-size "$UNCACHED_CACHE" --direct-io "$1" --ensure-vdisk "bench:$UNCACHED_SIZE" \
        ${ASHLAR_SHARDS:+--default-shards "$ASHLAR_SHARDS"} ${ASHLAR_NODE_ARGS:-} \
        >> "$RESULTS_DIR/logs/ashlar-cold.server.log" 2>&1 &
    NODE_PID=$! NODE_MODE=$1
    if ! wait_port 127.0.0.1 "$COLD_NBD_PORT" 60; then
        note ashlar-cold "ashlar did not start: $(tail -2 "$RESULTS_DIR/logs/ashlar-cold.server.log" | tr '\n' ' ')"
        stop_pid "$NODE_PID" ashlar; NODE_PID=""; return 1
    fi
    log "ashlar node pid $NODE_PID, --direct-io $1, node info: $(curl -s -m 5 "$API/api/v1/node" | jq -c '{disk_io, direct_io, buffered_fallback_opens, cache_bytes}' 2>/dev/null)"
}
stop_node() { stop_pid "$NODE_PID" ashlar; NODE_PID=""; }

# A fresh node with its vdisk filled (1 MiB sequential writes), oplog drained.
NODE_FILLED=0
node_up() {
    [ -n "$NODE_PID" ] && [ "$NODE_MODE" = "$ASHLAR_DIRECT_IO" ] && return 0
    [ -x "$ASHLAR_BIN" ] || { note ashlar-cold "no binary at $ASHLAR_BIN (cargo build --release -p ashlar)"; return 1; }
    stop_node
    [ $NODE_FILLED = 1 ] || rm -rf "$NODE_DIR"
    start_node "$ASHLAR_DIRECT_IO" || return 1
    [ $NODE_FILLED = 1 ] && return 0
    log "filling ashlar-cold ($UNCACHED_SIZE)"
    local t0=$SECONDS
    if run_bounded 900 "$FIO" --name=fill --ioengine=nbd --uri="$URI" --rw=write --bs=1M --iodepth=8 \
        >/dev/null 2>"$RESULTS_DIR/logs/ashlar-cold.fill.err"; then
        NODE_FILLED=1
        log "filled ashlar-cold in $((SECONDS - t0)) s"
    else
        # Reads of an unfilled vdisk hit holes and never touch the disk: no row of it means
        # anything, so none is run.
        note ashlar-cold "pre-fill failed, Ashlar's cold rows not run: $(tail -2 "$RESULTS_DIR/logs/ashlar-cold.fill.err" | tr '\n' ' ')"
        stop_node
        return 1
    fi
    note ashlar-cold "ashlar $("$ASHLAR_BIN" --version | awk '{print $2}'), $ASHLAR_REACTORS reactors, ${ASHLAR_SHARDS:-default} shards, cache $UNCACHED_CACHE, vdisk $UNCACHED_SIZE,${ASHLAR_NODE_ARGS:+ node flags $ASHLAR_NODE_ARGS,} $(curl -s -m 5 "$API/api/v1/node" | jq -r '"disk I/O \(.disk_io), direct_io \(.direct_io), buffered fallback opens \(.buffered_fallback_opens)"' 2>/dev/null), data on $(df -hT "$DATA_DIR" | awk 'NR==2{print $2}') under $NODE_DIR; page cache dropped before every job; writes durable at acknowledgement"
}

cache_note() { # LABEL
    curl -s -m 5 "$API/stats/cache" | jq -r --arg l "$1" '.total |
        "\($l): node cache hits \(.single_touch_hits + .multi_touch_hits), misses \(.misses) (capacity \(.capacity_bytes / 1048576 | floor) MiB)"' \
        2>/dev/null | while read -r line; do note ashlar-cold "$line"; done
}

raw_ready() {
    [ -n "$RAW_REWRITTEN" ] && return 0
    # Rewritten once per run, like Ashlar's vdisk: the virtual disk's host keeps recently
    # written data in its own cache, so a file written hours ago reads ~15x slower than one
    # written a minute ago (4k vs 64k IOPS here), and the two sides would not be comparable.
    rm -f "$COLD_IMG.filled"
    SIZE=$UNCACHED_SIZE fill_file "$COLD_IMG" 1 || { note raw-cold "could not create $COLD_IMG"; return 1; }
    RAW_REWRITTEN=1
}
raw_args=(--ioengine=io_uring --direct=1 --filename="$COLD_IMG" --size="$UNCACHED_SIZE")

# ---- uncached -----------------------------------------------------------------------------
if has uncached "$COLD_STAGES"; then
    if has raw "$UNCACHED_SYSTEMS" && raw_ready; then
        note raw-cold "fio io_uring direct=1 on $COLD_IMG ($UNCACHED_SIZE, $(df -hT "$COLD_IMG" | awk 'NR==2{print $2}')), page cache dropped before every job"
        record_load raw-cold; SERVER_PIDS=""
        for j in $UNCACHED_JOBS; do cold_case raw-cold "$j" "${raw_args[@]}"; done
        # The sequential-write ceiling of any server whose writes are durable at
        # acknowledgement: with QD writes in flight it cannot flush less often than once per
        # QD writes (an optimistic bound: fio does not wait for the writes a sync covers).
        record_load raw-cold-flush; SERVER_PIDS=""
        for j in $UNCACHED_JOBS; do
            case $j in seqwrite*) cold_case raw-cold-flush "$j" "${raw_args[@]}" --fdatasync="${j##*:}" ;; esac
        done
    fi
    if has ashlar "$UNCACHED_SYSTEMS" && node_up; then
        record_load ashlar-cold; SERVER_PIDS=$NODE_PID
        cache_note "before the uncached jobs"
        for j in $UNCACHED_JOBS; do cold_case ashlar-cold "$j" --ioengine=nbd --uri="$URI"; done
        cache_note "after the uncached jobs"
    fi
fi

# nbdkit_durable NAME FILL NOTE NBDKIT-ARGS...: the durable jobs against an nbdkit started with
# NBDKIT-ARGS (filled first when FILL is 1), with the node stopped so its memory and CPU stay
# out of the rows.
nbdkit_durable() {
    local name=$1 fill=$2 what=$3; shift 3
    if ! port_free "$COLD_NBDKIT_PORT"; then
        note "$name" "port $COLD_NBDKIT_PORT busy, skipped"
        return
    fi
    stop_node   # restarted for Ashlar's rows on the same data
    nbdkit -f --exit-with-parent -i 127.0.0.1 -p "$COLD_NBDKIT_PORT" -t "${NBDKIT_THREADS:-16}" \
        "$@" > "$RESULTS_DIR/logs/$name.server.log" 2>&1 &
    NBDKIT_PID=$!
    if wait_port 127.0.0.1 "$COLD_NBDKIT_PORT" 20; then
        local kuri=nbd://127.0.0.1:$COLD_NBDKIT_PORT/
        [ "$fill" = 1 ] && { run_bounded 300 "$FIO" --name=fill --ioengine=nbd --uri="$kuri" \
            --rw=write --bs=1M --iodepth=8 >/dev/null 2>&1 || note "$name" "pre-fill failed"; }
        note "$name" "$(nbdkit --version), $what, page cache dropped before every job"
        record_load "$name"; SERVER_PIDS=$NBDKIT_PID
        for j in $DURABLE_JOBS; do cold_case "$name" "$j" --ioengine=nbd --uri="$kuri"; done
    else
        note "$name" "nbdkit did not start: $(tail -2 "$RESULTS_DIR/logs/$name.server.log" | tr '\n' ' ')"
    fi
    stop_pid "$NBDKIT_PID" nbdkit; NBDKIT_PID=""
}

# ---- durable ------------------------------------------------------------------------------
if has durable "$COLD_STAGES"; then
    if has raw-dsync "$DURABLE_SYSTEMS" && raw_ready; then
        record_load raw-cold-dsync; SERVER_PIDS=""
        for j in $DURABLE_JOBS; do cold_case raw-cold-dsync "$j" "${raw_args[@]}" --sync=dsync; done
    fi
    if has nbdkit-memory "$DURABLE_SYSTEMS"; then
        nbdkit_durable nbdkit-memory-cold 1 "memory plugin size=$UNCACHED_SIZE (filled)" \
            memory "size=$UNCACHED_SIZE"
    fi
    if has nbdkit-file-fua "$DURABLE_SYSTEMS" && raw_ready; then
        nbdkit_durable nbdkit-file-fua-cold 0 "file plugin on $COLD_IMG with the fua filter, fuamode=force: every write is made durable before its reply (pwrite + fdatasync), as Ashlar's are" \
            --filter=fua file "$COLD_IMG" fuamode=force
    fi
    if has ashlar "$DURABLE_SYSTEMS" && node_up; then
        record_load "ashlar-cold (durable)"; SERVER_PIDS=$NODE_PID
        for j in $DURABLE_JOBS; do cold_case ashlar-cold "$j" --ioengine=nbd --uri="$URI"; done
    fi
fi

# ---- pagecache ----------------------------------------------------------------------------
meminfo_bytes() { awk -v k="$1:" '$1 == k {print $2 * 1024; exit}' /proc/meminfo; }
status_bytes() { awk -v k="$2:" '$1 == k {print $2 * 1024; exit}' "/proc/$1/status" 2>/dev/null; }
fincore_bytes() { # bytes of the files under DIR resident in the page cache
    find "$1" -type f -print0 2>/dev/null | timeout 120 xargs -0 -r fincore --bytes --noheadings --raw -o RES 2>/dev/null |
        awk '{s += $1} END {print s + 0}'
}
CGROUP_STAT=""
cg=$(awk -F: '$2 == "memory" {print $3; exit}' /proc/self/cgroup 2>/dev/null)
[ -n "$cg" ] && [ -r "/sys/fs/cgroup/memory$cg/memory.stat" ] && CGROUP_STAT=/sys/fs/cgroup/memory$cg/memory.stat
[ -z "$CGROUP_STAT" ] && cg=$(awk -F: '$1 == "0" {print $3; exit}' /proc/self/cgroup 2>/dev/null) &&
    [ -r "/sys/fs/cgroup$cg/memory.stat" ] && CGROUP_STAT=/sys/fs/cgroup$cg/memory.stat
cgroup_cache() { # page cache charged to this script's memory cgroup (v1 `cache`, v2 `file`)
    [ -n "$CGROUP_STAT" ] || { echo "-"; return; }
    awk '$1 == "cache" || $1 == "file" {print $2; exit}' "$CGROUP_STAT"
}

if has pagecache "$COLD_STAGES"; then
    [ -f "$RESULTS_DIR/pagecache.tsv" ] || printf '%s\n' "system	direct_io	bytes_read	elapsed_s	mibs	cached_growth	fincore_growth	rss_growth	cgroup_cache_growth	rss_after	status" \
        > "$RESULTS_DIR/pagecache.tsv"
    for mode in $PAGECACHE_MODES; do
        ASHLAR_DIRECT_IO=$mode
        node_up || { printf 'ashlar-cold\t%s\t%s\t-\t-\t-\t-\t-\t-\t-\tFAILED (no node)\n' "$mode" "$READ_BYTES" >> "$RESULTS_DIR/pagecache.tsv"; continue; }
        wait_drained
        drop_caches
        # Starting fio pages in fio and its libraries (~60 MiB here: Debian's fio links librbd,
        # glusterfs, ...): read 1 MiB first so the baseline already holds them.
        run_bounded 120 "$FIO" --name=prime --ioengine=nbd --uri="$URI" --rw=read --bs=1M --io_size=1M \
            >/dev/null 2>&1 || log "pagecache ($mode): priming read failed"
        c0=$(meminfo_bytes Cached); f0=$(fincore_bytes "$NODE_DIR"); r0=$(status_bytes "$NODE_PID" VmRSS); g0=$(cgroup_cache)
        json=$RESULTS_DIR/json/ashlar-cold.pagecache-$mode.json
        log "pagecache ($mode): reading $PAGECACHE_READ through the node; Cached $((c0 >> 20)) MiB, node files in cache $((f0 >> 20)) MiB"
        t0=$(date +%s.%N)
        run_bounded $((120 + READ_BYTES / 10485760)) "$FIO" --name=pagecache --ioengine=nbd --uri="$URI" --rw=read \
            --bs=1M --iodepth=8 --io_size="$READ_BYTES" --output-format=json --output="$json" \
            2>"$RESULTS_DIR/logs/ashlar-cold.pagecache-$mode.fio.err"
        rc=$?
        t1=$(date +%s.%N)
        c1=$(meminfo_bytes Cached); f1=$(fincore_bytes "$NODE_DIR"); r1=$(status_bytes "$NODE_PID" VmRSS); g1=$(cgroup_cache)
        got=$(jq -r '.jobs[0].read.io_bytes' "$json" 2>/dev/null)
        el=$(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.1f", b - a}')
        if [ $rc -eq 0 ] && [ -n "$got" ] && [ "$got" != null ]; then
            st=ok
        else
            st="FAILED (fio rc=$rc)"; got=${got:--}
        fi
        mibs=$(jq -r '.jobs[0].read.bw / 1024 * 10 | round / 10' "$json" 2>/dev/null || echo -)
        dg=-; [ "$g0" != - ] && [ -n "$g1" ] && dg=$((g1 - g0))
        printf 'ashlar-cold\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$mode" "$got" "$el" "${mibs:--}" \
            $((c1 - c0)) $((f1 - f0)) $((${r1:-0} - ${r0:-0})) "$dg" "${r1:--}" "$st" >> "$RESULTS_DIR/pagecache.tsv"
        log "pagecache ($mode): read $got bytes in ${el}s; Cached grew $(((c1 - c0) >> 20)) MiB, node files in cache $(((f1 - f0) >> 20)) MiB, node RSS $(((${r1:-0} - ${r0:-0}) >> 20)) MiB, cgroup cache ${dg} bytes"
    done
    [ -n "$CGROUP_STAT" ] && note ashlar-cold "pagecache: cgroup growth read from $CGROUP_STAT (this script's cgroup, shared with whatever else runs in it)"
fi
finish_standalone

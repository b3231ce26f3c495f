# probe-lib.sh — what durable-probe.sh, read-probe.sh and write-probe.sh share: sourced, not run.
# They start one node (2 reactors, CACHE_SIZE of cache (256M), vdisk `probe`) on a fresh DATA_DIR and
# read the request counters of the block device under it.

# Checks root and the binary, recreates DATA_DIR, and sets `disk` and `stat_file` (the
# device's /sys stat file, for its request counters).
probe_prepare() {
    [ "$(id -u)" = 0 ] || { echo "run as root (the page cache is dropped before the job)" >&2; exit 1; }
    [ -x "$ASHLAR_BIN" ] || { echo "no binary at $ASHLAR_BIN (cargo build --release -p ashlar)" >&2; exit 1; }
    rm -rf "$DATA_DIR"
    mkdir -p "$DATA_DIR"
    disk=$(basename "$(df --output=source "$DATA_DIR" | tail -1)")
    stat_file=/sys/block/$disk/stat
    [ -r "$stat_file" ] || stat_file=/sys/class/block/$disk/stat
}

# probe_start_node LOG RUST_LOG: starts the node (plus NODE_ARGS) with its output in LOG,
# stops it when the script exits, waits until it answers, and sets NODE_PID and URI.
probe_start_node() {
    # shellcheck disable=SC2086 # NODE_ARGS is a list of flags
    RUST_LOG=$2 "$ASHLAR_BIN" node --data-dir "$DATA_DIR" \
        --nbd-listen 127.0.0.1:$NBD_PORT --http-listen 127.0.0.1:$HTTP_PORT --reactors 2 \
        --cache-size "${CACHE_SIZE:-256M}" --ensure-vdisk "probe:$VDISK_SIZE" ${NODE_ARGS:-} > "$1" 2>&1 &
    NODE_PID=$!
    trap 'kill $NODE_PID 2>/dev/null || true' EXIT
    for _ in $(seq 100); do
        curl -sf "http://127.0.0.1:$HTTP_PORT/healthz" >/dev/null 2>&1 && break
        sleep 0.2
    done
    URI=nbd://127.0.0.1:$NBD_PORT/probe
}

# probe_busiest_threads SECONDS: prints the node's busiest threads over the next SECONDS, in
# % of a CPU (utime + stime from /proc/PID/task).
probe_busiest_threads() {
    local before
    before=$(probe_thread_ticks)
    sleep "$1"
    echo "busiest node threads over $1 s (% of a CPU): $(paste <(echo "$before") <(probe_thread_ticks) \
        | awk -v hz="$(getconf CLK_TCK)" -v s="$1" '$4 > $2 {printf "%s %.0f\n", $1, ($4 - $2) * 100 / hz / s}' \
        | sort -k2 -nr | head -6 | tr '\n' ' ')"
}

probe_thread_ticks() {
    for t in /proc/$NODE_PID/task/*; do
        echo "$(cat "$t/comm") $(awk '{print $14 + $15}' "$t/stat")"
    done
}

# probe_fill_and_drain MAX_LIVE_BYTES: fills the vdisk with 1 MiB sequential writes, then
# waits (at most 60 s) until its oplog holds at most MAX_LIVE_BYTES, so the job meets the data
# in the extent store.
probe_fill_and_drain() {
    fio --name=fill --ioengine=nbd --uri="$URI" --rw=write --bs=1M --iodepth=8 >/dev/null
    local live
    for _ in $(seq 120); do
        live=$(curl -s "http://127.0.0.1:$HTTP_PORT/stats/vdisks" | jq '[.vdisks[].oplog_live_bytes] | add')
        [ "$live" -le "$1" ] && break
        sleep 0.5
    done
}

# probe_drop_caches: writes back and drops the kernel page cache, then lets the disk settle.
probe_drop_caches() {
    sync
    echo 3 > /proc/sys/vm/drop_caches
    sleep 2
}

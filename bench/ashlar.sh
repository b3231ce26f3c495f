#!/usr/bin/env bash
# ashlar.sh — Ashlar in the peers' table: an `ashlar node` on 127.0.0.1 serving one vdisk,
# driven by fio's nbd engine with the same workload matrix as nbdkit.sh.
#   ashlar          : reads after the vdisk was filled and read once (served from the cache
#                     when the working set fits --cache-size; reads over 128 KiB always come
#                     from the disk), writes durable at ack
#   ashlar-uncached : same with a read cache too small to hold the data (--cache-size 0)
#   ashlar-2shards  : as `ashlar`, with the vdisk on two shards (--default-shards 2), one per
#                     reactor: half of a connection's requests cross reactors (shown beside it)
# Knobs (environment): see ../shared/bench/peers/lib.sh; ASHLAR_BIN (default: release build),
#   ASHLAR_VARIANTS="cached uncached cached-2shards", ASHLAR_NBD_PORT=10821, ASHLAR_HTTP_PORT=10822,
#   ASHLAR_CACHE=6G, ASHLAR_REACTORS=2.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
PEERS=${PEERS:-$HERE/../../shared/bench/peers}
source "$PEERS/lib.sh"
init_results ashlar
ASHLAR_BIN=${ASHLAR_BIN:-$HERE/../target/release/ashlar}
ASHLAR_VARIANTS=${ASHLAR_VARIANTS:-"cached uncached cached-2shards"}
ASHLAR_NBD_PORT=${ASHLAR_NBD_PORT:-10821}
ASHLAR_HTTP_PORT=${ASHLAR_HTTP_PORT:-10822}
ASHLAR_CACHE=${ASHLAR_CACHE:-6G}
ASHLAR_REACTORS=${ASHLAR_REACTORS:-2}
ensure_pkgs fio jq time libnbd-bin || { note ashlar "could not install packages"; exit 1; }
[ -x "$ASHLAR_BIN" ] || { note ashlar "no binary at $ASHLAR_BIN (cargo build --release)"; exit 1; }

NODE_PID=""
NODE_DIR=$DATA_DIR/ashlar-node
cleanup() { kill_bounded; stop_pid "$NODE_PID" ashlar; NODE_PID=""; }
trap cleanup EXIT
trap 'exit 143' TERM INT

for v in $ASHLAR_VARIANTS; do
    case $v in
        cached) sys=ashlar; cache=$ASHLAR_CACHE; shards="" ;;
        uncached) sys=ashlar-uncached; cache=0; shards="" ;;
        cached-2shards) sys=ashlar-2shards; cache=$ASHLAR_CACHE; shards="--default-shards 2" ;;
        *) note ashlar "unknown variant $v"; continue ;;
    esac
    rm -rf "$NODE_DIR"; mkdir -p "$NODE_DIR"
    port_free "$ASHLAR_NBD_PORT" || { note "$sys" "port $ASHLAR_NBD_PORT busy"; continue; }
    RUST_LOG=warn "$ASHLAR_BIN" node --data-dir "$NODE_DIR" --nbd-listen 127.0.0.1:$ASHLAR_NBD_PORT \
        --http-listen 127.0.0.1:$ASHLAR_HTTP_PORT --reactors "$ASHLAR_REACTORS" --cache-size "$cache" \
        $shards --ensure-vdisk "bench:$SIZE" > "$RESULTS_DIR/logs/$sys.server.log" 2>&1 &
    NODE_PID=$!
    if ! wait_port 127.0.0.1 "$ASHLAR_NBD_PORT" 60; then
        note "$sys" "ashlar did not start: $(tail -2 "$RESULTS_DIR/logs/$sys.server.log" | tr '\n' ' ')"
        cleanup; continue
    fi
    uri=nbd://127.0.0.1:$ASHLAR_NBD_PORT/bench
    log "filling $sys"
    run_bounded 900 "$FIO" --name=fill --ioengine=nbd --uri="$uri" --rw=write --bs=1M \
        --iodepth=8 >/dev/null 2>&1 || {
        # Reads of an unfilled vdisk hit holes and never touch the disk: no row would mean anything.
        note "$sys" "pre-fill failed, its rows not run"
        cleanup; continue
    }
    if [ "$v" != uncached ]; then
        log "warming the read cache of $sys"
        # 256 KiB reads fill the cache (longer ones are scans and fill nothing); the 4 KiB
        # pass then hits every block a second time, so the measured jobs see the steady
        # state, not the cache's one-time promotions.
        run_bounded 900 "$FIO" --name=warm --ioengine=nbd --uri="$uri" --rw=read --bs=256k \
            --iodepth=8 >/dev/null 2>&1 || true
        run_bounded 900 "$FIO" --name=warm2 --ioengine=nbd --uri="$uri" --rw=read --bs=4k \
            --iodepth=32 >/dev/null 2>&1 || true
    fi
    note "$sys" "ashlar $("$ASHLAR_BIN" --version | awk '{print $2}'), $ASHLAR_REACTORS reactors, ${shards:-default shards}, cache $cache, data on $(df -hT "$NODE_DIR" | awk 'NR==2{print $2}') under $NODE_DIR; writes durable at acknowledgement"
    log "== $sys: pid $NODE_PID $uri runtime=${RUNTIME}s"
    SERVER_PIDS=$NODE_PID
    run_matrix "$sys" --ioengine=nbd --uri="$uri"
    ps -o rss= -p "$NODE_PID" | awk -v s="$sys" '{printf "%s\tnode RSS after the matrix: %.0f MiB\n", s, $1/1024}' >> "$RESULTS_DIR/notes.tsv"
    cleanup
done
finish_standalone

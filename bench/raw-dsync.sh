#!/usr/bin/env bash
# raw-dsync.sh — the durable local limit: fio io_uring on the shared ext4 image with
# direct=1 and sync=dsync (every write durable before it completes), the bar Ashlar's
# durable-at-acknowledgement writes are compared with.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
PEERS=${PEERS:-$HERE/../../shared/bench/peers}
source "$PEERS/lib.sh"
init_results raw-dsync
ensure_pkgs fio jq time || { note raw-dsync "could not install fio/jq"; exit 1; }
trap 'kill_bounded' EXIT
trap 'exit 143' TERM INT
fill_file "$DISK_IMG" 1 || { note raw-ext4-dsync "could not create $DISK_IMG"; exit 1; }
SERVER_PIDS=""
WORKLOADS=${DSYNC_WORKLOADS:-"randwrite4k randrw8k seqwrite1m"} \
    run_matrix raw-ext4-dsync --ioengine=io_uring --direct=1 --sync=dsync --filename="$DISK_IMG" --size="$SIZE"
finish_standalone

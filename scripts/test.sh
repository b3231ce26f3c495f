#!/usr/bin/env bash
# The whole test suite: unit tests, storage crash/property tests, and end-to-end tests that run
# a real `ashlar node` against real clients (fio, nbdinfo, nbdcopy, qemu-img, nbdfuse).
# Needs: fio libnbd-bin nbdkit qemu-utils fuse3 e2fsprogs, and etcd-server for the MetaStore
# tests, which start their own etcd (.ci/run installs them).
set -euo pipefail
cd "$(dirname "$0")/.."
# Release mode: the end-to-end tests push real I/O through the node. The whole run is bounded
# so a hung test fails CI with a message instead of running into CI's own limit.
timeout --kill-after=30 3600 cargo test --workspace --release -- --test-threads=2 "$@"
# The end-to-end tests again with the node's disk I/O through the page cache instead of
# O_DIRECT (--direct-io off), the mode a filesystem that refuses O_DIRECT falls back to.
ASHLAR_TEST_DIRECT_IO=off timeout --kill-after=30 1800 \
    cargo test --release -p ashlar --tests -- --test-threads=2 "$@"

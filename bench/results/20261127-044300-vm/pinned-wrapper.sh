#!/bin/sh
# Runs node 1 on CPU 0 and nodes 2 and 3 on CPU 1 (an experiment: copies do not preempt the owner).
case "$*" in
  *ashlar-cluster-bench/node1*) exec taskset -c 0 /tmp/bench-bin/intake "$@" ;;
  *ashlar-cluster-bench/node2*|*ashlar-cluster-bench/node3*) exec taskset -c 1 /tmp/bench-bin/intake "$@" ;;
  *) exec /tmp/bench-bin/intake "$@" ;;
esac

#!/usr/bin/env bash
# call1.sh's first three parts with four of the lab's kernels, for a call with less device time (about 5 minutes):
# bash benchmarks/logs/2026-12-07-s17/call2.sh OUT
PARTS="lab probe floor" LAB_VARIANTS=sub,xall,xraw,xall-det LAB_T=110 PROBE_T=110 \
    exec bash "$(dirname "$0")/call1.sh" "$@"

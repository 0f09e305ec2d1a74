#!/usr/bin/env bash
# The shortest call: call1.sh's lab (four of its kernels) and the probe beside it (about 3 minutes):
# bash benchmarks/logs/2026-12-07-s17/call3.sh OUT
PARTS="lab probe" LAB_VARIANTS=sub,xall,xraw,xall-det LAB_T=100 PROBE_T=100 exec bash "$(dirname "$0")/call1.sh" "$@"

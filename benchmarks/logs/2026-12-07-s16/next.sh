#!/usr/bin/env bash
# The next GPU call, on whichever GPU comes:
# - an H200: the decode attention's lighter launch at batch 1 / 16 against the H200 table's, then every launch on
#   the tuning's steps (the H200 branch of benchmarks/logs/2026-12-07-s15/pending-next.sh): decides the H200 table;
# - any other (an H100): the later PDL trigger on its three templates only (`LLMC_PDL_LATE=all`, which until this
#   tree also took the early trigger off every other kernel), beside PDL as shipped, on one machine, both arms on
#   the first arm's tile choices (one tuning cache).
# First, on either: benchmarks/step_floor.py, whose chains now also run as one persistent kernel with grid barriers
# (about a minute): could a step of one kernel reach what one of 293 launches cannot?
# Usage, from the repository root on the GPU: bash benchmarks/logs/2026-12-07-s16/next.sh OUT (about 6-9 minutes;
# on an H100 the parts' own limits keep it under 10; on an H200 they allow 10.5, and what is done by then comes back)
OUT=$1; mkdir -p $OUT
python3 -c "import llmc" 2>/dev/null || pip install -q --no-deps -e . >/dev/null 2>&1
n=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$n" | tee $OUT/gpu.txt
timeout 120 python3 benchmarks/step_floor.py --out $OUT/floor > $OUT/floor.log 2>&1
echo "step_floor rc $?"; grep -A40 "one persistent kernel" $OUT/floor.log | head -40
case "$n" in
  *H200*) bash benchmarks/logs/2026-12-07-s15/pending-next.sh $OUT ;;
  *) ARMS="${ARMS:-all late-all}" ARM_TIMEOUT=${ARM_TIMEOUT:-200} SHARED_CACHE=1 \
         bash benchmarks/logs/2026-12-07-s15/pending-pdl-pairs/pdl-pairs.sh $OUT/pdl ;;
esac

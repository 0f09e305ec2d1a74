#!/usr/bin/env bash
# One GPU call (about 9 minutes): the int4 wgmma GEMV's tests on the hardware, then the 8B int4 g128 decode at batch
# 1 / 16 (llmc's default, batch-invariant compile) in the arms of ../2026-12-07-s18/call2.sh (ARMS, default
# "trial triton": the wgmma kernel offered with its configs not yet timed, and the Triton qlinear alone), which
# prints each arm's chosen decode attention launch and qlinear kernels. Then, as time allows, the per-linear
# probe at 1-64 rows (PROBE=0 skips it).
# Usage, from the repository root on the GPU: bash benchmarks/logs/2026-12-07-s19/call1.sh OUT
OUT=$1; mkdir -p $OUT
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
ARMS=${ARMS:-trial triton} ARM_T=${ARM_T:-190} bash benchmarks/logs/2026-12-07-s18/call2.sh $OUT/decode
if [ "${PROBE:-1}" = 1 ]; then
  timeout ${PROBE_T:-150} python3 benchmarks/qlinear_probe.py --shapes gate_up,down,qkv,o_proj --ms 1,16,32,64 \
      --formats int4-g128 --variants default,split2,wgmma,wgmma-trial --out $OUT/probe > $OUT/probe.log 2>&1
  echo "probe rc $?"; tail -30 $OUT/probe.log
fi

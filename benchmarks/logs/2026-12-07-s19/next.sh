#!/usr/bin/env bash
# The GPU work owed after call 1 (two calls of about 6 and 9 minutes, on an H200):
#   PART=ab: call2.sh, the wgmma GEMV (copies ahead now default candidates) against the Triton qlinear alone,
#            with the decode attention launch the same in both arms (the A/B without call 1's confound);
#   PART=probe: each 8B int4 linear at 1, 16, 32 and 64 rows, the Triton qlinear's default and doubled K split
#            beside every wgmma config, the 4-warpgroup trial configs included (per-linear figures on the H200);
#   PART=mixed: the mixed workload's bars with this tree's kernels and tables (FP8, int8 W8A8, int4 against bf16
#            untuned, longest output first, as in RESULTS "2026-12-07 (later)").
# Usage, from the repository root on the GPU: PART=ab|probe|mixed bash benchmarks/logs/2026-12-07-s19/next.sh OUT
OUT=$1; mkdir -p $OUT
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tee $OUT/gpu.txt
case ${PART:-ab} in
  ab) bash benchmarks/logs/2026-12-07-s19/call2.sh $OUT ;;
  probe)
    timeout ${PROBE_T:-300} python3 benchmarks/qlinear_probe.py --shapes gate_up,down,qkv,o_proj --ms 1,16,32,64 \
        --formats int4-g128 --variants default,split2,wgmma,wgmma-trial --out $OUT/probe > $OUT/probe.log 2>&1
    echo "probe rc $?"; tail -60 $OUT/probe.log ;;
  mixed)
    timeout ${MIXED_T:-570} python3 benchmarks/quant_decode_bench.py --shape 8b --quant fp8,w8a8,rtn4 --no-decode \
        --mixed 128 --bf16-no-tune --longest-first --out $OUT/mixed > $OUT/mixed.log 2>&1
    echo "mixed rc $?"; tail -12 $OUT/mixed.log ;;
esac

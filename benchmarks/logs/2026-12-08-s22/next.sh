#!/usr/bin/env bash
# The GPU work owed after calls 1-3, on an H200 (the bars' GPU), in two calls on one machine:
#   PART=int4: call3.sh: the tall form's GPU tests (the configs added after calls 1-2 included), then the 8B int4
#              compile with the shipped H200 table (no int4 choice at 128+ tokens, so the tall form is timed
#              there) against bf16: decode at batch 128 and the mixed workload;
#   PART=8bit: the mixed workload's FP8 and int8 W8A8 bars with this tree's kernels and tables (as RESULTS
#              "2026-12-07 (later)" measured them).
# Usage, from the repository root on the GPU: PART=int4|8bit bash benchmarks/logs/2026-12-08-s22/next.sh OUT
OUT=$1; mkdir -p $OUT
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
case ${PART:-int4} in
  int4) bash benchmarks/logs/2026-12-08-s22/call3.sh $OUT ;;
  8bit)
    nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tee $OUT/gpu.txt
    timeout ${MIXED_T:-560} python3 benchmarks/quant_decode_bench.py --shape 8b --quant fp8,w8a8 --no-decode \
        --mixed 128 --bf16-no-tune --longest-first --out $OUT/mixed > $OUT/mixed.log 2>&1
    echo "mixed rc $?"; tail -8 $OUT/mixed.log ;;
esac

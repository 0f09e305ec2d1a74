#!/usr/bin/env bash
# Pending: which kernel's PDL overlap with the kernel before it gains or costs the 8B int4 decode. With 8-warp
# decode attention programs PDL cost batch 16 3%, with 4-warp ones it gained 5%, and batch 1 gains 7% either way
# (RESULTS 2026-12-07, decode launch). Each arm runs the batch-1 / 16 decode (bf16 untuned, int4 tuned from the
# shipped table, a fresh tuning cache each) with PDL off for one template's kernels only (benchmarks/pdl_off.py);
# "all" keeps PDL on everywhere, "none" turns it off everywhere (LLMC_PDL=0); "late-NAME[+NAME]" keeps PDL on
# everywhere but lets the next kernel start only after the named templates' main loops (LLMC_PDL_LATE; "late-all":
# every template that has the later trigger: qmatmul_linear, paged_attention_decode, matmul).
# SHARED_CACHE=1: every arm compiles with one tuning cache, so that all run the first arm's tile choices and differ
# in the PDL switch alone (by default each arm tunes afresh, and the tuner's own spread joins the switch's effect).
# Usage, from the repository root on the GPU (95-130 s an arm, PDL off compiling its kernels afresh; three arms a call):
#   ARMS="all paged_attention_decode qmatmul_linear" bash benchmarks/logs/2026-12-07-s15/pending-pdl-pairs/pdl-pairs.sh OUT
#   ARMS="rms_norm elementwise rope_kv_write" bash benchmarks/logs/2026-12-07-s15/pending-pdl-pairs/pdl-pairs.sh OUT
#   ARMS="late-all late-qmatmul_linear late-paged_attention_decode" bash .../pdl-pairs.sh OUT
OUT=$1; mkdir -p $OUT
python3 -c "import llmc" 2>/dev/null || pip install -q --no-deps -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tee $OUT/gpu.txt
t0=$(date +%s)
ARGS="--shape ${SHAPE:-8b} --quant rtn4 --new 128 --bf16-no-tune"
for arm in ${ARMS:-all none late-all paged_attention_decode qmatmul_linear rms_norm elementwise rope_kv_write}; do
  if [ -n "$SHARED_CACHE" ]; then  # one tuning cache: the first arm tunes, the others take its choices
    export LLMC_CACHE_DIR=/tmp/llmc_cache_pdl_shared; rm -rf /tmp/tmp*
  else
    export LLMC_CACHE_DIR=/tmp/llmc_cache_pdl_$arm; rm -rf $LLMC_CACHE_DIR /tmp/tmp*
  fi
  case $arm in
    all) cmd="python3 benchmarks/quant_decode_bench.py $ARGS" ;;
    none) cmd="env LLMC_PDL=0 python3 benchmarks/quant_decode_bench.py $ARGS" ;;
    late-*) late=${arm#late-}; cmd="env LLMC_PDL_LATE=${late//+/,} python3 benchmarks/quant_decode_bench.py $ARGS" ;;
    *) cmd="python3 benchmarks/pdl_off.py --templates $arm -- benchmarks/quant_decode_bench.py $ARGS" ;;
  esac
  timeout ${ARM_TIMEOUT:-170} $cmd --out $OUT/$arm > $OUT/$arm.log 2>&1
  echo "$arm rc $? at $(( $(date +%s) - t0 )) s"; grep -A2 "^config" $OUT/$arm.log | head -3 | tail -2
done

#!/usr/bin/env bash
# int4 FOLD configs on the GPU: the loop's waits under the GPU's Triton, the compiled tests, the 8B decode with
# FOLD offered to the tuning and without (own tuning caches), then each linear's best shipped and FOLD config.
# Usage, from the repository root: bash benchmarks/logs/2026-12-07-s14/call1.sh OUT
OUT=$1; mkdir -p $OUT; export PYTHONPATH=.
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
for c in 0,64,2,4,4,3 1,64,2,4,4,3 product,0,64,2,4,4,3 product,1,64,2,4,4,3 product,1,64,1,4,4,3; do
  echo "ttgir $c: $(python3 benchmarks/int4_async_lab.py --ttgir $c 2>&1 | grep -o 'pendings = [0-9]*' | sort | uniq -c | tr -s ' ' | tr '\n' ';')"
done | tee $OUT/ttgir.txt
TRITON_INTERPRET=0 timeout 100 python3 -m pytest -q -p no:cacheprovider tests/codegen/test_qmatmul.py \
    -k "fold or formats or split_k" > $OUT/tests.log 2>&1; el "tests rc $?: $(tail -1 $OUT/tests.log)"
for arm in ${ARMS:-0 1}; do
  LLMC_INT4_FOLD=$arm LLMC_CACHE_DIR=/tmp/llmc_fold$arm timeout 150 python3 benchmarks/quant_decode_bench.py --shape 8b \
      --quant rtn4 --new 128 --bf16-no-tune --out $OUT/fold$arm > $OUT/fold$arm.log 2>&1
  el "fold $arm rc $?"; grep -A3 "^config" $OUT/fold$arm.log | head -4
done
timeout ${LAB_TIMEOUT:-120} python3 benchmarks/int4_async_lab.py ${LAB_OPTS:-} --shapes gate_up,down,o_proj --ms 1,16 \
    --out $OUT/lab 2>&1 | grep -v -i warn > $OUT/lab.log; el "lab rc $?"; grep -v failed $OUT/lab.log

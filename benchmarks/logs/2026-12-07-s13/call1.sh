#!/usr/bin/env bash
# decode attention over 8-bit caches with each key tile read a tile ahead (LLMC_KV_PREFETCH): GPU golden check,
# then the kernel A/B on one machine (bf16 cache beside it)
OUT=$1; mkdir -p $OUT
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $gpu"
python3 -c "import llmc" 2>/dev/null || pip install -q --no-deps -e . >/dev/null 2>&1
t0=$(date +%s)
LLMC_KV_PREFETCH=1 timeout 150 python3 scripts/gpu_check_attention.py --golden-only > $OUT/golden_pf1.log 2>&1
echo "golden pf1 rc $? at $(( $(date +%s) - t0 )) s: $(grep -c ' ok$' $OUT/golden_pf1.log) ok"; grep -i "FAIL\|error" $OUT/golden_pf1.log | head -8
for args in "bf16 64 0" "fp8 64 0" "fp8 64 1" "int8 64 0" "int8 64 1" "fp8 16 0" "fp8 16 1"; do
  set -- $args
  LLMC_KV_PREFETCH=$3 timeout 100 python3 benchmarks/attention_bench.py --shape 8b --decode-only --kv-dtype $1 --block-size $2 \
    --out $OUT/att_$1_bs$2_pf$3 > $OUT/att_$1_bs$2_pf$3.log 2>&1; echo "$1 bs$2 pf$3 rc $? at $(( $(date +%s) - t0 )) s"
done
for f in $OUT/att_*.log; do echo "--- $f"; sed -n "/# best llmc launch/,/^$/p" $f | head -10; done

#!/usr/bin/env bash
OUT=$1; mkdir -p $OUT
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $gpu"
python3 -c "import llmc" 2>/dev/null || pip install -q --no-deps -e . >/dev/null 2>&1
t0=$(date +%s)
for v in "LLMC_KV_CODE_WORDS=0" "LLMC_KV_FP8_SCORES=1"; do
  env $v timeout 150 python3 scripts/gpu_check_attention.py --golden-only > $OUT/golden_$v.log 2>&1; echo "golden $v rc $? at $(( $(date +%s) - t0 )) s"
  grep -c " ok$" $OUT/golden_$v.log; grep -i "FAIL\|error" $OUT/golden_$v.log | head -8
done
for args in "fp8 64 words LLMC_KV_CODE_WORDS=1" "fp8 64 nowords LLMC_KV_CODE_WORDS=0" "fp8 64 fp8scores LLMC_KV_FP8_SCORES=1" "int8 64 words LLMC_KV_CODE_WORDS=1" "int8 64 nowords LLMC_KV_CODE_WORDS=0" "bf16 64 bf16 X=1"; do
  set -- $args
  env $4 timeout 100 python3 benchmarks/attention_bench.py --shape 8b --decode-only --kv-dtype $1 --block-size $2 --out $OUT/att_$1_$3 > $OUT/att_$1_$3.log 2>&1; echo "$1 $3 rc $? at $(( $(date +%s) - t0 )) s"
done
for f in $OUT/att_*.log; do echo "--- $f"; sed -n "/# best llmc launch/,/^$/p" $f | head -10; done

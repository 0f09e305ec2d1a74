#!/usr/bin/env bash
OUT=$1; mkdir -p $OUT
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $gpu"
python3 -c "import llmc" 2>/dev/null || pip install -q --no-deps -e . >/dev/null 2>&1
t0=$(date +%s)
for args in "fp8 64" "int8 64" "bf16 16" "bf16 64"; do
  set -- $args
  timeout 110 python3 benchmarks/attention_bench.py --shape 8b --decode-only --kv-dtype $1 --block-size $2 --partitions 512,1024 --out $OUT/att_$1_$2 > $OUT/att_$1_$2.log 2>&1; echo "$1 $2 rc $? at $(( $(date +%s) - t0 )) s"
done
for f in $OUT/att_*.log; do echo "--- $f"; sed -n "/# best llmc launch/,/^$/p" $f | head -10; sed -n "/# decode: the best launch at each/,/^$/p" $f | head -12; done

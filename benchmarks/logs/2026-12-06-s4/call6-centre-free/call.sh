#!/usr/bin/env bash
OUT=$1; mkdir -p $OUT
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $gpu"
python3 -c "import llmc" 2>/dev/null || pip install -q --no-deps -e . >/dev/null 2>&1
t0=$(date +%s)
for kv in bf16 fp8 int8; do
  timeout 100 python3 benchmarks/attention_bench.py --shape 8b --decode-only --kv-dtype $kv --out $OUT/att_$kv > $OUT/att_$kv.log 2>&1; echo "$kv rc $?"
done
for kv in fp8 int8; do
  timeout 100 python3 benchmarks/centre_free_decode.py --shape 8b --decode-only --kv-dtype $kv --out $OUT/free_$kv > $OUT/free_$kv.log 2>&1; echo "free $kv rc $?"
done
echo "== all done at $(( $(date +%s) - t0 )) s"
for f in $OUT/att_*.log $OUT/free_*.log; do echo "--- $f"; sed -n "/# best llmc launch/,/^$/p" $f | head -10; done

#!/usr/bin/env bash
OUT=$1; mkdir -p $OUT
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $gpu"
python3 -c "import llmc" 2>/dev/null || pip install -q --no-deps -e . >/dev/null 2>&1
t0=$(date +%s)
timeout 150 python3 scripts/gpu_check_attention.py --golden-only > $OUT/golden.log 2>&1; echo "golden rc $?"; tail -4 $OUT/golden.log
echo "== golden done at $(( $(date +%s) - t0 )) s"
for kv in fp8 int8; do for tall in 1 0; do
  LLMC_KV_KEYS_TALL=$tall timeout 100 python3 benchmarks/attention_bench.py --shape 8b --decode-only --kv-dtype $kv --out $OUT/att_${kv}_tall$tall > $OUT/att_${kv}_tall$tall.log 2>&1; echo "$kv tall=$tall rc $?"
  echo "== at $(( $(date +%s) - t0 )) s"
done; done
timeout 100 python3 benchmarks/attention_bench.py --shape 8b --decode-only --kv-dtype bf16 --out $OUT/att_bf16 > $OUT/att_bf16.log 2>&1; echo "bf16 rc $?"
echo "== all done at $(( $(date +%s) - t0 )) s"
for f in $OUT/att_*.log; do echo "--- $f"; sed -n "/# best llmc launch/,/^$/p" $f | head -12; done

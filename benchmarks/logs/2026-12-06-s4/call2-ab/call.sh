#!/usr/bin/env bash
OUT=$1; mkdir -p $OUT
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $gpu"
python3 -c "import llmc" 2>/dev/null || pip install -q --no-deps -e . >/dev/null 2>&1
t0=$(date +%s)
(cd .ab_old && timeout 250 python3 benchmarks/quant_decode_bench.py --shape 8b --quant rtn4,rtn4-small --new 128 --out $OUT/old > $OUT/old.log 2>&1; echo "old rc $?")
echo "== old done at $(( $(date +%s) - t0 )) s"
timeout $(( 570 - ($(date +%s) - t0) )) python3 benchmarks/quant_decode_bench.py --shape 8b --quant rtn4,rtn4-small --new 128 --out $OUT/new > $OUT/new.log 2>&1; echo "new rc $?"
echo "== new done at $(( $(date +%s) - t0 )) s"
echo "--- old (5263161)"; grep -A4 "^# 8b" $OUT/old.log
echo "--- new (7fcef83, SwiGLU epilogue)"; grep -A4 "^# 8b" $OUT/new.log

#!/usr/bin/env bash
OUT=$1; mkdir -p $OUT
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $gpu"
python3 -c "import llmc" 2>/dev/null || pip install -q --no-deps -e . >/dev/null 2>&1
t0=$(date +%s)
# (the lab before its two last modes)
timeout 420 python3 benchmarks/fp8_decode_lab.py --out $OUT > $OUT/lab.log 2>&1; echo "lab rc $?"
echo "== lab done at $(( $(date +%s) - t0 )) s"
grep -v '^{' $OUT/lab.log | tail -16

#!/usr/bin/env bash
OUT=$1; mkdir -p $OUT
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $gpu"
python3 -c "import llmc" 2>/dev/null || pip install -q --no-deps -e . >/dev/null 2>&1
t0=$(date +%s)
timeout 420 python3 benchmarks/fp8_decode_lab.py --cases 128x1024,64x4096,16x1024 --configs 64x4x2,64x4x3,128x4x2,128x8x2 \
  --modes bf16,fp16dots,fp16dots-rows,fp8k,fp8k2,fp8kvt,fp8kvt2,fp8kvt2-rows,i8kvt2,i8kvt2-rows --out $OUT/lab > $OUT/lab.log 2>&1; echo "lab rc $? at $(( $(date +%s) - t0 )) s"
grep -v '^{' $OUT/lab.log | tail -40

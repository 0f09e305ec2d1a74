#!/usr/bin/env bash
OUT=$1; mkdir -p $OUT
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $gpu"
python3 -c "import llmc" 2>/dev/null || pip install -q --no-deps -e . >/dev/null 2>&1
t0=$(date +%s)
timeout 300 python3 benchmarks/fp8_decode_lab.py --block-size 64 --cases 128x1024,64x4096,16x1024 --configs 32x4x2,64x4x2,64x4x3,64x8x2,128x4x2 \
  --modes bf16,fp16dots,fp16dots-rows,fp8k2,fp8kvt2,fp8kvt2-rows,i8kvt2,i8kvt2-rows --out $OUT/lab64 > $OUT/lab64.log 2>&1; echo "lab64 rc $? at $(( $(date +%s) - t0 )) s"
timeout 200 python3 benchmarks/fp8_decode_lab.py --block-size 16 --cases 128x1024,64x4096 --configs 64x4x2,128x4x2 \
  --modes bf16,fp16dots-rows,fp8k2 --out $OUT/lab16 > $OUT/lab16.log 2>&1; echo "lab16 rc $? at $(( $(date +%s) - t0 )) s"
grep -v '^{' $OUT/lab64.log | tail -30; grep -v '^{' $OUT/lab16.log | tail -8

#!/usr/bin/env bash
OUT=$1; mkdir -p $OUT
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $gpu"
python3 -c "import llmc" 2>/dev/null || pip install -q --no-deps -e . >/dev/null 2>&1
t0=$(date +%s)
rm -rf /tmp/tmp*
LLMC_DECODE_PARTITION=${PART:-512} timeout 560 python3 benchmarks/quant_decode_bench.py --shape 8b --quant "${QUANT:-fp8+kvfp8,w8a8+kvint8}" \
    --no-decode --mixed 128 --bf16-no-tune --longest-first --block-size ${BS:-64} --out $OUT > $OUT/quant_mixed.log 2>&1
echo "rc $? at $(( $(date +%s) - t0 )) s"
grep '^{' $OUT/quant_mixed.log | cut -c1-200
tail -6 $OUT/quant_mixed.log

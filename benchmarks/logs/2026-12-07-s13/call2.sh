#!/usr/bin/env bash
# the 8B mixed workload on the bars' GPU: FP8, int8 W8A8 and int4 g128 (bf16 caches), bf16 cuBLAS in the same run,
# 128 requests at once, longest output first
OUT=$1; mkdir -p $OUT
python3 -c "import llmc" 2>/dev/null || pip install -q --no-deps -e . >/dev/null 2>&1
git log --oneline -1 > $OUT/commit.txt
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/gpu.txt; cat $OUT/gpu.txt
t0=$(date +%s)
rm -rf /tmp/tmp*
timeout 575 python3 benchmarks/quant_decode_bench.py --shape 8b --quant "${QUANT:-fp8,w8a8,rtn4}" \
    --no-decode --mixed 128 --bf16-no-tune --longest-first --out $OUT > $OUT/quant_mixed.log 2>&1
echo "rc $? at $(( $(date +%s) - t0 )) s"
cat $OUT/quant_decode_bench.partial.jsonl 2>/dev/null | cut -c1-300
tail -6 $OUT/quant_mixed.log

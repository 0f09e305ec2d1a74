#!/usr/bin/env bash
OUT=$1; mkdir -p $OUT
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $gpu"
python3 -c "import llmc" 2>/dev/null || pip install -q --no-deps -e . >/dev/null 2>&1
git log --oneline -1 > $OUT/commit.txt; git diff --stat >> $OUT/commit.txt
t0=$(date +%s)
rm -rf /tmp/tmp*
timeout 570 python3 benchmarks/quant_decode_bench.py --shape 8b --quant "${QUANT:-rtn4-small}" --new 128 \
    --mixed 128 --longest-first --profile-decode --out $OUT > $OUT/quant.log 2>&1
echo "rc $? at $(( $(date +%s) - t0 )) s"
for f in $OUT/profile-*.txt; do head -16 $f | cut -c1-140; done
grep '^{' $OUT/quant.log | cut -c1-400
tail -12 $OUT/quant.log

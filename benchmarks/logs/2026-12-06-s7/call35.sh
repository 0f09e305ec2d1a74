#!/usr/bin/env bash
OUT=$1; mkdir -p $OUT
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $gpu"
python3 -c "import llmc" 2>/dev/null || pip install -q --no-deps -e . >/dev/null 2>&1
git log --oneline -1 > $OUT/commit.txt; git status --short >> $OUT/commit.txt
t0=$(date +%s)
timeout 150 python3 benchmarks/dequant_slices.py --out $OUT > $OUT/dequant_slices.log 2>&1
echo "slices rc $? at $(( $(date +%s) - t0 )) s"
TRITON_INTERPRET=0 timeout 120 python3 -m pytest -q -p no:cacheprovider tests/codegen/test_qmatmul.py -k "slices or library or dequantize" > $OUT/tests.log 2>&1
echo "tests rc $? at $(( $(date +%s) - t0 )) s"; tail -3 $OUT/tests.log
rm -rf /tmp/tmp*
timeout 330 python3 benchmarks/quant_decode_bench.py --shape 8b --quant rtn4-small --new 128 \
    --mixed 128 --longest-first --out $OUT > $OUT/quant.log 2>&1
echo "quant rc $? at $(( $(date +%s) - t0 )) s"
grep -o '"qlinear[^"]*N[0-9]*K[0-9]*"\|"1024+": {"config": {[^}]*}\|"512+": {"config": {[^}]*}\|"128+": {"config": {[^}]*}' $OUT/rtn4-small_tuning.json | paste - - - - | cut -c1-300
tail -8 $OUT/quant.log
grep -v '^{' $OUT/dequant_slices.log | tail -14 | cut -c1-330
grep -o '"graph[0-9]*_\(same\|error\)": [^,}]*' $OUT/dequant_slices.log | sort | uniq -c

#!/usr/bin/env bash
# qlinear tiles through TMA descriptors: the compiled tests; the 8B mixed workload (128 at once, longest first),
# FP8 tuned without TMA twins, then with them (LLMC_QLINEAR_TMA=1), a fresh tuning cache each and bf16 (cuBLAS)
# in each run; then, with the time left, the fp8 sweep at 128 rows (tuner's list, its TMA twins, deeper TMA)
python3 -c "import llmc" 2>/dev/null || pip install -q --no-deps -e . >/dev/null 2>&1
git log --oneline -1 > $OUT/commit.txt
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/gpu.txt
t0=$(date +%s)
TRITON_INTERPRET=0 timeout 60 python3 -m pytest -q -x -p no:cacheprovider tests/codegen/test_qmatmul.py \
    -k "test_tma or tall_split" > $OUT/pytest.log 2>&1
echo "pytest rc $? at $(( $(date +%s) - t0 )) s: $(tail -1 $OUT/pytest.log)"
mixed() {  # name, TMA, quant, seconds
    rm -rf /tmp/tmp*; export LLMC_CACHE_DIR=/tmp/llmc_cache_$1
    LLMC_QLINEAR_TMA=$2 timeout $4 python3 benchmarks/quant_decode_bench.py --shape 8b --quant $3 --no-decode --mixed 128 \
        --bf16-no-tune --longest-first --out $OUT/$1 > $OUT/$1.log 2>&1
    echo "$1 rc $? at $(( $(date +%s) - t0 )) s"; tail -4 $OUT/$1.log
}
mixed notma 0 fp8 175
mixed tma 1 fp8 $(( 380 - ($(date +%s) - t0) ))
left=$(( 425 - ($(date +%s) - t0) ))
if [ $left -gt 40 ]; then
    unset LLMC_CACHE_DIR
    timeout $left python3 benchmarks/w8_sweep.py --out $OUT/fp8 --kind fp8 --ms 128 --tma --no-grid \
        --shapes down,o_proj,qkv,gate_up > $OUT/sweep_fp8.log 2>&1
    echo "fp8 sweep rc $? at $(( $(date +%s) - t0 )) s"
    grep -v "quantize" $OUT/sweep_fp8.log | grep "M=" | cut -c1-150
fi
tar czf /tmp/r.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/r.tgz $OUT/

#!/usr/bin/env bash
# the step floor, then the relaxed-reset patch: its compiled split-K tests, then the 8B decode tree / patched
# (tree again if time is left), one machine
python3 -c "import llmc" 2>/dev/null || pip install -q --no-deps -e . >/dev/null 2>&1
git log --oneline -1 > $OUT/commit.txt
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/gpu.txt
t0=$(date +%s)
timeout 150 python3 benchmarks/step_floor.py --out $OUT/floor > $OUT/floor.log 2>&1; echo "floor rc $? at $(( $(date +%s) - t0 )) s"
P=benchmarks/logs/2026-12-06-s9/pending-relaxed-reset/relaxed-reset.patch
decode() {
    rm -rf /tmp/tmp*
    timeout 150 python3 benchmarks/quant_decode_bench.py --shape 8b --quant rtn4-small --new 128 --bf16-no-tune \
        --out $OUT/$1 > $OUT/$1.log 2>&1
    echo "$1 rc $? at $(( $(date +%s) - t0 )) s"; tail -3 $OUT/$1.log
}
git apply $P || exit 1
TRITON_INTERPRET=0 timeout 80 python3 -m pytest -q -x -p no:cacheprovider tests/codegen/test_qmatmul.py \
    tests/codegen/test_attention_kernels.py tests/codegen/test_norm_elementwise_matmul.py \
    -k "split_k_and_swapped or releases_its_counters or alone_equals or split_k_sums" > $OUT/pytest.log 2>&1
echo "pytest rc $? at $(( $(date +%s) - t0 )) s: $(tail -1 $OUT/pytest.log)"
git apply -R $P
decode tree1
git apply $P || exit 1
decode relaxed
git apply -R $P
if [ $(( $(date +%s) - t0 )) -lt 420 ]; then decode tree2; fi
tail -32 $OUT/floor.log
tar czf /tmp/r.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/r.tgz $OUT/

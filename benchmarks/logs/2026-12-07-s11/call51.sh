#!/usr/bin/env bash
# qlinear tiles through TMA descriptors: the compiled TMA tests, then the fp8 sweep at 128 rows (the mixed
# workload's decode batch): the tuner's list, its TMA twins and deeper TMA pipelines, _scaled_mm, bf16 cuBLAS
python3 -c "import llmc" 2>/dev/null || pip install -q --no-deps -e . >/dev/null 2>&1
git log --oneline -1 > $OUT/commit.txt
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/gpu.txt
t0=$(date +%s)
TRITON_INTERPRET=0 timeout 40 python3 -m pytest -q -x -p no:cacheprovider tests/codegen/test_qmatmul.py \
    -k "test_tma" > $OUT/pytest.log 2>&1
echo "pytest rc $? at $(( $(date +%s) - t0 )) s: $(tail -1 $OUT/pytest.log)"
timeout $(( 165 - ($(date +%s) - t0) )) python3 benchmarks/w8_sweep.py --out $OUT/fp8 --kind fp8 --ms 128 --tma \
    --no-grid --shapes down,o_proj,gate_up,qkv > $OUT/sweep_fp8.log 2>&1
echo "fp8 sweep rc $? at $(( $(date +%s) - t0 )) s"
grep "M=" $OUT/sweep_fp8.log | grep -v quantize | cut -c1-160
tar czf /tmp/r.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/r.tgz $OUT/

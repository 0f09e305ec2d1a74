#!/usr/bin/env bash
# FP8 with its MMA's sums promoted every 128 of K and the TMA twins offered: the 8B mixed workload (128 at once,
# longest first, bf16 cuBLAS in the same run); then the fp8 sweep at 128 rows, promoted every 32 and every 128,
# pointer configs and their TMA twins, with each config's error against the fp32 reference
python3 -c "import llmc" 2>/dev/null || pip install -q --no-deps -e . >/dev/null 2>&1
git log --oneline -1 > $OUT/commit.txt
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/gpu.txt
t0=$(date +%s)
rm -rf /tmp/tmp*; export LLMC_CACHE_DIR=/tmp/llmc_cache_p128
LLMC_FP8_PROMOTE=128 LLMC_QLINEAR_TMA=1 timeout 230 python3 benchmarks/quant_decode_bench.py --shape 8b --quant fp8 \
    --no-decode --mixed 128 --bf16-no-tune --longest-first --out $OUT/p128tma > $OUT/p128tma.log 2>&1
echo "mixed p128tma rc $? at $(( $(date +%s) - t0 )) s"; tail -4 $OUT/p128tma.log
unset LLMC_CACHE_DIR
timeout $(( 280 - ($(date +%s) - t0) )) python3 benchmarks/w8_sweep.py --out $OUT/fp8 --kind fp8 --ms 128 --tma \
    --no-grid --no-deep --promote 32,128 --shapes down,o_proj,qkv,gate_up > $OUT/sweep_fp8.log 2>&1
echo "fp8 sweep rc $? at $(( $(date +%s) - t0 )) s"
grep "M=" $OUT/sweep_fp8.log | grep -v "quantize\|failed" | cut -c1-150
echo "failed: $(grep -c failed $OUT/sweep_fp8.log)"
tar czf /tmp/r.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/r.tgz $OUT/

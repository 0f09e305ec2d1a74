#!/usr/bin/env bash
# One call on whichever GPU comes:
# 1. benchmarks/gluon_int4_lab.py: the int4 g128 GEMV whose codes load straight into the MMA's register layout
#    (Gluon), its bits against torch and its time at 1 and 16 rows on the 8B linears; then llmc's qlinear on the
#    same shapes and rows (qlinear_probe.py, default configs) beside it;
# 2. benchmarks/step_floor.py: the step's floors, its chains also as one persistent kernel each;
# 3. benchmarks/persistent_linears.py: the 32 layers' int4 linears at batch 1 as one persistent kernel against
#    one launch a linear, on one GEMV body.
# Usage, from the repository root on the GPU: bash benchmarks/logs/2026-12-07-s17/call1.sh OUT (under 8 minutes)
OUT=$1; mkdir -p $OUT
python3 -c "import llmc" 2>/dev/null || pip install -q --no-deps -e . >/dev/null 2>&1
n=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$n" | tee $OUT/gpu.txt
timeout 150 python3 benchmarks/gluon_int4_lab.py --out $OUT/gluon > $OUT/gluon.log 2>&1
echo "gluon lab rc $?"
timeout 120 python3 benchmarks/qlinear_probe.py --shapes gate_up,down,qkv,o_proj --ms 1,16 --formats int4-g128 \
    --variants default,split2 --out $OUT/probe > $OUT/probe.log 2>&1
echo "probe rc $?"
timeout 100 python3 benchmarks/step_floor.py --out $OUT/floor > $OUT/floor.log 2>&1
echo "step_floor rc $?"
timeout 120 python3 benchmarks/persistent_linears.py --out $OUT/pl --block-n 32,64 --block-w 32,64 \
    --launch 4x3,8x3 > $OUT/pl.log 2>&1
echo "persistent_linears rc $?"
grep -v "^{" $OUT/gluon.log | grep -v -i "warn" | tail -12
grep -v -i warn $OUT/probe.log | tail -12
python3 benchmarks/gluon_int4_lab.py --compare $OUT/gluon/gluon_int4_lab.json $OUT/probe/qlinear_probe.json \
    2>&1 | tee $OUT/compare.md
grep -A12 "step chains" $OUT/floor.log; grep -A60 "one persistent kernel" $OUT/floor.log | grep -v atomic | head -40
grep "against torch\|^best" $OUT/pl.log | head -10

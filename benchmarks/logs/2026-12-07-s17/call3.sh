#!/usr/bin/env bash
# The shortest call: the Gluon int4 lab, then llmc's qlinear on the same shapes and rows (qlinear_probe.py).
# Usage, from the repository root on the GPU: bash benchmarks/logs/2026-12-07-s17/call3.sh OUT (about 3 minutes)
OUT=$1; mkdir -p $OUT
python3 -c "import llmc" 2>/dev/null || pip install -q --no-deps -e . >/dev/null 2>&1
n=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$n" | tee $OUT/gpu.txt
timeout 100 python3 benchmarks/gluon_int4_lab.py --variants sub,xall,xraw,xall-det --out $OUT/gluon > $OUT/gluon.log 2>&1
echo "gluon lab rc $?"
grep -v "^{" $OUT/gluon.log | grep -v -i "warn" | tail -40
timeout 100 python3 benchmarks/qlinear_probe.py --shapes gate_up,down,qkv,o_proj --ms 1,16 --formats int4-g128 \
    --variants default,split2 --out $OUT/probe > $OUT/probe.log 2>&1
echo "probe rc $?"
grep -v -i warn $OUT/probe.log | tail -12
python3 benchmarks/gluon_int4_lab.py --compare $OUT/gluon/gluon_int4_lab.json $OUT/probe/qlinear_probe.json \
    2>&1 | tee $OUT/compare.md

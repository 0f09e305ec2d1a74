#!/usr/bin/env bash
# One call on whichever GPU comes:
# 1. benchmarks/step_floor.py (about a minute): the step's floors, its chains also as one persistent kernel each;
# 2. benchmarks/persistent_linears.py (about 3 minutes): the 32 layers' int4 linears at batch 1 as one persistent
#    kernel against one launch a linear, on one GEMV body;
# Usage, from the repository root on the GPU: bash benchmarks/logs/2026-12-07-s17/call1.sh OUT
OUT=$1; mkdir -p $OUT
python3 -c "import llmc" 2>/dev/null || pip install -q --no-deps -e . >/dev/null 2>&1
n=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$n" | tee $OUT/gpu.txt
git log -1 --format=%H > $OUT/commit.txt 2>/dev/null
timeout 150 python3 benchmarks/step_floor.py --out $OUT/floor > $OUT/floor.log 2>&1
echo "step_floor rc $?"
timeout 240 python3 benchmarks/persistent_linears.py --out $OUT/pl > $OUT/pl.log 2>&1
echo "persistent_linears rc $?"
grep -B2 -A60 "^# .*step chains" $OUT/floor.log | grep -v "| [0-9,]* | [0-9.]* | [0-9.]* | \[" | head -70
grep "against torch\|^best\|error" $OUT/pl.log | head -20

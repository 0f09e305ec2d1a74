#!/usr/bin/env bash
# Pending: the qlinear's whole tiles loaded without masks (EVEN_N, and EVEN_K only where K is unpadded; even.patch,
# the same bits, 7-9% fewer int4 and 10-20% fewer 8-bit main-loop instructions on sm_90). Each int4 linear of the
# 8B shape at its bucket's default config on the tree, with the patch, and on the tree again; then (unless E2E=0)
# the 8B int4 decode with the patch and without, each with its own tuning cache seeded by the shipped table.
# Usage, from the repository root of a tree without the patch (e007534 or later):
#   bash benchmarks/logs/2026-12-07-s14/call2.sh OUT
OUT=$1; mkdir -p $OUT; export PYTHONPATH=.
P=benchmarks/logs/2026-12-07-s14/even.patch
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
probe() { timeout 70 python3 benchmarks/qlinear_probe.py --shapes gate_up,down,qkv,o_proj --ms 1,16 --formats int4-g128 \
    --out $OUT/$1 2>&1 | grep -v -i warn > $OUT/$1.log; el "$1 rc $?"; cat $OUT/$1.log; }
tables() {  # the shipped tables under the names the kernel sources here give them (a kernel change renames them)
python3 - <<'PY'
import json, shutil, triton
from pathlib import Path
from llmc.codegen import autotune
for f in sorted(Path("llmc/codegen/tuned").glob("*.json")):
    d = json.loads(f.read_text()); v = triton.__version__; triton.__version__ = d["triton"]
    new = Path(autotune.cache_file(d["device"], d["joint_buckets"])).name; triton.__version__ = v
    if new != f.name:
        shutil.copy(f, f.parent / new)
PY
}
e2e() { [ "${E2E:-1}" = 0 ] && return; LLMC_CACHE_DIR=/tmp/llmc_$1 timeout ${E2E_TIMEOUT:-150} python3 \
    benchmarks/quant_decode_bench.py --shape 8b --quant rtn4 --new 128 --bf16-no-tune --out $OUT/e2e-$1 \
    > $OUT/e2e-$1.log 2>&1; el "e2e $1 rc $?"; grep -A3 "^config" $OUT/e2e-$1.log | head -4; }
probe tree1
git apply $P && tables && probe even && e2e even
git apply -R $P
[ "${TREE2:-1}" = 0 ] || probe tree2
e2e tree

#!/usr/bin/env bash
# The tall form as a default candidate, on whatever GPU comes for `nvidia-h200` (its bars are the H200's): its GPU
# tests (the configs added after calls 1-2 included), then the 8B int4 compile with the shipped table (which holds
# no int4 choice at 128+ tokens) against bf16 (untuned, cuBLAS): decode at batch 128 and the mixed workload.
# MIXED=0 leaves the mixed workload out (decode at batch 128 only).
# Usage, from the repository root on the GPU: bash benchmarks/logs/2026-12-08-s22/call3.sh OUT
OUT=$1; mkdir -p $OUT/c3
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tee $OUT/c3/gpu.txt
TRITON_INTERPRET=0 timeout ${TESTS_T:-100} python3 -m pytest -q -p no:cacheprovider tests/codegen/test_qwgmma.py \
    -k "tall and not fold" > $OUT/c3/tests.log 2>&1
echo "tall tests rc $?"; grep -E "passed|failed" $OUT/c3/tests.log | tail -3
timeout ${BENCH_T:-330} python3 benchmarks/quant_decode_bench.py --shape 8b --quant rtn4 --no-decode --full-batch 128 \
    $([ "${MIXED:-1}" = 1 ] && echo --mixed 128) --bf16-no-tune --longest-first --out $OUT/c3 > $OUT/c3/bench.log 2>&1
echo "bench rc $?"
grep '^{' $OUT/c3/bench.log | python3 -c "
import json, sys
for l in sys.stdin:
    r = json.loads(l)
    print(r.get('config'), {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items() if k.startswith(('mixed', 'compile', 'full'))})"
python3 - $OUT/c3/rtn4_tuning.json <<'PY'
import json, sys, os
if os.path.exists(sys.argv[1]):
    for key, v in json.load(open(sys.argv[1])).get("kernels", {}).items():
        if key.startswith("qlinear[w4a16") and "128+" in v:
            print("  ", key[-12:], v["128+"]["config"], round(v["128+"]["triton_ms"] * 1e3, 1), "us")
PY
tar czf /tmp/call3-out.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/call3-out.tgz "$OUT"/

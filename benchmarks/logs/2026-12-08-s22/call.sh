#!/usr/bin/env bash
# The int4 wgmma kernel's tall form at a full decode batch on an H200, in two calls on one machine:
#   PART=1: the tall form's GPU tests (every tall config against the reference, the new split configs included);
#           each 8B int4 linear at 128 rows over a grid of tall configs (`qlinear_probe.py --variants
#           wgmma-tall-grid,bf16`); then the A/B's arm without the tall form (call1.sh of 2026-12-07-s20,
#           `ARMS=notall`: decode at batch 128 and the mixed workload, bf16 beside it);
#   PART=2: the arm with it (`ARMS=tall`).
# Usage, from the repository root on the GPU: PART=1|2 bash benchmarks/logs/2026-12-08-s22/call.sh OUT
OUT=$1; mkdir -p $OUT
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
BENCH="--full-batch 128 --mixed 128 --bf16-no-tune --longest-first"
if [ "${PART:-1}" = 1 ]; then
  mkdir -p $OUT/p1
  TRITON_INTERPRET=0 timeout 200 python3 -m pytest -q -p no:cacheprovider tests/codegen/test_qwgmma.py -k "tall and not fold" \
      > $OUT/p1/tests.log 2>&1
  echo "tall tests rc $?"; grep -E "passed|failed" $OUT/p1/tests.log | tail -3
  timeout 200 python3 benchmarks/qlinear_probe.py --shapes gate_up,down,qkv,o_proj --ms 128 --formats int4-g128 \
      --variants wgmma-tall-grid,bf16 --out $OUT/p1/grid > $OUT/p1/grid.log 2>&1
  echo "grid rc $?"
  python3 - $OUT/p1/grid/qlinear_probe.json <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))
for shape in ("gate_up", "down", "qkv", "o_proj"):
    rs = sorted((r for r in rows if r["shape"] == shape), key=lambda r: r["us"])
    print(shape, " ".join(f"{r['us']:.1f}" + ("(bf16)" if r["config"] is None else
          f"({r['config']['XN']},{r['config']['WG']},{r['config']['SPLIT_K']}{'f' if r['config'].get('FOLD') else ''})") for r in rs[:6]))
PY
  ARMS=notall TESTS=0 PROBE=0 ARM_T=290 TAR=0 BENCH="$BENCH" bash benchmarks/logs/2026-12-07-s20/call1.sh $OUT/p1
else
  ARMS=tall TESTS=0 PROBE=0 ARM_T=290 TAR=0 BENCH="$BENCH" bash benchmarks/logs/2026-12-07-s20/call1.sh $OUT/p2
fi
tar czf /tmp/call-out.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/call-out.tgz "$OUT"/

#!/usr/bin/env bash
# The int4 wgmma GEMV (llmc/codegen/qwgmma.py) on a Hopper GPU: its tests compiled on the hardware, then the 8B
# int4 g128 decode at batch 1 and 16, with the kernel offered to the tuner (arm `wgmma`) and without (`triton`:
# LLMC_QWGMMA=0), and with its configs not yet timed offered too (`trial`: LLMC_QWGMMA_TRY=1), each arm with a
# tuning cache of its own so that each times its own candidates; bf16 beside each; each arm's chosen decode
# attention launch and wgmma choices printed after it. ARMS: the arms in order; ARM_T: each arm's limit (s);
# NBI=1: the int4 compiles with --no-batch-invariant (the first measurement, on 1-16 rows only: llmc's default
# is batch-invariant).
# Usage, from the repository root on the GPU: bash benchmarks/logs/2026-12-07-s18/call2.sh OUT
OUT=$1; mkdir -p $OUT
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tee $OUT/gpu.txt
git log -1 --format=%H > $OUT/commit.txt 2>/dev/null
TRITON_INTERPRET=0 timeout 150 python3 -m pytest -q -p no:cacheprovider tests/codegen/test_qwgmma.py > $OUT/tests.log 2>&1
echo "tests rc $?"; grep -E "passed|failed|Error" $OUT/tests.log | tail -5
for arm in ${ARMS:-wgmma triton}; do
  d=$OUT/$arm; mkdir -p $d
  sw=1; [ "$arm" = triton ] && sw=0
  xa=0; [ "$arm" = trial ] && xa=1
  LLMC_QWGMMA=$sw LLMC_QWGMMA_TRY=$xa LLMC_CACHE_DIR=/tmp/llmc-cache-$arm timeout ${ARM_T:-240} python3 benchmarks/quant_decode_bench.py \
      --shape 8b --quant rtn4 ${NBI:+--no-batch-invariant} --new 128 --out $d > $d/bench.log 2>&1
  echo "$arm rc $?"
  rm -rf /tmp/llmc-cache-$arm
  grep '^{' $d/bench.log | python3 -c "
import json, sys
for l in sys.stdin:
    r = json.loads(l)
    print(r.get('config'), {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items() if k.startswith(('b1_', 'b16_'))})"
  python3 - "$d" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/*_tuning.json")):  # each compile's decode attention launch
    for key, v in json.load(open(f)).get("kernels", {}).items():
        if key.startswith("paged_attention_decode"):
            print("  ", f.split("/")[-1], key[:30], {b: r.get("config") for b, r in v.items()})
for f in glob.glob(sys.argv[1] + "/rtn4_tuning.json"):
    k = json.load(open(f)).get("kernels", {})
    for key, v in k.items():
        if key.startswith("qlinear[w4a16"):
            cfgs = {b: rec.get("config", {}) for b, rec in v.items() if isinstance(rec, dict)}
            print("  ", key[-24:], "wgmma chosen at", [f"{b} (WG {c['WG']}{', x ahead' if c.get('XASYNC') else ''})"
                                                       for b, c in cfgs.items() if c.get("WGMMA")] or "none")
PY
done

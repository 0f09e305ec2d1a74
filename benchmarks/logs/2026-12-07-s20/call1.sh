#!/usr/bin/env bash
# The int4 wgmma kernel's tall form (one MMA of 64 or 128 of x's rows a group; llmc/codegen/qwgmma.py) on an sm_90
# GPU: its tests compiled on the hardware; then, if they pass, the 8B mixed workload (`quant_decode_bench.py --quant
# rtn4 --no-decode --mixed 128 --bf16-no-tune --longest-first`, bf16 beside each) in the arms of ARMS (default
# "tall notall": the tall form offered to the tuner, LLMC_QWGMMA_TALL=1, and not, =0), each with a tuning cache
# of its own, each arm's int4 choices at 128+ / 512+ / 1024+ tokens printed after it (the folded configs offered
# only where their GPU tests pass: LLMC_QWGMMA_FOLD=0 otherwise); then (PROBE=1) each 8B int4
# linear at 128 and 512 rows: every generated config, the tall configs, the dequantized library GEMM and bf16 cuBLAS.
# BENCH replaces the benchmark's workload options (e.g. "--full-batch 128 --mixed 128 --bf16-no-tune --longest-first").
# Its files come back as OUT/call1-out.tgz.
# Usage, from the repository root on the GPU: bash benchmarks/logs/2026-12-07-s20/call1.sh OUT
OUT=$1; mkdir -p $OUT
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tee $OUT/gpu.txt
git log -1 --format=%H > $OUT/commit.txt 2>/dev/null
if [ "${TESTS:-1}" = 1 ]; then
  TRITON_INTERPRET=0 timeout ${TESTS_T:-200} python3 -m pytest -q -p no:cacheprovider tests/codegen/test_qwgmma.py \
      -k "not fold" > $OUT/tests.log 2>&1
  rc=$?; echo "tests rc $rc"; grep -E "passed|failed|Error" $OUT/tests.log | tail -8
  [ $rc = 0 ] || ARMS=""
  # the tall form's folded configs: timed in the arms only where their sums match the reference here
  TRITON_INTERPRET=0 timeout ${TESTS_T:-200} python3 -m pytest -q -p no:cacheprovider tests/codegen/test_qwgmma.py \
      -k "fold" > $OUT/tests-fold.log 2>&1
  rc=$?; echo "fold tests rc $rc"; grep -E "passed|failed|Error" $OUT/tests-fold.log | tail -8
  [ $rc = 0 ] || export LLMC_QWGMMA_FOLD=0
fi
# Both arms time the int4 linears at 128+ tokens afresh: each arm's tuning cache starts as this GPU's shipped table
# without its int4 records at 128+, 512+ and 1024+ tokens and their token-budget GEMM times, and the shipped table
# is moved aside for the arms (the device's copy of the tree; put back at the end).
mkdir -p /tmp/shipped-aside
for arm in ${ARMS-tall notall}; do
  d=$OUT/$arm; mkdir -p $d
  sw=1; [ "$arm" = notall ] && sw=0
  rm -rf /tmp/llmc-cache-$arm
  LLMC_CACHE_DIR=/tmp/llmc-cache-$arm python3 - <<'PY'
import json, shutil, torch
from llmc.codegen import autotune
path = autotune.cache_file(torch.cuda.get_device_name(0), autotune.JOINT_BUCKETS)
shipped = autotune.SHIPPED_DIR / path.name
kernels = {}
if shipped.exists():
    kernels = json.loads(shipped.read_text())["kernels"]
    kernels = {k: {b: r for b, r in v.items() if not (k.startswith("qlinear[w4a16") and b in ("128+", "512+", "1024+"))}
               for k, v in kernels.items() if not k.startswith("qgemm_ms:w4a16")}
    shutil.move(str(shipped), "/tmp/shipped-aside/" + shipped.name)
path.parent.mkdir(parents=True, exist_ok=True)
path.write_text(json.dumps({"device": torch.cuda.get_device_name(0), "format": 1,
                            "joint_buckets": list(autotune.JOINT_BUCKETS), "kernels": kernels}))
print("seeded", path, len(kernels), "keys")
PY
  LLMC_QWGMMA_TALL=$sw LLMC_CACHE_DIR=/tmp/llmc-cache-$arm timeout ${ARM_T:-230} python3 \
      benchmarks/quant_decode_bench.py --shape 8b --quant rtn4 --no-decode ${BENCH:---mixed 128 --bf16-no-tune --longest-first} \
      --out $d > $d/bench.log 2>&1
  echo "$arm rc $?"
  rm -rf /tmp/llmc-cache-$arm
  grep '^{' $d/bench.log | python3 -c "
import json, sys
for l in sys.stdin:
    r = json.loads(l)
    print(r.get('config'), {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items() if k.startswith(('mixed', 'compile', 'full'))})"
  python3 - "$d" <<'PY'
import glob, json, sys
for f in glob.glob(sys.argv[1] + "/rtn4_tuning.json"):
    for key, v in json.load(open(f)).get("kernels", {}).items():
        if key.startswith("qlinear[w4a16"):
            print("  ", key[-22:], {b: (rec.get("config"), round(rec.get("triton_ms") or 0, 4)) for b, rec in v.items()
                                      if b in ("128+", "512+", "1024+")})
PY
  mv /tmp/shipped-aside/*.json llmc/codegen/tuned/ 2>/dev/null
done
if [ "${PROBE:-1}" = 1 ]; then
  timeout ${PROBE_T:-200} python3 benchmarks/qlinear_probe.py --shapes gate_up,down,qkv,o_proj --ms 128 \
      --formats int4-g128 --variants triton-all,wgmma-tall,bf16 --out $OUT/probe128 > $OUT/probe128.log 2>&1
  echo "probe 128 rc $?"
  timeout ${PROBE_T:-120} python3 benchmarks/qlinear_probe.py --shapes gate_up,down,qkv,o_proj --ms 512 \
      --formats int4-g128 --variants wgmma-tall,dequant,bf16 --out $OUT/probe512 > $OUT/probe512.log 2>&1
  echo "probe 512 rc $?"
  python3 - $OUT <<'PY'
import json, sys, os
for f in ("probe128", "probe512"):
    p = os.path.join(sys.argv[1], f, "qlinear_probe.json")
    if not os.path.exists(p):
        continue
    best = {}
    for r in json.load(open(p)):
        fam = r["variant"].rstrip("0123456789")
        k = (r["shape"], r["m"], fam)
        if k not in best or r["us"] < best[k]["us"]:
            best[k] = r
    for (shape, m, fam), r in sorted(best.items()):
        print(f"{shape:8s} {m:4d} {fam:12s} {r['us']:7.1f} us  err {r['rel_err']:.1e}  {json.dumps(r['config'])}")
PY
fi
# at most 8 files come back from a call: everything in one archive (TAR=0 leaves the files as they are)
if [ "${TAR:-1}" = 1 ]; then
  tar czf /tmp/call1-out.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/call1-out.tgz "$OUT"/
fi

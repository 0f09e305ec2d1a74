#!/usr/bin/env bash
# int4 decode tiles 128 rows wide with 256 columns on 4 warps (18% fewer main-loop instructions a code than the
# 64-wide default, compiled for sm_90: benchmarks/sass_loop.py --configs 16,128,256,2,1,3): each linear alone at
# 1 and 64 rows against the default, then the 8B int4 decode with the tree's candidates and with two such tiles
# added to DECODE_TILES (each arm its own fresh tuning cache; the tuner takes them only where they time faster).
# Usage, from the repository root on the GPU: bash benchmarks/logs/2026-12-07-s16/call2-bn128/call2.sh OUT
# (ARMS="bn128" for one arm, NO_PROBE=1 without the per-linear timings)
OUT=$1; mkdir -p $OUT
python3 -c "import llmc" 2>/dev/null || pip install -q --no-deps -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tee $OUT/gpu.txt
t0=$(date +%s)
[ -n "$NO_PROBE" ] || timeout ${PROBE_TIMEOUT:-110} python3 benchmarks/qlinear_probe.py --shapes gate_up,down,qkv,o_proj --ms 1,64 --formats int4-g128 \
    --variants default,split2,bn128+split2,bn128+split2+st4 --out $OUT/probe > $OUT/probe.log 2>&1
echo "probe rc $? at $(( $(date +%s) - t0 )) s"; grep -v -i warn $OUT/probe.log | head -30
for arm in ${ARMS:-tree bn128}; do
  export LLMC_CACHE_DIR=/tmp/llmc_cache_$arm; rm -rf $LLMC_CACHE_DIR /tmp/tmp*
  if [ $arm = bn128 ]; then
    python3 - <<'PY'
from pathlib import Path
p = Path("llmc/codegen/qmatmul.py"); s = p.read_text()
old = "(64, 256, 2, True, 4, 3), (64, 256, 0.5, True, 4, 3), (128, 256, 1, True, 8, 3))"
assert old in s
p.write_text(s.replace(old, old[:-1] + ", (128, 256, 1, True, 4, 3), (128, 256, 1, True, 4, 4))"))
print("DECODE_TILES + (128, 256, 1, True, 4, 3), (128, 256, 1, True, 4, 4)")
PY
  fi
  timeout ${ARM_TIMEOUT:-180} python3 benchmarks/quant_decode_bench.py --shape 8b --quant rtn4 --new 128 --bf16-no-tune \
      --out $OUT/$arm > $OUT/$arm.log 2>&1
  echo "$arm rc $? at $(( $(date +%s) - t0 )) s"; grep -A5 "^config" $OUT/$arm.log | head -6
done
python3 - "$OUT" <<'PY'
import json, sys
for arm in ("tree", "bn128"):
    try:
        d = json.load(open(f"{sys.argv[1]}/{arm}/rtn4_tuning.json"))
    except OSError:
        continue
    for k, v in d["kernels"].items():
        if k.startswith("qlinear") and "1" in v:
            c = v["1"]["config"]
            print(arm, k.split("]")[1], c["BLOCK_N"], c["BLOCK_K"], c["SPLIT_K"], c["num_warps"], c["num_stages"],
                  f'{v["1"]["triton_ms"] * 1e3:.1f} us summed over 1-64 rows')
PY

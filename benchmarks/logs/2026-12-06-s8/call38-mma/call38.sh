#!/usr/bin/env bash
# MMA v2 (mma.sync: 2 warps, or wgmma disabled) against v3 (wgmma) for the int4 qlinear at 1 and 16 rows;
# then the 8B int4 decode with 2-warp decode tiles among the candidates
OUT=$1; mkdir -p $OUT
here=$(cd "$(dirname "$0")" && pwd)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $gpu"
python3 -c "import llmc" 2>/dev/null || pip install -q --no-deps -e . >/dev/null 2>&1
git log --oneline -1 > $OUT/commit.txt; git status --short >> $OUT/commit.txt
t0=$(date +%s)
DISABLE_MMA_V3=0 timeout 150 python3 benchmarks/qlinear_probe.py --shapes gate_up,down,qkv,o_proj --ms 1,16 \
    --formats int4-g128 --variants default,st4,w2,bn128+w2,bn32+w2,w2+st4 --out $OUT/mma-v3-off-0 > $OUT/probe-v3off0.log 2>&1
echo "probe 0 rc $? at $(( $(date +%s) - t0 )) s"
DISABLE_MMA_V3=1 timeout 80 python3 benchmarks/qlinear_probe.py --shapes gate_up,down,qkv,o_proj --ms 1,16 \
    --formats int4-g128 --variants default,st4,bn128+w8 --out $OUT/mma-v3-off-1 > $OUT/probe-v3off1.log 2>&1
echo "probe 1 rc $? at $(( $(date +%s) - t0 )) s"
python3 - $OUT <<'PY'
import json, sys
rows = {}
for v in (0, 1):
    try:
        for r in json.load(open(f"{sys.argv[1]}/mma-v3-off-{v}/qlinear_probe.json")):
            rows.setdefault((r["shape"], r["m"]), {})[(v, r["variant"])] = r["us"]
    except OSError as e:
        print(e)
cols = sorted({k for d in rows.values() for k in d}, key=lambda k: (k[0], k[1]))
print("us per call; v3off1 = wgmma disabled (mma.sync)")
print(f"{'shape':8s} {'M':>3s} " + " ".join(f"{('v2:' if v else '') + n:>12s}" for v, n in cols))
for (s, m), d in rows.items():
    print(f"{s:8s} {m:3d} " + " ".join(f"{d.get(c, float('nan')):12.1f}" for c in cols))
PY
git apply "$here/w2-candidates.patch" || exit 1
rm -rf /tmp/tmp*
timeout 290 python3 benchmarks/quant_decode_bench.py --shape 8b --quant rtn4-small --new 128 --bf16-no-tune \
    --out $OUT/w2 > $OUT/w2.log 2>&1
echo "w2 e2e rc $? at $(( $(date +%s) - t0 )) s"
git apply -R "$here/w2-candidates.patch"
tail -5 $OUT/w2.log
python3 - $OUT <<'PY'
import json, sys
try:
    t = json.load(open(f"{sys.argv[1]}/w2/rtn4-small_tuning.json"))
except OSError as e:
    sys.exit(print(e))
for k, v in t["kernels"].items():
    if k.startswith("qlinear"):
        print(k[:60], {b: (c["config"].get("BLOCK_N"), c["config"].get("num_warps"), c["config"].get("SPLIT_K")) for b, c in v.items()})
PY

#!/usr/bin/env bash
# int4 decode: the tree, then the tree with the family choice for every joint bucket and two 4-stage decode tiles
OUT=$1; mkdir -p $OUT
here=$(cd "$(dirname "$0")" && pwd)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $gpu"
python3 -c "import llmc" 2>/dev/null || pip install -q --no-deps -e . >/dev/null 2>&1
git log --oneline -1 > $OUT/commit.txt
t0=$(date +%s)
timeout 60 python3 benchmarks/qlinear_probe.py --shapes gate_up,qkv --ms 1,64 --formats int4-g128 \
    --variants default,st4,split2,split2+st4,st5 --out $OUT/probe > $OUT/probe.log 2>&1
echo "probe rc $? at $(( $(date +%s) - t0 )) s"; awk '{print $1, $2, $4, $5}' $OUT/probe.log | column -t
for run in tree family-st4; do
    if [ $run != tree ]; then git apply "$here/$run.patch" || exit 1; fi
    rm -rf /tmp/tmp*
    timeout 250 python3 benchmarks/quant_decode_bench.py --shape 8b --quant rtn4-small --new 128 --bf16-no-tune \
        --out $OUT/$run > $OUT/$run.log 2>&1
    echo "$run rc $? at $(( $(date +%s) - t0 )) s"
    if [ $run != tree ]; then git apply -R "$here/$run.patch"; fi
    tail -5 $OUT/$run.log
done
python3 - $OUT <<'PY'
import json, sys
for run in ("tree", "family-st4"):
    try:
        t = json.load(open(f"{sys.argv[1]}/{run}/rtn4-small_tuning.json"))
    except OSError as e:
        print(e); continue
    for k, v in t["kernels"].items():
        if k.startswith("qlinear"):
            print(run, k[41:], {b: (c["config"].get("BLOCK_N"), c["config"].get("SPLIT_K"), c["config"].get("num_stages"),
                                 "F" if c.get("family_of") else "") for b, c in v.items() if c.get("config")})
PY

#!/usr/bin/env bash
OUT=$1; mkdir -p $OUT
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $gpu"
python3 -c "import llmc" 2>/dev/null || pip install -q --no-deps -e . >/dev/null 2>&1
git log --oneline -1 > $OUT/commit.txt; git status --short >> $OUT/commit.txt; git diff > $OUT/tree.diff
t0=$(date +%s)
rm -rf /tmp/tmp*
timeout 260 python3 benchmarks/quant_decode_bench.py --shape 8b --quant rtn4-small --new 128 --bf16-no-tune --out $OUT > $OUT/quant.log 2>&1
echo "quant rc $? at $(( $(date +%s) - t0 )) s"
tail -7 $OUT/quant.log
python3 - $OUT <<'PY'
import json, sys
for name in ("bf16", "rtn4-small"):
    try:
        t = json.load(open(f"{sys.argv[1]}/{name}_tuning.json"))
    except OSError:
        continue
    for k, v in t["kernels"].items():
        if k.startswith(("qlinear", "matmul")):
            fam = {b: (c["config"], round(c.get("triton_ms") or 0, 4)) for b, c in v.items() if c.get("family_of")}
            if fam:
                print(name, k[:70], fam)
PY

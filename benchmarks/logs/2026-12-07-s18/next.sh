#!/usr/bin/env bash
# The next GPU call for the int4 wgmma GEMV (preferably on an H200, where the int4 decode is furthest from its bytes):
# 1. each 8B int4 linear at 1, 16, 32 and 64 rows: the Triton qlinear's default and doubled K split beside every
#    wgmma config the tuner may time, and each with x copied a group ahead (`qlinear_probe.py --variants
#    default,split2,wgmma,wgmma-trial`; the latter offered to the tuner only with LLMC_QWGMMA_TRY=1): where the wgmma kernel loses at
#    32-64 rows, which keeps the default (batch-invariant) tuning off it, and whether the copies ahead mend that;
# 2. call2.sh: the 8B int4 decode at batch 1 / 16, default compile, with the kernel offered and without (NBI=1:
#    with --no-batch-invariant instead).
# Usage, from the repository root: bash benchmarks/logs/2026-12-07-s18/next.sh OUT (about 7 minutes)
OUT=$1; mkdir -p $OUT
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
timeout 150 python3 benchmarks/qlinear_probe.py --shapes gate_up,down,qkv,o_proj --ms 1,16,32,64 --formats int4-g128 \
    --variants default,split2,wgmma,wgmma-trial --out $OUT/probe > $OUT/probe.log 2>&1
echo "probe rc $?"
python3 - $OUT/probe/qlinear_probe.json <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))
print("| linear | rows | Triton best us | wgmma best us (config) | Triton / wgmma |")  # wgmma: either kind
print("|---|---|---|---|---|")
for shape in ("qkv", "o_proj", "gate_up", "down"):
    for m in (1, 16, 32, 64):
        t = [r for r in rows if r["shape"] == shape and r["m"] == m and not r["variant"].startswith("wgmma")]
        w = [r for r in rows if r["shape"] == shape and r["m"] == m and r["variant"].startswith("wgmma")]
        if t and w:
            bt, bw = min(t, key=lambda r: r["us"]), min(w, key=lambda r: r["us"])
            c = bw["config"]
            print(f"| {shape} | {m} | {bt['us']:.1f} | {bw['us']:.1f} (WG {c['WG']}, split {c['SPLIT_K']}, ahead "
                  f"{c['AHEAD']}, x ahead {c.get('XASYNC', False)}; err {bw['rel_err']:.0e}) | "
                  f"{bt['us'] / bw['us']:.2f}x |")
PY
bash benchmarks/logs/2026-12-07-s18/call2.sh $OUT/decode

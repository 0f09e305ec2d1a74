#!/usr/bin/env bash
# The GPU work owed after calls 1-3, on an H200 (the bars' GPU), in three calls on one machine:
#   PART=pipe: the pipelined tall configs (`LLMC_QWGMMA_PIPE`): their GPU tests (against the reference, and bit for
#              bit against the same configs folded), then each 8B int4 linear at 128 rows over the tall grid,
#              pipelined and not (`qlinear_probe.py --variants wgmma-tall-grid,wgmma-tall-pipe,bf16`);
#   PART=int4: call3.sh: the tall form's GPU tests (the configs added after calls 1-2 included), then the 8B int4
#              compile with the shipped H200 table (no int4 choice at 128+ tokens, so the tall form is timed
#              there) against bf16: decode at batch 128 and the mixed workload;
#   PART=8bit: the mixed workload's FP8 and int8 W8A8 bars with this tree's kernels and tables (as RESULTS
#              "2026-12-07 (later)" measured them).
# Usage, from the repository root on the GPU: PART=pipe|int4|8bit bash benchmarks/logs/2026-12-08-s22/next.sh OUT
OUT=$1; mkdir -p $OUT
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
case ${PART:-int4} in
  pipe)
    nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tee $OUT/gpu.txt
    TRITON_INTERPRET=0 timeout 150 python3 -m pytest -q -p no:cacheprovider tests/codegen/test_qwgmma.py \
        -k "pipelined or tall_form_matches" > $OUT/tests.log 2>&1
    echo "tests rc $?"; grep -E "passed|failed" $OUT/tests.log | tail -3
    timeout 300 python3 benchmarks/qlinear_probe.py --shapes gate_up,down,qkv,o_proj --ms 128 --formats int4-g128 \
        --variants wgmma-tall-grid,wgmma-tall-pipe,bf16 --out $OUT/probe > $OUT/probe.log 2>&1
    echo "probe rc $?"
    python3 - $OUT/probe/qlinear_probe.json <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))
for shape in ("gate_up", "down", "qkv", "o_proj"):
    for fam in ("wgmma-tall-grid", "wgmma-tall-pipe", "bf16"):
        rs = sorted((r for r in rows if r["shape"] == shape and r["variant"].rstrip("0123456789") == fam),
                    key=lambda r: r["us"])
        if rs:
            print(f"{shape:8s} {fam:16s} {rs[0]['us']:7.1f} us  err {rs[0]['rel_err']:.1e}  {json.dumps(rs[0]['config'])}")
PY
    ;;
  int4) bash benchmarks/logs/2026-12-08-s22/call3.sh $OUT ;;
  8bit)
    nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tee $OUT/gpu.txt
    timeout ${MIXED_T:-560} python3 benchmarks/quant_decode_bench.py --shape 8b --quant fp8,w8a8 --no-decode \
        --mixed 128 --bf16-no-tune --longest-first --out $OUT/mixed > $OUT/mixed.log 2>&1
    echo "mixed rc $?"; tail -8 $OUT/mixed.log ;;
esac

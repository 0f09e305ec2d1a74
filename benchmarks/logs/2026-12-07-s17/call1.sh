#!/usr/bin/env bash
# One call on whichever GPU comes, its parts in turn (PARTS, default "lab probe floor pl"):
# - lab: benchmarks/gluon_int4_lab.py, the int4 g128 GEMV whose codes load straight into the MMA's register layout
#   (Gluon), its bits against torch and its time at 1 and 16 rows on the 8B linears (LAB_VARIANTS: the lab's
#   --variants, its default if unset);
# - probe: llmc's qlinear on the same shapes and rows (qlinear_probe.py, default config and K split doubled), then
#   the lab against it, a linear and a layer (gluon_int4_lab.py --compare);
# - floor: benchmarks/step_floor.py, the step's floors, its chains also as one persistent kernel each;
# - pl: benchmarks/persistent_linears.py, the 32 layers' int4 linears at batch 1 as one persistent kernel against
#   one launch a linear, on one GEMV body.
# LAB_T and PROBE_T: the lab's and the probe's time limits in seconds (150, 120).
# Usage, from the repository root on the GPU: bash benchmarks/logs/2026-12-07-s17/call1.sh OUT (under 8 minutes;
# call2.sh and call3.sh run fewer parts)
OUT=$1; mkdir -p $OUT
PARTS=${PARTS:-lab probe floor pl}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # llmc from this tree (scripts under benchmarks/ import it)
n=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$n" | tee $OUT/gpu.txt
for part in $PARTS; do
  case $part in
    lab)
      timeout ${LAB_T:-150} python3 benchmarks/gluon_int4_lab.py ${LAB_VARIANTS:+--variants $LAB_VARIANTS} \
          --out $OUT/gluon > $OUT/gluon.log 2>&1
      echo "gluon lab rc $?"
      grep -v "^{" $OUT/gluon.log | grep -v -i "warn" | tail -40 ;;
    probe)
      timeout ${PROBE_T:-120} python3 benchmarks/qlinear_probe.py --shapes gate_up,down,qkv,o_proj --ms 1,16 \
          --formats int4-g128 --variants default,split2 --out $OUT/probe > $OUT/probe.log 2>&1
      echo "probe rc $?"
      grep -v -i warn $OUT/probe.log | tail -12
      python3 benchmarks/gluon_int4_lab.py --compare $OUT/gluon/gluon_int4_lab.json $OUT/probe/qlinear_probe.json \
          2>&1 | tee $OUT/compare.md ;;
    floor)
      timeout 100 python3 benchmarks/step_floor.py --out $OUT/floor > $OUT/floor.log 2>&1
      echo "step_floor rc $?"
      grep -A12 "step chains" $OUT/floor.log; grep -A60 "one persistent kernel" $OUT/floor.log | grep -v atomic | head -40 ;;
    pl)
      timeout 120 python3 benchmarks/persistent_linears.py --out $OUT/pl --block-n 32,64 --block-w 32,64 \
          --launch 4x3,8x3 > $OUT/pl.log 2>&1
      echo "persistent_linears rc $?"
      grep "against torch\|^best" $OUT/pl.log | head -10 ;;
  esac
done

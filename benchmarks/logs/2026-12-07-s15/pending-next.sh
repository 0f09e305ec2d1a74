#!/usr/bin/env bash
# The pending GPU measurements of 2026-12-07 (decode launch), one call on whichever GPU comes:
# - an H200: the decode attention's lighter launch at batch 1 / 16 against the H200 table's (both arms, about
#   220 s), then every launch on the tuning's steps (decode_launch_lab.py, about 50 s): decides the H200 table's entry;
# - any other (an H100): the PDL arms with PDL on everywhere, with the later trigger everywhere, and off everywhere
#   (pdl-pairs.sh, 95-130 s an arm; ARMS=... for others).
# Usage, from the repository root on the GPU: bash benchmarks/logs/2026-12-07-s15/pending-next.sh OUT
OUT=$1; mkdir -p $OUT; D=benchmarks/logs
python3 -c "import llmc" 2>/dev/null || pip install -q --no-deps -e . >/dev/null 2>&1
n=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$n" | tee $OUT/gpu.txt
case "$n" in
  *H200*)
    PARTS=b1 timeout 300 bash $D/2026-12-07-s13/pending-decode-launch/decode-launch-ab.sh $OUT/launch 2>&1 \
        | grep -v "^config  *b1 prefill"
    timeout 100 python3 benchmarks/decode_launch_lab.py --out $OUT/lab > $OUT/lab.log 2>&1
    echo "lab rc $?"; grep -v -i warn $OUT/lab.log | tail -13 ;;
  *)
    ARMS=${ARMS:-all late-all none} bash $D/2026-12-07-s15/pending-pdl-pairs/pdl-pairs.sh $OUT/pdl ;;
esac

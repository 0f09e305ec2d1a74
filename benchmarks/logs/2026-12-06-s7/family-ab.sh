#!/usr/bin/env bash
# The pending family patch against the tree, one machine: int4 b1 / b16 decode (bf16 untuned as the baseline),
# first without the patch, then with it (the tree is restored after). Usage: bash THIS OUT
OUT=$1; mkdir -p $OUT
here=$(cd "$(dirname "$0")" && pwd)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $gpu"
python3 -c "import llmc" 2>/dev/null || pip install -q --no-deps -e . >/dev/null 2>&1
t0=$(date +%s)
for run in tree patched; do
    if [ $run = patched ]; then git apply "$here/pending-family-every-bucket.patch" || exit 1; fi
    rm -rf /tmp/tmp*
    timeout 280 python3 benchmarks/quant_decode_bench.py --shape 8b --quant rtn4-small --new 128 --bf16-no-tune \
        --out $OUT/$run > $OUT/$run.log 2>&1
    echo "$run rc $? at $(( $(date +%s) - t0 )) s"
    if [ $run = patched ]; then git apply -R "$here/pending-family-every-bucket.patch"; fi
    tail -4 $OUT/$run.log
done

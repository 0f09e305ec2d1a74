#!/usr/bin/env bash
# The gpt-fast-style int4 peer against bf16 at batch 1, then llmc int4 (rtn4-small) against bf16, one machine
OUT=$1; mkdir -p $OUT
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $gpu"
python3 -c "import llmc" 2>/dev/null || pip install -q --no-deps -e . >/dev/null 2>&1
git log --oneline -1 > $OUT/commit.txt; git status --short > $OUT/status.txt
t0=$(date +%s)
timeout 230 python3 benchmarks/peer_int4_decode.py --shape 8b --new 128 --batches 1 --out $OUT/peer > $OUT/peer.log 2>&1
echo "peer rc $? at $(( $(date +%s) - t0 )) s"; grep -E "tok/s|int4:|^ *[0-9]|batch" $OUT/peer.log | tail -8
rm -rf /tmp/tmp*
timeout $(( 360 - ($(date +%s) - t0) )) python3 benchmarks/quant_decode_bench.py --shape 8b --quant rtn4-small --new 128 --bf16-no-tune \
    --out $OUT/llmc > $OUT/llmc.log 2>&1
echo "llmc rc $? at $(( $(date +%s) - t0 )) s"; tail -6 $OUT/llmc.log | grep -v "^{"

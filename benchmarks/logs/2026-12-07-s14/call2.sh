#!/usr/bin/env bash
# The qlinear's mask-free whole tiles (EVEN_N, EVEN_K): each int4 linear of the 8B shape at its bucket's default
# config, with the tree's kernels, then with the masks back (even.patch reversed), then the tree's again; then the
# 8B int4 decode on the tree. Usage, from the repository root: bash benchmarks/logs/2026-12-07-s14/call2.sh OUT
OUT=$1; mkdir -p $OUT; export PYTHONPATH=.
P=benchmarks/logs/2026-12-07-s14/even.patch
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
probe() { timeout 70 python3 benchmarks/qlinear_probe.py --shapes gate_up,down,qkv,o_proj --ms 1,16 --formats int4-g128 \
    --out $OUT/$1 2>&1 | grep -v -i warn > $OUT/$1.log; el "$1 rc $?"; cat $OUT/$1.log; }
probe tree1
git apply -R $P && probe masked; git apply $P
[ "${TREE2:-1}" = 0 ] || probe tree2
[ "${E2E:-1}" = 0 ] && exit 0  # E2E=0: the probes only
LLMC_CACHE_DIR=/tmp/llmc_even timeout ${E2E_TIMEOUT:-120} python3 benchmarks/quant_decode_bench.py --shape 8b --quant rtn4 \
    --new 128 --bf16-no-tune --out $OUT/e2e > $OUT/e2e.log 2>&1; el "e2e rc $?"; grep -A3 "^config" $OUT/e2e.log | head -4

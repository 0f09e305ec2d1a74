#!/usr/bin/env bash
# A split-K tile's count reset without a fence (this directory's patch): the split-K kernels compiled and run
# on the GPU with the patch, then the 8B bf16 and int4 decode of the tree, the patched tree and the tree again,
# one machine (the patch is reverted afterwards). Usage: bash THIS OUT   (about 9 minutes)
OUT=$1; mkdir -p $OUT
here=$(cd "$(dirname "$0")" && pwd)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $gpu"
python3 -c "import llmc" 2>/dev/null || pip install -q --no-deps -e . >/dev/null 2>&1
t0=$(date +%s)
decode() {
    rm -rf /tmp/tmp*
    timeout 150 python3 benchmarks/quant_decode_bench.py --shape 8b --quant rtn4-small --new 128 --bf16-no-tune \
        --out $OUT/$1 > $OUT/$1.log 2>&1
    echo "$1 rc $? at $(( $(date +%s) - t0 )) s"; tail -3 $OUT/$1.log
}
git apply "$here/relaxed-reset.patch" || exit 1
TRITON_INTERPRET=0 timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/codegen/test_qmatmul.py \
    tests/codegen/test_attention_kernels.py tests/codegen/test_norm_elementwise_matmul.py \
    -k "split_k_and_swapped or releases_its_counters or alone_equals or split_k_sums" \
    > $OUT/pytest.log 2>&1
echo "pytest rc $? at $(( $(date +%s) - t0 )) s: $(tail -1 $OUT/pytest.log)"
git apply -R "$here/relaxed-reset.patch"
decode tree1
git apply "$here/relaxed-reset.patch" || exit 1
decode relaxed
git apply -R "$here/relaxed-reset.patch"
decode tree2

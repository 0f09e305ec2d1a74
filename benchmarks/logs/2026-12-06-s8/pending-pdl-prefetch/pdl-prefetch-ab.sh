#!/usr/bin/env bash
# int4 decode with the qlinear's weight prefetch before its PDL wait (this directory's patch, LLMC_PDL_PREFETCH):
# off, then on at 16 and 48 MiB a launch, one machine; the patch is reverted afterwards. Usage: bash THIS OUT
OUT=$1; mkdir -p $OUT
here=$(cd "$(dirname "$0")" && pwd)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $gpu"
python3 -c "import llmc" 2>/dev/null || pip install -q --no-deps -e . >/dev/null 2>&1
git apply "$here/pdl-prefetch-qlinear.patch" || exit 1
t0=$(date +%s)
LLMC_PDL_PREFETCH=1 TRITON_INTERPRET=0 timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/codegen/test_qmatmul.py \
    -k "qlinear_formats and (int4 or fp8)" > $OUT/pytest.log 2>&1
echo "pytest rc $? at $(( $(date +%s) - t0 )) s: $(tail -1 $OUT/pytest.log)"
for run in "0 4" "1 16" "1 48"; do
    set -- $run; name=pf$1-$2
    rm -rf /tmp/tmp*
    LLMC_PDL_PREFETCH=$1 LLMC_PDL_PREFETCH_MB=$2 timeout 150 python3 benchmarks/quant_decode_bench.py --shape 8b \
        --quant rtn4-small --new 128 --bf16-no-tune --out $OUT/$name > $OUT/$name.log 2>&1
    echo "$name rc $? at $(( $(date +%s) - t0 )) s"
    tail -4 $OUT/$name.log | sed -n '2p;4p'
done
git apply -R "$here/pdl-prefetch-qlinear.patch"

#!/usr/bin/env bash
# The stream-K int4 kernel (this directory's patch): its compiled tests, one call per 8B shape against the
# tree's default and tuned-like configs, then the int4 b1 / b16 decode of the tree and of the tree with the
# patch on one machine (the patch is reverted afterwards). Usage: bash THIS OUT   (about 8 minutes)
OUT=$1; mkdir -p $OUT
here=$(cd "$(dirname "$0")" && pwd)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $gpu"
python3 -c "import llmc" 2>/dev/null || pip install -q --no-deps -e . >/dev/null 2>&1
t0=$(date +%s)
rm -rf /tmp/tmp*
timeout 150 python3 benchmarks/quant_decode_bench.py --shape 8b --quant rtn4-small --new 128 --bf16-no-tune \
    --out $OUT/tree > $OUT/tree.log 2>&1
echo "tree rc $? at $(( $(date +%s) - t0 )) s"; tail -4 $OUT/tree.log | sed -n '2p;4p'
git apply "$here/stream-k.patch" || exit 1
TRITON_INTERPRET=0 timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/codegen/test_qmatmul.py \
    -k "stream_k or qlinear_formats" > $OUT/pytest.log 2>&1
echo "pytest rc $? at $(( $(date +%s) - t0 )) s: $(tail -1 $OUT/pytest.log)"
timeout 150 python3 benchmarks/qlinear_probe.py --shapes gate_up,down,qkv,o_proj --ms 1,16,64 --formats int4-g128 \
    --variants default,split2,stream3,stream4,stream5,stream4+st4,stream1+bn128+w8+st4 --out $OUT/probe > $OUT/probe.log 2>&1
echo "probe rc $? at $(( $(date +%s) - t0 )) s"; awk '{print $1, $2, $4, $5, $6}' $OUT/probe.log
rm -rf /tmp/tmp*
timeout 150 python3 benchmarks/quant_decode_bench.py --shape 8b --quant rtn4-small --new 128 --bf16-no-tune \
    --out $OUT/stream-k > $OUT/stream-k.log 2>&1
echo "stream-k rc $? at $(( $(date +%s) - t0 )) s"; tail -4 $OUT/stream-k.log | sed -n '2p;4p'
git apply -R "$here/stream-k.patch"
python3 - $OUT <<'PY'
import json, sys
t = json.load(open(f"{sys.argv[1]}/stream-k/rtn4-small_tuning.json"))
for k, v in t["kernels"].items():
    if k.startswith("qlinear"):
        print(k[41:], {b: c["config"].get("STREAM") for b, c in v.items() if c.get("config")})
PY

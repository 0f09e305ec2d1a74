#!/usr/bin/env bash
# The 8B shape's decode attention launch end to end, on one machine. The shipped tables tune it
# to 128-key tiles on 8 warps (the fastest at batch 1, 1.12x slower than 64-key tiles on 4 warps over 128 ragged
# contexts; RESULTS 2026-12-07, later). Each arm compiles with its own tuning cache: "shipped" has none (the shipped
# table seeds the compile), "n64w4" a copy of the shipped table whose d128 decode entry is 64-key tiles on 4 warps
# (a machine's own cache wins over the shipped table). Both arms: batch-1 / 16 decode (bf16 and int4 tuned, so both
# take the arm's launch) and the mixed workload (int4 and FP8 tuned; bf16 untuned, the default launch, in both).
# Usage, from the repository root on the GPU: bash benchmarks/logs/2026-12-07-s13/pending-decode-launch/decode-launch-ab.sh OUT
# (ARMS="n64w4" PARTS="mixed" QUANT=rtn4,fp8 for a subset; default both arms, both parts, int4 and FP8 on the mixed workload)
OUT=$1; mkdir -p $OUT
python3 -c "import llmc" 2>/dev/null || pip install -q --no-deps -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tee $OUT/gpu.txt
t0=$(date +%s)
for arm in ${ARMS:-shipped n64w4}; do
  export LLMC_CACHE_DIR=/tmp/llmc_cache_$arm; rm -rf $LLMC_CACHE_DIR /tmp/tmp*
  if [ $arm = n64w4 ]; then
    python3 - <<'PY'
import json, shutil, torch
from llmc.codegen import autotune
path = autotune.cache_file(torch.cuda.get_device_name(0), autotune.JOINT_BUCKETS)
shipped = autotune.SHIPPED_DIR / path.name
d = json.loads(shipped.read_text())
rec = d["kernels"]["paged_attention_decode:d128:hq32:hkv8:bfloat16:bfloat16"]["decode"]
rec["config"] = {"BLOCK_N": 64, "num_stages": 2, "num_warps": 4}
path.parent.mkdir(parents=True, exist_ok=True)
path.write_text(json.dumps(d))
print("wrote", path)
PY
  fi
  if [[ " ${PARTS:-b1 mixed} " == *" b1 "* ]]; then
    timeout 200 python3 benchmarks/quant_decode_bench.py --shape 8b --quant rtn4 --new 128 --out $OUT/$arm-b1 \
        > $OUT/$arm-b1.log 2>&1; echo "$arm b1 rc $? at $(( $(date +%s) - t0 )) s"; grep -A3 "^config" $OUT/$arm-b1.log | head -4
  fi
  if [[ " ${PARTS:-b1 mixed} " == *" mixed "* ]]; then
    timeout ${MIXED_TIMEOUT:-260} python3 benchmarks/quant_decode_bench.py --shape 8b --quant ${QUANT:-rtn4,fp8} --no-decode \
        --mixed 128 --bf16-no-tune --longest-first --out $OUT/$arm-mixed > $OUT/$arm-mixed.log 2>&1
    echo "$arm mixed rc $? at $(( $(date +%s) - t0 )) s"; grep -A4 "^config" $OUT/$arm-mixed.log | head -5
    grep -h '"config"' $OUT/$arm-mixed/quant_decode_bench.partial.jsonl 2>/dev/null | cut -c1-160
  fi
done

#!/usr/bin/env bash
# The int4 wgmma GEMV with its copies of x a group ahead as default candidates, against the Triton qlinear alone
# (ARMS "wgmma triton" of ../2026-12-07-s18/call2.sh: 8B int4 g128 decode at batch 1 / 16, default compile, bf16
# beside each), with every compile's decode attention launch set to 64-key tiles on 4 warps (each arm's tuning
# cache seeded with that record), so that the arms differ in their linears only: the tuning's choice between
# that launch and 128-key tiles on 8 warps is within its 2% on an H200 and fell differently in call 1's arms.
# Usage, from the repository root on the GPU: bash benchmarks/logs/2026-12-07-s19/call2.sh OUT
OUT=$1; mkdir -p $OUT
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
for arm in ${ARMS:-wgmma triton}; do
  rm -rf /tmp/llmc-cache-$arm
  LLMC_CACHE_DIR=/tmp/llmc-cache-$arm python3 - <<'PY'
import json, torch
from llmc.codegen import autotune
path = autotune.cache_file(torch.cuda.get_device_name(0), autotune.JOINT_BUCKETS)
path.parent.mkdir(parents=True, exist_ok=True)
rec = {"config": {"BLOCK_N": 64, "num_stages": 2, "num_warps": 4}, "triton_ms": None, "cublas_ms": None,
       "prefer_cublas": False}
path.write_text(json.dumps({"device": torch.cuda.get_device_name(0), "format": 1,
                            "joint_buckets": list(autotune.JOINT_BUCKETS),
                            "kernels": {"paged_attention_decode:d128:hq32:hkv8:bfloat16:bfloat16": {"decode": rec}}}))
print("seeded", path)
PY
done
ARMS=${ARMS:-wgmma triton} ARM_T=${ARM_T:-180} bash benchmarks/logs/2026-12-07-s18/call2.sh $OUT/decode

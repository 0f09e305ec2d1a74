#!/usr/bin/env bash
# The GPU measurements still owed by the open issues, one step per argument, each writing its log and
# JSON under OUT (never through a pipe: a step cut off by the device's time limit keeps what it wrote).
#
#   bash benchmarks/gpu_pending.sh OUT qmatmul        # issue 14: the quantized kernels compiled on the GPU
#   bash benchmarks/gpu_pending.sh OUT w8-sweep       # issue 14: every W8A8 GEMM config at decode sizes (KIND fp8|w8a8,
#                                                     #   MS "64,128", SHAPES all four; benchmarks/w8_sweep.py)
#   bash benchmarks/gpu_pending.sh OUT quant-decode   # issue 14: 8B decode, bf16 vs int4 (QUANT=rtn4,rtn4-small,fp8,w8a8)
#   bash benchmarks/gpu_pending.sh OUT spec-load      # issue 18: widened 8B target at batch 32 and 128 (REPEAT runs, 3;
#                                                     #   WARMUP_RUNS untimed whole runs first, 1; SPEC_BATCHES)
#   bash benchmarks/gpu_pending.sh OUT spec-schedule  # issue 18: greedy agreement, plain and speculative, across schedules
#   bash benchmarks/gpu_pending.sh OUT spec-b1        # issue 18: widened 8B target at batch 1, held-out and repetitive
#   bash benchmarks/gpu_pending.sh OUT widen-check    # issue 18: bf16 agreement of the widened target, 64k tokens
#   bash benchmarks/gpu_pending.sh OUT onnx           # issue 19: 8B from its ONNX export against from its HF dir
#   bash benchmarks/gpu_pending.sh OUT quant-mixed    # issue 14: 8B mixed workload, bf16 vs fp8, w8a8, int4
#   QUANT=rtn4 bash benchmarks/gpu_pending.sh OUT quant-profile  # issue 14: the same, each run's top kernels
#   bash benchmarks/gpu_pending.sh OUT compile-8b     # issue 20: a cold 8B compile's phases (capture, passes, tuning, write)
#   bash benchmarks/gpu_pending.sh OUT int4-ptx       # issue 14: int4 codes unpacked by PTX: compiled tests, then per call
#                                                     #   against LLMC_INT4_PTX=0 (alternating), then 8B decode end to end
#   bash benchmarks/gpu_pending.sh OUT parallel       # issue 16 (nvidia-h200-x2): TP=2 and PP=2 against one GPU
#   SHAPE=70b-8l bash benchmarks/gpu_pending.sh OUT parallel   # issue 17's trimmed 70B layers on 2 GPUs
#   bash benchmarks/gpu_pending.sh OUT multi-step     # issue 20: 8B, multi-step decoding k=4,8 against single steps
#   bash benchmarks/gpu_pending.sh OUT parallel-moe   # issue 16 (nvidia-h200-x2): trimmed Mixtral, EP=2 against one GPU
#   bash benchmarks/gpu_pending.sh OUT allreduce      # issue 16 (nvidia-h200-x2): NCCL vs symmetric-memory all_reduce
#   bash benchmarks/gpu_pending.sh OUT verify         # issue 20: a load's weight check, 16 GB, on the machine's cores
#   bash benchmarks/gpu_pending.sh OUT mixed-graphs   # issue 20: mixed workload, eager mixed steps vs piecewise graphs
#                                                     #   (SHAPE, default 8b; N requests, default 128; 128 at once)
#   bash benchmarks/gpu_pending.sh OUT mixed-ab       # issue 20: the same in one engine per shape, the switch flipped
#                                                     #   between runs after an untimed run each way (SHAPES "1b 8b")
#   bash benchmarks/gpu_pending.sh OUT warm-up        # issue 20: first runs after a load with the warm-up off and on
#   TOOLS=.bench_tools bash benchmarks/gpu_pending.sh OUT issue-bench  # issue 20: llmc_bench.py per shape (SHAPES)
#                                                     #   and LLMC_MIXED_GRAPHS value (MIXED, default "0 1")
#   bash benchmarks/gpu_pending.sh OUT overlap        # issue 20: steps waited for vs overlapped (SHAPE, default 8b)
#   LAYOUTS=1x1,2x1s,2x1 bash benchmarks/gpu_pending.sh OUT parallel   # issue 16: TP=2 overlapped steps off / on
#   bash benchmarks/gpu_pending.sh OUT ncu-int4       # issue 14: the int4 qlinear kernel at batch 1 under Nsight
#                                                     #   Compute (stall reasons, issue rate, bandwidth): gate_up, down
#   bash benchmarks/gpu_pending.sh OUT step-trace     # issue 20: the mixed workload's wall time by step kind (GPU span,
#                                                     #   GPU gap, host launch) and its host's top functions (SHAPES)
#   bash benchmarks/gpu_pending.sh OUT mixed-step-graphs  # issue 20: whole-step mixed graphs: the packed attention's
#                                                     #   bits and times (gpu_check_attention.py --quick), then the
#                                                     #   step trace with LLMC_MIXED_STEP_GRAPHS=0 and =1 alternating
#                                                     #   in fresh processes (SHAPES, default "1b 8b"; ROUNDS, 2;
#                                                     #   VALUES, default "0 1": "1024 1" for graphs of steps of
#                                                     #   up to 1,024 tokens against up to 2,048; CHECK=0: no
#                                                     #   attention check first)
#   bash benchmarks/gpu_pending.sh OUT decode-step    # issue 20: one decode step (BATCHES, CONTEXTS) against its
#                                                     #   weights + K/V bound, kernel by kernel (SHAPES)
#   bash benchmarks/gpu_pending.sh OUT context-graphs # issue 20: decode graphs per context bucket off / on
#                                                     #   (LLMC_DECODE_CONTEXT_GRAPHS): a decode step, the mixed run
#   VAR=LLMC_SPLIT_ARGMAX bash benchmarks/gpu_pending.sh OUT step-ab  # the same for any runtime switch
#   bash benchmarks/gpu_pending.sh OUT kv-layout      # issue 20: the cache's memory order (LLMC_KV_LAYOUT tokens / heads):
#                                                     #   attention launches, then one decode step and the mixed run
#                                                     #   (SHAPES, default "1b 8b"; MIXED_SHAPES, default "1b",
#                                                     #   empty for none; ROUNDS of the decode step, default 1)
#   bash benchmarks/gpu_pending.sh OUT load-trace     # issue 20: a load's phases and warm-up steps, empty Triton cache
#                                                     #   then warm (SHAPE, default 8b)
#   bash benchmarks/gpu_pending.sh OUT profile-mixed  # issue 20: where the mixed workload's GPU time goes
#                                                     #   (TOOLS/llmc_profile.py, TOOLS default ../shared/tools; SHAPES
#                                                     #   default 8b; N requests)
#   bash benchmarks/gpu_pending.sh OUT attention      # issue 20: paged attention launches against the bounds
#                                                     #   (benchmarks/attention_bench.py; SHAPES, default "8b 1b";
#                                                     #   PARTITIONS="64,128,512": decode keys per split besides 256)
#   bash benchmarks/gpu_pending.sh OUT attention-kv   # issue 14: decode attention on a bf16, int8 and fp8 cache
#                                                     #   (KV_DTYPES; SHAPES, default "8b 1b"; CODE_DOTS="1 0": the
#                                                     #   quantized caches also with K/V dequantized first)
#   bash benchmarks/gpu_pending.sh OUT ab-mixed       # issue 20: TTFT and mixed workload with VAR=0 and =1 alternating
#                                                     #   (default LLMC_PREFILL_TILES; LLMC_LONG_PREFILL_GRAPHS:
#                                                     #   a lone prompt of up to 2,048 tokens on a step graph;
#                                                     #   WORKLOADS="decode" VAR=LLMC_SPLIT_ARGMAX: batch-1 decode
#                                                     #   with the argmax row on one program or split;
#                                                     #   VAR=LLMC_PDL, VAR=LLMC_PDL_PREFETCH likewise;
#                                                     #   VAR=LLMC_GC_FREEZE: the heap frozen at load or not;
#                                                     #   SHAPE=1b WORKLOADS="decode mixed" VAR=LLMC_SILU_EPILOGUE:
#                                                     #   the SwiGLU product after the gate/up matmul, or in it;
#                                                     #   ROUNDS, default 2; N mixed requests, default 128)
#   BASE=.bench_base bash benchmarks/gpu_pending.sh OUT tree-ab  # this tree against an older llmc under BASE
#                                                     #   (`git archive COMMIT llmc | tar -x -C BASE`), alternating:
#                                                     #   prefill attention launches (ATTN_SHAPES, default "8b 1b"),
#                                                     #   then llmc bench WORKLOADS (default "prefill mixed") on one
#                                                     #   SHAPE artifact (default 8b) compiled by this tree, ROUNDS (2)
#   bash benchmarks/gpu_pending.sh OUT tuned-table    # the shipped tuning table remade: SHAPES (default "8b 1b")
#                                                     #   compiled with an empty LLMC_CACHE_DIR, its tuning/*.json
#                                                     #   under OUT/tuned (copy it to llmc/codegen/tuned/)
#   bash benchmarks/gpu_pending.sh OUT budget         # issue 20: a compile's phases, decode and TTFT, then the mixed
#                                                     #   workload at the measured token budget and at TOKENS (2048)
#   bash benchmarks/gpu_pending.sh OUT tuned-check    # the generated matmul compiled, each tuned choice alone, and
#                                                     #   greedy agreement under variants of a tuned artifact's choices
#   bash benchmarks/gpu_pending.sh OUT step-profile   # issue 20: TTFT and batch-1 decode kernel by kernel (SHAPES,
#                                                     #   default "8b"; benchmarks/step_profile.py)
#   COLD_ENVS="LLMC_TRITON_SETUP=0 -" bash benchmarks/gpu_pending.sh OUT compile-ab  # issue 20: cold 8B compiles
#                                                     #   (fresh process, empty caches) under each setting, REPEAT times
#                                                     #   (DIRTY=1: the model written afresh right before each)
#   bash benchmarks/gpu_pending.sh OUT compile-spy    # issue 20: a cold 8B compile sampled by py-spy (every thread;
#                                                     #   the wheel under .whl/), then a fresh prompt's TTFT traced
#   bash benchmarks/gpu_pending.sh OUT compile-profile  # issue 20: a cold 8B compile under cProfile (the main thread's
#                                                     #   functions by cumulative time), empty Triton and llmc caches
#   bash benchmarks/gpu_pending.sh OUT prefill-flags  # issue 20: TTFT and greedy tokens with LLMC_LONG_PREFILL_GRAPHS
#                                                     #   each way (SHAPES, default "8b 1b")
#   bash benchmarks/gpu_pending.sh OUT e2e            # benchmarks/gpu_e2e.py: greedy tokens against HF eager
#   bash benchmarks/gpu_pending.sh OUT kernels        # the generated kernels compiled on the GPU against their
#                                                     #   references (norm, elementwise, matmul, sampling; attention by
#                                                     #   scripts/gpu_check_attention.py --quick;
#                                                     #   PDL on as by default on Hopper, LLMC_PDL=0 to compare)
#   bash benchmarks/gpu_pending.sh OUT mixed-factors  # issue 20: a tuned and an untuned artifact of one random model
#                                                     #   on the mixed workload, then the tuned one under the per-step
#                                                     #   budget (LLMC_STEP_BUDGET=1) and its measured budget (SHAPE)
#   bash benchmarks/gpu_pending.sh OUT schedules      # issue 20: the mixed workload's queue order and step budgets on
#                                                     #   one random SHAPE model (default 8b; N requests, 128 for 8b,
#                                                     #   256 for 1b; 128 at once), ROUNDS (2) of fresh llmc bench
#                                                     #   processes: the workload's order, longest first, and longest
#                                                     #   first with steps that carry decodes at 256 / 512 tokens
#                                                     #   (--max-prefill-tokens 2048; benchmarks/schedule_sim.py)
#                                                     #   and paced (LLMC_PACE_PROMPTS=1);
#                                                     #   KV="int8": that row again with an int8 K/V cache
#   bash benchmarks/gpu_pending.sh OUT compile-cold   # issue 20: a cold 8B compile (empty Triton and llmc caches)
#                                                     #   and its load, candidates warmed up on threads, then with
#                                                     #   LLMC_TUNE_THREADS=0 (COLD_THREADS="default" for the first only;
#                                                     #   COLD_PROCESSES="0 16": each also with kernels compiled in
#                                                     #   16 worker processes, LLMC_TUNE_PROCESSES)
#
# On nvidia-h200-x2 keep NVLink multicast off (the machine's NCCL_NVLS_ENABLE=0 and
# TORCH_SYMM_MEM_DISABLE_MULTICAST=1): the workers inherit this script's environment.
#
# parallel and multi-step compile their random model once per machine, to /tmp/art-SHAPE.llmc.
# Steps that need the widened target build it once under WIDE (default /tmp/wide: 13 GiB plus a 13 GiB
# artifact; the device's disk holds about 50 GiB free).
set -u
OUT=${1:?usage: gpu_pending.sh OUT STEP...}
shift
WIDE=${WIDE:-/tmp/wide}
export PYTHONPATH=${PYTHONPATH:-$(cd "$(dirname "$0")/.." && pwd)}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
mkdir -p "$OUT"

compile_shared() {  # SHAPE PATH: decode_bench's random model of SHAPE compiled to PATH (kept if there); prints
                  # "SHAPE compile phases {...}"
    python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from decode_bench import shared_artifact; \
art = shared_artifact('$1', '$2'); print('$1 compile phases', \
{k: round(v, 1) for k, v in (getattr(art, 'compile_timings', None) or {}).items()})"
}

requests_for() {  # the mixed workload's requests for a shape: $N_<shape>, else 256 for 1b and 128 for others
    local n=N_$1
    echo "${!n:-$([ "$1" = 1b ] && echo 256 || echo 128)}"
}

decode_step_with() {  # one engine decode step of shape $1 (batch 128 over 512 and 1,024 keys) under the setting $2
    # (VAR=value): its kernels appended to $3, its two summary lines, headed by the setting, to $4
    env "$2" python3 benchmarks/decode_step_profile.py --shape "$1" --artifact "/tmp/art-$1.llmc" --batches 128 \
        --contexts 512,1024 --out /tmp/dsp >>"$3" 2>&1
    grep "^==" "$3" | tail -2 | sed "s/^/$2: /" | tee -a "$4"
}

mixed_with() {  # the issue tool's mixed workload (step_trace.py) of shape $1 under the setting $2: its line to $3
    env "$2" python3 benchmarks/step_trace.py --shape "$1" --n "$(requests_for "$1")" --max-num-seqs 128 \
        --artifact "/tmp/art-$1.llmc" --out /tmp/st --no-cprofile 2>&1 | grep "^# $1," | sed "s/^/$2: /" | tee -a "$3"
}

widened_hf() {  # the widened target as a Hugging Face directory (what widen-check reads); one built before the
               # logit shift (scripts/widen_model.py, step 8) is built again, and its compiled artifact dropped
    grep -qs '"logit_shift": {' "$WIDE/w8b/widen_info.json" && return
    rm -rf "$WIDE/w8b.llmc"
    mkdir -p "$WIDE"
    python3 scripts/widen_model.py builtin:tiny-py "$WIDE/w8b" --hidden 4096 --layers 32 --heads 32 \
        --kv-heads 8 --intermediate 14336 --dtype bfloat16 >>"$OUT/widen.log" 2>&1
}

widened() {  # the widened target and tiny-py-draft compiled (what the speculation steps run)
    [ -d "$WIDE/w8b.llmc" ] && return
    widened_hf
    python3 -c "import llmc; llmc.compile('$WIDE/w8b', '$WIDE/w8b.llmc', dtype='bfloat16'); \
llmc.compile('builtin:tiny-py-draft', '$WIDE/d.llmc', dtype='bfloat16')" >>"$OUT/widen.log" 2>&1
}

for step in "$@"; do
    echo "== $step $(date -u +%T)"
    case $step in
        qmatmul)
            TRITON_INTERPRET=0 python3 -m pytest -q tests/codegen/test_qmatmul.py >"$OUT/qmatmul.log" 2>&1
            tail -3 "$OUT/qmatmul.log" ;;
        w8-sweep)
            PYTHONPATH=. python3 benchmarks/w8_sweep.py --out "$OUT" --kind "${KIND:-fp8}" --ms "${MS:-64,128}" \
                --shapes "${SW_SHAPES:-qkv,o_proj,gate_up,down}" >"$OUT/w8_sweep_${KIND:-fp8}.log" 2>&1
            grep -v failed "$OUT/w8_sweep_${KIND:-fp8}.log" | tail -60 ;;
        quant-decode)
            rm -rf /tmp/tmp*  # earlier steps' 8B models: the disk holds few
            python3 benchmarks/quant_decode_bench.py --shape 8b --quant "${QUANT:-rtn4,rtn4-small}" --new 128 \
                --no-tune --out "$OUT" >"$OUT/quant_decode.log" 2>&1
            tail -8 "$OUT/quant_decode.log" ;;
        spec-load)
            widened
            for b in ${SPEC_BATCHES:-32 128}; do
                n=$((b == 32 ? 64 : 128))
                python3 benchmarks/spec_bench.py --target "$WIDE/w8b.llmc" --draft "$WIDE/d.llmc" --dtype bfloat16 \
                    --prompts $n --max-tokens 128 --batch $b --configs none,ngram,multi:auto,draft:auto \
                    --repeat "${REPEAT:-3}" --warmup-runs "${WARMUP_RUNS:-1}" --out "$OUT" >"$OUT/spec_b$b.log" 2>&1
                tail -6 "$OUT/spec_b$b.log"
            done ;;
        spec-b1)
            widened
            python3 benchmarks/spec_bench.py --target "$WIDE/w8b.llmc" --draft "$WIDE/d.llmc" --dtype bfloat16 \
                --prompts 64 --max-tokens 256 --batch 1 --repeat "${REPEAT:-1}" \
                --configs none,draft:5,draft:auto,multi:auto,ngram --out "$OUT" >"$OUT/spec_b1.log" 2>&1
            tail -7 "$OUT/spec_b1.log"
            python3 benchmarks/spec_bench.py --target "$WIDE/w8b.llmc" --draft "$WIDE/d.llmc" --dtype bfloat16 \
                --workload repetitive --prompts 16 --max-tokens 256 --batch 1 --repeat "${REPEAT:-1}" \
                --configs none,ngram,draft:auto --out "$OUT" >"$OUT/spec_rep.log" 2>&1
            tail -5 "$OUT/spec_rep.log" ;;
        spec-schedule)
            widened
            python3 benchmarks/schedule_agreement.py --target "$WIDE/w8b.llmc" --runs "${RUNS:-all}" --out "$OUT" \
                >"$OUT/schedule.log" 2>&1
            tail -8 "$OUT/schedule.log" ;;
        widen-check)
            widened_hf
            python3 benchmarks/widen_check.py --bf16 "$WIDE/w8b" --tokens 65536 --out "$OUT" >"$OUT/widen_check.log" 2>&1
            tail -8 "$OUT/widen_check.log" ;;
        onnx)
            rm -rf /tmp/tmp*
            python3 benchmarks/onnx_bench.py --shape 8b --new 256 --ort-new "${ORT_NEW:-4}" --out "$OUT" >"$OUT/onnx_bench.log" 2>&1
            tail -25 "$OUT/onnx_bench.log" ;;
        quant-mixed)
            rm -rf /tmp/tmp*
            # MIXED_OPTS: e.g. "--longest-first --mixed-budget 256" (benchmarks/quant_decode_bench.py)
            python3 benchmarks/quant_decode_bench.py --shape 8b --quant "${QUANT:-fp8,w8a8,rtn4}" --no-decode \
                --mixed 128 --bf16-no-tune ${MIXED_OPTS:-} --out "$OUT" >"$OUT/quant_mixed.log" 2>&1
            tail -8 "$OUT/quant_mixed.log" ;;
        quant-profile)
            rm -rf /tmp/tmp*
            LLMC_PROFILE_DIR="$OUT/profile" LLMC_PROFILE_STEPS=${PROFILE_STEPS:-100:1500} \
                python3 benchmarks/quant_decode_bench.py --shape 8b --quant "${QUANT:-rtn4}" --no-decode --mixed 128 \
                --bf16-no-tune ${MIXED_OPTS:-} --out "$OUT" >"$OUT/quant_profile.log" 2>&1
            tail -6 "$OUT/quant_profile.log"; head -${PROFILE_LINES:-14} "$OUT"/profile/*/profile-engine.txt ;;
        int4-ptx)
            TRITON_INTERPRET=0 python3 -m pytest -q tests/codegen/test_qmatmul.py -k "formats or ragged or split_k or tall \
or row_tiles or leading or group_of_two" >"$OUT/int4_ptx_tests.log" 2>&1
            tail -3 "$OUT/int4_ptx_tests.log"
            for v in 0 1 0 1; do
                LLMC_INT4_PTX=$v python3 benchmarks/quant_bench.py --out "$OUT/ptx$v" --ms 1,16,128 --methods bf16,int4-g128 \
                    >"$OUT/int4_ptx_bench_$v.log" 2>&1
                tail -4 "$OUT/int4_ptx_bench_$v.log"
            done
            rm -rf /tmp/tmp*
            python3 benchmarks/quant_decode_bench.py --shape 8b --quant rtn4 --new 128 --out "$OUT" >"$OUT/quant_decode.log" 2>&1
            tail -4 "$OUT/quant_decode.log" ;;
        compile-8b)
            rm -rf /tmp/tmp* ~/.cache/llmc/tuning
            python3 -c "import sys, time; sys.path.insert(0, 'benchmarks'); from decode_bench import random_model; \
import llmc, tempfile, pathlib; d = pathlib.Path(tempfile.mkdtemp()); random_model('8b', d / 'm'); t = time.time(); \
art = llmc.compile(d / 'm', d / 'a.llmc', dtype='bfloat16'); print('compile', round(time.time() - t, 1), 's', \
{k: round(v, 1) for k, v in art.compile_timings.items()}, 'weights file', round(art.weights_seconds, 1), 's'); \
t = time.time(); llm = llmc.LLM(art.path); \
print('load', round(time.time() - t, 1), 's')" >"$OUT/compile_8b.log" 2>&1
            grep -v Writing "$OUT/compile_8b.log" | tail -3 ;;
        ncu-int4)
            for shape in gate_up down; do
                ncu --clock-control none --kernel-name regex:qmatmul_kernel --launch-count 1 \
                    --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
                    --section WarpStateStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
                    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
                    python3 benchmarks/qlinear_probe.py --shapes $shape --ms 1 --formats int4-g128 \
                    >"$OUT/ncu_int4_$shape.log" 2>&1
                grep -E "Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Issue Slots Busy|\
No Eligible|stalled|Warp Cycles Per Issued" "$OUT/ncu_int4_$shape.log" | head -40
            done ;;
        compile-cold)
            rm -rf /tmp/tmp* /tmp/cold; mkdir -p /tmp/cold
            python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from decode_bench import random_model; \
random_model('8b', '/tmp/cold/m')" >"$OUT/compile_cold.log" 2>&1
            for threads in ${COLD_THREADS:-default 0}; do
              for procs in ${COLD_PROCESSES:-0}; do
                threads=${threads#default}
                rm -rf /tmp/cold/a.llmc
                LLMC_TUNE_THREADS=$threads LLMC_TUNE_PROCESSES=$procs TRITON_CACHE_DIR=/tmp/cold/triton-$threads-$procs \
                    LLMC_CACHE_DIR=/tmp/cold/llmc-$threads-$procs \
                    python3 -c "import time, llmc; t = time.time(); art = llmc.compile('/tmp/cold/m', '/tmp/cold/a.llmc', \
dtype='bfloat16'); print('LLMC_TUNE_THREADS=${threads:-default} LLMC_TUNE_PROCESSES=$procs compile', round(time.time() - t, 1), 's', \
{k: round(v, 1) for k, v in art.compile_timings.items()}, 'weights file', round(art.weights_seconds, 1), 's'); \
[print('  step', round(t, 2), 's', m) for m, t in art.compile_steps]; t = time.time(); llm = llmc.LLM(art.path); \
print('load', round(time.time() - t, 1), 's')" >>"$OUT/compile_cold.log" 2>&1
              done
            done
            grep "compile \|^load\|  step" "$OUT/compile_cold.log" | grep -v Writing ;;
        compile-ab)
            # cold 8B compiles, one fresh process and empty Triton and llmc caches each, under each of COLD_ENVS
            # (space-separated; each a comma-joined list of VAR=VALUE, "-" for none), in that order, REPEAT times.
            # The model is on disk first (sync: as one downloaded earlier); DIRTY=1 writes it afresh right before
            # each compile instead (as a model just saved: 16 GB of dirty pages that throttle the disk writes)
            rm -rf /tmp/tmp* /tmp/cold; mkdir -p /tmp/cold
            model() { python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from decode_bench import random_model; \
random_model('8b', '/tmp/cold/m')" >>"$OUT/compile_ab.log" 2>&1; }
            [ "${DIRTY:-0}" = 1 ] || { model; sync; }
            for r in $(seq ${REPEAT:-1}); do
              for envs in ${COLD_ENVS:--}; do
                rm -rf /tmp/cold/a.llmc /tmp/cold/triton /tmp/cold/llmc
                settings=${envs//,/ }; [ "$envs" = - ] && settings=
                if [ "${DIRTY:-0}" = 1 ]; then rm -rf /tmp/cold/m; sync; model; else sync; fi
                echo -n "DIRTY=${DIRTY:-0} " >>"$OUT/compile_ab.log"; grep -E "^(Dirty|Writeback):" /proc/meminfo | tr -s ' ' | tr '\n' ' ' >>"$OUT/compile_ab.log"
                env $settings TRITON_CACHE_DIR=/tmp/cold/triton LLMC_CACHE_DIR=/tmp/cold/llmc python3 -c "import time; \
t0 = time.time(); import llmc.compiler; t = time.time(); \
art = llmc.compile('/tmp/cold/m', '/tmp/cold/a.llmc', dtype='bfloat16'); t1 = time.time(); \
from llmc.codegen import triton_setup as ts; print('$envs: imports', round(t - t0, 1), 's, compile', round(t1 - t, 1), \
's, both', round(t1 - t0, 1), 's', {k: round(v, 1) for k, v in art.compile_timings.items()}, 'weights file', \
round(art.weights_seconds, 1), 's, triton set-up', ts.seconds and round(ts.seconds, 2), ts.error); \
[print('  step', round(t, 2), 's', m) for m, t in art.compile_steps if t > 0.3]; t = time.time(); \
llm = llmc.LLM(art.path); print('  load', round(time.time() - t, 1), 's')" >>"$OUT/compile_ab.log" 2>&1
              done
            done
            rm -rf /tmp/cold  # 32 GB: the device's disk holds about 50 GB free
            grep "imports\|  load\|  step" "$OUT/compile_ab.log" | grep -v Writing ;;
        compile-spy)
            # a cold 8B compile and its load sampled by py-spy (wheel under .whl/, carried): every thread's
            # stacks, idle ones too, 100 a second; then a fresh prompt's TTFT traced on the artifact
            pip install -q --no-index .whl/py_spy-*.whl >"$OUT/compile_spy.log" 2>&1
            rm -rf /tmp/tmp* /tmp/cold; mkdir -p /tmp/cold
            python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from decode_bench import random_model; \
random_model('8b', '/tmp/cold/m')" >>"$OUT/compile_spy.log" 2>&1
            TRITON_CACHE_DIR=/tmp/cold/triton LLMC_CACHE_DIR=/tmp/cold/llmc py-spy record -r 100 --threads --idle \
                --nonblocking -f raw -o "$OUT/compile_stacks.txt" -- python3 -c "import time; t = time.time(); \
import llmc.compiler; print('imports', round(time.time() - t, 1), 's'); t = time.time(); \
art = llmc.compile('/tmp/cold/m', '/tmp/cold/a.llmc', dtype='bfloat16'); print('compile', round(time.time() - t, 1), \
's', {k: round(v, 1) for k, v in art.compile_timings.items()}, 'weights file', round(art.weights_seconds, 1), 's'); \
[print('  step', round(t, 2), 's', m) for m, t in art.compile_steps]; t = time.time(); llm = llmc.LLM(art.path); \
print('load', round(time.time() - t, 1), 's')" >>"$OUT/compile_spy.log" 2>&1
            grep "^imports\|compile \|^load\|  step" "$OUT/compile_spy.log" | grep -v Writing
            python3 benchmarks/stack_summary.py "$OUT/compile_stacks.txt" --top 12 >"$OUT/compile_stacks_all.txt" 2>&1
            for w in _tune_linears llmc-tune llmc-write; do
                python3 benchmarks/stack_summary.py "$OUT/compile_stacks.txt" --within $w --top 25 \
                    >"$OUT/compile_stacks_$w.txt" 2>&1
            done
            TRITON_CACHE_DIR=/tmp/cold/triton LLMC_CACHE_DIR=/tmp/cold/llmc python3 benchmarks/ttft_trace.py \
                /tmp/cold/a.llmc --out "$OUT" >"$OUT/ttft_trace.log" 2>&1
            tail -40 "$OUT/ttft_trace.log" ;;
        step-profile)
            rm -rf /tmp/tmp*
            for shape in ${SHAPES:-8b}; do
                python3 benchmarks/step_profile.py --shape $shape --artifact "${ARTIFACT:-/tmp/art-$shape.llmc}" --out "$OUT" \
                    >"$OUT/step_profile_$shape.log" 2>&1
                grep "^== \|# compiled" "$OUT/step_profile_$shape.log"
                rm -rf /tmp/tmp*  # the random model's directory: the disk holds few
            done ;;
        prefill-flags)
            rm -rf /tmp/tmp*
            for shape in ${SHAPES:-8b 1b}; do
                compile_shared "$shape" "/tmp/art-$shape.llmc" >"$OUT/prefill_flags_$shape.log" 2>&1
                rm -rf /tmp/tmp*
                python3 benchmarks/prefill_flags.py /tmp/art-$shape.llmc --out "$OUT" >>"$OUT/prefill_flags_$shape.log" 2>&1
                tail -5 "$OUT/prefill_flags_$shape.log"
            done ;;
        compile-profile)
            rm -rf /tmp/cold; mkdir -p /tmp/cold
            python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from decode_bench import random_model; \
random_model('8b', '/tmp/cold/m')" >"$OUT/compile_profile.log" 2>&1
            TRITON_CACHE_DIR=/tmp/cold/triton LLMC_CACHE_DIR=/tmp/cold/llmc python3 -c "import time; t = time.time(); \
import cProfile, pstats, llmc; print('import llmc', round(time.time() - t, 1), 's'); pr = cProfile.Profile(); t = time.time(); \
pr.enable(); art = llmc.compile('/tmp/cold/m', '/tmp/cold/a.llmc', dtype='bfloat16'); pr.disable(); \
print('compile', round(time.time() - t, 1), 's', {k: round(v, 1) for k, v in art.compile_timings.items()}, \
'weights file', round(art.weights_seconds, 1), 's'); pstats.Stats(pr).sort_stats('cumulative').print_stats(70)" >>"$OUT/compile_profile.log" 2>&1
            grep "^import llmc\|^compile " "$OUT/compile_profile.log"
            rm -rf /tmp/cold/a.llmc /tmp/cold/triton /tmp/cold/llmc
            python3 benchmarks/write_bench.py /tmp/cold/m --to /tmp/cold >"$OUT/write_bench.log" 2>&1
            cat "$OUT/write_bench.log" ;;
        parallel)
            rm -rf /tmp/tmp*
            python3 benchmarks/parallel_bench.py --shape "${SHAPE:-8b}" --layouts "${LAYOUTS:-1x1,2x1,2x1m8,1x2}" \
                --n 128 --artifact "/tmp/art-${SHAPE:-8b}.llmc" --out "$OUT" >"$OUT/parallel.log" 2>&1
            tail -8 "$OUT/parallel.log" ;;
        multi-step)
            rm -rf /tmp/tmp*
            python3 benchmarks/multi_step_bench.py --shape "${SHAPE:-8b}" --ks "${KS:-4,8}" --n 128 \
                --artifact "/tmp/art-${SHAPE:-8b}.llmc" --out "$OUT" >"$OUT/multi_step.log" 2>&1
            tail -5 "$OUT/multi_step.log" ;;
        parallel-moe)
            rm -rf /tmp/tmp*
            python3 benchmarks/parallel_bench.py --shape mixtral-8l --layouts 1x1,2x1 --expert-parallel --n 128 \
                --out "$OUT/moe" >"$OUT/parallel_moe.log" 2>&1
            tail -6 "$OUT/parallel_moe.log" ;;
        mixed-graphs)
            # LLMC_MIXED_GRAPHS 0 and 1 alternating, twice: N requests (default 128) at once, 128 sequences at most
            rm -rf /tmp/tmp*
            compile_shared "${SHAPE:-8b}" "/tmp/art-${SHAPE:-8b}.llmc" >"$OUT/mixed_graphs.log" 2>&1
            for v in 0 1 0 1; do
                LLMC_MIXED_GRAPHS=$v python3 -m llmc bench "/tmp/art-${SHAPE:-8b}.llmc" --workload mixed \
                    --num-requests ${N:-128} --max-num-seqs 128 --json >"$OUT/mixed_graphs_$v.json" 2>>"$OUT/mixed_graphs.log"
                python3 -c "import json; d = json.load(open('$OUT/mixed_graphs_$v.json')); print('LLMC_MIXED_GRAPHS=$v', \
{k: d.get(k) for k in ('out_tok_s', 'ttft_ms_p50', 'itl_ms_p50', 'itl_ms_p99', 'gpu_busy')})" | tee -a "$OUT/mixed_graphs.log"
            done ;;
        mixed-ab)
            # one engine per shape, eager mixed steps against piecewise graphs flipped between runs (SHAPES, default
            # "1b 8b"; N_1b, N_8b requests, default 256 and 128; REPEAT timed runs each, default 3)
            rm -rf /tmp/tmp*
            for shape in ${SHAPES:-1b 8b}; do
                python3 benchmarks/mixed_graphs_bench.py --shape $shape --n $(requests_for $shape) \
                    --repeat ${REPEAT:-3} --artifact "/tmp/art-$shape.llmc" --out "$OUT/mixed_ab_$shape" \
                    >"$OUT/mixed_ab_$shape.log" 2>&1
                tail -9 "$OUT/mixed_ab_$shape.log"
            done ;;
        warm-up)
            # fresh processes from the compile's Triton cache, the load-time warm-up off and on alternating (SHAPES,
            # default "1b 8b"; N_1b, N_8b requests, default 256 and 128; REPEAT, default 2; SETTINGS, default off,on:
            # add ahead for the warm-up's kernels compiled on threads first, LLMC_WARM_UP_AHEAD=1, procs for the same
            # in 16 worker processes; each row's JSON names the kernels its load compiled)
            rm -rf /tmp/tmp*
            for shape in ${SHAPES:-1b 8b}; do
                python3 benchmarks/warm_up_bench.py --shape $shape --n $(requests_for $shape) \
                    --repeat ${REPEAT:-2} --settings ${SETTINGS:-off,on} --out "$OUT/warm_up_$shape" \
                    >"$OUT/warm_up_$shape.log" 2>&1
                tail -6 "$OUT/warm_up_$shape.log"
            done ;;
        issue-bench)
            # the issue's own tool (TOOLS/llmc_bench.py), per shape (SHAPES, default "1b 8b"), under each of MIXED
            # (LLMC_MIXED_GRAPHS values, default "0 1"); N_1b, N_8b requests as above
            for shape in ${SHAPES:-1b 8b}; do
                for v in ${MIXED:-0 1}; do
                    rm -rf /tmp/tmp*
                    LLMC_MIXED_GRAPHS=$v PYTHONPATH=. python3 "${TOOLS:-../shared/tools}/llmc_bench.py" --shape $shape \
                        --n $(requests_for $shape) --out "$OUT" >"$OUT/llmc_bench_${shape}_$v.log" 2>&1
                    echo "$shape LLMC_MIXED_GRAPHS=$v: $(grep -E '^(compile|load|decode|ttft|throughput)' \
                        "$OUT/llmc_bench_${shape}_$v.log" | cut -c1-90 | tr '\n' '|')"
                done
            done ;;
        step-trace)
            # where the mixed workload's wall time goes, step kind by step kind, and the host's top functions
            # (benchmarks/step_trace.py; SHAPES, default "1b 8b"; N_1b, N_8b requests as above; 128 at once)
            for shape in ${SHAPES:-1b 8b}; do
                rm -rf /tmp/tmp*
                python3 benchmarks/step_trace.py --shape $shape --n $(requests_for $shape) --max-num-seqs 128 \
                    --artifact "/tmp/art-$shape.llmc" --out "$OUT" $([ "$shape" = 1b ] || echo --no-cprofile) \
                    >"$OUT/step_trace_$shape.log" 2>&1
                grep -A12 "^# $shape," "$OUT/step_trace_$shape.log"
            done ;;
        mixed-step-graphs)
            if [ "${CHECK:-1}" != 0 ]; then  # CHECK=0: the step traces alone
                python3 scripts/gpu_check_attention.py --quick >"$OUT/attn_packed.log" 2>&1
                grep -E "packed|ok$|FAIL" "$OUT/attn_packed.log" | tail -12
            fi
            for shape in ${SHAPES:-1b 8b}; do
                for round in $(seq 1 "${ROUNDS:-2}"); do
                    for v in ${VALUES:-0 1}; do
                        rm -rf /tmp/tmp*
                        LLMC_MIXED_STEP_GRAPHS=$v python3 benchmarks/step_trace.py --shape $shape \
                            --n $(requests_for $shape) --max-num-seqs 128 --artifact "/tmp/art-$shape.llmc" \
                            --out "$OUT/msg-$v-$round" --no-cprofile >"$OUT/msg_${shape}_${v}_$round.log" 2>&1
                        echo "LLMC_MIXED_STEP_GRAPHS=$v, round $round"
                        grep -B1 -A12 "^# $shape," "$OUT/msg_${shape}_${v}_$round.log"
                    done
                done
            done ;;
        decode-step)
            # one decode step at batches 64, 128 and contexts 512, 1024 against its bound, kernel by kernel (SHAPES)
            for shape in ${SHAPES:-1b 8b}; do
                rm -rf /tmp/tmp*
                python3 benchmarks/decode_step_profile.py --shape $shape --artifact "/tmp/art-$shape.llmc" \
                    --batches "${BATCHES:-64,128}" --contexts "${CONTEXTS:-512,1024}" --out /tmp/dsp \
                    >>"$OUT/decode_step.log" 2>&1
            done
            grep "^==" "$OUT/decode_step.log" ;;
        context-graphs|step-ab)
            # a runtime switch (VAR, default LLMC_DECODE_CONTEXT_GRAPHS: decode graphs per context bucket; e.g.
            # LLMC_SPLIT_ARGMAX) off, then on: one decode step at
            # batch 128 over 512 and 1,024 keys, then the issue tool's mixed workload (step_trace.py), per shape
            # (SHAPES, default "1b 8b")
            var=${VAR:-LLMC_DECODE_CONTEXT_GRAPHS}
            for shape in ${SHAPES:-1b 8b}; do
                rm -rf /tmp/tmp*
                for v in 0 1 0 1; do
                    decode_step_with $shape "$var=$v" "$OUT/step_ab_steps.log" "$OUT/step_ab.log"
                    mixed_with $shape "$var=$v" "$OUT/step_ab.log"
                done
            done ;;
        kv-layout)
            # the K/V cache stored token-major ([BS, Hkv, D] a block) and head-major ([Hkv, BS, D]): every decode
            # and prefill attention launch in each (attention_bench.py), then one engine decode step (batch 128 over
            # 512 and 1,024 keys) in each, alternating, per shape; then the issue tool's mixed workload in each
            for shape in ${SHAPES:-1b 8b}; do
                for layout in tokens heads; do
                    python3 benchmarks/attention_bench.py --shape $shape --layout $layout --out "$OUT" \
                        >"$OUT/attention_${shape}_$layout.log" 2>&1
                    sed -n '/best llmc launch/,/^$/p' "$OUT/attention_${shape}_$layout.log" | sed "s/^/$layout: /"
                done
                rm -rf /tmp/tmp*
                for layout in $(for _ in $(seq 1 "${ROUNDS:-1}"); do echo tokens heads; done); do
                    decode_step_with $shape "LLMC_KV_LAYOUT=$layout" "$OUT/kv_layout_steps.log" "$OUT/kv_layout.log"
                done
            done
            for shape in ${MIXED_SHAPES-1b}; do
                for layout in tokens heads tokens heads; do
                    mixed_with $shape "LLMC_KV_LAYOUT=$layout" "$OUT/kv_layout.log"
                done
            done ;;
        load-trace)
            # a load and its warm-up step by step (SHAPE, default 8b): first from an empty Triton cache, then again
            # with the cache the first left, then that under cProfile (the load's phases)
            shape=${SHAPE:-8b}
            rm -rf /tmp/tmp*
            compile_shared "$shape" "/tmp/art-$shape.llmc" >"$OUT/load_trace_$shape.log" 2>&1
            rm -rf "${TRITON_CACHE_DIR:-$HOME/.triton/cache}"
            for run in fresh warm warm-profiled; do
                python3 - "/tmp/art-$shape.llmc" "$OUT/load_trace_${shape}.prof.txt" $run >>"$OUT/load_trace_$shape.log" \
                    2>&1 <<'PY'
import cProfile, io, logging, pstats, sys, time
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(relativeCreated)8.0f %(name)s %(message)s")
logging.getLogger("llmc.runtime.executor").setLevel(logging.DEBUG)
import llmc
import llmc.compiler  # noqa: F401  (what a compile in the same process has imported before its load)
prof = cProfile.Profile()
profiled = sys.argv[3].endswith("profiled")
t = time.perf_counter()
if profiled:
    prof.enable()
llm = llmc.LLM(sys.argv[1], max_num_seqs=128)
prof.disable()
print(f"load ({sys.argv[3]}) {time.perf_counter() - t:.2f} s, warm-up {llm.stats()['warm_up_s']} s")
if sys.argv[3] == "warm":  # the weights on the GPU, bit for bit the file's
    import torch
    from safetensors import safe_open
    params = llm.engine.executor.plan.params
    with safe_open(sys.argv[1] + "/weights.safetensors", framework="pt") as f:
        bad = [n for n in params if not torch.equal(params[n].cpu(), f.get_tensor(n))]
    print(f"weights checked: {len(params) - len(bad)} of {len(params)} equal {bad[:3]}")
if profiled:
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(60)
    open(sys.argv[2], "w").write(s.getvalue())
PY
                echo "$run: $(grep -E '^(load|weights)' "$OUT/load_trace_$shape.log" | tail -2 | tr '\n' ' ')"
            done ;;
        overlap)
            rm -rf /tmp/tmp*
            python3 benchmarks/multi_step_bench.py --shape "${SHAPE:-8b}" --modes 1-sync,1,1-sync,1 --n 128 \
                --artifact "/tmp/art-${SHAPE:-8b}.llmc" --out "$OUT" >"$OUT/overlap.log" 2>&1
            tail -6 "$OUT/overlap.log" ;;
        profile-mixed)
            rm -rf /tmp/tmp*
            for shape in ${SHAPES:-8b}; do
                python3 "${TOOLS:-../shared/tools}/llmc_profile.py" --shape $shape --n ${N:-128} \
                    >"$OUT/profile_mixed_$shape.log" 2>&1
                grep -v Writing "$OUT/profile_mixed_$shape.log" | tail -40
            done ;;
        attention)
            for shape in ${SHAPES:-8b 1b}; do
                python3 benchmarks/attention_bench.py --shape $shape --out "$OUT" --partitions "${PARTITIONS:-}" \
                    >"$OUT/attention_$shape.log" 2>&1
                grep -E 'sdpa' "$OUT/attention_$shape.log"; sed -n '/best llmc launch/,$p' "$OUT/attention_$shape.log"
            done ;;
        attention-kv)
            # decode attention on each cache type (KV_DTYPES, default "bf16 int8 fp8"; SHAPES, default "8b 1b")
            for shape in ${SHAPES:-8b 1b}; do
                for kv in ${KV_DTYPES:-bf16 int8 fp8}; do
                    dots_values=${CODE_DOTS:-1}  # LLMC_KV_CODE_DOTS values ("1 0": also dequantized first)
                    for dots in $dots_values; do
                        [ "$kv" = bf16 ] && [ "$dots" != "${dots_values%% *}" ] && continue  # a bf16 cache: once
                        LLMC_KV_CODE_DOTS=$dots python3 benchmarks/attention_bench.py --shape $shape --decode-only \
                            --kv-dtype $kv >"$OUT/attention_${shape}_${kv}_dots$dots.log" 2>&1
                        echo "# $shape, $kv cache, LLMC_KV_CODE_DOTS=$dots"
                        sed -n '/best llmc launch/,/^$/p' "$OUT/attention_${shape}_${kv}_dots$dots.log"
                    done
                done
            done ;;
        ab-mixed)
            rm -rf /tmp/tmp*
            compile_shared "${SHAPE:-8b}" "/tmp/art-${SHAPE:-8b}.llmc" >"$OUT/ab_mixed.log" 2>&1
            grep "compile" "$OUT/ab_mixed.log" | grep -v Writing | tail -2
            python3 -c "import json; k = json.load(open('/tmp/art-${SHAPE:-8b}.llmc/tuning.json'))['kernels']; \
print({n: b for n, b in k.items() if n.startswith('paged_attention')}); print('token_budget', \
json.load(open('/tmp/art-${SHAPE:-8b}.llmc/tuning.json')).get('token_budget'))" | tee -a "$OUT/ab_mixed.log"
            var=${VAR:-LLMC_PREFILL_TILES}
            for round in $(seq 1 "${ROUNDS:-2}"); do
                for v in 0 1; do
                    for w in ${WORKLOADS:-prefill mixed}; do
                        env $var=$v python3 -m llmc bench "/tmp/art-${SHAPE:-8b}.llmc" --workload $w \
                            --num-requests $([ $w = mixed ] && echo "${N:-128} --max-num-seqs 128" || echo 5) --json \
                            >"$OUT/ab_${w}_${v}_$round.json" 2>>"$OUT/ab_mixed.log"
                        python3 -c "import json; d = json.load(open('$OUT/ab_${w}_${v}_$round.json')); \
print('$var=$v $w', {k: d.get(k) for k in ('out_tok_s', 'ttft_ms_p50', 'ttft_ms_p99', 'itl_ms_p50', 'itl_ms_p99', \
'gpu_busy', 'steps')}, d.get('host_ms_per_step'))" | tee -a "$OUT/ab_mixed.log"
                    done
                done
            done ;;
        mixed-factors)
            # a tuned artifact's mixed workload against an untuned one's (cuBLAS for every linear, the attention
            # kernels' default launches, no measured budget), and the tuned one under the per-step budget
            # (LLMC_STEP_BUDGET=1) and its measured budget every step: one random model, each row a fresh
            # `llmc bench` process (128 requests at once). An artifact's files are checked against its manifest,
            # so its tuning.json cannot be edited between rows
            rm -rf /tmp/tmp* /tmp/mf && mkdir -p /tmp/mf
            python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import llmc; from decode_bench import random_model; \
hf = random_model('${SHAPE:-8b}', '/tmp/mf/hf'); llmc.compile(str(hf), '/tmp/mf/t.llmc', dtype='bfloat16'); \
llmc.compile(str(hf), '/tmp/mf/u.llmc', dtype='bfloat16', tune=False)" >"$OUT/mixed_factors.log" 2>&1
            run_mf() {  # NAME ARTIFACT [bench options]
                local name=$1 art=$2; shift 2
                python3 -m llmc bench "$art" --workload mixed --num-requests 128 --max-num-seqs 128 --json "$@" \
                    >"$OUT/mf_$name.json" 2>>"$OUT/mixed_factors.log"
                python3 -c "import json; d = json.load(open('$OUT/mf_$name.json')); print('$name', \
{k: round(d[k], 3) for k in ('out_tok_s', 'ttft_ms_p50', 'itl_ms_p50', 'itl_ms_p99', 'gpu_busy') if k in d})" \
                    | tee -a "$OUT/mixed_factors.log"
            }
            run_mf tuned /tmp/mf/t.llmc
            run_mf untuned /tmp/mf/u.llmc
            LLMC_STEP_BUDGET=1 run_mf tuned-step-budget /tmp/mf/t.llmc
            run_mf tuned-budget-measured /tmp/mf/t.llmc --max-num-batched-tokens "$(python3 -c "import json; \
print(json.load(open('/tmp/mf/t.llmc/tuning.json')).get('token_budget', {}).get('tokens', 2048))")" ;;
        schedules)
            shape=${SHAPE:-8b}
            n=${N:-$(requests_for "$shape")}
            rm -rf /tmp/tmp* /tmp/sch && mkdir -p /tmp/sch
            compile_shared "$shape" /tmp/sch/a.llmc >"$OUT/schedules_$shape.log" 2>&1
            run_sch() {  # NAME [bench options]
                local name=$1; shift
                python3 -m llmc bench /tmp/sch/a.llmc --workload mixed --num-requests "$n" --max-num-seqs 128 --json \
                    "$@" >"$OUT/sch_${shape}_${name}_$round.json" 2>>"$OUT/schedules_$shape.log"
                python3 -c "import json; d = json.load(open('$OUT/sch_${shape}_${name}_$round.json')); \
print('$shape $name round $round', {k: round(d[k], 3) for k in ('out_tok_s', 'ttft_ms_p50', 'itl_ms_p99', 'gpu_busy', \
'steps', 'max_num_batched_tokens', 'max_prefill_tokens', 'pace_prompts') if d.get(k) is not None}, d.get('host_ms_per_step'))" \
                    | tee -a "$OUT/schedules_$shape.log"
            }
            for round in $(seq 1 "${ROUNDS:-2}"); do
                run_sch given
                run_sch longest --longest-first
                run_sch longest-256 --longest-first --max-num-batched-tokens 256 --max-prefill-tokens 2048
                run_sch longest-512 --longest-first --max-num-batched-tokens 512 --max-prefill-tokens 2048
                LLMC_PACE_PROMPTS=1 run_sch longest-paced --longest-first
                for kv in ${KV:-}; do  # KV="int8 fp8": the 256-token row again with a quantized K/V cache
                    run_sch longest-256-$kv --longest-first --max-num-batched-tokens 256 --max-prefill-tokens 2048 \
                        --kv-cache-dtype "$kv"
                done
            done
            grep "round" "$OUT/schedules_$shape.log" ;;
        tree-ab)
            base=$(cd "${BASE:?BASE=DIR: an older tree, llmc/ at its top}" && pwd)
            here=$(pwd)
            for shape in ${ATTN_SHAPES-8b 1b}; do
                for side in base here base here; do
                    dir=$([ $side = base ] && echo "$base" || echo "$here")
                    PYTHONPATH=$dir python3 benchmarks/attention_bench.py --shape $shape --prefill-only \
                        >"$OUT/attn_${shape}_$side.log" 2>&1
                    echo "$shape $side: $(sed -n '/best llmc launch/,$p' "$OUT/attn_${shape}_$side.log" | tail -n +2 \
                        | awk '{printf "%s us (%s)  ", $(NF-3), $(NF-4)}')"
                done
            done
            [ -n "${WORKLOADS-prefill mixed}" ] || exit 0
            rm -rf /tmp/tmp*
            compile_shared "${SHAPE:-8b}" "/tmp/art-${SHAPE:-8b}.llmc" >"$OUT/tree_ab.log" 2>&1
            grep "compile phases" "$OUT/tree_ab.log"
            for round in $(seq 1 "${ROUNDS:-2}"); do
                for side in base here; do
                    dir=$([ $side = base ] && echo "$base" || echo "$here")
                    for w in ${WORKLOADS-prefill mixed}; do
                        (cd "$dir" && PYTHONPATH=$dir python3 -m llmc bench "/tmp/art-${SHAPE:-8b}.llmc" --workload $w \
                            --num-requests $([ $w = mixed ] && echo "128 --max-num-seqs 128" || echo 5) --json \
                            >"$OUT/tree_${w}_${side}$round.json" 2>>"$OUT/tree_ab.log")
                        python3 -c "import json; d = json.load(open('$OUT/tree_${w}_${side}$round.json')); \
print('$side $round $w', {k: d.get(k) for k in ('out_tok_s', 'ttft_ms_p50', 'ttft_ms_p99', 'itl_ms_p50', 'gpu_busy')})" \
                            | tee -a "$OUT/tree_ab.log"
                    done
                done
            done ;;
        tuned-table)
            # the shipped tables aside while the shapes compile: a table of the cache's own name would seed the
            # tuning, and every choice it holds would be copied, not timed again
            rm -rf /tmp/tmp* /tmp/tuned-cache /tmp/tuned-shipped && mkdir -p /tmp/tuned-shipped
            mv llmc/codegen/tuned/*.json /tmp/tuned-shipped/ 2>/dev/null
            for shape in ${SHAPES:-8b 1b}; do
                LLMC_CACHE_DIR=/tmp/tuned-cache compile_shared "$shape" "/tmp/tuned-$shape.llmc" >>"$OUT/tuned_table.log" 2>&1
                rm -rf /tmp/tmp* "/tmp/tuned-$shape.llmc"
            done
            mv /tmp/tuned-shipped/*.json llmc/codegen/tuned/ 2>/dev/null
            mkdir -p "$OUT/tuned" && cp /tmp/tuned-cache/tuning/*.json "$OUT/tuned/"
            grep "compile phases" "$OUT/tuned_table.log"; ls "$OUT/tuned" ;;
        budget)
            rm -rf /tmp/tmp*
            compile_shared "${SHAPE:-8b}" "/tmp/art-${SHAPE:-8b}.llmc" >"$OUT/budget.log" 2>&1
            grep "compile" "$OUT/budget.log" | grep -v Writing | tail -2
            cp "/tmp/art-${SHAPE:-8b}.llmc/tuning.json" "$OUT/budget_tuning.json"
            for w in decode prefill; do
                python3 -m llmc bench "/tmp/art-${SHAPE:-8b}.llmc" --workload $w --json >"$OUT/budget_$w.json" \
                    2>>"$OUT/budget.log"
            done
            for t in default ${TOKENS:-2048} default ${TOKENS:-2048}; do
                python3 -m llmc bench "/tmp/art-${SHAPE:-8b}.llmc" --workload mixed --num-requests 128 --max-num-seqs 128 \
                    $([ $t = default ] || echo "--max-num-batched-tokens $t") --json >"$OUT/budget_mixed_$t.json" \
                    2>>"$OUT/budget.log"
                python3 -c "import json; d = json.load(open('$OUT/budget_mixed_$t.json')); \
print('mixed tokens=$t', {k: d.get(k) for k in ('out_tok_s', 'ttft_ms_p50', 'ttft_ms_p99', 'itl_ms_p50', 'itl_ms_p99', \
'gpu_busy')})" | tee -a "$OUT/budget.log"
            done
            python3 -c "import json; [print(w, {k: json.load(open('$OUT/budget_' + w + '.json')).get(k) for k in \
('out_tok_s', 'ttft_ms_p50', 'itl_ms_p50')}) for w in ('decode', 'prefill')]" | tee -a "$OUT/budget.log" ;;
        tuned-check)
            TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider tests/codegen/test_norm_elementwise_matmul.py \
                -k "matmul or candidate or split" >"$OUT/tuned_check_tests.log" 2>&1
            tail -3 "$OUT/tuned_check_tests.log"
            python3 benchmarks/tuned_check.py --out "$OUT" >"$OUT/tuned_check.log" 2>&1
            tail -30 "$OUT/tuned_check.log" ;;
        kernels)
            # the attention test module runs only interpreted (triton 3.6's interpreter fails it on this machine):
            # the compiled attention kernels are checked by scripts/gpu_check_attention.py
            TRITON_INTERPRET=0 timeout ${KERNELS_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider \
                tests/codegen/test_norm_elementwise_matmul.py tests/runtime/test_sampler.py >"$OUT/kernels.log" 2>&1
            tail -3 "$OUT/kernels.log"
            python3 scripts/gpu_check_attention.py --quick >"$OUT/attention_check.log" 2>&1
            tail -3 "$OUT/attention_check.log" ;;
        e2e)
            python3 benchmarks/gpu_e2e.py --out "$OUT" >"$OUT/gpu_e2e.log" 2>&1
            tail -12 "$OUT/gpu_e2e.log" ;;
        verify)
            python3 benchmarks/verify_bench.py --gb 16 --out "$OUT" >"$OUT/verify.log" 2>&1
            tail -4 "$OUT/verify.log" ;;
        allreduce)
            python3 benchmarks/allreduce_bench.py --out "$OUT/allreduce" >"$OUT/allreduce.log" 2>&1
            tail -9 "$OUT/allreduce.log" ;;
        *)
            echo "unknown step $step (qmatmul, quant-decode, spec-load, spec-b1, widen-check, onnx, quant-mixed, quant-profile, attention-kv, compile-8b, int4-ptx, ncu-int4, compile-cold, profile-mixed, attention, ab-mixed, budget, compile-ab, compile-spy, step-profile, prefill-flags, parallel, parallel-moe, multi-step, allreduce, verify, mixed-graphs, mixed-ab, warm-up, issue-bench, overlap, mixed-factors, tuned-check, tuned-table, tree-ab, kernels, e2e)" ;;
    esac
done

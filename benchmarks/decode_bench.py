"""Batch-1 decode speed of llmc's cuda backend on a Llama-3.2-1B-shaped model (random bf16 weights),
against the memory-bandwidth roofline measured in the same run.

Reports: copy bandwidth, bytes read per step, roofline tok/s; the graph-replay decode step time
(the runner alone) and the end-to-end engine tok/s (scheduler + sampler included); kernels per
decoder layer before and after fusion. Usage: python benchmarks/decode_bench.py [--new 256] [--out DIR]
[--kv-cache-dtype int8|fp8] (the same with a quantized KV cache)
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, head_dim=64,
               max_position_embeddings=4096),
    # Llama-3-8B (untied embeddings): the shape the speculative-decoding and quantization figures use
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, head_dim=128,
               max_position_embeddings=4096),
    # Llama-3-70B's layer shape, trimmed to 8 of its 80 layers (17.9 GB in bf16: fits one H200, and
    # the per-layer timing and memory planning of the 70B run on 2 GPUs, issue 17)
    "70b-8l": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=8, num_attention_heads=64,
                   num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, head_dim=128,
                   max_position_embeddings=4096),
    # a smoke-test shape for checking this script on a CPU (--shape tiny --backend triton-interpret)
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, tie_word_embeddings=True, head_dim=16,
                 max_position_embeddings=256),
    # Mixtral-8x7B's layer shape (8 experts, top 2), trimmed to 8 of its 32 layers (24 GB in bf16)
    "mixtral-8l": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=8, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=False, head_dim=128,
                       max_position_embeddings=4096, num_local_experts=8, num_experts_per_tok=2),
    "tiny-moe": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=256, tie_word_embeddings=False, head_dim=16,
                     max_position_embeddings=256, num_local_experts=4, num_experts_per_tok=2),
}
CUDA = torch.cuda.is_available()


def sync():
    if CUDA:
        torch.cuda.synchronize()


def random_model(shape: str, out: Path, dtype=torch.bfloat16, seed: int = 0) -> Path:
    """A seeded random Llama (Mixtral where the shape has experts) of `SHAPES[shape]` saved under `out`
    with tiny-py's tokenizer (so text goes in and out); LM-head rows past the tokenizer's ids are zero,
    so greedy tokens are text (the head keeps its full size and cost). Built on the GPU when there is one."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    from llmc.frontend.hf import TOKENIZER_FILES
    from llmc.models import builtin_dir
    out = Path(out)
    torch.manual_seed(seed)
    text_vocab = len(AutoTokenizer.from_pretrained(builtin_dir("tiny-py"), local_files_only=True))
    moe = "num_local_experts" in SHAPES[shape]
    config, model = (MixtralConfig, MixtralForCausalLM) if moe else (LlamaConfig, LlamaForCausalLM)
    cfg = config(**{**SHAPES[shape], "vocab_size": max(SHAPES[shape]["vocab_size"], text_vocab)},
                 architectures=[model.__name__])
    with torch.device("cuda" if CUDA else "cpu"):
        m = model(cfg).to(dtype)
    with torch.no_grad():
        m.lm_head.weight[text_vocab:] = 0
    m.save_pretrained(str(out))
    del m
    if CUDA:
        torch.cuda.empty_cache()
    for f in TOKENIZER_FILES:
        if (builtin_dir("tiny-py") / f).is_file():
            (out / f).write_bytes((builtin_dir("tiny-py") / f).read_bytes())
    return out


def shared_artifact(shape: str, path: str | None):
    """The bf16 artifact of `random_model(shape)`: loaded from `path` if a compile left it there, else
    compiled there (or in a fresh temporary directory), so that benchmarks on one machine share it."""
    import llmc
    if path and Path(path, "manifest.json").is_file():
        return llmc.load(path)
    work, t = Path(tempfile.mkdtemp()), time.time()
    art = llmc.compile(str(random_model(shape, work / "hf")), path or str(work / "m.llmc"), dtype="bfloat16")
    print(f"# compiled {shape} in {time.time() - t:.0f} s", flush=True)
    return art


def add_workload_args(ap, prompts_help: str | None = None) -> None:
    """The options the layout benchmarks (multi_step_bench, parallel_bench) share; `shared_setup` reads them."""
    ap.add_argument("--n", type=int, default=128, help="mixed workload: requests at once")
    ap.add_argument("--prompts", type=int, default=8, help=prompts_help)
    ap.add_argument("--artifact", default=None, help="compile the random model here, or reuse it if it is there "
                    "(steps on one machine then share one compile)")
    ap.add_argument("--out", default=".")


def shared_setup(a) -> tuple[Path, object, list[str]]:
    """(output folder, made; the shape's artifact, `shared_artifact`; `--prompts` held-out prompts) of
    parsed `add_workload_args` options and a `--shape`."""
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    return out, shared_artifact(a.shape, a.artifact), heldout_prompts(a.prompts)


def heldout_prompts(n: int) -> list[str]:
    """n 400-character cuts of the held-out text, 997 characters apart: the greedy comparisons' prompts."""
    from llmc.models import heldout_text_path
    text = heldout_text_path().read_text()
    return [text[i * 997:i * 997 + 400] for i in range(n)]


def bandwidth() -> float:
    if not CUDA:
        return float("nan")
    n = 2 * 1024 ** 3
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record()
    for _ in range(10):
        b.copy_(a)
    e.record()
    sync()
    del a, b
    return 2 * n * 10 / (s.elapsed_time(e) / 1e3)


def kernel_profile(runner, start, table, res, steps=50) -> dict:
    """GPU time per kernel name in one replayed decode step (CUPTI sees the kernels of a graph)."""
    from torch.profiler import ProfilerActivity, profile
    from llmc.runtime.executor import StepBatch, StepInput
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            runner.execute(StepBatch([StepInput([1], start + i, table)]))
        sync()
    per = {}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        us = e.self_cuda_time_total if us is None else us
        if us > 0:
            per[e.key] = (us / steps, e.count / steps)
    busy = sum(us for us, _ in per.values())
    step_us = res["step_ms"] * 1e3
    rows = sorted(per.items(), key=lambda kv: -kv[1][0])
    print(f"\nGPU time per decode step by kernel ({steps} replays): busy {busy:.1f} us of a {step_us:.1f} us step "
          f"(roofline {1e6 / res['roofline_tok_s']:.1f} us)")
    print(f"{'us/step':>8s} {'calls':>6s} {'share':>6s}  kernel")
    for k, (us, n) in rows[:30]:
        print(f"{us:8.1f} {n:6.1f} {us / step_us:6.1%}  {k[:110]}")
    return {"busy_us": busy, "step_us": step_us, "kernels": {k: {"us": us, "calls": n} for k, (us, n) in rows}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--out", default=".")
    ap.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8"])
    ap.add_argument("--profile", action="store_true",
                    help="also profile 32 engine decode steps with torch.profiler: a table of the top host and "
                         "device ops, and a chrome trace (engine_trace.json) under --out")
    ap.add_argument("--kernel-profile", action="store_true",
                    help="also profile 50 graph replays of the batch-1 decode step: GPU time per kernel per step, "
                         "its share of the step and of the roofline (kernel_profile.json under --out)")
    a = ap.parse_args()
    import llmc
    from transformers import LlamaConfig, LlamaForCausalLM
    from llmc.codegen.lower import Plan, kernels_per_layer
    from llmc.runtime.llm import LLM, SamplingParams
    from llmc.runtime.executor import StepBatch, StepInput
    res = {"gpu": torch.cuda.get_device_name() if CUDA else "cpu", "torch": torch.__version__, "shape": a.shape,
           "backend": a.backend}
    import triton
    res["triton"] = triton.__version__
    bw = bandwidth()
    res["bw_TBps"] = bw / 1e12
    work = Path(tempfile.mkdtemp())
    torch.manual_seed(0)
    cfg = LlamaConfig(**SHAPES[a.shape], architectures=["LlamaForCausalLM"])
    t = time.time()
    with torch.device("cuda" if CUDA else "cpu"):  # random init on the GPU: seconds, not minutes
        m = LlamaForCausalLM(cfg).to(torch.bfloat16)
    m.save_pretrained(str(work / "llama"))
    nparam = sum(p.numel() for p in m.parameters())
    del m
    # a tied table is read once per step, as the LM head; an untied input table only by the gather
    step_bytes = 2 * (nparam - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size))
    res.update(params=nparam, step_bytes=step_bytes, roofline_tok_s=bw / step_bytes)
    print(f"model saved in {time.time() - t:.0f}s; roofline {res['roofline_tok_s']:.0f} tok/s", flush=True)
    t = time.time()
    art = llmc.compile(work / "llama", work / "llama.llmc", dtype="bfloat16")
    res["compile_s"] = round(time.time() - t, 1)
    res["kernels_per_layer_fused"] = kernels_per_layer(Plan(art.graph, "meta"))["per_layer"]
    print(f"compiled in {res['compile_s']}s; kernels/layer {res['kernels_per_layer_fused']}", flush=True)

    res["kv_cache_dtype"] = a.kv_cache_dtype
    llm = LLM(art, backend=a.backend, num_blocks=2048, max_num_seqs=8, kv_cache_dtype=a.kv_cache_dtype)
    prompt = torch.randint(0, cfg.vocab_size, (a.prompt,)).tolist()
    params = SamplingParams(temperature=0, max_tokens=a.new, ignore_eos=True)
    llm.generate([prompt], params)  # warm-up: compiles kernels, captures the batch-1 graph
    llm.generate([prompt], params)  # again: a prefix-cache hit leaves a short prefill, compiled here
    llm.engine.timings.clear()
    llm.engine.num_steps = 0
    sync()
    t = time.perf_counter()
    out = llm.generate([prompt], params)[0]
    sync()
    e2e = time.perf_counter() - t
    res["engine_tok_s"] = a.new / e2e  # prefill of the prompt included, as the peers' figures
    res["engine_ms_per_step"] = {k: v for k, v in llm.stats().items() if k.startswith("ms_per_step")}
    # per-step wall times of the engine's decode steps (the median is the steady state)
    eng = llm.engine
    eng.add_request(prompt, params)
    times = []
    while eng.has_unfinished():
        t0 = time.perf_counter()
        eng.step()
        sync()
        times.append(time.perf_counter() - t0)
    dec = sorted(times[1:])
    res["engine_step_ms"] = {"median": dec[len(dec) // 2] * 1e3, "min": dec[0] * 1e3, "max": dec[-1] * 1e3,
                             "first (prefill)": times[0] * 1e3}
    res["engine_decode_tok_s_median"] = 1e3 / res["engine_step_ms"]["median"]
    if a.profile:
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
        with profile(activities=acts) as prof:
            llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
            sync()
        prof.export_chrome_trace(str(Path(a.out, "engine_trace.json")))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
    # the prompt's prefill alone (one token generated), to separate it from the decode rate
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate([prompt], one)
    sync()
    t = time.perf_counter()
    for _ in range(5):
        llm.generate([prompt], one)
    sync()
    res["prefill_ms"] = (time.perf_counter() - t) / 5 * 1e3
    res["engine_decode_tok_s"] = (a.new - 1) / (e2e - res["prefill_ms"] / 1e3)
    # time to first token of a fresh prompt (no prefix-cache hit): the whole prompt's prefill
    fresh = [torch.randint(0, cfg.vocab_size, (a.prompt,)).tolist() for _ in range(12)]
    llm.generate([fresh[0]], one)  # first use of this token bucket: kernels compiled, graph captured
    sync()
    t = time.perf_counter()
    for p in fresh[1:6]:
        llm.generate([p], one)
    sync()
    res["prefill_fresh_ms"] = (time.perf_counter() - t) / 5 * 1e3
    llm.engine.executor.use_cuda_graphs = False  # other fresh prompts' prefill eager, side by side
    llm.generate([fresh[6]], one)  # eager warm-up: kernel variants the graphs did not use compile here
    sync()
    t = time.perf_counter()
    for p in fresh[7:]:
        llm.generate([p], one)
    sync()
    res["prefill_fresh_eager_ms"] = (time.perf_counter() - t) / 5 * 1e3  # fresh[7:12]
    llm.engine.executor.use_cuda_graphs = a.backend == "cuda"
    # the prefill graph's logits against the eager plan's, same prompt and blocks (100 tokens: padded to 128)
    r = llm.engine.executor
    probe = [StepInput(fresh[0][:100], 0, list(range(1000, 1007)))]
    g_logits = r.execute(StepBatch(probe)).logits
    r.use_cuda_graphs = False
    e_logits = r.execute(StepBatch(probe)).logits
    r.use_cuda_graphs = a.backend == "cuda"
    res["prefill_graph_vs_eager"] = {"max_rel_err": ((g_logits - e_logits).abs().max() / e_logits.abs().max()).item(),
                                     "same_argmax": bool(g_logits.argmax() == e_logits.argmax())}
    # the runner alone: graph replays of one decode step
    runner = llm.engine.executor
    bt = list(range(32))
    for _ in range(5):
        runner.execute(StepBatch([StepInput([1], a.prompt, bt)]))
    sync()
    n = 200
    t = time.perf_counter()
    for i in range(n):
        runner.execute(StepBatch([StepInput([1], a.prompt + i, bt)]))
    sync()
    res["step_ms"] = (time.perf_counter() - t) / n * 1e3
    res["runner_tok_s"] = 1e3 / res["step_ms"]
    res["roofline_fraction_runner"] = res["runner_tok_s"] / res["roofline_tok_s"]
    res["roofline_fraction_engine"] = res["engine_tok_s"] / res["roofline_tok_s"]
    if a.kernel_profile and CUDA:
        res["kernel_profile"] = kernel_profile(runner, a.prompt, bt, res)
    # the same decode step without the fusion passes (graph replay too): what fusion buys
    del llm, runner
    torch.cuda.empty_cache() if CUDA else None
    plain = llmc.compile(work / "llama", work / "llama-unfused.llmc", dtype="bfloat16", fuse=False)
    res["kernels_per_step_unfused"] = kernels_per_layer(Plan(plain.graph, "meta"))["launches"]
    res["kernels_per_step_fused"] = kernels_per_layer(Plan(art.graph, "meta"))["launches"]
    r2 = LLM(plain, backend=a.backend, num_blocks=2048, max_num_seqs=8).engine.executor
    for _ in range(5):
        r2.execute(StepBatch([StepInput([1], a.prompt, bt)]))
    sync()
    t = time.perf_counter()
    for i in range(n):
        r2.execute(StepBatch([StepInput([1], a.prompt + i, bt)]))
    sync()
    res["step_ms_unfused"] = (time.perf_counter() - t) / n * 1e3
    del r2, plain
    # static buffer plan: arena bytes against one buffer per intermediate, and the activation
    # memory of a 2048-token prefill with the plan (arena + what kernels still allocate: split-K and
    # attention partials, the unplanned ops) and with the caching allocator alone
    bp = Plan(art.graph, "meta").buffers
    res["buffer_plan"] = {f"T={T}": bp.stats({"T": T, "N": 1, "L": 1}) for T in (1, 2048)}
    if CUDA:
        from llmc.runtime.executor import make_executor
        peak = {}
        for planned in (True, False):
            r3 = make_executor(art.graph, "cuda", "cuda", num_blocks=256, cuda_graphs=False)
            r3.plan = Plan(art.graph, "cuda", static_buffers=planned)
            batch = [StepInput(torch.randint(0, cfg.vocab_size, (2048,)).tolist(), 0, list(range(128)))]
            sync()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()  # weights and KV cache: the arena is not made yet
            r3.execute(StepBatch(batch))
            sync()
            t = time.perf_counter()
            r3.execute(StepBatch(batch))
            sync()
            peak[planned] = ((torch.cuda.max_memory_allocated() - base) / 2 ** 20, (time.perf_counter() - t) * 1e3)
            del r3
            torch.cuda.empty_cache()
        res["prefill2048_peak_MiB_planned"], res["prefill2048_ms_planned"] = peak[True]
        res["prefill2048_peak_MiB_allocator"], res["prefill2048_ms_allocator"] = peak[False]
    res["kv_cache_dtype"] = a.kv_cache_dtype
    llm = LLM(art, backend=a.backend, num_blocks=2048, max_num_seqs=8, kv_cache_dtype=a.kv_cache_dtype)
    # batch 8 decode through the engine (continuous batching), useful tokens per second
    prompts = [torch.randint(0, cfg.vocab_size, (a.prompt,)).tolist() for _ in range(8)]
    llm.generate(prompts, params)
    sync()
    t = time.perf_counter()
    llm.generate(prompts, params)
    sync()
    res["engine_batch8_tok_s"] = 8 * a.new / (time.perf_counter() - t)
    Path(a.out, "decode_bench.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    print("engine host time per step (ms):", res["engine_ms_per_step"], "\nengine step wall (ms):", res["engine_step_ms"],
          "\nbuffer plan:", res["buffer_plan"])
    print(f"\n{'metric':34s} value")
    for k in ("bw_TBps", "roofline_tok_s", "step_ms", "runner_tok_s", "engine_tok_s", "prefill_ms", "prefill_fresh_ms",
              "prefill_fresh_eager_ms",
              "engine_decode_tok_s", "engine_decode_tok_s_median", "engine_batch8_tok_s",
              "prefill2048_peak_MiB_planned", "prefill2048_peak_MiB_allocator",
              "roofline_fraction_runner", "step_ms_unfused", "kernels_per_step_unfused", "kernels_per_step_fused"):
        if k in res:
            print(f"{k:34s} {res[k]:.3f}" if isinstance(res[k], float) else f"{k:34s} {res[k]}")


if __name__ == "__main__":
    main()

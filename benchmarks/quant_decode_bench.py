"""Quantized decode on one GPU at a model shape (default Llama-3-8B, random bf16 weights): the same
random model compiled unquantized and with each `--quant` method, side by side in one run.

For each: weights file size, batch-1 engine decode tok/s (greedy, `--new` tokens after a fresh
128-token prompt, prefill included) and batch-16 decode tok/s (`--full-batch N`: batch N too), the
ratio to bf16, and the share of the memory roofline at batch 1 (bytes of the weights each step
reads / measured copy bandwidth); beside them the prompts' prefill time and the time a decode step
takes after it (`*_prefill_ms`, `*_step_ms`).

    python3 benchmarks/quant_decode_bench.py [--shape 8b] [--quant rtn4,fp8,smoothquant] [--new 128] [--out DIR]

A config name may end in `+kvint8` or `+kvfp8`: the weights are compiled for a K/V cache of that type
(`kv_cache_dtype`, so that the compile tunes the attention over it), so that e.g. `--quant fp8,fp8+kvfp8`
measures FP8 weights with and without an FP8 cache in one run. `--block-size` sets the engines' cache blocks.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# speed does not depend on how the codes were found: W8A8 int8 is SmoothQuant with a token of
# calibration (the random model has nothing to calibrate)
FORMATS = {"rtn4": {"method": "rtn", "wbits": 4}, "rtn8": {"method": "rtn", "wbits": 8}, "fp8": {"method": "fp8"},
           "w8a8": "w8a8",
           # the LM head int4 too and the embedding table in int8 rows: the smallest artifact (quant_size.py)
           "rtn4-small": {"method": "rtn", "wbits": 4, "skip": [], "embeddings": "int8"}}


def decode_rate(llm, prompt, new: int, batch: int, profile: tuple[str, str] | None = None) -> dict:
    """Generated tokens per second, end to end: a fresh 128-token prompt per sequence (its prefill
    included, as in tools/llmc_bench.py's decode figure) and `new` greedy tokens. Beside it, where the
    time goes: the prompts' prefill alone (`max_tokens=1` on prompts as fresh) and what is left a step."""
    from decode_bench import sync
    from llmc.runtime.engine import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    fresh = lambda off: [[(t + off + i) % 1000 for t in prompt] for i in range(batch)]  # noqa: E731

    def timed(prompts, p) -> float:
        sync()
        t = time.perf_counter()
        llm.generate(prompts, p)
        sync()
        return time.perf_counter() - t
    # warm-up (kernels, graphs) on prompts as distinct as the timed ones, so that it also runs every
    # prefill and mixed step shape the timed run will (prompts sharing a prefix would prefill it once)
    llm.generate(fresh(500), params)
    total = timed(fresh(1), params)  # no cache hit
    prefill = timed(fresh(700), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    if profile:  # one more run as the timed one, under the profiler (which slows it: not timed)
        from llmc.runtime.profiling import StepProfiler
        out, name = profile
        StepProfiler.around(f"{name}-b{batch}", out, lambda: llm.generate(fresh(300), params), new)
    return {"tok_s": batch * new / total, "prefill_ms": prefill * 1e3,
            "step_ms": (total - prefill) * 1e3 / max(new - 1, 1)}


def run_engines(a, art, row: dict, engine: dict, prompt, profile_root, name: str) -> dict:
    """`row` with the artifact's batch-1 / batch-16 decode and mixed-workload figures, engines built with
    `engine` (e.g. a K/V cache type); printed and appended to the partial results as it is measured."""
    from llmc.runtime.llm import LLM
    if not a.no_decode:
        llm = LLM(art, max_num_seqs=16, num_blocks=1024 * 16 // a.block_size, **engine)
        for batch in (1, 16):  # b1_tok_s, b1_prefill_ms, b1_step_ms, then batch 16's
            rate = decode_rate(llm, prompt, a.new, batch, (a.out, name) if a.profile_decode else None)
            row.update({f"b{batch}_{k}": v for k, v in rate.items()})
        del llm
    if a.full_batch:  # a full decode batch: its GEMMs run at the largest decode graph's rows
        n = a.full_batch
        llm = LLM(art, max_num_seqs=n, num_blocks=2 * n * -(-(len(prompt) + a.new) // a.block_size), **engine)
        rate = decode_rate(llm, prompt, a.new, n, (a.out, name) if a.profile_decode else None)
        row.update({f"full_{k}": v for k, v in rate.items()}, full_batch=n)
        del llm
    if a.mixed:
        from llmc.bench import bench
        if profile_root:  # LLMC_PROFILE_DIR: each config's engine profiles into a directory of its own
            os.environ["LLMC_PROFILE_DIR"] = str(Path(profile_root) / name)
        budget = {} if a.mixed_budget is None else {"max_num_batched_tokens": a.mixed_budget,
                                                    "max_prefill_tokens": 2048}
        mix = bench(art, "mixed", num_requests=a.mixed, max_num_seqs=min(a.mixed, 128),
                    longest_first=a.longest_first, **budget, **engine)
        row.update(mixed_out_tok_s=mix["out_tok_s"], mixed_gpu_busy=mix.get("gpu_busy"))
    print(json.dumps(row), flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    Path(a.out, "quant_decode_bench.partial.jsonl").open("a").write(json.dumps(row) + "\n")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--quant", default="rtn4,rtn8,fp8,w8a8")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--no-tune", action="store_true", help="compile without GEMM tuning (default tiles)")
    ap.add_argument("--no-batch-invariant", action="store_true",
                    help="compile the quantized models with --no-batch-invariant (int4 then takes the GEMV kernel at 1-4 "
                         "tokens per step)")
    ap.add_argument("--bf16-no-tune", action="store_true", help="the bf16 baseline untuned (cuBLAS for every GEMM)")
    ap.add_argument("--mixed", type=int, default=0, metavar="N",
                    help="also the mixed workload of `llmc bench` (N requests at once, max 128 sequences): out tok/s")
    ap.add_argument("--longest-first", action="store_true",
                    help="the mixed workload queued longest output first (as LLM.generate queues it)")
    ap.add_argument("--mixed-budget", type=int, default=None, metavar="TOKENS",
                    help="the mixed workload's budget for steps that carry decodes (steps without: 2,048 tokens)")
    ap.add_argument("--no-decode", action="store_true", help="skip the batch-1 and batch-16 decode figures")
    ap.add_argument("--full-batch", type=int, default=0, metavar="N",
                    help="also decode at batch N (e.g. 128, a full decode graph), as batch 16 is: tok/s and step ms")
    ap.add_argument("--profile-decode", action="store_true",
                    help="after each timed decode run, one more under the profiler: OUT/profile-CONFIG-bN.txt (wall "
                         "and GPU busy a step, top kernels)")
    ap.add_argument("--block-size", type=int, default=16, help="keys per K/V cache block (the engines')")
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    if a.profile_decode and not torch.cuda.is_available():
        ap.error("--profile-decode profiles CUDA kernels: it needs a GPU")
    from quant_quality import weight_and_cache
    configs = weight_and_cache(["bf16"] + a.quant.split(","), {"bf16": None, **FORMATS})
    import llmc
    from decode_bench import SHAPES, bandwidth, random_model
    work = Path(tempfile.mkdtemp())
    random_model(a.shape, work / "model")  # tiny-py's tokenizer beside it: SmoothQuant's calibration text
    cfg = json.loads((work / "model" / "config.json").read_text())
    bw = bandwidth()
    prompt = torch.randint(0, cfg["vocab_size"], (128,)).tolist()
    profile_root = os.environ.pop("LLMC_PROFILE_DIR", None)  # profiles the mixed runs only (see below)
    rows = []
    for name, fmt, kv in configs:  # each compiled for its cache type, so that its attention is tuned for it
        t = time.time()
        quant = None if fmt == "bf16" else FORMATS[fmt]
        if quant == "w8a8":
            quant = {"method": "smoothquant", "calib_samples": 1, "calib_len": 16}
        try:
            art = llmc.compile(work / "model", work / f"{name}.llmc", dtype="bfloat16", quant=quant,
                               kv_cache_dtype=kv or "auto",
                               tune=not a.no_tune and not (fmt == "bf16" and a.bf16_no_tune),
                               batch_invariant=not (a.no_batch_invariant and fmt != "bf16"))
        except Exception as e:  # a method that cannot run here is reported, the others go on
            rows.append({"config": name, "error": f"{type(e).__name__}: {e}"[:300]})
            print(json.dumps(rows[-1]), flush=True)
            continue
        compile_s = time.time() - t
        if (art.path / "tuning.json").exists():  # the kernel choices, for reading beside the figures
            Path(a.out).mkdir(parents=True, exist_ok=True)
            Path(a.out, f"{name}_tuning.json").write_text((art.path / "tuning.json").read_text())
        weights = sum(p.stat().st_size for p in art.path.glob("*.safetensors"))
        embed = cfg["vocab_size"] * cfg["hidden_size"] * 2  # the input table is gathered, not read, per step
        row = {"config": name, "compile_s": round(compile_s), "weights_GiB": weights / 2**30,
               "roofline_b1_tok_s": bw / (weights - embed)}
        engine = {"block_size": a.block_size, **({"kv_cache_dtype": kv} if kv else {})}
        rows.append(run_engines(a, art, row, engine, prompt, profile_root, name))
        del art
        for p in work.glob(f"{name}.llmc/*.safetensors"):  # the disk holds a few 8B artifacts at most
            p.unlink()
        # nothing of this config's engines left on the device for the next compile, whose token budget times
        # GEMMs of up to 8,192 rows; and the engine's profiled window, if one is open, written now
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    base = rows[0]
    for r in rows:
        if "error" in r:
            continue
        r["weights_x"] = r["weights_GiB"] / base["weights_GiB"]
        if "b1_tok_s" in r:
            r.update(b1_x=r["b1_tok_s"] / base["b1_tok_s"], b16_x=r["b16_tok_s"] / base["b16_tok_s"],
                     b1_of_roofline=r["b1_tok_s"] / r["roofline_b1_tok_s"])
        if "mixed_out_tok_s" in r:
            r["mixed_x"] = r["mixed_out_tok_s"] / base["mixed_out_tok_s"]
        if "full_tok_s" in r:
            r["full_x"] = r["full_tok_s"] / base["full_tok_s"]
    Path(a.out).mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    switches = {k: v for k, v in os.environ.items() if k.startswith("LLMC_")}  # e.g. LLMC_PDL=0
    Path(a.out, "quant_decode_bench.json").write_text(json.dumps({"shape": a.shape, "gpu": gpu, "env": switches,
                                                                  "bw_TBps": bw / 1e12, "rows": rows}, indent=1))
    print(f"# {a.shape}, {gpu}, copy bandwidth {bw / 1e12:.2f} TB/s")
    print(f"{'config':12s} {'GiB':>6s} {'x':>5s} {'b1 tok/s':>9s} {'x':>5s} {'roofl':>6s} {'b16 tok/s':>10s} {'x':>5s} "
          f"{'mixed tok/s':>11s} {'x':>5s}")
    for r in rows:
        if "error" in r:
            print(f"{r['config']:12s} error: {r['error'][:90]}")
            continue
        dec = (f"{r['b1_tok_s']:9.1f} {r['b1_x']:5.2f} {r['b1_of_roofline']:6.0%} {r['b16_tok_s']:10.1f} {r['b16_x']:5.2f}"
               if "b1_tok_s" in r else f"{'-':>9s} {'':5s} {'':6s} {'-':>10s} {'':5s}")
        mix = f"{r['mixed_out_tok_s']:11.1f} {r['mixed_x']:5.2f}" if "mixed_out_tok_s" in r else f"{'-':>11s}"
        print(f"{r['config']:12s} {r['weights_GiB']:6.2f} {r['weights_x']:5.2f} {dec} {mix}")
    for r in (r for r in rows if "full_tok_s" in r):
        print(f"{r['config']:12s} batch {r['full_batch']}: {r['full_tok_s']:9.1f} tok/s {r['full_x']:5.2f}x, "
              f"prefill {r['full_prefill_ms']:.2f} ms, step {r['full_step_ms']:.3f} ms")
    split = [r for r in rows if "b1_step_ms" in r]
    if split:
        print(f"{'config':12s} {'b1 prefill ms':>13s} {'b1 step ms':>10s} {'b16 prefill ms':>14s} {'b16 step ms':>11s}")
        for r in split:
            print(f"{r['config']:12s} {r['b1_prefill_ms']:13.2f} {r['b1_step_ms']:10.3f} {r['b16_prefill_ms']:14.2f} "
                  f"{r['b16_step_ms']:11.3f}")


if __name__ == "__main__":
    main()

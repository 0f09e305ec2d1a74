"""How far a quantized or narrower KV cache moves greedy decoding of the shipped model, on many prompts.

Each prompt is the opening of a held-out file (`llmc/models/data/heldout.txt`, never trained on).
The model runs in fp32 (--dtype) on the reference backend (--backend cuda: the generated
kernels); only the KV cache storage changes: int8 or fp8 (as shipped: each entry stored
relative to its block's first entry, with a scale per token and head), or K/V merely stored in
bf16 or fp16. Against the unquantized cache it reports
  - free-running agreement: positions where the greedy tokens are equal (a flipped near-tie
    changes the rest of that prompt, so this compounds);
  - prompts whose tokens are all equal, and the mean first divergence;
  - with --forced, teacher-forced agreement: the argmax at every position of the unquantized
    cache's own sequence, which measures the cache without compounding; and the KL divergence of
    the next-token distribution from the unquantized cache's there (mean and max over
    positions), which does not hinge on near-ties at all.

With --schemes it also emulates other 8-bit schemes (fake quantization in an fp32 cache: each
write requantizes the touched blocks from their exact values, so nothing is rounded twice unless
the scheme says "requantized"): scales per block and head (the int8 layout shipped before the
centred one), per token and head, per block, head and channel, asymmetric (a zero point), after
a Hadamard rotation of head_dim, with the block being filled kept exact; and K or V alone.

    python benchmarks/kv_cache_agreement.py --prompts 64 --tokens 64 [--forced] [--schemes [--only "A;B"]]
        [--backend cuda] [--dtype bfloat16] [--code-prompts] [--out DIR]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# tests.conftest makes a process that has not imported triton yet interpret its kernels (the CPU test
# suite's setting); a benchmark runs them compiled unless TRITON_INTERPRET says otherwise
os.environ.setdefault("TRITON_INTERPRET", "0")
from tests.conftest import CODE_PROMPTS  # noqa: E402  (the int8 test's 8 prompts)


def heldout_prompts(n: int, chars: int = 48) -> list[str]:
    """The first `chars` characters (cut at a line end where one falls past half) of n held-out files."""
    from llmc.models import builtin_dir
    text = (Path(builtin_dir("tiny-py")).parent / "data" / "heldout.txt").read_text()
    out = []
    for doc in text.split("<|endoftext|>"):
        doc = doc.lstrip("\n")
        if len(doc) < chars + 16:
            continue
        cut = doc.rfind("\n", chars // 2, chars)
        out.append(doc[: cut + 1 if cut > 0 else chars])
        if len(out) == n:
            break
    return out


def retyped(art, dtype: str):
    """The artifact with its KV caches stored in `dtype` (bf16 / f16): no quantization, only rounding."""
    from llmc.artifact import Artifact
    from llmc.ir.kv_layout import kv_cache_inputs
    g = art.graph.clone()
    for c in kv_cache_inputs(g):
        c.type = c.type.with_dtype(dtype)
    return Artifact(art.path, art.manifest, g)


# (K, V) scale granularity of each emulated scheme ("exact" keeps fp32), then options:
# "rotate" quantizes K and V after an orthonormal Hadamard rotation of head_dim (undone on read);
# "residual" keeps a block exact until its last slot is written (the block being filled stays fp32)
SCHEMES = {"block+head, no requantization": ("block", "block"), "K only (block+head)": ("block", "exact"),
           "V only (block+head)": ("exact", "block"), "token+head": ("token", "token"),
           "K channel, V block+head": ("channel", "block"), "K channel, V token": ("channel", "token"),
           "rotated, block+head": ("block", "block", "rotate"),
           "rotated, token+head": ("token", "token", "rotate"),
           "block+head, filling block exact": ("block", "block", "residual"),
           "rotated, block+head, filling block exact": ("block", "block", "rotate", "residual"),
           "K channel, V token, filling block exact": ("channel", "token", "residual"),
           "token+head, filling block exact": ("token", "token", "residual"),
           "asymmetric K channel, V token": ("channel", "token", "asym"),
           "asymmetric K channel, V token, filling block exact": ("channel", "token", "asym", "residual"),
           "asymmetric token+head": ("token", "token", "asym"),
           "asymmetric K channel, V channel": ("channel", "channel", "asym"),
           "asymmetric K channel, V block+head": ("channel", "block", "asym"),
           "asymmetric K channel, V token, requantized": ("channel", "token", "asym", "requant"),
           "asymmetric K channel, V channel, requantized": ("channel", "channel", "asym", "requant")}


def hadamard(d: int):
    """The orthonormal Sylvester-Hadamard matrix of size d (a power of two)."""
    import torch
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    assert h.shape[0] == d, "head_dim must be a power of two to rotate"
    return h / d ** 0.5


def fake_quant_writes(granularity: tuple[str, ...]):
    """A replacement for the reference cache write that stores int8-rounded values in a float cache."""
    import torch
    exact: dict = {}
    filled: dict = {}
    rotate, residual, asym, requant = ("rotate" in granularity, "residual" in granularity, "asym" in granularity,
                                       "requant" in granularity)

    def fq(vals, g):  # vals [blocks, BS, H, D]
        if g == "exact":
            return vals
        if rotate:
            h = hadamard(vals.shape[-1])
            vals = vals @ h
        dims = {"block": (1, 3), "token": (3,), "channel": (1,)}[g]
        if asym:  # a zero point: 255 levels between the group's min and max
            lo, hi = vals.amin(dim=dims, keepdim=True), vals.amax(dim=dims, keepdim=True)
            s = ((hi - lo) / 255.0).clamp_min(1e-12)
            out = ((vals - lo) / s).round() * s + lo
        else:
            s = (vals.abs().amax(dim=dims, keepdim=True) / 127.0).clamp_min(1e-12)
            out = (vals / s).round().clamp(-127, 127) * s
        return out @ h.T if rotate else out

    def write(cache, scale, which, new, slots):
        NB, BS = cache.shape[1], cache.shape[2]
        full = exact.setdefault((cache.data_ptr(), which), torch.zeros(cache.shape[1:], dtype=torch.float32))
        keep = slots >= 0
        slots, new = slots[keep], new[keep]
        if slots.numel() == 0:
            return
        blocks = slots // BS
        done = filled.setdefault((cache.data_ptr(), which), torch.zeros(NB, dtype=torch.bool))
        if requant:  # the blocks' earlier entries are known only as stored: requantizing rounds them twice
            touched = torch.unique(blocks)
            full[touched] = cache[which][touched].float()
        full[blocks[slots % BS == 0]] = 0.0  # a reused block starts afresh
        done[blocks[slots % BS == 0]] = False
        done[blocks[slots % BS == BS - 1]] = True
        full.view(NB * BS, *cache.shape[3:])[slots] = new.float()
        touched = torch.unique(blocks)
        vals = fq(full[touched], granularity[which])
        if residual:
            vals = torch.where(done[touched][:, None, None, None], vals, full[touched])
        cache[which][touched] = vals.to(cache.dtype)
    return write


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--forced", action="store_true", help="also teacher-forced agreement and KL divergence")
    ap.add_argument("--schemes", action="store_true", help="also emulate other 8-bit schemes (see above)")
    ap.add_argument("--only", default=None, help="with --schemes: emulate only these schemes (names separated by ;)")
    ap.add_argument("--backend", default="reference", help="reference (CPU) or cuda (the generated kernels)")
    ap.add_argument("--dtype", default="float32", help="the model's dtype (float32, bfloat16, float16)")
    ap.add_argument("--code-prompts", action="store_true", help="the int8 test's 8 prompts instead of held-out files")
    ap.add_argument("--no-fp8", action="store_true", help="skip the fp8 cache (it needs compute capability 8.9+)")
    ap.add_argument("--skip-shipped", action="store_true", help="skip the int8 / bf16 / fp16 runs")
    ap.add_argument("--block-size", type=int, default=16, help="keys per cache block (a block's centre is its first)")
    ap.add_argument("--out", default=None, help="write kv_cache_agreement.json here")
    a = ap.parse_args()
    import torch

    import llmc
    from llmc.runtime.executor import StepBatch, StepInput, make_executor
    from llmc.runtime.llm import LLM, SamplingParams
    prompts = CODE_PROMPTS if a.code_prompts else heldout_prompts(a.prompts)
    art = llmc.compile("builtin:tiny-py", Path(tempfile.mkdtemp()) / "tiny-py.llmc", dtype=a.dtype)
    params = SamplingParams(temperature=0, max_tokens=a.tokens, ignore_eos=True)
    per = -(-(a.tokens + 64) // a.block_size)  # blocks a sequence (prompts of up to 64 tokens)
    blocks = per * len(prompts) + 1024 // a.block_size

    from llmc.ir import paged_attention as pa

    @contextlib.contextmanager
    def emulating(granularity):
        """The reference cache write replaced by an emulated scheme's (None: as it is)."""
        if granularity is None:
            yield
            return
        real, pa._write = pa._write, fake_quant_writes(granularity)
        try:
            yield
        finally:
            pa._write = real

    def run(artifact, kv_dtype=None, granularity=None):
        t = time.time()
        kw = {"kv_cache_dtype": kv_dtype} if kv_dtype else {}
        with emulating(granularity):
            outs = LLM(artifact, num_blocks=blocks, block_size=a.block_size, max_num_seqs=16, backend=a.backend,
                       **kw).generate(prompts, params)
        print(f"  generated in {time.time() - t:.0f}s", flush=True)
        return [o.token_ids for o in outs]

    def forced(artifact, kv_dtype=None, granularity=None):
        """Log-probabilities at every position of the unquantized cache's sequences, one token a step."""
        tok, out = art.tokenizer(), []
        with emulating(granularity):
            r = make_executor(artifact.graph, a.backend, num_blocks=blocks, block_size=a.block_size,
                              kv_cache_dtype=kv_dtype or "auto")
            for i, (p, gen) in enumerate(zip(prompts, ref)):
                ids = tok.encode(p, add_special_tokens=False)
                seq, bt = ids + gen, list(range(per * i, per * i + per))
                # copies: a step's fp32 logits may alias the step graph's output buffer
                rows_ = [r.execute(StepBatch([StepInput(ids, 0, bt)])).logits[0].clone()]
                rows_ += [r.execute(StepBatch([StepInput([seq[j]], j, bt)])).logits[0].clone() for j in range(len(ids), len(seq) - 1)]
                out.append(torch.log_softmax(torch.stack(rows_).float().cpu(), dim=-1))
        return out

    print(f"{len(prompts)} prompts x {a.tokens} tokens; {a.dtype} model, against its unquantized cache", flush=True)
    ref = run(art)
    ref_lp = forced(art) if a.forced else None
    rows = {}
    runs = [("int8", art, "int8", None), ("fp8", art, "fp8", None)]
    if a.backend == "reference":  # the kernels take a float cache only in the model's dtype
        runs += [("bf16 storage", retyped(art, "bf16"), None, None), ("fp16 storage", retyped(art, "f16"), None, None)]
        if a.dtype != "float32":  # how far a cache finer than the model's own dtype moves it
            runs.append(("fp32 storage", retyped(art, "f32"), None, None))
    if a.schemes:
        runs += [(f"emulated: {name}", art, None, g) for name, g in SCHEMES.items()
                 if a.only is None or name in a.only.split(";")]
    if a.skip_shipped:
        runs = [r for r in runs if r[0].startswith("emulated")]
    if a.no_fp8:
        runs = [r for r in runs if r[0] != "fp8"]
    for name, artifact, kv_dtype, granularity in runs:
        print(name, flush=True)
        got = run(artifact, kv_dtype, granularity)
        same = sum(x == y for r, g in zip(ref, got) for x, y in zip(r, g))
        first = [next((j for j, (x, y) in enumerate(zip(r, g)) if x != y), len(r)) for r, g in zip(ref, got)]
        rows[name] = {"free_running": same / (len(prompts) * a.tokens),
                      "prompts_identical": sum(f == a.tokens for f in first),
                      "mean_first_divergence": sum(first) / len(first)}
        if a.forced:
            lp = forced(artifact, kv_dtype, granularity)
            hits = sum(int((x.argmax(-1) == torch.tensor(g)).sum()) for x, g in zip(lp, ref))
            kl = torch.cat([(r_.exp() * (r_ - x)).sum(-1) for r_, x in zip(ref_lp, lp)])
            rows[name].update(teacher_forced=hits / (len(prompts) * a.tokens), mean_kl=float(kl.mean()),
                              max_kl=float(kl.max()))
    print(f"\n{'KV cache':56s} {'free-running':>12s} {'identical prompts':>18s} {'mean 1st div.':>13s} "
          f"{'teacher-forced':>15s} {'mean KL':>9s} {'max KL':>9s}")
    for name, r in rows.items():
        tf = (f"{r['teacher_forced']:15.4f} {r['mean_kl']:9.2e} {r['max_kl']:9.2e}" if "teacher_forced" in r
              else f"{'-':>15s} {'-':>9s} {'-':>9s}")
        print(f"{name:56s} {r['free_running']:12.4f} {r['prompts_identical']:>10d} / {len(prompts):<5d} "
              f"{r['mean_first_divergence']:13.1f} {tf}")
    if a.out:
        Path(a.out, f"kv_cache_agreement_bs{a.block_size}.json").write_text(json.dumps(
            {"prompts": len(prompts), "tokens": a.tokens, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

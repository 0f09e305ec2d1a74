"""How far a quantized or narrower KV cache moves greedy decoding of the shipped model, on many prompts.

Each prompt is the opening of a held-out file (`llmc/models/data/heldout.txt`, never trained on).
The model runs in fp32 on the reference backend; only the KV cache storage changes: int8 (as
shipped: each entry stored relative to its block's first entry, with a scale per token and head),
or K/V merely stored in bf16 or fp16. Against the fp32 cache it reports
  - free-running agreement: positions where the greedy tokens are equal (a flipped near-tie
    changes the rest of that prompt, so this compounds);
  - prompts whose tokens are all equal, and the mean first divergence;
  - teacher-forced agreement (int8 only, --forced): the argmax at every position of the fp32
    cache's own sequence, which measures the cache without compounding.

With --schemes it also emulates other 8-bit schemes (fake quantization in an fp32 cache: each
write requantizes the touched blocks from their exact values, so there is no double rounding
either): scales per block and head (the int8 layout shipped before the centred one, minus its
requantization), per token and head, per block, head and channel for K, asymmetric (a zero
point), after a Hadamard rotation of head_dim, with a block kept exact until it fills, or with
the stored entries requantized as a block's range grows; and each of K or V quantized alone.

    python benchmarks/kv_cache_agreement.py --prompts 64 --tokens 64 [--forced] [--schemes] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


CODE_PROMPTS = ["def fibonacci(n):", "import os\n\n", "class Stack:\n    def __init__(self):", "for i in range(",
                "with open(path) as f:", "    def __repr__(self):", "try:\n    import json", "return sorted("]


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
    from llmc.passes.paged_kv import kv_cache_inputs
    from llmc.runtime.artifact import Artifact
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
    ap.add_argument("--forced", action="store_true", help="also teacher-forced agreement of the int8 cache")
    ap.add_argument("--schemes", action="store_true", help="also emulate other 8-bit schemes (see above)")
    ap.add_argument("--only", default=None, help="with --schemes: emulate only the schemes whose names contain one of these (comma-separated)")
    ap.add_argument("--backend", default="reference", help="reference (CPU) or cuda (the generated kernels)")
    ap.add_argument("--code-prompts", action="store_true", help="the int8 test's 8 prompts instead of held-out files")
    ap.add_argument("--skip-shipped", action="store_true", help="skip the int8 / bf16 / fp16 runs")
    ap.add_argument("--out", default=None, help="write kv_cache_agreement.json here")
    a = ap.parse_args()
    import llmc
    from llmc.runtime.engine import LLM, SamplingParams
    from llmc.runtime.model_runner import ModelRunner, StepInput
    prompts = CODE_PROMPTS if a.code_prompts else heldout_prompts(a.prompts)
    art = llmc.compile("builtin:tiny-py", Path(tempfile.mkdtemp()) / "tiny-py.llmc")
    params = SamplingParams(temperature=0, max_tokens=a.tokens, ignore_eos=True)
    blocks = (a.tokens + 64) // 16 * len(prompts) + 64

    def run(artifact, **kw):
        t = time.time()
        outs = LLM(artifact, num_blocks=blocks, max_num_seqs=16, backend=a.backend, **kw).generate(prompts, params)
        print(f"  generated in {time.time() - t:.0f}s", flush=True)
        return [o.token_ids for o in outs]

    print(f"{len(prompts)} held-out prompts x {a.tokens} tokens; fp32 cache", flush=True)
    ref = run(art)
    rows = {}
    runs = [("int8", lambda: run(art, kv_cache_dtype="int8")), ("bf16 storage", lambda: run(retyped(art, "bf16"))),
            ("fp16 storage", lambda: run(retyped(art, "f16")))]
    if a.schemes:
        from llmc.ir import paged_attention as pa

        def emulated(granularity):
            real, pa._write = pa._write, fake_quant_writes(granularity)
            try:
                return run(art)
            finally:
                pa._write = real
        runs += [(f"emulated: {name}", lambda g=g: emulated(g)) for name, g in SCHEMES.items()
                 if a.only is None or any(w in name for w in a.only.split(","))]
    if a.skip_shipped:
        runs = [r for r in runs if r[0].startswith("emulated")]
    for name, make in runs:
        print(name, flush=True)
        got = make()
        same = sum(x == y for r, g in zip(ref, got) for x, y in zip(r, g))
        first = [next((j for j, (x, y) in enumerate(zip(r, g)) if x != y), len(r)) for r, g in zip(ref, got)]
        rows[name] = {"free_running": same / (len(prompts) * a.tokens),
                      "prompts_identical": sum(f == a.tokens for f in first),
                      "mean_first_divergence": sum(first) / len(first)}
    if a.forced and "int8" in rows:
        tok = art.tokenizer()
        r8 = ModelRunner(art.graph, num_blocks=blocks, kv_cache_dtype="int8", backend=a.backend)
        same = 0
        per = (a.tokens + 64) // 16
        for i, (p, out) in enumerate(zip(prompts, ref)):
            ids = tok.encode(p, add_special_tokens=False)
            seq, bt = ids + out, list(range(per * i, per * i + per))
            preds = [int(r8.execute([StepInput(ids, 0, bt)])[0].argmax())]
            for j in range(len(ids), len(seq) - 1):
                preds.append(int(r8.execute([StepInput([seq[j]], j, bt)])[0].argmax()))
            same += sum(x == y for x, y in zip(preds, out))
        rows["int8"]["teacher_forced"] = same / (len(prompts) * a.tokens)
    print(f"\n{'KV cache':40s} {'free-running':>12s} {'identical prompts':>18s} {'mean 1st divergence':>20s} "
          f"{'teacher-forced':>15s}")
    for name, r in rows.items():
        tf = f"{r['teacher_forced']:.4f}" if "teacher_forced" in r else "-"
        print(f"{name:40s} {r['free_running']:12.4f} {r['prompts_identical']:>10d} / {len(prompts):<5d} "
              f"{r['mean_first_divergence']:20.1f} {tf:>15s}")
    if a.out:
        Path(a.out, "kv_cache_agreement.json").write_text(json.dumps(
            {"prompts": len(prompts), "tokens": a.tokens, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

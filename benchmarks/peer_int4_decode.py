"""The int4 peer: gpt-fast's recipe (every linear, the LM head included, int4 g128 with zero points through
torch's tinygemm kernel, `aten._weight_int4pack_mm`; Hugging Face Llama with a static K/V cache, the decode step
compiled with CUDA graphs) against the same model in bf16, on the same random weights, in one process.

    python3 benchmarks/peer_int4_decode.py --shape 8b --new 128 --batches 1,16 --out OUT   # GPU

Prints tok/s for bf16 and int4 at each batch and their ratio, the int4 linear's error against its dequantized
weight, and writes OUT/peer_int4_decode.json. Run it beside `quant_decode_bench.py --quant rtn4-small` (the same
recipe in llmc: int4 g128 everywhere, the LM head too) on the same machine to compare the two ratios.
On a CPU (`--shape tiny`) it runs eagerly through the CPU form of the same kernel, as a check of the wiring.
"""
from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_bench import SHAPES as BENCH_SHAPES  # noqa: E402

# llmc's benchmark shapes (random weights: speed only), and a tiny one for a CPU check
SHAPES = {**BENCH_SHAPES, "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=1024,
                                       tie_word_embeddings=False, head_dim=64, max_position_embeddings=4096)}


class Int4Linear(nn.Module):
    """y = x W.T with W in int4 groups along K, each with a bf16 scale and zero (min-max, asymmetric, as
    gpt-fast quantizes): W = (q - 8) * scale + zero, q in 0..15, in tinygemm's packed layout."""

    def __init__(self, lin: nn.Linear, group: int = 128, inner_k_tiles: int = 8, keep_reference: bool = False):
        super().__init__()
        w = lin.weight.detach().float()
        n, k = w.shape
        wg = w.reshape(n, k // group, group)
        lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
        scale = ((hi - lo) / 15).clamp(min=1e-6)
        q = ((wg - lo) / scale).round().clamp(0, 15).to(torch.int32).reshape(n, k)
        zero = lo + 8 * scale
        self.group, self.out_features = group, n
        # [K / group, N, 2]: (scale, zero) per group and column
        self.register_buffer("scales_zeros", torch.stack([scale.reshape(n, -1), zero.reshape(n, -1)], -1)
                             .transpose(0, 1).contiguous().to(torch.bfloat16))
        self.cuda_kernel = w.is_cuda
        if self.cuda_kernel:
            packed = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
            self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack(packed, inner_k_tiles))
        else:
            self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, inner_k_tiles))
        # the dequantized weight in fp32, for check(): kept only where asked, as it is 8x the codes' bytes
        self.reference = (((q.reshape(n, k // group, group) - 8) * scale + zero).reshape(n, k)
                          if keep_reference else None)

    def forward(self, x):
        x2 = x.reshape(-1, x.shape[-1])
        mm = torch.ops.aten._weight_int4pack_mm if self.cuda_kernel else torch.ops.aten._weight_int4pack_mm_for_cpu
        return mm(x2, self.packed, self.group, self.scales_zeros).reshape(*x.shape[:-1], self.out_features)

    def check(self) -> float:
        """Relative error of the kernel against x @ dequantized(W).T in fp32 (bf16 rounding only)."""
        x = torch.randn(4, self.reference.shape[1], device=self.packed.device, dtype=torch.bfloat16)
        ref = x.float() @ self.reference.T
        return ((self.forward(x).float() - ref).norm() / ref.norm()).item()


def quantize(model: nn.Module, group: int) -> tuple[int, float]:
    """Every nn.Linear whose input dim the group divides, in place: (count, worst check error)."""
    count, worst = 0, 0.0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.in_features % group == 0:
                q = Int4Linear(child, group, keep_reference=count < 8)  # a few layers are enough to check
                if q.reference is not None:
                    worst = max(worst, q.check())
                    q.reference = None
                setattr(parent, name, q)
                count += 1
    return count, worst


def decode_rate(model, cfg, batch: int, prompt: int, new: int, compiled: bool) -> float:
    """tok/s of `new` greedy steps after a `prompt`-token prefill at `batch` sequences (the steps only)."""
    from transformers import StaticCache
    dev = next(model.parameters()).device
    ids = torch.randint(0, cfg.vocab_size, (batch, prompt), device=dev)
    cache = StaticCache(config=cfg, max_cache_len=prompt + new + 8)
    # older transformers name the cache argument past_key_values
    arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def step(tok, pos):
        return model(input_ids=tok, position_ids=pos[None].expand(tok.shape[0], -1), cache_position=pos,
                     use_cache=True, **{arg: cache}).logits

    run = torch.compile(step, mode="reduce-overhead", fullgraph=True) if compiled else step
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def gen() -> float:
        cache.reset()
        tok = step(ids, torch.arange(prompt, device=dev))[:, -1].argmax(-1, keepdim=True)
        sync()
        t = time.perf_counter()
        for i in range(new):
            if compiled:
                torch.compiler.cudagraph_mark_step_begin()
            tok = run(tok, torch.tensor([prompt + i], device=dev))[:, -1].argmax(-1, keepdim=True).clone()
        sync()
        return time.perf_counter() - t

    gen()  # compiles and captures
    gen()
    return batch * new / gen()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM
    cuda = torch.cuda.is_available()
    cfg = LlamaConfig(**SHAPES[a.shape])

    def build() -> nn.Module:  # the same random weights each time
        torch.manual_seed(0)
        with torch.device("cuda" if cuda else "cpu"):
            return LlamaForCausalLM(cfg).to(torch.bfloat16).eval()

    batches = [int(b) for b in a.batches.split(",")]
    res = {"shape": a.shape, "gpu": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
           "prompt": a.prompt, "new": a.new, "bf16": {}, "int4": {}}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    def record(kind: str, batch: int, rate: float) -> None:
        res[kind][str(batch)] = rate
        ratio = f" ({rate / res['bf16'][str(batch)]:.2f}x bf16)" if kind == "int4" and str(batch) in res["bf16"] else ""
        print(f"{kind} batch {batch}: {rate:.1f} tok/s{ratio}", flush=True)
        (out / "peer_int4_decode.json").write_text(json.dumps(res, indent=1))

    with torch.inference_mode():
        models = {"bf16": build(), "int4": build()}
        t = time.time()
        res["int4_linears"], res["int4_check_rel_err"] = quantize(models["int4"], a.group_size)
        print(f"int4: {res['int4_linears']} linears in {time.time() - t:.0f} s, kernel against dequantized W: "
              f"relative error {res['int4_check_rel_err']:.2e}", flush=True)
        if res["int4_check_rel_err"] > 2e-2:
            raise SystemExit("the int4 kernel does not compute the dequantized weight's product: not timed")
        if cuda:
            torch.cuda.empty_cache()
        for b in batches:  # each batch's pair back to back, so that a time limit cuts whole pairs
            for kind, model in models.items():
                record(kind, b, decode_rate(model, cfg, b, a.prompt, a.new, compiled=cuda))
                torch._dynamo.reset()
    print("batch  bf16 tok/s  int4 tok/s  x bf16")
    for b in batches:
        f, q = res["bf16"][str(b)], res["int4"][str(b)]
        print(f"{b:5d} {f:11.1f} {q:11.1f} {q / f:7.2f}")


if __name__ == "__main__":
    main()

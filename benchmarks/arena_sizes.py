"""The static buffer plan's arena for a graph of a model shape's widths, with the SwiGLU product in the gate/up
projection's epilogue (the default pipeline) and unfused, and under each placement order (CPU, no weights run).

    python3 benchmarks/arena_sizes.py --shape 1b --tokens 1,64,2048

A random model of the shape's widths with `--layers` layers and a small vocabulary is compiled on the CPU
(weights in bf16), then `Plan(graph, "meta")` lays out its intermediates for each token count.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import llmc  # noqa: E402
import llmc.codegen.buffers as buffers  # noqa: E402
from decode_bench import SHAPES  # noqa: E402  (the shapes' widths, beside this script)
from llmc.codegen.lower import Plan  # noqa: E402
from llmc.ir.sharding import unfuse_linear_silu_mul  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", default="1,64,2048", help="token counts, comma-separated")
    args = ap.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM
    path = Path(tempfile.mkdtemp()) / "model"
    cfg = LlamaConfig(**{**SHAPES[args.shape], "num_hidden_layers": args.layers, "vocab_size": 512,
                         "max_position_embeddings": 8192, "tie_word_embeddings": True})
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    fused = llmc.compile(path, None, dtype="bfloat16").graph
    unfused = fused.clone()
    unfuse_linear_silu_mul(unfused)
    orders = buffers.PLACEMENT_ORDERS
    print(f"{args.shape} widths, {args.layers} layers: arena bytes (lower bound: the most bytes alive at one step)")
    print("| tokens | graph | largest first | best of the placement orders | lower bound |")
    print("|---|---|---|---|---|")
    for t in (int(x) for x in args.tokens.split(",")):
        env = {"T": t, "N": 2, "L": 2}
        for name, g in (("SwiGLU in the epilogue", fused), ("unfused", unfused)):
            row = []
            for some in (orders[:1], orders):
                buffers.PLACEMENT_ORDERS = some
                row.append(Plan(g, "meta").buffers.stats(env))
            buffers.PLACEMENT_ORDERS = orders
            print(f"| {t} | {name} | {row[0]['arena_bytes']:,} | {row[1]['arena_bytes']:,} | "
                  f"{row[1]['peak_live_bytes']:,} |")


if __name__ == "__main__":
    main()

"""Weights-file size of quantized artifacts at a model shape, against the dense one, without building
the whole model: the shape is compiled with `--layers` decoder layers (default 2; random weights), and
the full model's bytes follow exactly, since every decoder layer stores the same tensors:
bytes(L) = bytes outside the layers + L x bytes of one layer (read from the artifact's safetensors).

    python3 benchmarks/quant_size.py [--shape 8b] [--layers 2] [--configs bf16,rtn4,rtn4-head,rtn4-head-emb8]
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

CONFIGS = {
    "bf16": None,
    "rtn4": {"method": "rtn", "wbits": 4},
    "rtn4-head": {"method": "rtn", "wbits": 4, "skip": []},
    "rtn4-head-emb8": {"method": "rtn", "wbits": 4, "skip": [], "embeddings": "int8"},
}


def tensor_bytes(art_path: Path) -> dict[str, int]:
    from safetensors import safe_open
    out = {}
    for f in sorted(art_path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():
                t = sf.get_slice(k)
                n = 1
                for d in t.get_shape():
                    n *= d
                out[k] = n * {"BF16": 2, "F16": 2, "F32": 4, "U8": 1, "I8": 1, "I32": 4, "F8_E4M3": 1}[t.get_dtype()]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    import llmc
    from decode_bench import SHAPES
    from transformers import LlamaConfig, LlamaForCausalLM
    shape = dict(SHAPES[a.shape])
    full_layers = shape["num_hidden_layers"]
    shape["num_hidden_layers"] = a.layers
    work = Path(tempfile.mkdtemp())
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**shape, architectures=["LlamaForCausalLM"])).to(torch.bfloat16) \
        .save_pretrained(str(work / "m"))
    rows = []
    for name in a.configs.split(","):
        art = llmc.compile(work / "m", work / f"{name}.llmc", dtype="bfloat16", quant=CONFIGS[name], tune=False)
        tb = tensor_bytes(art.path)
        per_layer = [sum(b for k, b in tb.items() if re.search(rf"\.layers\.{i}\.", k)) for i in range(a.layers)]
        assert len(set(per_layer)) == 1, per_layer  # identical layers: the extrapolation is exact
        outside = sum(tb.values()) - sum(per_layer)
        total = outside + full_layers * per_layer[0]
        rows.append({"config": name, "bytes": total, "GiB": total / 2**30, "outside_layers_GiB": outside / 2**30,
                     "layer_MiB": per_layer[0] / 2**20})
        for p in art.path.glob("*.safetensors"):
            p.unlink()
    for r in rows:
        r["x_bf16"] = r["bytes"] / rows[0]["bytes"]
    Path(a.out).mkdir(parents=True, exist_ok=True)
    Path(a.out, f"quant_size-{a.shape}.json").write_text(json.dumps(rows, indent=1))
    print(f"# {a.shape} ({full_layers} layers, extrapolated from {a.layers})")
    print(f"{'config':16s} {'GiB':>7s} {'x bf16':>7s} {'outside layers GiB':>19s} {'per layer MiB':>14s}")
    for r in rows:
        print(f"{r['config']:16s} {r['GiB']:7.3f} {r['x_bf16']:7.4f} {r['outside_layers_GiB']:19.3f} {r['layer_MiB']:14.2f}")


if __name__ == "__main__":
    main()

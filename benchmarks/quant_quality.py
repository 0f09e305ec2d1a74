"""Quality of every quantization method on the shipped tiny-py: perplexity on the held-out split,
through llmc's own engine (`llmc.evaluate.perplexity`, the code path of `llmc eval`), against the
unquantized model compiled the same way.

Calibration (gptq, awq, smoothquant, mixed) reads the second half of the held-out text; the
perplexity is measured on its first `--max-tokens` tokens, so the two never overlap.

    python3 benchmarks/quant_quality.py [--dtype bfloat16] [--max-tokens 20000] [--backend reference]
        [--only rtn4,gptq4] [--out DIR]

A config name may end in `+kvint8` or `+kvfp8`: that config's engine on a K/V cache of that type
(`kv_cache_dtype`), e.g. `--only fp8,fp8+kvfp8,bf16+kvfp8`.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONFIGS = {
    "bf16": None,
    "rtn4": {"method": "rtn", "wbits": 4},
    "gptq4": {"method": "gptq", "wbits": 4},
    "gptq4-actorder": {"method": "gptq", "wbits": 4, "act_order": True},
    "awq4": {"method": "awq", "wbits": 4},
    "rtn8": {"method": "rtn", "wbits": 8},
    "gptq8": {"method": "gptq", "wbits": 8},
    "awq8": {"method": "awq", "wbits": 8},
    "smoothquant": {"method": "smoothquant"},
    "fp8": {"method": "fp8"},
    "mixed4.5": {"method": "mixed", "bits_budget": 4.5},
    "mixed6": {"method": "mixed", "bits_budget": 6.0},
    # the LM head in int4 too (`--quant-lm-head`), and the embedding table in int8 rows (`--quant-embeddings int8`)
    "rtn4-head": {"method": "rtn", "wbits": 4, "skip": []},
    "gptq4-head": {"method": "gptq", "wbits": 4, "skip": []},
    "gptq4-small": {"method": "gptq", "wbits": 4, "skip": [], "embeddings": "int8"},
}

KV_SUFFIXES = ("int8", "fp8")  # a config name's `+kv...` suffix: the K/V cache type its engine runs on


def weight_and_cache(names: list[str], formats) -> list[tuple[str, str, str]]:
    """(name, weight format, cache type or "") of each config name `FORMAT[+kvint8|+kvfp8]`; SystemExit naming
    the unknown ones (a weight format not in `formats`, a cache type not in KV_SUFFIXES)."""
    split = [(n, *n.partition("+kv")[::2]) for n in names]
    unknown = [n for n, fmt, kv in split if fmt not in formats or kv not in ("", *KV_SUFFIXES)]
    if unknown:
        raise SystemExit(f"unknown configs {unknown}: use {', '.join(formats)}, each optionally "
                         f"{' or '.join('+kv' + k for k in KV_SUFFIXES)}")
    return split


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-tokens", type=int, default=20000)
    ap.add_argument("--backend", default="reference")
    ap.add_argument("--device", default=None)
    ap.add_argument("--only", default=None, help="comma-separated config names (bf16 always runs)")
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    import llmc
    from llmc.evaluate import dataset_text, perplexity
    text = dataset_text("builtin:heldout")
    names = ["bf16"] + [n for n in (a.only.split(",") if a.only else CONFIGS) if n != "bf16"]
    configs = weight_and_cache(names, CONFIGS)
    work = Path(tempfile.mkdtemp())
    rows = []
    for name, fmt, kv in configs:
        t = time.time()
        art = llmc.compile("builtin:tiny-py", work / f"{name}.llmc", dtype=a.dtype, quant=CONFIGS[fmt], tune=False)
        compile_s = time.time() - t
        opts = {"backend": a.backend, **({"device": a.device} if a.device else {}),
                **({"kv_cache_dtype": kv} if kv else {})}
        r = perplexity(art, text, max_tokens=a.max_tokens, **opts)
        plan = art.graph.meta.get("quant_plan") or {}
        weights = sum(p.stat().st_size for p in art.path.glob("*.safetensors"))
        rows.append({"config": name, "perplexity": r.perplexity, "tokens": r.tokens, "avg_bits": plan.get("avg_bits"),
                     "weights_bytes": weights, "compile_s": round(compile_s, 1)})
        print(json.dumps(rows[-1]), flush=True)
    base = rows[0]["perplexity"]
    by = {r["config"]: r for r in rows}
    for r in rows:
        r["vs_bf16"] = r["perplexity"] / base - 1
    rtn = by.get("rtn4", {}).get("perplexity")
    for m in ("gptq4", "awq4"):
        if rtn and m in by and rtn > base:
            by[m]["recovered_of_rtn4_increase"] = 1 - (by[m]["perplexity"] - base) / (rtn - base)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    Path(a.out, "quant_quality.json").write_text(json.dumps({"dtype": a.dtype, "max_tokens": a.max_tokens,
                                                             "backend": a.backend, "rows": rows}, indent=1))
    print(f"{'config':12s} {'ppl':>9s} {'vs bf16':>8s} {'avg bits':>8s} {'recovers':>8s} {'MiB':>7s}")
    for r in rows:
        rec = r.get("recovered_of_rtn4_increase")
        print(f"{r['config']:12s} {r['perplexity']:9.4f} {100 * r['vs_bf16']:+7.2f}% "
              f"{r['avg_bits'] or 16:8.3f} {'' if rec is None else f'{100 * rec:7.0f}%':>8s} "
              f"{r['weights_bytes'] / 2**20:7.1f}")


if __name__ == "__main__":
    main()

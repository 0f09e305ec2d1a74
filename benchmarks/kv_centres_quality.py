"""What the block centres of a quantized K/V cache buy in quality: held-out perplexity of the shipped tiny-py
(bf16, reference backend) over int8 and fp8 caches as shipped (each entry its block's first entry + code x a
per-token-and-head scale) and over the same caches without centres (entry = code x scale), emulated by
swapping the golden model's cache write.

The decode kernel over a centre-free cache runs at 0.74-0.82x a bf16 cache's time where the centred one takes
1.06-1.13x (benchmarks/fp8_decode_lab.py, RESULTS 2026-12-06, evening); this measures the other side.

    python3 benchmarks/kv_centres_quality.py [--max-tokens 20000] [--block-size 16] [--centred-only] [--out DIR]

`--block-size` sets the engine's cache blocks (a block's centre is its first entry, so longer blocks hold
entries further from their centre); `--centred-only` skips the centre-free caches.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _write_without_centres(cache, scale, which, new, slots) -> None:
    """The golden model's `_write` with every block centre 0: each vector stored as code x its own scale."""
    from llmc.ir import paged_attention as pa
    if not pa.quantized(cache):
        return _ORIGINAL(cache, scale, which, new, slots)
    BS, H, D = cache.shape[2:]
    keep = slots >= 0
    slots, new = slots[keep], new[keep]
    if slots.numel() == 0:
        return None
    blocks, offs = slots // BS, slots % BS
    qmax, lay = pa.QMAX[cache.dtype], pa.scale_layout(D, BS)
    x = new.float()
    scale[blocks[offs == 0], :, lay["v_zero" if which else "k_zero"]] = 0
    s = (x.abs().amax(dim=-1) / qmax).clamp_min(pa.tiny(scale.dtype)).to(scale.dtype)
    cache[(which, blocks, offs)] = pa._to_q(x / s[..., None].float(), cache.dtype, qmax)
    col = lay["v_token" if which else "k_token"].start + offs
    scale[blocks[:, None], torch.arange(H, device=x.device)[None, :], col[:, None]] = s
    return None


_ORIGINAL = None


def main() -> None:
    global _ORIGINAL
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=20000)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--centred-only", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import llmc
    from llmc.evaluate import dataset_text, perplexity
    from llmc.ir import paged_attention as pa
    _ORIGINAL = pa._write
    text = dataset_text("builtin:heldout")
    art = llmc.compile("builtin:tiny-py", Path(tempfile.mkdtemp()) / "bf16.llmc", dtype="bfloat16", tune=False)
    rows = []
    for kv, centres in ((None, True), ("int8", True), ("int8", False), ("fp8", True), ("fp8", False)):
        if a.centred_only and not centres:
            continue
        pa._write = _ORIGINAL if centres else _write_without_centres
        r = perplexity(art, text, max_tokens=a.max_tokens, backend="reference", block_size=a.block_size,
                       **({"kv_cache_dtype": kv} if kv else {}))
        rows.append({"cache": kv or "bf16", "centres": centres if kv else None, "block_size": a.block_size,
                     "perplexity": r.perplexity, "tokens": r.tokens})
        print(json.dumps(rows[-1]), flush=True)
    pa._write = _ORIGINAL
    base = rows[0]["perplexity"]
    print(f"\n{'cache':6s} {'centres':8s} {'perplexity':>10s} {'vs bf16':>8s}")
    for r in rows:
        print(f"{r['cache']:6s} {str(r['centres']):8s} {r['perplexity']:10.4f} {100 * (r['perplexity'] / base - 1):+7.3f}%")
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        Path(a.out, f"kv_centres_quality_bs{a.block_size}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

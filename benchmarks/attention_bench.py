"""Paged attention kernels on the GPU against their hardware bounds, every launch the compile may choose.

Decode (one new token per sequence): microseconds per call and the K/V bytes read per second, as a share of
the device's copy bandwidth. Prefill (new tokens over cached context): TFLOP/s of the causal work done
(4 D Hq per visible key and query), beside torch's SDPA on the same fresh prompt in a contiguous layout; each
launch's largest difference from SDPA's output (fresh prompt) or from the default launch's (the other cases).

    python3 benchmarks/attention_bench.py --shape 8b --out OUT
    python3 benchmarks/attention_bench.py --shape 8b --layout heads --out OUT   # the cache's other memory order
    python3 benchmarks/attention_bench.py --shape 8b --kv-dtype fp8 --decode-only  # a quantized cache's decode

A quantized cache (`--kv-dtype int8 / fp8`) holds random codes and random per-block centres and per-token
scales (its speed does not depend on their values); its bytes read count the codes and the scale rows.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after PYTHONPATH: an older tree there is timed

from llmc.codegen.attention import DECODE_TILE_CANDIDATES, PREFILL_TILE_CANDIDATES, paged_attention  # noqa: E402
from llmc.codegen.autotune import gpu_time_ms  # noqa: E402
from llmc.compiler import _attention_step  # noqa: E402
from llmc.runtime.kv_cache import KV_LAYOUTS  # noqa: E402

SHAPES = {"8b": (32, 8, 128), "1b": (32, 8, 64)}  # Hq, Hkv, D
_ragged = random.Random(0)
DECODE_CASES = {  # name: context per sequence
    **{f"{n} x {c}": [c] * n for n, c in [(1, 512), (1, 4096), (16, 1024), (64, 1024), (128, 1024), (64, 4096)]},
    # the mixed workload's decode steps: prompts U[64, 1024] plus what each has generated of U[64, 512]
    **{f"{n} ragged, U[128, 1536]": [_ragged.randint(128, 1536) for _ in range(n)] for n in (64, 128)},
}
PREFILL_CASES = {  # name: (new tokens per sequence, context per sequence)
    "fresh 2048": ([2048], [2048]),
    "4 chunks of 512 over 1024": ([512] * 4, [1024] * 4),
    "mixed: 32 decodes + 2 x 512 over 1024": ([1] * 32 + [512, 512], [1024] * 34),
    "mixed: 128 decodes + 512 over 1024": ([1] * 128 + [512], [1024] * 129),  # a budget step of the mixed workload
    "mixed: 4 decodes + 1024 over 2048": ([1] * 4 + [1024], [1024] * 4 + [2048]),
    "mixed: 128 ragged decodes + 512 over 1024": ([1] * 128 + [512], DECODE_CASES["128 ragged, U[128, 1536]"] + [1024]),
}


def timed(fn) -> float:
    """Microseconds per call of `fn` replayed as a CUDA graph (the tuner's timing: no launch overhead)."""
    return gpu_time_ms(fn) * 1e3


def copy_bandwidth() -> float:
    """Bytes per second of a 2 GiB device-to-device copy (read + write), ten copies back to back (a graph
    replay of so long a copy times less than the copy itself)."""
    a = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
    start.record()
    for _ in range(10):
        b.copy_(a)
    end.record()
    end.synchronize()
    return 2 * 10 * a.numel() / (start.elapsed_time(end) * 1e-3)


def label(cfg: dict) -> str:
    return "/".join(f"{k.removeprefix('BLOCK_').removeprefix('num_')[0].lower()}{v}" for k, v in cfg.items())


def print_decode_objectives(rows: list[dict]) -> None:
    """The decode tuning's objective (compiler.DECODE_TUNING_CONTEXTS: 1 x 512 plus 64 x 1,024, summed) against one
    that adds a mixed workload's decode step (128 ragged contexts): each launch's sum, with the graphs' splits."""
    objectives = {"1 x 512 + 64 x 1024": ("1 x 512", "64 x 1024"),
                  "+ 128 ragged": ("1 x 512", "64 x 1024", "128 ragged, U[128, 1536]")}
    us = {(r["case"], r["launch"]): r["us"] for r in rows if r["kind"] == "decode" and "splits for" not in r["launch"]
          and "partition" not in r["launch"]}
    launches = list(dict.fromkeys(launch for case, launch in us if case == "1 x 512"))
    if not launches:
        return
    print("\n# decode tuning objectives: each launch's summed us (graph splits)")
    for name, cases in objectives.items():
        sums = {launch: sum(us[c, launch] for c in cases) for launch in launches}
        best = min(sums, key=sums.get)
        print(f"{name:22s} " + "  ".join(f"{k} {v:.1f}" for k, v in sums.items()) + f"  -> {best}")


def print_partitions(rows: list[dict]) -> None:
    """Per decode case, the best launch at each keys-per-split (256: the runtime's, the default rows)."""
    parts = sorted({int(r["launch"].rsplit(" ", 1)[1]) for r in rows if "partition" in r["launch"]})
    if not parts:
        return
    print("\n# decode: the best launch at each keys-per-split (graph splits)")
    for case in dict.fromkeys(r["case"] for r in rows if r["kind"] == "decode"):
        best = {}
        for r in rows:
            if r["kind"] != "decode" or r["case"] != case or "splits for" in r["launch"]:
                continue
            part = int(r["launch"].rsplit(" ", 1)[1]) if "partition" in r["launch"] else 256
            if part not in best or r["us"] < best[part]["us"]:
                best[part] = r
        print(f"{case:28s} " + "  ".join(f"{k}: {v['us']:.1f} us ({v['launch'].split(',')[0]})"
                                          for k, v in sorted(best.items())))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--prefill-only", action="store_true", help="only the prefill cases")
    ap.add_argument("--decode-only", action="store_true", help="only the decode cases")
    ap.add_argument("--kv-dtype", default="bf16", choices=("bf16", "int8", "fp8"),
                    help="the cache's element type (int8 / fp8: codes with per-block centres and per-token scales)")
    ap.add_argument("--layout", default="tokens", choices=KV_LAYOUTS,
                    help="the cache's memory order (llmc.runtime.kv_cache: LLMC_KV_LAYOUT)")
    ap.add_argument("--block-size", type=int, default=16, help="keys per cache block (the engine's --block-size)")
    ap.add_argument("--partitions", default="", metavar="P,P",
                    help="also time the decode cases with these keys per split (each launch whose key tile divides "
                         "P; the runtime's is 256 up to 32 Ki keys: attention.decode_partition)")
    a = ap.parse_args()
    a.decode_only |= a.kv_dtype != "bf16"  # the prefill cases compare with SDPA on a bf16 cache
    Hq, Hkv, D = SHAPES[a.shape]
    dtype, g = torch.bfloat16, torch.Generator(device="cuda").manual_seed(0)
    bw = copy_bandwidth()
    rows = []
    print(f"# {a.shape}: {Hq} q heads over {Hkv}, {D} wide, bf16, {a.kv_dtype} cache, layout {a.layout}, "
          f"blocks of {a.block_size}; "
          f"{torch.cuda.get_device_name()}, copy {bw / 1e12:.2f} TB/s")

    def step(new, ctx):
        codes = {"bf16": dtype, "int8": torch.int8, "fp8": torch.float8_e4m3fn}[a.kv_dtype]
        return _attention_step(g, new, ctx, Hq, Hkv, D, dtype, bs=a.block_size, kv_dtype=codes, layout=a.layout)
    for name, ctx in ({} if a.prefill_only else DECODE_CASES).items():
        q, kv, scale, qsl, lens, tables, out = step([1] * len(ctx), ctx)
        # K and V codes, and per block and kv head its scale row (centres and per-token scales)
        kv_bytes = sum(ctx) * Hkv * D * 2 * kv.element_size() + \
            (0 if scale is None else sum(-(-c // kv.shape[2]) for c in ctx) * Hkv * scale.shape[-1] * 2)
        # the decode graphs' splits follow the longest context the model allows (4,096 here); an eager step's
        # its own longest: both, for the default tiles
        for cfg, longest in [(None, max(ctx)), *((c, 4096) for c in [None, *DECODE_TILE_CANDIDATES])]:
            us = timed(lambda: paged_attention(q, kv, qsl, lens, tables, D ** -0.5, max_seqlen_q=1, kv_scale=scale,
                                               max_seqlen_k=longest, out=out, decode_tiles=cfg))
            launch = (label(cfg) if cfg else "default") + ("" if longest == 4096 else f", splits for {longest}")
            rows.append(dict(kind="decode", case=name, launch=launch, us=us, of_bandwidth=kv_bytes / (us * 1e-6) / bw))
        # other partitions (a global constant: every batch would split a context the same way), graph splits
        for part in (int(x) for x in a.partitions.split(",") if x):
            for cfg in (c for c in DECODE_TILE_CANDIDATES if part % c["BLOCK_N"] == 0):
                us = timed(lambda: paged_attention(q, kv, qsl, lens, tables, D ** -0.5, max_seqlen_q=1, kv_scale=scale,
                                                   max_seqlen_k=4096, out=out, decode_tiles=cfg, partition_size=part))
                rows.append(dict(kind="decode", case=name, launch=f"{label(cfg)}, partition {part}", us=us,
                                 of_bandwidth=kv_bytes / (us * 1e-6) / bw))
        del kv
    for name, (new, ctx) in ({} if a.decode_only else PREFILL_CASES).items():
        q, kv, scale, qsl, lens, tables, out = step(new, ctx)
        flops = 4 * D * Hq * sum(sum(c - n + i + 1 for i in range(n)) for n, c in zip(new, ctx))
        lengths = dict(max_seqlen_q=max(new), max_seqlen_k=max(ctx))
        want = None
        if name.startswith("fresh"):  # torch's SDPA on the same keys, gathered out of the cache: time and values
            S = new[0]
            qq = q.transpose(0, 1)[None]
            kk, vv = (kv[i][tables[0].long()].reshape(-1, Hkv, D)[:S].transpose(0, 1)[None].contiguous()
                      for i in (0, 1))
            sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
                qq, kk, vv, is_causal=True, enable_gqa=True)
            want = sdpa()[0].transpose(0, 1)
            us = timed(sdpa)
            rows.append(dict(kind="prefill", case=name, launch="torch sdpa (contiguous)", us=us,
                             tflops=flops / (us * 1e-6) / 1e12))
        # a mixed step's decodes (its leading one-token rows) in the prefill launch, or on the decode kernel
        # (default tiles, the decode graphs' splits) beside it: the runtime's launch since the split
        decodes = next((i for i, n in enumerate(new) if n != 1), len(new))
        for cfg, split in [(c, s) for c in [None, *PREFILL_TILE_CANDIDATES] for s in dict.fromkeys((0, decodes))]:
            run = lambda: paged_attention(q, kv, qsl, lens, tables, D ** -0.5, out=out, kv_scale=scale,  # noqa: E731
                                          prefill_tiles=cfg, decode_rows=split, context_limit=4096, **lengths)
            us = timed(run)
            run()
            want = out.clone() if want is None else want
            rows.append(dict(kind="prefill", case=name, us=us, tflops=flops / (us * 1e-6) / 1e12,
                             launch=(label(cfg) if cfg else "default") + (", decodes split" if split else ""),
                             max_err=float((out - want).abs().max())))
        del kv
    for r in rows:
        fig = f"{r['of_bandwidth']:6.1%} of copy BW" if r["kind"] == "decode" else f"{r['tflops']:6.1f} TFLOP/s"
        err = f"  max |diff| {r['max_err']:.4f}" if "max_err" in r else ""
        print(f"{r['kind']:8s} {r['case']:40s} {r['launch']:26s} {r['us']:9.1f} us  {fig}{err}")
    best = {}
    for r in rows:
        k = (r["kind"], r["case"])
        if not r["launch"].startswith("torch") and (k not in best or r["us"] < best[k]["us"]):
            best[k] = r
    print("\n# best llmc launch per case")
    for (kind, case), r in best.items():
        default = next(x for x in rows if (x["kind"], x["case"]) == (kind, case) and x["launch"] == "default")
        print(f"{kind:8s} {case:40s} {r['launch']:26s} {r['us']:9.1f} us  x{default['us'] / r['us']:.2f} default")
    print_decode_objectives(rows)
    print_partitions(rows)
    if any("decodes split" in r["launch"] for r in rows):
        print("\n# mixed steps: best launch with the decodes in the prefill kernel, and split onto the decode kernel")
        for case in dict.fromkeys(r["case"] for r in rows if "decodes split" in r["launch"]):
            one, two = ([r for r in rows if r["case"] == case and ("decodes split" in r["launch"]) == s] for s in (0, 1))
            x, y = min(one, key=lambda r: r["us"]), min(two, key=lambda r: r["us"])
            print(f"{case:44s} {x['us']:8.1f} us ({x['launch']})  {y['us']:8.1f} us ({y['launch']})  "
                  f"x{x['us'] / y['us']:.2f}")
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        name = f"attention_bench_{a.shape}" + ("" if a.layout == "tokens" else f"_{a.layout}") + \
            ("" if a.kv_dtype == "bf16" else f"_{a.kv_dtype}") + ("" if a.block_size == 16 else f"_bs{a.block_size}")
        (a.out / f"{name}.json").write_text(json.dumps(dict(copy_bw=bw, layout=a.layout, kv_dtype=a.kv_dtype,
                                                            block_size=a.block_size, rows=rows),
                                                        indent=1))


if __name__ == "__main__":
    main()

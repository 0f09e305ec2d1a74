"""One qlinear call per (shape, format, config variant) on the GPU, timed as CUDA-graph replays over
copies of the weight that overflow L2 (so each call streams its weight from HBM), with its largest
error against the reference relative to the reference's largest value:

    python3 benchmarks/qlinear_probe.py [--shapes gate_up,down] [--ms 1,16] [--formats int4-g128,int4]
        [--variants default,fold] [--out DIR]

A variant changes the bucket's default config: "default" (as an untuned GPU runs it), "split2" /
"split0.5" (the K split doubled / halved), "bk512" (BLOCK_K 512), "bn32" (BLOCK_N 32), "swap" /
"noswap" (SWAP_AB), "w8" (8 warps), "stN" (N pipeline stages); "a+b" applies a, then b. "wgmma" runs
each config the tuner may time of the int4 wgmma GEMV (llmc/codegen/qwgmma.py; sm_90, int4 g128, up to 64
rows) as variants wgmma0, wgmma1, ...; "wgmma-trial" those timed only with LLMC_QWGMMA_TRY=1 (4 warpgroups:
`qwgmma.trial_candidates`) as wgmma-trial0, ...; "wgmma-tall" the kernel's tall form (any rows:
`qwgmma.tall_candidates`) as wgmma-tall0, ...; "wgmma-tall-grid" the tall form over a wider grid than the
tuner's (64 or 128 of x's rows, 1 or 2 warpgroups, K splits of 1 to 8; `tall_grid`) as wgmma-tall-grid0, ...;
"wgmma-tall-pipe" that grid's unfolded configs pipelined (`PIPE`: the folded codes through shared memory, one MMA
in flight while the next group is dequantized) as wgmma-tall-pipe0, ...;
"triton-all" every generated config the tuner times at the
rows' bucket (`qlinear_bucket`) as triton-all0, ...; "dequant" the library GEMM over a dequantized weight
(128+ rows); "bf16" cuBLAS on the bf16 weight the int4 one was made from (copies of it streamed alike).
Run from a copy of an older tree, the same command measures that tree's kernels.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmc.codegen import qmatmul as qm  # noqa: E402
from llmc.codegen import qwgmma  # noqa: E402
from llmc.codegen.autotune import m_bucket  # noqa: E402
from llmc.ir.quant import QuantFormat, quantize_rtn  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
FORMATS = {"int4-g128": QuantFormat("int", 4, 128), "int4": QuantFormat("int", 4, 0),
           "int4-g128-zp": QuantFormat("int", 4, 128, True), "int8": QuantFormat("int", 8, 0)}
L2_BYTES = 60 << 20


def tall_grid(n: int, k: int) -> list[dict]:
    """The tall form's configs past the tuner's (`qwgmma.TALL_CONFIGS`): every pairing of x's rows a program (64,
    128), warpgroups (1, 2) and K split (1, 2, 4, 8, where it divides K's groups), x copied a group ahead; and
    128 rows on 2 warpgroups with the scales folded (fewer registers a thread) at splits of 1, 2 and 4."""
    out = [{"WGMMA": True, "XN": xn, "WG": wg, "AHEAD": 1, "SPLIT_K": s, "XASYNC": True}
           for xn in (64, 128) for wg in (1, 2) for s in (1, 2, 4, 8)]
    out += [{"WGMMA": True, "XN": 128, "WG": 2, "AHEAD": 1, "SPLIT_K": s, "XASYNC": True, "FOLD": True} for s in (1, 2, 4)]
    return [c for c in out if n % (qwgmma.TILE_N * c["WG"]) == 0 and (k // qwgmma.TILE_K) % c["SPLIT_K"] == 0]


def streamed_copies(qw) -> list:
    """`qw` prepared, then prepared again from clones until the copies hold twice L2's bytes: a call on each in
    turn streams its weight from HBM."""
    p0 = qm.prepare(qw.fmt, qw.qweight, qw.scales, qw.zeros)
    return [p0] + [qm.prepare(qw.fmt, qw.qweight.clone(), qw.scales.clone(),
                              qw.zeros.clone() if qw.zeros is not None else None)
                   for _ in range(max(0, -(-2 * L2_BYTES // p0.nbytes) - 1))]


def variant(cfg: dict, name: str) -> dict:
    cfg = dict(cfg)
    if "+" in name:  # changes applied in turn: "bn128+split2"
        for part in name.split("+"):
            cfg = variant(cfg, part)
        return cfg
    if name == "default":
        return cfg
    if name.startswith("split"):
        cfg["SPLIT_K"] = max(1, int(cfg["SPLIT_K"] * float(name[5:])))
    elif name.startswith("bk"):
        cfg["BLOCK_K"] = int(name[2:])
    elif name.startswith("bn"):
        cfg["BLOCK_N"] = int(name[2:])
    elif name in ("swap", "noswap"):
        cfg["SWAP_AB"] = name == "swap"
    elif name.startswith("w"):
        cfg["num_warps"] = int(name[1:])
    elif name.startswith("st"):
        cfg["num_stages"] = int(name[2:])
    else:
        raise SystemExit(f"unknown variant {name}")
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="gate_up,down,qkv,o_proj")
    ap.add_argument("--ms", default="1,16")
    ap.add_argument("--formats", default="int4-g128,int4")
    ap.add_argument("--variants", default="default")
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    print(f"{'shape':8s} {'M':>4s} {'format':13s} {'variant':9s} {'us':>7s} {'TB/s':>6s} {'rel err':>8s}  config")
    for shape in a.shapes.split(","):
        n, k = SHAPES[shape]
        w = torch.randn(n, k, device="cuda") / k ** 0.5
        for fname in a.formats.split(","):
            fmt = FORMATS[fname]
            qw = quantize_rtn(w, fmt, torch.bfloat16)
            copies = streamed_copies(qw)
            p0, nbytes = copies[0], copies[0].nbytes
            for m in map(int, a.ms.split(",")):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ref = qm.reference(x.float(), qw.fmt, qw.qweight, qw.scales, qw.zeros).to(torch.bfloat16).float()
                base = qm.candidates(m_bucket(m), n, p0.padded_k, p0.pack)[0]
                runs = []
                fits = qwgmma.fits(p0, torch.bfloat16, False, "")
                for vname in a.variants.split(","):
                    if vname == "bf16":
                        runs.append((vname, None))
                    elif vname == "dequant":
                        runs += [(vname, {"LIBRARY": "dequant"})] if m >= 128 else []
                    elif vname == "triton-all":
                        configs = qm.candidates(qm.qlinear_bucket(m), n, p0.padded_k, p0.pack, m <= 64)
                        runs += [(f"{vname}{i}", c) for i, c in enumerate(configs)]
                    elif vname == "wgmma-tall-pipe":
                        pipes = qwgmma.pipelined(tall_grid(n, k))
                        runs += [(f"{vname}{i}", c) for i, c in enumerate(pipes)] if fits else []
                    elif vname == "wgmma-tall-grid":
                        runs += [(f"{vname}{i}", c) for i, c in enumerate(tall_grid(n, k))] if fits else []
                    elif vname == "wgmma-tall":
                        runs += [(f"{vname}{i}", c) for i, c in enumerate(qwgmma.tall_candidates(n, k, m))] if fits else []
                    elif vname not in ("wgmma", "wgmma-trial"):
                        runs.append((vname, variant(base, vname)))
                    elif m <= qwgmma.MAX_ROWS and fits:
                        configs = qwgmma.candidates(n, k) if vname == "wgmma" else qwgmma.trial_candidates(n, k)
                        runs += [(f"{vname}{i}", c) for i, c in enumerate(configs)]
                wb = [w.to(torch.bfloat16)] if any(c is None for _, c in runs) else []
                wb += [wb[0].clone() for _ in range(max(0, -(-2 * L2_BYTES // (n * k * 2)) - 1))] if wb else []
                for vname, cfg in runs:
                    ys = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in (wb if cfg is None else copies)]
                    if cfg is None:
                        y = x @ wb[0].t()

                        def calls():
                            for wi, yi in zip(wb, ys):
                                torch.mm(x, wi.t(), out=yi)
                    else:
                        y = qm.qlinear(x, p0, config=cfg)

                        def calls():
                            for p, yi in zip(copies, ys):
                                qm.qlinear(x, p, config=cfg, out=yi)
                    err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                    us = triton.testing.do_bench_cudagraph(calls, rep=100) * 1e3 / len(ys)
                    row = {"shape": shape, "n": n, "k": k, "m": m, "format": fname, "variant": vname, "us": us,
                           "tb_s": (n * k * 2 if cfg is None else nbytes) / us / 1e6, "rel_err": err, "config": cfg}
                    rows.append(row)
                    print(f"{shape:8s} {m:4d} {fname:13s} {vname:9s} {us:7.1f} {row['tb_s']:6.2f} {err:8.1e}  "
                          f"{json.dumps(cfg)}", flush=True)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "qlinear_probe.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

"""The 8B shape's decode attention, every launch the compile may choose (attention.DECODE_TILE_CANDIDATES), on
the tuning's own steps and on the steps decoding runs, alone and followed by the o_proj linear that reads its
output (int4 g128 on the generated qlinear, bf16 on cuBLAS), each timed as CUDA-graph replays:

    python3 benchmarks/decode_launch_lab.py [--out DIR]

Steps: "tune 512" and "tune 64x1024" (compiler.DECODE_TUNING_CONTEXTS, "objective" their sum), "b16" (16
sequences of 192 keys: the middle of a batch-16 decode of 128-token prompts and 128 new tokens), "ragged 128"
(128 contexts drawn from 64 to 2,048 keys, one seed). "+int4 o_proj" / "+bf16 o_proj": the b16 step, then the
o_proj linear over its [16, 4096] output, on a weight copy of its own per call (copies that overflow L2, so each
call streams its weight from HBM, as in a decode step). Set LLMC_PDL=0 to launch every kernel without
programmatic dependent launch: the pairs then show what the overlap of a launch with the one before it is worth.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from llmc.codegen import qmatmul as qm  # noqa: E402
from llmc.codegen.attention import DECODE_TILE_CANDIDATES  # noqa: E402
from llmc.codegen.autotune import choose_timed, gpu_time_ms  # noqa: E402
from llmc.compiler import (DECODE_LIGHTER_WITHIN, DECODE_TUNING_CONTEXTS, _attend, _decode_steps,  # noqa: E402
                           decode_launch_weight)
from llmc.ir.quant import QuantFormat, quantize_rtn  # noqa: E402
from qlinear_probe import L2_BYTES, streamed_copies  # noqa: E402

HQ, HKV, D, MAX_LEN, HIDDEN = 32, 8, 128, 4096, 4096


def label(cfg: dict) -> str:
    """A decode launch as keys per tile / pipeline stages / warps."""
    return f"{cfg['BLOCK_N']}/{cfg['num_stages']}/{cfg['num_warps']}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    ragged = torch.randint(64, 2049, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    contexts = {"tune 512": DECODE_TUNING_CONTEXTS[0], "tune 64x1024": DECODE_TUNING_CONTEXTS[1],
                "b16": [192] * 16, "ragged 128": ragged}
    steps = {name: _decode_steps(g, [ctx], HQ, HKV, D, torch.bfloat16, torch.bfloat16, MAX_LEN)
             for name, ctx in contexts.items()}
    out16 = steps["b16"][0][0][6]  # the b16 step's [16, Hq, D] output: o_proj's input
    x16 = out16.view(16, HQ * D)
    w = torch.randn(HIDDEN, HQ * D, device="cuda", generator=g).div(64)
    int4 = streamed_copies(quantize_rtn(w, QuantFormat("int", 4, 128), torch.bfloat16))
    bf16 = [w.to(torch.bfloat16) for _ in range(1 + 2 * L2_BYTES // (w.numel() * 2))]
    turn = itertools.count()

    def int4_linear():
        qm.qlinear(x16, int4[next(turn) % len(int4)])

    def bf16_linear():
        torch.nn.functional.linear(x16, bf16[next(turn) % len(bf16)])

    rows = []
    for lin_name, lin in (("int4", int4_linear), ("bf16", bf16_linear)):
        rows.append({"launch": "-", "case": f"{lin_name} o_proj alone", "us": 1e3 * gpu_time_ms(lin)})
    timed = []  # (objective, launch)
    for cfg in DECODE_TILE_CANDIDATES:
        t = {}
        for name, st in steps.items():
            t[name] = 1e3 * gpu_time_ms(lambda st=st: _attend(st, D, 0, decode_tiles=cfg))
        t["objective"] = t["tune 512"] + t["tune 64x1024"]
        timed.append((t["objective"], cfg))
        for lin_name, lin in (("int4", int4_linear), ("bf16", bf16_linear)):
            def pair(lin=lin):
                _attend(steps["b16"], D, 0, decode_tiles=cfg)
                lin()
            t[f"b16 +{lin_name} o_proj"] = 1e3 * gpu_time_ms(pair)
        rows += [{"launch": label(cfg), "case": k, "us": v} for k, v in t.items()]
        print(label(cfg), " ".join(f"{k}={v:.1f}" for k, v in t.items()), flush=True)
    pdl = os.environ.get("LLMC_PDL", "1") != "0"
    print(f"\n# {torch.cuda.get_device_name(0)}, PDL {'on' if pdl else 'off'}; us per call (CUDA-graph replays)")
    cases = list(dict.fromkeys(r["case"] for r in rows if r["launch"] != "-"))
    print(f"{'launch':10s} " + " ".join(f"{c:>16s}" for c in cases))
    for cfg in DECODE_TILE_CANDIDATES:
        by = {r["case"]: r["us"] for r in rows if r["launch"] == label(cfg)}
        print(f"{label(cfg):10s} " + " ".join(f"{by[c]:16.1f}" for c in cases))
    for r in rows:
        if r["launch"] == "-":
            print(f"{r['case']}: {r['us']:.1f} us")
    fastest, pick = choose_timed(timed)[1], choose_timed(timed, decode_launch_weight, DECODE_LIGHTER_WITHIN)[1]
    print(f"fastest on the objective: {label(fastest)}; the tuning's pick (the lightest within "
          f"{DECODE_LIGHTER_WITHIN:.0%}): {label(pick)}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"decode_launch_lab{'' if pdl else '_nopdl'}.json").write_text(json.dumps(
            {"gpu": torch.cuda.get_device_name(0), "pdl": pdl, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

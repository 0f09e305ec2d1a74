"""Check the non-attention kernels on a CUDA GPU at realistic sizes: errors and times vs torch / cuBLAS.

    python scripts/gpu_check_kernels.py                 # everything, tuning the matmuls (a few minutes)
    python scripts/gpu_check_kernels.py --quick         # fewer shapes
    python scripts/gpu_check_kernels.py --tuning out/tuning.json   # keep (and reuse) the autotune records

Errors are max |kernel - torch| / max |torch| against the IR's reference ops run by torch in the same
dtype (fp32 <= 1e-4, bf16/fp16 <= 1e-2); argmax must match torch.argmax exactly. Times are
medians in microseconds of the call replayed as a CUDA graph (`do_bench_cudagraph`: GPU time, as
the runtime replays decode steps; the last column, eager, adds Python launch overhead); "torch" is
the same computation in torch (cuBLAS for linears, one kernel per op elsewhere).
Exits 1 when any check fails.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("unset TRITON_INTERPRET: this script checks the compiled kernels on a GPU")

from triton.testing import do_bench  # noqa: E402

from llmc.codegen.autotune import Tuner, gpu_time_ms, m_bucket  # noqa: E402
from llmc.codegen.elementwise import fused_elementwise, spec_from_ops  # noqa: E402
from llmc.codegen.matmul import MatmulSpec, linear, matmul, reference  # noqa: E402
from llmc.codegen.norm import rms_norm  # noqa: E402
from llmc.codegen.sampling import argmax  # noqa: E402
from llmc.ir.ops import get_op  # noqa: E402

TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}
NAME = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
FAILED: list[str] = []


def us(fn) -> float:
    """GPU microseconds per call, replayed as a CUDA graph (as the runtime runs decode steps)."""
    return gpu_time_ms(fn) * 1e3


def eager_us(fn) -> float:
    """Microseconds per call launched from Python (includes the launch overhead)."""
    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()


def row(kind: str, case: str, dtype, err: float, t_kernel: float, t_torch: float, extra: str = "",
        fn=None) -> None:
    ok = err <= TOL[dtype]
    if not ok:
        FAILED.append(f"{kind} {case} {NAME[dtype]}: error {err:.2e}")
    print(f"{kind:<12} {case:<34} {NAME[dtype]:<5} {err:9.2e} {'ok ' if ok else 'BAD'} {t_kernel:9.1f} "
          f"{t_torch:9.1f} {t_torch / t_kernel:6.2f}x {eager_us(fn) if fn else float('nan'):9.1f}  {extra}", flush=True)


def header(title: str) -> None:
    print(f"\n== {title}\n{'kernel':<12} {'case':<34} {'dtype':<5} {'max err':>9}     {'llmc us':>9} {'torch us':>9} "
          f"{'speedup':>7} {'eager us':>9}", flush=True)


def ref_op(op, args, **attrs):
    opdef = get_op(op)
    return opdef.ref(list(args), opdef.complete_attrs(attrs), None)


def check_rms_norm(dtypes, hiddens, rows_list) -> None:
    header("rms_norm (residual: fused add, writes h and out)")
    for dtype in dtypes:
        for H in hiddens:
            for M in rows_list:
                x, r = torch.randn(M, H, device="cuda", dtype=dtype), torch.randn(M, H, device="cuda", dtype=dtype)
                w = (1 + 0.1 * torch.randn(H, device="cuda")).to(dtype)
                for residual in (False, True):
                    if residual:
                        out, h = rms_norm(x, w, 1e-6, residual=r)
                        ref_h = x + r
                        err = max(rel_err(out, ref_op("rms_norm", [ref_h, w], eps=1e-6)), rel_err(h, ref_h))
                        t_k = us(lambda: rms_norm(x, w, 1e-6, residual=r))
                        t_t = us(lambda: ref_op("rms_norm", [x + r, w], eps=1e-6))
                    else:
                        err = rel_err(rms_norm(x, w, 1e-6), ref_op("rms_norm", [x, w], eps=1e-6))
                        t_k = us(lambda: rms_norm(x, w, 1e-6))
                        t_t = us(lambda: ref_op("rms_norm", [x, w], eps=1e-6))
                    row("rms_norm", f"M={M} H={H}{' +res' if residual else ''}", dtype, err, t_k, t_t,
                        fn=lambda: rms_norm(x, w, 1e-6, residual=r if residual else None))


def region_ref(spec, tensors):
    env = {n: t for (n, _, _), t in zip(spec.inputs, tensors)}
    for out, op, args, attrs in spec.body:
        env[out] = ref_op(op, [env[a] for a in args], **dict(attrs))
        if op == "constant":
            env[out] = env[out].cuda()
    return [env[n] for n, _ in spec.outputs]


def check_elementwise(dtypes, rows_list, inter: int) -> None:
    header("fused elementwise regions")
    for dtype in dtypes:
        dt = NAME[dtype]
        regions = {
            "silu_mul(g, u)": ([("g", dt, "full"), ("u", dt, "full")], [("silu_mul", ["g", "u"], {})]),
            "gelu_tanh(x + b) * s": ([("x", dt, "full"), ("b", dt, "col"), ("s", dt, "row")],
                                     [("add", ["x", "b"], {}), ("gelu", ["t0"], {"approximate": "tanh"}),
                                      ("mul", ["t1", "s"], {})]),
        }
        for name, (inputs, ops) in regions.items():
            spec = spec_from_ops(inputs, ops)
            for M in rows_list:
                shapes = {"full": (M, inter), "col": (inter,), "row": (M, 1), "scalar": ()}
                ts = [torch.randn(shapes[k], device="cuda", dtype=dtype) for _, _, k in inputs]
                (y,) = fused_elementwise(spec, ts)
                err = rel_err(y, region_ref(spec, ts)[0])
                run = lambda: fused_elementwise(spec, ts)  # noqa: E731
                row("elementwise", f"{name} M={M} C={inter}", dtype, err, us(run), us(lambda: region_ref(spec, ts)),
                    fn=run)


def check_matmul(dtypes, shapes, ms, tuner: Tuner) -> None:
    header("matmul y = epilogue(x @ w.T + b)   (tuned per M bucket; torch = cuBLAS + eager epilogue)")
    for dtype in dtypes:
        for N, K in shapes:
            w = (torch.randn(N, K, device="cuda") / K ** 0.5).to(dtype)
            b = torch.randn(N, device="cuda", dtype=dtype)
            for epi, bias in (((), None), (("silu",), b)):
                spec = MatmulSpec(NAME[dtype], bias is not None, epi)
                for M in ms:
                    x = torch.randn(M, K, device="cuda", dtype=dtype)
                    y = matmul(x, w, bias, epi, tuner=tuner)  # tunes (once per bucket) and records cuBLAS's time
                    err = rel_err(y, reference(x, w, bias, epi))
                    rec = tuner.lookup(spec.key(N, K), m_bucket(M))
                    cfg = rec.config if rec else {}
                    t_k = us(lambda: matmul(x, w, bias, epi, tuner=tuner))
                    t_t = us(lambda: reference(x, w, bias, epi))
                    t_l = us(lambda: linear(x, w, bias, epi, tuner=tuner))
                    tiles = "x".join(str(cfg.get(k, "?")) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
                    extra = (f"tiles {tiles} splitK {cfg.get('SPLIT_K', '?')} w{cfg.get('num_warps', '?')}"
                             f"s{cfg.get('num_stages', '?')}{'  prefer cuBLAS' if rec and rec.prefer_cublas else ''}"
                             f"  linear() {t_l:.1f}us")
                    name = f"M={M} N={N} K={K}{' +b silu' if epi else ''}"
                    row("matmul", name, dtype, err, t_k, t_t, extra, fn=lambda: matmul(x, w, bias, epi, tuner=tuner))


def check_argmax(dtypes, cases) -> None:
    header("argmax (must equal torch.argmax)")
    for dtype in dtypes:
        for N, V in cases:
            logits = (torch.randn(N, V, device="cuda") * 3).round().to(dtype)  # rounded: many ties
            same = torch.equal(argmax(logits), logits.argmax(-1))
            row("argmax", f"N={N} V={V}", dtype, 0.0 if same else float("inf"), us(lambda: argmax(logits)),
                us(lambda: logits.argmax(-1)), fn=lambda: argmax(logits))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer shapes and dtypes")
    ap.add_argument("--tuning", default=None, help="tuning.json to load and update")
    ap.add_argument("--only", default="rms_norm,elementwise,matmul,argmax")
    ap.add_argument("--dtypes", default=None, help="comma-separated subset of bf16,f16,f32")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "this script needs a CUDA GPU"
    import triton
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    only = set(args.only.split(","))
    dtypes = [torch.bfloat16] if args.quick else [torch.bfloat16, torch.float16, torch.float32]
    if args.dtypes:
        dtypes = [d for d, n in NAME.items() if n in args.dtypes.split(",")]
    tuner = Tuner.load(args.tuning) if args.tuning else Tuner()
    if "rms_norm" in only:
        check_rms_norm(dtypes, [2048, 4096], [1, 64] if args.quick else [1, 16, 64, 4096])
    if "elementwise" in only:
        check_elementwise(dtypes, [1, 64] if args.quick else [1, 16, 64, 4096], inter=14336)
    if "matmul" in only:
        shapes = [(4096, 4096)] if args.quick else [(2048, 2048), (4096, 4096), (8192, 2048), (2048, 8192),
                                                    (14336, 4096)]
        ms = [1, 16, 64] if args.quick else [1, 2, 4, 8, 16, 32, 64, 256]
        check_matmul(dtypes if args.dtypes else [torch.bfloat16] if args.quick else [torch.bfloat16, torch.float32],
                     shapes, ms, tuner)
    if "argmax" in only:
        check_argmax(dtypes, [(1, 128256), (64, 152064)] if not args.quick else [(1, 128256)])
    if args.tuning:
        tuner.save(args.tuning)
        print(f"\nautotune records written to {args.tuning}")
    if FAILED:
        print("\nFAILED:\n  " + "\n  ".join(FAILED))
        sys.exit(1)
    print("\nall checks passed")


if __name__ == "__main__":
    main()

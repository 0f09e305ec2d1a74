"""A decoder's int4 linears at batch 1 as one persistent kernel, against the same GEMV launched once a linear.

`step_floor.py` bounds a step of one kernel per op from streaming kernels: its persistent chains say what grid
barriers cost against launches when every phase only reads. This script asks the same of real work: the four
int4 g128 linears of each of the 8B shape's layers (qkv, o_proj, gate/up with the SwiGLU product, down) as
GEMVs on one row of x, every linear's output the next one's input (o_proj reads qkv's first `hidden` outputs,
where attention's would be; no norms, no residual). One GEMV body (`_item`) serves both ways of running:

- ``launches``: one kernel launch a linear, 4 a layer, captured into one CUDA graph, with programmatic
  dependent launch (PDL) as llmc launches its kernels;
- ``persistent``: one launch for every layer, the linears its phases, a grid barrier between phases, with
  0 or more weight blocks of each program's next item prefetched into L2 before the barrier.

A linear's work is split in items (a tile of BLOCK_N output rows over a K split); the split that finishes a
tile last sums the tile's partials in split order and writes the bf16 output (with the SwiGLU product for
gate/up, whose weight rows are stored a tile of gate rows and the tile's up rows at a time): the same sums
whichever split is last, and the same in both ways of running, so their outputs are bit-equal.

The weights: 4-bit codes, 8 columns an int32 word (column 8j + t at bits 4t of word j), zero point 8, a bf16
scale a group of 128 columns. Random; the scales keep activations near unit size through every layer.

    python3 benchmarks/persistent_linears.py --out OUT          # on a GPU, about a minute
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_bench import SHAPES  # noqa: E402
from int4_gemv_lab import _plane, _x as _x_plane  # noqa: E402  (code - 8) x 2^P of a nibble plane; x x 2^-P
from quant_bench import graph_time_us  # noqa: E402

GROUP = 128
COLUMNS = 8  # columns an int32 word of codes holds
FIELDS = 9  # a phase's row of the phase table: weight and scale offsets, N, K, K split, x and y offsets, SwiGLU, items


@triton.jit
def _prefetch(ptrs):
    # one L2 prefetch a pointer (a weight row's next 128 bytes)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _item(table_ptr, phase, item, w_arena, s_arena, act, ws_ptr, count_ptr,
          BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    """One item of one phase: BLOCK_N output rows over one K split, then, by the split that arrives last at the
    tile, the tile's finished bf16 outputs."""
    row = table_ptr + phase * 9
    w_off = tl.load(row)
    s_off = tl.load(row + 1)
    N = tl.load(row + 2).to(tl.int32)
    K = tl.load(row + 3).to(tl.int32)
    SPLIT = tl.load(row + 4).to(tl.int32)
    x_off = tl.load(row + 5)
    y_off = tl.load(row + 6)
    swiglu = tl.load(row + 7)
    n_tiles = tl.cdiv(N, BLOCK_N)
    tn = item % n_tiles
    sp = item // n_tiles
    KW = K // 8
    rn = tn * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    w_per_split = tl.cdiv(KW, SPLIT * BLOCK_W) * BLOCK_W
    j_start = sp * w_per_split
    j_end = tl.minimum(j_start + w_per_split, KW)
    rw = tl.arange(0, BLOCK_W)
    w_rows = w_arena + w_off + rn[:, None].to(tl.int64) * KW
    s_rows = s_arena + s_off + rn[:, None].to(tl.int64) * (K // 128)
    x_ptr = act + x_off
    acc = tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.float32)
    for j0 in range(j_start, j_end, BLOCK_W):
        j = j0 + rw
        ok = n_ok[:, None] & (j < j_end)[None, :]
        w = tl.load(w_rows + j[None, :], mask=ok, other=0)
        s = tl.load(s_rows + (j // 16)[None, :], mask=ok, other=0.0).to(tl.float32)
        w_hi = w >> 16
        c0 = j * 8
        part = _plane(w, 0) * _x_plane(x_ptr, c0, K, 0)[None, :]
        part += _plane(w, 4) * _x_plane(x_ptr, c0 + 1, K, 4)[None, :]
        part += _plane(w, 8) * _x_plane(x_ptr, c0 + 2, K, 8)[None, :]
        part += _plane(w, 12) * _x_plane(x_ptr, c0 + 3, K, 12)[None, :]
        part += _plane(w_hi, 0) * _x_plane(x_ptr, c0 + 4, K, 0)[None, :]
        part += _plane(w_hi, 4) * _x_plane(x_ptr, c0 + 5, K, 4)[None, :]
        part += _plane(w_hi, 8) * _x_plane(x_ptr, c0 + 6, K, 8)[None, :]
        part += _plane(w_hi, 12) * _x_plane(x_ptr, c0 + 7, K, 12)[None, :]
        acc += part * s
    tl.store(ws_ptr + sp * N + rn, tl.sum(acc, axis=1), mask=n_ok)
    tl.debug_barrier()  # every thread's partials written before the arrival is counted
    if tl.atomic_add(count_ptr + tn, 1, sem="acq_rel") == SPLIT - 1:  # the last split of this tile
        tl.atomic_xchg(count_ptr + tn, 0)  # ready for the next phase's tiles
        if swiglu != 0:  # rows: BLOCK_N / 2 gate rows, then the same outputs' up rows
            rh = tn * BLOCK_N + tl.arange(0, BLOCK_N // 2)
            g = tl.zeros((BLOCK_N // 2,), dtype=tl.float32)
            u = tl.zeros((BLOCK_N // 2,), dtype=tl.float32)
            for s2 in range(SPLIT):
                g += tl.load(ws_ptr + s2 * N + rh, mask=rh < N, other=0.0, cache_modifier=".cg")
                u += tl.load(ws_ptr + s2 * N + rh + BLOCK_N // 2, mask=rh < N, other=0.0, cache_modifier=".cg")
            g = g.to(tl.bfloat16).to(tl.float32)
            u = u.to(tl.bfloat16).to(tl.float32)
            h = g / (1.0 + tl.exp(-g)) * u  # (a name of its own: triton 3.6 types a name alike in both branches)
            out = tn * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            tl.store(act + y_off + out, h.to(tl.bfloat16), mask=out < N // 2)
        else:
            y = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for s2 in range(SPLIT):
                y += tl.load(ws_ptr + s2 * N + rn, mask=n_ok, other=0.0, cache_modifier=".cg")
            tl.store(act + y_off + rn, y.to(tl.bfloat16), mask=n_ok)


@triton.jit
def _prefetch_item(table_ptr, phase, item, w_arena, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
                   AHEAD: tl.constexpr):
    # the first AHEAD weight blocks of an item into L2 (BLOCK_W words = 4 x BLOCK_W bytes a row and block)
    row = table_ptr + phase * 9
    w_off = tl.load(row)
    N = tl.load(row + 2).to(tl.int32)
    K = tl.load(row + 3).to(tl.int32)
    SPLIT = tl.load(row + 4).to(tl.int32)
    n_tiles = tl.cdiv(N, BLOCK_N)
    tn = item % n_tiles
    sp = item // n_tiles
    KW = K // 8
    w_per_split = tl.cdiv(KW, SPLIT * BLOCK_W) * BLOCK_W
    rn = tl.minimum(tn * BLOCK_N + tl.arange(0, BLOCK_N), N - 1)
    for a in tl.static_range(AHEAD):
        for line in tl.static_range(BLOCK_W // 32):
            j = tl.minimum(sp * w_per_split + a * BLOCK_W + line * 32, KW - 1)
            _prefetch(w_arena + w_off + rn.to(tl.int64) * KW + j)


@triton.jit
def linears_kernel(table_ptr, w_arena, s_arena, act, ws_ptr, count_ptr, bar_ptr, first_phase, n_phases, limit,
                   BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, PERSISTENT: tl.constexpr, PDL: tl.constexpr,
                   AHEAD: tl.constexpr):
    """PERSISTENT: phases first_phase .. first_phase + n_phases - 1, each program taking items pid, pid + grid,
    ..., a grid barrier after each phase (an arrival counter, bar[0]; a wait that polls `limit` times gives up
    and is counted in bar[2], so that programs not all resident cannot hang the GPU; the last program to leave
    resets the counter, bar[1] counting leavers). Otherwise: the one phase first_phase, an item a program."""
    pid = tl.program_id(0)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if PERSISTENT:
        nprog = tl.num_programs(0)
        for p in range(n_phases):
            phase = first_phase + p
            items = tl.load(table_ptr + phase * 9 + 8).to(tl.int32)
            for item in range(pid, items, nprog):
                _item(table_ptr, phase, item, w_arena, s_arena, act, ws_ptr, count_ptr, BLOCK_N, BLOCK_W)
            if AHEAD > 0:
                if p + 1 < n_phases:
                    if pid < tl.load(table_ptr + (phase + 1) * 9 + 8):
                        _prefetch_item(table_ptr, phase + 1, pid, w_arena, BLOCK_N, BLOCK_W, AHEAD)
            tl.debug_barrier()
            tl.atomic_add(bar_ptr, 1, sem="release")
            target = (p + 1) * nprog
            seen = tl.load(bar_ptr, volatile=True)
            tries = 0
            while (seen < target) & (tries < limit):
                seen = tl.load(bar_ptr, volatile=True)
                tries += 1
            seen = tl.atomic_add(bar_ptr, 0, sem="acquire")  # orders this program's next reads after the others' writes
            if seen < target:
                tl.atomic_add(bar_ptr + 2, 1)
            tl.debug_barrier()
        if tl.atomic_add(bar_ptr + 1, 1, sem="acq_rel") == nprog - 1:  # the last to leave: every other has left
            tl.atomic_xchg(bar_ptr, 0)
            tl.atomic_xchg(bar_ptr + 1, 0)
    else:
        _item(table_ptr, first_phase, pid, w_arena, s_arena, act, ws_ptr, count_ptr, BLOCK_N, BLOCK_W)


class Chain:
    """The linears of `layers` layers of a shape: their weights in two arenas (made on `device`, random), the
    activations' arena and the phase table."""

    def __init__(self, hidden: int, inter: int, qkv: int, layers: int, splits: dict, block_n: int,
                 device: str, seed: int = 0):
        gen = torch.Generator(device=device).manual_seed(seed)
        self.hidden, self.block_n = hidden, block_n
        shapes = [("qkv", hidden, qkv), ("o_proj", hidden, hidden), ("gate_up", hidden, 2 * inter),
                  ("down", inter, hidden)]
        # the activations' arena (bf16): x0 [hidden], then each linear's output
        outs = {"qkv": hidden, "o_proj": hidden + qkv, "gate_up": 2 * hidden + qkv, "down": 2 * hidden + qkv + inter}
        ins = {"qkv": outs["down"], "o_proj": outs["qkv"], "gate_up": outs["o_proj"], "down": outs["gate_up"]}
        self.phases, rows = [], []
        w_off = s_off = 0
        for layer in range(layers):
            for name, k, n in shapes:
                x_off = 0 if (layer, name) == (0, "qkv") else ins[name]
                rows.append([w_off, s_off, n, k, splits[name], x_off, outs[name], int(name == "gate_up"),
                             -(-n // block_n) * splits[name]])
                self.phases.append(name)
                w_off += n * k // COLUMNS
                s_off += n * k // GROUP
        assert len(rows[0]) == FIELDS
        self.rows = rows
        self.table = torch.tensor(rows, dtype=torch.int64, device=device)
        self.w_arena = torch.randint(-2**31, 2**31, (w_off,), dtype=torch.int32, device=device, generator=gen)
        self.s_arena = torch.empty(s_off, dtype=torch.bfloat16, device=device)
        for (_, s0, n, k, *_), name in zip(rows, self.phases):
            # codes of variance 21.25 about the zero point: outputs near unit size (twice that into SwiGLU)
            scale = (torch.rand(n * k // GROUP, device=device, generator=gen) + 0.5) / (4.6 * k ** 0.5)
            self.s_arena[s0:s0 + n * k // GROUP] = scale * (2.0 if name == "gate_up" else 1.0)
        self.act = torch.zeros(outs["down"] + hidden, dtype=torch.bfloat16, device=device)
        self.act[:hidden] = torch.randn(hidden, device=device, generator=gen)
        self.x = self.act[:hidden].clone()
        self.ws = torch.zeros(max(r[2] * r[4] for r in rows), dtype=torch.float32, device=device)
        self.count = torch.zeros(max(-(-r[2] // block_n) for r in rows), dtype=torch.int32, device=device)
        self.bar = torch.zeros(3, dtype=torch.int32, device=device)

    def items(self, phase: int) -> int:
        return self.rows[phase][8]

    def weight_bytes(self) -> int:
        return self.w_arena.numel() * 4 + self.s_arena.numel() * 2

    def fresh(self):
        """Outputs, counters and barrier as before any run."""
        self.act[self.hidden:] = 0
        self.bar.zero_()
        self.count.zero_()

    def output(self) -> torch.Tensor:
        """The last down projection's output."""
        start = self.rows[-1][6]
        return self.act[start:start + self.hidden].clone()

    def phase_reference(self, phase: int) -> torch.Tensor:
        """One linear in torch on the input the kernels left in the arena: fp32 sums, bf16 out (SwiGLU from bf16
        gate and up)."""
        w0, s0, n, k, _, x_off, _, swiglu, _ = self.rows[phase]
        words, scales = self.w_arena[w0:w0 + n * k // COLUMNS].cpu().to(torch.int64), self.s_arena.cpu().float()
        codes = torch.stack([(words >> (4 * t)) & 15 for t in range(COLUMNS)], dim=1).reshape(n, k)
        w = (codes.float() - 8.0) * scales[s0:s0 + n * k // GROUP].view(n, k // GROUP).repeat_interleave(GROUP, 1)
        y = w @ self.act[x_off:x_off + k].float().cpu()
        if swiglu:
            t = y.view(n // self.block_n, 2, self.block_n // 2)
            g = t[:, 0].flatten().to(torch.bfloat16).float()
            u = t[:, 1].flatten().to(torch.bfloat16).float()
            y = g / (1.0 + torch.exp(-g)) * u
        return y.to(torch.bfloat16)

    def phase_output(self, phase: int) -> torch.Tensor:
        n, y_off, swiglu = self.rows[phase][2], self.rows[phase][6], self.rows[phase][7]
        return self.act[y_off:y_off + (n // 2 if swiglu else n)].cpu()


def phase_errors(chain: Chain, calls: list) -> list[float]:
    """Each launch in turn, its output against torch on the same input: the largest error, relative to the
    output's largest magnitude."""
    errors = []
    for phase, call in enumerate(calls):
        call()
        ref = chain.phase_reference(phase).float()
        errors.append(((chain.phase_output(phase).float() - ref).abs().max() / ref.abs().max()).item())
    return errors


def launch_calls(chain: Chain, block_w: int, warps: int, stages: int, pdl: bool) -> list:
    """One launch a linear (an item a program), as callables."""
    calls = []
    for phase in range(len(chain.phases)):
        kwargs = dict(BLOCK_N=chain.block_n, BLOCK_W=block_w, PERSISTENT=False, PDL=pdl, AHEAD=0,
                      num_warps=warps, num_stages=stages)
        if pdl:
            kwargs["launch_pdl"] = True
        calls.append(lambda phase=phase, kwargs=kwargs: linears_kernel[(chain.items(phase),)](
            chain.table, chain.w_arena, chain.s_arena, chain.act, chain.ws, chain.count, chain.bar, phase, 1, 0,
            **kwargs))
    return calls


def persistent_call(chain: Chain, programs: int, block_w: int, warps: int, stages: int, ahead: int,
                    limit: int = 100_000):
    """Every linear in one launch of `programs` programs, as a callable (returning the compiled kernel)."""
    return lambda: linears_kernel[(programs,)](
        chain.table, chain.w_arena, chain.s_arena, chain.act, chain.ws, chain.count, chain.bar, 0,
        len(chain.phases), limit, BLOCK_N=chain.block_n, BLOCK_W=block_w, PERSISTENT=True, PDL=False, AHEAD=ahead,
        num_warps=warps, num_stages=stages)


def resident(kernel, warps: int) -> int:
    """How many programs of a compiled kernel one multiprocessor holds at once (registers, shared memory, warps)."""
    props = torch.cuda.get_device_properties(0)
    regs = max(getattr(kernel, "n_regs", 0), 1)
    per_warp = -(-regs * 32 // 256) * 256  # registers are allocated 256 at a time a warp
    shared = getattr(kernel, "shared", None) or getattr(getattr(kernel, "metadata", None), "shared", 0) or 0
    smem = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
    by_regs = 65536 // (per_warp * warps)
    by_smem = smem // shared if shared else 64
    return max(0, min(by_regs, by_smem, 64 // warps, 32))


def measure(chain: Chain, calls: list, reps: int, want):
    chain.fresh()
    for c in calls:
        c()
    torch.cuda.synchronize()
    got = chain.output()
    row = {"waits_out": int(chain.bar[2]), "bit_equal": bool(want is None or torch.equal(got, want))}
    if row["waits_out"] == 0:
        row["ms"] = graph_time_us(calls, reps) * len(calls) / 1e3
        row["tb_s"] = chain.weight_bytes() / (row["ms"] * 1e-3) / 1e12
    return row, got


def default_splits(shapes, block_n: int, sms: int) -> dict:
    """K splits that give every linear about 3 items a multiprocessor (at least 1,024 columns a split)."""
    return {name: max(1, min(k // 1024, round(3 * sms / -(-n // block_n)))) for name, k, n in shapes}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory for persistent_linears.json")
    ap.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=20, help="graph replays timed (median)")
    ap.add_argument("--block-n", default="32,64", help="output rows an item (comma-separated)")
    ap.add_argument("--block-w", default="32,64", help="int32 words of a row a loop step (comma-separated)")
    ap.add_argument("--launch", default="4x3,4x4,8x3", help="warps x stages (comma-separated)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("persistent_linears: measuring needs a CUDA GPU")
    shape = SHAPES[args.shape]
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    qkv = (shape["num_attention_heads"] + 2 * shape["num_key_value_heads"]) * shape["head_dim"]
    shapes = [("qkv", hidden, qkv), ("o_proj", hidden, hidden), ("gate_up", hidden, 2 * inter), ("down", inter, hidden)]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    result = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(0), "shape": args.shape,
              "layers": args.layers, "torch": torch.__version__, "triton": triton.__version__, "checks": {},
              "rows": []}
    # each linear against torch first, one layer
    for block_n in [int(v) for v in args.block_n.split(",")]:
        chain = Chain(hidden, inter, qkv, 1, default_splits(shapes, block_n, sms), block_n, "cuda")
        errors = phase_errors(chain, launch_calls(chain, 32, 4, 3, pdl=False))
        result["checks"][block_n] = dict(zip(chain.phases, errors))
        print(f"block_n {block_n}: each linear's largest error against torch, relative: {result['checks'][block_n]}",
              flush=True)
        del chain
    for block_n in [int(v) for v in args.block_n.split(",")]:
        splits = default_splits(shapes, block_n, sms)
        chain = Chain(hidden, inter, qkv, args.layers, splits, block_n, "cuda")
        result["weight_bytes"] = chain.weight_bytes()
        for block_w in [int(v) for v in args.block_w.split(",")]:
            for launch in args.launch.split(","):
                warps, stages = (int(v) for v in launch.split("x"))
                base = {"block_n": block_n, "block_w": block_w, "warps": warps, "stages": stages, "splits": splits}
                arms = [({"run": "launches", "programs_per_sm": None, "ahead": 0},
                         launch_calls(chain, block_w, warps, stages, pdl=True))]
                try:
                    one = persistent_call(chain, sms, block_w, warps, stages, 0)
                    chain.fresh()
                    fits = resident(one(), warps)
                except Exception as exc:  # a config that does not compile: reported, not fatal
                    fits = 0
                    base["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                for per_sm in range(1, min(fits, 4) + 1):
                    for ahead in (0, 1, 2):
                        arms.append(({"run": "persistent", "programs_per_sm": per_sm, "ahead": ahead},
                                     [persistent_call(chain, per_sm * sms, block_w, warps, stages, ahead)]))
                want = None
                for arm, calls in arms:
                    row = dict(base, **arm)
                    try:
                        got_row, got = measure(chain, calls, args.reps, want)
                        want = got if want is None else want
                        row.update(got_row)
                    except Exception as exc:
                        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                    result["rows"].append(row)
                    print(json.dumps(row), flush=True)
        del chain
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "persistent_linears.json").write_text(json.dumps(result, indent=1))
    rows = result["rows"]
    print(f"\n# {result['gpu']}: {args.layers} layers of {args.shape}'s int4 g128 linears at batch 1, "
          f"{result['weight_bytes'] / 1e9:.3f} GB of weights")
    print("| block_n | block_w | warps, stages | run | programs/SM | ahead | ms | TB/s | bits |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ms = f"{r['ms']:.3f} | {r['tb_s']:.2f}" if "ms" in r else f"{r.get('error', 'waits ran out')} | -"
        print(f"| {r['block_n']} | {r['block_w']} | {r['warps']}, {r['stages']} | {r['run']} | "
              f"{r['programs_per_sm'] or '-'} | {r['ahead']} | {ms} | {'equal' if r.get('bit_equal') else 'DIFFER'} |")
    best = {}
    for r in rows:
        if "ms" in r and r.get("bit_equal") and (r["run"] not in best or r["ms"] < best[r["run"]]["ms"]):
            best[r["run"]] = r
    for run, r in best.items():
        print(f"best {run}: {r['ms']:.3f} ms ({r['tb_s']:.2f} TB/s): block_n {r['block_n']}, block_w {r['block_w']}, "
              f"{r['warps']} warps, {r['stages']} stages, {r['programs_per_sm'] or '-'} programs/SM, ahead {r['ahead']}")


if __name__ == "__main__":
    main()

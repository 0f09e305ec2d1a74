"""The floor of a decode step made of one kernel per op: the 8B step's kernels replaced by plain streaming kernels.

llmc's batch-1 decode step on the 8B shape runs about 293 kernels (per layer: add+norm, qkv, rope with the
K/V write, attention, o_proj, add+norm, gate/up, SiLU*mul, down; then the final norm, the LM head and the
argmax). This script replaces each of them by a kernel that does nothing but read as many bytes as that
kernel moves (its weight in the step's format, the K/V cache of the context, its activations), launched the
way llmc launches (programmatic dependent launch, PDL, on or off), captured into one CUDA graph and replayed.
Its time a step is the floor of a step built this way: what the step would cost if every kernel read its
bytes as fast as a tuned streaming kernel of its size. The gap from llmc's measured step to it is what better
kernels could still win; the gap from the floor to the issue's target is what only fewer kernels could.

Chains timed (each with PDL off and on):
- ``int4``: the int4 g128 step (every linear and the LM head 4 + 16/128 bits a weight: codes and bf16 scales);
- ``bf16``: the same step in bf16;
- ``int4-big5``: only the four linears and attention a layer (and the LM head): the small kernels fused away;
- ``empty``: the same 293 kernels reading nothing: the launch floor;
- ``one``: the int4 step's bytes read by one kernel: the bandwidth floor.

Before the chains, each distinct size is timed alone over copies that overflow L2, and its best config
(elements a program a loop, warps, programs a multiprocessor) is the one its chain kernels use.

Then ``int4``, ``int4-big5`` and ``empty`` run once more as one persistent kernel each (`persistent_kernel`): the
chain's kernels become phases of one launch, separated by a grid barrier (each GEMV's outputs are every next
GEMV's inputs), with 0, 1 or 2 blocks a program of the next phase read before the barrier (a persistent decode
kernel may stream its next weights while their activations are still being made). ``empty`` then gives the
barriers' own cost. These say whether a step of one persistent kernel could reach what 293 launches cannot.

    python3 benchmarks/step_floor.py --out OUT               # on a GPU, about a minute
    python3 benchmarks/step_floor.py --list                  # the step's kernels and bytes (no GPU)
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_bench import SHAPES  # noqa: E402
from quant_bench import graph_time_us  # noqa: E402

from llmc.ir.quant import QuantFormat  # noqa: E402

INT4 = QuantFormat("int", 4, 128)
WORD = 4  # the streaming kernel reads int32 words
L2_BYTES = 50 * 2**20  # H100 and H200: 50 MiB
CONFIGS = [(block, warps, per_sm) for block in (1024, 2048, 4096) for warps in (4, 8) for per_sm in (1, 2, 4, 8)]


@triton.jit
def stream_kernel(x_ptr, out_ptr, n_words, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Sum `n_words` int32 words, grid-stride, one partial sum a program (so that no load is dead)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(pid * BLOCK, n_words, step):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n_words, other=0)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


@triton.jit
def persistent_kernel(x_ptr, offs_ptr, bar_ptr, out_ptr, n_phases, limit, BLOCK: tl.constexpr, AHEAD: tl.constexpr,
                      LOAD_POLL: tl.constexpr = False):
    """One kernel for a whole chain: phase p sums the words [offs[p], offs[p + 1]) grid-stride over all programs,
    and a grid barrier (an arrival counter, bar[0]) separates the phases, as the all-to-all dependency of one
    GEMV's outputs on the one before it would. With AHEAD = 1 or 2 each program loads its first blocks of the next
    phase before it waits at the barrier: a persistent decode kernel may stream a layer's next weights while the
    activations they multiply are still being made. A program that has polled `limit` times stops waiting and
    counts it (out[n + pid]), so programs that are not all resident at once cannot hang the GPU; the last program
    to leave resets the counters (bar[1] counts leavers), so a CUDA graph can replay the kernel as it is.
    LOAD_POLL: poll the counter with plain (volatile) loads rather than atomics, which every program's polls would
    otherwise queue on at one address (what a kernel that hands data across the barrier would follow with an
    acquire fence; here no phase reads what another wrote, so the timing needs none).
    Needs every program resident at once to measure anything (a grid no larger than the GPU holds)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    step = nprog * BLOCK
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    lo = tl.load(offs_ptr)
    hi = tl.load(offs_ptr + 1)
    skip = 0  # blocks of this phase already read ahead
    waited_out = 0
    for ph in range(n_phases):
        for start in range(lo + pid * BLOCK + skip * step, hi, step):
            o = start + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + o, mask=o < hi, other=0)
        nhi = tl.load(offs_ptr + ph + 2, mask=ph + 1 < n_phases, other=hi)
        o1 = hi + pid * BLOCK + tl.arange(0, BLOCK)
        if AHEAD > 0:
            ahead1 = tl.load(x_ptr + o1, mask=o1 < nhi, other=0)
        if AHEAD > 1:
            ahead2 = tl.load(x_ptr + o1 + step, mask=o1 + step < nhi, other=0)
        tl.atomic_add(bar_ptr, 1, sem="release")
        target = (ph + 1) * nprog
        seen = tl.atomic_add(bar_ptr, 0, sem="acquire")
        tries = 0
        while (seen < target) & (tries < limit):
            if LOAD_POLL:
                seen = tl.load(bar_ptr, volatile=True)
            else:
                seen = tl.atomic_add(bar_ptr, 0, sem="acquire")
            tries += 1
        waited_out += (seen < target).to(tl.int32)
        if AHEAD > 0:
            acc += ahead1
        if AHEAD > 1:
            acc += ahead2
        lo = hi
        hi = nhi
        skip = AHEAD
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))
    tl.store(out_ptr + nprog + pid, waited_out)
    if tl.atomic_add(bar_ptr + 1, 1, sem="acq_rel") == nprog - 1:  # the last to leave: every other has left
        tl.atomic_xchg(bar_ptr, 0)
        tl.atomic_xchg(bar_ptr + 1, 0)


def step_kernels(shape: dict, fmt: QuantFormat | None, context: int, batch: int = 1) -> list[tuple[str, int]]:
    """(kind, bytes moved) of each kernel of one decode step of `shape` at `batch` rows over `context`
    cached tokens a sequence; `fmt` None is bf16. A linear moves its weight (codes and scales) and its
    input and output rows; the small kernels their rows (and the norm weight); attention its K/V."""
    h, inter, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    d, hq, hkv = shape["head_dim"], shape["num_attention_heads"], shape["num_key_value_heads"]

    def linear(name, k, n):
        w = k * n * 2 if fmt is None else math.ceil(k * n * fmt.bits_per_weight(k) / 8)
        return name, w + batch * (k + n) * 2

    def rows(name, *widths):
        return name, sum(batch * w * 2 for w in widths)

    qkv = (hq + 2 * hkv) * d
    layer = [rows("norm", h, h, h, h, h), linear("qkv", h, qkv), rows("rope_kv", qkv, qkv),
             ("attention", batch * context * hkv * d * 2 * 2 + batch * 2 * hq * d * 2),
             linear("o_proj", hq * d, h), rows("norm", h, h, h, h, h), linear("gate_up", h, 2 * inter),
             rows("silu_mul", 2 * inter, inter), linear("down", inter, h)]
    return ([rows("embed", h, h)] + layer * shape["num_hidden_layers"]
            + [rows("norm", h, h, h), linear("lm_head", h, v), rows("argmax", v), rows("argmax", 64)])


def chains(shape: dict, context: int) -> dict[str, list[tuple[str, int]]]:
    int4 = step_kernels(shape, INT4, context)
    big = {"qkv", "attention", "o_proj", "gate_up", "down", "lm_head"}
    return {"int4": int4, "bf16": step_kernels(shape, None, context),
            "int4-big5": [k for k in int4 if k[0] in big], "empty": [(name, 0) for name, _ in int4],
            "one": [("all", sum(b for _, b in int4))]}


def words(nbytes: int) -> int:
    return -(-nbytes // WORD)


def buffer(nbytes: int) -> torch.Tensor:
    """Words to stream for `nbytes` (an empty view of one word where there are none)."""
    n = words(nbytes)
    return torch.ones(max(n, 1), dtype=torch.int32, device="cuda")[:n]


def launcher(buf: torch.Tensor, out: torch.Tensor, config, pdl: bool, sms: int):
    block, warps, per_sm = config
    n = buf.numel()
    grid = (max(1, min(per_sm * sms, -(-n // block))),)
    kwargs = dict(BLOCK=block, PDL=pdl, num_warps=warps)
    if pdl:
        kwargs["launch_pdl"] = True
    return lambda: stream_kernel[grid](buf, out, n, **kwargs)


def graph_ms(calls: list, reps: int) -> float:
    """Median milliseconds of one replay of `calls` captured as one CUDA graph."""
    return graph_time_us(calls, reps) * len(calls) / 1e3


def best_configs(sizes: set[int], pdl: bool, sms: int, reps: int) -> dict[int, dict]:
    """Each size's fastest config, timed alone over copies that overflow L2 twice (at least 8 copies)."""
    found = {}
    for nbytes in sorted(sizes):
        n = words(nbytes)
        copies = max(8, math.ceil(2 * L2_BYTES / max(nbytes, 1)))
        copies = min(copies, 64)
        bufs = [buffer(nbytes) for _ in range(copies)]
        out = torch.empty(8 * sms, dtype=torch.int32, device="cuda")
        best = None
        for config in CONFIGS:
            if n and config[0] > 4 * n and config != CONFIGS[0]:
                continue
            us = graph_time_us([launcher(b, out, config, pdl, sms) for b in bufs], reps)  # a call
            if best is None or us < best["us"]:
                best = {"config": list(config), "us": us}
        best["tb_s"] = nbytes / (best["us"] * 1e-6) / 1e12
        found[nbytes] = best
        del bufs
    return found


def time_chain(kernels, configs, pdl: bool, sms: int, reps: int) -> float:
    bufs = [buffer(b) for _, b in kernels]
    out = torch.empty(8 * sms, dtype=torch.int32, device="cuda")
    calls = [launcher(buf, out, configs[b]["config"], pdl, sms) for buf, (_, b) in zip(bufs, kernels)]
    ms = graph_ms(calls, reps)
    del bufs
    torch.cuda.empty_cache()
    return ms


PERSISTENT_CONFIGS = [(2048, 8, 1), (4096, 8, 1), (2048, 4, 2), (1024, 4, 4)]  # block, warps, programs/SM
PERSISTENT_CHAINS = ("int4", "int4-big5", "empty")


def time_persistent(kernels, sms: int, reps: int, limit: int = 20_000) -> list[dict]:
    """The chain as one persistent kernel (`persistent_kernel`), each config of PERSISTENT_CONFIGS with 0, 1 and 2
    blocks read ahead across each barrier, polling it with atomics and with plain loads. A run whose first launch
    had a barrier wait run out of polls (its programs were not all resident at once) is reported and not timed."""
    sizes = [words(b) for _, b in kernels]
    x = torch.ones(max(sum(sizes), 1), dtype=torch.int32, device="cuda")
    offs = torch.tensor([0] + list(itertools.accumulate(sizes)), dtype=torch.int64, device="cuda")
    bar = torch.zeros(2, dtype=torch.int32, device="cuda")
    rows = []
    for block, warps, per_sm in PERSISTENT_CONFIGS:
        programs = per_sm * sms
        out = torch.zeros(2 * programs, dtype=torch.int32, device="cuda")
        for ahead, load_poll in itertools.product((0, 1, 2), (False, True)):
            def call(ahead=ahead, load_poll=load_poll):
                persistent_kernel[(programs,)](x, offs, bar, out, len(sizes), limit, BLOCK=block, AHEAD=ahead,
                                               LOAD_POLL=load_poll, num_warps=warps)
            call()
            torch.cuda.synchronize()
            row = {"config": [block, warps, per_sm], "ahead": ahead, "poll": "load" if load_poll else "atomic",
                   "waits_out": int(out[programs:].sum()),
                   "sum_ok": int(out[:programs].sum()) == sum(sizes)}  # x is ones; a program's sum fits int32
            if not row["waits_out"]:
                row["ms"] = graph_ms([call], reps)
            rows.append(row)
    del x
    torch.cuda.empty_cache()
    return rows


def summed(device: str = "cuda", programs: int = 3, block: int = 1024) -> tuple[int, int]:
    """The kernel's partial sums over a known buffer, added up, and the buffer's sum: equal when it reads
    every word once."""
    x = torch.arange(10_007, dtype=torch.int32, device=device) % 97
    out = torch.zeros(programs, dtype=torch.int32, device=device)
    stream_kernel[(programs,)](x, out, x.numel(), BLOCK=block, PDL=False)
    return int(out.sum()), int(x.sum())


def persistent_summed(sizes: list[int], device: str = "cuda", programs: int = 3, block: int = 1024, ahead: int = 0,
                      limit: int = 1 << 20, load_poll: bool = False) -> tuple[int, int, int]:
    """The persistent kernel's partial sums over phases of `sizes` words, added up, the buffer's sum (equal when it
    reads every word once), and how many barrier waits ran out of polls; twice in a row, so that the counters'
    reset is checked too (the second run's figures are returned)."""
    x = torch.arange(sum(sizes), dtype=torch.int32, device=device) % 97
    offs = torch.tensor([0] + list(itertools.accumulate(sizes)), dtype=torch.int64, device=device)
    bar = torch.zeros(2, dtype=torch.int32, device=device)
    for _ in range(2):
        out = torch.zeros(2 * programs, dtype=torch.int32, device=device)
        persistent_kernel[(programs,)](x, offs, bar, out, len(sizes), limit, BLOCK=block, AHEAD=ahead,
                                       LOAD_POLL=load_poll)
    return int(out[:programs].sum()), int(x.sum()), int(out[programs:].sum())


def check_sum() -> None:
    got, want = summed()
    if got != want:
        raise SystemExit(f"stream_kernel summed {got}, expected {want}: its timings would not mean anything")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="directory for step_floor.json")
    ap.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    ap.add_argument("--context", type=int, default=192,
                    help="cached tokens a sequence (default: the mean of a 128-token prompt and 128 new tokens)")
    ap.add_argument("--reps", type=int, default=20, help="graph replays timed (median)")
    ap.add_argument("--list", action="store_true", help="print the step's kernels and bytes and stop (no GPU)")
    args = ap.parse_args()
    shape = SHAPES[args.shape]
    all_chains = chains(shape, args.context)
    if args.list:
        for name, kernels in all_chains.items():
            print(f"{name}: {len(kernels)} kernels, {sum(b for _, b in kernels) / 1e9:.3f} GB")
        return
    if not args.out:
        ap.error("--out is needed to measure (or --list to print the kernels)")
    if not torch.cuda.is_available():
        sys.exit("step_floor: measuring needs a CUDA GPU (--list prints the kernels without one)")
    check_sum()
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    sizes = {b for kernels in all_chains.values() for _, b in kernels}
    result = {"date": datetime.date.today().isoformat(), "gpu": props.name, "shape": args.shape,
              "context": args.context, "torch": torch.__version__, "triton": triton.__version__, "pdl": {}}
    for pdl in (False, True):
        configs = best_configs(sizes, pdl, sms, args.reps)
        entry = {"sizes": {str(k): v for k, v in configs.items()}, "chains": {}}
        for name, kernels in all_chains.items():
            ms = time_chain(kernels, configs, pdl, sms, args.reps)
            nbytes = sum(b for _, b in kernels)
            entry["chains"][name] = {"kernels": len(kernels), "bytes": nbytes, "ms": ms,
                                     "tb_s": nbytes / (ms * 1e-3) / 1e12}
        result["pdl"]["on" if pdl else "off"] = entry
    result["persistent"] = {}
    for name in PERSISTENT_CHAINS:
        kernels = all_chains[name]
        rows = time_persistent(kernels, sms, args.reps)
        nbytes = sum(b for _, b in kernels)
        for row in rows:
            if "ms" in row:
                row["tb_s"] = nbytes / (row["ms"] * 1e-3) / 1e12
        result["persistent"][name] = {"phases": len(kernels), "bytes": nbytes, "runs": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_floor.json").write_text(json.dumps(result, indent=1))
    print(f"# {props.name}: streaming kernels alone, best config (PDL off)")
    print("| bytes | us | TB/s | block, warps, programs/SM |")
    print("|---|---|---|---|")
    for nbytes, v in sorted(result["pdl"]["off"]["sizes"].items(), key=lambda kv: int(kv[0])):
        print(f"| {int(nbytes):,} | {v['us']:.2f} | {v['tb_s']:.2f} | {v['config']} |")
    print(f"\n# {props.name}: step chains, {args.shape}, context {args.context}")
    print("| chain | PDL | kernels | GB | ms a step | TB/s |")
    print("|---|---|---|---|---|---|")
    for pdl, entry in result["pdl"].items():
        for name, c in entry["chains"].items():
            print(f"| {name} | {pdl} | {c['kernels']} | {c['bytes'] / 1e9:.3f} | {c['ms']:.3f} | {c['tb_s']:.2f} |")
    print(f"\n# {props.name}: each chain as one persistent kernel, a grid barrier between phases")
    print("| chain | phases | GB | block, warps, programs/SM | blocks read ahead | poll | ms a step | TB/s | sums |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, c in result["persistent"].items():
        for r in c["runs"]:
            ms = f"{r['ms']:.3f} | {r['tb_s']:.2f}" if "ms" in r else f"not timed: {r['waits_out']} waits ran out | -"
            print(f"| {name} | {c['phases']} | {c['bytes'] / 1e9:.3f} | {r['config']} | {r['ahead']} | {r['poll']} | {ms} | "
                  f"{'ok' if r['sum_ok'] else 'WRONG'} |")


if __name__ == "__main__":
    main()

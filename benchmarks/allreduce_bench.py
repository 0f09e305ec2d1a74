"""Latency of the collectives a tensor-parallel decode step runs, on 2+ GPUs of one host: what one
`all_reduce` of a batch-1 hidden state ([1, 4096] bf16) costs through NCCL and through PyTorch's
symmetric memory (llmc's one-shot `SymmetricAllReduce`, no multicast), eagerly and captured in a CUDA graph (64
in one graph, as a decode step has 2 per layer), and what the driver's per-step gloo broadcast of
the step buffer (16384 int64) and the worker's result send cost between processes. Then both all_reduce
paths for 8 to 512 rows, to place the size where llmc switches from one to the other.

    python3 benchmarks/allreduce_bench.py --out OUT          # nvidia-h200-x2
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

N_GRAPH = 64  # collectives per graph: a 32-layer decode step's two per layer


def _time_graph(fn, device, reps: int = 50) -> float:
    """Microseconds per call of fn, N_GRAPH calls captured in one CUDA graph, replayed `reps` times."""
    s = torch.cuda.Stream(device)
    s.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(s)
    torch.cuda.synchronize(device)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(N_GRAPH):
            fn()
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize(device)
    dist.barrier()
    t = time.perf_counter()
    for _ in range(reps):
        g.replay()
    torch.cuda.synchronize(device)
    return 1e6 * (time.perf_counter() - t) / (reps * N_GRAPH)


def _time_eager(fn, device, reps: int = 200) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize(device)
    dist.barrier()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize(device)
    return 1e6 * (time.perf_counter() - t) / reps


def _gpu(rank: int, world: int, hidden: int, out: str) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    x = torch.randn(1, hidden, device=device, dtype=torch.bfloat16)
    res: dict[str, float | str] = {}
    res["nccl_eager_us"] = _time_eager(lambda: dist.all_reduce(x), device)
    res["nccl_graph_us"] = _time_graph(lambda: dist.all_reduce(x), device)
    y = x.clone()
    res["copy_graph_us"] = _time_graph(lambda: y.copy_(x), device)  # a graph node's own floor
    try:
        from llmc.ir.collectives import TorchCollectives
        coll = TorchCollectives(None, device, "symm")
        res["symm_eager_us"] = _time_eager(lambda: coll.all_reduce(x), device)
        res["symm_graph_us"] = _time_graph(lambda: coll.all_reduce(x), device)
        # back to back, each rank's input different per call (small integers, exact in bf16): every sum
        # exact (no buffer overwritten while a peer reads it), eagerly and in one graph
        xs = [torch.full((1, hidden), float(rank + 1 + i), device=device, dtype=torch.bfloat16)
              for i in range(N_GRAPH)]
        want = [world * (world + 1) / 2 + i * world for i in range(N_GRAPH)]
        outs = [coll.all_reduce(v) for v in xs]
        bad = sum(float((o.float() - w).abs().max()) > 0 for o, w in zip(outs, want))
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            outs = [coll.all_reduce(v) for v in xs]
        for _ in range(20):
            g.replay()
        torch.cuda.synchronize(device)
        bad += sum(float((o.float() - w).abs().max()) > 0 for o, w in zip(outs, want))
        res["symm_wrong_sums"] = bad
        # by size: a decode step's [rows, hidden] for more rows (llmc sends up to SymmetricAllReduce.MAX_BYTES
        # through symmetric memory, the rest through NCCL)
        from llmc.ir.collectives import SymmetricAllReduce
        big = SymmetricAllReduce(None, device, max_bytes=4 << 20)
        for rows in (8, 32, 128, 512):
            xr = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16)
            res[f"nccl_graph_us_{rows}rows"] = _time_graph(lambda: dist.all_reduce(xr), device, reps=20)
            res[f"symm_graph_us_{rows}rows"] = _time_graph(lambda: big(xr), device, reps=20)
    except Exception as e:  # noqa: BLE001 - reported: symmetric memory may be missing or refused here
        res["symm_mem_error"] = f"{type(e).__name__}: {e}"[:300]
    Path(out, f"gpu_rank{rank}.json").write_text(json.dumps(res))
    dist.destroy_process_group()


def _control(rank: int, world: int, capacity: int, out: str) -> None:
    """Rank 0 plays the driver: broadcast a step buffer of `capacity` int64, then receive an int64 result
    from rank 1."""
    dist.init_process_group("gloo", rank=rank, world_size=world)
    buf = torch.zeros(capacity, dtype=torch.int64)
    tok = torch.zeros(1, dtype=torch.int64)
    reps = 500
    for i in range(reps + 20):
        if i == 20:
            t = time.perf_counter()
        dist.broadcast(buf, 0)
        if rank == 0:
            dist.recv(tok, 1)
        elif rank == 1:
            dist.send(tok, 0)
    if rank == 0:
        Path(out, f"control{capacity}.json").write_text(json.dumps(1e6 * (time.perf_counter() - t) / reps))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = "29611"
    mp.spawn(_gpu, args=(a.world, a.hidden, str(out)), nprocs=a.world)
    control = {}
    for i, capacity in enumerate((16384, 64)):  # the step buffer's initial capacity, and a small one
        os.environ["MASTER_PORT"] = str(29612 + i)
        mp.spawn(_control, args=(a.world + 1, capacity, str(out)), nprocs=a.world + 1)
        control[capacity] = json.loads((out / f"control{capacity}.json").read_text())
    ranks = [json.loads((out / f"gpu_rank{r}.json").read_text()) for r in range(a.world)]
    summary = {"gpus": a.world, "hidden": a.hidden, "ranks": ranks, "gloo_step_and_result_us": control}
    (out / "allreduce_bench.json").write_text(json.dumps(summary, indent=1))
    print(f"# all_reduce of [1, {a.hidden}] bf16 over {a.world} GPUs, microseconds per call (rank 0)")
    for k, v in ranks[0].items():
        print(f"{k:24s} {v if isinstance(v, str) else round(v, 2)}")
    for capacity, us in control.items():
        print(f"{'gloo step+result ' + str(capacity):24s} {us:.1f}")


if __name__ == "__main__":
    main()

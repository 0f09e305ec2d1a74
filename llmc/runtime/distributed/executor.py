"""The multi-process executor: tensor and pipeline parallel workers behind the `Executor` protocol.

The driver (the engine's process) keeps the scheduler and the block manager and never computes:
it spawns TP x PP workers (llmc/runtime/distributed/worker.py), broadcasts each step's batch to
them (one gloo broadcast of plain integers) and receives the result from the last stage's rank 0.
The workers rendezvous through a TCP store that the driver hosts on 127.0.0.1 (a free port the OS
picks), so no port is guessed and nothing leaves the machine.

A worker that dies (an exception, which it reports first, or a kill) makes the watchdog thread stop
the others, so every pending operation fails at once; `execute` then raises an LLMCError that names
the worker and its error, and so does every later call. A step that returns nothing within
`step_timeout_s` fails the same way; the engine never hangs on a lost worker.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import torch

from llmc.errors import LLMCError
from llmc.ir.kv_layout import kv_cache_inputs
from llmc.ir.sharding import plan_sharding
from llmc.plugins import sources_for
from llmc.runtime.distributed import codec
from llmc.runtime.distributed.worker import CONTROL_TIMEOUT, WorkerSpec
from llmc.runtime.executor import Feed, StepBatch, StepResult, select_backend

STARTUP_TIMEOUT_S = 900.0
INITIAL_CAPACITY = 1 << 10  # int64s: a decode step's batch is tens; larger steps grow it (RESIZE)


class DistributedExecutor:
    """Runs an artifact over `tensor_parallel_size` x `pipeline_parallel_size` worker processes.

    Args:
        artifact: the loaded artifact (its path is what the workers load; its graph is checked here
            first, so that a size that cannot split fails before any process starts).
        tensor_parallel_size, pipeline_parallel_size: ranks per stage, stages.
        expert_parallel: split MoE experts by expert over the tensor-parallel ranks (llmc/ir/sharding.py).
        backend, device: as for `make_executor`; on GPUs worker w uses cuda:w with the kernel plan
            (NCCL), on the CPU the reference interpreter (gloo).
        step_timeout_s: how long a step may take before the executor gives up on the workers.
        cuda_graphs: on GPUs, each worker replays its steps as CUDA graphs, the tensor-parallel collectives
            captured inside; with pipeline stages each micro-batch that a graph fits replays its stage's
            graph, the sends and receives between stages running outside it.
        The other arguments are the KV cache options of `make_executor`, applied by every worker.

    Example:
        >>> ex = DistributedExecutor(llmc.load("tiny.llmc"), 2, 1, num_blocks=64)        # doctest: +SKIP
        >>> ex.execute(StepBatch([StepInput([1, 2, 3], 0, [0])])).logits.shape           # doctest: +SKIP
        >>> ex.close()                                                                    # doctest: +SKIP
    """

    def __init__(self, artifact, tensor_parallel_size: int, pipeline_parallel_size: int, backend: str = "auto",
                 device: str | None = None, block_size: int = 16, num_blocks: int | None = None,
                 kv_cache_dtype: str = "auto", memory_fraction: float = 0.5, num_cpu_blocks: int = 0,
                 max_model_len: int | None = None, step_timeout_s: float = 900.0, expert_parallel: bool = False,
                 cuda_graphs: bool = True):
        tp, pp = tensor_parallel_size, pipeline_parallel_size
        graph = artifact.graph
        plan_sharding(graph, tp, expert_parallel)  # errors now, in the driver, not in every worker
        layers = len(kv_cache_inputs(graph))
        if pp > layers:
            raise LLMCError(f"pipeline parallel size {pp} is larger than the model's {layers} layers; use at most "
                            f"{layers}")
        backend = select_backend(backend, device)
        if backend == "cuda" and torch.cuda.device_count() < tp * pp:
            raise LLMCError(f"tensor parallel size {tp} x pipeline parallel size {pp} needs {tp * pp} GPUs (one per "
                            f"worker), and torch sees {torch.cuda.device_count()}")
        if backend == "cuda" and device is not None and torch.device(device).index not in (None, 0):
            raise LLMCError(f"--device {device}: parallel workers use cuda:0 .. cuda:{tp * pp - 1}; leave --device "
                            "out (or set CUDA_VISIBLE_DEVICES)")
        plugins = sources_for(graph)  # the modules behind a user's ops: each worker imports them first
        self.tp, self.pp = tp, pp
        self.block_size, self.device = block_size, torch.device("cpu")  # results arrive on the host
        self.vocab = int(graph.outputs[0].type.shape[-1])
        self._gang = _Gang(tp * pp, tp, step_timeout_s)
        spec = dict(artifact=str(Path(artifact.path).resolve()), tp=tp, pp=pp, store_port=self._gang.store.port,
                    backend=backend, block_size=block_size, num_blocks=num_blocks, kv_cache_dtype=kv_cache_dtype,
                    memory_fraction=memory_fraction, num_cpu_blocks=num_cpu_blocks, expert_parallel=expert_parallel,
                    max_model_len=max_model_len or int(graph.meta.get("max_position_embeddings") or 4096),
                    step_timeout_s=step_timeout_s, capacity=INITIAL_CAPACITY,
                    cuda_graphs=cuda_graphs and backend == "cuda", plugins=[list(src) for src in plugins])
        self._finalizer = weakref.finalize(self, self._gang.close)
        try:
            self.num_blocks, self.kv_bytes = self._gang.start([WorkerSpec(rank=w, **spec) for w in range(tp * pp)])
        except BaseException:
            self.close()
            raise
        self._result_rank = (pp - 1) * tp + 1  # the last stage's tensor-parallel rank 0, in the control group

    @property
    def overlaps(self) -> bool:
        """Whether `launch` works: with one stage (every rank holds the step's argmax rows on its device)."""
        return self.pp == 1

    def execute(self, batch: StepBatch) -> StepResult:
        self._gang.send(codec.STEP, codec.encode(batch))
        return self._receive(batch)

    def launch(self, batch: StepBatch, feed: Feed | None = None, sample=None) -> "_RemoteLaunched":
        """The overlapped step of `LocalExecutor.launch`, over the workers: sent now, its tokens received when
        the engine asks (in launch order): the workers return them once the next step is enqueued, or on a
        FLUSH when the engine reads them before it sends another step."""
        assert self.overlaps and batch.greedy and not batch.chain and sample is None, "the workers take argmax rows"
        gang = self._gang
        gang.send(codec.STEP, codec.encode(batch, feed, launched=True))
        steps = gang.steps_sent

        def tokens() -> list[int]:
            if gang.steps_sent == steps:  # no step follows it: ask for its result (see PipelineStage.serve)
                gang.send(codec.FLUSH, [])
            return self._receive(batch).tokens.tolist()
        return _RemoteLaunched(tokens)

    def _receive(self, batch: StepBatch) -> StepResult:
        rows = batch.num_logits if batch.seqs else 0
        if rows == 0:
            self._gang.receive(torch.empty(1, dtype=torch.int64), self._result_rank)
            return StepResult(tokens=torch.empty(0, dtype=torch.int64)) if batch.greedy else \
                StepResult(logits=torch.empty(0, 0))
        if batch.greedy:
            return StepResult(tokens=self._gang.receive(torch.empty(rows, dtype=torch.int64), self._result_rank))
        return StepResult(logits=self._gang.receive(torch.empty(rows, self.vocab), self._result_rank))

    def close(self) -> None:
        """Stop the workers (also done when the executor is collected, and at exit)."""
        self._finalizer()

    @property
    def timings(self) -> dict:
        """Where the steps' time went, summed (seconds): the driver's broadcasts (`send_s`) and its waits for
        results (`receive_s`), and, once the workers have stopped (`close`), each worker's own
        (`workers`: per rank, wait_s, decode_s, step_s, send_s and steps; see PipelineStage.serve)."""
        return {**self._gang.timings, "workers": self._gang.worker_timings}


class _RemoteLaunched:
    """A step the workers run: its tokens arrive with `tokens()`; they stay on the workers' devices (the
    next step's Feed names rows of them), so the driver holds none."""

    device_tokens = None

    def __init__(self, receive):
        self.tokens = receive


class _Gang:
    """The worker processes, the store and control group they share with the driver, and their watchdog.
    Kept apart from the executor so that the finalizer and the watchdog hold no reference to it."""

    def __init__(self, world: int, tp: int, step_timeout_s: float):
        from torch.distributed import TCPStore
        self.world, self.tp, self.timeout = world, tp, datetime.timedelta(seconds=step_timeout_s)
        self.store = TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False,
                              timeout=self.timeout)
        self.procs: list = []
        self.control = None
        self.failure: str | None = None
        self.closing = False
        self.capacity = INITIAL_CAPACITY  # the step broadcast's length, as the workers expect it
        self.timings = {"send_s": 0.0, "receive_s": 0.0}
        self.steps_sent = 0  # STEP and FLUSH messages: a launched step's result is read after one more
        self.worker_timings: list[dict] = []
        self._died = threading.Event()
        self._lock, self._ended = threading.Lock(), False

    def start(self, specs: list[WorkerSpec]) -> tuple[int, int]:
        """Start the workers, wait until each has its shard and cache, agree on the cache size; returns
        (num_blocks, kv bytes over all workers).

        Workers are fresh interpreters (`python -m llmc.runtime.distributed SPEC`), not
        multiprocessing children: fork would copy the driver's threads and CUDA state, and spawn
        re-imports the caller's main module, which breaks scripts without a `__main__` guard."""
        import torch.distributed as dist
        from torch.distributed import PrefixStore
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[3])  # the directory that holds the llmc package
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
        for spec in specs:
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "llmc.runtime.distributed", json.dumps(dataclasses.asdict(spec))],
                env=env, stdin=subprocess.DEVNULL))
        for w in range(self.world):
            threading.Thread(target=self._watch, args=(w,), daemon=True, name=f"llmc-watch-worker-{w}").start()
        keys = [f"ready/{w}" for w in range(self.world)]
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self.store.check(keys):
            if self._died.wait(0.02):
                self.raise_failure("while starting")
            if time.monotonic() > deadline:
                self._fail(f"the workers did not start within {STARTUP_TIMEOUT_S:.0f} s")
                self.raise_failure("while starting")
        ready = [json.loads(self.store.get(k)) for k in keys]
        num_blocks = min(r["num_blocks"] for r in ready)
        self.store.set("num_blocks", str(num_blocks))
        self.control = dist.ProcessGroupGloo(PrefixStore("control", self.store), 0, self.world + 1, CONTROL_TIMEOUT)
        return num_blocks, num_blocks * sum(r["block_bytes"] for r in ready)

    def send(self, op: int, payload: list[int]) -> None:
        """Broadcast a message to every worker (growing the broadcast buffer on both sides first if needed)."""
        if codec.HEADER + len(payload) > self.capacity:
            grown = max(2 * self.capacity, codec.HEADER + len(payload))
            self._broadcast(codec.message(codec.RESIZE, [grown], self.capacity))
            self.capacity = grown
        self._broadcast(codec.message(op, payload, self.capacity))
        self.steps_sent += op in (codec.STEP, codec.FLUSH)

    def _broadcast(self, buf: torch.Tensor) -> None:
        import torch.distributed as dist
        self._check()
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        t = time.perf_counter()
        try:
            self.control.broadcast([buf], opts).wait(self.timeout)
        except RuntimeError as e:
            self._lost(e)
        self.timings["send_s"] += time.perf_counter() - t

    def receive(self, buf: torch.Tensor, src: int) -> torch.Tensor:
        self._check()
        t = time.perf_counter()
        try:
            self.control.recv([buf], src, 0).wait(self.timeout)
        except RuntimeError as e:
            self._lost(e)
        self.timings["receive_s"] += time.perf_counter() - t
        return buf

    def _check(self) -> None:
        if self.failure is not None:
            self.raise_failure()

    def _lost(self, e: Exception) -> None:
        """A control operation failed: a worker died (the watchdog says which) or the step timed out."""
        if not self._died.wait(1.0):
            self._fail(f"no answer from the workers within {self.timeout.total_seconds():.0f} s")
        self.raise_failure("during a step")

    def raise_failure(self, when: str = "") -> None:
        if when == "while starting":
            raise LLMCError(f"distributed executor: {self.failure} (while starting)")
        raise LLMCError(f"distributed executor: {self.failure}{' (' + when + ')' if when else ''}; it cannot run "
                        "more steps: create a new engine")

    def _watch(self, rank: int) -> None:
        """Wait for worker `rank` to end; if it is the first to end while the driver is not closing, record why
        and stop the others, so that nothing waits on the dead one (they fail as a consequence of it)."""
        code = self.procs[rank].wait()
        with self._lock:
            first, self._ended = not self._ended, True
        if self.closing or not first:
            return
        if self.store.check([f"error/{rank}"]):
            what = self.store.get(f"error/{rank}").decode()
        elif code < 0:
            what = f"killed by signal {signal.Signals(-code).name}"
        else:
            what = f"exited with code {code}"
        self._fail(f"worker {rank} (tensor-parallel rank {rank % self.tp}, pipeline stage {rank // self.tp}) "
                   f"failed: {what}")

    def _fail(self, why: str) -> None:
        if self.failure is None:
            self.failure = why
        self._kill()
        self._died.set()

    def _kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()

    def close(self) -> None:
        self.closing = True
        if self.control is not None and self.failure is None:
            try:
                self.send(codec.STOP, [])
            except LLMCError:
                pass
        deadline = time.monotonic() + 5.0
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self._kill()
        for p in self.procs:
            p.wait()
        keys = [f"timings/{w}" for w in range(self.world)]
        if self.failure is None and self.store.check(keys):
            self.worker_timings = [json.loads(self.store.get(k)) for k in keys]
        self.control = None

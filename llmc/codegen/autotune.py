"""Compile-time autotuning: time candidate configs once per kernel and shape bucket, keep the fastest.

Choices live in `tuning.json` beside the artifact's graph and are reused at load without retuning
(a linear at a bucket that was not tuned, e.g. a prefill of 128 tokens or more, runs cuBLAS):

    {"format": 1, "device": "NVIDIA H200", "triton": "3.6.0",
     "kernels": {kernel_key: {bucket: {"config": {...}, "triton_ms": 0.011,
                                       "cublas_ms": 0.013, "prefer_cublas": false}}}}

`kernel_key` names the kernel and the static part of its shape (for a linear: dtype, bias,
epilogue, N and K); `bucket` the dynamic part (the token count M, rounded up to a power of two, 128+
for prefill). The buckets of 1 to 64 tokens share one choice (`JOINT_BUCKETS`): where that is the
generated kernel, every step of up to 64 tokens runs the same 16-row tiles, so a sequence's sums are
bitwise the same alone or among others; a tie goes to it (`JOINT_MARGIN`). Where cuBLAS wins for
the group by more, cuBLAS picks its own kernels per size, as under torch (`llmc compile
--no-batch-invariant`: only 1 to 4 share, `DECODE_JOINT_BUCKETS`, where int4 weights can take the
FMA-pipe GEMV of qmatmul.py). Timing needs a GPU: on CPU and
under the interpreter the first (default) candidate is returned untimed and nothing is recorded,
so a CPU compile never writes choices it did not measure.
The cuBLAS time is kept beside the best Triton time so the lowering can keep cuBLAS where it wins.

A cold tuning compiles its candidates (about a second each) and times them: `warm_up` first runs every
candidate once on threads, so that they compile in parallel, and `gpu_time_ms` times each in a few
milliseconds of CUDA graph replays.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from llmc.errors import ArtifactError

log = logging.getLogger(__name__)

FORMAT = 1
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
# buckets that share one choice (timed on their summed time), so that where the generated kernel
# is chosen a sequence's GEMMs sum in the same order whatever it shares a step with. Batch-invariant
# (the default): every step of up to 64 tokens, decode batches and short prefills alike. Otherwise
# only decode batches of up to 16 share; 32 and 64 get taller tiles of their own (faster at those
# sizes, not invariant).
JOINT_BUCKETS = ("1", "2", "4", "8", "16", "32", "64")
DECODE_JOINT_BUCKETS = ("1", "2", "4")
# cuBLAS wins a single bucket only when the generated kernel is not 3% faster (`margin` 0.97: a tie
# keeps the library); it wins a joint group only when it is 3% faster than the generated kernel, as
# only the generated kernel keeps a row's sums the same at every batch size (cuBLAS picks kernels,
# and split-K, per size), and only it runs split-K in one launch, where cuBLAS adds a reduce kernel
JOINT_MARGIN = 1.03


def m_bucket(m: int) -> str:
    """The shape bucket of a token count: "1", "2", "4", ..., "64", or "128+"."""
    for b in M_BUCKETS[:-1]:
        if m <= b:
            return str(b)
    return "128+"


def bucket_size(bucket: str) -> int:
    """The largest M of a bucket (128 stands for 128 and more)."""
    return int(bucket.rstrip("+"))


@dataclass
class TuneRecord:
    """One choice: the fastest config, its time, cuBLAS's time for the same work (ms), and the verdict."""

    config: dict[str, Any]
    triton_ms: float | None = None
    cublas_ms: float | None = None
    prefer_cublas: bool = False


@functools.lru_cache(maxsize=1)
def _device_name() -> str | None:
    try:
        import torch
        return torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except Exception:
        return None


def can_time() -> bool:
    """True when kernels run compiled on a GPU (not on CPU, not under TRITON_INTERPRET)."""
    from llmc.codegen.elementwise import interpreting
    return _device_name() is not None and not interpreting()


@functools.lru_cache(maxsize=None)
def shared_memory_limit(index: int) -> int:
    """The bytes of shared memory one program may use on CUDA device `index` (its opt-in limit)."""
    import torch
    props = torch.cuda.get_device_properties(index)
    limit = getattr(props, "shared_memory_per_block_optin", 0)
    if not limit:
        from triton.runtime import driver
        limit = driver.active.utils.get_device_properties(index)["max_shared_mem"]
    return int(limit)


def fit_stages(cfg: dict, stage_bytes: int, device) -> dict:
    """`cfg` with no more software-pipelining stages than fit the device's shared memory, where each buffered
    stage holds `stage_bytes` of tiles (Triton 3.6 keeps num_stages - 1 of them). A config that fits comes back as
    it is; one that does not (fp32 tiles, the gated kernel's two weight tiles, a config recorded on a GPU with
    more shared memory) runs fewer stages rather than failing to launch, the same way whenever it is timed or
    run. Stages change no result, only how far the loads run ahead (and the interpreter ignores them)."""
    if getattr(device, "type", None) != "cuda":
        return cfg
    import torch
    limit = shared_memory_limit(torch.cuda.current_device() if device.index is None else device.index)
    stages = cfg["num_stages"]
    while stages > 1 and (stages - 1) * stage_bytes > limit:
        stages -= 1
    return cfg if stages == cfg["num_stages"] else dict(cfg, num_stages=stages)


GRAPH_MS = 2.0  # GPU time of one timed replay
REPLAYS = 5
MAX_CALLS = 256


def gpu_time_ms(fn: Callable[[], Any]) -> float:
    """Milliseconds per call of `fn` replayed as a CUDA graph, as the runtime replays decode steps.

    The graph holds as many calls as take about GRAPH_MS on the GPU (at most MAX_CALLS), and the median of
    REPLAYS replays is the time. Plain `do_bench` times Python launch overhead too (tens of microseconds,
    as long as a decode linear itself), which would make every tile look alike; triton's
    `do_bench_cudagraph` sizes its graph from that eager time and replays it ten times, about 0.2 s a
    candidate, most of a warm compile's tuning. Eager `do_bench` is the fallback when `fn` cannot be
    captured.
    """
    from triton.testing import do_bench
    try:
        return _graph_time_ms(fn)
    except Exception as e:
        log.debug("autotune: CUDA graph timing failed (%s), timing eagerly", e)
        return float(do_bench(fn, warmup=10, rep=40, return_mode="median"))


def _graph_time_ms(fn: Callable[[], Any], graph_ms: float = GRAPH_MS, replays: int = REPLAYS) -> float:
    import torch
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # allocations and first-launch work outside the graphs
    stream.synchronize()

    def graph_of(calls: int):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            for _ in range(calls):
                fn()
        return g

    def replayed_ms(g, times: int) -> list[float]:
        out = []
        for _ in range(times):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            g.replay()
            end.record(stream)
            end.synchronize()
            out.append(start.elapsed_time(end))
        return out

    with torch.cuda.stream(stream):
        one = graph_of(1)
        estimate = sorted(replayed_ms(one, 3))[1]
        del one
        calls = max(1, min(MAX_CALLS, int(graph_ms / max(estimate, 1e-4))))
        many = graph_of(calls)
        times = sorted(t / calls for t in replayed_ms(many, replays))
        del many
    return float(times[len(times) // 2])


def tune_threads() -> int:
    """Threads that run a tuning's candidates once before they are timed (`warm_up`): $LLMC_TUNE_THREADS,
    else one per core, at most 16; 0 or 1 compiles each candidate when it is first timed."""
    v = os.environ.get("LLMC_TUNE_THREADS", "")
    return int(v) if v.strip().isdigit() else min(16, os.cpu_count() or 1)


def choose_timed(timed: Sequence[tuple[float, dict]], lighter: Callable[[dict], Any] | None = None,
                 within: float = 0.0) -> tuple[float, dict]:
    """The (time, config) chosen of `timed` (non-empty): the fastest, the first of equal times; with `lighter`,
    the config of least weight among those within `within` of the fastest time (the fastest of equal weight)."""
    best = min(timed, key=lambda t: t[0])
    if lighter is None:
        return best
    return min((t for t in timed if t[0] <= best[0] * (1 + within)), key=lambda t: (lighter(t[1]), t[0]))


def warm_up(candidates: Sequence[dict], bench: Callable[[dict], Any]) -> None:
    """Run each candidate once, on threads, so that their kernels compile in parallel before any is timed
    (`run_on_threads`). A candidate that fails here is left for the timing to skip, as it skips any config
    that does not launch."""
    run_on_threads([functools.partial(bench, dict(c)) for c in candidates])


def run_on_threads(calls: Sequence[Callable[[], Any]], shared_kernels: bool = False) -> None:
    """Run each call once, on threads (`tune_threads`; none where that is below 2), so that the kernels
    they launch compile in parallel; during a compile with worker processes (`precompile.CompilePool`,
    LLMC_TUNE_PROCESSES) those kernels are compiled there first.

    Triton's compiler releases the GIL (its MLIR passes run in C++, ptxas in a subprocess). Every launch goes
    to the caller's current stream, so the kernels still run one after another on the GPU, and no two
    share a split-K tile counter at once. A call that fails is logged and left to its caller's own run.

    Triton's once-per-process set-up is done first (`triton_setup.ready`), so that the threads do not each
    do it. With `shared_kernels` (calls that share kernels: a linear's token buckets with one recorded
    choice) and no worker processes, the kernels the calls would compile are collected first
    (`precompile.collect`, each call run once without compiling or launching) and each distinct one is
    compiled once on the threads; each call would otherwise compile it at the same time, Triton having no
    lock there. The calls then run on the threads, finding their kernels compiled.
    """
    import contextlib
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from llmc.codegen import precompile, triton_setup
    triton_setup.ready()
    pool = precompile.active()
    if pool is not None:  # their kernels compiled in worker processes first: the runs below find them cached
        pool.compile(calls)
    n = min(len(calls), tune_threads())
    if n < 2:
        return
    stream = torch.cuda.current_stream() if torch.cuda.is_available() else None

    def run(call: Callable[[], Any]) -> None:
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            call()
    with ThreadPoolExecutor(n, thread_name_prefix="llmc-tune") as threads:
        if shared_kernels and pool is None and triton_setup.enabled():
            precompile.compile_ahead(calls, threads)
        for i, f in [(i, threads.submit(run, c)) for i, c in enumerate(calls)]:
            try:
                f.result()
            except Exception as e:  # noqa: BLE001 - the caller's own run meets it again
                log.debug("autotune: warm-up call %d failed: %s", i, e)
    if stream is not None:
        stream.synchronize()


class Tuner:
    """Chooses a config per (kernel_key, bucket), timing candidates with triton.testing on CUDA (`gpu_time_ms`).

    Args:
        records: {kernel_key: {bucket: TuneRecord-as-dict}} from an earlier run (see `load`).
        device: the GPU name the records were measured on (default: the current one).

    Example:
        >>> t = Tuner()
        >>> t.choose("k", "1", [{"BLOCK": 64}, {"BLOCK": 128}], bench=lambda cfg: None)  # on CPU: untimed
        {'BLOCK': 64}
    """

    def __init__(self, records: dict[str, dict[str, dict]] | None = None, device: str | None = None,
                 frozen: bool = False, joint: Sequence[str] = JOINT_BUCKETS):
        self.records: dict[str, dict[str, dict]] = records or {}
        self.device = device or _device_name()
        self.frozen = frozen  # an artifact's choices: looked up, never timed at run time
        self.joint = tuple(joint)  # the buckets that share one choice
        self.used: set[str] = set()  # keys chosen through this tuner (recorded or timed)
        self.cache_path: Path | None = None  # `persistent`'s file
        # keep the generated kernel in the joint buckets even where cuBLAS was faster (`from_artifact`)
        self.invariant = False

    def lookup(self, key: str, bucket: str) -> TuneRecord | None:
        rec = self.records.get(key, {}).get(bucket)
        if rec is None:
            return None
        if self.invariant and rec.get("prefer_cublas") and rec.get("config") and bucket in self.joint:
            rec = {**rec, "prefer_cublas": False}
        return TuneRecord(**rec)

    def choose(self, key: str, buckets: str | Sequence[str], candidates: Sequence[dict],
               bench: Callable[[dict], Any], baseline: Callable[[], Any] | None = None,
               margin: float = 0.97, lighter: Callable[[dict], Any] | None = None,
               within: float = 0.0, accept: Callable[[dict], bool] | None = None) -> dict:
        """The config for `key` at `buckets`: recorded, else timed now (GPU), else the first candidate.

        Args:
            key: the kernel and static shape the choice is recorded under.
            buckets: one bucket, or several that must share one choice (`bench` and `baseline` then
                run every one of them, so the time compared is their sum); recorded under each.
            candidates: configs (plain JSON dicts), the default first.
            bench: runs the kernel once with a config (timed as a CUDA graph; a config that fails is skipped).
            baseline: runs the cuBLAS/torch equivalent once; its time is recorded beside the best.
            margin: cuBLAS is preferred unless Triton is faster than `margin` times its time.
            lighter: a config's weight on the GPU beside the kernels around it (say, its warps): among the
                configs within `within` (a fraction) of the fastest time, the one of least weight is chosen,
                for what a timing of the kernel alone cannot see (how much of the GPU it holds while the
                next kernel's programs are placed beside it).
            within: the tolerance `lighter` looks within (0.02: configs up to 2% slower than the fastest).
            accept: whether a recorded config may still run here (a kernel a setting now keeps out, such as
                `LLMC_QWGMMA=0`, recorded by an earlier compile or a shipped table): one it refuses is timed
                afresh among `candidates` and the record replaced, for every bucket of the group alike. A
                frozen tuner (an artifact's) keeps its records.

        Returns:
            The chosen config.
        """
        assert candidates, "no candidate configs"
        if not can_time():
            return dict(candidates[0])
        buckets = (buckets,) if isinstance(buckets, str) else tuple(buckets)
        rec = self.lookup(key, buckets[0])
        if rec is not None and (self.frozen or accept is None or accept(rec.config)):
            self.used.add(key)
            return rec.config
        if self.frozen:
            return dict(candidates[0])
        rec = self.tune(candidates, bench, baseline, margin, lighter, within)
        self.used.add(key)
        for b in buckets:
            self.records.setdefault(key, {})[b] = asdict(rec)
        log.info("autotune %s [%s]: %s in %.4f ms (cuBLAS %s ms)", key, ",".join(buckets), rec.config,
                 rec.triton_ms or -1, rec.cublas_ms)
        return rec.config

    @staticmethod
    def tune(candidates: Sequence[dict], bench: Callable[[dict], Any], baseline: Callable[[], Any] | None,
             margin: float = 0.97, lighter: Callable[[dict], Any] | None = None,
             within: float = 0.0) -> TuneRecord:
        timed, failed = [], None
        warm_up(candidates, bench)
        for cfg in candidates:
            try:
                timed.append((gpu_time_ms(lambda: bench(cfg)), dict(cfg)))
            except Exception as e:  # out of shared memory or registers for this tile: not a candidate
                log.debug("autotune: config %s failed: %s", cfg, e)
                failed = e
        if not timed:  # the last failure says why (device memory held elsewhere, a kernel that cannot build)
            raise RuntimeError(f"autotune: every candidate failed ({list(candidates)}); the last with "
                               f"{type(failed).__name__}: {str(failed)[:300]}")
        best_ms, best = choose_timed(timed, lighter, within)
        cublas_ms = gpu_time_ms(baseline) if baseline is not None else None
        prefer = cublas_ms is not None and best_ms > margin * cublas_ms
        return TuneRecord(best, float(best_ms), None if cublas_ms is None else float(cublas_ms), prefer)

    def to_json(self, keys: set[str] | None = None) -> dict:
        """The tuning.json contents: every record, or those of `keys` only."""
        import triton
        kernels = self.records if keys is None else {k: v for k, v in self.records.items() if k in keys}
        return {"format": FORMAT, "device": self.device, "triton": triton.__version__,
                "joint_buckets": list(self.joint), "kernels": kernels}

    @classmethod
    def persistent(cls, joint: Sequence[str] = JOINT_BUCKETS) -> "Tuner":
        """A tuner that starts from the choices earlier compiles on this GPU timed (`cache_file`), so
        a shape tuned once is never timed again; `save_cache` adds what it times."""
        t = cls(joint=joint)
        t.cache_path = cache_file(t.device, t.joint) if t.device is not None else None
        t.records = _shipped_records(t.cache_path)
        for key, by_bucket in _cached_records(t.cache_path).items():  # this machine's own timings win
            t.records.setdefault(key, {}).update(by_bucket)
        return t

    def save_cache(self) -> None:
        """Merge this tuner's records into its cache file (written atomically; another compile's
        records since `persistent` are kept)."""
        if self.cache_path is None:
            return
        self.cache_path.parent.mkdir(parents=True, exist_ok=True)
        merged = _cached_records(self.cache_path)
        for key, by_bucket in self.records.items():
            merged.setdefault(key, {}).update(by_bucket)
        Tuner(merged, self.device, joint=self.joint).save(self.cache_path)

    def save(self, path: str | Path) -> None:
        """Write tuning.json atomically (plain JSON, sorted keys for stable diffs)."""
        path = Path(path)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(self.to_json(), f, indent=1, sort_keys=True)
        os.replace(tmp, path)

    @classmethod
    def from_artifact(cls, tuning: dict | None, invariant: bool = False) -> "Tuner | None":
        """The frozen tuner of an artifact's tuning.json contents (it never times anything: a shape
        or bucket with no record runs cuBLAS); None when it holds no records.

        `invariant`: a linear whose joint buckets recorded cuBLAS as faster runs the generated kernel
        there all the same (the group's recorded config), so that a sequence's sums are the same at every
        step width up to the joint buckets' largest: what speculative decoding's verify steps need for
        greedy tokens equal to plain decoding's (cuBLAS picks its kernels, and split-K, per size, so a row
        of a step of 32 and of one of 40 may sum differently). It costs what cuBLAS won by, recorded beside
        the choice (14% on the 8B shape's qkv in the shipped H200 table: 0.1212 against 0.1062 ms)."""
        if not (tuning and tuning.get("kernels")):
            return None
        t = cls.from_json(tuning)
        t.frozen, t.invariant = True, invariant
        return t

    @classmethod
    def from_json(cls, data: dict) -> "Tuner":
        if data.get("format") != FORMAT:
            raise ArtifactError(f"tuning.json has format {data.get('format')!r}; this llmc reads format {FORMAT}: "
                                f"recompile the artifact, or delete tuning.json to use default tiles")
        here = _device_name()
        if here is not None and data.get("device") not in (None, here):
            log.warning("tuning.json was measured on %s, this is %s: its choices are not used (recompile to "
                        "tune here)", data.get("device"), here)
            return cls()
        return cls(data.get("kernels", {}), data.get("device"), joint=data.get("joint_buckets", JOINT_BUCKETS))

    @classmethod
    def load(cls, path: str | Path) -> "Tuner":
        """The tuner of a tuning.json; an empty one when the file is missing."""
        path = Path(path)
        if not path.exists():
            return cls()
        return cls.from_json(json.loads(path.read_text()))


def _cached_records(path: Path | None) -> dict:
    """The records of a tuning cache file: empty when there is none, and when it is damaged or of an
    older format (rebuilt, never fatal)."""
    if path is None or not path.exists():
        return {}
    try:
        return Tuner.load(path).records
    except (ValueError, ArtifactError) as e:
        log.warning("autotune: ignoring the tuning cache %s (%s)", path, e)
        return {}


SHIPPED_DIR = Path(__file__).parent / "tuned"


def _shipped_records(cache_path: Path | None) -> dict:
    """The choices shipped with llmc for a tuning cache (`SHIPPED_DIR`, a file of the cache's own name: the
    same GPU, triton version, joint buckets and kernel sources), so that a compile of a common shape on a
    common GPU starts tuned; empty where none is shipped, or where the kernels changed since it was made."""
    return _cached_records(SHIPPED_DIR / cache_path.name) if cache_path is not None else {}


# codegen modules that generate no kernel (they time, compile or set Triton up): a change to them keeps the
# tuning caches and the shipped tables valid
NOT_KERNEL_SOURCES = frozenset({"autotune.py", "precompile.py", "triton_setup.py"})


def cache_file(device: str, joint: Sequence[str]) -> Path:
    """The tuning cache of compiles on `device` that share `joint` buckets: one file per GPU name,
    triton version and version of llmc's kernel generators (its codegen sources and templates), so a
    change to any kernel or candidate list starts a fresh one."""
    import hashlib

    import triton
    from llmc.codegen.cache import cache_root
    h = hashlib.sha256()
    for f in sorted(Path(__file__).parent.rglob("*")):
        if f.suffix in (".py", ".jinja") and f.is_file() and f.name not in NOT_KERNEL_SOURCES:
            h.update(f.name.encode())
            h.update(f.read_bytes())
    for part in (device, triton.__version__, ",".join(joint)):
        h.update(part.encode())
    slug = "".join(c if c.isalnum() else "-" for c in device).strip("-").lower()
    return cache_root() / "tuning" / f"{slug}-{h.hexdigest()[:16]}.json"


def timing_io(group, k: int, n: int, dtype, device):
    """A function giving (x [m, k], y [m, n]) for every bucket of `group`: a GEMM choice's timing
    inputs, made on the first call (only when the choice is timed now, not when it is recorded)."""
    import threading

    import torch
    made: list = []
    lock = threading.Lock()  # made once, also when a warm-up's threads ask at once

    def io():
        with lock:
            if not made:
                made.extend((torch.randn(bucket_size(g), k, dtype=dtype, device=device),
                             torch.empty(bucket_size(g), n, dtype=dtype, device=device)) for g in group)
        return made
    return io

"""Triton kernels compiled in worker processes, into Triton's on-disk cache, before a tuning launches them.

A compile's tuning runs each candidate once on threads so that their kernels compile in parallel
(`autotune.run_on_threads`). Part of every Triton compile is Python (its code generator) and holds the GIL:
on one core, a thread busy in Python beside a compile slows the compile 1.8x. With 16 threads compiling at once
they queue on the GIL. Workers are separate interpreters, so they compile on every core at once.

How a kernel is compiled elsewhere: the calls are run once with Triton's `jit_cache_hook`, which is handed
every kernel the calls would compile and, returning True, keeps it from compiling or launching here. Each
hands over its specialization data (Triton's own serialised signature, constexprs, alignment attributes,
options and target). A worker imports the kernel's rendered module from its file (llmc's kernel cache: the
same source, so the same cache key) and `preload`s that data, so Triton compiles the kernel into the cache
directory it shares with this process. The calls then run as before, and each compile is a cache hit. A request
that fails in a worker is logged and compiled here as it would have been.

Workers start with `CompilePool` (`LLMC_TUNE_PROCESSES=N`; off by default until measured on a GPU) when a
compile begins, so that their imports overlap the capture. They run `python -m llmc.codegen.precompile`,
never a fork of this process and never the caller's main module. A request is one JSON line; the answer is
one JSON line.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import subprocess
import sys
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Sequence

log = logging.getLogger(__name__)

_ACTIVE: "CompilePool | None" = None


def tune_processes() -> int:
    """Worker processes for a compile's kernel compiles: $LLMC_TUNE_PROCESSES (0 or unset: none)."""
    v = os.environ.get("LLMC_TUNE_PROCESSES", "")
    return int(v) if v.strip().isdigit() else 0


def active() -> "CompilePool | None":
    """The pool of the compile in progress, if it has one."""
    return _ACTIVE


@dataclass(frozen=True)
class Request:
    """One kernel to compile: its rendered module (name and file) and function, and Triton's specialization
    data for it."""

    module: str
    path: str
    name: str
    data: str

    def line(self) -> str:
        return json.dumps({"module": self.module, "path": self.path, "name": self.name, "data": self.data})


def collect(calls: Sequence[Callable[[], Any]]) -> list[Request]:
    """The kernels that `calls` would compile, one request each (in order, without repeats), found by running
    each call with Triton's `jit_cache_hook`: nothing compiles or launches meanwhile. A call that fails is
    skipped (its own run meets the error again)."""
    from triton import knobs

    found: dict[tuple[str, str], Request] = {}

    def hook(*, fn, compile, **_):
        m = getattr(fn, "module", None)  # the function's module name (typed as the module in some versions)
        mod = m if isinstance(m, ModuleType) else sys.modules.get(m) if isinstance(m, str) else None
        path = getattr(mod, "__file__", None)
        data = compile.get("specialization_data") if isinstance(compile, dict) else None
        if getattr(fn, "jit_function", None) is not None and path is not None and data is not None:
            found.setdefault((mod.__name__, data), Request(mod.__name__, path, fn.name, data))
        return True  # nothing compiles here: one no worker can import compiles on the threads after, as before

    before = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = hook
    try:
        for call in calls:
            try:
                call()
            except Exception as e:  # noqa: BLE001 - the caller's own run meets it again
                log.debug("precompile: a call failed while its kernels were collected: %s", e)
    finally:
        knobs.runtime.jit_cache_hook = before
    return list(found.values())


def compile_ahead(calls: Sequence[Callable[[], Any]], threads) -> int:
    """Compile each distinct kernel that `calls` would compile (`collect`) on `threads`, a
    concurrent.futures executor; returns how many. A compile that fails is logged and left to the call
    that launches the kernel, which compiles it (or fails) itself."""
    reqs = collect(calls)
    for r, f in [(r, threads.submit(compile_here, r)) for r in reqs]:
        try:
            f.result()
        except Exception as e:  # noqa: BLE001 - see above
            log.debug("precompile: compiling %s of %s ahead failed: %s", r.name, r.module, e)
    return len(reqs)


class CompilePool:
    """Worker processes that compile kernels into Triton's on-disk cache (module docstring).

    Args:
        workers: how many; each is `python -m llmc.codegen.precompile` with this process's environment.
        command: the worker's command line (tests run a stand-in).
    """

    def __init__(self, workers: int, command: Sequence[str] | None = None):
        self.command = list(command or [sys.executable, "-m", "llmc.codegen.precompile"])
        self.procs: list[subprocess.Popen] = []
        for _ in range(max(0, workers)):
            try:
                self.procs.append(subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                   stderr=subprocess.DEVNULL, text=True, bufsize=1))
            except OSError as e:
                log.info("precompile: could not start a worker (%s); compiling on threads", e)
                break
        self.compiled = self.failed = 0

    def run(self, requests: Sequence[Request]) -> int:
        """Compile `requests` on the workers, each worker taking the next as it finishes one; returns how
        many compiled. A worker that dies is left out from then on."""
        todo: queue.Queue = queue.Queue()
        for r in requests:
            todo.put(r)
        done = [0]
        lock = threading.Lock()

        def feed(proc: subprocess.Popen) -> None:
            while proc.poll() is None:
                try:
                    r = todo.get_nowait()
                except queue.Empty:
                    return
                try:
                    proc.stdin.write(r.line() + "\n")
                    proc.stdin.flush()
                    answer = json.loads(proc.stdout.readline() or '{"ok": false, "error": "the worker exited"}')
                except (OSError, ValueError) as e:
                    answer = {"ok": False, "error": str(e)}
                with lock:
                    if answer.get("ok"):
                        done[0] += 1
                    else:
                        self.failed += 1
                        log.debug("precompile: %s of %s failed in a worker: %s", r.name, r.module, answer.get("error"))
        threads = [threading.Thread(target=feed, args=(p,), daemon=True) for p in self.procs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.compiled += done[0]
        return done[0]

    def compile(self, calls: Sequence[Callable[[], Any]]) -> int:
        """The kernels `calls` would compile, compiled on the workers first (`collect`, then `run`)."""
        if not self.procs:
            return 0
        return self.run(collect(calls))

    def close(self) -> None:
        for p in self.procs:
            with contextlib.suppress(OSError):
                p.stdin.close()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        self.procs = []

    def __enter__(self) -> "CompilePool":
        global _ACTIVE
        self._outer, _ACTIVE = _ACTIVE, self
        return self

    def __exit__(self, *exc) -> bool:
        global _ACTIVE
        _ACTIVE = self._outer
        self.close()
        return False


def _import(module: str, path: str):
    import importlib.util
    if module not in sys.modules:
        spec = importlib.util.spec_from_file_location(module, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[module] = mod
        spec.loader.exec_module(mod)
    return sys.modules[module]


def compile_here(r: Request) -> None:
    """Compile the kernel of a request in this process (Triton's `preload`: into its in-memory and on-disk
    caches, so that the launch that needs it finds it compiled)."""
    # a JITFunction (or a kernels.PDLKernel, which hands preload to the one it holds)
    getattr(_import(r.module, r.path), r.name).preload(r.data)


def serve(lines, write) -> None:
    """A worker's loop: each request line (`Request.line`) answered with one line, {"ok": true} or the error."""
    for line in lines:
        try:
            compile_here(Request(**json.loads(line)))
            answer = {"ok": True}
        except Exception as e:  # noqa: BLE001 - reported to the pool, which compiles it in its own process
            answer = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        write(json.dumps(answer) + "\n")


if __name__ == "__main__":
    def _write(s: str) -> None:
        sys.stdout.write(s)
        sys.stdout.flush()
    serve(sys.stdin, _write)

"""Triton's once-per-process set-up, done once, early and off the critical path.

The first kernel a process launches makes Triton build its CUDA driver's helper module (a C compile, in a
subprocess), and the first kernel it compiles makes it hash its own sources (`triton_key`) and ask ptxas
for its version. None of these is guarded by a lock. When a compile's tuning starts 16 threads that launch
their first kernels at once, each does all of it for itself: sampled on a cold 8B compile (py-spy, every
thread), the threads spent 74 thread-seconds in the driver's C compile and 28 in hashing Triton's sources,
about 6 s of each thread's 12 s (with 16 GB of the model's freshly written pages in the page cache; about
1 s when the disk was idle).

`start()` does this set-up on a background thread, once per process; a compile calls it as its passes
begin, so that the set-up overlaps them (the C compile waits on a subprocess, which holds no GIL). Started
with the capture instead, it slowed the capture's imports and export by about 2 s (five cold 8B compiles
on an H200 host: capture 11.4 s on average against 9.4 s without it), more than it saved the tuning (2.9
against 3.8 s). `ready()` waits for it, starting it first where nothing has: `autotune.run_on_threads`
calls it before its threads launch anything. A set-up step that fails is logged and left to the kernel
launch that needs it, which meets the same error as it would have without this module.
"""
from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)

_lock = threading.Lock()
_thread: threading.Thread | None = None
_done = threading.Event()
seconds: float | None = None  # how long the set-up took, once done (None: not run, or nothing to set up)
error: str | None = None  # why a step failed, if one did


def _steps() -> None:
    """What Triton does lazily before its first launch and its first compile, in that order."""
    from triton.runtime.driver import driver
    active = driver.active  # builds and loads the driver's helper module (cached on disk after the first time)
    target = active.get_current_target()
    from triton.runtime.cache import triton_key
    triton_key()  # lru-cached: every later compile's cache key reuses it
    from triton.compiler.compiler import make_backend
    make_backend(target).hash()  # the backend's key, with ptxas's version


def enabled() -> bool:
    """$LLMC_TRITON_SETUP (default on): 0 leaves Triton's set-up to the first launches, and
    `autotune.run_on_threads` lets its calls compile their kernels themselves (for comparisons)."""
    return os.environ.get("LLMC_TRITON_SETUP", "1").strip() != "0"


def _needed() -> bool:
    """Only a process that will launch compiled kernels: a CUDA GPU, and Triton not interpreting."""
    import torch
    return enabled() and torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


def _run() -> None:
    global seconds, error
    import time
    t = time.perf_counter()
    try:
        if _needed():
            _steps()
            seconds = time.perf_counter() - t
    except Exception as e:  # noqa: BLE001 - the launch that needs it meets the error itself
        error = f"{type(e).__name__}: {e}"
        log.debug("triton set-up: %s", error)
    finally:
        _done.set()


def start() -> None:
    """Begin Triton's set-up on a background thread (once per process; a no-op after the first call)."""
    global _thread
    with _lock:
        if _thread is None:
            _thread = threading.Thread(target=_run, name="llmc-triton-setup", daemon=True)
            _thread.start()


def ready() -> None:
    """Return once Triton's set-up has run (starting it if nothing has)."""
    start()
    _done.wait()

"""The heap an engine starts with, kept out of Python's cyclic garbage collector while it runs steps.

A collection of the oldest generation visits every object the collector tracks. A process that has
imported torch, transformers and triton and loaded a model tracks some 450,000 of them, and such a
collection then takes about 0.2 s (benchmarks/gc_pause_bench.py). The engine's steps allocate all the
time, so one comes every few hundred steps: a pause in which the host prepares no step, so the GPU
idles once the step in flight ends. `gc.freeze()` moves every object alive at that moment to a
permanent generation that collections skip; objects made later are collected as before, and an object
whose last reference goes is freed at once whether frozen or not (only cycles wait for the collector).

An engine on a GPU calls `freeze()` once it is ready (after its warm-up): one full collection first, so
nothing that is garbage already is frozen. The token it gets back is released (`release(token)`) when the
engine is done: `LLM.close()`, the `LLM` object's collection, the end of an `AsyncLLM`'s loop. Releasing
unfreezes, collects (so an engine dropped without `close()` gives back its device memory even where its
objects form cycles, which a frozen heap would otherwise keep to the end of the process), and freezes
again while another engine of the process holds a token. Python's shutdown never collects frozen objects,
so the heap is unfrozen at exit (some extension modules report frozen objects as leaked).
`LLMC_GC_FREEZE=0` turns it off. An engine on the CPU does not freeze: its device is the host, so a pause
idles nothing that the host's work would not.

Example:
    >>> import gc
    >>> token = freeze()
    >>> gc.get_freeze_count() > 0
    True
    >>> release(token); gc.get_freeze_count()
    0
"""
from __future__ import annotations

import atexit
import gc
import itertools
import os

_held: set[int] = set()  # tokens of the engines that froze the heap and are not done
_tokens = itertools.count(1)
_at_exit = False


def enabled() -> bool:
    """Whether engines freeze their heap: $LLMC_GC_FREEZE, on unless "0"."""
    return os.environ.get("LLMC_GC_FREEZE", "1") != "0"


def freeze() -> int | None:
    """Collect, then freeze every object alive (see the module docstring); a token for `release`, or None
    where turned off."""
    global _at_exit
    if not enabled():
        return None
    gc.collect()
    gc.freeze()
    token = next(_tokens)
    _held.add(token)
    if not _at_exit:
        atexit.register(gc.unfreeze)
        _at_exit = True
    return token


def release(token: int | None) -> None:
    """The engine of `token` is done: unfreeze and collect, and freeze again if another engine still holds a
    token. Releasing a token twice, or None, does nothing."""
    if token is None or token not in _held:
        return
    _held.discard(token)
    gc.unfreeze()
    gc.collect()
    if _held:
        gc.freeze()

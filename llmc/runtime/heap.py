"""The heap an engine starts with, kept out of Python's cyclic garbage collector while it runs steps.

A collection of the oldest generation visits every object the collector tracks. A process that has
imported torch, transformers and triton and loaded a model tracks some 450,000 of them, and such a
collection then takes about 0.2 s (benchmarks/gc_pause_bench.py). The engine's steps allocate all the
time, so one comes every few hundred steps: a pause in which the host prepares no step, so the GPU
idles once the step in flight ends. `gc.freeze()` moves every object alive at that moment to a
permanent generation that collections skip; objects made later are collected as before, and an object
whose last reference goes is freed at once whether frozen or not (only cycles wait for the collector).

`freeze(owner)` is called by an engine on a GPU once it is ready (after its warm-up), after a full
collection, so nothing that is garbage already is frozen. `release(owner)` (`LLM.close()`, the end of an
`AsyncLLM`'s loop) unfreezes, collects what the closed engine left in cycles, and freezes again while
another engine of the process is still open. Python's shutdown never collects frozen objects, so the
heap is unfrozen at exit (some extension modules report frozen objects as leaked). `LLMC_GC_FREEZE=0`
turns it off. An engine on the CPU does not freeze: its device is the host, so a pause idles nothing
that the host's work would not.

Example:
    >>> import gc
    >>> class Owner: pass
    >>> o = Owner()
    >>> freeze(o) and gc.get_freeze_count() > 0
    True
    >>> release(o); gc.get_freeze_count()
    0
"""
from __future__ import annotations

import atexit
import gc
import os
import weakref

_owners: weakref.WeakSet = weakref.WeakSet()  # open engines that froze the heap
_at_exit = False


def enabled() -> bool:
    """Whether engines freeze their heap: $LLMC_GC_FREEZE, on unless "0"."""
    return os.environ.get("LLMC_GC_FREEZE", "1") != "0"


def freeze(owner: object) -> bool:
    """Collect, then freeze every object alive (see the module docstring); False where turned off."""
    global _at_exit
    if not enabled():
        return False
    gc.collect()
    gc.freeze()
    _owners.add(owner)
    if not _at_exit:
        atexit.register(gc.unfreeze)
        _at_exit = True
    return True


def release(owner: object) -> None:
    """`owner` is done: unfreeze and collect, and freeze again if another owner is still open."""
    if owner not in _owners:
        return
    _owners.discard(owner)
    gc.unfreeze()
    gc.collect()
    if len(_owners):
        gc.freeze()

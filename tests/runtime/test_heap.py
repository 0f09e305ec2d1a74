"""The startup heap frozen out of the cyclic collector (llmc/runtime/heap.py): what is frozen waits until its
last owner is released, then is collected; off by LLMC_GC_FREEZE=0; an engine on the CPU never freezes."""
import gc
import weakref

import pytest

from llmc.runtime import heap
from llmc.runtime.engine import LLM


class Owner:
    pass


class Cycle:
    def __init__(self):
        self.me = self


@pytest.fixture(autouse=True)
def unfrozen():
    assert gc.get_freeze_count() == 0
    yield
    heap._owners.clear()
    gc.unfreeze()


def test_frozen_cycles_wait_for_the_last_owner():
    a, b = Owner(), Owner()
    garbage = Cycle()
    ref = weakref.ref(garbage)
    assert heap.freeze(a) and heap.freeze(b) and gc.get_freeze_count() > 0
    del garbage  # a cycle: only the collector frees it, and it skips frozen objects
    gc.collect()
    assert ref() is not None
    heap.release(a)  # b is still open: collected, then frozen again
    assert ref() is None and gc.get_freeze_count() > 0
    heap.release(b)
    assert gc.get_freeze_count() == 0
    heap.release(b)  # twice is harmless


def test_garbage_before_the_freeze_is_collected_not_frozen():
    o = Owner()
    garbage = Cycle()
    ref = weakref.ref(garbage)
    del garbage
    heap.freeze(o)
    assert ref() is None
    heap.release(o)


def test_turned_off(monkeypatch):
    monkeypatch.setenv("LLMC_GC_FREEZE", "0")
    assert not heap.enabled() and not heap.freeze(Owner()) and gc.get_freeze_count() == 0


def test_an_engine_on_the_cpu_does_not_freeze(llama_artifact):
    with LLM(llama_artifact, num_blocks=16, block_size=4):
        assert gc.get_freeze_count() == 0

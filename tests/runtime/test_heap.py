"""The startup heap frozen out of the cyclic collector (llmc/runtime/heap.py): what is frozen waits until the
last token is released, then is collected; an LLM released by close() or by its collection thaws the heap;
off by LLMC_GC_FREEZE=0; an engine on the CPU never freezes."""
import gc
import weakref

import pytest

from llmc.runtime import heap
from llmc.runtime.llm import LLM


class Cycle:
    def __init__(self):
        self.me = self


@pytest.fixture(autouse=True)
def unfrozen():
    """Each test starts with nothing frozen; engines of other tests that hold the heap get it back after."""
    saved = set(heap._held)
    heap._held.clear()
    gc.unfreeze()
    yield
    heap._held.clear()
    gc.unfreeze()
    if saved:
        heap._held.update(saved)
        gc.freeze()


def test_frozen_cycles_wait_for_the_last_token():
    a, b = heap.freeze(), heap.freeze()
    assert a != b and gc.get_freeze_count() > 0
    garbage = Cycle()
    ref = weakref.ref(garbage)
    heap.freeze()  # a third engine freezes it alive
    c = max(heap._held)
    del garbage  # a cycle: only the collector frees it, and it skips frozen objects
    gc.collect()
    assert ref() is not None
    heap.release(a)  # b and c still hold the heap: collected, then frozen again
    assert ref() is None and gc.get_freeze_count() > 0
    for t in (b, c, c, None):  # twice, or None, is harmless
        heap.release(t)
    assert gc.get_freeze_count() == 0


def test_garbage_before_the_freeze_is_collected_not_frozen():
    garbage = Cycle()
    ref = weakref.ref(garbage)
    del garbage
    token = heap.freeze()
    assert ref() is None
    heap.release(token)


def test_an_llm_collected_without_close_thaws_the_heap(llama_artifact):
    """What a GPU engine does, with the token taken by hand on the CPU: the LLM's collection releases it, so the
    engine's objects in cycles (on a GPU, those holding device memory) are collected as without the freeze."""
    llm = LLM(llama_artifact, backend="reference", num_blocks=16, block_size=4)
    assert llm.engine.heap_token is None and gc.get_freeze_count() == 0  # on the CPU: nothing frozen
    llm.engine.heap_token = heap.freeze()
    llm._thaw.detach()
    llm._thaw = weakref.finalize(llm, heap.release, llm.engine.heap_token)
    scheduler = weakref.ref(llm.engine.scheduler)  # held in a cycle (its queues' key is its bound method)
    assert gc.get_freeze_count() > 0
    del llm  # the finalizer runs while the LLM still holds its engine; the next collection takes the cycle
    gc.collect()
    assert gc.get_freeze_count() == 0 and scheduler() is None


def test_close_thaws_the_heap_once(llama_artifact):
    llm = LLM(llama_artifact, backend="reference", num_blocks=16, block_size=4)
    llm._thaw.detach()
    token = heap.freeze()
    llm._thaw = weakref.finalize(llm, heap.release, token)
    other = heap.freeze()  # another engine's
    llm.close()
    assert gc.get_freeze_count() > 0  # the other engine still holds it
    llm.close()
    heap.release(other)
    assert gc.get_freeze_count() == 0


def test_turned_off(monkeypatch):
    monkeypatch.setenv("LLMC_GC_FREEZE", "0")
    assert not heap.enabled() and heap.freeze() is None and gc.get_freeze_count() == 0

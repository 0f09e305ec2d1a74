"""Triton's once-per-process set-up (llmc.codegen.triton_setup): run once however many threads ask for it at
once, waited for by `ready`, a failure kept and not raised, nothing done where no kernel will be compiled
(no CUDA GPU, or the interpreter). The real steps (Triton's driver, its source hash, the backend's key) run on
the GPU in every compile: `bash benchmarks/gpu_pending.sh OUT compile-cold`."""
from __future__ import annotations

import threading
import time

import pytest

from llmc.codegen import triton_setup


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(triton_setup, "_thread", None)
    monkeypatch.setattr(triton_setup, "_done", threading.Event())
    monkeypatch.setattr(triton_setup, "seconds", None)
    monkeypatch.setattr(triton_setup, "error", None)
    monkeypatch.setattr(triton_setup, "_needed", lambda: True)


def test_the_set_up_runs_once_for_threads_that_ask_at_once(fresh, monkeypatch):
    runs = []

    def steps():
        runs.append(threading.current_thread().name)
        time.sleep(0.05)
    monkeypatch.setattr(triton_setup, "_steps", steps)
    waited = []
    threads = [threading.Thread(target=lambda: (triton_setup.ready(), waited.append(len(runs)))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert runs == ["llmc-triton-setup"] and waited == [1] * 8
    assert triton_setup.seconds is not None and triton_setup.seconds >= 0.05 and triton_setup.error is None
    triton_setup.start()
    triton_setup.ready()
    assert len(runs) == 1


def test_a_failing_step_is_kept_not_raised(fresh, monkeypatch):
    def steps():
        raise RuntimeError("0 active drivers")
    monkeypatch.setattr(triton_setup, "_steps", steps)
    triton_setup.ready()
    assert triton_setup.error == "RuntimeError: 0 active drivers" and triton_setup.seconds is None


def test_nothing_is_done_without_a_gpu_or_under_the_interpreter(fresh, monkeypatch):
    monkeypatch.setattr(triton_setup, "_needed", lambda: False)
    monkeypatch.setattr(triton_setup, "_steps", lambda: pytest.fail("no set-up without compiled kernels"))
    triton_setup.ready()
    assert triton_setup.seconds is None and triton_setup.error is None


def test_needed_only_for_compiled_kernels_on_cuda(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not triton_setup._needed()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert triton_setup._needed()
    monkeypatch.setenv("LLMC_TRITON_SETUP", "0")
    assert not triton_setup._needed()
    monkeypatch.delenv("LLMC_TRITON_SETUP")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not triton_setup._needed()

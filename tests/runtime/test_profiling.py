"""The step profiler's window (LLMC_PROFILE_DIR, LLMC_PROFILE_STEPS): written at its last step, or with the
steps it had when the run ends inside it."""
from __future__ import annotations

import torch

from llmc.runtime.profiling import StepProfiler


def _profiler(monkeypatch, tmp_path, steps: str) -> StepProfiler:
    monkeypatch.setenv("LLMC_PROFILE_DIR", str(tmp_path))
    monkeypatch.setenv("LLMC_PROFILE_STEPS", steps)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)  # the window's edges wait for the GPU
    cpu = torch.profiler.profile  # this machine has no GPU activity to record: the host's instead
    monkeypatch.setattr(torch.profiler, "profile",
                        lambda activities: cpu(activities=[torch.profiler.ProfilerActivity.CPU]))
    return StepProfiler.from_env("engine")


def test_a_window_is_written_at_its_last_step(monkeypatch, tmp_path):
    prof = _profiler(monkeypatch, tmp_path, "1:3")
    for _ in range(5):
        prof.tick()
        torch.ones(8).sum()
    text = (tmp_path / "profile-engine.txt").read_text()
    assert text.startswith("# engine: steps 1..2, wall ")
    (tmp_path / "profile-engine.txt").unlink()
    prof.finish()  # closed already: nothing more
    assert not (tmp_path / "profile-engine.txt").exists()


def test_a_run_shorter_than_the_window_writes_the_steps_it_had(monkeypatch, tmp_path):
    prof = _profiler(monkeypatch, tmp_path, "2:1000")
    for _ in range(6):
        prof.tick()
    assert not (tmp_path / "profile-engine.txt").exists()
    prof.finish()
    assert (tmp_path / "profile-engine.txt").read_text().startswith("# engine: steps 2..5, wall ")


def test_nothing_is_profiled_without_the_variable(monkeypatch):
    monkeypatch.delenv("LLMC_PROFILE_DIR", raising=False)
    assert StepProfiler.from_env("engine") is None


def test_one_call_profiled_as_a_window_of_its_own(monkeypatch, tmp_path):
    """`around`: a benchmark's one call, whatever the variables say, written to the directory it names with
    the steps it says the call ran."""
    _profiler(monkeypatch, tmp_path / "elsewhere", "50:250")
    calls = []
    StepProfiler.around("run-b16", str(tmp_path), lambda: calls.append(torch.ones(8).sum()), 128)
    assert len(calls) == 1
    assert (tmp_path / "profile-run-b16.txt").read_text().startswith("# run-b16: steps 0..127, wall ")
    assert not (tmp_path / "elsewhere").exists()

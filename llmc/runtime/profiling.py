"""A window of steps under the PyTorch profiler, for finding where a step's GPU time goes.

Set LLMC_PROFILE_DIR=DIR (and optionally LLMC_PROFILE_STEPS=FIRST:LAST, default 50:250): the engine
(one process) and every distributed worker profile steps FIRST..LAST-1 of their own and write
DIR/profile-<name>.txt: the window's wall time, the GPU's busy time (kernels and copies, CUDA graph
replays included kernel by kernel) and the top kernels with their time per step. A window its
process's runs do not reach the end of is written with the steps it had when the engine is collected
(or the process exits) or the worker stops.
Nothing happens (one attribute test per step) when the variable is unset.
"""
from __future__ import annotations

import os
import time
from pathlib import Path


class StepProfiler:
    """`tick()` once per step, before it runs."""

    def __init__(self, name: str, out: str | None = None):
        self.dir = out or os.environ.get("LLMC_PROFILE_DIR")
        first, _, last = os.environ.get("LLMC_PROFILE_STEPS", "50:250").partition(":")
        self.first, self.last = int(first), int(last)
        self.name, self.steps, self.prof, self.t0 = name, 0, None, 0.0

    @classmethod
    def around(cls, name: str, out: str, fn, steps: int) -> None:
        """Profile one call `fn()` that runs `steps` steps as a window of its own, written to
        out/profile-<name>.txt like an engine's window (for benchmarks that time a run first and
        then look inside an identical one)."""
        prof = cls(name, out)
        prof.first, prof.last = 0, steps + 1
        prof.tick()
        fn()
        prof.steps = steps
        prof.finish()

    @classmethod
    def from_env(cls, name: str) -> "StepProfiler | None":
        return cls(name) if os.environ.get("LLMC_PROFILE_DIR") else None

    def tick(self) -> None:
        import torch
        if self.steps == self.first:
            from torch.profiler import ProfilerActivity, profile
            torch.cuda.synchronize()
            self.prof = profile(activities=[ProfilerActivity.CUDA])
            self.prof.__enter__()
            self.t0 = time.perf_counter()
        elif self.steps == self.last:
            self.finish()
        self.steps += 1

    def finish(self) -> None:
        """End the window now (if it is open) and write what it holds: at its last step, or at the end of a
        run shorter than the window (which otherwise would write nothing)."""
        if self.prof is None:
            return
        import torch
        torch.cuda.synchronize()
        wall = time.perf_counter() - self.t0
        prof, self.prof = self.prof, None
        prof.__exit__(None, None, None)
        self._write(prof, wall, self.steps - self.first)

    def _write(self, prof, wall: float, steps: int) -> None:
        rows = sorted(((e.key, e.self_device_time_total, e.count) for e in prof.key_averages()),
                      key=lambda r: -r[1])
        busy = sum(r[1] for r in rows)  # microseconds
        steps = max(steps, 1)
        lines = [f"# {self.name}: steps {self.first}..{self.first + steps - 1}, wall {1e3 * wall / steps:.3f} "
                 "ms/step, "
                 f"GPU busy {busy / 1e3 / steps:.3f} ms/step ({busy / 1e6 / wall:.1%})",
                 f"{'us/step':>9s} {'calls/step':>10s} {'share':>6s}  kernel"]
        for key, us, count in rows[:40]:
            lines.append(f"{us / steps:9.1f} {count / steps:10.1f} {us / max(busy, 1e-9):6.1%}  {key[:110]}")
        Path(self.dir).mkdir(parents=True, exist_ok=True)
        Path(self.dir, f"profile-{self.name}.txt").write_text("\n".join(lines) + "\n")

"""benchmarks/spec_bench.py with every engine call's speculation measurement traced, one JSON list a line, to
OUT/gate_trace.jsonl: [kind (plain, spec, other), sequences, proposed tokens, one_time (captured a graph),
milliseconds since the last call ended, gate open, bucket blocked, plain calls since the last speculative
measurement, speculative calls since the last plain one].

    OUT=DIR python3 benchmarks/spec_gate_trace.py SPEC_BENCH_ARGS...
"""
import json
import os
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import llmc.runtime.spec_decode as sd  # noqa: E402

trace = open(os.path.join(os.environ["OUT"], "gate_trace.jsonl"), "w")
observe = sd.SpecDecoder.observe_step


def traced(self, out, now, one_time=False):
    n, last = len(out.scheduled), self._last
    b = self._bucket(max(n, 1))
    observe(self, out, now, one_time)
    trace.write(json.dumps([self._last[0], n, sum(len(e.spec) for e in out.scheduled), one_time,
                            round((now - last[1]) * 1e3, 2) if last else None, self._gate_open(b),
                            b in self.blocked, self.since_spec.get(b, 0), self.since_plain.get(b, 0)]) + "\n")


sd.SpecDecoder.observe_step = traced
sys.argv = [str(Path(__file__).with_name("spec_bench.py"))] + sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")

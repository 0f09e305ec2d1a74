"""The engine's host time per decode step with BlockManager.try_append's one-token fast path against the
general pass it skips, alternating in one process (an instant stub model, 128 sequences, 512-token prompts,
engine_host_bench's set-up): python3 benchmarks/decode_append_ab.py"""
import sys, time, statistics
sys.path.insert(0, 'benchmarks'); sys.path.insert(0, '.')
import engine_host_bench as h
import llmc
from llmc.runtime.block_manager import BlockManager
from llmc.runtime.engine import SamplingParams
fast = BlockManager.try_append
def general(self, seq, n):
    touched, new = self._blocks_to_write(seq, n)
    return self._append(seq, touched, new) if self._fits(seq, touched, new) else None
art = llmc.compile("builtin:tiny-py", "/tmp/hb.llmc", dtype="float32")
def run(batch=128, prompt_len=512, steps=64):
    eng = h.stubbed_engine(art, batch * (prompt_len + 3*steps + 32) // 16 + 64, max_num_seqs=batch,
                           max_num_batched_tokens=max(8192, batch*prompt_len))
    p = SamplingParams(temperature=0, max_tokens=3*steps, ignore_eos=True)
    for i in range(batch):
        eng.add_request([1 + (i * 7 + j) % 4000 for j in range(prompt_len)], p)
    for _ in range(4): eng.step(finished_only=True)
    t = time.perf_counter()
    for _ in range(steps): eng.step(finished_only=True)
    return (time.perf_counter() - t) / steps * 1e3
res = {"general": [], "fast": []}
for _ in range(4):
    for name, f in (("general", general), ("fast", fast)):
        BlockManager.try_append = f
        res[name].append(run())
for k, v in res.items(): print(k, [round(x, 3) for x in v], "median", round(statistics.median(v), 3), "ms/step")

"""The host's cost of admitting a fresh prompt: the block manager's fit check, then its allocation.

    python3 benchmarks/admission_bench.py [--tokens 2048] [--runs 200]

Each run checks (`can_allocate`, twice, as a scheduler's admission and its budget check do) and allocates
one fresh prompt of random tokens in a BlockManager with prefix caching on, then frees it. Prints the median
microseconds of the checks and of the allocation. CPU only; compare trees side by side on one machine.
"""
import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from llmc.runtime.block_manager import BlockManager  # noqa: E402
from llmc.runtime.sampling_params import SamplingParams  # noqa: E402
from llmc.runtime.sequence import Sequence  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--runs", type=int, default=200)
    a = ap.parse_args()
    rng = random.Random(0)
    bm = BlockManager(num_blocks=4096, block_size=16)
    checks, allocs = [], []
    for i in range(a.runs + 20):
        seq = Sequence(f"r{i}", [rng.randrange(128000) for _ in range(a.tokens)], SamplingParams())
        t0 = time.perf_counter()
        assert bm.can_allocate(seq) and bm.can_allocate(seq)
        t1 = time.perf_counter()
        bm.allocate(seq)
        t2 = time.perf_counter()
        bm.free(seq)
        if i >= 20:  # after a warm-up
            checks.append(t1 - t0)
            allocs.append(t2 - t1)
    print(f"{a.tokens}-token fresh prompt: fit checks {statistics.median(checks) * 1e6:.1f} us, allocation "
          f"{statistics.median(allocs) * 1e6:.1f} us (medians of {a.runs})")


if __name__ == "__main__":
    main()

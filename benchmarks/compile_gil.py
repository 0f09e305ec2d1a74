"""How much a Triton compile needs the GIL: the generated bf16 matmul compiled for sm_90 without a GPU
(`compile_threads.compile_one`), five configs one after another, alone and then beside a thread that only
counts in Python. The compiles' slowdown and the counter's share of its own rate say how often a compile
takes the GIL back (what 16 warm-up threads compiling at once queue on).

    python3 benchmarks/compile_gil.py
"""
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compile_threads import CONFIGS, compile_one  # noqa: E402


def spin(stop: threading.Event, out: list) -> None:
    n = 0
    while not stop.is_set():
        n += 1
    out.append(n)


def timed(configs, beside: bool) -> tuple[float, float]:
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-")  # every compile from nothing
    stop, out = threading.Event(), []
    t = threading.Thread(target=spin, args=(stop, out))
    if beside:
        t.start()
    t0 = time.perf_counter()
    for c in configs:
        compile_one(c)
    dt = time.perf_counter() - t0
    if beside:
        stop.set()
        t.join()
    return dt, (out[0] / dt if out else 0.0)


def main():
    compile_one(CONFIGS[0])  # imports and the first compile's set-up, outside the timings
    stop, out = threading.Event(), []
    t = threading.Thread(target=spin, args=(stop, out))
    t.start()
    time.sleep(2.0)
    stop.set()
    t.join()
    solo_rate = out[0] / 2.0
    alone, _ = timed(CONFIGS[1:], beside=False)
    beside, rate = timed(CONFIGS[1:], beside=True)
    print(f"{len(CONFIGS) - 1} compiles alone {alone:.2f} s, beside a Python thread {beside:.2f} s "
          f"({beside / alone:.2f}x); the thread kept {rate / solo_rate:.2f} of its own rate")


if __name__ == "__main__":
    main()

"""How long a load spends checking an artifact's weights: the whole-file sha256 a load used to compute, against
the per-piece check on one thread and on every core (`llmc.artifact.verify_files`), on a file of random
bytes the size of a model's weights (read from the page cache: the first pass warms it).

    python3 benchmarks/verify_bench.py --gb 2           # CPU ratios
    python3 benchmarks/verify_bench.py --gb 16 --out OUT   # an 8B model's weights, on the GPU machine's cores
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=2.0, help="size of the file")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from llmc.artifact import HASH_CHUNK, hash_file, sha256_file, verify_files
    with tempfile.TemporaryDirectory() as d:
        path = Path(d)
        f = path / "weights.safetensors"
        with open(f, "wb") as w:
            left = int(a.gb * (1 << 30))
            while left > 0:
                w.write(os.urandom(min(left, 1 << 26)))
                left -= 1 << 26
        whole, pieces = hash_file(f)  # also warms the page cache
        manifest = {"files": {f.name: whole}, "chunks": {f.name: {"bytes": HASH_CHUNK, "sha256": pieces}}}
        rows = {}
        t = time.perf_counter()
        sha256_file(f)
        rows["whole file, one thread (before)"] = time.perf_counter() - t
        for threads in (1, None):
            t = time.perf_counter()
            verify_files(path, manifest, threads=threads)
            rows[f"pieces, {threads or os.cpu_count()} threads"] = time.perf_counter() - t
    base = rows["whole file, one thread (before)"]
    print(f"# checking {a.gb:g} GB of weights, {os.cpu_count()} cores")
    for k, s in rows.items():
        print(f"{k:34s} {s:7.2f} s  {a.gb / s:6.2f} GB/s  {base / s:5.2f}x")
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        Path(a.out, "verify_bench.json").write_text(json.dumps({"gb": a.gb, "cores": os.cpu_count(), "seconds": rows}))


if __name__ == "__main__":
    main()

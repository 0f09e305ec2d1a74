"""A weights file written the way a compile did before (safetensors' save_file, then its pieces hashed
from the file: `hash_pieces`) against llmc's `write_safetensors` (pieces hashed from memory and written
on threads), alternating, on the tensors of a model directory's safetensors files.

    python3 benchmarks/write_bench.py MODEL_DIR [--runs 2] [--to DIR]
"""
import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main():
    from safetensors.torch import load_file, save_file

    from llmc.artifact import hash_pieces, write_safetensors
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--to", default=None, help="folder to write in (default: a temporary one)")
    a = ap.parse_args()
    tensors = {}
    for f in sorted(Path(a.model).glob("*.safetensors")):
        tensors.update({k: v.clone() for k, v in load_file(str(f)).items()})  # in memory, as a compile's are
    gb = sum(t.numel() * t.element_size() for t in tensors.values()) / 1e9
    out = Path(a.to or tempfile.mkdtemp())
    print(f"{len(tensors)} tensors, {gb:.2f} GB, {os.cpu_count()} cores")
    for run in range(a.runs):
        for how in ("save_file + hash_pieces", "write_safetensors"):
            path = out / "w.safetensors"
            t = time.perf_counter()
            if how == "write_safetensors":
                write_safetensors(tensors, path)
            else:
                save_file(tensors, str(path))
                hash_pieces(path)
            dt = time.perf_counter() - t
            print(f"run {run} {how:24s} {dt:6.2f} s  {gb / dt:5.2f} GB/s", flush=True)
            path.unlink()


if __name__ == "__main__":
    main()

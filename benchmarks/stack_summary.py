"""Summarise sampled stacks (py-spy's `--format raw`: one `frame;frame;... count` line per distinct stack).

    py-spy record -r 100 --threads --idle -f raw -o OUT/stacks.txt -- python3 -c "..."
    python3 benchmarks/stack_summary.py OUT/stacks.txt --rate 100 [--within FRAME] [--top 25]

Prints, per thread, its seconds; then, over the stacks that pass through `--within` (a substring of a
frame or of the thread's name, e.g. `_tune_linears` or `llmc-tune`), the seconds of each stack's deepest llmc frame, of its deepest frame of
any module (where the time is spent), and of the deepest frame below a few known libraries' entry
points (triton's compile, torch's loading, safetensors). Seconds are samples / rate.
"""
import argparse
import re
from collections import Counter


def parse(path):
    """[(thread, [frames...], count)] of a raw stack file."""
    rows = []
    for line in open(path):
        line = line.rstrip("\n")
        if not line:
            continue
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        thread = re.sub(r"\s*\(\d+\)", "", frames[0]) if frames[0].startswith("thread") else "?"
        rows.append((thread, frames[1:] if frames[0].startswith("thread") else frames, int(count)))
    return rows


def short(frame):
    """`func (path/file.py:line)` as `func (file.py)`: lines differ within one function."""
    m = re.match(r"(.*) \((.*?):\d+\)$", frame)
    if not m:
        return frame
    func, path = m.groups()
    return f"{func} ({'/'.join(path.split('/')[-2:])})"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stacks")
    ap.add_argument("--rate", type=float, default=100.0, help="samples per second of the recording")
    ap.add_argument("--within", default=None, help="only stacks with a frame (or a thread name) containing this")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    rows = parse(a.stacks)
    per_thread = Counter()
    for t, _, c in rows:
        per_thread[t] += c
    print("seconds per thread:")
    for t, c in per_thread.most_common(20):
        print(f"  {c / a.rate:8.2f}  {t}")
    if a.within:
        rows = [r for r in rows if a.within in r[0] or any(a.within in f for f in r[1])]
    total = sum(c for _, _, c in rows)
    print(f"\n{total / a.rate:.2f} s of samples{' within ' + a.within if a.within else ''}")
    llmc_deepest, leaf, lib = Counter(), Counter(), Counter()
    for _, frames, c in rows:
        mine = [f for f in frames if "llmc/" in f]
        llmc_deepest[short(mine[-1]) if mine else "(no llmc frame)"] += c
        leaf[short(frames[-1]) if frames else "?"] += c
        below = next((i for i, f in enumerate(frames) if re.search(
            r"\((triton/compiler/compiler\.py|triton/runtime/jit\.py|torch/serialization\.py|safetensors/|"
            r"transformers/modeling_utils\.py|torch/_export|torch/export/)", f)), None)
        lib[" > ".join(short(f) for f in frames[below:below + 3]) if below is not None else "(none)"] += c
    for title, counter in (("deepest llmc frame", llmc_deepest), ("deepest frame", leaf),
                           ("first library frames", lib)):
        print(f"\nby {title}:")
        for k, c in counter.most_common(a.top):
            print(f"  {c / a.rate:8.2f}  {k[:160]}")


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# Run the shared llmc_bench.py on an older checkout and on this tree, alternating (before, after,
# before, after, ...; ROUNDS rounds, default 2) on the same GPU, so that a change is judged by a ratio measured in one run and
# neither side alone pays for the cold kernel cache. Each figure is the best of its side's runs.
#   benchmarks/side_by_side.sh BASE_DIR TOOLS_DIR OUT_DIR [llmc_bench.py options...]
# BASE_DIR: a checkout of the older commit (e.g. `git archive COMMIT | tar -x -C BASE_DIR`);
# TOOLS_DIR: the folder holding llmc_bench.py and peer_decode.py.
set -euo pipefail
base=$(cd "$1" && pwd); tools=$(cd "$2" && pwd); out=$3; shift 3
here=$(cd "$(dirname "$0")/.." && pwd)
rounds=${ROUNDS:-2}
for round in $(seq 1 "$rounds"); do
  for side in before after; do
    dir=$([ "$side" = before ] && echo "$base" || echo "$here")
    mkdir -p "$out/$side$round"
    echo "== $side (round $round): $dir"
    (cd "$dir" && PYTHONPATH="$dir" python3 "$tools/llmc_bench.py" --out "$out/$side$round" "$@") 2>&1 \
      | tee "$out/$side$round/log.txt" | grep -E "^(decode|ttft|throughput|compile)"
  done
done
python3 - "$out" "$rounds" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rounds = range(1, int(sys.argv[2]) + 1)
runs = {s: [json.loads(next((out / f"{s}{r}").glob("llmc_bench_*.json")).read_text()) for r in rounds]
        for s in ("before", "after")}
print(f"{'figure':24s} {'before':>10s} {'after':>10s} {'after/before':>12s}   (runs: before | after)")
for k, better in (("decode_b1_tok_s", max), ("ttft_2048_ms", min), ("thru_out_tok_s", max), ("load_s", min)):
    b, a = (better(r[k] for r in runs[s]) for s in ("before", "after"))
    each = " ".join(f"{r[k]:.1f}" for r in runs["before"]) + " | " + " ".join(f"{r[k]:.1f}" for r in runs["after"])
    print(f"{k:24s} {b:10.1f} {a:10.1f} {a / b:12.3f}   ({each})")
PY

"""The shipped decode kernel over an int8 / fp8 cache with its block centres' part left out: what a centre-free
cache format would decode at, timed on the shipped kernel itself (its split-K, tiles and tuning), not a lab copy.

Runs benchmarks/attention_bench.py (same arguments) with the decode kernel's source rendered with the centres'
contributions to the scores and to the output set to 0, so that their loads and dots are dead code. The outputs
are then those of a cache whose centres are all 0 (its "max |diff|" against the centred reference is meaningless):
a speed measurement only, for `benchmarks/fp8_decode_lab.py`'s finding (RESULTS 2026-12-06, evening).

    python3 benchmarks/centre_free_decode.py --shape 8b --decode-only --kv-dtype fp8
"""
from __future__ import annotations

import re
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmc.codegen import kernels  # noqa: E402

_render = kernels.render


def render_without_centres(spec, pdl=None) -> str:
    src = _render(spec, pdl)
    if getattr(spec, "mode", None) == "decode" and getattr(spec, "kv_dtype", "") in ("int8", "float8_e4m3fn"):
        src, n = re.subn(r"^(\s+)(qk_centres|pv_centres) = .*$", r"\1\2 = 0.0", src, flags=re.M)
        assert n == 2, f"expected the two centre parts in the decode source, found {n}"
    return src


if __name__ == "__main__":
    kernels.render = render_without_centres
    sys.argv = [str(Path(__file__).with_name("attention_bench.py")), *sys.argv[1:]]
    runpy.run_path(sys.argv[0], run_name="__main__")

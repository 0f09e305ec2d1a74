"""Run a benchmark script with programmatic dependent launch (PDL) off for the kernels of some templates only:

    python3 benchmarks/pdl_off.py --templates paged_attention_decode,rms_norm -- \\
        benchmarks/quant_decode_bench.py --shape 8b --quant rtn4 --new 128 --bf16-no-tune --out OUT

`LLMC_PDL=0` turns PDL off for every kernel; this turns it off for the kernels rendered from the named templates
(`llmc/codegen/templates/NAME.py.jinja`), which then neither wait on the kernel before them nor start early, while
every other kernel keeps it. Timing a step with each template's PDL off in turn shows which kernel's overlap with
the one before it gains or costs (RESULTS 2026-12-07, decode launch: with 8-warp decode attention programs, PDL
cost the 8B int4 decode 3% at batch 16). The script runs in this process (`runpy`), after the patch, with the
arguments after `--`.
"""
from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def templates_off(names: list[str]) -> None:
    """Patch the kernel loader: a kernel of a template in `names` loads without PDL."""
    import functools

    from llmc.codegen import elementwise
    from llmc.codegen.kernels import TEMPLATES, load
    known = {p.name.removesuffix(".py.jinja") for p in TEMPLATES.glob("*.py.jinja")}
    unknown = sorted(set(names) - known)
    if unknown:
        raise SystemExit(f"pdl_off: no template named {', '.join(unknown)}; the templates: {', '.join(sorted(known))}")

    @functools.lru_cache(maxsize=None)
    def module(spec, interpret: bool, pdl: bool):
        return load(spec, pdl and spec.template.removesuffix(".py.jinja") not in names)
    elementwise._module = module


def main() -> None:
    argv = sys.argv[1:]
    if "--" not in argv:
        raise SystemExit("usage: pdl_off.py --templates NAME[,NAME] -- SCRIPT [ARGS...]")
    cut = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--templates", required=True, help="comma-separated template names (paged_attention_decode, "
                                                       "qmatmul_linear, rms_norm, elementwise, rope_kv_write, ...)")
    a = ap.parse_args(argv[:cut])
    script, args = argv[cut + 1], argv[cut + 2:]
    templates_off([t for t in a.templates.split(",") if t])
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()

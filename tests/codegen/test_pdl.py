"""Programmatic dependent launch (kernels.pdl_enabled): every generated kernel waits on the kernel before it
before it touches memory, only waiting kernels launch with the attribute, and the switch stays off where no
Hopper GPU compiles (the interpreter, this CPU machine) or under LLMC_PDL=0."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from llmc.codegen.kernels import TEMPLATES, PDLKernel, pdl_enabled, render
from llmc.codegen.norm import RmsNormSpec

ROOT = Path(__file__).resolve().parents[2]


def test_every_kernel_waits_first():
    kernels = 0
    for path in sorted(TEMPLATES.glob("*.py.jinja")):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if not re.match(r"def \w+_kernel\(", line):
                continue
            kernels += 1
            end = next(j for j in range(i, len(lines)) if lines[j].rstrip().endswith("):"))
            assert lines[end + 1] == '{% include "_pdl.jinja" %}', f"{path.name}: {line} does not wait first"
    assert kernels >= 17


def test_render_takes_the_switch():
    spec = RmsNormSpec(64, "bf16", True)
    on, off = render(spec, pdl=True), render(spec, pdl=False)
    assert on.count("tl.extra.cuda.gdc_wait()") == 1 and on.count("gdc_launch_dependents()") == 1
    assert "gdc" not in off
    assert render(spec) == off  # no Hopper GPU compiles here: the default is off
    assert not pdl_enabled()


def test_late_trigger_by_environment(monkeypatch):
    """LLMC_PDL_LATE moves the named templates' trigger (the next kernel may place its programs) from right
    after the wait to after the main loop; the others, and every default render, keep it right after the wait."""
    from llmc.codegen.attention import PagedAttentionSpec
    from llmc.codegen.matmul import MatmulSpec
    from llmc.codegen.qmatmul import QMatmulSpec
    loops = {QMatmulSpec("int", 4, 128, False, 64, "bf16", False, ""): "for k in range(0, k_per_split",
             MatmulSpec("bf16", False, ()): "for k in range(0, k_per_split",
             PagedAttentionSpec(head_dim=128, num_q_heads=32, num_kv_heads=8, block_size=16, dtype="bfloat16",
                                kv_dtype="bfloat16", mode="decode", split=True, block_n=64): "for start in range("}
    early = {spec: render(spec, pdl=True) for spec in loops}
    for spec, src in early.items():
        assert src.index("gdc_launch_dependents()") < src.index(loops[spec]), spec.template
    monkeypatch.setenv("LLMC_PDL_LATE", "qmatmul_linear,paged_attention_decode")
    for spec, loop in loops.items():
        src = render(spec, pdl=True)
        late = spec.template != "matmul.py.jinja"
        assert src.count("gdc_wait()") == 1 and src.count("gdc_launch_dependents()") == 1
        assert (src.rindex(loop) < src.index("gdc_launch_dependents()")) == late, spec.template
        assert (src == early[spec]) == (not late)
        assert "gdc" not in render(spec, pdl=False)
    monkeypatch.setenv("LLMC_PDL_LATE", "all")  # the three templates with a later trigger; the others as by default
    for spec, loop in loops.items():
        assert render(spec, pdl=True).rindex(loop) < render(spec, pdl=True).index("gdc_launch_dependents()")
    norm = RmsNormSpec(64, "bf16", True)
    src = render(norm, pdl=True)
    assert src.count("gdc_wait()") == 1 and src.index("gdc_wait()") < src.index("gdc_launch_dependents()")
    monkeypatch.delenv("LLMC_PDL_LATE")
    assert render(norm, pdl=True) == src


def test_late_trigger_names_are_checked(monkeypatch):
    """LLMC_PDL_LATE takes exactly the templates that include the later trigger; a name without one (misspelt,
    or a template that has none) is a one-line error naming it rather than a switch that silently does nothing."""
    from llmc.codegen import kernels
    from llmc.codegen.matmul import MatmulSpec
    from llmc.errors import LLMCError
    with_trigger = {t.name.removesuffix(".py.jinja") for t in TEMPLATES.glob("*.py.jinja")
                    if "_pdl_trigger.jinja" in t.read_text()}
    assert with_trigger == set(kernels.PDL_LATE_TEMPLATES)
    spec = MatmulSpec("bf16", False, ())
    for setting in ("qmatmul_linaer", "matmul,rms_norm"):
        monkeypatch.setenv("LLMC_PDL_LATE", setting)
        with pytest.raises(LLMCError, match="LLMC_PDL_LATE names 'qmatmul_linaer'|LLMC_PDL_LATE names 'rms_norm'"):
            render(spec, pdl=True)
    monkeypatch.setenv("LLMC_PDL_LATE", " matmul , ")
    assert kernels.pdl_late(spec)
    monkeypatch.setenv("LLMC_PDL_LATE", "")
    assert not kernels.pdl_late(spec)


def test_off_by_environment(monkeypatch):
    import llmc.codegen.elementwise as ew
    import llmc.codegen.kernels as k
    monkeypatch.setattr(k, "_hopper_or_newer", lambda: True)
    monkeypatch.setattr(ew, "interpreting", lambda: False)
    assert pdl_enabled()
    monkeypatch.setenv("LLMC_PDL", "0")
    assert not pdl_enabled()


def test_prefetch_columns():
    """LLMC_PDL_PREFETCH's share of each program: about PREFETCH_BYTES over the grid, in whole steps of two
    128-byte lines a row, at most the program's K range rounded up to a step; nothing above 64 rows."""
    from llmc.codegen.matmul import PREFETCH_BYTES, prefetch_columns
    cfg = {"BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 1}
    assert prefetch_columns(1, 2048, (1, 48, 1), cfg, 2) == 640  # a 1B-shape qkv: 640 of 2,048 columns, 3.75 MiB
    assert 48 * 64 * 640 * 2 <= PREFETCH_BYTES
    assert prefetch_columns(1, 500, (1, 4, 1), cfg, 2) == 512  # a small weight: all of it (a whole step)
    assert prefetch_columns(1, 4096, (1, 96, 1), cfg, 2) == 256  # an 8B-shape qkv
    assert prefetch_columns(1, 4096, (1, 448, 1), cfg, 2) == 0  # an 8B-shape gate_up: under a step a program
    assert prefetch_columns(1, 14336, (1, 64, 8), {**cfg, "SPLIT_K": 8}, 2) % 128 == 0
    assert prefetch_columns(128, 4096, (1, 48, 1), cfg, 2) == 0


def test_a_pdl_kernel_launches_with_the_attribute():
    calls = []

    class Fn:
        src = "tl.extra.cuda.gdc_wait()"

        def __getitem__(self, grid):
            return lambda *a, **kw: calls.append((grid, a, kw))

    k = PDLKernel(Fn())
    k[(3, 2)](1, 2, BLOCK=4, num_warps=4)
    assert calls == [((3, 2), (1, 2), {"launch_pdl": True, "BLOCK": 4, "num_warps": 4})]
    assert k.src == Fn.src


CHILD = r'''
import re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction
from llmc.codegen.kernels import PDLKernel, load
from llmc.codegen.matmul import MatmulSpec
from llmc.codegen.norm import RmsNormSpec

mm = load(MatmulSpec("bf16", False, ()), pdl=True)
glu = load(MatmulSpec("bf16", True, (), "", True), pdl=True)  # the SwiGLU epilogue, with a bias
assert isinstance(mm.matmul_kernel, PDLKernel) and isinstance(mm._finish, JITFunction), "only kernels wrapped"
assert isinstance(load(MatmulSpec("bf16", False, ()), pdl=False).matmul_kernel, JITFunction)
norm = load(RmsNormSpec(256, "bf16", True), pdl=True).rms_norm_kernel.fn
from llmc.codegen.attention import PagedAttentionSpec
attn = []  # prefill attention, whose launch order and grid are runtime arguments, over bf16 and int8 caches,
# and its packed grid (a captured mixed step's)
for kv, cache, packed in (("bfloat16", "*bf16", False), ("int8", "*i8", False), ("bfloat16", "*bf16", True)):
    spec = PagedAttentionSpec(head_dim=128, num_q_heads=32, num_kv_heads=8, block_size=16, dtype="bfloat16",
                              kv_dtype=kv, sliding_window=False, block_n=64, mode="prefill", causal=True, block_m=64,
                              packed=packed)
    fn = load(spec, pdl=True).paged_attention_prefill_kernel.fn
    c = spec.constexprs()
    ptrs = {"out_ptr": "*bf16", "q_ptr": "*bf16", "cache_ptr": cache, "kv_scale_ptr": "*bf16", "qsl_ptr": "*i32",
            "seq_lens_ptr": "*i32", "block_tables_ptr": "*i32", "qk_scale": "fp32"}
    attn.append((fn, {n: ptrs.get(n, "i32") for n in fn.arg_names if n not in c}, c))
cases = attn + [
    (mm.matmul_kernel.fn, {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "ws_ptr": "*fp32", "count_ptr": "*i32",
      "stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32", "M": "i32", "N": "i32", "K": "i32",
      "prefetch_k": "i32"},
     {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 2, "M_TILES": 1}),
    (glu.matmul_kernel.fn, {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "ws_ptr": "*fp32",
      "count_ptr": "*i32", "stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32", "M": "i32", "N": "i32",
      "K": "i32", "prefetch_k": "i32"},
     {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 4, "M_TILES": 4}),
    (norm, {"x_ptr": "*bf16", "r_ptr": "*bf16", "h_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16",
            "stride_x": "i32", "stride_r": "i32", "stride_h": "i32", "stride_out": "i32", "eps": "fp32"},
     {"BLOCK": 256}),
]
from llmc.codegen.qmatmul import QMatmulSpec
QCONSTS = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "SPLIT_K": 4, "M_TILES": 1, "SWAP_AB": True, "EVEN_K": True,
           "TMA": False}
QSPEC = QMatmulSpec("int", 4, 128, False, 64, "bf16", False, "")  # int4 g128, its codes unpacked by PTX


def qsig(fn):  # the int4 qlinear's arguments, as the attention cases': pointers typed, every other one i32
    ptrs = {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*bf16", "y_ptr": "*bf16", "ws_ptr": "*fp32", "count_ptr": "*i32"}
    return {n: ptrs.get(n, "i32") for n in fn.arg_names if n not in QCONSTS}


qfn = load(QSPEC, pdl=True).qmatmul_kernel.fn
cases.append((qfn, qsig(qfn), QCONSTS))
# the fp8 qlinear on a tall split tile with x's and W's tiles through TMA descriptors (bulk tensor copies)
F8CONSTS = {**QCONSTS, "BLOCK_M": 128, "BLOCK_K": 128, "TMA": True}
f8fn = load(QMatmulSpec("fp8", 8, 0, False, 0, "bf16", False, ""), pdl=True).qmatmul_kernel.fn
f8ptrs = {"x_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "sx_ptr": "*fp32", "y_ptr": "*bf16",
          "ws_ptr": "*fp32", "count_ptr": "*i32", "x_desc": "tensordesc<fp8e4nv[128, 128]>",
          "w_desc": "tensordesc<fp8e4nv[64, 128]>"}
cases.append((f8fn, {n: f8ptrs.get(n, "i32") for n in f8fn.arg_names if n not in F8CONSTS}, F8CONSTS))
for fn, sig, consts in cases:
    sig = {**sig, **{k: "constexpr" for k in consts}}
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4, "num_stages": 3, "launch_pdl": True})
    assert k.metadata.launch_pdl
    lines = k.asm["ptx"].splitlines()
    wait = [i for i, l in enumerate(lines) if "griddepcontrol.wait" in l]
    mem = [i for i, l in enumerate(lines) if re.search(r"\b(ld\.global|st\.global|cp\.async|atom\.|red\.)", l)]
    assert len(wait) == 1 and mem and wait[0] < min(mem), (fn.__name__, wait, mem[:3])
    # a split-K tile's count: released after its partials (acq_rel), reset by the last split without a fence
    # (the next launch sees the 0 once this one has finished)
    exch = [l for l in lines if re.search(r"\batom\..*\bexch\b", l)]
    if consts.get("SPLIT_K", 1) > 1:
        assert len(exch) == 1 and ".relaxed" in exch[0], (fn.__name__, exch)
        assert sum("acq_rel" in l for l in lines if "atom." in l) == 1, fn.__name__
    assert any("cp.async.bulk.tensor" in l for l in lines) == bool(consts.get("TMA")), fn.__name__

# LLMC_PDL_LATE: the int4 qlinear lets the next kernel's programs be placed after its main loop's last MMA
import os
os.environ["LLMC_PDL_LATE"] = "qmatmul_linear"
late = load(QSPEC, pdl=True).qmatmul_kernel.fn
del os.environ["LLMC_PDL_LATE"]
sig = {**qsig(late), **{k: "constexpr" for k in QCONSTS}}
src = ASTSource(late, sig, constexprs={(late.arg_names.index(k),): v for k, v in QCONSTS.items()})
lines = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4, "num_stages": 3, "launch_pdl": True}).asm["ptx"].splitlines()
trigger = [i for i, l in enumerate(lines) if "griddepcontrol.launch_dependents" in l]
mma = [i for i, l in enumerate(lines) if "wgmma.mma_async" in l]
assert len(trigger) == 1 and mma and trigger[0] > max(mma), (trigger, mma[-3:])

# LLMC_PDL_PREFETCH: the weight lines sent for into L2 before the wait, still no other access before it
import llmc.codegen.matmul as matmul
matmul.PDL_PREFETCH = True
fn, sig, consts = cases[len(attn)]
pre = load(MatmulSpec("bf16", False, ()), pdl=True).matmul_kernel.fn
assert pre is not fn
sig = {**sig, **{k: "constexpr" for k in consts}}
src = ASTSource(pre, sig, constexprs={(pre.arg_names.index(k),): v for k, v in consts.items()})
lines = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4, "num_stages": 3, "launch_pdl": True}).asm["ptx"].splitlines()
wait = [i for i, l in enumerate(lines) if "griddepcontrol.wait" in l]
fetch = [i for i, l in enumerate(lines) if "prefetch.global.L2" in l]
mem = [i for i, l in enumerate(lines) if re.search(r"\b(ld\.global|st\.global|cp\.async|atom\.|red\.)", l)]
assert len(wait) == 1 and fetch and max(fetch) < wait[0] < min(mem), (wait, fetch[:3], mem[:3])
print("ok")
'''


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "1") == "0", reason="the child compiles; a GPU run has the "
                                                                          "real launches")
def test_compiled_for_hopper_the_wait_precedes_every_memory_access():
    """Kernels compiled here for sm_90 (the matmul, also with the SwiGLU epilogue, the norm, prefill attention
    over bf16 and int8 caches and on its packed grid, the int4 qlinear, the fp8 one with TMA tiles): each
    compiles, and its one wait comes before any memory access, bulk tensor copies included. The split-K ones
    reset a tile's count without a fence."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-3000:] + r.stderr[-3000:]


def test_not_on_rocm(monkeypatch):
    import torch

    import llmc.codegen.kernels as k
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 4))  # an MI300's gfx942
    k._hopper_or_newer.cache_clear()
    try:
        monkeypatch.setattr(torch.version, "hip", "6.2")
        assert not k._hopper_or_newer()
        k._hopper_or_newer.cache_clear()
        monkeypatch.setattr(torch.version, "hip", None)
        assert k._hopper_or_newer()
    finally:
        k._hopper_or_newer.cache_clear()

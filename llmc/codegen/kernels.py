"""Kernel specs and rendering: Jinja fills in templates, every decision stays in Python.

Each kernel family is a frozen `KernelSpec` dataclass naming its template in
`llmc/codegen/templates/`; `render(spec)` gives the source, `load(spec)` the imported module
(through the content-hash cache). Templates are only ever rendered from llmc's own files: an
artifact's kernels/ folder is for reading, never for loading.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

import jinja2
import torch

from llmc.codegen.cache import load_source
from llmc.errors import LLMCError

TEMPLATES = Path(__file__).parent / "templates"


@lru_cache(maxsize=None)
def _env(template_dir: str | None = None) -> jinja2.Environment:
    dirs = [template_dir, str(TEMPLATES)] if template_dir else [str(TEMPLATES)]
    return jinja2.Environment(loader=jinja2.FileSystemLoader(dirs), undefined=jinja2.StrictUndefined,
                              trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)


@dataclass(frozen=True)
class KernelSpec:
    """Base of all kernel specs. Subclasses set `template` and add fields (the Jinja variables)."""

    template: ClassVar[str] = ""
    template_dir: ClassVar[str | None] = None  # a user's own template folder, searched before llmc's

    def context(self) -> dict[str, Any]:
        """Variables for the template; override to add derived values (computed here, not in Jinja)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @property
    def name(self) -> str:
        return self.template.removesuffix(".py.jinja")

    def describe(self) -> str:
        """`name(field=value, ...)` over the spec's own fields (what selects the rendered source)."""
        return f"{self.name}(" + ", ".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                                           if not isinstance(getattr(self, f.name), (list, dict, tuple))) + ")"


@lru_cache(maxsize=None)
def _hopper_or_newer() -> bool:
    # an NVIDIA GPU only: ROCm reports gfx9 devices as capability 9.x too
    return torch.cuda.is_available() and torch.version.hip is None and torch.cuda.get_device_capability()[0] >= 9


def pdl_enabled(interpret: bool | None = None) -> bool:
    """Whether kernels are rendered and launched for programmatic dependent launch (PDL): compiled for an
    NVIDIA GPU of compute capability 9.0 or newer (the interpreter runs no PTX), unless `LLMC_PDL=0`.

    With PDL a kernel's programs are placed on the GPU while the kernel before it on the stream runs its
    last programs, and wait there (`griddepcontrol.wait`, before any memory access) until it has completed
    and its writes are visible; so what overlaps is a launch's start-up (and, with LLMC_PDL_PREFETCH, a
    matmul's first weight lines on their way into L2), never a read of another kernel's output.
    Each template takes the variable `pdl` (`_pdl.jinja`), and `load` launches exactly the kernels whose
    source waits with the launch attribute, so a kernel never starts early without waiting. `interpret`:
    `interpreting()` where the caller has it already (every launch asks, through `compiled`).
    """
    if interpret is None:
        from llmc.codegen.elementwise import interpreting
        interpret = interpreting()
    return not interpret and _hopper_or_newer() and os.environ.get("LLMC_PDL", "1") != "0"


# the templates with a later trigger (`_pdl_trigger.jinja`), which LLMC_PDL_LATE may name
PDL_LATE_TEMPLATES = ("qmatmul_linear", "paged_attention_decode", "matmul")


def pdl_late(spec: KernelSpec) -> bool:
    """Whether `spec`'s kernels, launched with PDL, let the next kernel's programs be placed only once their main
    loop is done (`_pdl_trigger.jinja`) rather than right after their wait: `LLMC_PDL_LATE`, a comma-separated
    list of template names (`qmatmul_linear`, `paged_attention_decode`, `matmul`) or `all` (those three); none by
    default. Every other kernel lets the next one place its programs right after its wait, as by default.
    Placed early, the next kernel's programs hold registers, shared memory and warp slots beside this one's
    (RESULTS 2026-12-07, decode launch: with 8-warp decode attention programs PDL cost the 8B int4 decode 3% at
    batch 16; beside 4-warp ones it gains), an experiment's switch, read when a kernel is rendered. A name that has
    no later trigger is an error, not a switch that silently does nothing."""
    setting = os.environ.get("LLMC_PDL_LATE", "").strip()
    if not setting:
        return False
    names = PDL_LATE_TEMPLATES if setting == "all" else [n.strip() for n in setting.split(",") if n.strip()]
    unknown = [n for n in names if n not in PDL_LATE_TEMPLATES]
    if unknown:
        raise LLMCError(f"LLMC_PDL_LATE names {', '.join(map(repr, unknown))}: give a comma-separated list of "
                        f"{', '.join(PDL_LATE_TEMPLATES)}, or all")
    return spec.template.removesuffix(".py.jinja") in names


def render(spec: KernelSpec, pdl: bool | None = None) -> str:
    """The source of `spec`; `pdl` (default `pdl_enabled()`) is the templates' `pdl` variable, and `pdl_late`
    (`pdl_late(spec)`) theirs."""
    d = str(Path(spec.template_dir).resolve()) if spec.template_dir else None
    pdl = pdl_enabled() if pdl is None else pdl
    return _env(d).get_template(spec.template).render(**{"pdl": pdl, "pdl_late": pdl and pdl_late(spec),
                                                         **spec.context()})


class PDLKernel:
    """A jitted kernel whose source waits on the kernel before it (`_pdl.jinja`): `kernel[grid](...)`
    launches it with Triton's `launch_pdl`. Everything else is the kernel's own."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        launch = self.fn[grid]
        return lambda *args, **kwargs: launch(*args, launch_pdl=True, **kwargs)

    def __getattr__(self, name):
        return getattr(self.fn, name)


def _launch_with_pdl(module: ModuleType) -> ModuleType:
    from triton.runtime.jit import JITFunction
    for name, fn in list(vars(module).items()):
        if isinstance(fn, JITFunction) and "gdc_wait()" in fn.src:
            setattr(module, name, PDLKernel(fn))
    return module


def load(spec: KernelSpec, pdl: bool | None = None) -> ModuleType:
    """The rendered, imported module of `spec` (cached by content hash); with `pdl` (default
    `pdl_enabled()`) its kernels wait on the kernel before them and launch as PDL dependents."""
    pdl = pdl_enabled() if pdl is None else pdl
    module = load_source(render(spec, pdl), spec.name)
    return _launch_with_pdl(module) if pdl else module


_COUNTERS: dict[str, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # replaced counter buffers: captured graphs may still point at them


def tile_counters(device: torch.device, n: int) -> torch.Tensor:
    """n int32 arrival counters on `device`, zero between launches.

    For kernels whose programs split one output (split-K matmul, split-context decode attention):
    each split counts itself in, the last one combines the partials and resets its counter. One
    buffer per device, shared by every such launch: launches on one stream run one after another,
    so no two use it at once. Made by a first, eager launch (64 Ki counters cover every decode
    shape), never inside a CUDA graph capture, where its zero fill would not run; a larger request
    replaces it for later launches and keeps the old one alive for the graphs that hold it.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = str(device)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("split kernels need their counters before a CUDA graph captures them: "
                               "run the step once eagerly first")
        if buf is not None:
            _RETIRED.append(buf)
        buf = _COUNTERS[key] = torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device)
    return buf


def check_counters_released() -> None:
    """Raise if a split launch left a tile counter above zero (each must be back at 0 once its launch is
    done): the next split launch over that counter would finish its tile early or never, so outputs
    would be wrong from then on, in every kernel that shares the buffer. A host sync; once per compile."""
    for key, buf in _COUNTERS.items():
        left = int(torch.count_nonzero(buf))
        if left:
            raise RuntimeError(f"{left} split-kernel tile counters on {key} were left above zero after their "
                               "launches: a split launch did not count every split in (an llmc bug; please report "
                               "it with the model's config.json)")

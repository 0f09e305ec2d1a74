"""Pass infrastructure: Pass, PassResult, the registry, and the PassManager.

A pass is a dataclass whose fields are its options, so `--pass name{opt=value}` sets them. The
manager runs a list of passes, verifies the graph after each one when asked (always in tests),
and names the pass that broke the graph, with the IR around the failure.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from llmc.errors import CompileError, IRError
from llmc.ir.graph import Graph
from llmc.ir.verify import ir_context, verify


@dataclass
class PassResult:
    """What a pass returns: the (possibly new) graph, whether it changed, and counters for reports."""

    graph: Graph
    changed: bool
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass
class PassContext:
    """Compile-wide options and logs shared by the passes of one pipeline run."""

    options: dict[str, Any] = field(default_factory=dict)
    log: list[str] = field(default_factory=list)
    explain: list[str] = field(default_factory=list)  # why a fusion declined a candidate
    state: dict[str, Any] = field(default_factory=dict)  # what one pass hands a later one (calibration statistics)

    def note(self, msg: str) -> None:
        self.log.append(msg)


class Pass:
    """Base class. Subclass as a dataclass, set `name`, implement `run`.

    Example:
        >>> @register_pass
        ... @dataclass
        ... class Nothing(Pass):
        ...     name: ClassVar[str] = "nothing"
        ...     def run(self, graph, ctx):
        ...         return PassResult(graph, changed=False)
    """

    name: ClassVar[str] = "pass"

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:  # pragma: no cover - interface
        raise NotImplementedError

    def describe(self) -> str:
        opts = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)} if dataclasses.is_dataclass(self) else {}
        return self.name + ("{" + ", ".join(f"{k}={v}" for k, v in opts.items()) + "}" if opts else "")


PASSES: dict[str, type[Pass]] = {}


def register_pass(cls: type[Pass]) -> type[Pass]:
    """Class decorator: make a pass available by name (`--pass NAME`, `pipeline(before=NAME)`)."""
    if not getattr(cls, "name", None) or cls.name == "pass":
        raise CompileError(f"pass class {cls.__name__} needs a `name` class attribute")
    PASSES[cls.name] = cls
    return cls


def get_pass(name: str) -> type[Pass]:
    _load_builtin_passes()
    try:
        return PASSES[name]
    except KeyError:
        raise CompileError(f"unknown pass {name!r}; registered passes: {', '.join(sorted(PASSES))}") from None


def _load_builtin_passes() -> None:
    import llmc.passes.pipeline  # noqa: F401  (imports every built-in pass module)


class PassManager:
    """Runs passes in order; with `verify=True` checks the graph after each pass; `progress`, if given, is
    called with each pass as it starts."""

    def __init__(self, passes: list[Pass], verify: bool = False, dump_dir: str | Path | None = None,
                 progress=None):
        self.passes, self.verify, self.progress = list(passes), verify, progress
        self.dump_dir = Path(dump_dir) if dump_dir else None

    def run(self, graph: Graph, ctx: PassContext | None = None) -> Graph:
        ctx = ctx or PassContext()
        if self.dump_dir:
            self.dump_dir.mkdir(parents=True, exist_ok=True)
            for old in self.dump_dir.glob("[0-9][0-9]-*.ir"):  # an earlier compile's dump: not this one's passes
                old.unlink()
            (self.dump_dir / "00-input.ir").write_text(str(graph))
        for i, p in enumerate(self.passes, 1):
            if self.progress:
                self.progress(p)
            t0 = time.perf_counter()
            try:
                res = p.run(graph, ctx)
            except CompileError:
                raise
            except Exception as e:
                node = getattr(e, "node", None)
                where = ir_context(graph, node) if node is not None else ""
                raise CompileError(f"pass {p.name!r} raised {type(e).__name__}: {e} (at {_user_frame(e)})"
                                   + (f"\n{where}" if where else "")) from e
            if not isinstance(res, PassResult):
                raise CompileError(f"pass {p.name!r} returned {type(res).__name__}, not a PassResult")
            graph = res.graph
            if self.verify:
                try:
                    verify(graph)
                except IRError as e:
                    raise CompileError(f"pass {p.name!r} left the graph invalid: {e}") from None
            graph.meta.setdefault("passes", []).append(
                {"name": p.describe(), "changed": res.changed, "stats": res.stats,
                 "ms": round((time.perf_counter() - t0) * 1e3, 2)})
            if self.dump_dir:
                (self.dump_dir / f"{i:02d}-{p.name}.ir").write_text(str(graph))
        if not self.verify and self.passes:  # checked once at least: an invalid graph must not be written
            try:
                verify(graph)
            except IRError as e:
                raise CompileError(f"the passes left the graph invalid: {e} (--verify checks after every pass "
                                   "and names the pass)") from None
        return graph


def _user_frame(e: BaseException) -> str:
    """file:line of the innermost frame outside llmc itself: where a user's pass failed."""
    import traceback
    frames = traceback.extract_tb(e.__traceback__)
    import llmc
    root = str(Path(llmc.__file__).parent)
    for f in reversed(frames):
        if not f.filename.startswith(root):
            return f"{f.filename}:{f.lineno}"
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "unknown location"


# ---------------------------------------------------------------------------------------------
# pass specs from the command line: NAME, NAME{opt=value,...}, FILE.py:Class, module.path:Class

_SPEC = re.compile(r"^(?P<target>[^{]+?)(?:\{(?P<opts>.*)\})?$")


def parse_pass_spec(spec: str) -> Pass:
    """Build a pass from `name`, `name{opt=1,flag=true}`, `file.py:Class{...}` or `pkg.mod:Class`."""
    m = _SPEC.match(spec.strip())
    if not m:
        raise CompileError(f"cannot parse pass spec {spec!r}; use NAME, NAME{{opt=value}} or FILE.py:ClassName")
    target, opts = m.group("target").strip(), _parse_opts(m.group("opts") or "", spec)
    cls = load_pass_class(target) if ":" in target else get_pass(target)
    names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    bad = set(opts) - names
    if bad:
        raise CompileError(f"pass {cls.name!r} has no option(s) {sorted(bad)}; its options: {sorted(names) or 'none'}")
    for f in dataclasses.fields(cls) if dataclasses.is_dataclass(cls) else ():
        if f.name in opts and not _fits_default(opts[f.name], f.default):
            raise CompileError(f"pass {cls.name!r}: {f.name} takes {type(f.default).__name__} values like "
                               f"{f.default!r}, got {opts[f.name]!r}")
    try:
        return cls(**opts)
    except TypeError as e:
        raise CompileError(f"cannot construct pass {cls.name!r} with {opts}: {e}") from None


def fits_kind(value: Any, kind: type) -> bool:
    """Whether an option's value is of `kind`, one of bool, int, float (an int too) and str; a bool is no
    number."""
    if kind is bool or isinstance(value, bool):
        return kind is bool and isinstance(value, bool)
    return isinstance(value, (int, float) if kind is float else kind)


def _fits_default(value: Any, default: Any) -> bool:
    """Whether an option's value is of its default's kind (`fits_kind`); options whose default is none of
    bool, int, float and str (None, a config object, no default) take anything."""
    kind = type(default)
    return kind not in (bool, int, float, str) or fits_kind(value, kind)


def _parse_opts(text: str, spec: str) -> dict[str, Any]:
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "=" not in part:
            raise CompileError(f"pass option {part!r} in {spec!r} must be key=value")
        k, v = (s.strip() for s in part.split("=", 1))
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v  # a bare word is a string
    return out


def load_pass_class(target: str) -> type[Pass]:
    """Load `path/to/file.py:ClassName` or `package.module:ClassName` (a user's own pass)."""
    where, _, cls_name = target.rpartition(":")
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise CompileError(f"pass file {path} does not exist")
        from llmc.plugins import import_file
        module = import_file(path, f"llmc_user_pass_{abs(hash(str(path.resolve())))}", f"importing pass file {path}",
                             "a pass file defines passes", CompileError)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise CompileError(f"cannot import pass module {where!r}: {e}") from None
    cls = getattr(module, cls_name, None)
    if cls is None or not (isinstance(cls, type) and issubclass(cls, Pass)):
        raise CompileError(f"{where} has no Pass subclass named {cls_name!r}")
    return cls

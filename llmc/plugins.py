"""User extensions (ops, and their kernel lowerings) and where they were registered from.

A user's pass may put ops of their own into a graph (`register_op`, `register_lowering`); an artifact that
holds them loads only in a process that has registered them first (`--plugin FILE.py`, or an import of the
user's module). The worker processes of a parallel run are fresh interpreters, so each registration records
the module it came from, and the workers import the modules behind the ops of the graph they run
(`sources_for`, `import_sources`) before they load it. Only modules the user's own process imported are
imported, never anything named by an artifact.

Example:
    >>> load_plugins(["my_ops.py"])                             # doctest: +SKIP
    >>> sources_for(artifact.graph)                             # doctest: +SKIP
    [('llmc_plugin_my_ops_1234', '/home/me/my_ops.py')]
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

from llmc.errors import LLMCError

# op name -> (module name, its file) for ops registered outside llmc; lowerings likewise
OP_SOURCES: dict[str, tuple[str, str | None]] = {}
LOWERING_SOURCES: dict[str, tuple[str, str | None]] = {}
PLUGIN_PREFIX = "llmc_plugin_"


def record(table: dict, name: str, depth: int = 2) -> None:
    """Note the module that registers `name` (the caller's caller), unless it is part of llmc."""
    caller = sys._getframe(depth).f_globals
    module = caller.get("__name__", "")
    if module != "llmc" and not module.startswith("llmc."):
        table[name] = (module, caller.get("__file__"))


def load_plugins(files, option: str = "--plugin") -> None:
    """Import each Python file, in order, once, as a uniquely named module (a plugin named json.py must not
    shadow the standard library). Errors name the file after `option`."""
    for f in files:
        path = Path(f)
        if not path.is_file():
            raise LLMCError(f"{option} {f}: " + ("no such file" if not path.exists() else "not a file")
                            + "; give the Python file that registers your ops")
        if path.suffix != ".py":
            raise LLMCError(f"{option} {f}: not a Python file; give the FILE.py that registers your ops")
        name = f"{PLUGIN_PREFIX}{path.stem}_{abs(hash(str(path.resolve())))}"
        if name not in sys.modules:
            import_file(path, name, f"{option} {f}: importing it", "a plugin registers ops and passes")


def import_file(path: Path, name: str, what: str, role: str, error: type[LLMCError] = LLMCError):
    """Run a user's Python file as the module `name` and return it (registered in sys.modules while it runs, as
    dataclasses need, and dropped again if it fails). Its failure, or its call of sys.exit (the file's exit, not
    this process's), is `error`: "{what} failed: ..." / "{what} called sys.exit(...); {role} and must not exit"."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except SystemExit as e:
        del sys.modules[name]
        raise error(f"{what} called sys.exit({e.code!r}); {role}, and must not exit") from None
    except Exception as e:
        del sys.modules[name]
        raise error(f"{what} failed: {type(e).__name__}: {e}") from e
    return module


def sources_for(graph) -> list[tuple[str, str | None]]:
    """The modules (name, file) that registered the graph's ops of a user's, and those ops' lowerings, in
    the order first met. Raises LLMCError for one registered by a process's main script, which another
    process cannot import without running the script again."""
    out: dict[tuple[str, str | None], None] = {}
    for op in sorted({n.op for n in graph.nodes}):
        for table, what in ((OP_SOURCES, "op"), (LOWERING_SOURCES, "lowering of")):
            src = table.get(op)
            if src is None:
                continue
            if src[0] in ("__main__", "__mp_main__"):
                raise LLMCError(f"the {what} {op!r} is registered by the main script, which the parallel workers "
                                "cannot import; move its registration into a module file and import that (or "
                                "pass the file as --plugin FILE.py)")
            out[src] = None
    return list(out)


def import_sources(sources) -> None:
    """Import what `sources_for` listed (in a worker, before it loads the artifact): a --plugin file again by
    its path, any other module by its name, from the directory that held its package where the name alone
    does not find it."""
    for module, file in sources:
        if module in sys.modules:
            continue
        if module.startswith(PLUGIN_PREFIX) and file:
            load_plugins([file], option="a plugin of the driver's,")
            continue
        if file:  # the directory the module was imported from, where the worker's path lacks it
            root = Path(file).resolve().parent
            for _ in range(module.count(".") + (Path(file).name == "__init__.py")):
                root = root.parent
            if str(root) not in sys.path:
                sys.path.append(str(root))
        try:
            importlib.import_module(module)
        except Exception as e:
            raise LLMCError(f"importing {module} (which registers ops of this artifact) failed in a parallel "
                            f"worker: {type(e).__name__}: {e}") from e

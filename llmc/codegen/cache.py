"""Content-hash cache for rendered kernel sources.

The key covers the source text, the Triton version and the device capability, so a change to any
of them renders and compiles afresh. Files are written atomically (write to a temp name, rename),
so concurrent processes never import a half-written module.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
import threading
from pathlib import Path
from types import ModuleType

_MODULES: dict[str, ModuleType] = {}
_LOADING = threading.Lock()


def cache_root() -> Path:
    """llmc's cache folder: $LLMC_CACHE_DIR, else ~/.cache/llmc (kernels/: compiled sources; tuning/:
    the choices compiles timed, per device)."""
    return Path(os.environ.get("LLMC_CACHE_DIR", Path.home() / ".cache" / "llmc"))


def cache_dir() -> Path:
    d = cache_root() / "kernels"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _device_tag() -> str:
    try:
        import torch
        if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            major, minor = torch.cuda.get_device_capability()
            return f"sm{major}{minor}"
    except Exception:
        pass
    return "interp" if os.environ.get("TRITON_INTERPRET") == "1" else "cpu"


def source_key(source: str) -> str:
    import triton
    h = hashlib.sha256()
    for part in (source, triton.__version__, _device_tag()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


def load_source(source: str, name_hint: str = "kernel") -> ModuleType:
    """Import a rendered source through the on-disk cache (Triton's JIT needs a real file to read).
    One module per source, also when threads ask at once (a tuning's warm-up): its JIT functions hold
    every config compiled so far."""
    key = source_key(source)
    with _LOADING:
        return _MODULES[key] if key in _MODULES else _import(source, name_hint, key)


def _import(source: str, name_hint: str, key: str) -> ModuleType:
    path = cache_dir() / f"{name_hint}_{key}.py"
    if not path.exists():
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(source)
        os.replace(tmp, path)
    mod_name = f"llmc_kernels.{path.stem}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    spec.loader.exec_module(module)
    _MODULES[key] = module
    return module

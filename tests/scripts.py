"""The repository's scripts/ and benchmarks/ (not packages) loaded as modules, for the tests and benchmarks
that call their functions."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
BENCHMARKS = SCRIPTS.parent / "benchmarks"


def load_script(name: str, where: Path = SCRIPTS) -> ModuleType:
    """scripts/NAME.py (or NAME.py in `where`) as the module NAME (registered in sys.modules: dataclasses look
    their module up while it executes)."""
    spec = importlib.util.spec_from_file_location(name, where / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module

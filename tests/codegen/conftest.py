"""Codegen tests run the generated kernels under Triton's interpreter: TRITON_INTERPRET is set by
tests/conftest.py, before anything imports triton."""


def library_interpreted() -> bool:
    """Whether triton's library was decorated for the interpreter (TRITON_INTERPRET was set before its
    first import): the kernels then run on the CPU; otherwise they need a GPU."""
    from llmc.codegen.elementwise import interpreting
    if not interpreting():
        return False
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(tl.zeros, InterpretedFunction)


def sass_loop():
    """benchmarks/sass_loop.py as a module (main-loop instruction counts of kernels compiled for sm_90); skips the
    calling test where this triton ships no cuobjdump."""
    import importlib.util
    import sys
    from pathlib import Path

    import pytest
    path = Path(__file__).parents[2] / "benchmarks" / "sass_loop.py"
    spec = importlib.util.spec_from_file_location("sass_loop", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["sass_loop"] = module
    spec.loader.exec_module(module)
    if not module.cuobjdump().is_file():
        pytest.skip("this triton ships no cuobjdump")
    return module

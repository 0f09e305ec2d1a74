"""Codegen tests run the generated Triton kernels on CPU, under Triton's interpreter.

How Triton reads TRITON_INTERPRET (triton 3.9: `triton/knobs.py`, `triton/runtime/jit.py`): from
`os.environ`, each time `triton.knobs.runtime.interpret` is read; `@triton.jit` reads it when it
*decorates* a function and fixes it there (an `InterpretedFunction` or a compiled `JITFunction`).
Triton's own library (`tl.sum`, `tl.max`, `tl.zeros`, `tl.sigmoid`, ...) is `@jit`-decorated when
`triton` is first imported, so the variable must be set before the process's first `import
triton`: set later, an interpreted kernel calling `tl.sum` fails with "Cannot call @triton.jit'd
outside of the scope of a kernel". llmc's kernels are rendered and imported lazily
(`codegen.kernels.load`), and the rendered-module cache key includes the interpreter flag.

pytest loads the conftest.py of every path on its command line before collecting anything, and
`pytest tests` collects tests/codegen first, so this file normally runs before any import of
triton (neither torch nor llmc import it). If triton is already imported, setting the variable
would only break things, so it is left alone; test modules check that the library was decorated
interpreted (`isinstance(tl.zeros, InterpretedFunction)`) and otherwise run compiled on a GPU, or
skip (or rerun themselves in a child process) saying why.

`setdefault`: `TRITON_INTERPRET=0 pytest tests/codegen` on a GPU machine runs the tests compiled.
The setting holds for the rest of the pytest process (tests of other folders collected later).
"""
import os
import sys

if "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")


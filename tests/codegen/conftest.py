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

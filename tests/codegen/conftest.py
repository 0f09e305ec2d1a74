"""Codegen tests run the generated kernels under Triton's interpreter: TRITON_INTERPRET is set by
tests/conftest.py, before anything imports triton."""

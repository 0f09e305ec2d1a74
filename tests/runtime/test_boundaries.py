"""The runtime's boundaries: it imports no compiler code, and loading or running a model changes no
process-wide state (environment, transformers' logging)."""
import os
import subprocess
import sys

from llmc.runtime.llm import LLM, SamplingParams


def test_runtime_imports_no_compiler_code():
    code = ("import sys, llmc, llmc.runtime.engine, llmc.runtime.async_engine; "
            "print(sorted(m for m in sys.modules if m.startswith(('llmc.passes', 'llmc.frontend', 'llmc.compiler'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_compile_and_run_leave_process_state_alone(llama_dir, tmp_path):
    import llmc
    from transformers.utils import logging as hf_logging
    env = dict(os.environ)
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    art = llmc.compile(llama_dir, tmp_path / "m.llmc")
    LLM(art, backend="reference", num_blocks=16, block_size=4).generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    assert dict(os.environ) == env
    assert (hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()) == (verbosity, bars)

"""llmc: an ahead-of-time compiler and runtime for large language model inference.

    >>> import llmc
    >>> art = llmc.compile("builtin:tiny-py", "tiny.llmc")          # doctest: +SKIP
    >>> llm = llmc.LLM("tiny.llmc")                                  # doctest: +SKIP
    >>> llm.generate(["def fib(n):"], llmc.SamplingParams(max_tokens=32))[0].text  # doctest: +SKIP
"""
__version__ = "0.1.0"

from llmc.errors import ArtifactError, CompileError, LLMCError, RequestError  # noqa: E402
from llmc.ir.graph import Graph  # noqa: E402
from llmc.passes.manager import Pass, PassResult, register_pass  # noqa: E402


def compile(model, output=None, **options):
    """Compile a model into an artifact; see `llmc.compiler.compile`."""
    from llmc.compiler import compile as _compile
    return _compile(model, output, **options)


def load(path, verify: bool = True):
    """Load an artifact directory (format version and file hashes checked)."""
    from llmc.runtime.artifact import load_artifact
    return load_artifact(path, verify=verify)


def __getattr__(name):
    # the runtime pulls in more of torch; import it on first use
    if name in ("LLM", "SamplingParams", "RequestOutput"):
        from llmc.runtime import engine
        return getattr(engine, name)
    raise AttributeError(name)


__all__ = ["compile", "load", "LLM", "SamplingParams", "RequestOutput", "Graph", "Pass", "PassResult",
           "register_pass", "LLMCError", "CompileError", "ArtifactError", "RequestError"]

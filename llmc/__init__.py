"""llmc: an ahead-of-time compiler and runtime for large language model inference.

    >>> import llmc
    >>> art = llmc.compile("builtin:tiny-py", "tiny.llmc")          # doctest: +SKIP
    >>> llm = llmc.LLM("tiny.llmc")                                  # doctest: +SKIP
    >>> llm.generate(["def fib(n):"], llmc.SamplingParams(max_tokens=32))[0].text  # doctest: +SKIP
"""
__version__ = "0.1.0"

from llmc.errors import ArtifactError, CompileError, LLMCError, RequestError  # noqa: E402


def compile(model, output=None, **options):
    """Compile a model into an artifact; see `llmc.compiler.compile`."""
    from llmc.compiler import compile as _compile
    return _compile(model, output, **options)


def load(path, verify: bool | str = True):
    """Load an artifact directory (format version and file hashes checked; with verify="background" the hashes
    are checked on threads while the caller goes on, and an engine made from it waits for that check before
    it runs: `Artifact.wait_verified()`)."""
    from llmc.artifact import load_artifact
    return load_artifact(path, verify=verify)


# Imported on first use, each from its own side of the artifact: a process that only runs models
# never imports the compiler, and one that only compiles never imports the runtime.
_LAZY = {"LLM": "llmc.runtime.llm", "SamplingParams": "llmc.runtime.engine",
         "RequestOutput": "llmc.runtime.engine", "AsyncLLM": "llmc.runtime.async_engine",
         "Graph": "llmc.ir.graph", "Pass": "llmc.passes.manager", "PassResult": "llmc.passes.manager",
         "register_pass": "llmc.passes.manager"}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'llmc' has no attribute {name!r}")


__all__ = ["compile", "load", "LLM", "AsyncLLM", "SamplingParams", "RequestOutput", "Graph", "Pass",
           "PassResult", "register_pass", "LLMCError", "CompileError", "ArtifactError", "RequestError"]

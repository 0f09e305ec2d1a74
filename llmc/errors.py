"""llmc's own exceptions: each carries a message written for the user (what was wrong, what to do).

The CLI prints the message of an `LLMCError` without a traceback; `--debug` shows the traceback.
"""


class LLMCError(Exception):
    """Base of every error a user can meet."""


class CompileError(LLMCError):
    """The model cannot be captured, lowered or compiled."""


class ArtifactError(LLMCError):
    """An artifact is missing, corrupted or of an unknown format."""


class RequestError(LLMCError):
    """A generation request is invalid (empty prompt, bad sampling parameters, ...)."""


class IRError(LLMCError):
    """A graph is malformed: type errors, dangling values, unparsable text."""

"""Perplexity of a text under a compiled model, scored by the engine itself (`llmc eval`).

The text's tokens are cut into windows that each fit the model's context; every window is one
request asking for its prompt log-probabilities (`SamplingParams.prompt_logprobs`), and the engine
batches them like any other requests, on any backend. Perplexity is `exp(nll)`, `nll` the mean
negative log-likelihood (nats) of the scored tokens.

Windows follow `llmc/models/evaluate.py`, so that the numbers compare with the built-in models'
`metrics.json`: window i holds tokens [i * W, (i + 1) * W] (W + 1 tokens) and scores its last W, each
given the tokens before it in its own window only (no context carried over). Neighbouring windows
share one token, so every token but the text's first is scored exactly once, whatever W is.

W defaults to that module's 512 tokens (fewer if the context is shorter), not to the whole context:
a perplexity depends on the context each token gets, so one fixed W keeps numbers comparable between
models and runs, and a model trained on shorter sequences than its position table allows (the
built-in ones: 512 of 1024) would otherwise be measured past what it learnt.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from llmc.artifact import Artifact
from llmc.errors import RequestError
from llmc.models.evaluate import DEFAULT_WINDOW
from llmc.runtime.llm import LLM, SamplingParams

DATASETS = ("builtin:heldout",)


@dataclass(frozen=True)
class Perplexity:
    """The result of `perplexity`: `perplexity == exp(nll)`."""

    perplexity: float
    nll: float  # mean negative log-likelihood of a scored token, in nats
    tokens: int  # tokens scored
    windows: int  # requests they were scored in
    window: int  # most tokens scored per window

    def to_json(self) -> dict:
        return asdict(self)


def perplexity(model: LLM | Artifact | str | Path, text: str | Sequence[int], *, max_tokens: int | None = None,
               window: int | None = None, progress: bool = False, **options) -> Perplexity:
    """Perplexity of `text` under `model`, from the engine's prompt log-probabilities.

    Args:
        model: an `LLM` (its engine options are kept), or an artifact or its path.
        text: the text (tokenized with the artifact's tokenizer, no special tokens added) or its token ids.
        max_tokens: score only the first `max_tokens` tokens after the text's first (which has no context
            to be predicted from); None: the whole text.
        window: most tokens scored per window (see the module docstring); None: 512, or as many as the
            model's context holds if fewer (a window of W scored tokens is a prompt of W + 1).
        progress: show a progress bar (windows done) on the terminal.
        **options: engine options (`EngineConfig` fields) when `model` is not an `LLM` already.

    Returns:
        a `Perplexity`.

    Raises:
        RequestError: text that cannot be scored (fewer than 2 tokens, or text and no tokenizer), or a
            window or max_tokens out of range.

    Example:
        >>> from llmc.evaluate import dataset_text, perplexity
        >>> r = perplexity("tiny.llmc", dataset_text("builtin:heldout"), max_tokens=4096)  # doctest: +SKIP
        >>> r.perplexity, r.tokens, r.windows                                              # doctest: +SKIP
    """
    if options and isinstance(model, LLM):
        raise RequestError("engine options apply to a model given by its artifact, not to an LLM already built")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                   or max_tokens < 1):
        raise RequestError(f"max_tokens must be an int >= 1 (tokens to score), got {max_tokens!r}")
    llm = model if isinstance(model, LLM) else LLM(model, **options)
    ids = _token_ids(llm, text, max_tokens)
    window = _window(llm, window)
    chunks = windows(ids, window)
    scored = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)  # the one sampled token is unused
    outs = llm.generate(chunks, scored, progress=progress)
    nll = -math.fsum(lp for o in outs for lp in o.prompt_logprobs[1:])
    n = len(ids) - 1
    return Perplexity(math.exp(nll / n), nll / n, n, len(chunks), window)


def windows(ids: Sequence[int], window: int) -> list[list[int]]:
    """Windows of `window` + 1 tokens (the last one shorter) that overlap by one token: each scores its
    tokens after the first, and together they score every token of `ids` after its first once."""
    return [list(ids[i:i + window + 1]) for i in range(0, len(ids) - 1, window)]


def read_utf8(path: str | Path, what: str, by_line: bool = False) -> str:
    """A UTF-8 file as stored, decoded from its bytes (`Path.read_text`'s universal newlines would turn
    "\\r\\n" into "\\n"). A missing file, or one not UTF-8, is a RequestError naming it after the option
    `what` that gave it; with `by_line` (a file of one request a line) the bad byte is placed as PATH:LINE."""
    path = Path(path)
    if not path.is_file():
        raise RequestError(f"{what} {path}: " + ("no such file" if not path.exists() else "not a file"))
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        where = f"{path}:{line}" if by_line else f"{what} {path}"
        raise RequestError(f"{where}: not UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start}); save the "
                           "file as UTF-8") from None


def read_text(path: str | Path, what: str = "--text") -> str:
    """A UTF-8 text file to score, as stored (`read_utf8`: "\\r\\n" kept, which the tokens scored depend on)."""
    text = read_utf8(path, what)
    if not text:
        raise RequestError(f"{what} {path} is empty; give a file with some text to score")
    return text


def dataset_text(name: str) -> str:
    """The text of a shipped data set: builtin:heldout is Python standard-library source that the built-in
    models never saw in training (`llmc/models/data/heldout.txt`)."""
    if name not in DATASETS:
        raise RequestError(f"unknown dataset {name!r}; known: {', '.join(DATASETS)} (or give your own file with "
                           "--text FILE)")
    from llmc.models import heldout_text_path
    return read_text(heldout_text_path(), "--dataset")


def _token_ids(llm: LLM, text: str | Sequence[int], max_tokens: int | None) -> list[int]:
    """The tokens to score (the first one only as context), cut to `max_tokens` scored ones."""
    if isinstance(text, str):
        tok = llm.engine.tokenizer
        if tok is None:
            raise RequestError("this artifact has no tokenizer (its model had no tokenizer files), so it cannot "
                               "score text: give token ids instead")
        # the engine's own tokenization of a prompt; verbose=False: no warning that the text is longer
        # than the model's context (it is cut into windows)
        ids = tok(text, add_special_tokens=False, verbose=False)["input_ids"] if text else []
    else:
        ids = list(text)
    if len(ids) < 2:
        raise RequestError(f"the text has {len(ids)} token{'' if len(ids) == 1 else 's'}; a perplexity needs at "
                           "least 2 (the first is only context)")
    return ids if max_tokens is None else ids[:max_tokens + 1]


def _window(llm: LLM, window: int | None) -> int:
    """Tokens scored per window: a prompt of window + 1 tokens must leave the one generated token room."""
    longest = llm.engine.max_model_len - 2
    if window is None:
        return min(DEFAULT_WINDOW, longest)
    if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= longest:
        raise RequestError(f"window must be an int from 1 to {longest}, got {window!r}: the model's context is "
                           f"{llm.engine.max_model_len} tokens, and a window of W scored tokens is a prompt of W + 1 "
                           "with room for one generated token")
    return window

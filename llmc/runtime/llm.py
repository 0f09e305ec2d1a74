"""The offline API: `LLM` over an engine (llmc/runtime/engine.py), with the queue order of its `generate`.

    >>> from llmc.runtime.llm import LLM, SamplingParams                            # doctest: +SKIP
    >>> with LLM("tiny.llmc") as llm:                                              # doctest: +SKIP
    ...     print(llm.generate(["def add(a, b):"], SamplingParams(max_tokens=16))[0].text)
"""
from __future__ import annotations

import operator
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Sequence as Seq

from llmc.artifact import Artifact
from llmc.errors import RequestError
from llmc.runtime import heap
from llmc.runtime.engine import CompletionOutput, LLMEngine, RequestOutput, engine_config, load_model
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.spec_decode import SpecConfig

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "longest_first_order"]


class LLM:
    """Offline generation over a compiled artifact.

    Args:
        model: an artifact path (or a loaded Artifact).
        speculative: speculative decoding, e.g. `{"method": "draft", "draft": "draft.llmc",
            "num_speculative_tokens": "auto"}` or `{"method": "ngram"}` (see `SpecConfig`); None: off.
        **options: engine options, the fields of `EngineConfig` (max_num_seqs, max_num_batched_tokens,
            block_size, num_blocks, kv_cache_dtype, backend, device, ...).

    Example:
        >>> llm = LLM("tiny.llmc", max_num_seqs=8)                                    # doctest: +SKIP
        >>> llm.generate(["def add(a, b):"], SamplingParams(max_tokens=16))[0].text   # doctest: +SKIP
    """

    def __init__(self, model: str | Path | Artifact, speculative: dict | SpecConfig | None = None, **options):
        self.engine = LLMEngine(load_model(model), engine_config(**options), speculative)
        # closed, or collected without close(): the heap the engine froze is thawed and collected, so its
        # device memory goes even where its objects form cycles
        self._thaw = weakref.finalize(self, heap.release, self.engine.heap_token)
        self._thaw.atexit = False  # at exit heap.py thaws the heap without collecting

    def close(self) -> None:
        """Release what the engine holds: a parallel run's worker processes, or this process's KV cache,
        weights on the GPU and step graphs (a draft model's too); otherwise that happens when the LLM is
        collected, and at exit. `with LLM(...) as llm:` closes it on leaving the block. A closed LLM runs
        no more requests."""
        thaw = getattr(self, "_thaw", None)  # (stand-ins made with LLM.__new__ have none)
        if thaw is not None:
            thaw()
        proposer = getattr(self.engine.spec, "proposer", None)
        draft = getattr(getattr(proposer, "draft", proposer), "executor", None)  # a cascade's draft, or the draft
        for ex in (self.engine.executor, draft):
            close = getattr(ex, "close", None)
            if close is not None:
                close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: str | Seq[str] | Seq[Seq[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None,
                 progress: bool = False, request_ids: Seq[str] | None = None,
                 longest_first: bool = True) -> list[RequestOutput]:
        """Generate for every prompt (continuous batching); outputs in the order of `prompts`.

        Every request is validated before any runs: one bad request raises RequestError and nothing is
        generated. If anything fails (or the call is interrupted), the call's requests are aborted and
        the engine stays usable. `request_ids`: one unique id per prompt (default: fresh ones).

        `longest_first`: the call returns when its last request finishes, so its requests are queued in
        order of their most output tokens, largest first (ties in the order given; priorities still come
        first). A request's tokens come one a step, so the one with the most sets the call's step count
        unless it starts early: queued last, a long request runs on alone in a shrinking batch while the
        short ones that went before it are done (the longest-processing-time-first rule for makespan).
        False queues them in the order given.
        """
        final: dict[str, RequestOutput] = {}
        ids = self._add_all(prompts, params, request_ids, longest_first)
        mine = set(ids)
        bar = _bar(progress, len(ids))
        try:
            while len(final) < len(ids):
                for o in self.engine.step(finished_only=True):
                    if o.finished and o.request_id in mine:
                        final[o.request_id] = o
                        bar(1)
        finally:
            bar(None)
            self._abort_unfinished(ids, final)
        return [final[i] for i in ids]

    def chat(self, messages: Seq[dict] | Seq[Seq[dict]], params: SamplingParams | Seq[SamplingParams] | None = None,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             progress: bool = False) -> list[RequestOutput]:
        """Generate a reply to one conversation, or to each of several (a list of conversations), as `generate`
        does for prompts: each rendered into its prompt text by the chat template first.

        Args:
            messages: one conversation, a list of {"role", "content"[, "name"]} dicts, or a list of them.
            params: sampling parameters, one for all or one per conversation.
            chat_template: Jinja source to use instead of the artifact's (its tokenizer's `chat_template`).
            add_generation_prompt: end the text with the template's opening of an assistant turn.

        Returns:
            One RequestOutput per conversation, in order. RequestError (nothing generated) where the artifact
            has no template and none is given, a message is malformed, or the template refuses them.

        Example:
            >>> llm.chat([{"role": "user", "content": "Write a haiku."}])[0].text   # doctest: +SKIP
        """
        from llmc.chat import conversation_texts
        texts = conversation_texts(self.engine, messages, chat_template, add_generation_prompt)
        return self.generate(texts, params, progress=progress)

    def stream(self, prompts: str | Seq[str] | Seq[Seq[int]],
               params: SamplingParams | Seq[SamplingParams] | None = None,
               request_ids: Seq[str] | None = None, longest_first: bool = False) -> Iterator[RequestOutput]:
        """Like `generate`, but yields after every step the outputs of this call's requests that progressed,
        each with `outputs[i].delta_text` / `delta_token_ids` (new since its previous output) and totals.
        Closing the iterator early aborts the requests that have not finished. Give `request_ids` to tell
        the outputs of several prompts apart (`out.request_id`). Requests are queued in the order given
        (the first prompt is the first answered), or with `longest_first` as `generate` queues them.

        Example:
            >>> for out in llm.stream("def fib(n):", SamplingParams(max_tokens=32)):   # doctest: +SKIP
            ...     print(out.outputs[0].delta_text, end="", flush=True)
        """
        ids = self._add_all(prompts, params, request_ids, longest_first)
        mine, final = set(ids), {}
        try:
            while len(final) < len(ids):
                for o in self.engine.step():
                    if o.request_id in mine:
                        if o.finished:
                            final[o.request_id] = o
                        yield o
        finally:
            self._abort_unfinished(ids, final)

    def _add_all(self, prompts, params, request_ids=None, longest_first: bool = False) -> list[str]:
        """Validate every request, then queue them all (or none): in the order given, or with `longest_first`
        in order of their most output tokens, largest first (stable). Ids in the order given either way."""
        prompts = _prompt_list(prompts)
        if params is not None and not isinstance(params, (SamplingParams, list, tuple)):
            raise TypeError(f"params must be a SamplingParams or a list of them, one per prompt; got "
                            f"{type(params).__name__}" + (" (write SamplingParams(**params))"
                                                         if isinstance(params, dict) else ""))
        plist = list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(prompts)
        if not all(isinstance(p, SamplingParams) for p in plist):
            bad = next(p for p in plist if not isinstance(p, SamplingParams))
            raise TypeError(f"params must be SamplingParams, got a {type(bad).__name__} in the list")
        if len(plist) != len(prompts):
            raise RequestError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        rids = list(request_ids) if request_ids is not None else [None] * len(prompts)
        if len(rids) != len(prompts) or len({r for r in rids if r is not None}) != sum(r is not None for r in rids):
            raise RequestError(f"give one unique request id per prompt ({len(prompts)} prompts, {len(rids)} ids)")
        taken = [r for r in rids if r in self.engine.requests]
        if taken:
            raise RequestError(f"request id {taken[0]!r} is already in use")
        for p in plist:
            p.validate()
        encoded = [self.engine.encode(pr) for pr in prompts]
        eng = self.engine
        ids = [r if r is not None else f"req-{next(eng._ids)}" for r in rids]
        order = longest_first_order([(len(e), p.max_tokens) for e, p in zip(encoded, plist)], eng.max_model_len) \
            if longest_first else range(len(prompts))
        added: list[str] = []
        try:
            for i in order:
                pr = prompts[i]
                added.append(eng._add(encoded[i], plist[i], ids[i], pr if isinstance(pr, str) else None))
        except BaseException:
            self._abort_unfinished(added, {})
            raise
        return ids

    def _abort_unfinished(self, ids: list[str], final: dict) -> None:
        """Abort this call's requests that did not finish and drop their outputs (nobody will read them)."""
        eng = self.engine
        left = [i for i in ids if i not in final and i in eng.requests]
        for i in left:
            eng.abort(i)
        if left:
            for g in eng.scheduler.take_finished(set(left)):
                eng.requests.pop(g.request_id, None)

    def stats(self) -> dict[str, int]:
        return self.engine.stats()


def _prompt_list(prompts) -> list:
    """`generate`'s prompts as a list of prompts: a string or one list of token ids is one prompt; any other
    iterable (a generator too) is taken as prompts. TypeError for what is neither."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (bytes, bytearray)):
        raise TypeError("prompts must be a string, token ids, or a list of them; got bytes: decode them first")
    if prompts is None or not hasattr(prompts, "__iter__"):
        raise TypeError(f"prompts must be a string, token ids, or a list of them; got {type(prompts).__name__}")
    if not hasattr(prompts, "__getitem__"):
        prompts = list(prompts)  # a generator, a set: read once
    if len(prompts) and _is_token(prompts[0]):
        return [prompts]
    return prompts if isinstance(prompts, list) else list(prompts)


def _is_token(x) -> bool:
    """Whether x is one token id (an int, a numpy integer, a one-element integer tensor)."""
    try:
        operator.index(x)
    except TypeError:
        return False
    return True


def longest_first_order(requests: Seq[tuple[int, int]], max_model_len: int) -> list[int]:
    """Indices of `requests` (prompt tokens, max_tokens) by their most output tokens, largest first, ties in
    the order given: `LLM.generate`'s queue order. A request's output is bounded by its max_tokens and by the
    context its prompt leaves.

    Example:
        >>> longest_first_order([(10, 8), (10, 64), (60, 64), (10, 8)], max_model_len=64)
        [1, 0, 3, 2]
    """
    return sorted(range(len(requests)), key=lambda i: -min(requests[i][1], max_model_len - requests[i][0]))


def _bar(enabled: bool, total: int):
    if not enabled:
        return lambda n: None
    from rich.progress import Progress
    p = Progress(transient=True)
    p.start()
    task = p.add_task("generating", total=total)

    def advance(n):
        if n is None:
            p.stop()
        else:
            p.advance(task, n)
    return advance

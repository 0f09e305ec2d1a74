"""Streaming, asynchronous generation: one engine loop thread, many consumers on any event loops.

The `LLMEngine` is not thread-safe, so exactly one thread (the loop thread started here) ever
calls it. Consumers never touch the engine: they send commands (add, abort, cancel) through a
thread-safe queue, and the loop thread hands each `RequestOutput` back to the consumer's own
event loop with `call_soon_threadsafe`. The loop thread drains all pending commands before each
`engine.step()`, so a request added while a step runs joins the very next batch, and it blocks on
the command queue when the engine has no work, so an idle `AsyncLLM` costs no CPU.

Ownership of a request id: the loop thread maps each live request id to the `_Stream` that added
it. A consumer that goes away (cancelled, closed, `break`) sends "cancel" with its own stream, so
it can abort only its own request, never a later request that reused the id after a failed add.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Sequence as Seq

from llmc.artifact import Artifact
from llmc.errors import LLMCError, RequestError
from llmc.runtime import heap
from llmc.runtime.engine import LLMEngine, RequestOutput, engine_config, load_model
from llmc.runtime.sampling_params import SamplingParams

log = logging.getLogger(__name__)

__all__ = ["AsyncLLM"]

_STOP = object()  # the command that ends the loop thread


@dataclass(eq=False)
class _Stream:
    """One consumer's request: where its outputs go (a queue on the consumer's own event loop)."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False  # the consumer is gone: drop its outputs


class AsyncLLM:
    """Streaming generation over one shared `LLMEngine`, for many concurrent asyncio consumers.

    Consumers may run on different event loops (in different threads). Cancelling a consumer's
    task, closing its generator or breaking out of its `async for` aborts its request and frees
    its KV blocks. If an engine step fails, every request in flight then raises that error (an
    `LLMCError`; other exceptions are wrapped in one) and the loop goes on serving new requests.
    The loop thread keeps the engine (and its KV cache) alive until `shutdown()` or the end of an
    `async with` block.

    Args:
        model: an artifact path (or a loaded Artifact).
        speculative: speculative decoding options, as for `llmc.LLM`.
        **engine_options: the options of `llmc.LLM` (`EngineConfig` fields: max_num_seqs,
            num_blocks, block_size, backend, ...).

    Example:
        >>> async def main():                                                       # doctest: +SKIP
        ...     async with AsyncLLM("tiny.llmc", max_num_seqs=8) as llm:
        ...         async for out in llm.generate("def add(a, b):", SamplingParams(max_tokens=16)):
        ...             print(out.outputs[0].delta_text, end="", flush=True)
        >>> asyncio.run(main())                                                     # doctest: +SKIP
    """

    def __init__(self, model: str | Path | Artifact, speculative: dict | None = None, **engine_options):
        # built exactly as `llmc.LLM` builds its engine, so the two take the same options
        self.engine = LLMEngine(load_model(model), engine_config(**engine_options), speculative)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # live requests; the loop thread's alone
        # `_closed` and the last put happen under one lock, so no command can slip in behind the
        # loop thread's final drain and wait forever
        self._lock = threading.Lock()
        self._closed = False
        self._error: BaseException | None = None  # why the loop thread died, if it did
        self._thread = threading.Thread(target=self._run, name="llmc-async-engine", daemon=True)
        self._thread.start()

    # -- the consumers' side ----------------------------------------------------------------------
    async def chat(self, messages: Seq[dict], params: SamplingParams | None = None, request_id: str | None = None,
                   chat_template: str | None = None, add_generation_prompt: bool = True
                   ) -> AsyncIterator[RequestOutput]:
        """Stream the reply to one conversation (a list of {"role", "content"} dicts), rendered by the artifact's
        chat template or `chat_template=` as `LLM.chat` renders it; otherwise as `generate`.

        Example:
            >>> async for out in llm.chat([{"role": "user", "content": "hi"}]):  # doctest: +SKIP
            ...     print(out.outputs[0].delta_text, end="")
        """
        from llmc.chat import conversation_texts
        if not isinstance(messages, Seq) or isinstance(messages, str) or \
                (messages and not isinstance(messages[0], Mapping)):
            raise RequestError("AsyncLLM.chat takes one conversation: a list of {'role', 'content'} dicts")
        (text,) = conversation_texts(self.engine, messages, chat_template, add_generation_prompt)
        async for out in self.generate(text, params, request_id):
            yield out

    async def generate(self, prompt: str | Seq[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs as the engine produces them.

        Args:
            prompt: text, or token ids.
            params: sampling options (default `SamplingParams()`).
            request_id: a unique id (default: a fresh one); reusing a live id is a RequestError.

        Returns:
            an async iterator of `RequestOutput`s, in order; the last has `finished=True`. Each
            `outputs[i]` carries `delta_text` / `delta_token_ids`: what is new since the previous
            output. A bad request raises `RequestError` at the first `__anext__`.

        Example:
            >>> async for out in llm.generate("def f(x):", SamplingParams(max_tokens=8)):  # doctest: +SKIP
            ...     print(out.outputs[0].delta_text, end="")
        """
        stream = _Stream(request_id if request_id is not None else f"async-{uuid.uuid4().hex}",
                         asyncio.get_running_loop())
        if not isinstance(prompt, str):
            try:  # a private copy: the caller may reuse its list before the loop thread reads it
                prompt = list(prompt)
            except TypeError:
                pass  # not a sequence: the engine's check rejects it with a RequestError
        self._send(("add", stream, prompt, params))
        done = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                done = item.finished
                yield item
                if done:
                    return
        finally:
            if not done:  # cancelled, closed, collected or broken out of: free the engine's blocks
                self._send(("cancel", stream), quiet=True)

    async def abort(self, request_id: str) -> bool:
        """Abort a live request by id; its consumer then gets a final output with reason "abort".

        Args:
            request_id: the id given to (or made by) `generate`.

        Returns:
            True if a live request had that id, False otherwise.

        Example:
            >>> await llm.abort("req-7")  # doctest: +SKIP
            True
        """
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._send(("abort", request_id, fut))
        return await asyncio.wrap_future(fut)

    def shutdown(self, timeout: float | None = None) -> None:
        """Abort what is left (its consumers get their "abort" outputs), stop and join the loop thread.

        Safe to call twice; `generate` and `abort` afterwards raise LLMCError.

        Args:
            timeout: seconds to wait for the thread (None: until it ends, i.e. after the current step).
        """
        with self._lock:
            if not self._closed:
                self._closed = True
                self._commands.put(_STOP)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc) -> None:
        # joining blocks this event loop for at most the step in progress; the loop thread never
        # waits on a consumer's loop, so this cannot deadlock
        self.shutdown()

    def _send(self, command: tuple, quiet: bool = False) -> None:
        with self._lock:
            if not self._closed:
                self._commands.put(command)
                return
        if not quiet:
            raise LLMCError("this AsyncLLM has been shut down" +
                            (f" after an internal error: {self._error}" if self._error else "") +
                            "; create a new one")

    # -- the loop thread --------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                for cmd in self._pending(block=not self.engine.has_unfinished()):
                    if cmd is _STOP:  # put last, under the lock: nothing follows it
                        self._stop()
                        return
                    self._handle(cmd)
                if self.engine.has_unfinished():
                    self._step()
        except BaseException as e:  # a bug here must not leave consumers waiting forever
            self._error = e
            with self._lock:
                self._closed = True
            self._fail_all(_as_llmc_error(e, "the async engine loop failed"))
            self._drain_closed()
        finally:
            heap.release(self.engine.heap_token)  # the loop is over: what it made in cycles may be collected

    def _pending(self, block: bool) -> list:
        """Every queued command; with `block`, first sleep until there is one (the idle engine)."""
        cmds = [self._commands.get()] if block else []
        while True:
            try:
                cmds.append(self._commands.get_nowait())
            except queue.Empty:
                return cmds

    def _handle(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, stream, prompt, params = cmd
            if stream.request_id in self._streams:
                self._deliver(stream, RequestError(f"request id {stream.request_id!r} is already in use"))
                return
            try:
                self.engine.add_request(prompt, params, stream.request_id)
            except Exception as e:  # the engine changed nothing: only this consumer hears of it
                if not isinstance(e, RequestError):  # a bad request is the client's to hear of; anything else a bug
                    log.error("adding request %s failed", stream.request_id, exc_info=True)
                self._deliver(stream, _as_llmc_error(e, "adding the request failed"))
                return
            self._streams[stream.request_id] = stream
        elif kind == "cancel":
            stream = cmd[1]
            if self._streams.get(stream.request_id) is stream and not stream.cancelled:
                stream.cancelled = True
                if not self.engine.abort(stream.request_id):
                    del self._streams[stream.request_id]
        elif kind == "abort":
            _, request_id, fut = cmd
            ok = request_id in self._streams and self.engine.abort(request_id)
            fut.set_result(bool(ok))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            log.error("an engine step failed; its %d requests are aborted", len(self._streams), exc_info=True)
            err = _as_llmc_error(e, "an engine step failed")
            for stream in list(self._streams.values()):
                self.engine.abort(stream.request_id)  # the ones not in the failed step, too
            self._fail_all(err)
            return
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # an output of a request failed earlier
            if out.finished:
                del self._streams[out.request_id]
            if not stream.cancelled:
                by_loop.setdefault(stream.loop, []).append((stream, out))
        # one wake-up per event loop and step, not one per request: with a hundred streams the
        # consumers' loop would otherwise spend the step's time being woken
        for loop, items in by_loop.items():
            self._deliver_all(loop, items)

    def _deliver(self, stream: _Stream, item: RequestOutput | BaseException) -> None:
        self._deliver_all(stream.loop, [(stream, item)])

    def _deliver_all(self, loop: asyncio.AbstractEventLoop, items: list) -> None:
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the consumers' event loop is closed: nobody will read these requests
            for stream, _ in items:
                if not stream.cancelled and self._streams.get(stream.request_id) is stream:
                    stream.cancelled = True
                    self.engine.abort(stream.request_id)

    def _fail_all(self, err: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            if not stream.cancelled:
                self._deliver(stream, err)

    def _stop(self) -> None:
        """Abort every live request, deliver the "abort" outputs, then refuse what is queued."""
        for request_id in list(self._streams):
            self.engine.abort(request_id)
        for _ in range(3):  # an abort is reported by the next step; more is a broken engine
            if not (self._streams and self.engine.has_unfinished()):
                break
            self._step()
        self._fail_all(LLMCError("the AsyncLLM was shut down before this request finished"))
        self._drain_closed()

    def _drain_closed(self) -> None:
        """Answer the commands queued before `_closed` was set (nothing can be queued after)."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd is _STOP:
                continue
            if cmd[0] == "add":
                self._deliver(cmd[1], LLMCError("the AsyncLLM was shut down; create a new one"))
            elif cmd[0] == "abort":
                cmd[2].set_result(False)


def _put_all(items: list) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)


def _as_llmc_error(e: BaseException, what: str) -> LLMCError:
    """An LLMCError passes through; anything else is wrapped, keeping the original as the cause."""
    if isinstance(e, LLMCError):
        return e
    err = LLMCError(f"{what}: {type(e).__name__}: {e}")
    err.__cause__ = e
    return err

"""The HTTP server: a FastAPI app over one `AsyncLLM`, speaking the OpenAI API.

The app never touches the scheduler: it validates and tokenizes a request, hands token ids to
`AsyncLLM.generate`, and turns the `RequestOutput`s it streams back into OpenAI responses or SSE
chunks. Prompts are tokenized on the event loop (a tokenizer's encode is not safe to run beside another
call on the same tokenizer), so a text too long to fit the context by its length alone is refused before
it is tokenized, and a body over `MAX_BODY_BYTES` before it is read. A client that goes away mid-stream cancels the
response task, which closes the `generate` iterator, which aborts the request and frees its blocks; one
that goes away while a non-streamed answer is being generated cancels its generation the same way.

Log-probabilities are those the engine reports (`SamplingParams.logprobs`: of the distribution each token
was drawn from); -inf (an alternative the request's filters removed) is sent as -9999.0, as vLLM does,
since JSON has no infinity.
"""
from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from llmc.chat import compile_template, render
from llmc.errors import LLMCError, RequestError
from llmc.runtime.async_engine import AsyncLLM
from llmc.runtime.engine import RequestOutput
from llmc.runtime.sampling_params import SamplingParams
from llmc.serve import protocol as P
from llmc.serve.metrics import RequestTimer, ServerMetrics
from llmc.tokenizer import TokenBytes, check_text

__all__ = ["create_app", "APIError"]

# the largest request body read (413 above it): a hundred prompts of 32,768 tokens of four bytes fit it
MAX_BODY_BYTES = 64 << 20


class APIError(Exception):
    """An error answered in OpenAI's shape with this status (and headers, e.g. Retry-After)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers
        self.type = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                     413: "invalid_request_error", 503: "service_unavailable"}.get(status, "server_error")


@dataclass
class _Prompt:
    """One prompt of a request, tokenized: `text` is what echo shows."""

    text: str
    ids: list[int]


class _Server:
    """The app's state: the engine client, the tokenizer, the chat template, admission and metrics."""

    def __init__(self, llm: AsyncLLM, name: str, chat_template: str | None, max_queue: int | None):
        eng = llm.engine
        self.llm, self.name, self.max_queue = llm, name, max_queue
        self.max_len, self.vocab = eng.max_model_len, eng.info.vocab_size
        self.max_num_seqs = eng.config.max_num_seqs
        self.tokenizer = eng.tokenizer  # the engine's, loaded once
        source = chat_template if chat_template is not None else eng.info.chat_template
        self.template = compile_template(source) if source else None
        self.metrics = ServerMetrics(eng.stats)
        self.waiting = 0  # admitted requests with no output yet: what --max-queue bounds
        # one token's text (and bytes): asked for every alternative of every token, and fixed for a tokenizer
        self.token_text = functools.lru_cache(maxsize=1 << 16)(lambda t: self.decode([t]))
        raw = TokenBytes(self.tokenizer) if self.tokenizer is not None else None
        self.token_bytes = functools.lru_cache(maxsize=1 << 16)(
            lambda t: list(raw(t)) if raw is not None else list(self.token_text(t).encode()))
        # no token covers more characters than the longest in the vocabulary (x4: normalizers may merge some), so
        # a text longer than this holds more tokens than the context: refused without tokenizing it
        longest = max((len(k) for k in self.tokenizer.get_vocab()), default=1) if self.tokenizer is not None else 1
        self.max_text = 4 * max(longest, 1) * self.max_len

    # -- prompts ----------------------------------------------------------------------------------
    def encode(self, text: str, param: str) -> list[int]:
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so it takes token ids only: send the prompt as a "
                                "list of integers", param)
        if len(text) > self.max_text:
            raise APIError(400, f"the {param} is {len(text):,} characters long, more than this model's context of "
                                f"{self.max_len} tokens can hold; shorten it", param, "context_length_exceeded")
        try:
            check_text(text, f"the {param}")
        except RequestError as e:
            raise APIError(400, str(e), param) from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else "".join(f" {t}" for t in ids)

    def check_prompt(self, ids: list[int], max_tokens: int | None, param: str) -> None:
        """400 for a prompt that is empty, holds an id outside the vocabulary, or leaves no room in the context
        for `max_tokens` (None: the request gave none, so at least one)."""
        if not ids:
            raise APIError(400, "the prompt is empty; give some text or token ids to continue", param)
        bad = next((t for t in ids if not 0 <= t < self.vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside this model's vocabulary [0, {self.vocab})", param)
        if max_tokens is None and len(ids) >= self.max_len:
            raise APIError(400, f"this model's maximum context length is {self.max_len} tokens and the prompt has "
                                f"{len(ids)}, leaving no room for a generated token; shorten the prompt", param,
                           "context_length_exceeded")
        max_tokens = max_tokens or 1
        if len(ids) + max_tokens > self.max_len:
            raise APIError(400, f"this model's maximum context length is {self.max_len} tokens, but {len(ids)} "
                                f"prompt tokens + max_tokens={max_tokens} is {len(ids) + max_tokens}; shorten the "
                                "prompt or lower max_tokens", "max_tokens" if len(ids) < self.max_len else param,
                           "context_length_exceeded")

    def admit(self, count: int) -> "_Places":
        """Places in the waiting queue for `count` requests, taken now (before anything is awaited, so requests that
        arrive together see each other's), or 503 where --max-queue has no room for them."""
        if self.max_queue is not None and self.waiting + count > self.max_queue:
            raise APIError(503, f"the server's queue is full ({self.waiting} requests waiting, --max-queue "
                                f"{self.max_queue}); retry shortly", None, "queue_full", {"Retry-After": "1"})
        return _Places(self, count)

    # -- generation -------------------------------------------------------------------------------
    async def generate(self, ids: list[int], params: SamplingParams, places: "_Places") -> AsyncIterator[RequestOutput]:
        """`AsyncLLM.generate`, counted in the metrics; it gives one of `places` back at its first output, or
        however it ends before one."""
        timer = self.metrics.track(len(ids))
        waiting, reason = True, None
        try:
            async for out in self.llm.generate(ids, params, f"srv-{uuid.uuid4().hex}"):
                if waiting:
                    waiting = False
                    places.give_back(1)
                timer.output(sum(len(c.delta_token_ids) for c in out.outputs))
                if out.finished:
                    reason = out.finish_reason
                yield out
        finally:
            if waiting:
                places.give_back(1)
            timer.done(reason)


class _Places:
    """A request's places in the server's waiting queue (one per engine request): each given back when its
    request's first output comes, the rest when the handler is done with them (`give_back()`), or when this is
    collected (a stream whose body never started)."""

    def __init__(self, srv: _Server, count: int):
        self.srv, self.left = srv, count
        srv.waiting += count

    def give_back(self, count: int | None = None) -> None:
        n = self.left if count is None else min(count, self.left)
        self.left -= n
        self.srv.waiting -= n

    def __del__(self):
        self.give_back()


def create_app(llm: AsyncLLM, served_model_name: str, *, api_key: str | None = None,
               chat_template: str | None = None, max_queue: int | None = None,
               shutdown_timeout: float | None = 30.0) -> FastAPI:
    """An OpenAI-compatible app over `llm`; its lifespan shuts `llm` down when the server stops.

    Args:
        llm: the engine client, shared by every request.
        served_model_name: the `model` name clients must send (and `/v1/models` lists).
        api_key: when given, `/v1/*` needs `Authorization: Bearer <api_key>` (401 otherwise).
        chat_template: Jinja source overriding the artifact's chat template.
        max_queue: most requests waiting for the engine's first step; more get 503 + Retry-After.
        shutdown_timeout: seconds to wait for the engine thread at shutdown.

    Returns:
        the FastAPI app (run it with uvicorn).

    Example:
        >>> app = create_app(AsyncLLM("tiny.llmc"), "tiny-py")                    # doctest: +SKIP
        >>> uvicorn.run(app, port=8000)                                            # doctest: +SKIP
    """
    srv = _Server(llm, served_model_name, chat_template, max_queue)

    @asynccontextmanager
    async def lifespan(app):
        yield
        # uvicorn has stopped accepting and let in-flight responses finish (or cancelled them after
        # its graceful timeout); whatever is left is aborted here
        await asyncio.get_running_loop().run_in_executor(None, llm.shutdown, shutdown_timeout)

    app = FastAPI(title="llmc", lifespan=lifespan)
    app.state.server = srv
    _errors(app)
    app.add_middleware(_Gate, metrics=srv.metrics, api_key=api_key)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(srv.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return P.ModelList(data=[P.ModelCard(id=srv.name, max_model_len=srv.max_len)])

    @app.post("/v1/completions")
    async def post_completions(req: P.CompletionRequest, request: Request):
        return await completions(srv, req, request)

    @app.post("/v1/chat/completions")
    async def post_chat(req: P.ChatCompletionRequest, request: Request):
        return await chat_completions(srv, req, request)

    @app.post("/tokenize")
    async def tokenize(req: P.TokenizeRequest):
        """The ids a completion's prompt (or a chat's messages) becomes on this server, as vLLM's /tokenize."""
        _check_model(srv, req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give either prompt (text) or messages (a chat)", "prompt")
        ids = srv.encode(req.prompt, "prompt") if req.prompt is not None else \
            _chat_ids(srv, req, req.add_generation_prompt)
        return P.TokenizeResponse(count=len(ids), max_model_len=srv.max_len, tokens=ids)

    @app.post("/detokenize")
    async def detokenize(req: P.DetokenizeRequest):
        _check_model(srv, req.model)
        bad = next((t for t in req.tokens if not 0 <= t < srv.vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside this model's vocabulary [0, {srv.vocab})", "tokens")
        return P.DetokenizeResponse(prompt=srv.decode(req.tokens))

    return app


# -- errors and the gate --------------------------------------------------------------------------
def _errors(app: FastAPI) -> None:
    """Every error leaves in OpenAI's shape; none leaves as a traceback."""

    def reply(status, message, type_, param=None, code=None, headers=None):
        return JSONResponse(P.error_body(message, type_, param, code), status, headers=headers)

    @app.exception_handler(_ClientGone)
    async def client_gone(request, e: _ClientGone):
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it, /metrics counts it

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return reply(e.status, e.message, e.type, e.param, e.code, e.headers)

    @app.exception_handler(RequestError)
    async def request_error(request, e: RequestError):
        return reply(400, str(e), "invalid_request_error", _field_of(str(e)))

    @app.exception_handler(RequestValidationError)
    async def invalid(request, e: RequestValidationError):
        err = e.errors()[0]
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            return reply(400, f"the request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}",
                         "invalid_request_error")
        if err.get("type") == "extra_forbidden":
            return reply(400, f"unknown field {'.'.join(loc)!r}", "invalid_request_error", ".".join(loc))
        union = _union_forms(e.errors(), loc[:1])
        if union:  # a value that is none of a union's forms: name them all, not the first tried
            return reply(400, f"{loc[0]} must be one of: {', '.join(union)}; got {type(err.get('input')).__name__}",
                         "invalid_request_error", loc[0])
        where = ".".join(loc) or "body"
        return reply(400, f"{where}: {err['msg']}", "invalid_request_error", loc[0] if loc else None)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        type_ = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return reply(e.status_code, str(e.detail), type_, headers=getattr(e, "headers", None))

    @app.exception_handler(LLMCError)
    async def llmc_error(request, e: LLMCError):
        return reply(500, str(e), "server_error")

    @app.exception_handler(Exception)
    async def internal(request, e: Exception):
        return reply(500, f"internal error {type(e).__name__}: {e}", "server_error")


def _union_forms(errors: list[dict], field: list[str]) -> list[str]:
    """The forms a union field takes, as pydantic tags its errors ("prompt.str", "prompt.list[int].0", ...),
    where every error is about that one field and there are several forms; else []."""
    forms = []
    for err in errors:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if not field or loc[:1] != field or len(loc) < 2:
            return []
        forms.append(loc[1])
    forms = list(dict.fromkeys(forms))
    return forms if len(forms) > 1 else []


def _field_of(message: str) -> str | None:
    """`SamplingParams.validate` starts each message with the field it is about."""
    word = message.split(" ", 1)[0].split("[", 1)[0]  # "logit_bias[5] must be ..." is about logit_bias
    return word if word in SamplingParams.__dataclass_fields__ else None


_ENDPOINTS = {"/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"}


class _Gate:
    """Pure ASGI middleware (it does not buffer streams): checks the API key on /v1 and the tokenizer's endpoints,
    and counts each of their requests by endpoint and final status."""

    def __init__(self, app, metrics: ServerMetrics, api_key: str | None):
        self.app, self.metrics, self.api_key = app, metrics, api_key

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] != "http" or not (path.startswith("/v1") or path in _ENDPOINTS):
            return await self.app(scope, receive, send)
        status = [500]
        endpoint = path if path in _ENDPOINTS else "other"

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if self.api_key is not None and not self._authorized(scope):
                body = json.dumps(P.error_body("missing or wrong API key: send the header 'Authorization: "
                                               "Bearer <key>' with the server's --api-key",
                                               "authentication_error", None, "invalid_api_key")).encode()
                await send_status({"type": "http.response.start", "status": 401,
                                   "headers": [(b"content-type", b"application/json"),
                                               (b"www-authenticate", b"Bearer")]})
                await send({"type": "http.response.body", "body": body})
                return
            size = dict(scope.get("headers") or []).get(b"content-length", b"0")
            if (int(size) if size.isdigit() else 0) > MAX_BODY_BYTES:
                body = json.dumps(P.error_body(f"the request body is {int(size):,} bytes, more than the server reads "
                                               f"({MAX_BODY_BYTES:,}); send fewer or shorter prompts",
                                               "invalid_request_error", None, "request_too_large")).encode()
                await send_status({"type": "http.response.start", "status": 413,
                                   "headers": [(b"content-type", b"application/json"),
                                               (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
            await self.app(scope, receive, send_status)
        finally:
            self.metrics.requests.labels(endpoint, str(status[0])).inc()

    def _authorized(self, scope) -> bool:
        auth = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
        scheme, _, key = auth.partition(" ")
        return scheme.lower() == "bearer" and key.strip() == self.api_key  # the scheme is case-insensitive


# -- the handlers ---------------------------------------------------------------------------------
def _check_model(srv: _Server, model: str) -> None:
    if model != srv.name:
        raise APIError(404, f"the model {model!r} does not exist: this server serves {srv.name!r} (GET /v1/models)",
                       "model", "model_not_found")


def _sampling(srv: _Server, req: P._Sampling, max_tokens: int, logprobs: int | None) -> SamplingParams:
    """The request's SamplingParams, validated: a bad value is a 400 naming its field. `logprobs`: None (off)
    or how many alternatives per generated token."""
    if req.n > srv.max_num_seqs:
        raise APIError(400, f"n={req.n} samples run together and this server batches at most {srv.max_num_seqs} "
                            "sequences (--max-num-seqs); lower n", "n")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if stop and srv.tokenizer is None:
        raise APIError(400, "stop strings need a tokenizer and this model has none; use stop_token_ids", "stop")
    p = SamplingParams(n=req.n, temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, min_p=req.min_p,
                       repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
                       frequency_penalty=req.frequency_penalty, seed=req.seed, stop=stop,
                       stop_token_ids=list(req.stop_token_ids or ()), max_tokens=max_tokens, logprobs=logprobs,
                       ignore_eos=req.ignore_eos, priority=req.priority, logit_bias=req.logit_bias,
                       min_tokens=req.min_tokens)
    try:
        p.validate()
        p.check_vocab(srv.vocab)
    except RequestError as e:
        raise APIError(400, str(e), _field_of(str(e))) from None
    return p


async def _all(coros) -> list:
    """Await every coroutine; if one fails (or this is cancelled), the others are cancelled."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()


class _ClientGone(Exception):
    """The client disconnected before its non-streamed answer was ready."""


async def _unless_gone(request: Request | None, coro):
    """Await `coro` while the client waits for it: if the client disconnects first, `coro` is cancelled, which
    aborts its engine requests and frees their blocks, and `_ClientGone` is raised."""
    work = asyncio.ensure_future(coro)
    if request is None:
        return await work
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)  # its aborts are sent before this returns
    if work.cancelled():
        raise _ClientGone()
    return work.result()


async def _disconnect(request: Request) -> None:
    """Returns when the client disconnects: with the body read, the server's next ASGI message is that."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _final(srv: _Server, ids: list[int], params: SamplingParams, places: _Places) -> RequestOutput:
    out = None
    async for out in srv.generate(ids, params, places):
        pass
    return out


def _sse(obj) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


def _usage(prompt: int, completion: int) -> P.Usage:
    return P.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


async def _merged(srv: _Server, jobs: list[tuple[list[int], SamplingParams]],
                  places: _Places) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of several requests as they come, tagged with the job's index; closing this
    iterator (a client gone) cancels every job, which aborts its request."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, ids, params):
        try:
            async for out in srv.generate(ids, params, places):
                queue.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which answers with an error event
            queue.put_nowait((i, e))

    tasks = [asyncio.ensure_future(pump(i, ids, p)) for i, (ids, p) in enumerate(jobs)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item.finished:
                left -= 1
            yield i, item
    finally:
        for t in tasks:
            t.cancel()


def _stream_error(e: Exception) -> str:
    bad = isinstance(e, (RequestError, APIError))
    return _sse(P.error_body(str(e), "invalid_request_error" if bad else "server_error", None, None))


def _token_texts(srv: _Server, ids: list[int]) -> list[str]:
    return [srv.token_text(t) for t in ids]


def _lp(value: float) -> float:
    return max(value, -9999.0)  # JSON has no -inf


def _legacy_top(srv: _Server, top: dict[int, float], chosen: int, chosen_lp: float) -> dict[str, float]:
    """One token's entry of the legacy `top_logprobs`: its alternatives by text, most likely first, and the
    chosen token (OpenAI: up to logprobs + 1 entries); of tokens with the same text, the likelier's."""
    out: dict[str, float] = {}
    for t, lp in {**top, chosen: chosen_lp}.items():
        out.setdefault(srv.token_text(t), _lp(lp))
    return out


MAX_COMPLETION_LOGPROBS, MAX_TOP_LOGPROBS = 5, 20  # OpenAI's limits


async def completions(srv: _Server, req: P.CompletionRequest, request: Request | None = None):
    """POST /v1/completions: one engine request per prompt, n samples each (choice i * n + j)."""
    _check_model(srv, req.model)
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_COMPLETION_LOGPROBS:
        raise APIError(400, f"logprobs must be from 0 to {MAX_COMPLETION_LOGPROBS} (how many most likely tokens to "
                            f"return beside each chosen one), got {req.logprobs}", "logprobs")
    raw = req.prompt
    items = [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else list(raw)
    if not items:
        raise APIError(400, "prompt is an empty list; give a string, a list of strings or token ids", "prompt")
    prompts = [_Prompt(x, srv.encode(x, "prompt")) if isinstance(x, str) else _Prompt("", list(x)) for x in items]
    want_lp, k = req.logprobs is not None, req.logprobs or 0
    params = []
    for p in prompts:
        mt = req.max_tokens if req.max_tokens is not None else max(1, srv.max_len - len(p.ids))
        sp = _sampling(srv, req, mt, req.logprobs)
        srv.check_prompt(p.ids, req.max_tokens, "prompt")
        if req.echo and not p.text:
            p.text = srv.decode(p.ids)
        if req.echo and want_lp:
            sp.prompt_logprobs = k
        params.append(sp)
    places = srv.admit(len(prompts))
    n, rid, created = req.n, f"cmpl-{uuid.uuid4().hex}", int(time.time())

    def logprobs(p: _Prompt, c, out: RequestOutput | None, ids: list[int], offset: int) -> P.CompletionLogprobs:
        # the last len(ids) entries of the totals are those of `ids` (a stream's delta, or all)
        lps: list = list(c.logprobs[len(c.logprobs) - len(ids):]) if ids else []
        tops: list = list(c.top_logprobs[len(c.top_logprobs) - len(ids):]) if ids and k else []
        if out is not None:  # echo: the prompt's tokens first, the first with no log-probability
            ids, lps = p.ids + ids, list(out.prompt_logprobs or [None] * len(p.ids)) + lps
            tops = list(out.prompt_top_logprobs or [None] * len(p.ids)) + tops if k else []
        toks = _token_texts(srv, ids)
        offsets = []
        for t in toks:
            offsets.append(offset)
            offset += len(t)
        top = [None if d is None or lp is None else _legacy_top(srv, d, t, lp)
               for d, t, lp in zip(tops, ids, lps)] if k else None
        return P.CompletionLogprobs(tokens=toks, token_logprobs=[None if v is None else _lp(v) for v in lps],
                                    top_logprobs=top, text_offset=offsets)

    if not req.stream:
        try:
            outs = await _unless_gone(request, _all(_final(srv, p.ids, sp, places) for p, sp in zip(prompts, params)))
        finally:
            places.give_back()
        choices = []
        for i, (p, out) in enumerate(zip(prompts, outs)):
            for c in out.outputs:
                lp = logprobs(p, c, out if req.echo else None, c.token_ids, 0) if want_lp else None
                choices.append(P.CompletionChoice(index=i * n + c.index, text=(p.text if req.echo else "") + c.text,
                                                  logprobs=lp, finish_reason=c.finish_reason))
        usage = _usage(sum(len(p.ids) for p in prompts), sum(len(c.token_ids) for o in outs for c in o.outputs))
        return P.CompletionResponse(id=rid, created=created, model=srv.name, choices=choices, usage=usage)

    def chunk(choices, usage=None) -> str:
        return _sse(P.CompletionResponse(id=rid, created=created, model=srv.name, choices=choices,
                                         usage=usage).model_dump_json())

    async def events():
        done, sent, generated = set(), {}, 0
        try:
            async for i, out in _merged(srv, [(p.ids, sp) for p, sp in zip(prompts, params)], places):
                p = prompts[i]
                for c in out.outputs:
                    key = (i, c.index)
                    if key in done:
                        continue
                    first = key not in sent
                    sent[key] = sent.get(key, 0) + len(c.delta_text)
                    generated += len(c.delta_token_ids)
                    echo = p.text if req.echo and first else ""
                    if not (c.delta_text or c.delta_token_ids or c.finish_reason or echo):
                        continue
                    lp = None
                    if want_lp:  # offsets into the choice's whole text: the echoed prompt's from 0
                        lp = logprobs(p, c, out if echo else None, c.delta_token_ids,
                                      0 if echo else sent[key] - len(c.delta_text) + (len(p.text) if req.echo else 0))
                    if c.finish_reason is not None:
                        done.add(key)
                    yield chunk([P.CompletionChoice(index=i * n + c.index, text=echo + c.delta_text, logprobs=lp,
                                                    finish_reason=c.finish_reason)])
        except Exception as e:  # noqa: BLE001 - the status line is gone: the error goes in the stream
            yield _stream_error(e)
        else:
            if req.stream_options is not None and req.stream_options.include_usage:
                yield chunk([], _usage(sum(len(p.ids) for p in prompts), generated))
        finally:
            places.give_back()
        yield _sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream")


def _messages(req: P.ChatCompletionRequest) -> list[dict]:
    """The messages as the template sees them: content parts of type text joined into one string."""
    out = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, f"messages[{i}].content: only parts of type text are supported, got "
                                        f"{part.get('type')!r}", "messages")
                parts.append(part["text"])
            content = "".join(parts)
        out.append({"role": m.role, "content": content or "", **({"name": m.name} if m.name else {})})
    return out


def _chat_ids(srv: _Server, req, add_generation_prompt: bool) -> list[int]:
    """The token ids of a request's messages rendered by the chat template (400s where that cannot be)."""
    import jinja2
    if srv.template is None:
        raise APIError(400, "this model has no chat template, so it cannot format messages: start the server with "
                            "--chat-template FILE (a Jinja template over `messages`), or use /v1/completions",
                       "messages", "no_chat_template")
    try:
        text = render(srv.template, _messages(req), srv.tokenizer, add_generation_prompt)
    except jinja2.exceptions.TemplateError as e:
        raise APIError(400, f"the chat template refused these messages: {e}", "messages") from None
    return srv.encode(text, "messages")


async def chat_completions(srv: _Server, req: P.ChatCompletionRequest, request: Request | None = None):
    """POST /v1/chat/completions: the messages rendered by the chat template, then one engine request."""
    _check_model(srv, req.model)
    ids = _chat_ids(srv, req, req.add_generation_prompt)
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        raise APIError(400, f"top_logprobs must be from 0 to {MAX_TOP_LOGPROBS}, got {req.top_logprobs}",
                       "top_logprobs")
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    k = req.top_logprobs or 0
    given = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    mt = given if given is not None else max(1, srv.max_len - len(ids))
    params = _sampling(srv, req, mt, k if req.logprobs else None)
    srv.check_prompt(ids, given, "messages")
    places = srv.admit(1)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def entry(t: int, lp: float) -> dict:  # bytes: the token's own, also where its text alone is not a character
        return {"token": srv.token_text(t), "logprob": _lp(lp), "bytes": srv.token_bytes(t)}

    def logprobs(c, new: list[int]) -> P.ChatLogprobs | None:
        if not req.logprobs:
            return None
        # the last len(new) entries of the totals are those of `new` (a stream's delta, or all)
        lps = c.logprobs[len(c.logprobs) - len(new):] if new else []
        tops = c.top_logprobs[len(c.top_logprobs) - len(new):] if new and k else [{}] * len(new)
        return P.ChatLogprobs(content=[P.ChatTokenLogprob(**entry(t, lp), top_logprobs=[
            P.TopLogprob(**entry(a, alp)) for a, alp in top.items()]) for t, lp, top in zip(new, lps, tops)])

    if not req.stream:
        try:
            out = await _unless_gone(request, _final(srv, ids, params, places))
        finally:
            places.give_back()
        choices = [P.ChatChoice(index=c.index, message=P.ChatResponseMessage(content=c.text),
                                logprobs=logprobs(c, c.token_ids), finish_reason=c.finish_reason)
                   for c in out.outputs]
        usage = _usage(len(ids), sum(len(c.token_ids) for c in out.outputs))
        return P.ChatCompletionResponse(id=rid, created=created, model=srv.name, choices=choices, usage=usage)

    def chunk(choices, usage=None) -> str:
        return _sse(P.ChatCompletionChunk(id=rid, created=created, model=srv.name, choices=choices,
                                          usage=usage).model_dump_json(exclude_none=True))

    async def events():
        done, generated = set(), 0
        for j in range(req.n):
            yield chunk([P.ChatChunkChoice(index=j, delta=P.DeltaMessage(role="assistant", content=""))])
        try:
            async for _, out in _merged(srv, [(ids, params)], places):
                for c in out.outputs:
                    if c.index in done:
                        continue
                    generated += len(c.delta_token_ids)
                    if not (c.delta_text or c.delta_token_ids or c.finish_reason):
                        continue
                    if c.finish_reason is not None:
                        done.add(c.index)
                    yield chunk([P.ChatChunkChoice(index=c.index, delta=P.DeltaMessage(content=c.delta_text),
                                                   logprobs=logprobs(c, c.delta_token_ids),
                                                   finish_reason=c.finish_reason)])
        except Exception as e:  # noqa: BLE001 - the status line is gone: the error goes in the stream
            yield _stream_error(e)
        else:
            if req.stream_options is not None and req.stream_options.include_usage:
                yield chunk([], _usage(len(ids), generated))
        finally:
            places.give_back()
        yield _sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream")

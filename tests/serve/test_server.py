"""`llmc serve` end to end: the real server in a subprocess, driven by the official `openai` client.

Completions and chat, streamed and not, n > 1, stop strings, seeds, logprobs with top-k alternatives;
64 concurrent streams with some cancelled midway, and a non-streamed request whose client goes away (every
KV block comes back, read off /metrics); each error case answers
its status and OpenAI-shaped body while another request streams on; /metrics parses and counts the
requests made; --max-queue answers 503 with Retry-After; SIGTERM lets a stream finish and exits 0.
"""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import json
import urllib.error
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import llmc

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-test"
TEMPLATE = ("{% for m in messages %}# {{ m.role }}: {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}# assistant:\n{% endif %}")
PROMPTS = ["def fibonacci(n):", "import os\n\n", "class Stack:\n    def __init__(self):", "for i in range(",
           "with open(path) as f:", "    def __repr__(self):", "try:\n    import json", "return sorted("]


def http(method: str, url: str, body: bytes | dict | None = None, headers: dict | None = None):
    """(status, headers, parsed JSON or text) of one plain HTTP request, errors included."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(url, data, {"Content-Type": "application/json", **(headers or {})}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            status, hdrs, raw = r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        status, hdrs, raw = e.code, dict(e.headers), e.read().decode()
    try:
        return status, {k.lower(): v for k, v in hdrs.items()}, json.loads(raw)
    except json.JSONDecodeError:
        return status, hdrs, raw


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m llmc.cli serve ...` in a subprocess, up once /health answers."""

    def __init__(self, artifact: Path, *args: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "llmc.cli", "serve", str(artifact), "--port", str(self.port), "--backend",
             "reference", "--device", "cpu", "--block-size", "4", *args],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.proc.stdout.read()}")
            try:
                if http("GET", self.url + "/health")[0] == 200:
                    return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError("the server did not answer /health within 60 s")

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=60)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, timeout=60)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics as `name{label=value,...}` -> value."""
        text = http("GET", self.url + "/metrics")[2]
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
        return out

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("serve") / "tiny-py.llmc"
    llmc.compile("builtin:tiny-py", out, dtype="float32")
    return out


@pytest.fixture(scope="module")
def server(artifact, tmp_path_factory):
    template = tmp_path_factory.mktemp("tpl") / "chat.jinja"
    template.write_text(TEMPLATE)
    s = Server(artifact, "--max-num-seqs", "8", "--num-blocks", "160", "--api-key", KEY,
               "--served-model-name", "tiny", "--chat-template", str(template))
    yield s
    assert s.stop() == 0


def _stream_text(stream) -> tuple[list[str], list, object]:
    """Per choice index its streamed text, the finish reasons, and the usage chunk (if any)."""
    texts, reasons, usage = {}, {}, None
    for ch in stream:
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            piece = c.text if hasattr(c, "text") else (c.delta.content or "")
            texts[c.index] = texts.get(c.index, "") + piece
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    return [texts[i] for i in sorted(texts)], [reasons.get(i) for i in sorted(texts)], usage


def test_models_health_and_completion(server, artifact):
    c = server.client()
    assert http("GET", server.url + "/health")[2] == {"status": "ok"}
    assert [m.id for m in c.models.list().data] == ["tiny"]
    r = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0)
    want = llmc.LLM(artifact, backend="reference", device="cpu", block_size=4, num_blocks=160).generate(PROMPTS[0], llmc.SamplingParams(temperature=0, max_tokens=12))[0]
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == want.finish_reason
    assert r.usage.prompt_tokens == len(want.prompt_token_ids) and r.usage.completion_tokens == len(want.token_ids)


def test_stream_equals_whole_for_a_seed(server):
    c = server.client()
    kw = dict(model="tiny", prompt=PROMPTS[2], max_tokens=20, temperature=0.9, top_p=0.95, seed=11, n=2,
              extra_body={"top_k": 50})
    whole = c.completions.create(**kw)
    again = c.completions.create(**kw)
    assert [ch.text for ch in whole.choices] == [ch.text for ch in again.choices]  # seeded: reproducible
    assert whole.choices[0].text != whole.choices[1].text  # sample i uses seed + i
    texts, reasons, usage = _stream_text(c.completions.create(**kw, stream=True,
                                                              stream_options={"include_usage": True}))
    assert texts == [ch.text for ch in whole.choices]
    assert reasons == [ch.finish_reason for ch in whole.choices]
    assert usage.completion_tokens == whole.usage.completion_tokens == 40


def test_prompt_lists_token_ids_echo_and_stop(server):
    c = server.client()
    base = c.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=24, temperature=0).choices[0].text
    stop = base[len(base) // 2:len(base) // 2 + 3]
    r = c.completions.create(model="tiny", prompt=[PROMPTS[1], PROMPTS[3]], max_tokens=24, temperature=0, n=2,
                             stop=[stop])
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text == base[:base.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    ids = c.completions.create(model="tiny", prompt=[[1, 2, 3, 4]], max_tokens=5, temperature=0, echo=True)
    assert len(ids.choices) == 1 and ids.usage.prompt_tokens == 4
    echo = c.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=24, temperature=0, echo=True)
    assert echo.choices[0].text == PROMPTS[1] + base


def test_logit_bias_forces_and_bans_tokens(server, artifact):
    c = server.client()
    tok = llmc.load(artifact).tokenizer()
    forced = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=0,
                                  logit_bias={"42": 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].logprobs.tokens == [tok.decode([42])] * 6
    first = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=1, temperature=0, logprobs=0)
    top = tok.encode(first.choices[0].logprobs.tokens[0], add_special_tokens=False)[0]
    banned = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=1, temperature=0, logprobs=0,
                                  logit_bias={str(top): -100})
    assert banned.choices[0].logprobs.tokens != first.choices[0].logprobs.tokens


def test_tokenize_and_detokenize_count_what_the_server_counts(server):
    c, auth = server.client(), {"Authorization": f"Bearer {KEY}"}
    r = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=1, temperature=0)
    code, _, tok = http("POST", server.url + "/tokenize", {"model": "tiny", "prompt": PROMPTS[0]}, auth)
    assert code == 200 and tok["count"] == len(tok["tokens"]) == r.usage.prompt_tokens and tok["max_model_len"] > 0
    code, _, back = http("POST", server.url + "/detokenize", {"model": "tiny", "tokens": tok["tokens"]}, auth)
    assert code == 200 and back == {"prompt": PROMPTS[0]}
    messages = [{"role": "user", "content": PROMPTS[2]}]
    chat = c.chat.completions.create(model="tiny", messages=messages, max_tokens=1, temperature=0)
    code, _, tok = http("POST", server.url + "/tokenize", {"model": "tiny", "messages": messages}, auth)
    assert code == 200 and tok["count"] == chat.usage.prompt_tokens
    for path, body, status, param in [
            ("/tokenize", {"model": "tiny"}, 400, "prompt"),
            ("/tokenize", {"model": "tiny", "prompt": "x", "messages": messages}, 400, "prompt"),
            ("/tokenize", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
            ("/detokenize", {"model": "tiny", "tokens": [99999]}, 400, "tokens")]:
        code, _, reply = http("POST", server.url + path, body, auth)
        assert code == status and reply["error"]["param"] == param, (path, body, reply)
    assert http("POST", server.url + "/tokenize", {"model": "tiny", "prompt": "x"})[0] == 401  # the API key holds


def test_logprobs(server):
    c = server.client()
    r = c.completions.create(model="tiny", prompt=PROMPTS[4], max_tokens=10, temperature=0, logprobs=0)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == r.usage.completion_tokens == 10
    assert all(v <= 0 for v in lp.token_logprobs) and "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset[-1] == len(r.choices[0].text) - len(lp.tokens[-1])
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                     temperature=0, logprobs=True)
    content = chat.choices[0].logprobs.content
    assert len(content) == 6 and "".join(t.token for t in content) == chat.choices[0].message.content


def same(a, b) -> bool:
    """Equal, floats to 1e-4: a prompt served from the prefix cache may round its logits apart."""
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and same(list(a.values()), list(b.values()))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-4
    return a == b


def test_top_logprobs_streamed_and_not(server):
    """Completions logprobs=3 (legacy: up to 4 entries by text, the chosen one included) and chat
    top_logprobs=2, each streamed and whole: the same tokens, log-probabilities and alternatives."""
    c = server.client()
    kw = dict(model="tiny", prompt=PROMPTS[6], max_tokens=10, temperature=0.7, seed=5, n=2, logprobs=3)
    whole = c.completions.create(**kw)
    parts: dict[int, list] = {0: [[], [], [], []], 1: [[], [], [], []]}
    for ch in c.completions.create(**kw, stream=True):
        for choice in ch.choices:
            if choice.logprobs is not None:
                got, lp = parts[choice.index], choice.logprobs
                for field, acc in zip((lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset), got):
                    acc += field
    for choice in whole.choices:
        lp = choice.logprobs
        assert same(parts[choice.index], [lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset])
        assert len(lp.top_logprobs) == len(lp.tokens) == 10
        for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
            values = list(top.values())
            assert 3 <= len(top) <= 4 and top[tok] == v and values[:3] == sorted(values[:3], reverse=True)
    echo = c.completions.create(model="tiny", prompt=PROMPTS[6], max_tokens=2, temperature=0, logprobs=2,
                                echo=True).choices[0].logprobs
    assert echo.top_logprobs[0] is None and echo.token_logprobs[0] is None
    assert all(top[t] == v for t, v, top in zip(echo.tokens[1:], echo.token_logprobs[1:], echo.top_logprobs[1:]))

    kw = dict(model="tiny", messages=[{"role": "user", "content": "a queue"}], max_tokens=8, temperature=0,
              logprobs=True, top_logprobs=2)
    content = c.chat.completions.create(**kw).choices[0].logprobs.content
    streamed = [t for ch in c.chat.completions.create(**kw, stream=True) for choice in ch.choices
                if choice.logprobs is not None for t in choice.logprobs.content]
    assert same([t.model_dump() for t in streamed], [t.model_dump() for t in content]) and len(content) == 8
    for t in content:  # greedy: the chosen token is the most likely one
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == t.logprob >= t.top_logprobs[1].logprob
        assert t.top_logprobs[0].bytes == t.bytes == list(t.token.encode())


def test_chat_stream_equals_whole(server):
    c = server.client()
    kw = dict(model="tiny", messages=[{"role": "system", "content": "write python"},
                                      {"role": "user", "content": [{"type": "text", "text": "a stack"}]}],
              max_tokens=16, temperature=0.8, seed=3, n=2)
    whole = c.chat.completions.create(**kw)
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == 32
    texts, reasons, _ = _stream_text(c.chat.completions.create(**kw, stream=True))
    assert texts == [ch.message.content for ch in whole.choices]
    assert reasons == [ch.finish_reason for ch in whole.choices]


def test_concurrent_streams_with_cancels_return_every_block(server):
    async def one(client, i):
        kw = dict(model="tiny", prompt=PROMPTS[i % 8], max_tokens=8 + i % 8, temperature=0)
        if i % 5 == 3:  # goes away after two chunks; its blocks must come back
            stream = await client.completions.create(**{**kw, "max_tokens": 200}, stream=True,
                                                     extra_body={"ignore_eos": True})
            got = 0
            async for _ in stream:
                got += 1
                if got == 2:
                    break
            await stream.close()
            return None
        text = ""
        async for ch in await client.completions.create(**kw, stream=True):
            text += ch.choices[0].text if ch.choices else ""
        return text

    async def main():
        async with server.async_client() as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    texts = asyncio.run(main())
    c = server.client()
    wants = {}  # request i depends on i % 8 alone
    for i, text in enumerate(texts):
        if text is not None:
            if i % 8 not in wants:
                wants[i % 8] = c.completions.create(model="tiny", prompt=PROMPTS[i % 8], max_tokens=8 + i % 8,
                                                    temperature=0).choices[0].text
            assert text == wants[i % 8], i
    deadline = time.monotonic() + 10
    while True:
        m = server.metrics()
        if m["llmc_kv_blocks_used"] == 0 and m["llmc_requests_running"] == 0 and m["llmc_requests_waiting"] == 0:
            break
        assert time.monotonic() < deadline, f"blocks still in use: {m['llmc_kv_blocks_used']}"
        time.sleep(0.1)
    assert m["llmc_request_finished_total{reason=abort}"] >= 13


def test_non_streamed_request_of_a_client_gone_is_aborted(server):
    before = server.metrics().get("llmc_request_finished_total{reason=abort}", 0)
    body = json.dumps({"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 500, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        deadline = time.monotonic() + 10
        while server.metrics()["llmc_kv_blocks_used"] == 0:  # generating: then the client goes away
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.02)
    deadline = time.monotonic() + 10
    while True:
        m = server.metrics()
        if m["llmc_kv_blocks_used"] == 0 and m["llmc_requests_running"] == 0:
            break
        assert time.monotonic() < deadline, f"blocks still in use: {m['llmc_kv_blocks_used']}"
        time.sleep(0.05)
    assert m["llmc_request_finished_total{reason=abort}"] == before + 1
    assert m.get("llmc_http_requests_total{endpoint=/v1/completions,status=499}", 0) >= 1


ERRORS = [  # (body or raw bytes, headers, status, param)
    (b'{"model": "tiny", "prompt": ', {}, 400, None),
    ({"model": "tiny", "prompt": "x", "bogus": 1}, {}, 400, "bogus"),
    ({"model": "tiny", "prompt": "x", "temperature": -1}, {}, 400, "temperature"),
    ({"model": "tiny", "prompt": "x", "top_p": 1.5}, {}, 400, "top_p"),
    ({"model": "tiny", "prompt": "x", "n": 0}, {}, 400, "n"),
    ({"model": "tiny", "prompt": "x", "presence_penalty": 3}, {}, 400, "presence_penalty"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 5000}, {}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "x " * 1100, "max_tokens": 1}, {}, 400, "prompt"),
    ({"model": "tiny", "prompt": [], "max_tokens": 1}, {}, 400, "prompt"),
    ({"model": "tiny", "prompt": [[99999]], "max_tokens": 1}, {}, 400, "prompt"),
    ({"model": "tiny", "prompt": "x", "logprobs": 6}, {}, 400, "logprobs"),
    ({"model": "tiny", "prompt": "x", "logprobs": -1}, {}, 400, "logprobs"),
    ({"model": "tiny", "prompt": "x", "logit_bias": {"5": 101}}, {}, 400, "logit_bias"),
    ({"model": "tiny", "prompt": "x", "logit_bias": {"99999": 1}}, {}, 400, "logit_bias"),
    ({"model": "tiny", "prompt": "x", "repetition_penalty": 1e-40}, {}, 400, "repetition_penalty"),
    ({"model": "tiny", "prompt": "x", "max_tokens": "5"}, {}, 400, "max_tokens"),  # JSON types are kept
    ({"model": "tiny", "prompt": "x", "max_tokens": True}, {}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "temperature": "0.5"}, {}, 400, "temperature"),
    ({"model": "tiny", "prompt": 5}, {}, 400, "prompt"),
    ({"model": "tiny", "prompt": "x", "seed": 2 ** 64}, {}, 400, "seed"),
    ({"model": "tiny", "prompt": "x", "stop_token_ids": [99999]}, {}, 400, "stop_token_ids"),
    ({"model": "tiny", "prompt": "def \ud800 f(", "max_tokens": 1}, {}, 400, "prompt"),  # a lone surrogate
    ({"model": "tiny", "prompt": "x" * 300_000, "max_tokens": 1}, {}, 400, "prompt"),  # refused untokenized
    ({"model": "gpt-4", "prompt": "x"}, {}, 404, "model"),
    ({"model": "tiny", "prompt": "x"}, {"Authorization": "Bearer wrong"}, 401, None),
    ({"model": "tiny", "prompt": "x"}, {"Authorization": ""}, 401, None),
]


def test_errors_answer_in_openai_shape_while_others_stream(server):
    c = server.client()
    stream = c.completions.create(model="tiny", prompt=PROMPTS[5], max_tokens=40, temperature=0, stream=True,
                                  extra_body={"ignore_eos": True})
    text = next(iter(stream)).choices[0].text
    for body, headers, status, param in ERRORS:
        code, _, reply = http("POST", server.url + "/v1/completions", body,
                              {"Authorization": f"Bearer {KEY}", **headers})
        assert code == status, (body, reply)
        err = reply["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err
        assert err["param"] == param, err
    for chat_kw in ({"logprobs": True, "top_logprobs": 21}, {"top_logprobs": 2}):
        with pytest.raises(openai.BadRequestError, match="top_logprobs") as e:
            c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], **chat_kw)
        assert e.value.body["param"] == "top_logprobs"
    text += "".join(ch.choices[0].text for ch in stream if ch.choices)
    want = c.completions.create(model="tiny", prompt=PROMPTS[5], max_tokens=40, temperature=0,
                                extra_body={"ignore_eos": True})
    assert text == want.choices[0].text


def test_a_tiny_temperature_is_greedy_and_fails_no_other_request(server):
    """1e-40 would overflow fp32 logits divided by it: it is greedy (as vLLM takes it), and the request beside
    it runs on."""
    c = server.client()
    kw = dict(model="tiny", prompt=PROMPTS[1], max_tokens=12, extra_body={"ignore_eos": True})
    other = c.completions.create(stream=True, temperature=0.8, seed=1, **kw)
    head = next(iter(other))
    tiny = c.completions.create(temperature=1e-40, **kw)
    assert tiny.choices[0].text == c.completions.create(temperature=0, **kw).choices[0].text
    rest = list(other)
    assert rest[-1].choices[0].finish_reason == "length" and head.choices[0].text is not None


def test_a_token_that_is_part_of_a_character(server):
    """Token 159 of tiny-py's byte-level vocabulary is the byte 0xE2 (the first of "€"): a chat logprob's
    `bytes` are that byte, and a completion that ends on it keeps its text as the tokenizer decodes it."""
    c = server.client()
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                     logprobs=True, logit_bias={"159": 100})
    assert chat.choices[0].logprobs.content[0].bytes == [0xE2]
    r = c.completions.create(model="tiny", prompt="x = ", max_tokens=1, logit_bias={"159": 100})
    assert r.choices[0].text == "\ufffd" and r.choices[0].finish_reason == "length"


def test_streamed_echo_offsets_equal_the_whole_answers(server):
    body = {"model": "tiny", "prompt": PROMPTS[2], "max_tokens": 5, "temperature": 0, "logprobs": 1, "echo": True}
    whole = server.client().completions.create(**body).choices[0].logprobs
    offsets, tokens = [], []
    for ch in server.client().completions.create(stream=True, **body):
        for c in ch.choices:
            if c.logprobs is not None:
                offsets += c.logprobs.text_offset
                tokens += c.logprobs.tokens
    assert tokens == whole.tokens and offsets == whole.text_offset and offsets[0] == 0


def test_key_scheme_any_case_and_a_body_too_large(server):
    for scheme in ("bearer", "BEARER"):
        code, _, _ = http("GET", server.url + "/v1/models", headers={"Authorization": f"{scheme} {KEY}"})
        assert code == 200, scheme
    # a body announced over the limit is refused before it is read
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                     b"\r\nContent-Type: application/json\r\nContent-Length: 999999999999\r\n\r\n{")
        reply = b""
        while b"request_too_large" not in reply and (part := sock.recv(65536)):
            reply += part
    assert reply.startswith(b"HTTP/1.1 413") and b"request_too_large" in reply


def test_metrics_count_the_requests_made(server):
    before = server.metrics()
    c = server.client()
    c.completions.create(model="tiny", prompt="x = ", max_tokens=3)
    list(c.completions.create(model="tiny", prompt="x = ", max_tokens=3, stream=True))
    c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=3)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="tiny", prompt="x", temperature=-2)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="nope", prompt="x")
    after = server.metrics()

    def delta(name):
        return after.get(name, 0) - before.get(name, 0)

    assert delta("llmc_http_requests_total{endpoint=/v1/completions,status=200}") == 2
    assert delta("llmc_http_requests_total{endpoint=/v1/chat/completions,status=200}") == 1
    assert delta("llmc_http_requests_total{endpoint=/v1/completions,status=400}") == 1
    assert delta("llmc_http_requests_total{endpoint=/v1/completions,status=404}") == 1
    assert delta("llmc_generation_tokens_total") == 9
    assert delta("llmc_e2e_request_latency_seconds_count") == 3
    assert delta("llmc_time_to_first_token_seconds_count") == 3
    for name in ("llmc_kv_blocks_total", "llmc_prefix_cache_hit_rate", "llmc_preemptions_total",
                 "llmc_prompt_tokens_total", "llmc_inter_token_latency_seconds_count",
                 "llmc_request_queue_time_seconds_count"):
        assert name in after
    assert after["llmc_kv_blocks_total"] == 160


def test_queue_full_no_template_and_graceful_sigterm(artifact):
    s = Server(artifact, "--max-num-seqs", "1", "--num-blocks", "64", "--max-queue", "2")
    try:
        c = s.client()
        with pytest.raises(openai.BadRequestError, match="--chat-template"):
            c.chat.completions.create(model="tiny-py", messages=[{"role": "user", "content": "x"}])
        kw = dict(model="tiny-py", max_tokens=60, temperature=0, stream=True, extra_body={"ignore_eos": True})
        occupant = c.completions.create(prompt=PROMPTS[0], **kw)
        next(iter(occupant))  # running: it holds the one sequence slot

        async def burst():  # requests that arrive together see each other's places: of six, two fit the queue
            async with s.async_client() as ac:
                async def one(p):
                    try:
                        await ac.completions.create(model="tiny-py", prompt=p, max_tokens=2, timeout=120)
                        return 200
                    except openai.APIStatusError as e:
                        return e.status_code
                return await asyncio.gather(*(one(p) for p in PROMPTS[2:8]))
        codes = asyncio.run(burst())
        assert sorted(codes) == [200, 200, 503, 503, 503, 503], codes
        list(occupant)
        first = c.completions.create(prompt=PROMPTS[0], **kw)
        head = next(iter(first))  # running: it holds the one sequence slot
        queued = [c.completions.create(prompt=p, **kw) for p in PROMPTS[1:3]]  # waiting for that slot
        code, headers, reply = http("POST", s.url + "/v1/completions", {"model": "tiny-py", "prompt": "x",
                                                                        "max_tokens": 2})
        assert code == 503 and headers["retry-after"] and reply["error"]["code"] == "queue_full"
        for q in queued:
            q.close()
        s.proc.send_signal(signal.SIGTERM)  # in flight: `first` finishes before the server exits
        rest = list(first)
        assert rest[-1].choices[0].finish_reason == "length"
        assert len(head.choices[0].text + "".join(ch.choices[0].text for ch in rest)) > 0
        assert s.proc.wait(30) == 0
    finally:
        s.stop()


def test_a_port_in_use_is_one_line_before_the_model_loads(artifact):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        r = subprocess.run([sys.executable, "-m", "llmc.cli", "serve", str(artifact), "--port", str(port),
                            "--device", "cpu"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and f"cannot listen on 127.0.0.1:{port}" in lines[0], r.stderr

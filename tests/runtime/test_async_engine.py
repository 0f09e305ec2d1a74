"""AsyncLLM on the shipped model: many concurrent consumers stream the same outputs as the offline
LLM, cancelled and aborted consumers free their blocks, a bad request or a failed step reaches
only the consumers concerned, consumers on two event loops share one engine, shutdown stops it."""
import asyncio
import threading
import time

import pytest

import llmc
from llmc.errors import LLMCError, RequestError
from llmc.runtime.sampling_params import SamplingParams

# 8 sequences at a time and 24 blocks of 4 slots (8 sequences of ~30 tokens need 64): 32 requests
# queue, and running ones are preempted (recomputed) while they stream
OPTS = dict(backend="reference", max_num_seqs=8, num_blocks=24, block_size=4)
PROMPTS = ["def fibonacci(n):", "import os\n\n", "class Stack:\n    def __init__(self):", "for i in range(",
           "with open(path) as f:", "    def __repr__(self):", "try:\n    import json", "return sorted(",
           "def main():\n", "if __name__ == '__main__':", "x = [", "async def fetch(url):"]
CANCEL, BREAK = {3, 10, 17, 24}, 29  # consumers that go away after a few outputs


def params_for(i: int) -> SamplingParams:
    if i in CANCEL or i == BREAK:
        return SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    if i % 4 == 0:
        return SamplingParams(temperature=0, max_tokens=6 + i % 13)
    if i % 4 == 1:
        return SamplingParams(temperature=0.8, top_k=40, seed=100 + i, max_tokens=12)
    if i % 4 == 2:  # stops on text: the streamed deltas must hold back what the cut removes
        return SamplingParams(temperature=0, max_tokens=24, stop=["\n\n", "(self"])
    return SamplingParams(temperature=1.0, top_p=0.9, seed=i, max_tokens=20, stop=["):"])


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return llmc.compile("builtin:tiny-py", tmp_path_factory.mktemp("async") / "tiny-py.llmc", dtype="float32")


@pytest.fixture(scope="module")
def offline(artifact):
    """What the offline LLM generates for each of the 32 requests."""
    llm = llmc.LLM(artifact, **OPTS)
    return llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(32)], [params_for(i) for i in range(32)])


@pytest.fixture
def llm(artifact):
    a = llmc.AsyncLLM(artifact, **OPTS)
    yield a
    a.shutdown()


async def collect(agen) -> list:
    return [out async for out in agen]


async def wait_idle(llm, timeout: float = 10.0) -> None:
    """Until the loop thread has nothing left (a cancel is handled on its next round)."""
    t = time.monotonic()
    while llm._streams or llm.engine.has_unfinished():
        assert time.monotonic() - t < timeout, "the engine did not drain"
        await asyncio.sleep(0.01)


def check_stream(outs) -> None:
    """Outputs are in order, only the last is finished, and the deltas concatenate to the totals."""
    assert outs and all(not o.finished for o in outs[:-1])
    for k in range(len(outs[-1].outputs)):
        assert "".join(o.outputs[k].delta_text for o in outs) == outs[-1].outputs[k].text
        assert sum((o.outputs[k].delta_token_ids for o in outs), []) == outs[-1].outputs[k].token_ids


def test_32_concurrent_consumers_match_offline_generate(llm, offline):
    got: dict[int, list] = {}
    aborted, real_abort = [], llm.engine.abort
    llm.engine.abort = lambda rid: aborted.append(rid) or real_abort(rid)  # called by the loop thread

    async def consume(i: int, few: asyncio.Event | None):
        got[i] = []
        async for out in llm.generate(PROMPTS[i % len(PROMPTS)], params_for(i), request_id=f"c{i}"):
            got[i].append(out)
            if few is not None and len(got[i]) == 3:
                few.set()  # the canceller cancels this task at its next await
            if i == BREAK and len(got[i]) == 4:
                break

    async def cancel_when(task, few):
        await few.wait()
        task.cancel()

    async def main():
        events = {i: asyncio.Event() for i in CANCEL}
        tasks = [asyncio.create_task(consume(i, events.get(i))) for i in range(32)]
        results = await asyncio.gather(*tasks, *(cancel_when(tasks[i], events[i]) for i in CANCEL),
                                       return_exceptions=True)
        for i, r in enumerate(results[:32]):
            assert isinstance(r, asyncio.CancelledError) if i in CANCEL else r is None, (i, r)
        await wait_idle(llm)

    asyncio.run(main())
    assert sorted(aborted) == sorted(f"c{i}" for i in CANCEL | {BREAK})  # the ones that went away, once each
    assert llm.engine.stats()["num_preemptions"] > 0  # the small cache really was contended
    for i, outs in got.items():
        want = offline[i]
        if i in CANCEL or i == BREAK:  # went away midway: what it saw is a prefix of the full output
            assert 3 <= len(outs) < 48 and not outs[-1].finished
            assert want.token_ids[:len(outs[-1].token_ids)] == outs[-1].token_ids
            continue
        check_stream(outs)
        last = outs[-1]
        assert (last.text, last.token_ids, last.finish_reason) == (want.text, want.token_ids, want.finish_reason), i
    assert llm.engine.block_manager.num_used_blocks == 0
    assert not llm.engine.has_unfinished()


def test_abort_by_id_gives_the_consumer_a_final_abort_output(llm):
    async def main():
        long = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
        stream = llm.generate("def f(x):", long, request_id="victim")
        first = await stream.__anext__()
        assert await llm.abort("victim") is True
        rest = [first] + await collect(stream)
        check_stream(rest)
        assert rest[-1].finish_reason == "abort" and len(rest[-1].token_ids) < 80
        assert await llm.abort("victim") is False and await llm.abort("never-was") is False
        await wait_idle(llm)

    asyncio.run(main())
    assert llm.engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("prompt, params", [
    ("def f():", SamplingParams(temperature=-1.0)),
    ("", SamplingParams()),
    ([1, 2, 3] * 300, SamplingParams()),  # longer than the model's context
    ([1, 2, -5], SamplingParams()),  # not token ids of this vocabulary
    ([1, 2, 10 ** 6], SamplingParams()),
    ([1, "x"], SamplingParams()),
    (123, SamplingParams()),
], ids=["bad-params", "empty", "too-long", "negative-id", "id-past-vocab", "not-an-id", "not-a-prompt"])
def test_bad_request_raises_to_its_consumer_only(llm, offline, prompt, params):
    async def main():
        good = [asyncio.create_task(collect(llm.generate(PROMPTS[i], params_for(i)))) for i in (0, 1, 2)]
        with pytest.raises(RequestError):
            await collect(llm.generate(prompt, params))
        for i, task in zip((0, 1, 2), good):
            outs = await task
            check_stream(outs)
            assert outs[-1].token_ids == offline[i].token_ids

    asyncio.run(main())


def test_duplicate_live_request_id_is_refused_and_ids_default_unique(llm):
    async def main():
        long = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        first = llm.generate("def f(x):", long, request_id="same")
        await first.__anext__()
        with pytest.raises(RequestError, match="already in use"):
            await collect(llm.generate("class A:", long, request_id="same"))
        outs = await collect(first)  # the refused twin did not abort the live request
        assert outs[-1].finish_reason == "length" and len(outs[-1].token_ids) == 30
        a, b = await asyncio.gather(*(collect(llm.generate("x = ", SamplingParams(max_tokens=2))) for _ in range(2)))
        assert a[0].request_id != b[0].request_id

    asyncio.run(main())


def test_consumers_on_two_event_loops_share_one_engine(llm, offline):
    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def worker(ids):
        async def main():
            outs = await asyncio.gather(*(collect(llm.generate(PROMPTS[i % len(PROMPTS)], params_for(i)))
                                          for i in ids))
            results.update(zip(ids, outs))
        try:
            asyncio.run(main())
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(ids,)) for ids in ((0, 1, 2, 4), (5, 6, 7, 8))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and sorted(results) == [0, 1, 2, 4, 5, 6, 7, 8]
    for i, outs in results.items():
        check_stream(outs)
        assert outs[-1].token_ids == offline[i].token_ids and outs[-1].text == offline[i].text


def test_failed_step_reaches_requests_in_flight_and_the_loop_goes_on(llm, offline):
    engine, real_step = llm.engine, llm.engine.step
    calls = []

    def failing_step(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise ValueError("device fell over")
        return real_step(*a, **kw)

    async def main():
        long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        engine.step = failing_step  # read by the loop thread on its next round
        streams = [collect(llm.generate(p, long)) for p in PROMPTS[:3]]
        results = await asyncio.gather(*streams, return_exceptions=True)
        for r in results:
            assert isinstance(r, LLMCError) and "device fell over" in str(r)
            assert isinstance(r.__cause__, ValueError)
        await wait_idle(llm)
        assert engine.block_manager.num_used_blocks == 0
        outs = await collect(llm.generate(PROMPTS[0], params_for(0)))  # later requests are served
        assert outs[-1].token_ids == offline[0].token_ids

    asyncio.run(main())


def test_shutdown_aborts_what_is_left_and_stops_the_thread(artifact):
    async def main():
        async with llmc.AsyncLLM(artifact, **OPTS) as llm:
            stream = llm.generate("def f(x):", SamplingParams(temperature=0, max_tokens=80, ignore_eos=True))
            await stream.__anext__()
            task = asyncio.create_task(collect(stream))
            await asyncio.sleep(0.05)
        assert not llm._thread.is_alive()
        outs = await task
        assert outs[-1].finished and outs[-1].finish_reason == "abort"
        with pytest.raises(LLMCError, match="shut down"):
            await collect(llm.generate("x = ", SamplingParams(max_tokens=2)))
        llm.shutdown()  # twice is fine

    asyncio.run(main())


def test_idle_loop_thread_sleeps(llm):
    asyncio.run(collect(llm.generate("x = ", SamplingParams(max_tokens=2))))
    time.sleep(0.05)
    cpu = time.process_time()
    time.sleep(0.5)  # only the loop thread could use CPU now
    assert time.process_time() - cpu < 0.1
    assert llm._thread.is_alive()

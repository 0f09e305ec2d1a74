"""Prompt log-probabilities: each prompt token's log-probability given the tokens before it equals the
log-softmax of one plain full-sequence forward (Hugging Face, same weights), however the engine
computes the prompt: in chunks, beside other requests, after a cached prefix, again after a
preemption, on the generated kernels; and requests that do not ask for them are unchanged."""
import pytest
import torch

from llmc.errors import RequestError
from llmc.runtime.llm import LLM, SamplingParams
from tests.conftest import hf_model

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SCORED = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=2)


def prompt_of(n: int, seed: int) -> list[int]:
    return torch.randint(1, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def direct(llama_dir):
    """prompt -> [P, V] fp32 log-softmax of the logits of one Hugging Face forward over it."""
    model = hf_model(llama_dir)

    def logprobs(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    return logprobs


def alone(art, prompt, params=GREEDY, **options):
    return LLM(art, backend="reference", num_blocks=64, block_size=4, **options).generate([prompt], params)[0]


def assert_scored(out, want: torch.Tensor, num_top: int, atol: float = 1e-4):
    prompt = out.prompt_token_ids
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    expected = want[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor(out.prompt_logprobs[1:]), expected, atol=atol, rtol=0)
    if not num_top:
        assert out.prompt_top_logprobs is None
        return
    assert len(out.prompt_top_logprobs) == len(prompt) and out.prompt_top_logprobs[0] is None
    for row, top in zip(want[:-1], out.prompt_top_logprobs[1:]):
        values, ids = row.topk(num_top)
        assert list(top) == ids.tolist()
        assert torch.allclose(torch.tensor(list(top.values())), values, atol=atol, rtol=0)


def test_chunked_prompt_beside_a_plain_request(llama_artifact, direct):
    """A 37-token prompt under an 8-token budget: five chunks, each with its logits rows, as one prefill
    each (not split into decode rows); the plain request in the same steps keeps its tokens."""
    prompt, other = prompt_of(37, 0), prompt_of(21, 1)
    # every step through `_forward`, to count its rows (overlapped steps would launch the plain decodes)
    llm = LLM(llama_artifact, backend="reference", num_blocks=64, block_size=4, max_num_batched_tokens=8,
              overlap=False)
    ex = llm.engine.executor
    real, steps = ex._forward, []
    ex._forward = lambda seqs, greedy: steps.append(seqs) or real(seqs, greedy)
    scored, plain = llm.generate([prompt, other], [SCORED, GREEDY])
    assert_scored(scored, direct(prompt), 2)
    assert plain.prompt_logprobs is None and plain.prompt_top_logprobs is None
    assert plain.token_ids == alone(llama_artifact, other).token_ids
    assert scored.token_ids == alone(llama_artifact, prompt).token_ids
    chunks = [s for seqs in steps for s in seqs if s.num_logits == len(s.token_ids) > 1]
    assert len(chunks) >= 3 and sum(s.num_logits for seqs in steps for s in seqs) == 36 + 1 + 5 + 1 + 5
    assert llm.stats()["blocks_used"] == 0


def test_cached_prefix_is_computed_again(llama_artifact, direct):
    """A cached prefix would skip computing its positions, and with them their logits: the request takes
    no hit, and the cache still serves the plain requests after it."""
    prefix = prompt_of(16, 2)  # 4 full blocks of 4
    llm = LLM(llama_artifact, backend="reference", num_blocks=64, block_size=4)
    llm.generate([prefix + [40, 41]], GREEDY)
    hits = llm.stats()["prefix_cache_hit_tokens"]
    prompt = prefix + [50, 51, 52]
    out = llm.generate([prompt], SCORED)[0]
    assert llm.stats()["prefix_cache_hit_tokens"] == hits
    assert_scored(out, direct(prompt), 2)
    assert out.token_ids == alone(llama_artifact, prompt).token_ids
    llm.generate([prefix + [60]], GREEDY)
    assert llm.stats()["prefix_cache_hit_tokens"] == hits + 16


def test_preempted_midway_scores_each_position_once(llama_artifact, direct):
    """Preempted by recompute after two of its chunks, an n = 2 request computes its prompt again from the
    start but scores only the positions it had not; both samples report the one prompt's."""
    prompt = prompt_of(30, 3)
    llm = LLM(llama_artifact, backend="reference", num_blocks=64, block_size=4, max_num_seqs=2,
              max_num_batched_tokens=8)
    eng = llm.engine
    eng.add_request(prompt, SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=4, prompt_logprobs=0), "scored")
    eng.step()
    eng.step()
    assert len(eng.requests["scored"].group.prompt_logprobs.logprobs) == 16
    eng.add_request(prompt_of(5, 4), SamplingParams(temperature=0, max_tokens=2, priority=-1), "urgent")
    final = {}
    while eng.has_unfinished():
        final.update((o.request_id, o) for o in eng.step(finished_only=True))
    assert eng.num_preemptions >= 1
    out = final["scored"]
    assert_scored(out, direct(prompt), 0)
    assert len(out.outputs) == 2 and all(len(c.token_ids) == 4 for c in out.outputs)


def test_stream_carries_them_from_the_prompts_last_chunk(llama_artifact):
    prompt = prompt_of(20, 6)
    llm = LLM(llama_artifact, backend="reference", num_blocks=64, block_size=4, max_num_batched_tokens=8)
    outs = list(llm.stream(prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=1)))
    first = next(i for i, o in enumerate(outs) if o.prompt_logprobs is not None)
    assert first == 2 and outs[first].outputs[0].token_ids and not outs[first - 1].outputs[0].token_ids
    assert all(o.prompt_logprobs == outs[first].prompt_logprobs for o in outs[first:])
    assert outs[-1].finished and len(outs[-1].prompt_top_logprobs) == 20


def test_one_token_prompt_and_bad_values(llama_artifact):
    out = alone(llama_artifact, [7], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))
    assert out.prompt_logprobs == [None] and out.prompt_top_logprobs == [None]
    for bad in (-1, 1.5, "2", True):
        with pytest.raises(RequestError, match="prompt_logprobs must be None .off. or an int >= 0"):
            SamplingParams(prompt_logprobs=bad).validate()


def test_triton_interpret_backend(llama_artifact, direct):
    """The generated kernels score a chunked prompt (two chunks) beside a plain request."""
    prompt, other = prompt_of(10, 7), prompt_of(3, 8)
    llm = LLM(llama_artifact, backend="triton-interpret", num_blocks=16, block_size=4, max_num_batched_tokens=8)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=2)
    plain_params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    scored, plain = llm.generate([prompt, other], [params, plain_params])
    assert_scored(scored, direct(prompt), 2, atol=1e-3)
    assert plain.token_ids == alone(llama_artifact, other).token_ids[:2]


def test_beside_a_speculative_decode(llama_artifact, direct):
    """Steps that verify one request's speculated tokens (a row per fed token) and score another's prompt
    chunk: each request gets its own rows, and the decoding one its tokens of plain decoding."""
    loop, prompt = [5, 6, 7, 8] * 6, prompt_of(40, 9)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm = LLM(llama_artifact, backend="reference", num_blocks=64, block_size=4, max_num_batched_tokens=8,
              speculative={"method": "ngram", "num_speculative_tokens": 3})
    eng, plans = llm.engine, []
    schedule = eng.scheduler.schedule
    eng.scheduler.schedule = lambda: plans.append(schedule()) or plans[-1]
    eng.add_request(loop, params, "loop")
    while llm.stats()["spec_proposed_tokens"] == 0:
        eng.step()
    eng.add_request(prompt, SCORED, "scored")
    final = {}
    while eng.has_unfinished():
        final.update((o.request_id, o) for o in eng.step(finished_only=True))
    assert any(p.has_spec and p.scores_prompts for p in plans)
    assert final["loop"].token_ids == alone(llama_artifact, loop, params).token_ids
    assert_scored(final["scored"], direct(prompt), 2)

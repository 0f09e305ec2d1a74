"""Generated tokens' log-probabilities and top-k alternatives (`SamplingParams(logprobs=k)`): each equals a
direct log-softmax (of the logits the token was drawn from: temperature applied) of one plain Hugging Face
forward over prompt + output, greedy and sampled, n > 1, streamed; speculative decoding reports what plain
decoding does; bad values are refused."""
import pytest
import torch

from llmc.errors import RequestError
from llmc.runtime.llm import LLM, SamplingParams
from tests.conftest import CODE_PROMPTS, hf_model

K = 4


def prompt_of(n: int, seed: int) -> list[int]:
    return torch.randint(1, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def direct(llama_dir):
    """(prompt, output, temperature) -> [len(output), V] fp32 log-softmax of the logits / temperature that
    chose each output token, from one Hugging Face forward over prompt + output."""
    model = hf_model(llama_dir)

    def logprobs(prompt: list[int], output: list[int], temperature: float = 1.0) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + output])).logits[0].float()
        return torch.log_softmax(logits[len(prompt) - 1:-1] / temperature, dim=-1)
    return logprobs


def assert_matches(c, want: torch.Tensor, k: int, atol: float = 1e-4):
    """Sample `c`'s logprobs and alternatives equal the rows of `want` [len(c.token_ids), V]."""
    assert len(c.logprobs) == len(c.top_logprobs) == len(c.token_ids) == want.shape[0]
    chosen = want.gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(c.logprobs), chosen, atol=atol, rtol=0)
    for row, top, tok, lp in zip(want, c.top_logprobs, c.token_ids, c.logprobs):
        values, ids = row.topk(k)
        assert list(top) == ids.tolist()  # most likely first
        assert torch.allclose(torch.tensor(list(top.values())), values, atol=atol, rtol=0)
        if tok in top:
            assert top[tok] == pytest.approx(lp, abs=1e-6)


def test_greedy_alternatives_are_the_top_k_of_the_models_distribution(llama_artifact, direct):
    prompts = [prompt_of(9, 0), prompt_of(17, 1)]
    llm = LLM(llama_artifact, backend="reference", num_blocks=64, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=K)
    outs = llm.generate(prompts, [params, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)])
    c = outs[0].outputs[0]
    assert_matches(c, direct(prompts[0], c.token_ids), K)
    assert all(tok == next(iter(top)) for tok, top in zip(c.token_ids, c.top_logprobs))  # greedy: the first
    plain = outs[1].outputs[0]  # asked nothing: gets nothing, and the same tokens as alone
    assert plain.logprobs is None and plain.top_logprobs is None
    alone = LLM(llama_artifact, backend="reference", num_blocks=64, block_size=4).generate(
        [prompts[1]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert plain.token_ids == alone.token_ids
    assert llm.stats()["blocks_used"] == 0


def test_sampled_n2_alternatives_are_those_of_the_tempered_distribution(llama_artifact, direct):
    prompt = prompt_of(12, 2)
    params = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=8, ignore_eos=True, logprobs=K)
    llm = LLM(llama_artifact, backend="reference", num_blocks=64, block_size=4)
    out = llm.generate([prompt], params)[0]
    assert out.outputs[0].token_ids != out.outputs[1].token_ids
    for c in out.outputs:
        assert_matches(c, direct(prompt, c.token_ids, 0.8), K)
    # a filtered-out alternative is reported as what it is in the distribution drawn from: -inf
    filtered = llm.generate([prompt], SamplingParams(temperature=0.8, seed=7, max_tokens=4, top_k=2,
                                                     logprobs=3))[0].outputs[0]
    for top, tok in zip(filtered.top_logprobs, filtered.token_ids):
        assert list(top.values())[2] == float("-inf") and tok in list(top)[:2]


def test_stream_deltas_carry_their_tokens_alternatives(llama_artifact):
    prompt = prompt_of(10, 3)
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True, logprobs=2)
    llm = LLM(llama_artifact, backend="reference", num_blocks=64, block_size=4)
    whole = llm.generate([prompt], params)[0]
    got = {0: ([], [], []), 1: ([], [], [])}
    for o in llm.stream(prompt, params):
        for c in o.outputs:
            n = len(c.delta_token_ids)
            ids, lps, tops = got[c.index]
            ids += c.delta_token_ids
            lps += c.logprobs[len(c.logprobs) - n:] if n else []
            tops += c.top_logprobs[len(c.top_logprobs) - n:] if n else []
    for c in whole.outputs:  # (the second run's prompt comes from the prefix cache: values may round apart)
        ids, lps, tops = got[c.index]
        assert ids == c.token_ids and lps == pytest.approx(c.logprobs, abs=1e-4)
        assert [list(t) for t in tops] == [list(t) for t in c.top_logprobs]
        assert [v for t in tops for v in t.values()] == \
            pytest.approx([v for t in c.top_logprobs for v in t.values()], abs=1e-4)


def test_speculative_verify_reports_what_plain_decoding_does(tiny_py_artifact):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=K)
    plain = LLM(tiny_py_artifact, backend="reference", num_blocks=256).generate(CODE_PROMPTS, greedy)
    llm = LLM(tiny_py_artifact, backend="reference", num_blocks=256,
              speculative={"method": "ngram", "num_speculative_tokens": 3})
    spec = llm.generate(CODE_PROMPTS, greedy)
    assert llm.stats()["spec_accepted_tokens"] > 0
    for a, b in zip(spec, plain):
        a, b = a.outputs[0], b.outputs[0]
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        for x, y in zip(a.top_logprobs, b.top_logprobs):
            assert list(x) == list(y) and list(x.values()) == pytest.approx(list(y.values()), abs=1e-4)


def test_speculative_sampled_tokens_carry_the_targets_alternatives(tiny_py_artifact):
    """Sampled tokens differ with speculation (the randomness is used differently), so each one's (accepted
    draft tokens' included) is checked against plain scoring of prompt + output: `prompt_logprobs` over the
    whole vocabulary gives the model's log-softmax rows, tempered here as the sampler tempers them."""
    t = 0.7
    params = SamplingParams(n=2, temperature=t, seed=1, max_tokens=24, ignore_eos=True, logprobs=K)
    llm = LLM(tiny_py_artifact, backend="reference", num_blocks=256,
              speculative={"method": "ngram", "num_speculative_tokens": 3})
    outs = llm.generate(CODE_PROMPTS[:4], params)
    assert llm.stats()["spec_accepted_tokens"] > 0
    scorer = LLM(tiny_py_artifact, backend="reference", num_blocks=256)
    vocab = scorer.engine.info.vocab_size
    for o in outs:
        for c in o.outputs:
            p = len(o.prompt_token_ids)
            ref = scorer.generate([o.prompt_token_ids + c.token_ids],
                                  SamplingParams(max_tokens=1, prompt_logprobs=vocab))[0]
            rows = torch.full((len(c.token_ids), vocab), float("-inf"))
            for r, full in enumerate(ref.prompt_top_logprobs[p:]):
                rows[r, list(full)] = torch.tensor(list(full.values()))
            assert_matches(c, torch.log_softmax(rows / t, dim=-1), K)


def test_chosen_only_bool_spelling_and_bad_values(llama_artifact):
    llm = LLM(llama_artifact, backend="reference", num_blocks=64, block_size=4)
    for lp in (0, True):
        c = llm.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=3, logprobs=lp))[0].outputs[0]
        assert len(c.logprobs) == 3 and c.top_logprobs is None
    assert SamplingParams(logprobs=True).num_logprobs == 0 and SamplingParams(logprobs=False).num_logprobs is None
    SamplingParams(logprobs=20).validate()
    for bad in (21, -1, 1.5, "2"):
        with pytest.raises(RequestError, match="logprobs must be None .off. or an int from 0 to 20"):
            SamplingParams(logprobs=bad).validate()

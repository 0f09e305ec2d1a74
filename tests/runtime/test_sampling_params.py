"""SamplingParams.validate: every bad field gives a RequestError that names it."""

import pytest

from llmc.errors import LLMCError, RequestError
from llmc.runtime.sampling_params import SamplingParams


def test_defaults_are_valid():
    SamplingParams().validate()
    params = SamplingParams(temperature=0, top_k=-1, top_p=1.0, min_p=1.0, stop="\n")
    params.validate(context_len=16)
    assert SamplingParams(stop="x").stop_strings == ("x",)
    assert SamplingParams(stop=["a", "b"]).stop_strings == ("a", "b")
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_tokens=0), "max_tokens must be at least 1"),
        (dict(max_tokens=-3), "max_tokens must be at least 1"),
        (dict(max_tokens=2.5), "max_tokens must be an int"),
        (dict(top_p=0.0), "top_p must be in (0, 1]"),
        (dict(top_p=1.5), "top_p must be in (0, 1]"),
        (dict(temperature=-0.1), "temperature must be >= 0"),
        (dict(temperature=float("nan")), "temperature must be a finite number"),
        (dict(temperature=float("inf")), "temperature must be a finite number"),
        (dict(top_k=-2), "top_k must be -1 or 0"),
        (dict(min_p=-0.1), "min_p must be in [0, 1]"),
        (dict(min_p=1.1), "min_p must be in [0, 1]"),
        (dict(n=0), "n must be at least 1"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be from 0.001 to 1000"),
        (dict(repetition_penalty=1e-40), "repetition_penalty must be from 0.001 to 1000"),  # logits / it: inf
        (dict(repetition_penalty=1e4), "repetition_penalty must be from 0.001 to 1000"),
        (dict(presence_penalty=3.0), "presence_penalty must be in [-2, 2]"),
        (dict(frequency_penalty=-2.5), "frequency_penalty must be in [-2, 2]"),
        (dict(stop=""), "stop must not be an empty string"),
        (dict(stop=["ok", ""]), "stop must be a string or a list of non-empty strings"),
        (dict(stop=["ok", 3]), "got element 3"),
        (dict(stop=5), "got int"),
        (dict(stop_token_ids=[1, -1]), "stop_token_ids must be a list of non-negative ints"),
        (dict(stop_token_ids=[1, "a"]), "got element 'a'"),
        (dict(stop_token_ids=[True]), "got element True"),
        (dict(stop_token_ids=7), "got int"),
        (dict(seed="7"), "seed must be an int"),
        (dict(seed=2 ** 64), "seed must be an int from -2**63 to 2**64 - 1"),
        (dict(seed=-2 ** 63 - 1), "seed must be an int from -2**63"),
        (dict(seed=2 ** 64 - 1, n=2), "2**64 - 2 (sample i"),  # sample 1 would use seed + 1
        (dict(ignore_eos="yes"), "ignore_eos must be true or false"),
        (dict(priority=0.5), "priority must be an int"),
    ],
)
def test_invalid_params_raise_clear_request_error(kwargs, message):
    with pytest.raises(RequestError) as info:
        SamplingParams(**kwargs).validate()
    assert message in str(info.value)
    assert isinstance(info.value, LLMCError)


def test_max_tokens_beyond_context_len_is_rejected():
    SamplingParams(max_tokens=100).validate()
    with pytest.raises(RequestError, match="exceeds the model's context length"):
        SamplingParams(max_tokens=100).validate(context_len=64)


def test_temperatures_below_the_greedy_threshold_are_greedy():
    # dividing fp32 logits by 1e-40 would overflow them: such a request is greedy, as vLLM takes it
    assert SamplingParams(temperature=1e-40).greedy and SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=1e-4).greedy
    SamplingParams(temperature=1e-40, seed=2 ** 64 - 1).validate()

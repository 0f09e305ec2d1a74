"""How one request wants its tokens chosen and when it wants generation to stop.

The fields follow the OpenAI / vLLM names so that `llmc serve` maps request JSON onto them
one to one. `validate()` is the single place a bad request is turned into a `RequestError`
with a message the user can act on; the scheduler calls it in `add()` so that nothing invalid
ever reaches the sampler (which would otherwise fail deep inside a torch call).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from numbers import Integral, Real

from llmc.errors import RequestError


MAX_LOGPROBS = 20  # most alternatives per generated token (OpenAI's chat top_logprobs limit)
# temperatures below this are greedy (as vLLM's): dividing fp32 logits by less would overflow them to inf
GREEDY_TEMPERATURE = 1e-5
# repetition_penalty's range: dividing a logit by less than its lower end could overflow fp32
REPETITION_PENALTY_RANGE = (1e-3, 1e3)
# torch.Generator.manual_seed's range; sample i of a request uses seed + i
SEED_RANGE = (-2 ** 63, 2 ** 64 - 1)


@dataclass
class SamplingParams:
    """Sampling and stopping options of one request.

    Args:
        n: number of independent samples of the same prompt (they share the prompt's KV blocks).
        temperature: softmax temperature; 0 (or anything below `GREEDY_TEMPERATURE`, 1e-5) means greedy
            (argmax, ties to the lowest token id).
        top_k: keep the k most likely tokens; 0 or -1 turns it off.
        top_p: keep the smallest set of most likely tokens whose probability sums to >= top_p.
        min_p: drop tokens whose probability is below min_p times the top token's probability.
        repetition_penalty: HF semantics over prompt+output tokens (1.0 = off; from 0.001 to 1000).
        presence_penalty: OpenAI semantics over output tokens (0.0 = off).
        frequency_penalty: OpenAI semantics over output tokens (0.0 = off).
        seed: makes sampling repeatable; sample i of an n>1 request uses seed + i (from -2**63 to 2**64 - 1).
        stop_token_ids: token ids that end generation (finish_reason "stop").
        stop: strings that end generation; the output text is cut before the stop string.
        max_tokens: most tokens to generate (finish_reason "length").
        min_tokens: the first `min_tokens` generated tokens cannot be the end-of-sequence token or one of
            `stop_token_ids` (vLLM's semantics; stop strings still end generation).
        logprobs: None (off), or k >= 0 (at most `MAX_LOGPROBS`): keep the log-probability of each
            generated token, and with k > 0 also its k most likely alternatives (see
            `CompletionOutput.top_logprobs`). Both are of the distribution the token was drawn from:
            log-softmax of the logits after penalties, temperature and top-k/top-p/min-p (a greedy
            request keeps temperature 1), so a filtered-out alternative has -inf. True means 0 and
            False None (the older spelling).
        prompt_logprobs: None (off), or k >= 0: return the log-probability of every prompt token
            given the ones before it (of the model's raw distribution: log-softmax of the fp32
            logits, no temperature, penalty or filter), and with k > 0 also each position's k most
            likely tokens (see `RequestOutput.prompt_logprobs`).
        logit_bias: {token id: bias} added to the model's logits before anything else (OpenAI semantics:
            a bias from -100 to 100; -100 practically bans a token, 100 practically forces it). JSON's
            string keys ("50256") are taken as the ids they spell.
        logits_processors: Python callables `fn(output_token_ids, logits) -> logits`, applied in order to
            each of the request's fp32 logits rows [V] after the bias and before the penalties (the offline
            API only: a server request cannot carry code). The ids are the tokens generated so far, all of
            them: a request with processors waits for its previous step's tokens, as one with penalties does.
        ignore_eos: keep generating past the end-of-sequence token.
        priority: lower value is served first (see `Scheduler` for the aging rule).

    Example:
        >>> SamplingParams(temperature=0.0, max_tokens=8, stop=["\\n"]).validate()
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] | list[int] = ()
    stop: str | tuple[str, ...] | list[str] = ()
    max_tokens: int = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    ignore_eos: bool = False
    priority: int = 0
    logit_bias: dict[int, float] | None = None
    logits_processors: tuple | list = ()

    def __post_init__(self):
        if isinstance(self.logit_bias, Mapping):  # JSON (the server, --prompts) spells the ids as strings
            self.logit_bias = {int(k) if isinstance(k, str) and k.isdigit() else k: v
                               for k, v in self.logit_bias.items()}

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def reads_tokens(self) -> bool:
        """Whether sampling reads the sequence's tokens, not only these params: a penalty or a logits processor."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or \
            bool(self.logits_processors)

    @property
    def plain_greedy(self) -> bool:
        """Greedy with no penalty, logit bias, min_tokens or logits processor: each token is the row's raw argmax."""
        return self.greedy and not self.reads_tokens and not self.logit_bias and not self.min_tokens

    @property
    def num_logprobs(self) -> int | None:
        """`logprobs` as None (off) or k >= 0 alternatives per token (True is 0, False None)."""
        lp = self.logprobs
        return None if lp is None or lp is False else 0 if lp is True else int(lp)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """`stop` as a tuple (a single string is accepted for OpenAI compatibility)."""
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def validate(self, context_len: int | None = None) -> None:
        """Raise `RequestError` naming the first invalid field and its allowed range.

        Args:
            context_len: the model's maximum context length; when given, `max_tokens` larger
                than it is rejected because it could never be reached.
        """
        _int(self.n, "n")
        if self.n < 1:
            raise RequestError(f"n must be at least 1, got {self.n}.")
        _int(self.max_tokens, "max_tokens")
        if self.max_tokens <= 0:
            raise RequestError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if context_len is not None and self.max_tokens > context_len:
            raise RequestError(
                f"max_tokens={self.max_tokens} exceeds the model's context length "
                f"({context_len}); lower max_tokens."
            )
        _int(self.min_tokens, "min_tokens")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise RequestError(f"min_tokens must be from 0 to max_tokens ({self.max_tokens}), got {self.min_tokens}.")
        _real(self.temperature, "temperature")
        if self.temperature < 0:
            raise RequestError(
                f"temperature must be >= 0 (0 means greedy), got {self.temperature}."
            )
        _int(self.top_k, "top_k")
        if self.top_k < -1:
            raise RequestError(f"top_k must be -1 or 0 (off) or a positive int, got {self.top_k}.")
        _real(self.top_p, "top_p")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}.")
        _real(self.min_p, "min_p")
        if not 0.0 <= self.min_p <= 1.0:
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p}.")
        _real(self.repetition_penalty, "repetition_penalty")
        lo, hi = REPETITION_PENALTY_RANGE
        if not lo <= self.repetition_penalty <= hi:
            raise RequestError(
                f"repetition_penalty must be from {lo:g} to {hi:g} (1.0 is off), got {self.repetition_penalty}."
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _real(value, name)
            if not -2.0 <= value <= 2.0:
                raise RequestError(f"{name} must be in [-2, 2], got {value}.")
        if self.seed is not None:
            _int(self.seed, "seed")
            lo, hi = SEED_RANGE
            if not lo <= self.seed <= hi - (self.n - 1):
                raise RequestError(f"seed must be an int from -2**63 to 2**64 - {self.n} (sample i of the request "
                                   f"uses seed + i), got {self.seed}.")
        _int(self.priority, "priority")
        for name in ("ignore_eos",):
            if not isinstance(getattr(self, name), bool):
                raise RequestError(f"{name} must be true or false, got {getattr(self, name)!r}.")
        lp = self.logprobs
        if lp is not None and not isinstance(lp, bool) and \
                (not isinstance(lp, Integral) or not 0 <= lp <= MAX_LOGPROBS):
            raise RequestError(
                f"logprobs must be None (off) or an int from 0 to {MAX_LOGPROBS} (how many most likely "
                f"alternatives to return beside each generated token's log-probability), got {lp!r}."
            )
        if self.prompt_logprobs is not None:
            if isinstance(self.prompt_logprobs, bool) or not isinstance(self.prompt_logprobs, Integral) \
                    or self.prompt_logprobs < 0:
                raise RequestError(
                    "prompt_logprobs must be None (off) or an int >= 0 (how many most likely tokens to "
                    f"return beside each prompt token's log-probability), got {self.prompt_logprobs!r}."
                )
        self._validate_stop()
        self._validate_logit_bias()
        procs = self.logits_processors
        if not isinstance(procs, (list, tuple)) or not all(callable(f) for f in procs):
            raise RequestError("logits_processors must be a list of callables fn(output_token_ids, logits) -> logits.")

    def _validate_logit_bias(self, vocab_size: int | None = None) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, Mapping):
            raise RequestError(f"logit_bias must map token ids to biases from -100 to 100, got {type(bias).__name__}.")
        for t, b in bias.items():
            if isinstance(t, bool) or not isinstance(t, Integral) or t < 0 or \
                    (vocab_size is not None and t >= vocab_size):
                where = f" [0, {vocab_size})" if vocab_size is not None else ""
                raise RequestError(f"logit_bias keys must be token ids{where}; got {t!r}.")
            _real(b, f"logit_bias[{t}]")
            if not -100.0 <= b <= 100.0:
                raise RequestError(f"logit_bias[{t}] must be from -100 to 100, got {b}.")

    def check_vocab(self, vocab_size: int) -> None:
        """Raise `RequestError` where a token id the request names (logit_bias, stop_token_ids) is outside the
        vocabulary."""
        self._validate_logit_bias(vocab_size)
        bad = next((t for t in self.stop_token_ids if t >= vocab_size), None)
        if bad is not None:
            raise RequestError(f"stop_token_ids holds token id {bad}, outside this model's vocabulary [0, {vocab_size}).")

    def _validate_stop(self) -> None:
        stop = self.stop
        if isinstance(stop, str):
            if not stop:
                raise RequestError("stop must not be an empty string.")
        elif isinstance(stop, (list, tuple)):
            for s in stop:
                if not isinstance(s, str) or not s:
                    raise RequestError(
                        f"stop must be a string or a list of non-empty strings; got element {s!r}."
                    )
        else:
            raise RequestError(
                f"stop must be a string or a list of non-empty strings, got {type(stop).__name__}."
            )
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)):
            raise RequestError(
                f"stop_token_ids must be a list of non-negative ints, got {type(ids).__name__}."
            )
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, Integral) or t < 0:
                raise RequestError(
                    f"stop_token_ids must be a list of non-negative ints; got element {t!r}."
                )


def _int(value: object, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise RequestError(f"{name} must be an int, got {value!r}.")


def _real(value: object, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise RequestError(f"{name} must be a finite number, got {value!r}.")

"""Turn one logits row per sequence into the next token: penalties, filters, then a draw.

Order (each step reads the previous one's output):
  0. logit bias (OpenAI): each request's {token id: bias} added to the model's logits; then, for a
     request with fewer output tokens than its `min_tokens`, its stop token ids and the end-of-sequence
     ids masked to -inf;
     then each request's own `logits_processors`, row by row;
  1. repetition penalty (HF): over prompt+output tokens, divide positive logits, multiply
     negative ones, so a repeated token always becomes less likely;
  2. presence / frequency penalties (OpenAI): `logit -= frequency * count + presence * (count>0)`
     over output tokens only;
  3. temperature (greedy rows keep temperature 1: argmax is invariant, and their logprobs stay
     those of the penalised distribution);
  4. top-k, 5. top-p, 6. min-p: masked to -inf. Top-k/top-p use one descending stable sort so
     that among equal logits the lowest token id is kept, which makes top_k=1 and a tiny top_p
     agree with greedy's argmax (ties to the lowest id);
  7. draw: greedy rows take the argmax; a seeded row uses `torch.multinomial` with the sequence's own
     generator, so a seeded request repeats whatever else is in the batch; the unseeded rows share
     one `torch.multinomial` call.
The returned logprob is `log_softmax` of the processed logits at the chosen token, and a row whose
request asks for k alternatives (`SamplingParams.logprobs = k`) gets that row's k largest entries too.
Everything is batched over rows except the per-row draw (each row may own a generator).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmc.errors import RequestError
from llmc.runtime.sampling_params import GREEDY_TEMPERATURE
from llmc.runtime.sequence import Sequence
from llmc.runtime.transfer import to_device


@dataclass
class SamplerOutput:
    token_ids: list[int]  # [N]
    logprobs: list[float]  # [N], log-probability of each chosen token
    top: list[dict[int, float]] | None = None  # [N], each row's asked-for alternatives (None: none asked)


class Sampler:
    """Samples one token per row of `logits` for the matching sequence. `eos_token_ids`: the model's end of
    sequence, which `min_tokens` holds off.

    Example:
        >>> out = Sampler()(logits, seqs)  # logits: float32 [len(seqs), V]
        >>> out.token_ids, out.logprobs
    """

    def __init__(self, eos_token_ids=()):
        self.eos_token_ids = tuple(eos_token_ids)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        # logits: [N, V], one row per entry of seqs
        assert logits.dim() == 2 and logits.shape[0] == len(seqs), (logits.shape, len(seqs))
        if all(plain_greedy(s.params) for s in seqs):
            # the decode hot path: no filter or penalty can change an argmax, so skip the
            # vocabulary-wide passes; logprobs only when asked for
            tokens = logits.argmax(dim=-1)  # [N]; first maximum = lowest id on ties
            if any(s.params.num_logprobs is not None for s in seqs):
                logprobs = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
                chosen = logprobs.gather(1, tokens[:, None])[:, 0]
                return SamplerOutput(tokens.tolist(), chosen.tolist(), top_of(logprobs, seqs))
            ids = tokens.tolist()
            return SamplerOutput(ids, [0.0] * len(ids))
        logits = self.process(logits, seqs)
        logprobs = torch.log_softmax(logits, dim=-1)  # [N, V]
        tokens = self._draw(logits, seqs)  # [N]
        chosen = logprobs.gather(1, tokens[:, None])[:, 0]  # [N]
        return SamplerOutput(tokens.tolist(), chosen.tolist(), top_of(logprobs, seqs))

    @staticmethod
    def argmax_only(seqs: list[Sequence]) -> bool:
        """Whether each row's token is just its argmax, with no logprob asked: then the logits need
        not leave the device (the runner reduces them where they are)."""
        return all(s.argmax_only for s in seqs)

    def process(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Apply penalties, temperature and filters; returns new float32 logits [N, V]. Nothing here waits for
        the device (the parameters go to it through pinned memory; every branch is decided on the host)."""
        logits = logits.to(torch.float32, copy=True)
        params = [s.params for s in seqs]
        device = logits.device

        def column(name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # [N, 1]
            return to_device([float(getattr(p, name)) for p in params], device, dtype)[:, None]

        if any(p.logit_bias for p in params):
            entries = [(i, t, b) for i, p in enumerate(params) for t, b in (p.logit_bias or {}).items()]
            rows, cols, bias = (to_device(list(c), device, d) for c, d in
                                zip(zip(*entries), (torch.int64, torch.int64, torch.float32)))
            logits.index_put_((rows, cols), bias, accumulate=True)
        short = [(i, t) for i, (s, p) in enumerate(zip(seqs, params))
                 if p.min_tokens and len(s.output_token_ids) < p.min_tokens
                 for t in {*self.eos_token_ids, *p.stop_token_ids} if t < logits.shape[1]]
        if short:  # too few tokens yet: nothing that would end the sequence may be drawn
            rows, cols = (to_device(list(c), device, torch.int64) for c in zip(*short))
            logits[rows, cols] = float("-inf")
        for i, (s, p) in enumerate(zip(seqs, params)):
            for fn in p.logits_processors:
                out = fn(list(s.output_token_ids), logits[i])
                if not isinstance(out, torch.Tensor) or out.shape != logits[i].shape:
                    raise RequestError(f"a logits processor returned {type(out).__name__} "
                                       f"{tuple(getattr(out, 'shape', ()))}; it must return the logits row, a "
                                       f"tensor of shape {tuple(logits[i].shape)}")
                logits[i] = out
        if any(p.repetition_penalty != 1.0 for p in params):
            seen = _token_counts([s.token_ids for s in seqs], logits.shape[1], device) > 0
            penalty = column("repetition_penalty")
            penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits = torch.where(seen, penalised, logits)
        if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
            counts = _token_counts([s.output_token_ids for s in seqs], logits.shape[1], device)
            logits -= column("frequency_penalty") * counts
            logits -= column("presence_penalty") * (counts > 0)
        temperature = column("temperature")
        logits /= torch.where(temperature < GREEDY_TEMPERATURE, 1.0, temperature)
        vocab = logits.shape[1]
        if any(0 < p.top_k < vocab or p.top_p < 1.0 for p in params):
            logits = _top_k_top_p(logits, column("top_k", torch.int64), column("top_p"))
        if any(p.min_p > 0 for p in params):
            probs = torch.softmax(logits, dim=-1)
            floor = column("min_p") * probs.max(dim=-1, keepdim=True).values
            logits = logits.masked_fill(probs < floor, float("-inf"))
        return logits

    @staticmethod
    def on_device(seq: Sequence) -> bool:
        """Whether `tokens_on_device` can sample this sequence's row: a plain argmax, or a draw under
        temperature, top-k, top-p and min-p alone; no seed (its generator is on the host), no penalty or
        logits processor (they read the sequence's tokens, the last of which may still be on the device), no
        logprobs."""
        p = seq.params
        return p.num_logprobs is None and (plain_greedy(p) or (seq.generator is None and not p.reads_tokens))

    def tokens_on_device(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Each row's token for `on_device` sequences, left on the device and not waited for (the engine's
        overlapped steps): the host path's `process` and draw, where none of these rows has a generator or
        a penalty, so nothing waits."""
        return self._draw(self.process(logits, seqs), seqs)

    @staticmethod
    def _draw(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Greedy rows' argmax; a seeded row drawn with its own generator; the other sampled rows in one
        `torch.multinomial` call (on a GPU: one launch and no wait per row)."""
        top, tokens = logits.max(dim=-1)  # [N]; first maximum = lowest id on ties
        probs = _drawable(torch.softmax(logits, dim=-1), top, tokens)
        free = [i for i, seq in enumerate(seqs) if not seq.params.greedy and seq.generator is None]
        if free:
            rows = to_device(free, logits.device, torch.int64)
            tokens[rows] = torch.multinomial(probs[rows], 1)[:, 0]
        for i, seq in enumerate(seqs):
            if not seq.params.greedy and seq.generator is not None:
                tokens[i] = draw(probs[i], seq.generator)
        return tokens


def _drawable(probs: torch.Tensor, top: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """`probs` with each row that is no distribution replaced by all its mass on the row's argmax (`tokens`): a row
    whose largest logit (`top`) is NaN or +inf (a logits processor's NaN, an inf that softmax turns into NaN) or
    -inf (every token filtered out). One such row then cannot fail the whole batch's draw (on a GPU, a device
    assert). Nothing waits for the device."""
    bad = ~torch.isfinite(top)[:, None]
    return probs.masked_fill_(bad, 0.0).scatter_add_(1, tokens[:, None], bad.to(probs.dtype))


def target_logprobs(logits: torch.Tensor, targets: list[int], num_top: int = 0
                    ) -> tuple[list[float], list[dict[int, float]]]:
    """Each row's log-probability of its target token under the model's own distribution (log-softmax of
    the fp32 logits: no temperature, penalty or filter), and with `num_top` > 0 each row's `num_top` most
    likely tokens and theirs, most likely first (else an empty list). logits: [R, V], targets: [R].

    Subtracts each row's logsumexp from the few entries wanted instead of taking a whole log-softmax: a
    long prompt chunk's rows are the largest tensor of its step, and this allocates no second one."""
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [R, 1]
    chosen = (logits.gather(1, torch.tensor(targets, device=logits.device)[:, None]) - lse)[:, 0].tolist()
    if num_top <= 0:
        return chosen, []
    return chosen, top_logprobs(logits, [num_top] * len(targets), lse)


def top_logprobs(rows: torch.Tensor, nums: list[int], lse: torch.Tensor | None = None) -> list[dict[int, float]]:
    """Row i's `nums[i]` largest entries as token id -> value, largest first (an empty dict where nums[i] is
    0); `lse` [R, 1] is subtracted from the values (then rows are logits, not log-probabilities). rows: [R, V].
    One top-k over all rows: what one decode step costs beside its log-softmax."""
    k = min(max(nums, default=0), rows.shape[1])
    if k <= 0:
        return [{} for _ in nums]
    values, ids = rows.topk(k, dim=-1)  # [R, k], sorted descending
    if lse is not None:
        values = values - lse
    return [dict(zip(i[:n], v[:n])) for i, v, n in zip(ids.tolist(), values.tolist(), nums)]


def top_of(logprobs: torch.Tensor, seqs: list) -> list[dict[int, float]] | None:
    """Each row's alternatives as its sequence asks for them (`SamplingParams.logprobs`); None if none asks.
    logprobs: [N, V], the rows the chosen tokens' log-probabilities come from."""
    nums = [s.params.num_logprobs or 0 for s in seqs]
    return top_logprobs(logprobs, nums) if any(nums) else None


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from a probability row. A seeded request's generator lives on the CPU (so the same
    seed gives the same tokens on every device): its row is drawn there."""
    if generator is not None and probs.device != generator.device:
        probs = probs.to(generator.device)
    return int(torch.multinomial(probs, 1, generator=generator)[0])


def plain_greedy(p) -> bool:
    return p.plain_greedy


def _token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """Occurrences of each token id per row: [N, V] float32."""
    counts = torch.zeros(len(token_lists), vocab, device=device)
    for i, tokens in enumerate(token_lists):
        if tokens:
            ids = torch.tensor(tokens, device=device)
            counts[i].index_add_(0, ids, torch.ones(len(tokens), device=device))
    return counts


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask all but each row's top-k and top-p tokens. top_k: [N, 1] int, top_p: [N, 1]."""
    vocab = logits.shape[1]
    k = torch.where(top_k <= 0, vocab, top_k.clamp(max=vocab))  # [N, 1]
    # Stable descending sort: among equal logits the lower token id comes first.
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # [N, V]
    rank = torch.arange(vocab, device=logits.device)[None, :]  # [1, V]
    drop = rank >= k
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of strictly better tokens
    # rank 0 always survives; top_p == 1 is exempt since the cumsum may round up to 1.0
    drop |= (mass_before >= top_p) & (rank > 0) & (top_p < 1.0)
    return logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))

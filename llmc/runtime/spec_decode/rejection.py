"""The lossless verify step of speculative decoding: keep a prefix of the draft, then one more token.

The algorithm of Leviathan et al. 2023 and Chen et al. 2023, as in gpt-fast's `speculative_decode`.
The target's k + 1 rows go through the engine's own sampling transforms (`Sampler.process`), giving
p_0..p_k. Draft token x_j, drawn from q_j, is accepted with probability min(1, p_j(x_j) / q_j(x_j));
at the first rejection the token is drawn from norm(max(0, p_j - q_j)) instead and the step ends;
if all k are accepted a bonus token is drawn from p_k. Each emitted token is then distributed exactly
as if the target had been sampled one token at a time. A deterministic proposer has q one-hot at its
token, so a draft token is accepted with probability p_j(x_j) and a rejection draws from p_j without it.
Greedy requests accept while the draft equals the argmax, and so emit what greedy decoding would.

Row j's penalties see the sequence as if draft[:j] had been appended (one `_RowView` per row), so the
repetition / presence / frequency penalties too are those of decoding one token at a time.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from llmc.runtime.sampler import Sampler, draw, plain_greedy, top_of
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.sequence import Sequence


def verify(logits: torch.Tensor, seq: Sequence, draft: list[int], q: torch.Tensor | None,
           sampler: Sampler) -> tuple[list[int], list[float], list[dict[int, float]] | None]:
    """The tokens the target keeps of one sequence's draft, and one more.

    Args:
        logits: fp32 [k + 1, V], the target's raw logits at the k + 1 fed positions of `seq`: row j
            predicts the token after the j-th fed token (row 0 follows seq's last token, row j follows
            draft[j - 1]).
        seq: the sequence, without the draft appended (it is not modified; its generator is advanced).
        draft: the k proposed tokens (k may be 0).
        q: [k, V], the distributions the draft tokens were drawn from (after the same sampling
            transforms), or None for a deterministic proposer (q one-hot at each draft token).
        sampler: the engine's sampler, whose `process` gives the target distributions.

    Returns:
        (tokens, logprobs, top): the accepted draft prefix and then one more token (1..k + 1 tokens), the
        log-probability of each under the processed target row that chose it, as `Sampler` reports it
        (0.0 for a plain greedy request that asked for no logprobs), and, when the request asks for
        alternatives (`SamplingParams.logprobs` = k > 0), each token's k most likely ones from that same
        row (else None): what decoding one token at a time would report.

    Example:
        >>> seq = Sequence("r", [1, 2], SamplingParams(temperature=0.0))
        >>> logits = torch.zeros(3, 8); logits[0, 5] = logits[1, 6] = logits[2, 7] = 1.0
        >>> verify(logits, seq, [5, 4], None, Sampler())[0]  # 5 accepted, 4 rejected for 6
        [5, 6]
    """
    k = len(draft)
    assert logits.dim() == 2 and logits.shape[0] == k + 1, (tuple(logits.shape), k)
    assert q is None or tuple(q.shape) == (k, logits.shape[1]), (tuple(q.shape), tuple(logits.shape))
    params = seq.params
    if plain_greedy(params):
        # as the Sampler's greedy path: no transform changes an argmax, logprobs are of the raw rows
        logits = logits.float()
    else:
        logits = sampler.process(logits, row_views(seq, draft))  # [k + 1, V]
    if params.greedy:
        tokens = accept_greedy(draft, logits.argmax(dim=-1).tolist())  # first maximum = lowest id on ties
    else:
        tokens = _rejection_sample(torch.softmax(logits, dim=-1), draft, q, seq.generator)
    if plain_greedy(params) and params.num_logprobs is None:
        return tokens, [0.0] * len(tokens), None
    rows = torch.log_softmax(logits[:len(tokens)], dim=-1)  # [n + 1, V]
    chosen = torch.tensor(tokens, device=rows.device)
    return tokens, rows.gather(1, chosen[:, None])[:, 0].tolist(), top_of(rows, [seq] * len(tokens))


@dataclass
class _RowView:
    """What `Sampler.process` reads of a sequence, as of one verified row (draft[:j] appended)."""

    params: SamplingParams
    token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None


def accept_greedy(draft: list[int], target: list[int]) -> list[int]:
    """The draft's tokens while they equal the target rows' choices, then the choice of the first row that
    differs (or of row k): what greedy decoding emits token by token."""
    n = next((j for j in range(len(draft)) if draft[j] != target[j]), len(draft))
    return target[:n + 1]


def row_views(seq: Sequence, draft: list[int]) -> list:
    """What `Sampler.process` should see for each of the k + 1 rows: `seq` with draft[:j] appended."""
    p = seq.params
    done = len(seq.output_token_ids)
    alike = done >= p.min_tokens or done + len(draft) < p.min_tokens  # min_tokens holds every row or none
    if alike and not p.reads_tokens:
        return [seq] * (len(draft) + 1)  # `process` then treats every row alike
    return [_RowView(p, seq.token_ids + draft[:j], seq.output_token_ids + draft[:j], seq.generator)
            for j in range(len(draft) + 1)]


def _rejection_sample(p: torch.Tensor, draft: list[int], q: torch.Tensor | None,
                      generator: torch.Generator | None) -> list[int]:
    """Accept draft[j] with probability min(1, p_j/q_j) up to the first rejection, then draw one more."""
    # p: [k + 1, V] target probabilities; q: [k, V] or None
    k = len(draft)
    x = torch.tensor(draft, dtype=torch.long, device=p.device)[:, None]  # [k, 1]
    p_x = p[:k].gather(1, x)[:, 0]  # [k]
    q_x = torch.ones_like(p_x) if q is None else q.float().gather(1, x)[:, 0]
    accept = _accept_probs(p_x, q_x).cpu()  # [k]
    # uniforms on the CPU, from the request's generator when it has a seed; always k of them, so a
    # seeded request consumes the same randomness whatever the outcome
    u = torch.rand(k, generator=generator)
    rejected = (u >= accept).nonzero()
    if len(rejected) == 0:
        return list(draft) + [draw(p[k], generator)]
    n = int(rejected[0, 0])
    if q is None:
        q_row = torch.zeros_like(p[n])
        q_row[draft[n]] = 1.0
    else:
        q_row = q[n].float()
    return list(draft[:n]) + [draw(_residual(p[n], q_row), generator)]


def _accept_probs(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """min(1, p/q) per draft token; p = 0 (filtered by the target) always rejects, q = 0 with p > 0 accepts."""
    return torch.where(p_x > 0, (p_x / q_x).clamp(max=1.0), 0.0)


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Unnormalised max(0, p - q); p itself where that is all zero (p == q up to the draft's rounding)."""
    r = (p - q).clamp(min=0.0)  # [V]
    return r if bool(r.sum() > 0) else p


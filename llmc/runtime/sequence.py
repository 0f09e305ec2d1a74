"""State of one generated sequence and of the request (group) that owns it.

A `Sequence` is plain data: the scheduler moves it between queues, the block manager fills its
`block_table`, the sampler reads its tokens and generator, the stop checker fills its text. Keeping
it free of behaviour means every component can be unit-tested with hand-built sequences.

A request with `n > 1` is a `SequenceGroup` of n sequences. Only the first (the leader) is
prefilled; when its last prompt chunk is sampled the scheduler forks the others off it, so they
share the prompt's KV blocks and diverge by copy-on-write (see `BlockManager.fork`).
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

from llmc.runtime.sampling_params import SamplingParams

TEXT_WINDOW = 5  # tokens decoded again before the newest, so that a multi-token character settles (stop.py)


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    SWAPPED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in (
            SequenceStatus.FINISHED_STOPPED,
            SequenceStatus.FINISHED_LENGTH,
            SequenceStatus.FINISHED_ABORTED,
        )

    @staticmethod
    def for_reason(reason: str) -> SequenceStatus:
        """Map an OpenAI finish_reason ("stop", "length", "abort") to a finished status."""
        return {
            "stop": SequenceStatus.FINISHED_STOPPED,
            "length": SequenceStatus.FINISHED_LENGTH,
            "abort": SequenceStatus.FINISHED_ABORTED,
        }[reason]


_seq_ids = itertools.count()


@dataclass
class PromptLogprobs:
    """A request's prompt log-probabilities, gathered chunk by chunk as its prompt is computed.

    Entry i is of prompt token i + 1 given the tokens before it (the first token has nothing to be
    predicted from); with `num_top > 0`, `top[i]` holds that position's `num_top` most likely tokens.
    One object per request: the samples of an n > 1 request share their leader's prompt.
    """

    num_top: int
    logprobs: list[float] = field(default_factory=list)
    top: list[dict[int, float]] = field(default_factory=list)


class Sequence:
    """One token stream: a prompt plus the tokens generated for it so far.

    `num_computed_tokens` counts the leading tokens whose K/V are in the cache. In decode it is
    `num_tokens - 1` (the last sampled token is fed in next step); after a recompute preemption
    it is 0 and the whole prompt+output is prefilled again.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seed: int | None = None,
        prompt_logprobs: PromptLogprobs | None = None,
    ) -> None:
        self.seq_id: int = next(_seq_ids)
        self.request_id = request_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        # each token just the row's argmax, no logprob asked (Sampler.argmax_only): fixed with the params
        self.argmax_only = params.plain_greedy and params.num_logprobs is None
        self.priority: int = params.priority
        self.arrival: int = 0  # global admission order, set by Scheduler.add
        self.arrival_step: int = 0  # scheduler step at arrival, for aging
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # the stop token or string that ended it
        self.num_computed_tokens: int = 0
        self.num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
        # only ever appended to in place: any other change (copy on write, a trim, a swap, freeing) assigns a
        # new list, so a holder of the list knows an unchanged prefix by identity (the decode graphs' inputs)
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of full blocks; BlockManager's cache
        self.num_marked_blocks: int = 0  # leading full blocks already offered to the prefix cache
        self.spec_token_ids: list[int] = []  # speculated continuation to verify in the next step
        self.ends_in_flight: bool = False  # its last token is still on the device and ends it (length)
        self._tokens: list[int] = list(self.prompt_token_ids)  # prompt + output, appended in place
        self.output_logprobs: list[float] = []
        self.output_top_logprobs: list[dict[int, float]] = []  # per output token, when alternatives are asked
        self.prompt_logprobs = prompt_logprobs  # its request's, from SequenceGroup; None: not asked for
        # Incremental detokenization state (see stop.py): text of the output, and the token
        # window offsets that let a tokenizer's multi-token characters settle before we emit them.
        self.output_text: str = ""
        self.read_offset: int = len(self.prompt_token_ids)
        self.prefix_offset: int = max(self.read_offset - TEXT_WINDOW, 0)
        self.generator: torch.Generator | None = None
        if seed is not None:
            self.generator = torch.Generator(device="cpu")
            self.generator.manual_seed(seed)

    @property
    def token_ids(self) -> list[int]:
        """Prompt and output tokens: one list kept up to date (read it, never modify it)."""
        return self._tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    def __len__(self) -> int:
        return self.num_tokens

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """True while more than the last sampled token lacks K/V (fresh prompt or recompute)."""
        return len(self._tokens) - self.num_computed_tokens > 1 or not self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def scores_prompt(self) -> bool:
        """Whether prompt log-probabilities are asked for and some are not computed yet."""
        pl = self.prompt_logprobs
        return pl is not None and len(pl.logprobs) < self.num_prompt_tokens - 1

    def token_at(self, pos: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[pos] if pos < n else self.output_token_ids[pos - n]

    def append_token(self, token_id: int, logprob: float | None = None, top: dict[int, float] | None = None) -> None:
        self.output_token_ids.append(int(token_id))
        self._tokens.append(int(token_id))
        if logprob is not None:
            self.output_logprobs.append(float(logprob))
        if top is not None:
            self.output_top_logprobs.append(top)

    def set_token(self, pos: int, token_id: int) -> None:
        """Write the value of the output token at `pos`, appended before it was known (overlapped steps)."""
        self._tokens[pos] = token_id
        self.output_token_ids[pos - self.num_prompt_tokens] = token_id

    def truncate(self, num_tokens: int) -> None:
        """Keep the first `num_tokens` tokens (never fewer than the prompt): output past them is dropped,
        and so are K/V past the new last token (which is fed again). The text is the caller's to redo."""
        assert self.num_prompt_tokens <= num_tokens <= self.num_tokens
        drop = self.num_tokens - num_tokens
        if drop:
            del self.output_token_ids[len(self.output_token_ids) - drop:]
            del self._tokens[num_tokens:]
            del self.output_logprobs[min(len(self.output_logprobs), self.num_output_tokens):]
            del self.output_top_logprobs[min(len(self.output_top_logprobs), self.num_output_tokens):]
        self.num_computed_tokens = min(self.num_computed_tokens, num_tokens - 1)
        self.read_offset = min(self.read_offset, num_tokens)
        self.prefix_offset = min(self.prefix_offset, max(self.read_offset - TEXT_WINDOW, 0))

    def set_text(self, text: str) -> None:
        """`text` is the output's text of every token so far: incremental detokenizing goes on after them."""
        self.output_text = text
        self.read_offset = self.num_tokens
        self.prefix_offset = max(self.read_offset - TEXT_WINDOW, 0)

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, req={self.request_id!r}, {self.status.name}, "
            f"tokens={self.num_prompt_tokens}+{self.num_output_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table})"
        )


class SequenceGroup:
    """The n sequences of one request; `seqs[0]` is the leader that prefills the prompt.

    Args:
        request_id: unique id of the request (used by `Scheduler.abort`).
        prompt_token_ids: the tokenized prompt.
        params: the request's sampling parameters; with a seed, sample i is seeded `seed + i`.

    Example:
        >>> g = SequenceGroup("r0", [1, 2, 3], SamplingParams(n=2, seed=7))
        >>> [s.num_tokens for s in g.seqs]
        [3, 3]
    """

    def __init__(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        self.request_id = request_id
        self.params = params
        self.prompt_token_ids = list(prompt_token_ids)
        # one prompt, scored once: every sample shares the object its leader fills
        self.prompt_logprobs = None if params.prompt_logprobs is None else PromptLogprobs(params.prompt_logprobs)
        self.seqs: list[Sequence] = [
            Sequence(
                request_id,
                prompt_token_ids,
                params,
                seed=None if params.seed is None else params.seed + i,
                prompt_logprobs=self.prompt_logprobs,
            )
            for i in range(params.n)
        ]
        self.forked: bool = params.n == 1  # True once the siblings share the leader's blocks

    @property
    def leader(self) -> Sequence:
        return self.seqs[0]

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def pending_forks(self, seq: Sequence) -> list[Sequence]:
        """Siblings that will be forked off `seq` when its prompt is sampled (empty if none)."""
        if self.forked or seq is not self.leader:
            return []
        return [s for s in self.seqs[1:] if not s.is_finished]

"""When a sequence is done: stop tokens, stop strings, max_tokens and the model's context length.

Stop strings are matched on text, not tokens, because a string like "\\n\\n" can be split across
tokens in many ways. The text is decoded incrementally (the vLLM / HF streamer scheme): each step
decodes a small window of tokens ending at the new one and emits only the text that extends the
previous window, and holds back text ending in U+FFFD, which means a multi-byte character is still
incomplete. The window starts a few tokens back so that tokenizers which drop a leading space on
the first token of a decode call still produce the right delta.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from llmc.runtime.sequence import Sequence

Decode = Callable[[list[int]], str]


def detokenize_incrementally(seq: Sequence, decode: Decode) -> str:
    """Append the text of the newest token(s) to `seq.output_text`; returns the new text."""
    return _extend_text(seq, decode, seq.num_tokens, step_back=False)


def settle_text(seq: Sequence, decode: Decode, end: int) -> None:
    """Append the text of tokens `seq.read_offset` to `end` to `seq.output_text` in one decode: the text that
    `detokenize_incrementally`, called token by token, would have appended. Where the newest tokens end
    mid-character their text waits, as it would there: the window steps back past them."""
    _extend_text(seq, decode, end, step_back=True)


def _extend_text(seq: Sequence, decode: Decode, end: int, step_back: bool) -> str:
    """The text tokens `seq.read_offset` to `end` add to the window that starts at `seq.prefix_offset`, appended
    and returned; nothing while it ends in an incomplete character (with `step_back`, the longest shorter run
    that does not is taken)."""
    if end <= seq.read_offset:
        return ""
    tokens = seq.token_ids
    prefix_text = decode(tokens[seq.prefix_offset : seq.read_offset])
    new_text = decode(tokens[seq.prefix_offset : end])
    while step_back and new_text.endswith("\ufffd") and end - 1 > seq.read_offset:
        end -= 1
        new_text = decode(tokens[seq.prefix_offset : end])
    if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
        return ""  # an incomplete character: wait for the next token
    delta = new_text[len(prefix_text) :]
    seq.prefix_offset, seq.read_offset = seq.read_offset, end
    seq.output_text += delta
    return delta


class StopChecker:
    """Decides whether a sequence has finished after a token was appended to it.

    Args:
        max_model_len: the model's context length; a sequence whose length reaches it has no
            room for the next token's K/V and finishes with "length".
        eos_token_id: the end-of-sequence id (or ids: some models have several); None if none.
        decode: token ids -> text, needed for stop strings and `output_text`; None skips text.

    Example:
        >>> checker = StopChecker(max_model_len=2048, eos_token_id=2)
        >>> reason = checker(seq)  # None, "stop" or "length"; also sets seq.stop_reason
    """

    def __init__(
        self,
        max_model_len: int,
        eos_token_id: int | Iterable[int] | None = None,
        decode: Decode | None = None,
    ) -> None:
        self.max_model_len = max_model_len
        if eos_token_id is None:
            self.eos_ids: frozenset[int] = frozenset()
        elif isinstance(eos_token_id, int):
            self.eos_ids = frozenset((eos_token_id,))
        else:
            self.eos_ids = frozenset(eos_token_id)
        self.decode = decode

    def __call__(self, seq: Sequence) -> str | None:
        """Return the finish reason ("stop" / "length") for `seq`, or None to keep going."""
        params = seq.params
        token = seq.last_token_id
        # Stop tokens end the sequence before their text is decoded: they are control tokens.
        if (not params.ignore_eos and token in self.eos_ids) or token in params.stop_token_ids:
            seq.stop_reason = token
            return "stop"
        if self.decode is not None and params.stop_strings:
            # only stop strings need the text at every token; others' is decoded when an output asks (`settle`)
            delta = detokenize_incrementally(seq, self.decode)
            stop = _find_stop_string(seq.output_text, len(delta), params.stop_strings)
            if stop is not None:
                index, string = stop
                seq.output_text = seq.output_text[:index]
                seq.stop_reason = string
                return "stop"
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def settle(self, seq: Sequence) -> None:
        """Bring `seq.output_text` up to its last token (`settle_text`): an offline request's text is then
        decoded once, not token by token. A stop token that ended the sequence is not text. A sequence that has
        finished (not at a stop string) also gets the text of tokens that end mid-character, as the tokenizer
        decodes them (U+FFFD), so that its text is its tokens' whole text."""
        if self.decode is not None:
            end = seq.num_tokens - (1 if isinstance(seq.stop_reason, int) else 0)
            settle_text(seq, self.decode, end)
            if seq.is_finished and not isinstance(seq.stop_reason, str) and end > seq.read_offset:
                tokens = seq.token_ids
                before = len(self.decode(tokens[seq.prefix_offset : seq.read_offset]))
                seq.output_text += self.decode(tokens[seq.prefix_offset : end])[before:]
                seq.prefix_offset, seq.read_offset = seq.read_offset, end


def _find_stop_string(
    text: str, num_new_chars: int, stops: tuple[str, ...]
) -> tuple[int, str] | None:
    """Earliest stop string that ends inside the newly added text, as (start index, string)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        # Only a match overlapping the new characters is new; older text was checked before.
        begin = max(0, len(text) - num_new_chars - len(stop) + 1)
        index = text.find(stop, begin)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best

"""StopChecker: stop tokens, stop strings on incrementally decoded text, length limits."""

from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.sequence import Sequence
from llmc.runtime.stop import StopChecker, detokenize_incrementally, settle_text

VOCAB = ["<s>", "</s>", "a", "b", " ", "\n", "END", "x"]


def decode(ids):
    return "".join(VOCAB[i] for i in ids)


def run(tokens, prompt=(0,), max_model_len=100, eos=1, **params):
    """Check after each token; the text then settled, as the engine does before an output reads it."""
    s = Sequence("r", list(prompt), SamplingParams(**params))
    check = StopChecker(max_model_len, eos_token_id=eos, decode=decode)
    reason = None
    for t in tokens:
        s.append_token(t)
        reason = check(s)
        if reason:
            break
    check.settle(s)
    return s, reason


def test_eos_stops_unless_ignored():
    s, reason = run([2, 1, 3])
    assert reason == "stop" and s.output_token_ids == [2, 1] and s.stop_reason == 1
    assert s.output_text == "a"  # the eos token is not decoded into the text
    s, reason = run([2, 1, 3], ignore_eos=True)
    assert reason is None and s.output_text == "a</s>b"


def test_several_eos_ids_and_stop_token_ids():
    checker = StopChecker(100, eos_token_id=[1, 7])
    s = Sequence("r", [0], SamplingParams())
    s.append_token(7)
    assert checker(s) == "stop"
    s, reason = run([2, 3, 6, 2], stop_token_ids=[6])
    assert reason == "stop" and s.stop_reason == 6 and s.num_output_tokens == 3


def test_stop_string_truncates_text_and_can_span_tokens():
    s, reason = run([2, 5, 5, 3], stop=["\n\n"])
    assert reason == "stop" and s.output_text == "a" and s.stop_reason == "\n\n"
    s, reason = run([2, 3, 6, 2], stop="END")
    assert reason == "stop" and s.output_text == "ab"
    s, reason = run([2, 3, 4, 2], stop=["zz"])
    assert reason is None and s.output_text == "ab a"


def test_earliest_stop_string_wins():
    s, reason = run([2, 3, 2, 3], stop=["ba", "ab"])
    assert reason == "stop" and s.output_text == "" and s.stop_reason == "ab"


def test_stop_string_in_prompt_does_not_stop():
    s, reason = run([3], prompt=(2, 5, 5), stop=["\n\n"], max_tokens=5)
    assert reason is None and s.output_text == "b"


def test_max_tokens_and_max_model_len_give_length():
    s, reason = run([2, 2, 2, 2], max_tokens=3)
    assert reason == "length" and s.num_output_tokens == 3
    s, reason = run([2] * 10, prompt=(0, 0, 0), max_model_len=6, max_tokens=50)
    assert reason == "length" and s.num_tokens == 6


def test_incomplete_utf8_character_is_held_back():
    byte_vocab = {0: b"h", 1: "é".encode()[:1], 2: "é".encode()[1:], 3: b"!"}
    dec = lambda ids: b"".join(byte_vocab[i] for i in ids).decode("utf-8", errors="replace")
    s = Sequence("r", [0], SamplingParams())
    deltas = []
    for t in (1, 2, 3):
        s.append_token(t)
        deltas.append(detokenize_incrementally(s, dec))
    assert deltas == ["", "é", "!"] and s.output_text == "é!"


def test_without_decode_only_tokens_and_lengths_matter():
    check = StopChecker(100, eos_token_id=None)
    s = Sequence("r", [0], SamplingParams(stop=["a"], max_tokens=2))
    s.append_token(2)
    assert check(s) is None and s.output_text == ""
    s.append_token(2)
    assert check(s) == "length"


def test_text_waits_for_an_output_unless_stop_strings_need_it():
    """Without stop strings the checker decodes nothing: `settle` decodes every token since the last output
    at once. With them, each token's text is there as it is checked."""
    check = StopChecker(100, eos_token_id=1, decode=decode)
    s = Sequence("r", [0], SamplingParams())
    for t in (2, 3, 4):
        s.append_token(t)
        assert check(s) is None
    assert s.output_text == ""
    check.settle(s)
    assert s.output_text == "ab " and s.read_offset == 4
    s.append_token(1)
    assert check(s) == "stop"
    check.settle(s)
    assert s.output_text == "ab "  # the eos token that ended it is not text
    s = Sequence("r", [0], SamplingParams(stop=["zz"]))
    s.append_token(2)
    assert check(s) is None and s.output_text == "a"


def test_settled_text_equals_token_by_token_text():
    """One decode of many tokens gives the text that token-by-token decoding gives, also where characters
    span tokens, stay incomplete at the end, or never complete (random byte tokens, settled at random
    points)."""
    import random
    pieces = {0: b"h", 1: "\u00e9".encode()[:1], 2: "\u00e9".encode()[1:], 3: b"!", 4: "\u20ac".encode()[:2],
              5: "\u20ac".encode()[2:], 6: b" ", 7: b"\xff"}
    dec = lambda ids: b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")  # noqa: E731
    rng = random.Random(0)
    for _ in range(300):
        prompt = [rng.randrange(8) for _ in range(rng.randrange(1, 8))]
        out = [rng.randrange(8) for _ in range(rng.randrange(1, 12))]
        a, b = Sequence("r", prompt, SamplingParams()), Sequence("r", prompt, SamplingParams())
        for t in out:
            a.append_token(t)
            detokenize_incrementally(a, dec)
            b.append_token(t)
            if rng.random() < 0.3:
                settle_text(b, dec, b.num_tokens)
        settle_text(b, dec, b.num_tokens)
        assert b.output_text == a.output_text, (prompt, out)


def test_a_finished_sequence_keeps_the_text_of_a_character_cut_off_at_its_end():
    """While running, a trailing incomplete character waits; once the sequence has finished (length, a stop
    token) its text is the tokenizer's decode of all its tokens, U+FFFD included. A stop string's cut stays."""
    from llmc.runtime.sequence import SequenceStatus
    pieces = {0: b"h", 1: "\u20ac".encode()[:1], 2: "\u20ac".encode()[1:], 3: b"!", 9: b"</s>"}
    dec = lambda ids: b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")  # noqa: E731
    check = StopChecker(100, eos_token_id=9, decode=dec)
    for tail, status, want in (([], SequenceStatus.FINISHED_LENGTH, "!\u20ac!\ufffd"),
                               ([9], SequenceStatus.FINISHED_STOPPED, "!\u20ac!\ufffd")):
        s = Sequence("r", [0], SamplingParams())
        for t in (3, 1, 2, 3, 1, *tail):
            s.append_token(t)
            check(s)
        check.settle(s)
        assert s.output_text == "!\u20ac!"  # running: the cut character waits
        s.status = status
        check.settle(s)
        assert s.output_text == want and s.output_text == dec(s.output_token_ids[:5])
        check.settle(s)
        assert s.output_text == want  # once

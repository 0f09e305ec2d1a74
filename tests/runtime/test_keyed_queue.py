"""KeyedQueue against a plain list sorted by key: order, membership, the weights' total and the largest top, under
random joins and leaves."""
import random

import pytest

from llmc.runtime.keyed_queue import KeyedQueue
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.sequence import Sequence


@pytest.mark.parametrize("seed", range(5))
def test_random_joins_and_leaves_match_a_sorted_list(seed):
    rng = random.Random(seed)
    seqs = [Sequence(f"r{i}", [1] * rng.randint(1, 9), SamplingParams(max_tokens=rng.randint(1, 50)))
            for i in range(300)]
    prio = {s.seq_id: rng.randint(0, 3) for s in seqs}

    def key(s):
        return prio[s.seq_id], s.seq_id
    q = KeyedQueue(key, weight=lambda s: s.num_prompt_tokens, top=lambda s: s.params.max_tokens)
    model: list[Sequence] = []
    for _ in range(2000):
        outside = [s for s in seqs if s not in q]
        if outside and (not model or rng.random() < 0.55):
            s = rng.choice(outside)
            q.add(s)
            model.append(s)
        else:
            s = rng.choice(model)
            (q.remove if rng.random() < 0.5 else q.discard)(s)
            model.remove(s)
        want = sorted(model, key=key)
        assert list(q) == want and len(q) == len(want) and list(reversed(q)) == want[::-1]
        assert q.total == sum(s.num_prompt_tokens for s in want)
        assert q.top(-1) == max((s.params.max_tokens for s in want), default=-1)
        if want:
            i = rng.randrange(len(want))
            assert q[i] is want[i] and q.key(want[i]) == key(want[i]) and want[i] in q
    stranger = next(s for s in seqs if s not in q)
    before = list(q)
    q.discard(stranger)  # a non-member: nothing changes
    assert list(q) == before and stranger not in q

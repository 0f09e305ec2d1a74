"""The scheduler's queues (waiting, running, swapped): sequences kept in order of a fixed key."""
from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections.abc import Callable, Iterator

from llmc.runtime.sequence import Sequence


class KeyedQueue:
    """Sequences in increasing order of `key(seq)`, computed once, when the sequence joins.

    The scheduler's key is fixed at arrival (see scheduler.py), so the order never needs sorting
    again: joining and leaving cost O(log n) key comparisons (bisect), membership is a dict lookup,
    and the head, the tail and the i-th member are list reads. No operation visits every member, so
    a step's host work does not grow with the number of waiting requests. (Inserting into or
    deleting from the middle of a Python list moves the pointers behind it with one memmove: about a
    microsecond at 10^4 members.)

    Example:
        >>> from llmc.runtime.sampling_params import SamplingParams
        >>> a, b = Sequence("a", [1], SamplingParams()), Sequence("b", [2], SamplingParams())
        >>> q = KeyedQueue(lambda s: (s.request_id,))
        >>> q.add(b); q.add(a)
        >>> [s.request_id for s in q], a in q, q.key(b)
        (['a', 'b'], True, ('b',))
    """

    def __init__(self, key: Callable[[Sequence], tuple], weight: Callable[[Sequence], int] | None = None,
                 top: Callable[[Sequence], int] | None = None) -> None:
        self._key_fn = key
        self._keys: list[tuple] = []  # sorted; _seqs[i] has key _keys[i]
        self._seqs: list[Sequence] = []
        self._key_of: dict[int, tuple] = {}  # seq_id -> its key, for removal and membership
        self._weight_fn = weight
        self._weight_of: dict[int, int] = {}  # seq_id -> its weight when it joined
        self.total = 0  # the members' weights (`weight(seq)` as each joined), summed as they join and leave
        self._top_fn = top
        self._tops: list[int] = []  # sorted: `top(seq)` of every member as it joined (`top()`: the largest)
        self._top_of: dict[int, int] = {}

    def add(self, seq: Sequence) -> None:
        assert seq.seq_id not in self._key_of, f"{seq} is queued already"
        k = self._key_of[seq.seq_id] = self._key_fn(seq)
        i = bisect_right(self._keys, k)
        self._keys.insert(i, k)
        self._seqs.insert(i, seq)
        if self._weight_fn is not None:
            w = self._weight_of[seq.seq_id] = self._weight_fn(seq)
            self.total += w
        if self._top_fn is not None:
            t = self._top_of[seq.seq_id] = self._top_fn(seq)
            insort(self._tops, t)

    def remove(self, seq: Sequence) -> None:
        i = bisect_left(self._keys, self._key_of.pop(seq.seq_id))
        assert self._seqs[i] is seq, "keys must be unique and never change while queued"
        del self._keys[i], self._seqs[i]
        self.total -= self._weight_of.pop(seq.seq_id, 0)
        if self._top_fn is not None:
            del self._tops[bisect_left(self._tops, self._top_of.pop(seq.seq_id))]

    def top(self, default: int = 0) -> int:
        """The largest `top(seq)` among the members (as each joined), or `default` when empty."""
        return self._tops[-1] if self._tops else default

    def discard(self, seq: Sequence) -> None:
        if seq.seq_id in self._key_of:
            self.remove(seq)

    def key(self, seq: Sequence) -> tuple:
        """The key `seq` was queued under."""
        return self._key_of[seq.seq_id]

    def __contains__(self, seq: Sequence) -> bool:
        return seq.seq_id in self._key_of

    def __len__(self) -> int:
        return len(self._seqs)

    def __getitem__(self, i):
        return self._seqs[i]

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._seqs)

    def __reversed__(self) -> Iterator[Sequence]:
        return reversed(self._seqs)

    def __repr__(self) -> str:
        return f"KeyedQueue({self._seqs!r})"

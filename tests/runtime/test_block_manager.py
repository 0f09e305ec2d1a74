"""BlockManager: slot mapping, prefix caching, eviction, fork/copy-on-write, swapping."""

from collections import Counter

import pytest

from llmc.runtime.block_manager import BlockManager, slot_for
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.sequence import Sequence


def make_seq(tokens):
    return Sequence("r", list(tokens), SamplingParams())


def computed(bm, seq):
    """What the engine does after a step that computed every token of `seq`."""
    seq.num_computed_tokens = seq.num_tokens
    bm.mark_computed(seq)


def check(bm, seqs):
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
    refs = Counter(b for s in seqs for b in s.block_table)
    for b in range(bm.num_blocks):
        assert bm.ref_count(b) == refs.get(b, 0)
        assert bm.is_free(b) == (bm.ref_count(b) == 0)


def test_slot_mapping_follows_block_table():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = make_seq(range(6))
    bm.allocate(s)
    assert len(s.block_table) == 2 and s.num_computed_tokens == 0
    s.block_table = [5, 2]  # any table: the formula, not the allocation order, is under test
    assert bm.slot_mapping(s, 0, 6) == [20, 21, 22, 23, 8, 9]
    assert slot_for([5, 2], 5, 4) == 9


def test_prefix_hit_on_three_full_blocks():
    bm = BlockManager(num_blocks=16, block_size=4)
    prefix = list(range(100, 112))  # 3 full blocks
    a = make_seq(prefix + [1, 2])
    bm.allocate(a)
    assert bm.stats.prefix_cache_hit_tokens == 0
    computed(bm, a)
    b = make_seq(prefix + [7, 8, 9])
    bm.allocate(b)
    assert b.block_table[:3] == a.block_table[:3]
    assert b.block_table[3] != a.block_table[3]
    assert b.num_computed_tokens == 12 and b.num_cached_tokens == 12
    assert bm.stats.prefix_cache_hit_tokens == 12
    assert bm.stats.prefix_cache_queries == 2
    assert bm.stats.prefix_cache_query_tokens == 14 + 15
    assert [bm.ref_count(x) for x in b.block_table] == [2, 2, 2, 1]
    check(bm, [a, b])


def test_block_aligned_full_hit_still_recomputes_last_token():
    """A prompt that is entirely cached reuses all but the block holding its last token, since
    that token must run through the model to produce logits (and writing into a shared block
    is not allowed)."""
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq(range(12))
    bm.allocate(a)
    computed(bm, a)
    b = make_seq(range(12))
    bm.allocate(b)
    assert b.num_computed_tokens == 8 and b.num_computed_tokens < b.num_tokens
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    check(bm, [a, b])


def test_hash_is_chained_over_the_prefix():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq([1, 1, 1, 1, 2, 2, 2, 2, 0])
    bm.allocate(a)
    computed(bm, a)
    b = make_seq([3, 3, 3, 3, 2, 2, 2, 2, 0])  # same second block, different parent
    bm.allocate(b)
    assert b.num_computed_tokens == 0 and not set(a.block_table) & set(b.block_table)


def test_only_computed_blocks_are_registered():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq(range(10))
    bm.allocate(a)
    a.num_computed_tokens = 5  # one full block computed so far (chunked prefill)
    bm.mark_computed(a)
    b = make_seq(range(10))
    bm.allocate(b)
    assert b.num_computed_tokens == 4 and b.block_table[0] == a.block_table[0]


def test_freed_cached_blocks_stay_hittable_until_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_seq(range(9))  # 3 blocks, 2 full
    bm.allocate(a)
    computed(bm, a)
    a_blocks = list(a.block_table)
    bm.free(a)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 4
    assert bm.is_cached(a_blocks[0]) and bm.is_cached(a_blocks[1])
    b = make_seq(range(9))
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.block_table[:2] == a_blocks[:2] and b.num_computed_tokens == 8
    bm.free(b)
    # Needing every block evicts the cached ones; the tail block (freed first) goes first.
    c = make_seq([50] * 16)
    bm.allocate(c)
    assert bm.stats.evictions == 2
    assert not bm.is_cached(a_blocks[0]) and not bm.is_cached(a_blocks[1])
    d = make_seq(range(9))
    assert not bm.can_allocate(d)
    bm.free(c)
    bm.allocate(d)
    assert d.num_computed_tokens == 0
    check(bm, [d])


def test_lru_evicts_least_recently_freed_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = make_seq([1, 1, 9]), make_seq([2, 2, 9])  # one full (cacheable) block each
    for s in (a, b):
        bm.allocate(s)
        computed(bm, s)
    b_first = b.block_table[0]
    bm.free(a)
    bm.free(b)  # a's cached block is now older than b's
    big = make_seq([7, 7, 7, 7, 7])
    bm.allocate(big)  # 3 blocks: the 2 uncached ones + the oldest cached
    assert bm.stats.evictions == 1
    bm.free(big)
    assert bm._prefix_hits(make_seq([1, 1, 9])) == []
    c = make_seq([2, 2, 9])
    bm.allocate(c)
    assert c.block_table[0] == b_first and c.num_computed_tokens == 2


def test_can_allocate_counts_evictable_hits_as_used():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = make_seq([1, 2, 3, 4, 5])  # 3 blocks, 2 full
    bm.allocate(a)
    computed(bm, a)
    bm.free(a)
    b = make_seq([1, 2, 3, 4, 6])  # hits 2 evictable blocks, needs 1 fresh: all 3 in total
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert bm.num_free_blocks == 0 and bm.num_used_blocks == 3


def test_prefix_caching_can_be_disabled():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = make_seq(range(9))
    bm.allocate(a)
    computed(bm, a)
    b = make_seq(range(9))
    bm.allocate(b)
    assert b.num_computed_tokens == 0 and not set(a.block_table) & set(b.block_table)


def test_fork_shares_blocks_and_copy_on_write():
    bm = BlockManager(num_blocks=16, block_size=4)
    parent = make_seq(range(10))  # blocks: full, full, partial (2 of 4 slots)
    bm.allocate(parent)
    computed(bm, parent)
    parent.num_computed_tokens = 10
    children = [make_seq(range(10)) for _ in range(3)]
    for c in children:
        bm.fork(parent, c)
    family = [parent, *children]
    assert all(bm.ref_count(b) == 4 for b in parent.block_table)
    check(bm, family)
    last = parent.block_table[-1]
    copies = []
    for i, s in enumerate(family):
        s.append_token(100 + i)
        assert bm.can_append(s, 1)
        copies.append(bm.append_slots(s, 1))  # writes position 10, in the shared last block
    # The first three writers copy the shared block; the last one owns it alone by then.
    assert [len(c) for c in copies] == [1, 1, 1, 0]
    assert all(c[0][0] == last for c in copies[:3])
    assert len({s.block_table[-1] for s in family}) == 4
    assert family[-1].block_table[-1] == last and bm.ref_count(last) == 1
    assert all(bm.ref_count(b) == 4 for b in parent.block_table[:2])  # full blocks still shared
    assert bm.stats.cow_copies == 3
    check(bm, family)
    for s in family:
        bm.free(s)
    assert bm.num_used_blocks == 0


def test_a_table_changed_other_than_by_appending_is_a_new_list():
    """Sequence.block_table is only appended to in place: a copy on write and a trim assign a new list, and
    the list a holder kept is left as it was (the decode graphs rewrite a row by the list's identity)."""
    bm = BlockManager(num_blocks=16, block_size=4)
    parent = make_seq(range(10))
    bm.allocate(parent)
    computed(bm, parent)
    child = make_seq(range(10))
    bm.fork(parent, child)
    held, before = child.block_table, list(child.block_table)
    child.append_token(1)
    assert bm.append_slots(child, 1)  # a copy of the shared last block
    assert child.block_table is not held and held == before and child.block_table[-1] != before[-1]
    held = parent.block_table
    parent.append_token(2)
    bm.append_slots(parent, 7)  # into the last block (its own by now) and two new ones: in place
    assert parent.block_table is held and len(held) == 5
    parent.num_computed_tokens = 11
    bm.trim(parent)  # the blocks past its computed tokens go: a new, shorter list
    assert parent.block_table is not held and len(held) == 5 and parent.block_table == held[:3]
    check(bm, [parent, child])


def test_append_into_new_block_needs_no_copy():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = make_seq(range(8))  # exactly two full blocks
    bm.allocate(parent)
    computed(bm, parent)
    child = make_seq(range(8))
    bm.fork(parent, child)
    child.append_token(1)
    assert bm.append_slots(child, 1) == []
    assert len(child.block_table) == 3 and bm.ref_count(child.block_table[2]) == 1


def test_can_append_fails_when_cache_is_full():
    bm = BlockManager(num_blocks=2, block_size=4)
    s = make_seq(range(8))
    bm.allocate(s)
    computed(bm, s)
    s.num_computed_tokens = 8
    assert not bm.can_append(s, 1)
    assert bm.can_append(s, 0)


def test_swap_out_and_in_round_trip():
    bm = BlockManager(num_blocks=4, block_size=4, num_cpu_blocks=3)
    s = make_seq(range(10))
    bm.allocate(s)
    s.num_computed_tokens = 10
    gpu = list(s.block_table)
    assert bm.can_swap_out(s)
    out = bm.swap_out(s)
    assert list(out) == gpu and len(set(out.values())) == 3
    assert s.block_table == [] and bm.num_used_blocks == 0 and bm.num_free_cpu_blocks == 0
    assert bm.can_swap_in(s, 1) and not bm.can_swap_in(s, 7)  # 17 tokens would need 5 blocks
    back = bm.swap_in(s)
    assert list(back) == list(out.values()) and s.block_table == list(back.values())
    assert bm.num_free_cpu_blocks == 3 and bm.num_used_blocks == 3
    big = make_seq(range(16))
    bm.free(s)
    bm.allocate(big)
    assert not bm.can_swap_out(big)  # 4 blocks, 3 host blocks


def test_free_of_swapped_sequence_releases_host_blocks():
    bm = BlockManager(num_blocks=4, block_size=4, num_cpu_blocks=4)
    s = make_seq(range(5))
    bm.allocate(s)
    bm.swap_out(s)
    assert bm.num_free_cpu_blocks == 2
    bm.free(s)
    assert bm.num_free_cpu_blocks == 4 and bm.num_free_blocks == 4


def test_invalid_sizes():
    with pytest.raises(ValueError):
        BlockManager(num_blocks=0)


def test_blocks_filled_by_decoding_are_registered_once_each():
    """Decode steps fill blocks one token at a time: each block joins the prefix cache when it fills
    (a later request sharing prompt + output hits it), and is offered once, not at every step."""
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq([9, 8, 7, 6, 5])
    bm.allocate(a)
    computed(bm, a)
    offered = []
    real = bm._block_keys
    bm._block_keys = lambda seq, n, start=0: offered.extend(range(start, n)) or real(seq, n, start)
    for t in range(10):  # decode 10 tokens
        a.append_token(100 + t)
        bm.append_slots(a, 1)
        computed(bm, a)
    assert a.num_marked_blocks == 3 and sorted(offered) == [1, 2]  # block 0 was offered at prefill
    b = make_seq(a.token_ids[:12] + [1])
    bm.allocate(b)
    assert b.num_cached_tokens == 12 and b.block_table[:3] == a.block_table[:3]
    bm.free(a)
    assert a.num_marked_blocks == 0
    check(bm, [b])


def test_a_fresh_prompts_admission_check_hashes_one_block():
    """Checking whether a long fresh prompt fits looks its prefix up block by block and stops at the first
    miss: one block's key is made, not every block's (the scheduler checks each waiting prompt a step
    until it is admitted). Allocating it then registers every full block as in flight, and a second prompt
    with the same first blocks finds them."""
    bm = BlockManager(num_blocks=64, block_size=4)
    s = make_seq(range(100, 181))  # 20 full blocks and one token
    assert bm.can_allocate(s) and bm.can_allocate(s)
    assert len(s.block_hashes) == 1
    bm.allocate(s)
    assert len(s.block_hashes) == 20
    computed(bm, s)
    t = make_seq(list(range(100, 140)) + [7, 7, 7])
    assert bm.can_allocate(t)
    assert len(t.block_hashes) == 10  # its 10 full blocks before the last token: all hits
    bm.allocate(t)
    assert t.block_table[:10] == s.block_table[:10] and t.num_computed_tokens == 40
    check(bm, [s, t])

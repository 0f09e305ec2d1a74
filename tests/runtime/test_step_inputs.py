"""The executor's step inputs (`LocalExecutor.build_inputs`, vectorised over the step's tokens) against
a direct per-token construction from the paged graph's definitions (llmc/passes/paged_kv.py)."""
from __future__ import annotations

import random

import pytest
import torch

from llmc.errors import LLMCError
from llmc.runtime.block_manager import slot_for
from llmc.runtime.executor import LocalExecutor, StepInput


class _Inputs(LocalExecutor):
    def __init__(self, block_size: int):
        self.block_size, self.device = block_size, torch.device("cpu")

    @property
    def kv(self):
        return {}


def _direct(seqs, bs):
    ids, pos, qsl, lens, slots, rows = [], [], [0], [], [], []
    width = -(-max(len(s.block_table) for s in seqs) // 16) * 16  # zero-padded to a multiple of 16 columns
    tables = torch.zeros(len(seqs), width, dtype=torch.int32)
    for i, s in enumerate(seqs):
        n = len(s.token_ids)
        ids += s.token_ids
        pos += range(s.start_pos, s.start_pos + n)
        slots += [slot_for(s.block_table, p, bs) for p in range(s.start_pos, s.start_pos + n)]
        rows += range(qsl[-1] + n - s.num_logits, qsl[-1] + n)
        qsl.append(qsl[-1] + n)
        lens.append(s.start_pos + n)
        tables[i, :len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.int32)
    return {"input_ids": torch.tensor(ids), "positions": torch.tensor(pos),
            "query_start_loc": torch.tensor(qsl, dtype=torch.int32), "seq_lens": torch.tensor(lens, dtype=torch.int32),
            "block_tables": tables, "slot_mapping": torch.tensor(slots), "logits_indices": torch.tensor(rows)}


def test_inputs_equal_the_per_token_definition():
    rng, bs = random.Random(0), 16
    seqs, free = [], list(range(4000))
    rng.shuffle(free)  # tables of scattered blocks
    for kind in ["decode"] * 40 + ["chunk"] * 3 + ["verify"] * 5:
        start = rng.randint(0, 700)
        n = {"decode": 1, "chunk": rng.randint(2, 300), "verify": 4}[kind]
        need = (start + n + bs - 1) // bs + rng.randint(0, 3)  # some tables longer than the context
        table, free = free[:need], free[need:]
        k = {"decode": 1, "chunk": rng.choice([0, 1, 5]), "verify": 4}[kind]
        seqs.append(StepInput([rng.randrange(8000) for _ in range(n)], start, table, k, kind == "chunk"))
    got, want = _Inputs(bs).build_inputs(seqs), _direct(seqs, bs)
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name


def test_a_table_too_short_for_the_step_is_an_error():
    seqs = [StepInput([1], 0, [3]), StepInput([1, 2, 3], 14, [7])]  # positions 14..16 need 2 blocks of 16
    with pytest.raises(LLMCError, match="sequence 1: 17 tokens need more blocks"):
        _Inputs(16).build_inputs(seqs)


def test_inputs_over_steps_whose_tables_grow_change_move_and_narrow():
    """The kept block-table rows (step_graphs.TableRows) give each step exactly the definition's tables, zeros
    past every table, whatever the rows held before: lists grown in place, replaced (copy on write, a trim),
    moved to other rows, and steps narrower then wider than the last."""
    ex, bs = _Inputs(4), 4
    a, b, c = [3, 5], [11], list(range(100, 140))  # c: 40 blocks, wider than 16 columns

    def step(*seqs):
        batch = [StepInput([7] * n, pos, table, 1) for n, pos, table in seqs]
        got, want = ex.build_inputs(batch), _direct(batch, bs)
        for name in want:
            assert torch.equal(got[name], want[name]), (name, got[name], want[name])

    step((1, 5, a), (2, 0, b))
    step((1, 150, c), (1, 6, a))  # c's wide table in row 0, a moved to row 1
    a.append(8)  # grown in place
    step((1, 8, a), (1, 2, b))  # a back in row 0, narrower than c's row was: zeros past it
    step((1, 9, [3, 40, 8]), (1, 151, c), (3, 0, [60]))  # a new list for a (copy on write), c now in row 1
    c.append(140)
    step((1, 160, c), (1, 3, b[:1]))  # c grown and back in row 0; b's trimmed copy
    step((2, 4, [1, 2]))


def test_kept_table_rows_over_random_steps():
    """300 random steps over 12 sequences whose tables grow in place, are replaced by copies (copy on write, a
    trim), and move between rows as the batch changes its members, order and width: every step's inputs equal
    the definition's, zeros past every table."""
    rng, bs, ex = random.Random(1), 4, _Inputs(4)
    tables = [[rng.randrange(1, 500) for _ in range(rng.randint(1, 3))] for _ in range(12)]
    lengths = [len(t) * bs - rng.randrange(bs) for t in tables]  # tokens so far (the last block part full)
    for _ in range(300):
        for i in rng.sample(range(12), 3):
            r = rng.random()
            if r < 0.5:  # grows in place
                tables[i].append(rng.randrange(1, 500))
                lengths[i] = min(lengths[i] + bs, len(tables[i]) * bs)
            elif r < 0.75:  # a new list (copy on write)
                tables[i] = list(tables[i][:-1]) + [rng.randrange(1, 500)]
            elif len(tables[i]) > 1:  # trimmed: a shorter copy
                tables[i] = tables[i][:-1]
                lengths[i] = min(lengths[i], len(tables[i]) * bs)
        batch = []
        for i in rng.sample(range(12), rng.randint(1, 12)):  # members, order and count change every step
            n = 1 if rng.random() < 0.8 else rng.randint(1, min(3, lengths[i]))
            batch.append(StepInput([7] * n, lengths[i] - n, tables[i], 1))
        got, want = ex.build_inputs(batch), _direct(batch, bs)
        for name in want:
            assert torch.equal(got[name], want[name]), name

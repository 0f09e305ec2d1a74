"""A step as one int64 tensor, the payload of the driver's one broadcast per step.

    [op, length, flags (1: greedy, 2: chain, 4: launched), #seqs, #swap_out, #swap_in, #copies, #fed,
     per sequence: #tokens, start_pos, #blocks, num_logits, prefill, tokens..., blocks...,
     swap_out pairs..., swap_in pairs..., copy pairs..., fed (dst, src) pairs...]

A launched step (the engine's overlapped steps) returns its result once the next step is under way, or
on a FLUSH; its fed pairs say which of its input tokens are rows of the previous step's argmax
(`executor.Feed`), which every worker still holds on its device.

Plain integers, no pickle: a worker rebuilds the `StepBatch` the engine made.
"""
from __future__ import annotations

import torch

from llmc.runtime.executor import Feed, StepBatch, StepInput

STEP, STOP, RESIZE, FLUSH = 1, 2, 3, 4  # FLUSH: return the launched step's result now (no step follows it yet)
HEADER = 2  # op, payload length


def encode(batch: StepBatch, feed: Feed | None = None, launched: bool = False) -> list[int]:
    flags = int(batch.greedy) | int(batch.chain) << 1 | int(launched) << 2
    fed = list(zip(feed.dst, feed.src)) if feed is not None else []
    out = [flags, len(batch.seqs), len(batch.swap_out), len(batch.swap_in), len(batch.copies), len(fed)]
    for s in batch.seqs:
        out += [len(s.token_ids), s.start_pos, len(s.block_table), s.num_logits, int(s.prefill)]
        out += s.token_ids
        out += s.block_table
    for pairs in (batch.swap_out, batch.swap_in, batch.copies, fed):
        for a, b in pairs:
            out += [a, b]
    return out


def decode(payload: list[int]) -> tuple[StepBatch, list[tuple[int, int]], bool]:
    """(the batch, its fed (dst, src) pairs, whether it was launched)."""
    flags, n, n_out, n_in, n_copy, n_fed = payload[:6]
    at, seqs = 6, []
    for _ in range(n):
        nt, start, nb, num_logits, prefill = payload[at:at + 5]
        at += 5
        seqs.append(StepInput(payload[at:at + nt], start, payload[at + nt:at + nt + nb], num_logits, bool(prefill)))
        at += nt + nb
    pairs = []
    for count in (n_out, n_in, n_copy, n_fed):
        pairs.append([(payload[at + 2 * i], payload[at + 2 * i + 1]) for i in range(count)])
        at += 2 * count
    return StepBatch(seqs, *pairs[:3], greedy=bool(flags & 1), chain=bool(flags & 2)), pairs[3], bool(flags & 4)


def message(op: int, payload: list[int], capacity: int) -> torch.Tensor:
    """The broadcast buffer: header, payload, zeros up to the capacity both sides agreed on."""
    buf = torch.zeros(capacity, dtype=torch.int64)
    buf[:HEADER + len(payload)] = torch.tensor([op, len(payload), *payload], dtype=torch.int64)
    return buf

"""Paged KV-cache bookkeeping: which physical blocks each sequence owns. Pure CPU logic.

The device cache is `num_blocks` blocks of `block_size` token slots; the flat slot of token
position p of a sequence is `block_table[p // block_size] * block_size + p % block_size`.

Three mechanisms save memory and compute:
  * ref counts let sequences share blocks (`fork` for n>1 samples, prefix-cache hits); a write
    into a shared block first copies it (copy-on-write pairs returned by `append_slots`);
  * prefix caching: a FULL block whose K/V are computed is registered under the chained key
    `(parent_hash, tuple(its tokens))`; `allocate` reuses the longest registered prefix. A freed
    block that is registered stays in an LRU "evictable" set, still hittable, until its id is
    needed: free blocks are handed out first, evictable ones (least recently freed) after;
  * swapping: `swap_out` moves a sequence's blocks to a host pool of `num_cpu_blocks` blocks.

Invariant (tested by property tests): every block is either free (free list or evictable, ref 0)
or used (ref > 0, and ref == the number of block tables that hold it); never both.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass

from llmc.runtime.sequence import Sequence

_BlockKey = tuple[int, tuple[int, ...]]  # (parent chain hash, tokens of the block)


@dataclass
class BlockManagerStats:
    """Counters for logs and benchmarks; hit rate = hit_tokens / query_tokens."""

    prefix_cache_queries: int = 0  # allocate() lookups
    prefix_cache_query_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    evictions: int = 0
    cow_copies: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0


def slot_for(block_table: list[int], pos: int, block_size: int) -> int:
    """Flat cache slot of token position `pos` of a sequence with this block table."""
    return block_table[pos // block_size] * block_size + pos % block_size


class BlockManager:
    """Owns the block pools; the scheduler asks it for room, the model runner reads tables.

    Args:
        num_blocks: device KV-cache blocks.
        block_size: token slots per block.
        enable_prefix_caching: reuse registered full blocks across sequences.
        num_cpu_blocks: host blocks for swap preemption (0 disables swapping).

    Example:
        >>> bm = BlockManager(num_blocks=8, block_size=4)
        >>> s = Sequence("r", list(range(6)), SamplingParams())
        >>> bm.allocate(s); s.block_table, bm.slot_mapping(s, 4, 6)
        ([0, 1], [4, 5])
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        num_cpu_blocks: int = 0,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0 or num_cpu_blocks < 0:
            raise ValueError("num_blocks and block_size must be positive, num_cpu_blocks >= 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_cpu_blocks = num_cpu_blocks
        self._ref = [0] * num_blocks
        self._key: list[_BlockKey | None] = [None] * num_blocks  # registered prefix key
        self._free: deque[int] = deque(range(num_blocks))  # ref 0, no cached content
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref 0, cached, LRU first
        self._cached: dict[_BlockKey, int] = {}  # key -> block holding those K/V
        # full prompt blocks allocated but not computed yet: a request admitted meanwhile with the same
        # prefix waits for them rather than computing the prefix a second time
        self._inflight: dict[_BlockKey, int] = {}
        self._inflight_key: list[_BlockKey | None] = [None] * num_blocks
        self._num_used = 0
        self._cpu_free: deque[int] = deque(range(num_cpu_blocks))
        self._swapped: dict[int, list[int]] = {}  # seq_id -> host block table
        self.stats = BlockManagerStats()

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (truly free + evictable cached)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self._num_used

    @property
    def num_free_cpu_blocks(self) -> int:
        return len(self._cpu_free)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def is_free(self, block: int) -> bool:
        return block in self._evictable or block in self._free

    def is_cached(self, block: int) -> bool:
        return self._key[block] is not None

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def slot_mapping(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Flat cache slots of positions [start, end) of `seq` (where the runner writes K/V)."""
        return [slot_for(seq.block_table, p, self.block_size) for p in range(start, end)]

    # ---- prefix hashing ------------------------------------------------------------------
    def _block_keys(self, seq: Sequence, num_full: int, start: int = 0) -> Iterator[_BlockKey]:
        """Keys of full blocks [start, num_full), made as they are asked for (a lookup that stops at its
        first miss makes no more: a fresh prompt's admission checks one block, not all of them); chain
        hashes are memoised on the seq (those of the blocks before `start` must be there already)."""
        bs = self.block_size
        parent = seq.block_hashes[start - 1] if start else -1
        tokens = seq.token_ids
        for i in range(start, num_full):
            key = (parent, tuple(tokens[i * bs : (i + 1) * bs]))
            if i == len(seq.block_hashes):
                seq.block_hashes.append(hash(key))
            parent = seq.block_hashes[i]
            yield key

    def _prefix_hits(self, seq: Sequence) -> list[int]:
        # a sequence still scoring its prompt (prompt_logprobs) computes every position: a hit would skip
        # the logits it needs (its blocks still join the cache once computed)
        if not self.enable_prefix_caching or seq.scores_prompt:
            return []
        # At most num_tokens - 1 tokens may hit: the last one must run to produce logits.
        hits = []
        for key in self._block_keys(seq, (seq.num_tokens - 1) // self.block_size):
            block = self._cached.get(key)
            if block is None:
                break
            hits.append(block)
        return hits

    # ---- allocation ----------------------------------------------------------------------
    def _take(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            del self._cached[self._key[block]]
            self._key[block] = None
            self.stats.evictions += 1
        self._ref[block] = 1
        self._num_used += 1
        return block

    def _share(self, block: int) -> None:
        if self._ref[block] == 0:
            del self._evictable[block]
            self._num_used += 1
        self._ref[block] += 1

    def _release(self, block: int) -> None:
        self._ref[block] -= 1
        assert self._ref[block] >= 0, f"block {block} released more often than taken"
        if self._ref[block] == 0:
            self._num_used -= 1
            self._landed(block)
            if self._key[block] is not None:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether `allocate(seq)` would succeed now (prefix hits on live blocks cost nothing)."""
        hits = self._prefix_hits(seq)
        fresh = self.blocks_for(seq.num_tokens) - len(hits)
        revived = sum(1 for b in hits if self._ref[b] == 0)  # evictable hits leave the free pool
        return fresh + revived <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Give `seq` blocks for all its tokens, reusing cached prefix blocks.

        Sets `seq.num_computed_tokens` to the number of cached tokens, which is always less
        than `seq.num_tokens` so that the last token is recomputed and yields logits.
        """
        assert not seq.block_table, f"{seq} already has blocks"
        hits = self._prefix_hits(seq)
        self.stats.prefix_cache_queries += 1
        self.stats.prefix_cache_query_tokens += seq.num_tokens
        self.stats.prefix_cache_hit_tokens += len(hits) * self.block_size
        for b in hits:
            self._share(b)
        fresh = [self._take() for _ in range(self.blocks_for(seq.num_tokens) - len(hits))]
        seq.block_table, seq.num_marked_blocks = hits + fresh, len(hits)
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size
        if self.enable_prefix_caching:
            full = seq.num_tokens // self.block_size
            for i, key in enumerate(self._block_keys(seq, full, len(hits)), len(hits)):
                if key not in self._cached and key not in self._inflight:
                    self._inflight[key] = seq.block_table[i]
                    self._inflight_key[seq.block_table[i]] = key

    def _landed(self, block: int) -> None:
        """The block's in-flight prefix is computed, or will never be: stop making others wait for it."""
        key = self._inflight_key[block]
        if key is not None:
            self._inflight_key[block] = None
            del self._inflight[key]

    def waits_for_prefix(self, seq: Sequence) -> bool:
        """Whether `seq`'s prompt continues its cached prefix with a block that an admitted sequence is
        computing now: admitted a step later, it shares that block instead of computing it again."""
        if not self._inflight or seq.scores_prompt:
            return False
        for key in self._block_keys(seq, (seq.num_tokens - 1) // self.block_size):
            if key not in self._cached:
                return key in self._inflight
        return False

    def _blocks_to_write(self, seq: Sequence, num_new_tokens: int) -> tuple[range, int]:
        """Indices of existing table entries the new tokens write into, and blocks to add."""
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new_tokens
        first = start // self.block_size
        last = min(self.blocks_for(end), len(seq.block_table))
        return range(first, last), max(0, self.blocks_for(end) - len(seq.block_table))

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether `append_slots(seq, num_new_tokens)` would find enough free blocks."""
        touched, new = self._blocks_to_write(seq, num_new_tokens)
        return self._fits(seq, touched, new)

    def _fits(self, seq: Sequence, touched: range, new: int) -> bool:
        cow = sum(1 for i in touched if self._ref[seq.block_table[i]] > 1)
        return new + cow <= self.num_free_blocks

    def try_append(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """`append_slots(seq, num_new_tokens)` where `can_append` holds, else None (nothing changed): the two
        in one pass over the blocks, as the scheduler does for each running sequence every step."""
        if num_new_tokens == 1:  # a decode: the common case, without the general pass's ranges
            i, table = seq.num_computed_tokens // self.block_size, seq.block_table
            if i < len(table) and self._ref[table[i]] == 1:
                return []  # its own block has room
            if i == len(table) and self.num_free_blocks:
                table.append(self._take())
                return []
        touched, new = self._blocks_to_write(seq, num_new_tokens)
        return self._append(seq, touched, new) if self._fits(seq, touched, new) else None

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Make positions [computed, computed + num_new_tokens) writable by `seq` alone.

        Returns:
            copy-on-write pairs `(src_block, dst_block)`: the runner copies src into dst
            before this step's forward, because dst replaced a block shared with others.
        """
        return self._append(seq, *self._blocks_to_write(seq, num_new_tokens))

    def _append(self, seq: Sequence, touched: range, new: int) -> list[tuple[int, int]]:
        copies = []
        for i in touched:
            src = seq.block_table[i]
            if self._ref[src] > 1:
                dst = self._take()
                self._release(src)
                if not copies:  # a new list, not one changed in place (Sequence.block_table)
                    seq.block_table = list(seq.block_table)
                seq.block_table[i] = dst
                copies.append((src, dst))
                # The copy diverges from the registered content, so the seq's chain hashes past
                # this point are still valid (tokens unchanged) but the block is unregistered.
        self.stats.cow_copies += len(copies)
        seq.block_table.extend(self._take() for _ in range(new))
        return copies

    def mark_computed(self, seq: Sequence) -> None:
        """Register the seq's full, computed blocks in the prefix cache (engine calls per step).

        Each block is offered once, when it fills: the work per step does not grow with the
        sequence. (A block not registered then, because another block held its content, is not
        offered again if that one is evicted later: a missed hit, never a wrong one.)
        """
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if num_full <= seq.num_marked_blocks:
            return
        start = min(seq.num_marked_blocks, len(seq.block_hashes))
        for i, key in enumerate(self._block_keys(seq, num_full, start), start):
            block = seq.block_table[i]
            self._landed(block)
            if key not in self._cached and self._key[block] is None:
                self._cached[key] = block
                self._key[block] = key
        seq.num_marked_blocks = num_full

    def trim(self, seq: Sequence) -> None:
        """Free the seq's blocks past its computed tokens (left by rejected speculated tokens)."""
        keep = self.blocks_for(seq.num_computed_tokens)
        if keep < len(seq.block_table):
            for b in reversed(seq.block_table[keep:]):
                self._release(b)
            seq.block_table = seq.block_table[:keep]  # a new list, not one cut in place (Sequence.block_table)

    def rollback(self, seq: Sequence) -> None:
        """After `seq.truncate`: free blocks past its computed tokens, forget the chain hashes of blocks
        no longer full, and unregister a block of its own that now holds dropped tokens (its next write
        would change a cached block's content; a shared one is copied on write anyway)."""
        self.trim(seq)
        full = seq.num_tokens // self.block_size
        del seq.block_hashes[full:]
        kept = min(seq.num_marked_blocks, seq.num_computed_tokens // self.block_size)
        for b in seq.block_table[kept:seq.num_marked_blocks]:
            if self._ref[b] == 1 and self._key[b] is not None:
                del self._cached[self._key[b]]
                self._key[b] = None
        seq.num_marked_blocks = kept

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let `child` share every block of `parent` (n>1 samples of one prompt)."""
        assert not child.block_table, f"{child} already has blocks"
        for b in parent.block_table:
            self._share(b)
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_marked_blocks = parent.num_marked_blocks
        child.num_computed_tokens = parent.num_computed_tokens

    def free(self, seq: Sequence) -> None:
        """Release the seq's device (or, if swapped, host) blocks. Tail blocks are freed first
        so that, in the LRU, they are evicted before the more widely shared head blocks."""
        for b in reversed(seq.block_table):
            self._release(b)
        seq.block_table, seq.num_marked_blocks = [], 0
        self._cpu_free.extend(self._swapped.pop(seq.seq_id, []))

    # ---- swapping ------------------------------------------------------------------------
    def can_swap_out(self, seq: Sequence) -> bool:
        return len(seq.block_table) <= len(self._cpu_free)

    def swap_out(self, seq: Sequence) -> dict[int, int]:
        """Move the seq's blocks to host blocks; returns {device_block: host_block} to copy.

        The runner must copy these before anything else this step: the device blocks are free
        again and may be handed out (as copy-on-write or prefill targets) in the same step.
        """
        assert self.can_swap_out(seq), "not enough host blocks"
        mapping = {}
        for b in seq.block_table:
            mapping[b] = self._cpu_free.popleft()
            self._release(b)
        self._swapped[seq.seq_id] = list(mapping.values())
        seq.block_table, seq.num_marked_blocks = [], 0
        self.stats.swapped_out_blocks += len(mapping)
        return mapping

    def can_swap_in(self, seq: Sequence, num_new_tokens: int = 0) -> bool:
        """Whether the seq's host blocks, plus room for `num_new_tokens` more, fit on device."""
        host = self._swapped[seq.seq_id]
        total = max(len(host), self.blocks_for(seq.num_computed_tokens + num_new_tokens))
        return total <= self.num_free_blocks

    def swap_in(self, seq: Sequence) -> dict[int, int]:
        """Bring a swapped seq back; returns {host_block: device_block} to copy."""
        host = self._swapped.pop(seq.seq_id)
        mapping = {h: self._take() for h in host}
        seq.block_table, seq.num_marked_blocks = list(mapping.values()), 0
        self._cpu_free.extend(host)
        self.stats.swapped_in_blocks += len(mapping)
        return mapping

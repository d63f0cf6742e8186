"""The paged KV cache's bookkeeping: which cache blocks belong to which sequence, and where each new token goes.

The cache itself (``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer) lives in the backend; this module
only hands out block ids. A sequence owns ``ceil(num_tokens / block_size)`` blocks, listed in order in its block
table; token ``t`` of the sequence lives in slot ``block_table[t // block_size] * block_size + t % block_size``.

Running out of blocks never corrupts state: ``reserve`` and ``admit`` either succeed for all requested tokens or
raise ``OutOfBlocks`` having changed nothing, so the scheduler can queue (or preempt) and try again later.

Prefix caching (as vLLM's automatic prefix caching): a full block whose K/V has been computed can be registered under
a key of its content, the tokens of the block and of every block before it (``block_keys``). A later sequence whose
prompt starts with the same full blocks takes those blocks into its table (shared, read-only: a sequence only writes
the slots of its own uncached tokens, which lie in later blocks) and skips their prefill. A registered block that no
sequence holds any more stays in the cache, *evictable*: it counts as free, and is reused for new tokens only when
no unregistered block is free, least recently released first.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np


class OutOfBlocks(RuntimeError):
    """Not enough free KV-cache blocks for a request; nothing was allocated."""


def block_keys(keys: list[bytes], token_ids: list[int], block_size: int, num_blocks: int,
               offset: int = 0) -> list[bytes]:
    """Extend ``keys`` (the keys of a sequence's first blocks) in place to the keys of its first ``num_blocks`` full
    blocks, stopping before a block holding a negative id (a token not known on the host yet). Key ``i`` is a digest
    of key ``i - 1`` and block ``i``'s tokens: equal keys mean equal tokens from the sequence's start (a 128-bit
    BLAKE2 digest, collision-free in practice: two prompts never share a key by chance). ``token_ids`` are the
    sequence's tokens from token ``offset`` on (a multiple of ``block_size``, no later than the first block to key),
    so that a caller keying a long sequence's newest block passes that block, not a copy of the whole sequence."""
    for i in range(len(keys), num_blocks):
        block = token_ids[i * block_size - offset:(i + 1) * block_size - offset]
        if len(block) < block_size or min(block) < 0:
            break
        h = hashlib.blake2b(keys[i - 1] if i else b"", digest_size=16)
        h.update(np.asarray(block, dtype=np.int64).tobytes())
        keys.append(h.digest())
    return keys


class BlockManager:
    """Allocates fixed-size KV-cache blocks to sequences (identified by any hashable id), sharing registered prefix
    blocks between them (see the module docstring)."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # LIFO free list of blocks holding nothing registered: a just-freed block is reused first, which keeps the
        # working set of the cache small.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[object, list[int]] = {}
        self._num_tokens: dict[object, int] = {}
        self._refs = [0] * num_blocks  # sequences whose table holds each block
        self._key_of: dict[int, bytes] = {}  # registered block -> its content key
        self._block_of: dict[bytes, int] = {}  # content key -> registered block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # registered blocks no sequence holds, oldest first

    # -- queries ---------------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks a reservation may take: unregistered free blocks and evictable registered ones."""
        return len(self._free) + len(self._evictable)

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._tables

    def num_tokens(self, seq_id) -> int:
        return self._num_tokens[seq_id]

    def block_table(self, seq_id) -> list[int]:
        return self._tables[seq_id]

    def blocks_needed(self, seq_id, num_new_tokens: int) -> int:
        """How many more blocks ``num_new_tokens`` more tokens of ``seq_id`` (new or existing) would take."""
        have = len(self._tables.get(seq_id, ()))
        total = self._num_tokens.get(seq_id, 0) + num_new_tokens
        return max(0, -(-total // self.block_size) - have)

    def slot(self, seq_id, position: int) -> int:
        """Cache slot of token ``position`` of ``seq_id``."""
        if not 0 <= position < self._num_tokens[seq_id]:
            raise IndexError(f"position {position} outside sequence {seq_id!r} of {self._num_tokens[seq_id]} tokens")
        return self._tables[seq_id][position // self.block_size] * self.block_size + position % self.block_size

    def cached_prefix(self, keys: list[bytes]) -> list[int]:
        """The registered blocks of the longest run of ``keys`` (a sequence's block keys, from its start)."""
        hits = []
        for key in keys:
            block = self._block_of.get(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def admit_cost(self, hits: list[int], num_tokens: int) -> int:
        """Free blocks that ``admit(..., hits, num_tokens)`` would use up: new blocks for the tokens past the hits,
        and the hits that sit evictable (they leave the free pool)."""
        new = -(-num_tokens // self.block_size) - len(hits)
        return new + sum(1 for b in hits if not self._refs[b])

    # -- updates ---------------------------------------------------------------------------------------------------
    def reserve(self, seq_id, num_new_tokens: int) -> None:
        """Make room for ``num_new_tokens`` more tokens of ``seq_id`` (creating it if new); ``slot`` gives their slots.

        Appending one decode token is ``reserve(seq_id, 1)``: a new block is taken only when the last one is full.
        Raises ``OutOfBlocks`` (state unchanged) when the free blocks do not suffice.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        need = self.blocks_needed(seq_id, num_new_tokens)
        self._check_free(seq_id, need)
        table = self._tables.setdefault(seq_id, [])
        start = self._num_tokens.get(seq_id, 0)
        for _ in range(need):
            table.append(self._take())
        self._num_tokens[seq_id] = start + num_new_tokens

    def admit(self, seq_id, hits: list[int], num_tokens: int) -> None:
        """Create ``seq_id`` with ``num_tokens`` tokens whose first blocks are the registered ``hits``
        (``cached_prefix``'s, fewer than the tokens fill: the caller feeds at least the last token); new blocks for
        the rest. Raises ``OutOfBlocks`` (state unchanged) when the free blocks do not suffice."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already holds blocks")
        if len(hits) * self.block_size >= num_tokens:
            raise ValueError(f"{len(hits)} cached blocks cover all {num_tokens} tokens; leave one token to feed")
        self._check_free(seq_id, self.admit_cost(hits, num_tokens))
        for b in hits:
            if not self._refs[b]:
                del self._evictable[b]
            self._refs[b] += 1
        self._tables[seq_id] = list(hits)
        self._num_tokens[seq_id] = len(hits) * self.block_size
        self.reserve(seq_id, num_tokens - len(hits) * self.block_size)

    def register(self, seq_id, keys: list[bytes], start: int = 0, stop: int | None = None) -> None:
        """Register blocks ``start`` to ``stop`` (default ``len(keys)``) of ``seq_id``'s table under those of ``keys``
        (its block keys; the blocks full and their K/V computed, or at least launched on the device's stream before
        any later step). A block whose content another block already holds stays unregistered (it is freed as a plain
        block)."""
        table = self._tables[seq_id]
        stop = len(keys) if stop is None else min(stop, len(keys))
        if stop * self.block_size > self._num_tokens[seq_id]:
            raise ValueError(f"{stop} keys for {self._num_tokens[seq_id]} tokens of {seq_id!r}: only full blocks "
                             "are registered")
        for block, key in zip(table[start:stop], keys[start:stop]):
            if block not in self._key_of and key not in self._block_of:
                self._key_of[block] = key
                self._block_of[key] = block

    def forget_cached(self) -> None:
        """Drop every registration (evictable blocks become plain free blocks): the cache's contents are no longer
        what they were registered for (another Generator wrote the backend's cache)."""
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._key_of.clear()
        self._block_of.clear()

    def free(self, seq_id) -> None:
        """Drop ``seq_id``'s hold on its blocks (unknown ids are an error: a double free is a bug). A block no other
        sequence holds returns to the pool: evictable if registered (its last blocks first in line for eviction),
        else free."""
        table = self._tables.pop(seq_id)
        del self._num_tokens[seq_id]
        for b in reversed(table):
            self._refs[b] -= 1
            if self._refs[b]:
                continue
            if b in self._key_of:
                self._evictable[b] = None
            else:
                self._free.append(b)

    def _check_free(self, seq_id, need: int) -> None:
        if need > self.num_free_blocks:
            raise OutOfBlocks(f"sequence {seq_id!r} needs {need} more KV blocks, {self.num_free_blocks} free "
                              f"(of {self.num_blocks}); wait for a sequence to finish or raise --num-blocks")

    def _take(self) -> int:
        """A block for new tokens: an unregistered free one, else the least recently released registered one
        (unregistered: its content is about to be overwritten)."""
        if self._free:
            b = self._free.pop()
        else:
            b, _ = self._evictable.popitem(last=False)
            del self._block_of[self._key_of.pop(b)]
        self._refs[b] = 1
        return b

    def check_invariants(self) -> None:
        """Every block is free, evictable or held, each held block by as many tables as its count says; each table
        has the right length; the registry maps keys and blocks one to one, and no free block is registered."""
        held = [b for t in self._tables.values() for b in t]
        counts = [0] * self.num_blocks
        for b in held:
            counts[b] += 1
        assert counts == self._refs, "a block's hold count differs from the tables holding it"
        every = sorted(set(held)) + self._free + list(self._evictable)
        assert sorted(every) == list(range(self.num_blocks)), "a block is leaked, or both held and free"
        assert all(self._refs[b] == 0 and b in self._key_of for b in self._evictable), "a bad evictable block"
        assert not any(b in self._key_of for b in self._free), "a free block is still registered"
        assert {k: b for b, k in self._key_of.items()} == self._block_of, "the registry is not one to one"
        for seq_id, table in self._tables.items():
            n = self._num_tokens[seq_id]
            assert len(table) == -(-n // self.block_size), f"{seq_id!r}: {len(table)} blocks for {n} tokens"
            assert len(set(table)) == len(table), f"{seq_id!r} holds a block twice"

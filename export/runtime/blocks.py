"""The paged KV cache's bookkeeping: which cache blocks belong to which sequence, and where each new token goes.

The cache itself (``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer) lives in the backend; this module
only hands out block ids. A sequence owns ``ceil(num_tokens / block_size)`` blocks, listed in order in its block
table; token ``t`` of the sequence lives in slot ``block_table[t // block_size] * block_size + t % block_size``.

Running out of blocks never corrupts state: ``reserve`` either succeeds for all requested tokens or raises
``OutOfBlocks`` having changed nothing, so the scheduler can queue (or preempt) and try again later.
"""

from __future__ import annotations


class OutOfBlocks(RuntimeError):
    """Not enough free KV-cache blocks for a request; nothing was allocated."""


class BlockManager:
    """Allocates fixed-size KV-cache blocks to sequences (identified by any hashable id)."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # LIFO free list: a just-freed block is reused first, which keeps the working set of the cache small.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[object, list[int]] = {}
        self._num_tokens: dict[object, int] = {}

    # -- queries ---------------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

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

    # -- updates ---------------------------------------------------------------------------------------------------
    def reserve(self, seq_id, num_new_tokens: int) -> None:
        """Make room for ``num_new_tokens`` more tokens of ``seq_id`` (creating it if new); ``slot`` gives their slots.

        Appending one decode token is ``reserve(seq_id, 1)``: a new block is taken only when the last one is full.
        Raises ``OutOfBlocks`` (state unchanged) when the free blocks do not suffice.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        need = self.blocks_needed(seq_id, num_new_tokens)
        if need > len(self._free):
            raise OutOfBlocks(f"sequence {seq_id!r} needs {need} more KV blocks, {len(self._free)} free "
                              f"(of {self.num_blocks}); wait for a sequence to finish or raise --num-blocks")
        table = self._tables.setdefault(seq_id, [])
        start = self._num_tokens.get(seq_id, 0)
        for _ in range(need):
            table.append(self._free.pop())
        self._num_tokens[seq_id] = start + num_new_tokens

    def free(self, seq_id) -> None:
        """Return every block of ``seq_id`` to the pool (unknown ids are an error: a double free is a bug)."""
        table = self._tables.pop(seq_id)
        del self._num_tokens[seq_id]
        self._free.extend(reversed(table))

    def check_invariants(self) -> None:
        """Every block is either free or owned by exactly one sequence, and each table has the right length."""
        owned = [b for t in self._tables.values() for b in t]
        every = owned + self._free
        assert len(every) == self.num_blocks, f"{len(every)} blocks accounted for, pool has {self.num_blocks}"
        assert sorted(every) == list(range(self.num_blocks)), "a block is leaked, shared or duplicated"
        for seq_id, table in self._tables.items():
            n = self._num_tokens[seq_id]
            assert len(table) == -(-n // self.block_size), f"{seq_id!r}: {len(table)} blocks for {n} tokens"

"""KV block manager: a seeded random walk of thousands of reserve/append/free steps, invariants checked each step."""

import random

import pytest

from export.runtime.blocks import BlockManager, OutOfBlocks


@pytest.mark.parametrize("num_blocks,block_size,seed", [(1, 1, 0), (7, 1, 1), (13, 4, 2), (64, 16, 3), (5, 3, 4)])
def test_random_walk_keeps_invariants(num_blocks, block_size, seed):
    rng = random.Random(seed)
    bm = BlockManager(num_blocks, block_size)
    tokens: dict[int, int] = {}  # our own model of how many tokens each live sequence holds
    slots_of: dict[int, list[int]] = {}
    next_id = 0
    refusals = 0
    for _ in range(3000):
        op = rng.random()
        if op < 0.3 or not tokens:  # new sequence with a prompt
            n = rng.randint(1, 3 * block_size + 1)
            free_before = bm.num_free_blocks
            try:
                bm.reserve(next_id, n)
            except OutOfBlocks:
                refusals += 1
                assert -(-n // block_size) > free_before
                assert bm.num_free_blocks == free_before and next_id not in bm  # refused: nothing changed
            else:
                tokens[next_id], slots_of[next_id] = n, [bm.slot(next_id, p) for p in range(n)]
            next_id += 1
        elif op < 0.8:  # append one token (decode)
            sid = rng.choice(list(tokens))
            last_full = tokens[sid] % block_size == 0
            free_before = bm.num_free_blocks
            try:
                bm.reserve(sid, 1)
            except OutOfBlocks:
                refusals += 1
                assert last_full and free_before == 0
            else:
                # A new block is taken exactly when the last one was full.
                assert bm.num_free_blocks == free_before - (1 if last_full else 0)
                slots_of[sid].append(bm.slot(sid, tokens[sid]))
                tokens[sid] += 1
        else:
            sid = rng.choice(list(tokens))
            bm.free(sid)
            del tokens[sid], slots_of[sid]
        bm.check_invariants()
        # Slots: a token's slot never moves once reserved, and no two live tokens share a slot.
        all_slots = [s for v in slots_of.values() for s in v]
        assert len(all_slots) == len(set(all_slots)), "two live tokens share a cache slot"
        for sid, n in tokens.items():
            assert bm.num_tokens(sid) == n
            assert slots_of[sid] == [bm.slot(sid, p) for p in range(n)]
    for sid in list(tokens):
        bm.free(sid)
    bm.check_invariants()
    assert bm.num_free_blocks == num_blocks
    if num_blocks < 16:
        assert refusals > 0, "the walk never hit out-of-memory: it did not test refusal"


def test_append_takes_new_block_only_when_full():
    bm = BlockManager(4, 3)
    bm.reserve("a", 2)
    assert [bm.slot("a", p) for p in range(2)] == [bm.block_table("a")[0] * 3 + 0, bm.block_table("a")[0] * 3 + 1]
    bm.reserve("a", 1)
    assert len(bm.block_table("a")) == 1 and bm.num_free_blocks == 3
    bm.reserve("a", 1)
    assert len(bm.block_table("a")) == 2 and bm.num_free_blocks == 2


def test_errors():
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0)
    bm = BlockManager(2, 2)
    with pytest.raises(OutOfBlocks, match="raise --num-blocks"):
        bm.reserve(0, 5)
    bm.reserve(0, 1)
    bm.free(0)
    with pytest.raises(KeyError):
        bm.free(0)  # double free is a bug, not a no-op
    with pytest.raises(IndexError):
        bm.reserve(1, 1)
        bm.slot(1, 1)

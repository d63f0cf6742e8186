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


@pytest.mark.parametrize("num_blocks,block_size,seed", [(6, 1, 0), (12, 2, 1), (20, 4, 2), (9, 3, 3)])
def test_prefix_cache_walk_reads_back_every_sequence(num_blocks, block_size, seed):
    """A random walk of admissions (prompts drawn from a few shared prefixes, so that blocks are shared), decode
    appends, registrations of computed blocks and frees, over a model of the cache's slots: each sequence writes
    only the slots of its tokens past its cached prefix, and reads every one of its tokens back through its block
    table. A block shared while being written, registered under the wrong content or reused while held fails the
    read-back; the invariants are checked every step."""
    from export.runtime.blocks import block_keys

    rng = random.Random(seed)
    bm = BlockManager(num_blocks, block_size)
    stems = [[rng.randrange(50) for _ in range(3 * block_size + 1)] for _ in range(3)]
    cache = [None] * (num_blocks * block_size)  # what each slot holds: a token id
    live: dict[int, list[int]] = {}  # sequence -> its tokens (all computed: written at reservation)
    keys: dict[int, list[bytes]] = {}
    hits_seen = 0
    for sid in range(1500):
        op = rng.random()
        if op < 0.35 or not live:
            toks = rng.choice(stems)[:rng.randint(1, 3 * block_size + 1)] + [rng.randrange(50)] * rng.randint(0, 2)
            k = block_keys([], toks, block_size, (len(toks) - 1) // block_size)
            hits = bm.cached_prefix(k)
            try:
                bm.admit(sid, hits, len(toks))
            except OutOfBlocks:
                assert bm.admit_cost(hits, len(toks)) > bm.num_free_blocks and sid not in bm
                continue
            hits_seen += len(hits)
            for p in range(len(hits) * block_size, len(toks)):
                cache[bm.slot(sid, p)] = toks[p]
            live[sid], keys[sid] = toks, k
        elif op < 0.7:
            sid = rng.choice(list(live))
            try:
                bm.reserve(sid, 1)
            except OutOfBlocks:
                continue
            live[sid].append(rng.randrange(50))
            cache[bm.slot(sid, len(live[sid]) - 1)] = live[sid][-1]
        elif op < 0.85:
            sid = rng.choice(list(live))
            full = len(live[sid]) // block_size
            bm.register(sid, block_keys(keys[sid], live[sid], block_size, full), rng.randint(0, full))
        else:
            sid = rng.choice(list(live))
            bm.free(sid)
            del live[sid], keys[sid]
        bm.check_invariants()
        for s, toks in live.items():
            assert [cache[bm.slot(s, p)] for p in range(len(toks))] == toks, f"sequence {s} reads other tokens"
    assert hits_seen > 20, "too few prefix hits: the walk does not test sharing"
    for s in list(live):
        bm.free(s)
    bm.check_invariants()
    assert bm.num_free_blocks == num_blocks


def test_prefix_hits_are_taken_from_the_evictable_pool_and_evicted_last_released_first():
    from export.runtime.blocks import block_keys

    bm = BlockManager(4, 2)
    toks = [1, 2, 3, 4, 5]
    bm.reserve("a", 5)  # 3 blocks
    k = block_keys([], toks, 2, 2)
    bm.register("a", k)
    first, second, third = bm.block_table("a")
    bm.free("a")
    assert bm.num_free_blocks == 4  # two evictable, two free
    assert bm.cached_prefix(k) == [first, second]
    assert bm.admit_cost([first, second], 5) == 1 + 2  # one new block, and both hits leave the evictable pool
    bm.admit("b", [first], 3)  # the first block from the cache, one new (the never-registered third block)
    assert bm.block_table("b") == [first, third] and bm.num_free_blocks == 2
    bm.reserve("c", 3)  # the last free block, then the one evictable block: unregistered as it is taken
    assert bm.block_table("c")[1] == second and bm.cached_prefix(k) == [first]
    # a key stands for the tokens from the sequence's start: the same block after another first block is no hit
    assert block_keys([], [7, 7, 3, 4, 5], 2, 2)[1] != k[1]
    assert block_keys([], [1, 2, 3, -1], 2, 2) == k[:1]  # a token not known yet ends the keys
    with pytest.raises(ValueError, match="leave one token to feed"):
        bm.admit("d", [first], 2)
    with pytest.raises(ValueError, match="only full blocks"):
        bm.register("b", block_keys([], [1, 2, 3, 4], 2, 2))
    bm.check_invariants()

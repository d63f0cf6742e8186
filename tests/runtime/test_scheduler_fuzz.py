"""Random add / abort / step (aborts from inside token callbacks too) under memory pressure, with and without the
pipelined decode: the block pool's invariants hold at every step, every block returns to the pool, and the requests
not aborted produce exactly the unbatched reference's tokens."""
import random

import pytest

from export.runtime import Generator, SamplingParams
from tests.runtime.test_scheduler import VOCAB, reference, toy_backend


@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("pipeline", [False, True])
def test_random_add_abort_step(seed, pipeline):
    rng = random.Random(seed)
    nb = rng.choice([4, 6, 10, 20])
    bs = rng.choice([1, 2, 4])
    gen = Generator(toy_backend(pipeline, nb, bs), max_num_seqs=rng.randint(1, 6),
                    max_num_batched_tokens=rng.randint(1, 12))
    want, aborted = {}, set()
    for _ in range(600):
        r = rng.random()
        if r < 0.3 and len(want) < 40:
            p = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 10))]
            n = rng.randint(1, 12)
            try:
                want[gen.add_request(p, SamplingParams(max_new_tokens=n))] = reference(p, n)
            except ValueError:
                pass
        elif r < 0.4:
            live = [q for q in want if q not in aborted]
            if live:
                q = rng.choice(live)
                gen.abort(q)
                aborted.add(q)

        def cb(rid, tok, d):
            if rng.random() < 0.05:
                live = [q for q in want if q not in aborted]
                q = rng.choice(live)
                gen.abort(q)
                aborted.add(q)
        gen.step(cb)
        gen.blocks.check_invariants()
    while gen.has_unfinished():
        gen.step()
    gen.blocks.check_invariants()
    assert gen.blocks.num_free_blocks == nb
    for q, w in want.items():
        if q not in aborted:
            r = gen.result(q)
            assert r.token_ids == w and r.finish_reason in ("stop", "length"), q

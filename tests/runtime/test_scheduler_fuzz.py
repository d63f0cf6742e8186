"""Random add / abort / step (aborts from inside token callbacks too) under memory pressure, greedy and sampled
requests mixed, prompts sharing stems or continuing an earlier request's prompt and output as a chat's next turn
(prefix-cache hits on prompt and on decoded blocks), with and without the pipelined decode, and with or without rows
of unusable logits (NaN, +inf, all -inf) that the model gives at a context chosen by a hash of it (so a recompute
after preemption gives them again), in any chunk of a prefill (sampling or not) or decode: the block pool's
invariants hold at every step, every block returns, an errored request keeps exactly its tokens before the bad row
and ends with "error", every other request not aborted equals the unbatched reference and counts at most its prompt
as cached, streams equal results (an errored one's ends in NO_TOKEN), abort after the end works."""
import random

import pytest

from export.runtime import Generator, SamplingParams
from export.runtime.sampling import NO_TOKEN
from tests.runtime.test_scheduler import EOS, VOCAB, ToyPagedBackend, ToyPipelinedBackend, next_token

KINDS = ("nan", "inf", "neg_inf")


def poison(toks, salt):
    """None, or how the row of this context is unusable (never with ``salt`` None)."""
    if salt is None:
        return None
    h = sum((i + 3) * (t + 11) for i, t in enumerate(toks)) * 40503 + salt
    return KINDS[h % 3] if (h // 7) % 9 == 0 else None


def reference(prompt, n, salt):
    toks, out = list(prompt), []
    while len(out) < n:
        if poison(toks, salt):
            return out, "error"
        t = next_token(toks)
        out.append(t)
        toks.append(t)
        if t == EOS:
            return out, "stop"
    return out, "length"


def poisoned(base, salt):
    class Poisoned(base):
        nan_rows = 0
        nonsampling_nan_rows = 0

        def forward(self, b, input_ids=None):
            logits = (super().forward(b, input_ids) if input_ids is not None else super().forward(b)) * 100
            for i in range(b.num_seqs):
                n = int(b.seq_lens[i])
                slots = [int(b.block_table[i, p // self.block_size]) * self.block_size + p % self.block_size
                         for p in range(n)]
                kind = poison(self.cache[slots].tolist(), salt)
                if kind == "nan":
                    logits[i, (n * 7) % VOCAB] = float("nan")
                elif kind == "inf":
                    logits[i, (n * 5) % VOCAB] = float("inf")
                elif kind == "neg_inf":
                    logits[i] = float("-inf")
                self.nan_rows += kind is not None
            return logits
    return Poisoned


@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("pipeline", [False, True])
@pytest.mark.parametrize("unusable_rows", [False, True])
def test_random_add_abort_step(seed, pipeline, unusable_rows):
    rng = random.Random(seed)
    salt = rng.randrange(1000) if unusable_rows else None
    nb = rng.choice([4, 6, 10, 20])
    bs = rng.choice([1, 2, 4])
    backend = poisoned(ToyPipelinedBackend if pipeline else ToyPagedBackend, salt)(nb, bs)
    seqs = rng.randint(1, 6)
    budget = rng.randint(seqs, 12)
    gen = Generator(backend, max_num_seqs=seqs, max_num_batched_tokens=budget)
    assert gen.pipeline == pipeline
    want, aborted, streamed, sampled, prompts = {}, set(), {}, set(), {}
    stems = [[rng.randrange(1, VOCAB) for _ in range(9)] for _ in range(3)]

    def cb(rid, tok, d):
        streamed.setdefault(rid, []).append(tok)
        assert tok >= 0 or tok == NO_TOKEN
        if rng.random() < 0.03:
            live = [q for q in want if q not in aborted]
            q = rng.choice(live)
            gen.abort(q)
            aborted.add(q)

    for _ in range(600):
        r = rng.random()
        if r < 0.3 and len(want) < 40:
            # half the prompts start with one of a few shared stems: the prefix cache shares their blocks
            length = rng.randint(1, 10)
            p = rng.choice(stems)[:rng.randint(0, length - 1)] if rng.random() < 0.5 else []
            p += [rng.randrange(1, VOCAB) for _ in range(length - len(p))]
            if want and rng.random() < 0.2:  # a chat's next turn: an earlier prompt, its output, a reply
                q = rng.choice(list(want))
                p = prompts[q] + want[q][0] + p[:2]
            n = rng.randint(1, 12)
            # a sampled request: one-hot logits * 100 at temperature 0.8 draw the argmax (the rest underflow to 0)
            kw = dict(temperature=0.8, seed=rng.randrange(99)) if rng.random() < 0.3 else {}
            try:
                q = gen.add_request(p, SamplingParams(max_new_tokens=n, **kw))
                want[q] = reference(p, n, salt)
                prompts[q] = p
                if kw:
                    sampled.add(q)
            except ValueError:
                pass
        elif r < 0.37:
            live = [q for q in want if q not in aborted]
            if live:
                q = rng.choice(live)
                gen.abort(q)
                aborted.add(q)
        # the bookkeeping (tokens + finish) of a ended request mid-way: error ones hold their tokens already
        for q in want:
            if q not in aborted:
                res = gen.result(q)
                if res.finish_reason is not None:
                    assert (res.token_ids, res.finish_reason) == want[q], q
                else:
                    assert res.token_ids == want[q][0][:len(res.token_ids)], q
        out = gen.step(lambda rid, tok, d: cb(rid, tok, d))
        assert all(t >= 0 for _, t in out)
        gen.blocks.check_invariants()
        # a finished request's blocks are all back
        for q in want:
            if q not in aborted and gen._seqs[q].finish_reason is not None:
                assert q not in gen.blocks
    while gen.has_unfinished():
        gen.step(cb)
        gen.blocks.check_invariants()
    assert gen.blocks.num_free_blocks == nb
    for q, w in want.items():
        if q not in aborted:
            r = gen.result(q)
            assert (r.token_ids, r.finish_reason) == w, q
            assert r.num_cached_tokens <= len(prompts[q]), q
            assert streamed.get(q, []) == w[0] + ([NO_TOKEN] if w[1] == "error" else []), q
            gen.abort(q)  # a server drops a finished request's bookkeeping: works after "error" too
    assert not gen._seqs and gen._inflight is None
    assert backend.max_tokens_seen <= budget, "a step exceeded the token budget"
    assert (backend.nan_rows > 0) == unusable_rows

"""Sampling: exact top-k / top-p masks against brute force, greedy, seeds, temperature -> 0, bad parameters."""

import math

import pytest
import torch

from export.runtime.sampling import NO_TOKEN, SamplingParams, make_generator, sample, sample_one, warp


def top_k_mask(logits, k):
    """The tokens ``warp`` keeps with top-k ``k`` alone, as a mask in vocabulary order."""
    return _kept(logits, SamplingParams(temperature=1.0, top_k=k))


def top_p_mask(logits, p):
    return _kept(logits, SamplingParams(temperature=1.0, top_p=p))


def _kept(logits, params):
    logits = logits.reshape(-1, logits.shape[-1])
    return warp(logits, [params] * logits.shape[0]) > 0


def _brute_top_p(logits: torch.Tensor, p: float) -> set[int]:
    probs = torch.softmax(logits.double(), -1).tolist()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    keep, mass = set(), 0.0
    for i in order:  # add tokens by decreasing probability until the kept mass reaches p
        keep.add(i)
        mass += probs[i]
        if mass >= p:
            break
    return keep


@pytest.mark.parametrize("vocab", [1, 7, 123, 1000])
@pytest.mark.parametrize("k", [1, 2, 5, 50])
def test_top_k_mask_exact(vocab, k):
    logits = torch.randn(3, vocab)  # continuous values: no ties
    mask = top_k_mask(logits, k)
    for row, m in zip(logits, mask):
        want = set(torch.argsort(row, descending=True)[:min(k, vocab)].tolist())
        assert set(torch.nonzero(m).flatten().tolist()) == want


def test_top_k_ties_keep_all_equal_logits():
    mask = top_k_mask(torch.tensor([1.0, 3.0, 3.0, 0.0]), 1)
    assert mask.tolist() == [[False, True, True, False]]


@pytest.mark.parametrize("vocab", [1, 7, 123])
@pytest.mark.parametrize("p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_mask_exact(vocab, p):
    # Scale 3 makes the distribution peaked enough that small p keeps few tokens and large p many.
    logits = 3 * torch.randn(4, vocab)
    mask = top_p_mask(logits, p)
    for row, m in zip(logits, mask):
        got = set(torch.nonzero(m).flatten().tolist())
        want = _brute_top_p(row, p)
        # fp32 cumsum vs fp64 brute force may disagree only on a token whose mass-before is within 1e-6 of p.
        probs = torch.softmax(row.double(), -1)
        for i in got ^ want:
            before = float(probs[probs > probs[i]].sum())
            assert abs(before - p) < 1e-6, f"token {i} kept={i in got} mass_before={before} p={p}"


def test_greedy_is_argmax_and_batch_path_matches():
    logits = torch.randn(5, 123)
    params = [SamplingParams()] * 5
    assert sample(logits, params, [None] * 5) == torch.argmax(logits, -1).tolist()
    assert SamplingParams(temperature=0.7, top_k=1).greedy


def test_mixed_batch_samples_each_row_as_sample_one_does():
    """A batch mixing greedy, temperature-only, top-k and top-p rows (the generator's normal step) takes no argmax
    shortcut: row i is exactly ``sample_one(logits[i], params[i], generator i)``, with each generator drawn from as
    ``sample_one`` alone would draw from it. Each row peaks at a different token (and the greedy rows are not row 0),
    so a ``sample`` that read another row's logits, params or generator gives other tokens."""
    vocab = 64
    params = [SamplingParams(temperature=1.0, seed=11),
              SamplingParams(),  # greedy: temperature 0
              SamplingParams(temperature=0.8, top_k=5, seed=12),
              SamplingParams(temperature=1.2, top_p=0.6, seed=13),
              SamplingParams(temperature=0.7, top_k=1)]  # greedy: top_k 1
    logits = torch.randn(len(params), vocab)
    for i in range(len(params)):  # a clear favourite per row, 8 tokens apart: rows draw from different tokens
        logits[i, 8 * i] += 4.0
    gens = [make_generator(p.seed, "cpu") if not p.greedy else None for p in params]
    want_gens = [make_generator(p.seed, "cpu") if not p.greedy else None for p in params]
    for step in range(4):  # several steps: the generators advance as they would one row at a time
        got = sample(logits, params, gens)
        want = [sample_one(logits[i], p, g) for i, (p, g) in enumerate(zip(params, want_gens))]
        assert got == want, f"step {step}: sample() {got} != sample_one row by row {want}"
    assert [got[i] for i in (1, 4)] == torch.argmax(logits[[1, 4]], -1).tolist(), "greedy rows: their own argmax"


def test_seeded_sampling_is_reproducible_and_seed_matters():
    logits = torch.randn(1000)
    p = SamplingParams(temperature=1.0, top_p=0.95, top_k=200, seed=7)

    def draw(seed):
        gen = make_generator(seed, "cpu")
        return [sample_one(logits, p, gen) for _ in range(20)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)  # 20 draws from ~200 tokens: identical sequences are (practically) impossible


def test_sampled_tokens_respect_masks():
    logits = torch.randn(500)
    gen = make_generator(0, "cpu")
    top_k = torch.topk(logits, 10).indices
    kept = logits[top_k]  # top-p applies to what top-k kept, renormalised (HF's warper order)
    allowed = {int(top_k[i]) for i in _brute_top_p(kept, 0.5)}
    seen = {sample_one(logits, SamplingParams(temperature=1.0, top_k=10, top_p=0.5), gen) for _ in range(200)}
    assert seen <= allowed and len(allowed) < 10


def test_top_p_is_taken_over_the_top_k_tokens():
    """probs .4 / .3 / .2 / .1, top_k 2, top_p 0.5: over the whole distribution top-p would keep the first two; over
    top-k's two, renormalised (.57 / .43), only the first reaches 0.5."""
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    gen = make_generator(0, "cpu")
    assert {sample_one(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.5), gen) for _ in range(50)} == {0}


def test_temperature_to_zero_equals_greedy():
    gen = make_generator(0, "cpu")
    for _ in range(20):
        logits = torch.randn(300)
        # At temperature 1e-4 a runner-up >= 1e-2 below the max has probability < 300 * exp(-100): the draw must be
        # the argmax. Rows with a smaller gap are skipped (they test float rounding, not sampling).
        top2 = torch.topk(logits, 2).values
        if float(top2[0] - top2[1]) < 1e-2:
            continue
        tok = sample_one(logits, SamplingParams(temperature=1e-4, seed=0), gen)
        assert tok == int(torch.argmax(logits))
        assert sample_one(logits, SamplingParams(temperature=0.0), None) == int(torch.argmax(logits))
        # a temperature so small that logits / T overflows float32 (a NaN in softmax before the shift by the max)
        assert sample_one(logits, SamplingParams(temperature=1e-40, seed=0), gen) == int(torch.argmax(logits))


@pytest.mark.parametrize("kw,match", [(dict(max_new_tokens=0), "max_new_tokens"), (dict(temperature=-1), "temperature"),
                                      (dict(temperature=float("nan")), "finite"),
                                      (dict(temperature=float("inf")), "finite"),
                                      (dict(top_k=-2), "top_k"), (dict(top_p=0.0), "top_p"),
                                      (dict(top_p=1.5), "top_p")])
def test_bad_params_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_a_temperature_below_greedy_temperature_is_greedy():
    """A positive temperature that float32 makes 0 (5e-324) gave the top logit 0 / 0 = NaN and a multinomial error;
    below GREEDY_TEMPERATURE (vLLM's 1e-5) sampling is argmax, as at 0."""
    from export.runtime.sampling import GREEDY_TEMPERATURE

    logits = torch.tensor([0.5, 3.0, -1.0, 2.9])
    for t in (5e-324, 1e-30, GREEDY_TEMPERATURE / 2):
        p = SamplingParams(temperature=t)
        assert p.greedy and sample_one(logits, p, make_generator(0, "cpu")) == 1
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).greedy


def test_rows_without_a_usable_logit_get_no_token_and_draw_nothing():
    """A row with a NaN (argmax takes it for the largest), a +inf, or only -inf gets NO_TOKEN, greedy or sampled,
    and its generator is not advanced; the other rows are sampled as sample_one samples them."""
    logits = torch.randn(5, 11)
    logits[1, 4] = float("nan")
    logits[2, 7] = float("inf")
    logits[3] = float("-inf")
    for greedy in (True, False):
        params = [SamplingParams() if greedy else SamplingParams(temperature=0.9, seed=i) for i in range(5)]
        gens = [None if greedy else make_generator(i, "cpu") for i in range(5)]
        states = [None if g is None else g.get_state() for g in gens]
        got = sample(logits, params, gens)
        assert [got[i] for i in (1, 2, 3)] == [NO_TOKEN] * 3
        for i in (1, 2, 3):
            assert gens[i] is None or torch.equal(gens[i].get_state(), states[i])
        for i in (0, 4):
            want = int(logits[i].argmax()) if greedy else sample_one(logits[i], params[i], make_generator(i, "cpu"))
            assert got[i] == want


def test_draws_follow_the_warped_distribution():
    """4000 draws (temperature 0.8, top-k 6, top-p 0.9 over 10 tokens) fall on each kept token with its renormalised
    probability, within 5 standard deviations of a binomial count (the seed is fixed: no flakes), and never on a
    dropped token. A race that multiplied by E instead of dividing, or took the argmax of the wrong axis, skews the
    counts far past that."""
    logits = torch.tensor([2.0, 1.5, 1.4, 1.0, 0.5, 0.3, 0.0, -0.5, -1.0, -2.0])
    p = SamplingParams(temperature=0.8, top_k=6, top_p=0.9)
    probs = warp(logits[None], [p])[0].double()
    want = probs / probs.sum()
    assert int((want > 0).sum()) == 5  # top-k kept 6, top-p dropped the sixth
    n = 4000
    gen = make_generator(0, "cpu")
    got = torch.bincount(torch.tensor(sample(logits.expand(n, 10), [p] * n, [gen] * n)), minlength=10).double()
    sd = (n * want * (1 - want)).sqrt()
    assert ((got - n * want).abs() <= 5 * sd).all(), (got.tolist(), (n * want).tolist())


def test_a_row_without_top_p_keeps_every_token_beside_rows_with_it():
    """A row's distribution does not depend on its batch: beside a top-p row (which makes the batch compute the
    cumulative mass), a row without top-p keeps every token, though fp32 sums of its mass reach 1 before its tail."""
    logits = torch.full((2, 1000), -30.0)
    logits[:, :2] = 0.0  # two tokens of ~0.5 each, and a tail of 998 tokens of ~5e-14
    probs = warp(logits, [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.5)])
    ordered = torch.sort(torch.softmax(logits[0], -1), descending=True).values
    assert float((torch.cumsum(ordered, -1) - ordered)[-1]) >= 1.0  # what a top-p of 1 would have dropped
    assert (probs[0] > 0).all() and torch.equal(probs[0], warp(logits[:1], [SamplingParams(temperature=1.0)])[0])
    assert int((probs[1] > 0).sum()) == int((probs[1, :2] > 0).sum()) == 1  # one of the two reaches 0.5


@pytest.mark.gpu
def test_cuda_sampling_is_batch_invariant_and_follows_the_distribution():
    """On CUDA (the runtime's device: CUDA generators, sort, searchsorted): each row of a mixed batch draws what it
    draws alone with the same seed, and the frequency test above holds."""
    dev = "cuda"
    vocab = 32000
    params = [SamplingParams(temperature=1.0, seed=1), SamplingParams(),
              SamplingParams(temperature=0.8, top_k=40, seed=2), SamplingParams(temperature=1.1, top_p=0.7, seed=3),
              SamplingParams(temperature=0.6, top_k=100, top_p=0.9, seed=4)]
    logits = torch.randn(len(params), vocab, device=dev) * 4
    gens = [None if p.greedy else make_generator(p.seed, dev) for p in params]
    alone = [None if p.greedy else make_generator(p.seed, dev) for p in params]
    for step in range(5):
        got = sample(logits, params, gens)
        want = [sample_one(logits[i], p, g) for i, (p, g) in enumerate(zip(params, alone))]
        assert got == want, f"step {step}"
    small = torch.tensor([2.0, 1.5, 1.4, 1.0, 0.5, 0.3, 0.0, -0.5, -1.0, -2.0], device=dev)
    p = SamplingParams(temperature=0.8, top_k=6, top_p=0.9)
    probs = warp(small[None], [p])[0].double().cpu()
    want = probs / probs.sum()
    n = 4000
    gen = make_generator(0, dev)
    got = torch.bincount(torch.tensor(sample(small.expand(n, 10), [p] * n, [gen] * n)), minlength=10).double()
    assert ((got - n * want).abs() <= 5 * (n * want * (1 - want)).sqrt()).all(), (got.tolist(), (n * want).tolist())


def test_a_token_below_float32_resolution_keeps_its_share_of_the_draw(monkeypatch):
    """A token of probability 2e-8 after half the mass (float32's ulp there is 6e-8) is drawn where the uniform
    number falls in its share of the CDF: in float32 its share was empty (such tokens were never drawn, and a CDF
    summed in another order, as CUDA sums one row and several, moved draws between tokens; see ``_draw``)."""
    from export.runtime import sampling

    logits = torch.tensor([[0.0, math.log(4e-8), math.log(1 - 4e-8)]])  # probabilities 1/2, 2e-8, 1/2 - 2e-8
    params = SamplingParams(temperature=1.0, seed=0)
    probs = warp(logits, [params])[0].double()
    assert 0 < probs[1] < 3e-8
    cdf = torch.cumsum(probs, 0)
    u = (cdf[0] + probs[1] / 2) / cdf[-1]  # the middle of token 1's share
    monkeypatch.setattr(sampling.torch, "rand", lambda *shape, generator=None, device=None, dtype=torch.float32:
                        torch.full(shape, u.item(), dtype=dtype, device=device))
    assert sample(logits, [params], [make_generator(0, "cpu")]) == [1]

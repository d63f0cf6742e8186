"""Scheduler + generation loop on a toy backend whose 'model' reads its whole context back through the paged cache.

The toy stores each token id in the cache slot the batch assigns it and predicts the next token from the sequence it
reads back through ``block_table`` / ``seq_lens``. Any wrong slot, block table, position or packing offset, or a
block shared between two sequences, changes the prediction, so batched paged generation (with preemption under a
tiny cache) must equal the unbatched reference exactly.
"""

import dataclasses
import random

import pytest
import torch

from export.runtime import Generator, SamplingParams

VOCAB, EOS = 53, 0


def next_token(tokens: list[int]) -> int:
    h = sum((i + 1) * (t + 7) for i, t in enumerate(tokens))
    return (h * 2654435761) % VOCAB


def reference(prompt: list[int], max_new: int) -> list[int]:
    toks, out = list(prompt), []
    while len(out) < max_new:
        t = next_token(toks)
        out.append(t)
        toks.append(t)
        if t == EOS:
            break
    return out


def continued(prompt: list[int], n: int) -> list[int]:
    """The reference's ``n`` tokens after ``prompt`` with ignore_eos: on through EOS."""
    toks = list(prompt)
    for _ in range(n):
        toks.append(next_token(toks))
    return toks[len(prompt):]


class ToyPagedBackend:
    device = torch.device("cpu")
    vocab_size = VOCAB
    eos_token_ids = (EOS,)

    def __init__(self, num_blocks, block_size, max_model_len=512):
        self.num_blocks, self.block_size, self.max_model_len = num_blocks, block_size, max_model_len
        self.cache = torch.full((num_blocks * block_size,), -1, dtype=torch.int64)
        self.max_batch_seen = 0

    def forward(self, b):
        T = b.input_ids.shape[0]
        assert b.positions.shape == (T,) and b.slot_mapping.shape == (T,) and b.cu_seqlens_q[-1] == T
        self.cache[b.slot_mapping.long()] = b.input_ids
        logits = torch.zeros(b.num_seqs, VOCAB)
        for i in range(b.num_seqs):
            n = int(b.seq_lens[i])
            q = int(b.cu_seqlens_q[i + 1] - b.cu_seqlens_q[i])
            assert b.positions[int(b.cu_seqlens_q[i + 1]) - 1] == n - 1 and q <= n
            slots = [int(b.block_table[i, p // self.block_size]) * self.block_size + p % self.block_size
                     for p in range(n)]
            toks = self.cache[slots].tolist()
            assert -1 not in toks, "read a cache slot nobody wrote"
            logits[i, next_token(toks)] = 1.0
        self.max_batch_seen = max(self.max_batch_seen, b.num_seqs)
        self.max_tokens_seen = max(getattr(self, "max_tokens_seen", 0), T)
        return logits


class ToyPipelinedBackend(ToyPagedBackend):
    """The toy with the torch backend's device-token input: a pipelined step's host batch carries placeholders (the
    tokens are not known on the host yet) and ``input_ids`` holds the previous step's argmax."""

    supports_device_tokens = True
    device_token_steps = 0

    def forward(self, b, input_ids=None):
        if input_ids is not None:
            assert (b.input_ids == -1).all() and input_ids.shape == b.input_ids.shape
            b = dataclasses.replace(b, input_ids=input_ids)
            self.device_token_steps += 1
        return super().forward(b)


def toy_backend(pipeline, *args, **kw):
    return (ToyPipelinedBackend if pipeline else ToyPagedBackend)(*args, **kw)


# (cache blocks, block size, seed, whether the cache is small enough that a decode step must preempt)
@pytest.mark.parametrize("num_blocks,block_size,seed,preempts", [(200, 4, 0, False), (8, 4, 1, True),
                                                                 (22, 1, 2, True), (6, 8, 3, None)])
@pytest.mark.parametrize("token_budget", [8192, 5])  # 5 < most prompts: chunked prefill
@pytest.mark.parametrize("pipeline", [False, True])
def test_batched_paged_generation_equals_reference(num_blocks, block_size, seed, preempts, token_budget, pipeline):
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 9))] for _ in range(7)]
    max_new = [rng.randint(1, 12) for _ in prompts]
    backend = toy_backend(pipeline, num_blocks, block_size)
    gen = Generator(backend, max_num_seqs=5, max_num_batched_tokens=token_budget)
    assert gen.pipeline == pipeline
    streamed = {i: [] for i in range(len(prompts))}
    res = gen.generate(prompts, [SamplingParams(max_new_tokens=m) for m in max_new],
                       on_token=lambda i, t, d: streamed[i].append(t))
    for i, (p, m, r) in enumerate(zip(prompts, max_new, res)):
        want = reference(p, m)
        assert r.token_ids == want, f"prompt {i}"
        assert r.finish_reason == ("stop" if want[-1] == EOS else "length")
        assert streamed[i] == want
    assert backend.max_batch_seen > 1, "nothing was batched"
    assert backend.max_tokens_seen <= token_budget, "a step exceeded the token budget"
    if preempts is not None:
        assert (sum(r.num_preemptions for r in res) > 0) == preempts, "preemption did (not) happen as designed"
    if pipeline and num_blocks > 6:
        assert backend.device_token_steps > 0, "no decode step ran ahead on device-side tokens"
    gen.blocks.check_invariants()
    assert gen.blocks.num_free_blocks == num_blocks


@pytest.mark.parametrize("pipeline", [False, True])
def test_requests_join_between_steps(pipeline):
    backend = toy_backend(pipeline, 64, 2)
    gen = Generator(backend)
    a = gen.add_request([5, 6, 7], SamplingParams(max_new_tokens=10, ignore_eos=True))
    gen.step()
    gen.step()
    b = gen.add_request([9, 1], SamplingParams(max_new_tokens=4, ignore_eos=True))
    while gen.has_unfinished():
        gen.step()
    # ignore_eos: generation continues through EOS to exactly max_new_tokens
    assert gen.result(a).token_ids == continued([5, 6, 7], 10)
    assert gen.result(b).token_ids == continued([9, 1], 4)
    gen.blocks.check_invariants()
    assert gen.blocks.num_free_blocks == 64


@pytest.mark.parametrize("pipeline", [False, True])
def test_running_sequences_decode_while_a_long_prompt_is_prefilled_in_chunks(pipeline):
    """A prompt longer than the token budget arrives while a request decodes: every step gives the decoding request
    its token and the prompt's chunk the rest of the budget (the decode stalled for all the chunks before), no step
    exceeds the budget, and both requests equal their unbatched references."""
    backend = toy_backend(pipeline, 64, 4)
    gen = Generator(backend, max_num_seqs=4, max_num_batched_tokens=6)
    a = gen.add_request([5, 6, 7], SamplingParams(max_new_tokens=20, ignore_eos=True))
    gen.step()
    gen.step()
    long_prompt = [(7 * i) % (VOCAB - 1) + 1 for i in range(30)]
    b = gen.add_request(long_prompt, SamplingParams(max_new_tokens=3, ignore_eos=True))
    steps = 0
    while b not in dict(out := gen.step()):
        assert [rid for rid, _ in out] == [a], f"step {steps} of the chunked prefill gave {out}"
        steps += 1
    assert steps >= 30 // 6, "the prompt was not chunked"
    while gen.has_unfinished():
        gen.step()
    assert gen.result(a).token_ids == continued([5, 6, 7], 20)
    assert gen.result(b).token_ids == continued(long_prompt, 3)
    assert backend.max_tokens_seen <= 6
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(4\) must be >= max_num_seqs \(8\)"):
        Generator(backend, max_num_seqs=8, max_num_batched_tokens=4)


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("pipeline", [False, True])
def test_prefix_cache_serves_shared_prompts_and_chat_turns(pipeline, prefix_caching):
    """Requests that start with the full blocks of an earlier one (a shared system prompt; the next turn of a chat,
    which holds the previous turn's output too) take those blocks from the cache and prefill only the rest; the
    tokens equal the unbatched reference either way (the toy reads every token back through the shared blocks)."""
    backend = toy_backend(pipeline, 64, 4)
    gen = Generator(backend, max_num_seqs=4, prefix_caching=prefix_caching)
    system = [(3 * i) % (VOCAB - 1) + 1 for i in range(13)]  # three full blocks of 4, and one token
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)

    def run(prompts):  # each request's cached tokens, and the prompt tokens the steps fed
        res = gen.generate(prompts, params)
        for p, r in zip(prompts, res):
            assert r.token_ids == continued(p, 6)
        return [r.num_cached_tokens for r in res], gen.stats.prefill_tokens

    first = system + [5, 6]
    assert run([first]) == ([0], 15)
    # 14 tokens: the three blocks before the last token are the system prompt's; 8 tokens: one block before it
    cached, fed = run([system + [7], system[:8]])
    assert cached == ([12, 4] if prefix_caching else [0, 0]) and fed == 22 - sum(cached)
    # The next turn: the first prompt, its output (its K/V computed but for the last token's) and a reply. The
    # output's blocks were registered when the first request finished.
    turn = first + continued(first, 6) + [9, 9]
    cached, fed = run([turn])
    assert cached == ([20] if prefix_caching else [0]) and fed == len(turn) - cached[0]
    gen.blocks.check_invariants()
    assert gen.blocks.num_free_blocks == 64


@pytest.mark.parametrize("pipeline", [False, True])
def test_prefix_cache_offers_only_blocks_whose_kv_a_step_has_computed(pipeline):
    """A second copy of a long prompt arrives while the first is still prefilled in chunks: it starts from the blocks
    the first's chunks have filled so far, not from blocks still to be computed (they would be read unwritten)."""
    backend = toy_backend(pipeline, 64, 4)
    gen = Generator(backend, max_num_seqs=4, max_num_batched_tokens=8)
    prompt = [(5 * i) % (VOCAB - 1) + 1 for i in range(30)]
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    a = gen.add_request(prompt, params)
    gen.step()  # a's first chunk: 8 tokens
    b = gen.add_request(prompt + [8], params)
    while gen.has_unfinished():
        gen.step()
    # b is admitted beside a's last chunk (tokens 24-29: the budget's 8 leave room for b's first 2 tokens), when a's
    # first 6 blocks are computed; a's seventh, which b's prompt holds too, is being computed in that step
    assert gen.result(b).num_cached_tokens == 24
    for rid, p in ((a, prompt), (b, prompt + [8])):
        assert gen.result(rid).token_ids == continued(p, 3)


@pytest.mark.parametrize("pipeline", [False, True])
def test_generators_taking_turns_on_a_backend_do_not_reuse_each_others_overwritten_blocks(pipeline):
    """Two Generators on one backend, one after the other: the second overwrites the blocks the first registered, so
    the first, running again, must not take them from its prefix cache (it did: wrong tokens, silently)."""
    backend = toy_backend(pipeline, 16, 4)
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    a, b = Generator(backend), Generator(backend)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    a.generate([prompt], params)
    b.generate([[11] * 9], params)
    r = a.generate([prompt + [10]], params)[0]
    assert r.token_ids == continued(prompt + [10], 3) and r.num_cached_tokens == 0
    assert a.generate([prompt + [12]], params)[0].num_cached_tokens == 8  # its own blocks again, once it wrote them


@pytest.mark.parametrize("full", ["max_num_seqs", "blocks"])
def test_a_server_at_capacity_keeps_pipelining_while_requests_wait(full):
    """Two requests run and others wait that cannot join before one finishes: the batch is at max_num_seqs, or the
    waiting prompt's blocks are not free. The next step is the same batch either way, so the decode steps between
    stay pipelined (they ran synchronously whenever anything waited)."""
    if full == "max_num_seqs":
        backend = ToyPipelinedBackend(64, 4)
        gen = Generator(backend, max_num_seqs=2)
        prompts, new = [[5, 6, 7], [9, 1], [4, 4], [8]], (12, 14, 3, 3)
    else:  # 12 blocks of 4: the first two hold 4 each at most; the third's 36-token prompt needs 9, and 2 spare
        backend = ToyPipelinedBackend(12, 4)
        gen = Generator(backend, max_num_seqs=4)
        prompts, new = [[5] * 8, [6] * 8, [7] * 36], (8, 8, 2)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in new]
    res = gen.generate(prompts, params)
    assert [r.token_ids for r in res] == [continued(p, n) for p, n in zip(prompts, new)]
    assert sum(r.num_preemptions for r in res) == 0
    # the first two decode side by side while the others wait: all but their first step and the last ones pipelined
    assert backend.device_token_steps >= min(new[:2]) - 4, backend.device_token_steps


@pytest.mark.parametrize("pipeline", [False, True])
def test_result_between_steps_is_what_the_host_knows(pipeline):
    """A server loop reads ``result`` between steps: the tokens so far (a pipelined step's token, still on the
    device, left out rather than shown as a -1 placeholder), a copy, and no finish reason until the request ends."""
    gen = Generator(toy_backend(pipeline, 64, 2))
    a = gen.add_request([5, 6, 7], SamplingParams(max_new_tokens=6, ignore_eos=True))
    toks = [5, 6, 7]
    for _ in range(6):  # ignore_eos: on through EOS
        toks.append(next_token(toks))
    seen = []
    while gen.has_unfinished():
        gen.step()
        r = gen.result(a)
        assert -1 not in r.token_ids and r.token_ids[:len(seen)] == seen
        assert (r.finish_reason is None) == gen.has_unfinished()
        r.token_ids.append(12345)  # the caller's list, not the generator's
        seen = r.token_ids[:-1]
    assert gen.result(a).token_ids == seen == toks[3:]


@pytest.mark.parametrize("pipeline", [False, True])
def test_stop_tokens_and_refusals(pipeline):
    backend = toy_backend(pipeline, 4, 4, max_model_len=16)
    gen = Generator(backend)
    full = reference([3, 4], 8)
    stop = full[2]
    (r,) = gen.generate([[3, 4]], SamplingParams(max_new_tokens=8, stop_token_ids=(stop,)))
    assert r.token_ids == full[:full.index(stop) + 1] and r.finish_reason == "stop"
    with pytest.raises(ValueError, match="exceeds the maximum sequence length"):
        gen.generate([[1, 2], [1] * 10], SamplingParams(max_new_tokens=10))  # the first, valid one is withdrawn
    with pytest.raises(ValueError, match="empty prompt"):
        gen.generate([[]])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        gen.generate([[VOCAB + 1]])
    with pytest.raises(ValueError, match="needs a tokenizer"):
        gen.generate(["hello"])
    with pytest.raises(ValueError, match="one per prompt"):
        gen.generate([[1], [2]], [SamplingParams()] * 3)
    assert not gen.has_unfinished()  # refused requests left nothing queued


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("pipeline", [False, True])
def test_random_arrivals_under_memory_pressure(seed, pipeline):
    """Requests arrive at random steps into a small cache with a small token budget (chunking, queueing and
    preemption all happen); every request still gets exactly its unbatched reference, and no block leaks."""
    rng = random.Random(100 + seed)
    backend = toy_backend(pipeline, num_blocks=10, block_size=2)
    gen = Generator(backend, max_num_seqs=5, max_num_batched_tokens=6)
    want = {}
    steps = 0
    while steps < 400 and (len(want) < 12 or gen.has_unfinished()):
        if len(want) < 12 and rng.random() < 0.5:
            prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 8))]
            n = rng.randint(1, 10)
            want[gen.add_request(prompt, SamplingParams(max_new_tokens=n))] = reference(prompt, n)
        gen.step()
        gen.blocks.check_invariants()
        steps += 1
    assert not gen.has_unfinished(), "requests starved"
    for rid, tokens in want.items():
        assert gen.result(rid).token_ids == tokens, f"request {rid}"
    assert gen.blocks.num_free_blocks == 10
    assert sum(gen.result(r).num_preemptions for r in want) > 0, "no preemption: the test is too gentle"


def test_sequence_tokens_is_a_slice_of_token_ids_without_building_it():
    from export.runtime.sampling import SamplingParams
    from export.runtime.scheduler import Sequence

    seq = Sequence(0, [11, 12, 13, 14], SamplingParams(), output_ids=[21, 22, 23])
    for start in range(8):
        for n in range(5):
            assert seq.tokens(start, n) == seq.token_ids[start:start + n], (start, n)
    assert seq.num_tokens == len(seq.token_ids) == 7
    twin = Sequence(0, [11, 12, 13, 14], SamplingParams(), output_ids=[21, 22, 23])
    assert seq != twin and seq in [seq] and twin not in [seq]  # identity, not field-wise equality


def test_pipelined_decode_runs_ahead_and_drops_the_token_after_a_stop():
    """Steady greedy decode runs every step after the first on the device-side tokens; a sequence that stops has
    computed one token more, which is dropped (its result ends at the stop token) and whose blocks are freed."""
    full = reference([3, 4], 40)
    stop = next(t for t in full[3:] if t != EOS)
    k = full.index(stop)
    backend = ToyPipelinedBackend(64, 4)
    gen = Generator(backend)
    r_stop, r_long = gen.generate([[3, 4], [7]], [SamplingParams(max_new_tokens=40, stop_token_ids=(stop,)),
                                                  SamplingParams(max_new_tokens=30, ignore_eos=True)])
    assert r_stop.token_ids == full[:k + 1] and r_stop.finish_reason == "stop"
    toks = [7]
    for _ in range(30):
        toks.append(next_token(toks))
    assert r_long.token_ids == toks[1:] and r_long.finish_reason == "length"
    assert backend.device_token_steps >= 30 - 4  # all but the first decode step and the batch changes
    assert gen.blocks.num_free_blocks == 64


class _Boom(Exception):
    pass


@pytest.mark.parametrize("where", ["callback", "backend"])
@pytest.mark.parametrize("pipeline", [False, True])
def test_an_error_inside_generate_leaves_nothing_behind(pipeline, where):
    """A callback that raises (a client gone) or a backend step that fails (out of memory) ends ``generate`` with
    that error, its requests aborted: every KV block free, no request left to finish, and the next call runs only its
    own prompt, correctly."""
    backend = toy_backend(pipeline, 64, 2)
    gen = Generator(backend)
    forwards, calls = [], []
    real_forward = backend.forward

    def forward(*a, **k):
        forwards.append(1)
        if where == "backend" and len(forwards) == 4:
            raise _Boom("CUDA out of memory")
        return real_forward(*a, **k)

    def on_token(i, tok, delta):
        calls.append(i)
        if where == "callback" and len(calls) == 3:
            raise _Boom("client went away")

    backend.forward = forward
    with pytest.raises(_Boom):
        gen.generate([[5, 6, 7], [9, 1]], SamplingParams(max_new_tokens=8, ignore_eos=True), on_token=on_token)
    assert not gen.has_unfinished() and gen.blocks.num_free_blocks == 64
    gen.blocks.check_invariants()
    forwards.clear()
    r = gen.generate([[3, 4]], SamplingParams(max_new_tokens=3, ignore_eos=True))[0]
    toks = [3, 4]
    for _ in range(3):
        toks.append(next_token(toks))
    assert r.token_ids == toks[2:] and len(forwards) <= 3 + 1  # its own steps only (+1: a pipelined step ahead)


@pytest.mark.parametrize("pipeline", [False, True])
def test_a_callback_may_abort_another_request(pipeline):
    """A server cancelling a group of requests from its token callback: the aborted one's token of the same step is
    not streamed (it was a KeyError that lost the rest of the step's callbacks), the others go on."""
    gen = Generator(toy_backend(pipeline, 64, 2))
    a = gen.add_request([5, 6, 7], SamplingParams(max_new_tokens=4, ignore_eos=True))
    b = gen.add_request([9, 1], SamplingParams(max_new_tokens=4, ignore_eos=True))
    seen = []

    def on_token(rid, tok, text):
        seen.append(rid)
        if rid == a and b in gen._seqs:
            gen.abort(b)

    while gen.has_unfinished():
        gen.step(on_token)
    assert seen.count(a) == 4 and b not in seen and gen.blocks.num_free_blocks == 64


def test_a_request_fits_the_blocks_of_all_but_its_last_token():
    """Prompt 4 + 5 new tokens in blocks of 4: the 5th new token is sampled, never fed back, so 8 tokens are cached
    and 2 blocks hold the request (it was refused: 'needs 3 KV blocks')."""
    gen = Generator(toy_backend(False, 2, 4))
    out = gen.generate([[5, 6, 7, 8]], SamplingParams(max_new_tokens=5, ignore_eos=True))[0]
    toks = [5, 6, 7, 8]
    for _ in range(5):
        toks.append(next_token(toks))
    assert out.token_ids == toks[4:]
    with pytest.raises(ValueError, match="needs 3 KV blocks"):
        gen.generate([[5, 6, 7, 8]], SamplingParams(max_new_tokens=6, ignore_eos=True))


@pytest.mark.parametrize("limit", ["max_num_seqs", "max_num_batched_tokens"])
def test_a_scheduler_that_can_admit_nothing_is_refused(limit):
    """A limit of 0 admitted nothing, and generate() looped forever."""
    with pytest.raises(ValueError, match=limit):
        Generator(toy_backend(False, 64, 4), **{limit: 0})


def test_one_prompt_of_ids_in_any_integer_container():
    """A single prompt as a tensor, an array, or numpy ints is one prompt (each id was taken for a prompt)."""
    import numpy as np

    want = Generator(toy_backend(False, 64, 4)).generate([5, 6, 7], SamplingParams(max_new_tokens=3))[0].token_ids
    for prompt in (torch.tensor([5, 6, 7]), np.array([5, 6, 7]), [np.int64(5), np.int64(6), np.int64(7)]):
        got = Generator(toy_backend(False, 64, 4)).generate(prompt, SamplingParams(max_new_tokens=3))
        assert len(got) == 1 and got[0].token_ids == want, type(prompt)


@pytest.mark.parametrize("pipeline", [False, True])
def test_abort_frees_a_request_and_the_others_go_on(pipeline):
    gen = Generator(toy_backend(pipeline, 64, 2))
    a = gen.add_request([5, 6, 7], SamplingParams(max_new_tokens=20, ignore_eos=True))
    b = gen.add_request([9, 1], SamplingParams(max_new_tokens=6, ignore_eos=True))
    for _ in range(3):
        gen.step()
    gen.abort(a)
    while gen.has_unfinished():
        gen.step()
    toks = [9, 1]
    for _ in range(6):
        toks.append(next_token(toks))
    assert gen.result(b).token_ids == toks[2:] and gen.blocks.num_free_blocks == 64
    with pytest.raises(KeyError):
        gen.result(a)


def test_num_cached_tokens_counts_prompt_tokens_after_a_preemption():
    """A preempted request is re-admitted onto its own registered blocks, which hold its output too: its
    num_cached_tokens counts prompt tokens only (it said 6 for a 2-token prompt)."""
    gen = Generator(ToyPagedBackend(8, 2), max_num_seqs=4, max_num_batched_tokens=8)
    prompts = [[5], [6, 7], [8, 9, 10], [11]]
    res = gen.generate(prompts, SamplingParams(max_new_tokens=9, ignore_eos=True))
    assert [r.num_preemptions for r in res] == [0, 1, 1, 2]  # the case as designed: re-admissions onto cached blocks
    assert [r.num_cached_tokens for r in res] == [0, 2, 0, 1]  # the whole prompt of 1 and 3, from the cache


def test_decode_steps_do_not_rebuild_a_sequences_token_list():
    """Keying a decoding sequence's newest full block reads that block, not ``token_ids`` (a copy of the whole
    sequence, for every sequence at every block boundary: O(length) host work a block, ~70 us at 16k tokens)."""
    from export.runtime.blocks import BlockManager, block_keys
    from export.runtime.scheduler import Scheduler, Sequence

    class Counted(Sequence):
        builds = 0

        @property
        def token_ids(self):
            Counted.builds += 1
            return super().token_ids

    sch = Scheduler(BlockManager(64, 2), max_num_seqs=2, max_num_batched_tokens=16)
    seqs = [Counted(i, [3 + i] * 7, SamplingParams(max_new_tokens=20)) for i in range(2)]
    for seq in seqs:
        sch.add(seq)
    for t in range(12):
        step = sch.schedule()
        for seq, n in zip(step.seqs, step.num_tokens):
            seq.num_cached += n
            seq.output_ids.append(10 + t)
    sch.schedule()  # registers what the last step computed
    assert Counted.builds == 0
    for seq in seqs:  # the keys are those of the whole sequence's full computed blocks
        assert seq.num_registered == seq.num_cached // 2 == 9
        assert seq.block_keys[:9] == block_keys([], super(Counted, seq).token_ids, 2, 9)

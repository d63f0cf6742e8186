"""Runtime edges that the scheduler and generator tests left open (each killed a mutant the suite let survive): an
aborted waiting request never runs, the max_model_len and vocabulary bounds are inclusive where they should be,
admission keeps a block for every running sequence's next token, and a seeded request samples the same tokens alone
and in a batch with preemption."""
import pytest

from export.runtime import Generator, SamplingParams
from tests.runtime.test_scheduler import ToyPagedBackend

def test_abort_of_a_waiting_request_never_runs_it():
    gen = Generator(ToyPagedBackend(64, 4), max_num_seqs=1)
    gen.add_request([5, 6], SamplingParams(max_new_tokens=3, ignore_eos=True))
    b = gen.add_request([7, 8], SamplingParams(max_new_tokens=3, ignore_eos=True))
    gen.step()  # a admitted; b waits (max_num_seqs=1)
    seq_b = gen._seqs[b]
    gen.abort(b)
    assert seq_b not in gen.scheduler.waiting
    while gen.has_unfinished():
        gen.step()
    assert seq_b.output_ids == [] and gen.blocks.num_free_blocks == 64


def test_max_model_len_and_vocab_boundaries():
    gen = Generator(ToyPagedBackend(64, 4, max_model_len=16))
    gen.generate([[1] * 6], SamplingParams(max_new_tokens=10, ignore_eos=True))  # 6 + 10 == 16: fits
    with pytest.raises(ValueError, match="exceeds the maximum sequence length"):
        gen.generate([[1] * 7], SamplingParams(max_new_tokens=10))
    from tests.runtime.test_scheduler import VOCAB
    gen.generate([[VOCAB - 1]], SamplingParams(max_new_tokens=1))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        gen.generate([[VOCAB]])


def test_admission_keeps_a_block_per_running_sequence():
    """A (4 tokens = 1 full block of 4) will need a block at its first decode; admitting B (2 blocks) into the last
    2 free blocks would force B's preemption at once: B must wait instead."""
    gen = Generator(ToyPagedBackend(3, 4))
    res = gen.generate([[5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 8]], [SamplingParams(max_new_tokens=3, ignore_eos=True),
                                                                 SamplingParams(max_new_tokens=2, ignore_eos=True)])
    assert [r.num_preemptions for r in res] == [0, 0]


def test_seeded_sampling_is_independent_of_batch_and_preemption():
    import torch

    class SoftBackend(ToyPagedBackend):
        def forward(self, b):
            hot = super().forward(b)  # validates the paged cache; one-hot at next_token(context)
            return hot * 2 + torch.stack(
                [torch.randn(hot.shape[1], generator=torch.Generator().manual_seed(int(i))) for i in hot.argmax(-1)])

    p = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, top_k=20, seed=1234, ignore_eos=True)
    alone = Generator(SoftBackend(64, 4)).generate([[5, 6, 7]], p)[0].token_ids
    others = [SamplingParams(max_new_tokens=12, temperature=0.7, seed=s, ignore_eos=True) for s in range(4)]
    res = Generator(SoftBackend(9, 2), max_num_seqs=3, max_num_batched_tokens=3).generate(
        [[9, 9], [5, 6, 7], [1, 2, 3, 4], [8], [3, 3, 3]], [others[0], p, *others[1:]])
    assert sum(r.num_preemptions for r in res) > 0
    assert res[1].token_ids == alone


@pytest.mark.parametrize("pipeline", [False, True])
@pytest.mark.parametrize("bad", ["nan", "inf", "all_neg_inf"])
@pytest.mark.parametrize("sampled", [False, True])
def test_unusable_logits_end_their_request_with_an_error_and_the_others_go_on(pipeline, bad, sampled):
    """The model gives one request a row of logits no token can be chosen from (a NaN, an overflow to +inf, all
    -inf) at its third output token: that request ends with finish_reason "error" and its first two tokens, its
    stream ends in a call with token NO_TOKEN, it frees its blocks; the others' tokens equal the reference. (Before,
    a sampled row raised out of step() at every retry, the whole batch stuck; a greedy row's argmax took the NaN's
    index as a token.)"""

    from export.runtime.sampling import NO_TOKEN
    from tests.runtime.test_scheduler import ToyPipelinedBackend, next_token

    def reference(prompt, n):  # ignore_eos
        toks = list(prompt)
        for _ in range(n):
            toks.append(next_token(toks))
        return toks[len(prompt):]

    poisoned = [5, 6, 7]

    class PoisonBackend(ToyPipelinedBackend if pipeline else ToyPagedBackend):
        def forward(self, b, input_ids=None):
            logits = super().forward(b, input_ids) if pipeline else super().forward(b)
            for i in range(b.num_seqs):
                end = int(b.cu_seqlens_q[i + 1]) - 1
                n = int(b.seq_lens[i])
                toks = self.cache[[int(b.block_table[i, p // self.block_size]) * self.block_size +
                                   p % self.block_size for p in range(n)]].tolist()
                if toks[:3] == poisoned and n == len(poisoned) + 2 and end >= 0:
                    logits[i] = {"nan": float("nan"), "inf": 0.0, "all_neg_inf": float("-inf")}[bad]
                    if bad == "inf":
                        logits[i, 3] = float("inf")
                    if bad == "nan":
                        logits[i, :5] = 1.0  # a NaN among numbers: argmax still picks it
            return logits

    params = [SamplingParams(max_new_tokens=6, ignore_eos=True, **(dict(temperature=0.8, seed=s) if sampled else {}))
              for s in range(3)]
    backend = PoisonBackend(64, 2)
    gen = Generator(backend)
    assert gen.pipeline == pipeline
    prompts = [[1, 2, 3], poisoned, [9, 8]]
    streamed = {i: [] for i in range(3)}
    res = gen.generate(prompts, params, on_token=lambda i, t, d: streamed[i].append(t))
    bad_res = res[1]
    assert bad_res.finish_reason == "error" and len(bad_res.token_ids) == 2
    assert streamed[1] == bad_res.token_ids + [NO_TOKEN]
    if not sampled:
        assert bad_res.token_ids == reference(poisoned, 2)
        for i in (0, 2):
            assert res[i].token_ids == reference(prompts[i], 6) and res[i].finish_reason == "length"
    else:
        assert all(r.finish_reason == "length" and len(r.token_ids) == 6 for r in (res[0], res[2]))
    assert gen.blocks.num_free_blocks == 64


@pytest.mark.parametrize("pipeline", [False, True])
def test_a_row_that_ends_in_an_error_is_no_decode_token_nor_a_first_token(pipeline):
    """stats.decode_tokens counts the tokens decoded: a decode row of unusable logits (NaN) made none, with or
    without the pipelined decode (before: the synchronous step counted every row of the step, the pipelined one
    only the tokens, so decode tok/s differed by path); a prefill whose only row is unusable gave no first token."""
    from tests.runtime.test_scheduler import ToyPipelinedBackend

    class NaNAt(ToyPipelinedBackend if pipeline else ToyPagedBackend):
        def forward(self, b, input_ids=None):
            logits = super().forward(b, input_ids) if pipeline else super().forward(b)
            for i in range(b.num_seqs):
                if int(b.seq_lens[i]) in (5, 20):  # [1, 2, 3]'s 3rd output token; [4] * 20's first
                    logits[i] = float("nan")
            return logits

    gen = Generator(NaNAt(64, 2))
    res = gen.generate([[1, 2, 3], [7, 8, 9, 10, 11, 12]], SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert [(r.finish_reason, len(r.token_ids)) for r in res] == [("error", 2), ("length", 6)]
    assert gen.stats.decode_tokens == sum(len(r.token_ids) - 1 for r in res) == 6
    (r,) = gen.generate([[4] * 20], SamplingParams(max_new_tokens=3))
    assert r.finish_reason == "error" and r.token_ids == [] and gen.stats.time_to_first_token_s is None
    assert gen.stats.decode_tokens == 0

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
    res = Generator(SoftBackend(9, 2), max_num_batched_tokens=3).generate(
        [[9, 9], [5, 6, 7], [1, 2, 3, 4], [8], [3, 3, 3]], [others[0], p, *others[1:]])
    assert sum(r.num_preemptions for r in res) > 0
    assert res[1].token_ids == alone

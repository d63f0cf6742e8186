"""export.model.CpuOps (what a float32 model on the CPU runs) against TorchOps (the torch.ops.tritrt ops' references).

The same decoder walk on both backends over a scattered paged cache: prefill of sequences of different lengths, decode
steps, a chunked-prefill step mixed with a decode, block sizes 1 and 4 (7 and 13 tokens cross blocks mid-sequence),
every tiny variant (GQA 2:1 and 5:1, tied head, llama3 RoPE scaling, Qwen2 bias, Qwen3 q/k norm). Both sides compute in
fp32 and differ only in summation order (RMSNorm's mean, SDPA vs einsum attention, RoPE's multiply-add): ~1e-7
relative per op, so 1e-5 of the largest logit is a ~100x margin over 2 layers, and any wiring error (a wrong head,
position, sign or block) moves logits by O(1).
"""

import pytest
import torch

from export.decoder import decoder_forward
from export.model import CpuOps, LlamaModel, TorchOps, make_batch
from tests.helpers import describe_error

REL_TOL = 1e-5


def _forward(model, ops_cls, batch, kv):
    return decoder_forward(ops_cls(model.weights, model.cos_sin_cache), model.config, batch.input_ids,
                           batch.positions, batch.slot_mapping, batch.block_table, batch.seq_lens,
                           batch.cu_seqlens_q, batch.max_seqlen_q, kv, all_logits=True)


def _assert_rel(got, want, what):
    assert torch.isfinite(got).all(), what + ": non-finite " + describe_error(got, want)
    rel = float((got - want).abs().max() / want.abs().max())
    assert rel < REL_TOL, f"{what}: rel err {rel:.2e} >= {REL_TOL}: " + describe_error(got, want)


@pytest.mark.parametrize("variant", ["llama", "tied", "llama3", "qwen2", "qwen3", "odd_dims"])
@pytest.mark.parametrize("block_size", [1, 4])
def test_cpu_ops_equal_torch_ops(tiny_dirs, variant, block_size):
    model = LlamaModel.from_checkpoint(tiny_dirs(variant), dtype=torch.float32)
    gen = torch.Generator().manual_seed(block_size)
    steps = [[7, 13, 1], [1, 1, 1], [5, 1, 1], [1, 1, 1]]  # prefill, decode, chunked prefill + decode, decode
    num_seqs, blocks_per_seq = 3, -(-16 // block_size) + 1
    num_blocks = num_seqs * blocks_per_seq
    perm = torch.randperm(num_blocks, generator=gen)
    kv = {}
    for name in ("cpu", "torch"):  # NaN where nothing was written: a read past a sequence's tokens fails
        kv[name] = [(t.fill_(float("nan")), u.fill_(float("nan")))
                    for t, u in model.allocate_kv_cache(num_blocks, block_size, "cpu", torch.float32)]
    done = [0] * num_seqs
    for step, new in enumerate(steps):
        ids = torch.randint(0, model.config.vocab_size, (sum(new),), generator=gen)
        batch = make_batch(new, cached_lens=done, block_size=block_size, input_ids=ids, blocks_per_seq=blocks_per_seq)
        slots = batch.slot_mapping.long()  # rename blocks through perm: a sequence's blocks are not contiguous
        batch.block_table = perm[batch.block_table.long()].to(torch.int32)
        batch.slot_mapping = (perm[slots // block_size] * block_size + slots % block_size).to(torch.int32)
        got = _forward(model, CpuOps, batch, kv["cpu"])
        want = _forward(model, TorchOps, batch, kv["torch"])
        _assert_rel(got, want, f"{variant} block_size {block_size} step {step}")
        done = [d + n for d, n in zip(done, new)]
    for (k, v), (k_want, v_want) in zip(kv["cpu"], kv["torch"]):  # the caches hold the same K/V (RoPE'd K)
        written = ~torch.isnan(k_want)
        assert torch.equal(written, ~torch.isnan(k)) and torch.equal(~torch.isnan(v_want), ~torch.isnan(v))
        torch.testing.assert_close(k[written], k_want[written], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v[written], v_want[written], rtol=0, atol=0)


def test_cpu_ops_run_only_for_float32_on_cpu(tiny_llama_dir, monkeypatch):
    # Dispatch is explicit: a float32 CPU model runs CpuOps, a half one (and any CUDA model) the torch.ops.tritrt ops.
    used = []
    init = TorchOps.__init__

    def spy(self, *args):
        used.append(type(self).__name__)
        init(self, *args)

    monkeypatch.setattr(TorchOps, "__init__", spy)
    for dtype, want in ((torch.float32, "CpuOps"), (torch.float16, "TorchOps")):
        model = LlamaModel.from_checkpoint(tiny_llama_dir, dtype=dtype)
        model(make_batch([3]), model.allocate_kv_cache(1, 4))
        assert used[-1] == want, f"{dtype}: ran {used[-1]}"

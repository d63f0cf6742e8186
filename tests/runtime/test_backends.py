"""Backend plumbing that runs on CPU: decode padding for static (CUDA-graph / engine) shapes, and the TensorRT
backend's refusal when TensorRT is missing."""

import pytest
import torch

from export.batch import Batch
from export.runtime.backends import TorchBackend, pad_decode_batch


@pytest.fixture(scope="module")
def tiny_model(tiny_dir):
    from export.model import LlamaModel

    return LlamaModel.from_checkpoint(tiny_dir, dtype=torch.float32)


def _decode_batch(seq_lens, block_size, tables):
    S = len(seq_lens)
    slots = [tables[i][(n - 1) // block_size] * block_size + (n - 1) % block_size for i, n in enumerate(seq_lens)]
    width = max(len(t) for t in tables)
    bt = torch.zeros(S, width, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t)
    return Batch(input_ids=torch.randint(0, 300, (S,)), positions=torch.tensor([n - 1 for n in seq_lens]),
                 slot_mapping=torch.tensor(slots, dtype=torch.int32), block_table=bt,
                 seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                 cu_seqlens_q=torch.arange(S + 1, dtype=torch.int32), max_seqlen_q=1)


def test_padded_decode_equals_unpadded_and_padding_writes_nothing(tiny_model):
    bs = 4  # block size
    backend = TorchBackend(tiny_model, num_blocks=16, block_size=bs)
    for k, v in backend.kv_cache:  # a full cache of random history
        k.normal_()
        v.normal_()
    batch = _decode_batch([5, 1, 9], bs, [[3, 7], [2], [8, 1, 4]])
    snapshot = [(k.clone(), v.clone()) for k, v in backend.kv_cache]
    want = backend.forward(batch)
    after_real = [(k.clone(), v.clone()) for k, v in backend.kv_cache]
    for (k0, _), (k1, _) in zip(snapshot, after_real):
        assert (k0 != k1).any(dim=(2, 3)).sum() == 3  # exactly the three new tokens' slots were written
    for (k, v), (k0, v0) in zip(backend.kv_cache, snapshot):
        k.copy_(k0)
        v.copy_(v0)
    padded = pad_decode_batch(batch, 8, 5)
    assert padded.block_table.shape == (8, 5) and padded.slot_mapping[3:].eq(-1).all()
    got = backend.forward(padded)
    assert torch.isfinite(got).all()
    # Same math on the same rows: only the padding around them differs, so the real rows must agree closely
    # (fp32; 1e-5 absorbs a different reduction order if a kernel splits work by batch shape).
    torch.testing.assert_close(got[:3], want, rtol=1e-5, atol=1e-5)
    real = torch.zeros(16 * bs, dtype=torch.bool)
    real[batch.slot_mapping.long()] = True
    for (k, v), (k0, v0), (k1, v1) in zip(backend.kv_cache, snapshot, after_real):
        for new, old, ref in ((k, k0, k1), (v, v0, v1)):
            new, old, ref = (t.view(16 * bs, -1) for t in (new, old, ref))
            assert torch.equal(new[~real], old[~real]), "padding rows wrote into the cache"
            torch.testing.assert_close(new[real], ref[real], rtol=1e-5, atol=1e-5)


def test_pad_decode_batch_refuses_what_does_not_fit():
    batch = _decode_batch([5, 1], 4, [[3, 7], [2]])
    with pytest.raises(ValueError, match="exceeds the padded shape"):
        pad_decode_batch(batch, 1, 5)
    with pytest.raises(ValueError, match="exceeds the padded shape"):
        pad_decode_batch(batch, 4, 1)
    prefill = Batch(batch.input_ids.repeat(2), batch.positions.repeat(2), batch.slot_mapping.repeat(2),
                    batch.block_table, batch.seq_lens, torch.tensor([0, 2, 4], dtype=torch.int32), 2)
    with pytest.raises(ValueError, match="pure decode batch"):
        pad_decode_batch(prefill, 4, 5)


def test_staged_decode_batch_is_the_padded_batch_in_one_buffer():
    """The decode graph's inputs (one buffer, filled through its host twin) hold the batch's rows, then the padding
    rule (input 0, position 0, slot -1, one token, block 0, one query each), step after step: a later, smaller batch
    leaves no trace of an earlier, larger one. pad_decode_batch is the same thing on the host."""
    from export.batch import TENSOR_FIELDS
    from export.runtime.backends import StagedDecodeBatch

    def expect(batch, rows, width):
        S, w = batch.num_seqs, batch.block_table.shape[1]
        table = torch.zeros(rows, width, dtype=torch.int32)
        table[:S, :w] = batch.block_table
        pad = lambda t, v: torch.cat([t, torch.full((rows - S,), v, dtype=t.dtype)])  # noqa: E731
        return dict(input_ids=pad(batch.input_ids, 0), positions=pad(batch.positions, 0),
                    slot_mapping=pad(batch.slot_mapping, -1), block_table=table, seq_lens=pad(batch.seq_lens, 1),
                    cu_seqlens_q=torch.arange(rows + 1, dtype=torch.int32))

    staged = StagedDecodeBatch(8, 5, "cpu")
    empty = expect(_decode_batch([1], 4, [[0]]), 8, 5)
    for f in TENSOR_FIELDS[2:]:  # before any load: all padding (input_ids / positions of padding rows are 0)
        assert torch.equal(getattr(staged.device_batch, f)[1:], empty[f][1:]), f
    for batch in (_decode_batch([5, 1, 9], 4, [[3, 7], [2], [8, 1, 4]]), _decode_batch([6], 4, [[3, 7]])):
        staged.load(batch)
        want = expect(batch, 8, 5)
        for got in (staged.device_batch, pad_decode_batch(batch, 8, 5)):
            for f in TENSOR_FIELDS:
                assert getattr(got, f).dtype == want[f].dtype and torch.equal(getattr(got, f), want[f]), f
            assert got.max_seqlen_q == 1
    with pytest.raises(ValueError, match="exceeds the padded shape"):
        StagedDecodeBatch(1, 5, "cpu").load(_decode_batch([5, 1], 4, [[3, 7], [2]]))


def test_cuda_graphs_need_cuda(tiny_model):
    with pytest.raises(ValueError, match="CUDA device"):
        TorchBackend(tiny_model, num_blocks=4, block_size=4, cuda_graphs=True)

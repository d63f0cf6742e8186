"""Backend plumbing that runs on CPU: decode and prefill padding for static (CUDA-graph / engine) shapes, the prefill
graph buckets, and the TensorRT backend's refusal when TensorRT is missing."""

from pathlib import Path

import pytest
import torch

from export.batch import Batch
from export.runtime.backends import StagedBatch, TorchBackend, pad_batch, pad_decode_batch
from tests.helpers import prefill_batch


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


def _restore(kv_cache, snapshot):
    for (k, v), (k0, v0) in zip(kv_cache, snapshot):
        k.copy_(k0)
        v.copy_(v0)


def _check_only_real_slots_written(kv_cache, snapshot, after_real, slot_mapping):
    """``kv_cache`` after a padded step: the real tokens' slots hold what the unpadded step wrote (``after_real``; fp32,
    1e-5 as for the logits), every other slot what it held before (``snapshot``): padding wrote nothing."""
    slots = snapshot[0][0].shape[0] * snapshot[0][0].shape[1]
    real = torch.zeros(slots, dtype=torch.bool)
    real[slot_mapping.long()] = True
    for (k, v), (k0, v0), (k1, v1) in zip(kv_cache, snapshot, after_real):
        for new, old, ref in ((k, k0, k1), (v, v0, v1)):
            new, old, ref = (t.view(slots, -1) for t in (new, old, ref))
            assert torch.equal(new[~real], old[~real]), "padding wrote into the cache"
            torch.testing.assert_close(new[real], ref[real], rtol=1e-5, atol=1e-5)


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
    _restore(backend.kv_cache, snapshot)
    padded = pad_decode_batch(batch, 8, 5)
    assert padded.block_table.shape == (8, 5) and padded.slot_mapping[3:].eq(-1).all()
    got = backend.forward(padded)
    assert torch.isfinite(got).all()
    # Same math on the same rows: only the padding around them differs, so the real rows must agree closely
    # (fp32; 1e-5 absorbs a different reduction order if a kernel splits work by batch shape).
    torch.testing.assert_close(got[:3], want, rtol=1e-5, atol=1e-5)
    _check_only_real_slots_written(backend.kv_cache, snapshot, after_real, batch.slot_mapping)


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

    def expect(batch, rows, width):
        S, w = batch.num_seqs, batch.block_table.shape[1]
        table = torch.zeros(rows, width, dtype=torch.int32)
        table[:S, :w] = batch.block_table
        pad = lambda t, v: torch.cat([t, torch.full((rows - S,), v, dtype=t.dtype)])  # noqa: E731
        return dict(input_ids=pad(batch.input_ids, 0), positions=pad(batch.positions, 0),
                    slot_mapping=pad(batch.slot_mapping, -1), block_table=table, seq_lens=pad(batch.seq_lens, 1),
                    cu_seqlens_q=torch.arange(rows + 1, dtype=torch.int32))

    staged = StagedBatch(8, 8, 5, "cpu", 1)
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
        StagedBatch(1, 1, 5, "cpu", 1).load(_decode_batch([5, 1], 4, [[3, 7], [2]]))


def test_cuda_graphs_need_cuda(tiny_model):
    with pytest.raises(ValueError, match="CUDA device"):
        TorchBackend(tiny_model, num_blocks=4, block_size=4, cuda_graphs=True)


def test_staged_prefill_batch_layout():
    """A prefill padded to a graph's shape: the real tokens and sequences first, then the padding tokens (input 0,
    position 0, slot -1) spread evenly over the padding sequences (length = its tokens, block 0); a later, smaller
    batch leaves no trace of an earlier one."""
    staged = StagedBatch(16, 4, 5, "cpu", 16, max_seq_len=20)  # 5 blocks of 4
    assert staged.device_batch.max_seqlen_q == 16
    big = prefill_batch([3, 5, 2], [0, 4, 0])  # 10 tokens, 3 sequences, 1 spare
    small = prefill_batch([3, 5], [0, 4])  # 8 tokens, 2 sequences, 2 spare
    for batch, cu, lens in ((big, [0, 3, 8, 10, 16], [3, 9, 2, 6]), (small, [0, 3, 8, 12, 16], [3, 9, 4, 4]),
                            (big, [0, 3, 8, 10, 16], [3, 9, 2, 6])):
        for got in (staged, None):
            if got is None:
                got = pad_batch(batch, 16, 4, 5, 16, 20)
            else:
                got.load(batch)
                got = got.device_batch
            T, S = batch.input_ids.shape[0], batch.num_seqs
            assert torch.equal(got.input_ids[:T], batch.input_ids) and not got.input_ids[T:].any()
            assert torch.equal(got.positions[:T], batch.positions) and not got.positions[T:].any()
            assert torch.equal(got.slot_mapping[:T], batch.slot_mapping) and got.slot_mapping[T:].eq(-1).all()
            assert torch.equal(got.block_table[:S, :3], batch.block_table) and not got.block_table[S:].any()
            assert not got.block_table[:, 3:].any()
            assert got.cu_seqlens_q.tolist() == cu and got.seq_lens.tolist() == lens


def test_staged_prefill_batch_refuses_what_does_not_fit():
    batch = prefill_batch([3, 5], [0, 4])
    with pytest.raises(ValueError, match="spare sequence"):
        pad_batch(batch, 16, 2, 5, 16)  # 8 padding tokens and no sequence to own them
    pad_batch(prefill_batch([8, 8]), 16, 2, 5, 16)  # no padding tokens: fits
    with pytest.raises(ValueError, match="exceeds the padded shape"):
        pad_batch(batch, 6, 3, 5, 6)  # 8 tokens
    with pytest.raises(ValueError, match="exceeds the padded shape"):
        pad_batch(batch, 16, 4, 2, 16)  # 3 blocks
    with pytest.raises(ValueError, match="at most 3 in each"):
        pad_batch(batch, 16, 4, 5, 16, max_seq_len=3)  # 8 padding tokens in 2 sequences
    with pytest.raises(ValueError, match="at most 4 in each"):  # a padding sequence longer than the bound
        pad_batch(prefill_batch([3, 3]), 16, 3, 5, 4, 20)  # 10 padding tokens in 1
    with pytest.raises(ValueError, match="exceeds the bound"):
        pad_batch(batch, 16, 4, 5, 4)
    with pytest.raises(ValueError, match="decode .* or a prefill"):
        StagedBatch(8, 4, 5, "cpu", 1)
    # more sequences than tokens is a prefill shape too (many short prompts): one padding token per padding sequence
    # while they last, then sequences of none
    got = pad_batch(batch, 16, 32, 5, 16)
    assert got.cu_seqlens_q.tolist() == [0, 3, 8, *range(9, 17), *[16] * 22] and got.seq_lens[2:].eq(1).all()


def test_padded_prefill_equals_unpadded_and_padding_writes_nothing(tiny_model):
    """The padding rule keeps a prefill's real rows: a chunked prefill (a cached prefix) and a fresh prompt padded to
    a graph bucket give the unpadded logits and cache writes; padding writes no cache slot."""
    bs = 4
    backend = TorchBackend(tiny_model, num_blocks=16, block_size=bs)
    for k, v in backend.kv_cache:  # random history (the second sequence's 4 cached tokens among it)
        k.normal_()
        v.normal_()
    batch = prefill_batch([3, 6], [0, 4], bs)
    snapshot = [(k.clone(), v.clone()) for k, v in backend.kv_cache]
    want = backend.forward(batch)
    after_real = [(k.clone(), v.clone()) for k, v in backend.kv_cache]
    _restore(backend.kv_cache, snapshot)
    got = backend.forward(pad_batch(batch, 32, 4, 5, 32, 5 * bs))  # 23 padding tokens, 12 and 11 in two sequences
    assert got.shape[0] == 4 and torch.isfinite(got).all()
    # fp32, the same math on the same rows (as the decode padding test): 1e-5 absorbs a reduction order that depends
    # on the number of rows
    torch.testing.assert_close(got[:2], want, rtol=1e-5, atol=1e-5)
    _check_only_real_slots_written(backend.kv_cache, snapshot, after_real, batch.slot_mapping)


def test_prefill_graph_buckets():
    import inspect

    from export.runtime import Generator
    from export.runtime.backends import DEFAULT_PREFILL_GRAPH_TOKENS as B

    assert B[0] == 16 and all(b % 16 == 0 for b in B) and list(B) == sorted(set(B))
    # every step a default generator schedules has a bucket
    assert B[-1] == inspect.signature(Generator).parameters["max_num_batched_tokens"].default == 8192
    # 16 tokens apart up to 256, then never more than an eighth of a step padded
    assert all(b - a == 16 for a, b in zip(B, B[1:]) if b <= 256)
    assert all((b - a - 1) / (a + 1) < 0.125 for a, b in zip(B, B[1:]) if a >= 128)


def test_prefill_bucket_key(tiny_model):
    backend = TorchBackend(tiny_model, num_blocks=16, block_size=4, prefill_graph_tokens=(16, 64))
    W = backend._max_blocks_per_seq  # a prefill graph's block table is as wide as max_model_len
    assert backend._prefill_bucket(prefill_batch([3, 6], [0, 4])) == (16, 4, 16, W)
    assert backend._prefill_bucket(prefill_batch([16])) == (16, 2, 16, W)
    assert backend._prefill_bucket(prefill_batch([17])) == (64, 2, 64, W)
    assert backend._prefill_bucket(prefill_batch([65])) is None  # eager
    # the bound on a sequence's new tokens: the longest prompt's bucket (five of 10 tokens: 14 padding tokens in 3
    # spare sequences), unless a padding sequence is longer (three of 10: 34 padding tokens in the one spare)
    assert backend._prefill_bucket(prefill_batch([10] * 5)) == (64, 8, 16, W)
    assert backend._prefill_bucket(prefill_batch([10] * 3)) == (64, 4, 64, W)
    short = TorchBackend(tiny_model, num_blocks=16, block_size=4, prefill_graph_tokens=(64,), max_model_len=8)
    assert short._prefill_bucket(prefill_batch([3, 6], [0, 4])) is None  # 55 in 2 rows of 8
    with pytest.raises(ValueError, match="prefill_graph_after"):
        TorchBackend(tiny_model, num_blocks=4, block_size=4, prefill_graph_after=0)
    with pytest.raises(ValueError, match="max_prefill_graphs must be >= 0"):
        TorchBackend(tiny_model, num_blocks=4, block_size=4, max_prefill_graphs=-1)


def test_replay_loses_where_launching_eagerly_is_faster(tiny_model):
    """The rule that sends a prefill bucket's padded steps back to eager: its measured replay against the host time
    of launching its forward eagerly (no measurement yet: replay)."""
    backend = TorchBackend(tiny_model, num_blocks=4, block_size=4)
    key = (64, 2, 64, backend._max_blocks_per_seq)
    assert not backend._replay_loses(key)
    backend._prefill_host_ms[key] = 12.0  # the warm-up's launches before the capture
    assert not backend._replay_loses(key)  # replay not timed yet
    backend._replay_ms[key] = 1.5  # host-bound: the replay wins
    assert not backend._replay_loses(key)
    backend._replay_ms[key] = 31.0  # GPU-bound: eager costs its GPU time alone, the replay adds the padding
    assert backend._replay_loses(key)


def test_cpu_backend_takes_no_device_tokens(tiny_model):
    """Pipelined decode is for CUDA: on the CPU the property is False (it was a method object, always true)."""
    from export.runtime import Generator

    backend = TorchBackend(tiny_model, num_blocks=4, block_size=4)
    assert backend.supports_device_tokens is False
    assert Generator(backend).pipeline is False



def test_decode_graph_widths(tiny_model):
    """A decode step's table is padded to the narrowest width that holds it: 2048 tokens, then 4x wider, then
    max_model_len (the decode attention's split count follows the width: dev-logs/h200/decode_trim_splits.md)."""
    from export.runtime.backends import _decode_graph_widths

    assert _decode_graph_widths(8192, 16) == (128, 512)
    assert _decode_graph_widths(32768, 16) == (128, 512, 2048)
    assert _decode_graph_widths(2208, 16) == (128, 138)
    assert _decode_graph_widths(2048, 16) == (128,) and _decode_graph_widths(2049, 16) == (128, 129)
    assert _decode_graph_widths(64, 4, (8, 32)) == (2, 8, 16)
    backend = TorchBackend(tiny_model, num_blocks=64, block_size=4, max_model_len=64, decode_graph_widths=(8, 32),
                           graph_batch_sizes=(1, 2, 4))
    for lens, key in (([1], (1, 1, 1, 2)), ([8, 3], (2, 2, 1, 2)), ([9], (1, 1, 1, 8)), ([3, 30, 2], (4, 4, 1, 8)),
                      ([33], (1, 1, 1, 16)), ([64], (1, 1, 1, 16))):
        batch = prefill_batch([1] * len(lens), [n - 1 for n in lens])  # one new token after n - 1 cached
        assert batch.block_table.shape[1] == -(-max(lens) // 4)
        assert backend._decode_key(batch) == key, (lens, backend._decode_key(batch))


def test_the_loop_stops_at_the_directory_eos_tokens_without_a_tokenizer(tiny_dir, tmp_path):
    """The stop tokens come from the directory the model was loaded from (generation_config.json first, a list
    there), through TorchBackend to the generation loop: no tokenizer needed (token-id prompts stopped only at
    max_new_tokens before)."""
    import json
    import shutil

    from export.model import LlamaModel
    from export.runtime import Generator, SamplingParams

    def generate(path, **kw):
        model = LlamaModel.from_checkpoint(path, dtype=torch.float32)
        gen = Generator(TorchBackend(model, num_blocks=16, block_size=4))
        return model, gen.generate([[229, 269, 136, 34]], SamplingParams(max_new_tokens=4, **kw))[0]

    _, free = generate(tiny_dir, ignore_eos=True)
    stop = free.token_ids[1]
    ckpt = Path(shutil.copytree(tiny_dir, tmp_path / "ckpt"))
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [100000, stop]}))
    model, r = generate(ckpt)
    assert model.eos_token_ids == (100000, stop)
    assert r.finish_reason == "stop" and r.token_ids == free.token_ids[:free.token_ids.index(stop) + 1]
    assert model.for_cpu().eos_token_ids == model.eos_token_ids


def test_streamed_text_adds_up_to_the_result_text(tiny_dir):
    """The deltas ``on_token`` streams concatenate to each result's text: a trailing incomplete UTF-8 character (held
    back while a next token could complete it) is sent with a request's last token. Sampled requests over the tiny
    model's byte-level vocabulary end mid-character often."""
    from export.model import LlamaModel
    from export.runtime import Generator, SamplingParams
    from export.runtime.tokenizer import load_tokenizer

    model = LlamaModel.from_checkpoint(tiny_dir, dtype=torch.float32)
    gen = Generator(TorchBackend(model, num_blocks=64, block_size=4), load_tokenizer(tiny_dir))
    prompts = [[229, 269, 136, 34], [17, 40], [300, 5, 6]] * 8
    params = [SamplingParams(max_new_tokens=3 + i % 5, temperature=1.0, seed=i) for i in range(len(prompts))]
    streamed = [""] * len(prompts)

    def on_token(i, tok, delta):
        streamed[i] += delta

    results = gen.generate(prompts, params, on_token=on_token)
    assert [r.text for r in results] == streamed
    assert any(r.text.endswith("\ufffd") for r in results)  # the case this is about did occur

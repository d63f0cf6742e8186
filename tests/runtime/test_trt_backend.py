"""TensorRT backend: its feeds are exactly the ONNX graph's inputs (checked by running the reference ONNX in ONNX
Runtime on them, against the torch backend), profile and missing-TensorRT errors; the engine run itself is in the
``tensorrt`` tier (skipped where TensorRT is absent, which is everywhere this project runs today)."""

import json

import numpy as np
import pytest
import torch

from export.runtime.backends import TorchBackend
from export.runtime.trt_backend import TrtBackend, check_profile, engine_feeds, fitting_profile


def test_feeds_drive_the_exported_graph_like_the_torch_backend(tiny_dir, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    from export.model import LlamaModel, make_batch
    from export.onnx_export import attention_scratch, export_onnx

    model = LlamaModel.from_checkpoint(tiny_dir, dtype=torch.float32)
    block_size = 4
    path = export_onnx(model, path=str(tmp_path / "model.reference.onnx"), flavour="reference", block_size=block_size)
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    backend = TorchBackend(model, num_blocks=12, block_size=block_size)
    # Prefill 3 sequences of odd lengths, then one decode step: both step kinds through both runtimes.
    batch = make_batch([7, 1, 5], block_size=block_size, input_ids=torch.randint(0, 300, (13,)))
    nb = backend.num_blocks
    ort_cache = [(np.zeros_like(k.numpy()), np.zeros_like(v.numpy())) for k, v in backend.kv_cache]
    scratch = attention_scratch(model.config, 4, "cpu")  # a runtime's buffers, for more sequences than fed
    for step in range(2):
        feeds = engine_feeds(batch, ort_cache, scratch)
        assert set(feeds) == {i.name for i in sess.get_inputs()}, "feeds differ from the graph's inputs"
        for i in sess.get_inputs():
            assert len(i.shape) == feeds[i.name].ndim, i.name
        assert all(feeds[n].shape[0] == batch.num_seqs for n in scratch), "scratch fed for num_seqs sequences"
        np_feeds = {k: (v.numpy() if isinstance(v, torch.Tensor) else v) for k, v in feeds.items()}
        outs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, np_feeds)))
        want = backend.forward(batch)
        # Same fp32 math in two runtimes: differences are summation order only (~1e-6 on these O(1) logits).
        torch.testing.assert_close(torch.from_numpy(outs["logits"]), want, rtol=1e-4, atol=1e-4)
        ort_cache = [(outs[f"k_cache_out_{i}"], outs[f"v_cache_out_{i}"]) for i in range(len(ort_cache))]
        next_tok = want.argmax(-1)
        seq_lens = batch.seq_lens + 1
        batch = make_batch([1, 1, 1], cached_lens=batch.seq_lens.tolist(), block_size=block_size, input_ids=next_tok)
        assert torch.equal(batch.seq_lens, seq_lens) and nb >= batch.block_table.max() + 1


def test_a_step_runs_on_the_first_profile_that_holds_it(tiny_dir):
    """The engine's profiles as export.engine builds them (decode: one token per sequence, up to max_num_seqs;
    prefill: up to max_num_tokens packed tokens): a decode step takes the decode profile, a prefill chunk longer than
    max_num_seqs the prefill one, and one past every bound the prefill profile's error (what to rebuild)."""
    from export.engine import PROFILE_NAMES, dim_ranges
    from export.model import LlamaModel, make_batch
    from export.onnx_export import attention_scratch

    build = dict(max_num_tokens=64, max_num_seqs=4, num_blocks=32, max_blocks_per_seq=8)
    ranges = dim_ranges(build)
    dims = {"input_ids": ["num_tokens"], "seq_lens": ["num_seqs"], "cu_seqlens_q": ["num_seqs_plus_1"],
            "block_table": ["num_seqs", "max_blocks"]}
    profiles = [{n: tuple(tuple(ranges[name][d][k] for d in ds) for k in range(3)) for n, ds in dims.items()}
                for name in PROFILE_NAMES]
    config = LlamaModel.from_checkpoint(tiny_dir, dtype=torch.float32).config
    scratch = attention_scratch(config, 4, "cpu")

    def feeds(q_lens, cached):
        return engine_feeds(make_batch(q_lens, cached_lens=cached, block_size=4), [], scratch)

    assert fitting_profile(feeds([1, 1, 1], [5, 9, 2]), profiles) == PROFILE_NAMES.index("decode")
    assert fitting_profile(feeds([20, 3], [0, 0]), profiles) == PROFILE_NAMES.index("prefill")
    with pytest.raises(ValueError, match="outside the engine's profile"):
        fitting_profile(feeds([70], [0]), profiles)


def test_profile_refusal_says_what_to_rebuild():
    feeds = {"input_ids": torch.zeros(9, dtype=torch.int64), "seq_lens": torch.zeros(2, dtype=torch.int32)}
    check_profile(feeds, {"input_ids": ((1,), (4,), (16,))})
    with pytest.raises(ValueError, match="outside the engine's profile.*--max-tokens"):
        check_profile(feeds, {"input_ids": ((1,), (4,), (8,))})


def test_missing_engine_or_tensorrt_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="python -m export.build"):
        TrtBackend(tmp_path)
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        (tmp_path / "model.engine").write_bytes(b"not an engine")
        with pytest.raises(ImportError, match="TensorRT >= 10.9.*--backend torch"):
            TrtBackend(tmp_path)


@pytest.mark.tensorrt_engine
def test_engine_greedy_equals_torch_backend(tiny_dir, tmp_path):
    """Build the tiny model's engine and generate greedily with both backends (never run here: no TensorRT)."""
    import subprocess
    import sys

    from export.model import LlamaModel
    from export.runtime import Generator, SamplingParams
    from export.runtime.tokenizer import load_tokenizer

    out = tmp_path / "out"
    subprocess.run([sys.executable, "-m", "export.build", "--checkpoint", str(tiny_dir), "--out", str(out)],
                   check=True, timeout=900)
    block_size = json.loads((out / "build.json").read_text())["block_size"]
    tok = load_tokenizer(out)
    prompts = ["The quick brown", "x", "Paged attention keeps the key value cache in"]
    params = SamplingParams(max_new_tokens=32)
    want = Generator(TorchBackend(LlamaModel.from_output_dir(out, device="cuda"), block_size=block_size),
                     tok).generate(prompts, params)
    got = Generator(TrtBackend(out), tok).generate(prompts, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]

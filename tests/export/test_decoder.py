"""export.decoder: the one decoder walk. The weights it asks for are exactly what the checkpoint map produces (for
every model type), every backend implements every op of its interface, and a missing Qwen3 q/k norm is refused by
both the torch model and the exporter. (That the walk computes the HF model is test_model.py / test_onnx_export.py.)"""

import inspect

import pytest

from export.checkpoint import LlamaConfig, internal_names
from export.decoder import DecoderOps, NameRecorder, required_names

HF = {"vocab_size": 32, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 3,
      "num_attention_heads": 4, "num_key_value_heads": 2}
CONFIGS = {"llama": {"model_type": "llama"}, "tied": {"model_type": "llama", "tie_word_embeddings": True},
           "qwen2": {"model_type": "qwen2"}, "qwen3": {"model_type": "qwen3", "head_dim": 8},
           "mistral": {"model_type": "mistral", "sliding_window": None}}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_required_names_are_the_checkpoint_map(name):
    config = LlamaConfig.from_hf({**HF, **CONFIGS[name]})
    want = set(internal_names(config))
    if config.tie_word_embeddings:
        want.discard("lm_head")  # the walk falls back to the embedding
    got = required_names(config)
    assert len(got) == len(set(got)) and set(got) == want
    assert ("layers.2.q_norm" in got) == ("layers.2.k_norm" in got) == (name == "qwen3")
    assert ("layers.0.bqkv" in got) == (name == "qwen2")


def test_every_backend_implements_every_op():
    from export.gptq import CalibrationOps
    from export.model import CpuOps, TorchOps
    from export.onnx_export import OnnxOps

    ops = {n for n, _ in inspect.getmembers(DecoderOps, inspect.isfunction) if not n.startswith("_")}
    assert {"rms_norm", "head_rms_norm", "linear", "rope_write_kv_cache", "paged_attention"} <= ops
    for backend in (TorchOps, CpuOps, CalibrationOps, OnnxOps, NameRecorder):
        for op in ops:
            impl = getattr(backend, op, None)
            assert impl is not None and impl is not getattr(DecoderOps, op), f"{backend.__name__} lacks {op}"
            assert list(inspect.signature(impl).parameters) == list(inspect.signature(getattr(DecoderOps, op))
                                                                     .parameters), f"{backend.__name__}.{op}"


def test_missing_qk_norm_is_refused(tiny_dirs, tmp_path):
    from export.checkpoint import load_checkpoint
    from export.model import LlamaModel
    from export.onnx_export import export_onnx

    ckpt = load_checkpoint(tiny_dirs("qwen3"))
    weights = {k: v for k, v in ckpt.state_dict.items() if k != "layers.1.k_norm"}
    with pytest.raises(ValueError, match="lack 1 tensor"):
        LlamaModel(ckpt.config, weights)
    with pytest.raises(KeyError, match="layers.1.k_norm"):
        export_onnx(weights, ckpt.config, tmp_path / "m.onnx", "plugin")

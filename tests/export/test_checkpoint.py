"""export.checkpoint: config and weights of tiny HF checkpoints (made with transformers) land in our names exactly;
broken or unsupported checkpoints raise CheckpointError with a message that says what is wrong."""

import json
import os
import shutil

import pytest
import torch

from export.checkpoint import CheckpointError, LlamaConfig, internal_names, load_checkpoint
from tests.helpers import TINY_VARIANTS


def _hf_model(path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


@pytest.mark.parametrize("variant", list(TINY_VARIANTS))
def test_weights_match_hf_model(tiny_dirs, variant):
    path = tiny_dirs(variant)
    ckpt = load_checkpoint(path)
    model = _hf_model(path)
    hf = dict(model.named_parameters())
    hf.setdefault("lm_head.weight", model.get_output_embeddings().weight)  # tied: shared with embed_tokens
    cfg, hc = ckpt.config, model.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads,
            cfg.num_kv_heads) == (hc.vocab_size, hc.hidden_size, hc.intermediate_size, hc.num_hidden_layers,
                                  hc.num_attention_heads, hc.num_key_value_heads)
    # Qwen3's head_dim is its own config field (the tiny one: 32, not hidden / heads = 16)
    assert cfg.head_dim == (getattr(hc, "head_dim", None) or hc.hidden_size // hc.num_attention_heads)
    assert cfg.qk_norm == (variant == "qwen3")
    assert cfg.rms_norm_eps == hc.rms_norm_eps
    assert cfg.tie_word_embeddings == bool(TINY_VARIANTS[variant].get("tie_word_embeddings", False))
    assert cfg.attention_bias == (variant in ("qwen2", "bias"))
    names = internal_names(cfg)
    assert set(ckpt.state_dict) == set(names)
    # every parameter of HF's model is read (a dropped one, as o_proj's bias was, computes another model)
    assert {n for hf_names in names.values() for n in hf_names} == set(hf)
    for name, hf_names in names.items():
        want = torch.cat([hf[n].detach() for n in hf_names], dim=0)
        got = ckpt.state_dict[name]
        assert got.shape == want.shape, name
        assert torch.equal(got, want), f"{name} differs from {hf_names}"


def test_layout_of_fused_weights(tiny_llama_dir):
    ckpt = load_checkpoint(tiny_llama_dir)
    c = ckpt.config
    assert ckpt.state_dict["layers.0.wqkv"].shape == ((c.num_heads + 2 * c.num_kv_heads) * c.head_dim, c.hidden_size)
    assert ckpt.state_dict["layers.1.w13"].shape == (2 * c.intermediate_size, c.hidden_size)
    assert [p.name for p in ckpt.tokenizer_files][:2] == ["tokenizer.json", "tokenizer_config.json"]


def test_tied_lm_head_is_embed(tiny_dirs):
    ckpt = load_checkpoint(tiny_dirs("tied"))
    assert ckpt.state_dict["lm_head"] is ckpt.state_dict["embed"]


def test_sharded_checkpoint_has_index(tiny_dirs):
    path = tiny_dirs("sharded")
    assert (path / "model.safetensors.index.json").exists()
    assert len(list(path.glob("*.safetensors"))) > 1


def test_llama3_rope_scaling(tiny_dirs):
    cfg = load_checkpoint(tiny_dirs("llama3")).config
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.rope_scaling["factor"] == 8.0
    assert "rope_theta" not in cfg.rope_scaling  # only the scaling parameters, theta is its own field


def test_old_style_rope_config():
    hf = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
          "num_hidden_layers": 1, "num_attention_heads": 2, "rope_theta": 1e6,
          "rope_scaling": {"type": "linear", "factor": 2.0}}
    cfg = LlamaConfig.from_hf(hf)
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.num_kv_heads, cfg.head_dim) == \
        (1e6, {"rope_type": "linear", "factor": 2.0}, 2, 4)


def test_rope_scaling_wins_over_rope_parameters_as_in_transformers():
    """A transformers-5 config (``rope_parameters``) that also carries ``rope_scaling`` scales as transformers does
    (``rope_scaling or rope_parameters``), with the theta of ``rope_parameters``; we took the unscaled one."""
    hf = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
          "num_hidden_layers": 1, "num_attention_heads": 2,
          "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
          "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    cfg = LlamaConfig.from_hf(hf)
    assert (cfg.rope_theta, cfg.rope_scaling) == (5e5, {"rope_type": "linear", "factor": 4.0})


def test_dtype_cast(tiny_llama_dir):
    ckpt = load_checkpoint(tiny_llama_dir, dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in ckpt.state_dict.values())


# --- bad input -----------------------------------------------------------------------------------------------------
@pytest.fixture
def copy_of(tiny_llama_dir, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_llama_dir, dst)
    return dst


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _rewrite_weights(path, edit):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_missing_dir(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")


def test_no_config(copy_of):
    (copy_of / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_checkpoint(copy_of)


def test_bad_json(copy_of):
    (copy_of / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_checkpoint(copy_of)


def test_no_weights(copy_of):
    (copy_of / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_checkpoint(copy_of)


def test_missing_tensor(copy_of):
    _rewrite_weights(copy_of, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match="up_proj.weight' is missing"):
        load_checkpoint(copy_of)


def test_untied_without_lm_head(copy_of):
    _rewrite_weights(copy_of, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match="lm_head.weight' is missing"):
        load_checkpoint(copy_of)


def test_shape_mismatch(copy_of):
    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:-1].contiguous()

    _rewrite_weights(copy_of, edit)
    with pytest.raises(CheckpointError, match="k_proj.weight' has shape"):
        load_checkpoint(copy_of)


def test_missing_shard(tiny_dirs, tmp_path):
    dst = tmp_path / "sharded"
    shutil.copytree(tiny_dirs("sharded"), dst)
    sorted(dst.glob("model-*.safetensors"))[1].unlink()
    with pytest.raises(CheckpointError, match="missing"):
        load_checkpoint(dst)


@pytest.mark.parametrize("changes, match", [
    ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "model_type 'gpt2'"),
    ({"model_type": "mistral", "sliding_window": 4096}, "sliding-window"),
    ({"num_local_experts": 8}, "mixture-of-experts"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling 'yarn'"),
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, "bitsandbytes"),
])
def test_unsupported_architecture(copy_of, changes, match):
    _edit_config(copy_of, **changes)
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(copy_of)


def test_mistral_without_sliding_window_loads(copy_of):
    _edit_config(copy_of, model_type="mistral", sliding_window=None, architectures=["MistralForCausalLM"])
    assert load_checkpoint(copy_of).config.model_type == "mistral"


@pytest.mark.parametrize("name", ["model.safetensors", "tokenizer.json"])
def test_an_unreadable_file_is_refused_up_front_as_unreadable(tiny_dirs, monkeypatch, name):
    """A weight shard or tokenizer file this user cannot read: a CheckpointError before any work that says to make
    it readable (not "truncated or corrupt: re-download it", nor a disk hint after the weights were loaded). The
    tests may run as root, whom file modes do not stop, so ``open`` is what refuses here."""
    import builtins
    import errno

    from export.checkpoint import check_weight_files

    denied = tiny_dirs("llama") / name
    real_open = builtins.open

    def fake_open(file, *a, **k):
        if os.fspath(file) == os.fspath(denied):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(file))
        return real_open(file, *a, **k)

    monkeypatch.setattr(builtins, "open", fake_open)
    with pytest.raises(CheckpointError, match=f"cannot read {denied} \\(Permission denied\\); make it readable"):
        check_weight_files(tiny_dirs("llama"))

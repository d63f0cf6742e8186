"""A transformers model (``LlamaForCausalLM``, ``Qwen3ForCausalLM``, ... by model type) that runs on our internal
weights: the PyTorch baseline and the reference.

``hf_model(weights, config)`` builds the HF model on the meta device and assigns *views* of our tensors (rows of
``wqkv`` / ``w13`` split back into q/k/v and gate/up), so an 8B baseline costs no second copy of the weights.
Quantized linears (``kernels.quant.QuantizedWeight``) are dequantized: the reference for a quantized model is the
model it actually computes, so that tests do not count quantization error as a kernel or runtime error.
"""

from __future__ import annotations

import torch


def hf_state_dict(weights: dict, config) -> dict[str, torch.Tensor]:
    """HF parameter name -> tensor, views of ``weights`` (dequantized copies for quantized linears)."""
    from export.checkpoint import expected_shapes, internal_names

    shapes = expected_shapes(config)
    out = {}
    for name, hf_names in internal_names(config).items():
        w = weights[name]
        if not isinstance(w, torch.Tensor):
            from kernels.quant import dequantize

            w = dequantize(w, weights["embed"].dtype)
        for hf_name, part in zip(hf_names, w.split([shapes[n][0] for n in hf_names])):
            out[hf_name] = part
    return out


def hf_config(config):
    """Our ``LlamaConfig`` as the transformers config of its model type (``export.checkpoint.HF_CLASSES``)."""
    import transformers

    from export.checkpoint import HF_CLASSES

    config_cls, _ = HF_CLASSES[config.model_type]
    if config.attention_bias and config.model_type != "qwen2":
        raise ValueError(f"hf_model: a {config.model_type} config with q/k/v biases has no transformers model here")
    return getattr(transformers, config_cls)(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta, rope_scaling=config.rope_scaling,
        max_position_embeddings=config.max_position_embeddings, tie_word_embeddings=config.tie_word_embeddings,
        sliding_window=None)  # MistralConfig defaults to a window; the checkpoints we accept have none


def hf_model(weights: dict, config, attn_implementation: str = "sdpa"):
    """The transformers model of ``config.model_type`` (``LlamaForCausalLM``, ``Qwen3ForCausalLM``, ...) on views of
    ``weights`` (their device and dtype), in eval mode."""
    import transformers

    from export.checkpoint import HF_CLASSES

    cfg = hf_config(config)
    cfg._attn_implementation = attn_implementation
    embed = weights["embed"]
    with torch.device("meta"):
        model = getattr(transformers, HF_CLASSES[config.model_type][1])(cfg)
    sd = hf_state_dict(weights, config)
    if config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"HF model weights do not line up: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    # Buffers computed at construction (RoPE inverse frequencies) were made on the meta device: rebuild them.
    rotary = model.model.rotary_emb
    with torch.device(embed.device):
        model.model.rotary_emb = type(rotary)(config=cfg)
    # (no model.to(dtype): the parameters already are our tensors, and RoPE's inv_freq must stay fp32 as in HF)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_meta:
            raise RuntimeError(f"{name} is still on the meta device")
    return model.eval()

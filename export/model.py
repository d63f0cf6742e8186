"""The LLaMA forward in torch on our kernels (``torch.ops.tritrt.*``), over packed tokens and a paged KV cache.

One ``forward`` serves prefill, chunked prefill and decode (see ``export.batch.Batch``): each layer writes the new
tokens' K/V into the cache (``write_kv_cache_``) and attends to the cache (``paged_attention``). CUDA tensors run the
Triton kernels, CPU tensors the ops' torch references; the same module is what ``export.onnx_export`` traces and what
the runtime's torch backend runs. Weights use the internal names of ``export.checkpoint``; quantized linears are
``kernels.quant.QuantizedWeight`` and go through ``kernels.quant.linear``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from .batch import Batch
from .checkpoint import LlamaConfig, load_checkpoint

QUANT_MODES = ("none", "int8", "int4")


def _ops():
    """``torch.ops.tritrt`` with every op registered (importing kernels.ops registers them; it touches no GPU)."""
    import kernels.ops  # noqa: F401

    return torch.ops.tritrt


def rope_cache(config: LlamaConfig, device="cpu") -> torch.Tensor:
    """fp32 ``[max_position_embeddings, head_dim]`` = [cos | sin] table, with the config's rope scaling."""
    from kernels.rope import rope_cos_sin_cache

    cache = rope_cos_sin_cache(config.head_dim, config.max_position_embeddings, base=config.rope_theta,
                               scaling=config.rope_scaling)
    return cache.to(device=device, dtype=torch.float32)


def linear(x: torch.Tensor, w, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ w.T (+ bias)``; weight-only quantized ``w`` runs our W8A16 / W4A16 GEMM."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, bias)
    from kernels.quant import linear as qlinear

    return qlinear(x, w, bias)


class LlamaModel(torch.nn.Module):
    """LLaMA-family decoder on ``kernels.ops``; ``weights`` is the internal-name state dict it runs on."""

    def __init__(self, config: LlamaConfig, weights: dict, quant: str = "none", group_size: int = 128,
                 quantized: bool = False):
        """``quant`` != "none" quantizes the linear weights of ``weights`` unless ``quantized`` says they already are
        (``kernels.quant.QuantizedWeight``), as when loading a build output or a GPTQ/AWQ import. ``group_size`` is
        the largest int4 group size: each weight gets the largest one that divides its in_features
        (``export.quantize.choose_group_size``) and carries it; ``group_sizes`` says which."""
        super().__init__()
        if quant not in QUANT_MODES:
            raise ValueError(f"quant must be one of {QUANT_MODES}, got {quant!r}")
        missing = [n for n in required_names(config) if n not in weights]
        if missing:
            raise ValueError(f"weights lack {len(missing)} tensor(s), e.g. {missing[:3]}; load them with "
                             f"export.checkpoint.load_checkpoint")
        if quant != "none" and not quantized:
            from .quantize import quantize_state_dict

            weights = quantize_state_dict(weights, quant, group_size=group_size)
        self.config, self.quant, self.group_size = config, quant, group_size
        self.weights = dict(weights)
        embed = self.weights["embed"]
        self.dtype, self.device = embed.dtype, embed.device
        self.register_buffer("cos_sin_cache", rope_cache(config, embed.device), persistent=False)

    @property
    def group_sizes(self) -> dict:
        """The int4 group size of each projection, ``{"layers.*.wqkv": 64, "layers.*.w2": 32, ...}`` (collapsed over
        layers when they agree; see ``export.quantize.group_size_map``); empty unless quant is int4."""
        from .quantize import group_size_map

        return group_size_map(self.weights)

    # --- construction -------------------------------------------------------------------------------------------
    @classmethod
    def from_checkpoint(cls, path, quant: str = "none", dtype: Optional[torch.dtype] = None, device="cpu",
                        group_size: int = 128) -> "LlamaModel":
        """Load an HF checkpoint directory; ``dtype`` None keeps the checkpoint's dtype. A GPTQ/AWQ checkpoint is
        repacked with ``kernels.quant``'s importers (its own quant mode and group size win over ``quant``)."""
        ckpt = load_checkpoint(path, dtype=dtype)
        weights = {k: v.to(device) for k, v in ckpt.state_dict.items()}
        if ckpt.state_dict["lm_head"] is ckpt.state_dict["embed"]:
            weights["lm_head"] = weights["embed"]  # .to(device) made two copies of the tied tensor; keep one
        if ckpt.quantized_parts:
            from .quantize import import_quantized

            imported, quant, group_size = import_quantized(ckpt, device=device)
            weights.update(imported)
            return cls(ckpt.config, weights, quant=quant, group_size=group_size, quantized=True)
        return cls(ckpt.config, weights, quant=quant, group_size=group_size)

    @classmethod
    def from_output_dir(cls, out, device="cpu") -> "LlamaModel":
        """Load what ``python -m export.build`` wrote (build.json + config.json + weights.safetensors). The int4
        weights carry their own group sizes; build.json's ``group_size`` is the largest one allowed."""
        from .quantize import load_weights

        out = Path(out)
        for f in ("build.json", "config.json", "weights.safetensors"):
            if not (out / f).exists():
                raise FileNotFoundError(f"{out / f} is missing; is {out} an output of `python -m export.build`?")
        build = json.loads((out / "build.json").read_text())
        config = LlamaConfig.from_build(build, out)
        weights = load_weights(out / "weights.safetensors", device=device)
        return cls(config, weights, quant=build.get("quant", "none"), group_size=build.get("group_size") or 128,
                   quantized=True)

    def allocate_kv_cache(self, num_blocks: int, block_size: int, device=None, dtype=None):
        """One ``(k_cache, v_cache)`` per layer, each ``[num_blocks, block_size, num_kv_heads, head_dim]``."""
        c = self.config
        shape = (num_blocks, block_size, c.num_kv_heads, c.head_dim)
        device, dtype = device or self.device, dtype or self.dtype
        return [(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))
                for _ in range(c.num_layers)]

    # --- forward ------------------------------------------------------------------------------------------------
    def forward(self, batch: Batch, kv_cache, all_logits: bool = False) -> torch.Tensor:
        """Logits ``[S, vocab]`` of each sequence's last new token (``[T, vocab]`` with ``all_logits``); writes the
        new tokens' K/V into ``kv_cache`` in place."""
        return self.forward_tensors(batch.input_ids, batch.positions, batch.slot_mapping, batch.block_table,
                                    batch.seq_lens, batch.cu_seqlens_q, batch.max_seqlen_q, kv_cache,
                                    all_logits=all_logits)

    def forward_tensors(self, input_ids, positions, slot_mapping, block_table, seq_lens, cu_seqlens_q,
                        max_seqlen_q: int, kv_cache, all_logits: bool = False) -> torch.Tensor:
        """``forward`` on the graph's inputs (the exporter traces this signature)."""
        ops, c, w = _ops(), self.config, self.weights
        if len(kv_cache) != c.num_layers:
            raise ValueError(f"kv_cache has {len(kv_cache)} layers, the model {c.num_layers}")
        t = input_ids.shape[0]
        scale = c.head_dim ** -0.5
        x = F.embedding(input_ids, w["embed"])
        residual = None
        for i, (k_cache, v_cache) in enumerate(kv_cache):
            p = f"layers.{i}."
            # The first norm has nothing to add; every later one fuses the residual add into the norm.
            if residual is None:
                h, residual = ops.rms_norm(x, w[p + "attn_norm"], c.rms_norm_eps), x
            else:
                h, residual = ops.fused_add_rms_norm(x, residual, w[p + "attn_norm"], c.rms_norm_eps)
            qkv = linear(h, w[p + "wqkv"], w.get(p + "bqkv"))
            q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
            q = q.reshape(t, c.num_heads, c.head_dim)
            k = k.reshape(t, c.num_kv_heads, c.head_dim)
            v = v.reshape(t, c.num_kv_heads, c.head_dim)
            q, k = ops.rotary_embedding(q, k, positions, self.cos_sin_cache, False)
            ops.write_kv_cache_(k, v, k_cache, v_cache, slot_mapping)
            attn = ops.paged_attention(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, max_seqlen_q,
                                       scale)
            x = linear(attn.reshape(t, c.q_size), w[p + "wo"])
            h, residual = ops.fused_add_rms_norm(x, residual, w[p + "mlp_norm"], c.rms_norm_eps)
            x = linear(ops.swiglu(linear(h, w[p + "w13"]), None), w[p + "w2"])
        h, _ = ops.fused_add_rms_norm(x, residual, w["norm"], c.rms_norm_eps)
        if not all_logits:
            h = h[(cu_seqlens_q[1:] - 1).long()]  # only the last new token of each sequence samples
        return F.linear(h, w["lm_head"])


def required_names(config: LlamaConfig) -> list[str]:
    names = ["embed", "norm", "lm_head"]
    for i in range(config.num_layers):
        names += [f"layers.{i}.{n}" for n in ("attn_norm", "wqkv", "wo", "mlp_norm", "w13", "w2")]
        if config.attention_bias:
            names.append(f"layers.{i}.bqkv")
    return names


def make_batch(prompt_lens, cached_lens=None, block_size: int = 16, device="cpu", input_ids=None,
               blocks_per_seq=None, block_offset: int = 0) -> Batch:
    """A ``Batch`` for sequences with ``prompt_lens[i]`` new tokens after ``cached_lens[i]`` cached ones, each
    sequence owning ``blocks_per_seq`` consecutive cache blocks (sequence i starts at block ``block_offset + i *
    blocks_per_seq``; default: just enough). ``input_ids`` (packed) default to zeros. For tests, examples and the
    exporter's sample inputs; the runtime allocates blocks itself."""
    cached_lens = list(cached_lens or [0] * len(prompt_lens))
    totals = [c + n for c, n in zip(cached_lens, prompt_lens)]
    need = max(1, max(-(-n // block_size) for n in totals))
    blocks_per_seq = blocks_per_seq or need
    if blocks_per_seq < need:
        raise ValueError(f"blocks_per_seq={blocks_per_seq} cannot hold {max(totals)} tokens of {block_size} per block")
    positions, slots, cu = [], [], [0]
    table = torch.zeros(len(prompt_lens), blocks_per_seq, dtype=torch.int32)
    for i, (c, n) in enumerate(zip(cached_lens, prompt_lens)):
        first = block_offset + i * blocks_per_seq
        table[i] = torch.arange(first, first + blocks_per_seq, dtype=torch.int32)
        pos = list(range(c, c + n))
        positions += pos
        slots += [(first + p // block_size) * block_size + p % block_size for p in pos]
        cu.append(cu[-1] + n)
    t = cu[-1]
    ids = torch.zeros(t, dtype=torch.int64) if input_ids is None else torch.as_tensor(input_ids, dtype=torch.int64)
    return Batch(input_ids=ids, positions=torch.tensor(positions, dtype=torch.int64),
                 slot_mapping=torch.tensor(slots, dtype=torch.int32), block_table=table,
                 seq_lens=torch.tensor(totals, dtype=torch.int32), cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
                 max_seqlen_q=max(prompt_lens)).to(device)

"""The LLaMA-family model in torch on our kernels (``torch.ops.tritrt.*``), over packed tokens and a paged KV cache.

What a layer computes is ``export.decoder.decoder_forward`` (defined once, shared with the ONNX exporter); this module
runs it on ``TorchOps``, which maps each decoder op to a ``torch.ops.tritrt`` op (its implementation, called directly).
One ``forward`` serves prefill, chunked prefill and decode (see ``export.batch.Batch``): each layer writes the new
tokens' rotated K and their V into the cache (``rope_write_kv_cache_``, RoPE in the same kernel) and attends to the
cache (``paged_attention``). CUDA tensors run the Triton kernels, CPU tensors the ops' torch references; the
runtime's torch backend runs this module. Weights use the internal names of ``export.checkpoint``; quantized linears
are ``kernels.quant.QuantizedWeight`` and go through ``kernels.quant.linear``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from . import QUANT_MODES
from .batch import Batch
from .checkpoint import LlamaConfig, eos_token_ids, load_checkpoint
# required_names: public here too
from .decoder import (GATE_UP_PAIRS, SplitQkv, decoder_forward, gate_up_pairs, missing_weights,  # noqa: F401
                      required_names)


def _ops():
    """The ``torch.ops.tritrt`` ops' implementations, called without torch.library's dispatch (``kernels.ops.eager``:
    the same code, ~70-150 us less host time a call on the lent H100, which kept a 2k int4 prefill host-bound).
    Importing kernels.ops registers the ops too; it touches no GPU."""
    import kernels.ops

    return kernels.ops.eager


def rope_cache(config: LlamaConfig, device="cpu") -> torch.Tensor:
    """fp32 ``[max_position_embeddings, head_dim]`` = [cos | sin] table, with the config's rope scaling."""
    from kernels.rope import rope_cos_sin_cache

    cache = rope_cos_sin_cache(config.head_dim, config.max_position_embeddings, base=config.rope_theta,
                               scaling=config.rope_scaling)
    return cache.to(device=device, dtype=torch.float32)


def linear(x: torch.Tensor, w, bias: Optional[torch.Tensor] = None, ops=None) -> torch.Tensor:
    """``x @ w.T (+ bias)`` through ``ops`` (default ``torch.ops.tritrt``): an unquantized ``w`` on CUDA runs the
    ``linear`` op (our fp16 GEMV at decode sizes, else cuBLAS; ``F.linear`` off CUDA), a weight-only quantized one our
    W8A16 / W4A16 GEMM."""
    if isinstance(w, torch.Tensor):
        if not x.is_cuda or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)):
            return F.linear(x, w, bias)  # the op has no backward
        import kernels.ops  # noqa: F401  (registers torch.ops.tritrt.*)

        return (torch.ops.tritrt if ops is None else ops).linear(x, w, bias)
    from kernels.quant import linear as qlinear

    return qlinear(x, w, bias, ops=ops)


class LlamaModel(torch.nn.Module):
    """LLaMA-family decoder on ``kernels.ops``; ``weights`` is the internal-name state dict it runs on."""

    # The stop tokens of the directory it was loaded from (generation_config.json / config.json), which a backend
    # over this model hands to the generation loop: a model built from weights alone has none.
    eos_token_ids: tuple[int, ...] = ()

    def __init__(self, config: LlamaConfig, weights: dict, quant: str = "none", group_size: int = 128,
                 quantized: bool = False, lm_head_quant: str = "none"):
        """``quant`` != "none" quantizes the linear weights of ``weights`` unless ``quantized`` says they already are
        (``kernels.quant.QuantizedWeight``), as when loading a build output or a GPTQ/AWQ import. ``group_size`` is
        the largest int4 group size: each weight gets the largest one that divides its in_features
        (``export.quantize.choose_group_size``) and carries it; ``group_sizes`` says which. ``lm_head_quant`` !=
        "none" quantizes the (float) lm_head too (``export.quantize.quantize_lm_head``); a loaded one keeps its own."""
        super().__init__()
        if quant not in QUANT_MODES:
            raise ValueError(f"quant must be one of {QUANT_MODES}, got {quant!r}")
        missing = missing_weights(config, weights)
        if missing:
            raise ValueError(f"weights lack {len(missing)} tensor(s), e.g. {missing[:3]}; load them with "
                             f"export.checkpoint.load_checkpoint")
        if quant != "none" and not quantized:
            from .quantize import quantize_state_dict

            weights = quantize_state_dict(weights, quant, group_size=group_size)
        if lm_head_quant != "none":
            from .quantize import quantize_lm_head

            weights = quantize_lm_head(weights, lm_head_quant, group_size)
            if config.tie_word_embeddings:  # the head is its own weight now, as the build's config.json says
                config = dataclasses.replace(config, tie_word_embeddings=False)
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

    @property
    def lm_head_quant(self) -> str:
        """"int8" / "int4" where the lm_head is quantized, else "none"."""
        w = self.weights.get("lm_head")
        return "none" if w is None or isinstance(w, torch.Tensor) else f"int{w.bits}"

    def fuse_swiglu_(self) -> "LlamaModel":
        """Re-lay each quantized gate/up weight (``layers.{i}.w13``, ``[gate | up]`` columns) out as (gate, up) column
        pairs under ``layers.{i}.w13_pairs`` (``export.decoder.GATE_UP_PAIRS``, ``kernels.quant.interleave_halves``),
        so that the gate/up GEMM applies SwiGLU in its epilogue instead of writing ``[T, 2I]`` for the activation
        kernel to read back. In place, one layer's copy at a time (the ``[gate | up]`` weight is dropped); plain
        (unquantized) gate/up weights stay as they are. Returns ``self``.

        Why (H100, ``benchmarks/results/dev-logs/h100/fused_swiglu.md``, gate/up of five 1B-70B models): the fused
        GEMM against the GEMM + activation kernel, W4A16 1.03-1.10x at M = 1-8 (the tensor-core GEMV), 1.00-1.16x at
        M = 32-128, 0.98-1.05x at 512-2048 (geometric means 0.99-1.03x); W8A16 1.00-1.18x from M = 32, and since its
        GEMV took the epilogue too 1.02-1.09x at M = 1-4 (``dev-logs/h100/w8_gemv_swiglu.md``); the GEMV now takes
        every M up to 16 with it (H200, ``dev-logs/h200/w8_gemv_m5_8.md``: 1.24-1.46x Triton + the activation kernel
        at M = 9..16). A fused model runs; it is not a build artifact:
        ``export_onnx`` and ``save_weights`` refuse its weights (saved files keep the checkpoint's layout; the ONNX
        exporter makes the same pairs itself for its plugin graph, ``export.onnx_export``)."""
        from kernels.quant import interleave_halves

        for pairs, w13 in gate_up_pairs(self.weights).items():  # none left once fused; plain weights stay
            self.weights[pairs] = interleave_halves(self.weights.pop(w13))
        return self

    @property
    def swiglu_fused(self) -> bool:
        """Whether ``fuse_swiglu_`` re-laid out any gate/up weight."""
        return any(k.endswith("." + GATE_UP_PAIRS) for k in self.weights)

    # --- construction -------------------------------------------------------------------------------------------
    @classmethod
    def from_checkpoint(cls, path, quant: str = "none", dtype: Optional[torch.dtype] = None, device="cpu",
                        group_size: int = 128, lm_head_quant: str = "none") -> "LlamaModel":
        """Load an HF checkpoint directory; ``dtype`` None keeps the checkpoint's dtype. A GPTQ/AWQ checkpoint is
        repacked with ``kernels.quant``'s importers (its own quant mode and group size win over ``quant``; its float
        lm_head is quantized as ``lm_head_quant`` says, like any other's)."""
        ckpt = load_checkpoint(path, dtype=dtype)
        weights = {k: v.to(device) for k, v in ckpt.state_dict.items()}
        if ckpt.state_dict["lm_head"] is ckpt.state_dict["embed"]:
            weights["lm_head"] = weights["embed"]  # .to(device) made two copies of the tied tensor; keep one
        if ckpt.quantized_parts:
            from .quantize import import_quantized

            imported, quant, group_size = import_quantized(ckpt, device=device)
            weights.update(imported)
            model = cls(ckpt.config, weights, quant=quant, group_size=group_size, quantized=True,
                        lm_head_quant=lm_head_quant)
        else:
            model = cls(ckpt.config, weights, quant=quant, group_size=group_size, lm_head_quant=lm_head_quant)
        model.eos_token_ids = eos_token_ids(path)
        return model

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
        model = cls(config, weights, quant=build.get("quant", "none"), group_size=build.get("group_size") or 128,
                    quantized=True)
        model.eos_token_ids = eos_token_ids(out)
        return model

    def for_cpu(self) -> "LlamaModel":
        """This model as a CPU runs it well: quantized weights dequantized once to float32 (the exact values the GPU
        kernels multiply by) and float32 math. On the CPU every op runs its torch reference, where float16 matmuls are
        slow and dequantizing int4 weights again at every step costs more than the matmul itself."""
        from kernels.quant import dequantize

        weights = {}
        for k, v in self.weights.items():
            w = v.float() if isinstance(v, torch.Tensor) else dequantize(v, torch.float32)
            if k.endswith("." + GATE_UP_PAIRS):  # (gate, up) row pairs -> [gate | up]: the CPU model runs unfused
                k, w = k[:-len(GATE_UP_PAIRS)] + "w13", torch.cat([w[0::2], w[1::2]])
            weights[k] = w
        if self.weights.get("lm_head") is self.weights["embed"]:
            weights["lm_head"] = weights["embed"]
        model = LlamaModel(self.config, weights)
        model.eos_token_ids = self.eos_token_ids
        return model

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
        """``forward`` on the graph's inputs: ``export.decoder.decoder_forward`` on ``TorchOps``."""
        if len(kv_cache) != self.config.num_layers:
            raise ValueError(f"kv_cache has {len(kv_cache)} layers, the model {self.config.num_layers}")
        # A float32 model on the CPU (what for_cpu() makes) runs CpuOps; everything else the torch.ops.tritrt ops.
        cpu = self.device.type == "cpu" and self.dtype == torch.float32
        ops = (CpuOps if cpu else TorchOps)(self.weights, self.cos_sin_cache)
        return decoder_forward(ops, self.config, input_ids, positions,
                               slot_mapping, block_table, seq_lens, cu_seqlens_q, max_seqlen_q, kv_cache,
                               all_logits=all_logits)


class TorchOps(SplitQkv):
    """``export.decoder.DecoderOps`` on torch tensors: the ``torch.ops.tritrt`` ops' implementations called directly
    (``_ops``; CUDA: our kernels; CPU: their fp32 references); weights resolved by internal name from ``weights``."""

    def __init__(self, weights: dict, cos_sin_cache: torch.Tensor):
        self.w, self.cos_sin_cache, self.ops = weights, cos_sin_cache, _ops()

    def has_weight(self, name):
        return name in self.w

    def embedding(self, input_ids, weight):
        return F.embedding(input_ids, self.w[weight])

    def rms_norm(self, x, weight, eps):
        return self.ops.rms_norm(x, self.w[weight], eps)

    def head_rms_norm(self, x, weight, eps):
        return self.ops.rms_norm(x.reshape(-1, x.shape[-1]), self.w[weight], eps).reshape(x.shape)

    def fused_add_rms_norm(self, x, residual, weight, eps, name):
        return self.ops.fused_add_rms_norm(x, residual, self.w[weight], eps)

    def linear(self, x, weight, bias=None):
        return linear(x, self.w[weight], None if bias is None else self.w[bias], self.ops)

    def split_heads(self, x, heads, head_dim, name):
        parts = x.split([h * head_dim for h in heads], dim=-1)
        return [part.reshape(x.shape[0], h, head_dim) for part, h in zip(parts, heads)]

    def merge_heads(self, x, size):
        return x.reshape(x.shape[0], size)

    def rope_write_kv_cache(self, q, k, v, positions, layer, caches, slot_mapping, name):
        q = self.ops.rope_write_kv_cache_(q, k, v, positions, self.cos_sin_cache, caches[0], caches[1], slot_mapping,
                                          False)
        return q, caches

    def paged_attention(self, q, caches, block_table, seq_lens, cu_seqlens_q, max_seqlen_q, scale, name):
        return self.ops.paged_attention(q, caches[0], caches[1], block_table, seq_lens, cu_seqlens_q, max_seqlen_q,
                                        scale)

    def swiglu(self, gate_up, intermediate, name):
        return self.ops.swiglu(gate_up, None)

    def linear_swiglu(self, x, weight, intermediate, name):
        # a quantized weight of (gate, up) column pairs (fuse_swiglu_): SwiGLU in the GEMM's epilogue where the routed
        # kernel has one (kernels.gemm.routing), else right after it
        from kernels.quant import linear as qlinear

        return qlinear(x, self.w[weight], swiglu=True, ops=self.ops)

    def last_tokens(self, h, cu_seqlens_q):
        return h[(cu_seqlens_q[1:] - 1).long()]

    def lm_head(self, h, weight):
        return linear(h, self.w[weight], ops=self.ops)  # quantized: export.quantize.quantize_lm_head


class CpuOps(TorchOps):
    """``TorchOps`` for a float32 model on the CPU: the ops' CPU math as direct torch calls, without the custom-op
    dispatch, checks and fp32 upcasts of ``torch.ops.tritrt`` (a no-op on float32 that costs a few tensor ops each).

    On SmolLM2-135M these took ~25 ms of a ~70 ms decode step on 2 cores next to ~35 ms of matmuls. The RoPE table
    rows are looked up once per step instead of once per layer, and q and k rotate in one pass. Results equal
    ``TorchOps`` on the CPU to fp32 rounding (``tests/export/test_cpu_ops.py``).
    """

    def __init__(self, weights: dict, cos_sin_cache: torch.Tensor):
        super().__init__(weights, cos_sin_cache)
        self._rope_rows = None  # (positions, cos [T, 1, D], signed sin [T, 1, D]) of this step

    def rms_norm(self, x, weight, eps):
        return F.rms_norm(x, (x.shape[-1],), self.w[weight], eps)

    def head_rms_norm(self, x, weight, eps):
        return F.rms_norm(x, (x.shape[-1],), self.w[weight], eps)

    def fused_add_rms_norm(self, x, residual, weight, eps, name):
        res = x + residual
        return F.rms_norm(res, (res.shape[-1],), self.w[weight], eps), res

    def rope_write_kv_cache(self, q, k, v, positions, layer, caches, slot_mapping, name):
        from kernels.attention_cpu import write_kv_cache_cpu
        from kernels.rope import cos_sin_rows

        # Non-interleaved (rotate-half) RoPE over the whole head: x * [cos|cos] + roll(x, D/2) * [-sin|sin].
        if self._rope_rows is None or self._rope_rows[0] is not positions:
            cos, sin = cos_sin_rows(self.cos_sin_cache, positions).chunk(2, dim=-1)
            self._rope_rows = (positions, torch.cat([cos, cos], -1)[:, None], torch.cat([-sin, sin], -1)[:, None])
        _, cos, sin = self._rope_rows
        qk = torch.cat([q, k], dim=1)
        qk = qk * cos + qk.roll(qk.shape[-1] // 2, dims=-1) * sin
        write_kv_cache_cpu(qk[:, q.shape[1]:], v, caches[0], caches[1], slot_mapping)
        return qk[:, :q.shape[1]], caches

    def paged_attention(self, q, caches, block_table, seq_lens, cu_seqlens_q, max_seqlen_q, scale, name):
        # What the op runs on CPU tensors, called directly: the op's first call imports torch._dynamo (~1-3 s here).
        if max_seqlen_q == 1 and q.shape[0] == seq_lens.shape[0]:  # decode: one new token per sequence
            from kernels.attention_cpu import paged_decode_attention_cpu

            return paged_decode_attention_cpu(q, caches[0], caches[1], block_table, seq_lens, scale)
        from kernels.attention_ref import paged_attention_ref

        return paged_attention_ref(q, caches[0], caches[1], block_table, seq_lens, cu_seqlens_q, max_seqlen_q, scale)

    def swiglu(self, gate_up, intermediate, name):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


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

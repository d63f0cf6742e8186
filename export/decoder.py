"""The decoder, defined once: one walk over the layers, written against a small ops interface (``DecoderOps``).

The torch model (``export.model.TorchOps``: ``torch.ops.tritrt`` on tensors) and both ONNX flavours
(``export.onnx_export.OnnxOps``: ``export.onnx_ops.OpEmitter`` writing plugin nodes or their standard-op
decompositions) implement the interface; ``decoder_forward`` is the only place that says what a layer computes, and
``required_names`` (the weights the walk asks for, recorded by running it on ``NameRecorder``) the only list of
weights. A new architecture is a branch here plus its config and weight map in ``export.checkpoint``.

Why an explicit interface rather than tracing the torch model with ``torch.onnx.export``: the emitter keeps exact
control over each plugin node (input order, every attribute, the cache outputs aliasing the cache inputs) and over the
reference decompositions that ONNX Runtime runs, which a translation table over a traced graph would have to recover
from ATen-level nodes; and the walk stays plain Python that a reader follows layer by layer, as gpt-fast's model does.

Values in the walk are opaque handles (tensors in torch, tensor names in ONNX): the walk only passes them between
ops. Weights are named, never held: each op receives the internal weight name (``layers.{i}.wqkv``) and the backend
resolves it (the torch model to its tensor, the emitter to an initializer, the recorder to a required name).
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence

Value = Any  # a backend's handle: torch.Tensor (torch), a tensor name (ONNX), None (recorder)
# A layer's gate/up weight as (gate, up) column pairs, in place of ``w13`` ([gate | up]): what the torch model runs
# after ``export.model.LlamaModel.fuse_swiglu_``; never in a checkpoint, a saved build or an ONNX graph.
GATE_UP_PAIRS = "w13_pairs"


class DecoderOps(Protocol):
    """What the walk needs from a backend. Shapes: T packed tokens, H heads, D head_dim, S sequences."""

    def has_weight(self, name: str) -> bool:
        """Whether an optional weight (a q/k/v bias of a GPTQ import) is present."""

    def embedding(self, input_ids: Value, weight: str) -> Value:
        """[T] ids -> [T, hidden] rows of ``weight``."""

    def rms_norm(self, x: Value, weight: str, eps: float) -> Value:
        """[T, N] -> [T, N]."""

    def fused_add_rms_norm(self, x: Value, residual: Value, weight: str, eps: float, name: str) -> tuple[Value, Value]:
        """(rms_norm(x + residual), x + residual)."""

    def head_rms_norm(self, x: Value, weight: str, eps: float) -> Value:
        """RMSNorm over the last dim of each head: [T, H, D] with a [D] weight (Qwen3's q_norm / k_norm)."""

    def linear(self, x: Value, weight: str, bias: Optional[str] = None) -> Value:
        """[T, K] @ W.T (+ bias) -> [T, N]; W plain or weight-only quantized."""

    def split_heads(self, x: Value, heads: Sequence[int], head_dim: int, name: str) -> list[Value]:
        """[T, sum(heads) * D] -> one [T, h, D] per entry of ``heads``."""

    def merge_heads(self, x: Value, size: int) -> Value:
        """[T, H, D] -> [T, H * D]."""

    def rope_write_kv_cache(self, q: Value, k: Value, v: Value, positions: Value, layer: int,
                            caches: tuple[Value, Value], slot_mapping: Value, name: str) -> tuple[Value, tuple]:
        """Rotate q [T, Hq, D] and k [T, Hk, D] at ``positions`` with the config's RoPE table and write the rotated k
        and v into layer ``layer``'s paged cache; returns (the rotated q, the caches to attend to). One op, since
        the rotated k goes nowhere but the cache: one kernel (and one plugin node) does both."""

    def qkv_rope_write_kv_cache(self, qkv: Value, heads: Sequence[int], head_dim: int, positions: Value, layer: int,
                                caches: tuple[Value, Value], slot_mapping: Value, name: str) -> tuple[Value, tuple]:
        """``rope_write_kv_cache`` of the q, k and v of one q|k|v projection output [T, sum(heads) * D] (``heads``:
        Hq, Hk, Hk). One method, so that a backend may read the three in place (the plugin graph's
        QkvRopeWriteKvCache, where a Split would copy them); ``SplitQkv`` is ``split_heads``, then
        ``rope_write_kv_cache``."""

    def paged_attention(self, q: Value, caches: tuple[Value, Value], block_table: Value, seq_lens: Value,
                        cu_seqlens_q: Value, max_seqlen_q: Any, scale: float, name: str) -> Value:
        """Causal attention of q [T, Hq, D] over each sequence's cached tokens -> [T, Hq, D]."""

    def swiglu(self, gate_up: Value, intermediate: int, name: str) -> Value:
        """[T, 2I] = [gate | up] -> silu(gate) * up, [T, I]."""

    def linear_swiglu(self, x: Value, weight: str, intermediate: int, name: str) -> Value:
        """[T, K] -> silu(x @ gate.T) * (x @ up.T), [T, I], for a ``weight`` of (gate, up) column pairs. Asked only of
        a backend that has such a weight (``has_weight``): the torch model after ``LlamaModel.fuse_swiglu_``."""

    def last_tokens(self, h: Value, cu_seqlens_q: Value) -> Value:
        """[T, hidden] -> [S, hidden]: each sequence's last new token."""

    def lm_head(self, h: Value, weight: str) -> Value:
        """[*, hidden] -> logits [*, vocab]."""


class SplitQkv:
    """``DecoderOps.qkv_rope_write_kv_cache`` as the backend's ``split_heads``, then its ``rope_write_kv_cache``: for
    backends whose split costs nothing (torch views) or that compute nothing."""

    def qkv_rope_write_kv_cache(self, qkv, heads, head_dim, positions, layer, caches, slot_mapping, name):
        q, k, v = self.split_heads(qkv, heads, head_dim, name + "_split")
        return self.rope_write_kv_cache(q, k, v, positions, layer, caches, slot_mapping, name)


def decoder_forward(ops: DecoderOps, config, input_ids: Value, positions: Value, slot_mapping: Value,
                    block_table: Value, seq_lens: Value, cu_seqlens_q: Value, max_seqlen_q: Any,
                    kv_cache: Sequence[tuple[Value, Value]], all_logits: bool = False) -> Value:
    """The LLaMA-family decoder (LLaMA, Mistral, Qwen2's q/k/v bias, Qwen3's q/k norm) over packed tokens and a paged
    KV cache; returns the logits of each sequence's last new token ([T, vocab] with ``all_logits``)."""
    c = config
    eps = c.rms_norm_eps
    scale = c.head_dim ** -0.5
    x = ops.embedding(input_ids, "embed")
    residual = None
    for i, caches in enumerate(kv_cache):
        p = f"layers.{i}."
        # The first norm has nothing to add; every later one fuses the residual add into the norm. (The norm inside
        # the next GEMV's prologue lost at every shape but SmolLM2's at bs 1: dev-logs/h200/norm_in_gemv.md.)
        if residual is None:
            h, residual = ops.rms_norm(x, p + "attn_norm", eps), x
        else:
            h, residual = ops.fused_add_rms_norm(x, residual, p + "attn_norm", eps, p + "attn_norm")
        # q/k/v biases: Qwen2 always; a GPTQ import of another model may carry them too
        bias = p + "bqkv" if c.attention_bias or ops.has_weight(p + "bqkv") else None
        qkv = ops.linear(h, p + "wqkv", bias)
        heads = [c.num_heads, c.num_kv_heads, c.num_kv_heads]
        if getattr(c, "qk_norm", False):  # Qwen3: RMSNorm over each head of q and k, before RoPE
            q, k, v = ops.split_heads(qkv, heads, c.head_dim, p + "qkv_split")
            q = ops.head_rms_norm(q, p + "q_norm", eps)
            k = ops.head_rms_norm(k, p + "k_norm", eps)
            q, caches = ops.rope_write_kv_cache(q, k, v, positions, i, caches, slot_mapping, p + "rope_write_kv")
        else:
            q, caches = ops.qkv_rope_write_kv_cache(qkv, heads, c.head_dim, positions, i, caches, slot_mapping,
                                                    p + "rope_write_kv")
        attn = ops.paged_attention(q, caches, block_table, seq_lens, cu_seqlens_q, max_seqlen_q, scale,
                                   p + "attention")
        x = ops.linear(ops.merge_heads(attn, c.q_size), p + "wo", p + "bo" if ops.has_weight(p + "bo") else None)
        h, residual = ops.fused_add_rms_norm(x, residual, p + "mlp_norm", eps, p + "mlp_norm")
        if ops.has_weight(p + GATE_UP_PAIRS):  # SwiGLU in the gate/up GEMM's epilogue
            act = ops.linear_swiglu(h, p + GATE_UP_PAIRS, c.intermediate_size, p + "swiglu")
        else:
            act = ops.swiglu(ops.linear(h, p + "w13"), c.intermediate_size, p + "swiglu")
        x = ops.linear(act, p + "w2")
    h, _ = ops.fused_add_rms_norm(x, residual, "norm", eps, "final_norm")
    if not all_logits:
        h = ops.last_tokens(h, cu_seqlens_q)  # only the last new token of each sequence samples
    # tied embeddings: a weight dict may leave lm_head out and mean the embedding
    head = "lm_head" if ops.has_weight("lm_head") or not c.tie_word_embeddings else "embed"
    return ops.lm_head(h, head)


class NameRecorder(SplitQkv):
    """A ``DecoderOps`` that computes nothing and records every weight the walk asks for."""

    def __init__(self):
        self.names: list[str] = []

    def _use(self, *names):
        self.names += [n for n in names if n is not None and n not in self.names]

    def has_weight(self, name):
        return False  # optional weights are not required

    def embedding(self, input_ids, weight):
        self._use(weight)

    def rms_norm(self, x, weight, eps):
        self._use(weight)

    def head_rms_norm(self, x, weight, eps):
        self._use(weight)

    def fused_add_rms_norm(self, x, residual, weight, eps, name):
        self._use(weight)
        return None, None

    def linear(self, x, weight, bias=None):
        self._use(weight, bias)

    def split_heads(self, x, heads, head_dim, name):
        return [None] * len(heads)

    def merge_heads(self, x, size):
        return None

    def rope_write_kv_cache(self, q, k, v, positions, layer, caches, slot_mapping, name):
        return None, caches

    def paged_attention(self, q, caches, block_table, seq_lens, cu_seqlens_q, max_seqlen_q, scale, name):
        return None

    def swiglu(self, gate_up, intermediate, name):
        return None

    def linear_swiglu(self, x, weight, intermediate, name):
        self._use(weight)

    def last_tokens(self, h, cu_seqlens_q):
        return None

    def lm_head(self, h, weight):
        self._use(weight)


def required_names(config) -> list[str]:
    """Every internal weight name the decoder reads for ``config`` (optional ones, such as a tied lm_head, left out)."""
    rec = NameRecorder()
    decoder_forward(rec, config, None, None, None, None, None, None, None, [(None, None)] * config.num_layers)
    return rec.names


def missing_weights(config, weights) -> list[str]:
    return [n for n in required_names(config) if n not in weights]


def gate_up_pairs(weights) -> dict[str, str]:
    """``{"layers.{i}.w13_pairs": "layers.{i}.w13"}`` for each gate/up weight of ``weights`` that SwiGLU can fuse
    into: the quantized ones (a plain tensor has no fused GEMM and keeps the activation kernel). The one rule both the
    torch model's ``fuse_swiglu_`` and the ONNX exporter's plugin graph follow."""
    return {k[:-len("w13")] + GATE_UP_PAIRS: k for k, v in weights.items()
            if k.startswith("layers.") and k.endswith(".w13") and getattr(v, "qweight", None) is not None}


def check_unfused(weights, what: str) -> None:
    """Raise if ``weights`` hold a gate/up weight re-laid out for the torch runtime (``GATE_UP_PAIRS``), which
    ``what`` (a saved build, an ONNX graph) must not be given: they start from the checkpoint's ``[gate | up]`` layout
    (the ONNX exporter makes the pairs itself where its plugin flavour fuses SwiGLU)."""
    fused = [n for n in weights if n.endswith("." + GATE_UP_PAIRS)]
    if fused:
        raise ValueError(f"{what}: {fused[0]} (and {len(fused) - 1} more) is a gate/up weight fused for the torch "
                         f"runtime (LlamaModel.fuse_swiglu_, which TorchBackend applies on CUDA); use a model that was "
                         f"not fused, e.g. load it again")

"""One decoder layer's decode step as the TensorRT engine runs it vs the torch path, Llama-3-8B shape, bs 1, ctx 512.

"plugin": every op of the plugin graph (``export.onnx_export``'s layer: FusedAddRmsNorm, W*A16Linear qkv,
QkvRopeWriteKvCache (q, k and v read in place from the qkv output), PagedAttention, W*A16Linear o, FusedAddRmsNorm,
W*A16Linear gate/up with swiglu=1 on the interleaved weight, W*A16Linear down) is its plugin's AOT kernel -- the one
the engine embeds for M = 1 (the GEMMs' tactic 1, which on this GPU is the kernel the torch op routes to:
``trt_plugins.specs.linear_kernels``) -- compiled ahead of time and launched through the CUDA driver
(``trt_plugins.aot.run_aot``, ``kernels.aot.launcher.AotKernel``); PagedAttention gets its decode scratch as the
engine's ``attn_*`` inputs, and its kernel (tactic q_hint = 1, the decode profile's) takes its split-KV decode program
on this step. "torch": the same
layer through ``export.model.TorchOps`` (``torch.ops.tritrt.*``) with the checkpoint's gate/up layout (GEMM, then the
SwiGLU kernel). All are captured in CUDA graphs
(``harness.bench(cuda_graph=True)``), cycling through layer weight sets larger than L2, so the times are device time
without host launch overhead. "torch_fused": the layer as the runtime runs it on CUDA (``LlamaModel.fuse_swiglu_``:
gate/up weight interleaved, SwiGLU in the GEMM's epilogue, ``TorchOps.linear_swiglu``), the model's own path, so
``fused_torch_over_path`` of the plugin row is the issue's target (>= 0.95x); ``torch_over_path`` is against the
unfused torch layer. fp16 activations; weights int4 (g128) and int8. Then each op alone, torch_fused and plugin, on
the inputs it had in the layer (``--no-per-op`` skips this breakdown).

Usage: ``python benchmarks/bench_plugin_layer.py [--quant int4,int8]``; writes
``benchmarks/results/<card>/bench_plugin_layer.{json,md}``.
"""

from __future__ import annotations

import argparse

import torch

try:
    from benchmarks.harness import L2_BYTES, bench, write_results
except ImportError:  # run as a script from the repository root
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks.harness import L2_BYTES, bench, write_results

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 32, 8, 128  # Llama-3-8B
CTX, BLOCK_SIZE, GROUP_SIZE, EPS, THETA = 512, 16, 128, 1e-5, 500000.0
DEVICE = "cuda"
OP_SETS = 64  # input sets of the per-op rows: 64 KV caches of 2.2 MB are > 2 x an H100's / H200's 50 MB L2


def layer_weights(quant: str, seed: int) -> dict:
    """One layer's weights by internal name (``export.checkpoint``'s), linears quantized as ``export.quantize`` does."""
    from kernels.quant import quantize_int4, quantize_int8

    g = torch.Generator(device=DEVICE).manual_seed(seed)

    def lin(out_f, in_f):
        w = torch.randn(out_f, in_f, device=DEVICE, generator=g, dtype=torch.float16) * 0.02
        return quantize_int4(w, GROUP_SIZE) if quant == "int4" else quantize_int8(w)

    q_size, kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    norm = lambda: 1 + 0.1 * torch.randn(HIDDEN, device=DEVICE, generator=g, dtype=torch.float16)  # noqa: E731
    return {"attn_norm": norm(), "mlp_norm": norm(), "wqkv": lin(q_size + 2 * kv_size, HIDDEN),
            "wo": lin(HIDDEN, q_size), "w13": lin(2 * INTER, HIDDEN), "w2": lin(HIDDEN, INTER)}


def layer_step(ops, x, residual, positions, caches, slot_mapping, block_table, seq_lens, cu_seqlens_q,
               fused_swiglu=False):
    """One layer of ``export.decoder.decoder_forward`` (a layer after the first: its norm fuses the residual add),
    on any ``DecoderOps`` backend; returns (x, residual) for the next layer. ``fused_swiglu``: the gate/up GEMM with
    SwiGLU in its epilogue on the interleaved weight ``w13_pairs`` (a fused model's layer)."""
    h, residual = ops.fused_add_rms_norm(x, residual, "attn_norm", EPS, "attn_norm")
    q, caches = ops.qkv_rope_write_kv_cache(ops.linear(h, "wqkv"), [HEADS, KV_HEADS, KV_HEADS], HEAD_DIM, positions,
                                            0, caches, slot_mapping, "rope_write_kv")
    attn = ops.paged_attention(q, caches, block_table, seq_lens, cu_seqlens_q, 1, HEAD_DIM ** -0.5, "attention")
    x = ops.linear(ops.merge_heads(attn, HEADS * HEAD_DIM), "wo")
    h, residual = ops.fused_add_rms_norm(x, residual, "mlp_norm", EPS, "mlp_norm")
    if fused_swiglu:
        return ops.linear(ops.linear_swiglu(h, "w13_pairs", INTER, "gate_up"), "w2"), residual
    return ops.linear(ops.swiglu(ops.linear(h, "w13"), INTER, "swiglu"), "w2"), residual


class PluginOps:
    """The ``DecoderOps`` of ``layer_step`` as the engine runs them: each op its plugin's AOT kernel (``run_aot``)."""

    def __init__(self, weights: dict, cos_sin_cache: torch.Tensor, attn_scratch: tuple):
        self.w, self.cos_sin_cache, self.attn_scratch = weights, cos_sin_cache, attn_scratch

    @staticmethod
    def _run(op, inputs, attrs=None):
        from trt_plugins.aot import run_aot

        return run_aot(op, inputs, attrs)

    def fused_add_rms_norm(self, x, residual, weight, eps, name):
        y, res = self._run("FusedAddRmsNorm", [x, residual, self.w[weight]], {"eps": eps})
        return y, res

    def linear(self, x, weight):
        w = self.w[weight]
        if w.bits == 4:
            return self._run("W4A16Linear", [x, w.qweight, w.scales, w.zeros],
                             {"group_size": w.group_size, "m_hint": 1})[0]
        return self._run("W8A16Linear", [x, w.qweight, w.scales], {"m_hint": 1})[0]

    def linear_swiglu(self, x, weight, intermediate, name):
        w = self.w[weight]  # (gate, up) column pairs: the exporter's gate/up node, swiglu=1
        if w.bits == 4:
            return self._run("W4A16Linear", [x, w.qweight, w.scales, w.zeros],
                             {"group_size": w.group_size, "m_hint": 1, "swiglu": 1})[0]
        return self._run("W8A16Linear", [x, w.qweight, w.scales], {"m_hint": 1, "swiglu": 1})[0]

    def merge_heads(self, x, size):
        return x.reshape(x.shape[0], size)

    def qkv_rope_write_kv_cache(self, qkv, heads, head_dim, positions, layer, caches, slot_mapping, name):
        q = self._run("QkvRopeWriteKvCache", [qkv, positions, self.cos_sin_cache, caches[0], caches[1], slot_mapping],
                      {"interleaved": 0})[0]
        return q, caches

    def paged_attention(self, q, caches, block_table, seq_lens, cu_seqlens_q, max_seqlen_q, scale, name):
        return self._run("PagedAttention", [q, caches[0], caches[1], block_table, seq_lens, cu_seqlens_q,
                                             *self.attn_scratch], {"scale": float(scale), "q_hint": 1})[0]

    def swiglu(self, gate_up, intermediate, name):
        return self._run("SwiGLU", [gate_up])[0]


class Recorder:
    """Wraps a ``DecoderOps`` backend: calls go through, and each op call (name, the bound method, its arguments) is
    kept, so that every op of the layer can then be timed alone on the inputs it really had (``per_op``)."""

    TIMED = ("fused_add_rms_norm", "linear", "linear_swiglu", "qkv_rope_write_kv_cache", "paged_attention", "swiglu")

    def __init__(self, ops):
        self.ops, self.calls = ops, []

    def __getattr__(self, name):
        fn = getattr(self.ops, name)
        if name not in self.TIMED:
            return fn

        def call(*args):
            label = (f"{name} {args[1]}" if name in ("linear", "linear_swiglu") else
                     f"{name} {args[2]}" if name == "fused_add_rms_norm" else name)
            self.calls.append((label, fn, args))
            return fn(*args)
        return call


def per_op(make_ops, inputs, batch) -> list[tuple[str, float]]:
    """(op label, median us) of each op of the (fused) layer, each alone in a CUDA graph cycling through the weight
    sets."""
    traces = []
    for w, x, residual, caches in inputs:
        rec = Recorder(make_ops(w))
        layer_step(rec, x, residual, batch["positions"], caches, batch["slot_mapping"], batch["block_table"],
                   batch["seq_lens"], batch["cu_seqlens_q"], fused_swiglu=True)
        traces.append(rec.calls)
    out = []
    for i, (label, _, _) in enumerate(traces[0]):
        sets = [(t[i][1], *t[i][2]) for t in traces]
        out.append((label, 1e3 * bench(lambda fn, *args: fn(*args), sets, cuda_graph=True)))
    return out


def decode_batch():
    """bs 1, one new token at position CTX after CTX cached ones; its sequence owns blocks 0..CTX / BLOCK_SIZE."""
    blocks = CTX // BLOCK_SIZE + 1
    i32 = dict(device=DEVICE, dtype=torch.int32)
    return dict(positions=torch.tensor([CTX], **i32), slot_mapping=torch.tensor([CTX], **i32),
                block_table=torch.arange(blocks, **i32).reshape(1, blocks), seq_lens=torch.tensor([CTX + 1], **i32),
                cu_seqlens_q=torch.tensor([0, 1], **i32))


def weight_bytes(w: dict) -> int:
    return sum(t.numel() * t.element_size() for v in w.values()
               for t in ((v,) if isinstance(v, torch.Tensor) else (v.qweight, v.scales, v.zeros)) if t is not None)


def run(quant: str, breakdown: bool = True) -> list[dict]:
    from export.decoder import GATE_UP_PAIRS
    from export.model import TorchOps
    from kernels.paged_attention import paged_attention_scratch
    from kernels.quant import interleave_halves
    from kernels.rope import rope_cos_sin_cache

    cos_sin = rope_cos_sin_cache(HEAD_DIM, 8192, THETA, device=DEVICE)
    scratch = paged_attention_scratch(1, HEADS, KV_HEADS, HEAD_DIM, DEVICE)  # the engine's attn_* inputs, bs 1
    batch = decode_batch()
    cache_shape = (CTX // BLOCK_SIZE + 1, BLOCK_SIZE, KV_HEADS, HEAD_DIM)

    def input_set(seed: int) -> tuple:
        """(weights, x, residual, (K cache, V cache)) of one layer; the weights with the fused model's gate/up weight
        beside the checkpoint's (export.model.LlamaModel.fuse_swiglu_)."""
        w = layer_weights(quant, seed)
        w[GATE_UP_PAIRS] = interleave_halves(w["w13"])
        kc = torch.randn(cache_shape, device=DEVICE, dtype=torch.float16)
        x = torch.randn(1, HIDDEN, device=DEVICE, dtype=torch.float16)
        return w, x, torch.randn_like(x), (kc, torch.randn_like(kc))

    inputs = [input_set(0)]
    per_set = weight_bytes({k: v for k, v in inputs[0][0].items() if k != GATE_UP_PAIRS})  # what one step reads
    inputs += [input_set(s) for s in range(1, max(1, -(-2 * L2_BYTES // per_set)))]

    def step(backend):
        def fn(w, x, residual, caches):
            ops = PluginOps(w, cos_sin, scratch) if backend == "plugin" else TorchOps(w, cos_sin)
            return layer_step(ops, x, residual, batch["positions"], caches, batch["slot_mapping"],
                              batch["block_table"], batch["seq_lens"], batch["cu_seqlens_q"],
                              fused_swiglu=backend != "torch")
        return fn

    # Same inputs, same answer (the GEMMs' kernels are the same; attention / norms are the same Triton kernels).
    w, x, r, caches = inputs[0]
    yp, rp = step("plugin")(w, x, r, tuple(c.clone() for c in caches))
    yt, rt = step("torch")(w, x, r, tuple(c.clone() for c in caches))
    yf, rf = step("torch_fused")(w, x, r, tuple(c.clone() for c in caches))
    diff = {"torch": None, "plugin": float((yp.float() - yf.float()).abs().max()),
            "torch_fused": float((yf.float() - yt.float()).abs().max())}
    rows = []
    times = {b: bench(step(b), inputs, cuda_graph=True) for b in ("torch", "torch_fused", "plugin")}
    for b, ms in times.items():
        rows.append(dict(path=b, quant=quant, op="layer", us=ms * 1e3,
                         weight_gbs=per_set / (ms * 1e-3) / 1e9, torch_over_path=times["torch"] / ms,
                         fused_torch_over_path=times["torch_fused"] / ms, max_abs_diff=diff[b]))
    if breakdown:  # where the difference is: each op alone (its launch in a graph; no overlap with its neighbours)
        # The layer's sets cycle the layer's weights past L2, but not each op's alone: q|k|v's and o's weights and
        # the KV cache (2.2 MB) of 1-2 sets stay in L2 and ran 1.2-1.5x faster than the same kernels cold
        # (bench_gemm_routed). In a 32-layer step each op's inputs come from DRAM: OP_SETS cycle even the cache past
        # it.
        inputs += [input_set(s) for s in range(len(inputs), OP_SETS)]
        ops = {b: per_op(lambda w, b=b: PluginOps(w, cos_sin, scratch) if b == "plugin" else TorchOps(w, cos_sin),
                         inputs, batch) for b in ("torch_fused", "plugin")}
        for (label, t_us), (_, p_us) in zip(ops["torch_fused"], ops["plugin"]):
            rows.append(dict(path="torch_fused", quant=quant, op=label, us=t_us))
            rows.append(dict(path="plugin", quant=quant, op=label, us=p_us,
                             fused_torch_over_path=t_us / p_us if t_us else ""))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quant", default="int4,int8")
    ap.add_argument("--no-per-op", action="store_true", help="skip the per-op breakdown")
    args = ap.parse_args()
    from kernels.gemm.routing import card_of
    from trt_plugins.specs import SPECS

    rows = []
    for quant in args.quant.split(","):
        rows += run(quant, breakdown=not args.no_per_op)
    card = card_of()
    kernels = {}
    for op, (k, n) in (("W4A16Linear", (HIDDEN, 6144)), ("W8A16Linear", (HIDDEN, 6144))):
        spec = SPECS[op]
        shapes = ({"x": (1, k), "qweight": (k // 8, n), "scales": (k // GROUP_SIZE, n), "zeros": (k // GROUP_SIZE, n)}
                  if op == "W4A16Linear" else {"x": (1, k), "qweight": (k, n), "scales": (n,)})
        dtypes = {"x": "fp16", "qweight": "int32" if op == "W4A16Linear" else "int8", "scales": "fp16",
                  "zeros": "int8"}
        attrs = {"group_size": GROUP_SIZE, "m_hint": 1} if op == "W4A16Linear" else {"m_hint": 1}
        sp = spec.specialise(shapes, {n_: dtypes[n_] for n_ in spec.inputs}, attrs, card=card)
        kernels[op] = sp.cuda.route[0] if sp.cuda else "triton"
    write_results("bench_plugin_layer", rows, ["path", "quant", "op", "us", "weight_gbs", "torch_over_path",
                                               "fused_torch_over_path", "max_abs_diff"],
                  meta=dict(shape="Llama-3-8B layer", batch=1, ctx=CTX, group_size=GROUP_SIZE, card=card.name,
                            plugin_gemm_qkv_m1=str(kernels),
                            target="fused_torch_over_path >= 0.95 for the plugin layer row"),
                  notes="torch_over_path: torch time / this path's time (>= 1: as fast as the torch path or faster); "
                        "fused_torch_over_path: the same against torch_fused (the model's path on CUDA: SwiGLU in the "
                        "gate/up GEMM's epilogue). max_abs_diff: the plugin layer's output against torch_fused's, "
                        "torch_fused's against torch's. "
                        "torch's own row has none: it is the reference of torch_fused's. "
                        f"Rows other than 'layer': each op alone, in a CUDA graph of back-to-back calls cycling "
                        f"through {OP_SETS} input sets (its weights, KV cache and activations from DRAM, as in a "
                        "32-layer step; results whose note lacks this sentence used the layer's 1-2 sets, in which "
                        "q|k|v's and o's weights and the KV cache stayed in L2); consecutive calls overlap as far as "
                        "PDL lets them, so the rows need not sum to the layer's time.")


if __name__ == "__main__":
    main()

"""Inputs for each plugin op, at small (interpreter / CPU) or model (GPU) sizes, shared by the reference, AOT and
TensorRT tests. Fresh random values on each call; odd token counts; a KV length that is not a block multiple."""

from __future__ import annotations

import torch

SMALL, LARGE = "small", "large"


def _t(shape, dtype, device, scale=1.0):
    return (torch.randn(shape, dtype=torch.float32, device=device) * scale).to(dtype)


def _paged_batch(q_lens, ctx_lens, page, num_blocks, device, width=0):
    """block_table / seq_lens / cu_seqlens_q for sequences whose new q_len tokens follow ctx tokens; random blocks;
    the table at least ``width`` blocks wide."""
    seq_lens = [q + c for q, c in zip(q_lens, ctx_lens)]
    width = max([width] + [-(-s // page) for s in seq_lens])
    perm = torch.randperm(num_blocks)[: width * len(q_lens)].reshape(len(q_lens), width)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    return (perm.to(torch.int32).to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device),
            cu.to(device))


# (op, variant) of every case: one per op, PagedAttention's decode steps and the GEMMs with SwiGLU (swiglu=1) as
# second cases.
CASES = ("FusedAddRmsNorm", "PagedAttention", "PagedAttention:decode", "RmsNorm", "Rope", "RopeWriteKvCache", "SwiGLU",
         "W4A16Linear", "W4A16Linear:swiglu", "W8A16Linear", "W8A16Linear:swiglu", "WriteKvCache")


# Outputs whose contents are unspecified (PagedAttention's decode partials): compared nowhere. Its counter_out is
# compared: zeros in, zeros out.
SCRATCH_OUTPUTS = ("part_o_out", "part_lse_out")


def make_case(op: str, size: str = SMALL, dtype=torch.bfloat16, device="cpu"):
    """(inputs, attrs) for plugin ``op``, or for a case of ``CASES`` (``"PagedAttention:decode"``)."""
    op, _, variant = op.partition(":")
    big = size == LARGE
    if op in ("RmsNorm", "FusedAddRmsNorm"):
        t, h = (123, 4096) if big else (7, 123)
        x, w = _t((t, h), dtype, device), _t((h,), dtype, device, 0.5) + 1
        ins = [x, _t((t, h), dtype, device), w] if op == "FusedAddRmsNorm" else [x, w]
        return ins, {"eps": 1e-5}
    if op == "SwiGLU":
        t, i = (123, 11008) if big else (7, 88)
        return [_t((t, 2 * i), dtype, device, 2.0)], {}
    if op == "Rope":
        from kernels.rope import rope_cos_sin_cache

        t, hq, hk, d, r = (123, 32, 8, 128, 128) if big else (7, 4, 2, 16, 16)
        pos = torch.randint(0, 4096, (t,), device=device)
        cache = rope_cos_sin_cache(r, 4096, 500000.0, device=device)
        return [_t((t, hq, d), dtype, device), _t((t, hk, d), dtype, device), pos, cache], {"interleaved": 0}
    if op == "WriteKvCache":
        t, hk, d, page, nb = (123, 8, 128, 16, 64) if big else (7, 2, 16, 4, 8)
        slots = torch.randperm(nb * page)[:t].to(torch.int32)
        slots[1] = -1  # a padded token: skipped
        kc, vc = _t((nb, page, hk, d), dtype, device), _t((nb, page, hk, d), dtype, device)
        return [_t((t, hk, d), dtype, device), _t((t, hk, d), dtype, device), kc, vc, slots.to(device)], {}
    if op == "RopeWriteKvCache":  # Rope's q, k, positions and table, then WriteKvCache's v, caches and slots
        (q, k, pos, cache), attrs = make_case("Rope", size, dtype, device)
        (_, v, kc, vc, slots), _ = make_case("WriteKvCache", size, dtype, device)
        return [q, k, v, pos, cache, kc, vc, slots], attrs
    if op == "PagedAttention":
        from trt_plugins.specs.paged_attention import MAX_SPLITS, scratch_shapes

        hq, hk, d, page, nb = (32, 8, 128, 16, 256) if big else (4, 2, 16, 4, 32)
        if variant == "decode":  # one new token per sequence (one with none): the kernel's split-KV decode program
            q_lens, ctx = ([1, 1, 0, 1, 1], [1000, 17, 40, 2500, 333]) if big else ([1, 0, 1], [9, 3, 22])
        else:  # a prefill, a decode token and a chunk in one step: the flash-prefill program
            q_lens, ctx = ([123, 1, 300], [0, 517, 77]) if big else ([7, 1, 3], [0, 9, 5])
        # Small: a table wide enough (64 blocks of 4 tokens) that decode splits (>= 128 tokens of width each).
        width = max(max(-(-(q + c) // page) for q, c in zip(q_lens, ctx)), 0 if big else 64)
        nb = max(nb, width * len(q_lens))  # distinct blocks for every sequence's table row
        bt, sl, cu = _paged_batch(q_lens, ctx, page, nb, device, width)
        kc, vc = _t((nb, page, hk, d), dtype, device), _t((nb, page, hk, d), dtype, device)
        ins = [_t((sum(q_lens), hq, d), dtype, device), kc, vc, bt, sl, cu]
        for n, (shape, dt) in scratch_shapes(len(q_lens), hq, hk, d, MAX_SPLITS).items():
            ins.append(torch.zeros(shape, dtype=getattr(torch, {"fp32": "float32", "int32": "int32"}[dt]),
                                   device=device))
        # Each step kind with the launch tuned for the other (the tactic TensorRT may keep on a profile); the
        # tuned pairs run in tests/kernels/test_paged_attention.py and the benchmarks.
        return ins, {"scale": 0.0, "max_splits": MAX_SPLITS, "q_hint": 128 if variant == "decode" else 1}
    if op in ("W8A16Linear", "W4A16Linear"):
        from kernels.quant import quantize_int4, quantize_int8

        m, k, n = (7, 4096, 4096) if big else (3, 256, 96)
        w = _t((n, k), torch.float32, device, 0.05)
        x = _t((m, k), dtype, device)
        sw = int(variant == "swiglu")  # the weight's columns taken as (gate, up) pairs: y [m, n / 2]
        if op == "W8A16Linear":
            qw = quantize_int8(w, scale_dtype=dtype)
            return [x, qw.qweight, qw.scales], {"m_hint": 16, "swiglu": sw}
        qw = quantize_int4(w, 128, scale_dtype=dtype)
        return [x, qw.qweight, qw.scales, qw.zeros], {"group_size": 128, "m_hint": 16, "swiglu": sw}
    raise KeyError(op)


def fp32_reference(op, ins, attrs):
    """The kernels' own fp32 references (or plain torch math), called directly: what every run is judged against."""
    if op == "RmsNorm":
        from kernels.rms_norm import rms_norm_ref

        return [rms_norm_ref(ins[0], ins[1], attrs["eps"])]
    if op == "FusedAddRmsNorm":
        from kernels.rms_norm import fused_add_rms_norm_ref

        return list(fused_add_rms_norm_ref(*ins, attrs["eps"]))
    if op == "SwiGLU":
        x = ins[0].float()
        i = x.shape[1] // 2
        return [torch.nn.functional.silu(x[:, :i]) * x[:, i:]]
    if op == "Rope":
        from kernels.rope import rotary_embedding_ref

        return list(rotary_embedding_ref(*ins, interleaved=bool(attrs["interleaved"])))
    if op == "RopeWriteKvCache":
        from kernels.attention_ref import write_kv_cache_ref
        from kernels.rope import rotary_embedding_ref

        q, k, v, pos, cache, kc, vc, slots = ins
        q_out, k_out = rotary_embedding_ref(q, k, pos, cache, interleaved=bool(attrs["interleaved"]))
        kc, vc = kc.clone(), vc.clone()
        write_kv_cache_ref(k_out, v, kc, vc, slots)
        return [q_out, kc, vc]
    if op == "WriteKvCache":
        from kernels.attention_ref import write_kv_cache_ref

        k, v, kc, vc, slots = ins
        kc, vc = kc.clone(), vc.clone()
        write_kv_cache_ref(k, v, kc, vc, slots)
        return [kc, vc]
    if op.startswith("PagedAttention"):
        from kernels.attention_ref import paged_attention_ref

        q, kc, vc, bt, sl, cu = ins[:6]
        max_q = int((cu[1:] - cu[:-1]).max())
        return [paged_attention_ref(q, kc, vc, bt, sl, cu, max_q, q.shape[2] ** -0.5), *ins[6:]]
    if op == "W8A16Linear":
        from kernels.gemm.w8a16.triton_gemm import w8a16_reference

        return [w8a16_reference(*ins, swiglu=bool(attrs.get("swiglu")))]
    if op == "W4A16Linear":
        from kernels.quant import unpack_int4

        x, qw, s, z = ins
        g = attrs["group_size"]
        w = (unpack_int4(qw).float() - z.float().repeat_interleave(g, 0)) * s.float().repeat_interleave(g, 0)
        y = x.float() @ w
        return [torch.nn.functional.silu(y[:, 0::2]) * y[:, 1::2] if attrs.get("swiglu") else y]
    raise KeyError(op)


def jit_run(op, ins, attrs):
    """The same kernels through their torch launchers (Triton JIT), as the torch model runs them."""
    if op == "RmsNorm":
        from kernels.rms_norm import rms_norm

        return [rms_norm(ins[0], ins[1], attrs["eps"])]
    if op == "FusedAddRmsNorm":
        from kernels.rms_norm import fused_add_rms_norm

        return list(fused_add_rms_norm(*ins, attrs["eps"]))
    if op == "SwiGLU":
        from kernels.activation import swiglu

        return [swiglu(ins[0])]
    if op == "Rope":
        from kernels.rope import rotary_embedding

        return list(rotary_embedding(*ins, interleaved=bool(attrs["interleaved"])))
    if op == "WriteKvCache":
        from kernels.kv_cache import write_kv_cache

        write_kv_cache(*ins)
        return [ins[2], ins[3]]
    if op == "RopeWriteKvCache":
        from kernels.rope import rope_write_kv_cache

        q, k, v, pos, cache, kc, vc, slots = ins
        return [rope_write_kv_cache(q, k, v, pos, cache, kc, vc, slots, bool(attrs["interleaved"])), kc, vc]
    if op.startswith("PagedAttention"):
        from kernels.paged_attention import paged_attention_one_launch

        return [paged_attention_one_launch(*ins[:6], scale=ins[0].shape[2] ** -0.5, scratch=tuple(ins[6:]),
                                           max_splits=attrs["max_splits"], q_hint=attrs["q_hint"]), *ins[6:]]
    if op == "W8A16Linear":
        from kernels.gemm.w8a16.triton_gemm import w8a16_gemm

        return [w8a16_gemm(*ins, swiglu=bool(attrs.get("swiglu")))]
    if op == "W4A16Linear":
        from kernels.gemm.w4a16.triton_gemm import w4a16_gemm

        return [w4a16_gemm(*ins, attrs["group_size"], swiglu=bool(attrs.get("swiglu")))]
    raise KeyError(op)


# Plugins whose kernels index memory with values read from their inputs (tables, offsets, slots, positions).
INDEXING_OPS = ("PagedAttention", "Rope", "RopeWriteKvCache", "WriteKvCache")
# The random index inputs every index-input check runs (the GPU test and the memcheck smoke run alike).
GARBAGE_SEEDS = range(4)


def garbage_indices(ins: list, seed: int = 0) -> list:
    """``ins`` with every integer tensor refilled with random values over the dtype's range (int32: all of it): what
    a TensorRT build may feed a plugin while it times tactics. Float tensors are kept."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in ins:
        if t.dtype in (torch.int32, torch.int64):
            r = torch.randint(-2**31, 2**31 - 1, t.shape, generator=g, dtype=torch.int64)
            out.append(r.to(t.dtype).to(t.device))
        else:
            out.append(t.clone())
    return out

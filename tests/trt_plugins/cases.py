"""Inputs for each plugin op, at small (interpreter / CPU) or model (GPU) sizes, shared by the reference, AOT and
TensorRT tests. Fresh random values on each call; odd token counts; a KV length that is not a block multiple.

One registered class per op (``@_case("Op")``): ``make`` builds its inputs and attrs, ``reference`` runs the kernels'
own fp32 reference (or plain torch math: what every run is judged against), ``jit`` runs the same kernels through
their torch launchers (Triton JIT, as the torch model runs them). ``CASES`` and ``INDEXING_OPS`` are read off the
registry, so adding a plugin op here is one class; ``test_every_spec_has_a_case`` fails until it exists."""

from __future__ import annotations

import torch

SMALL, LARGE = "small", "large"

# Outputs whose contents are unspecified (PagedAttention's decode partials): compared nowhere. Its counter_out is
# compared: zeros in, zeros out.
SCRATCH_OUTPUTS = ("part_o_out", "part_lse_out")


class _Case:
    """A plugin op's test case; subclasses override the three static methods."""
    variants = ("",)  # "" is the plain case; others are named "Op:variant" in CASES
    indexing = False  # the kernels index memory with values read from the inputs (tables, offsets, slots, positions)

    @staticmethod
    def make(variant: str, big: bool, dtype, device) -> tuple[list, dict]:
        raise NotImplementedError

    @staticmethod
    def reference(ins: list, attrs: dict) -> list:
        raise NotImplementedError

    @staticmethod
    def jit(ins: list, attrs: dict) -> list:
        raise NotImplementedError


_OPS: dict[str, type[_Case]] = {}


def _case(op: str):
    def register(cls: type[_Case]) -> type[_Case]:
        _OPS[op] = cls
        return cls
    return register


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


def _norm_inputs(big, dtype, device, residual: bool):
    t, h = (123, 4096) if big else (7, 123)
    x, w = _t((t, h), dtype, device), _t((h,), dtype, device, 0.5) + 1
    return ([x, _t((t, h), dtype, device), w] if residual else [x, w]), {"eps": 1e-5}


@_case("RmsNorm")
class _RmsNorm(_Case):
    @staticmethod
    def make(variant, big, dtype, device):
        return _norm_inputs(big, dtype, device, residual=False)

    @staticmethod
    def reference(ins, attrs):
        from kernels.rms_norm import rms_norm_ref

        return [rms_norm_ref(ins[0], ins[1], attrs["eps"])]

    @staticmethod
    def jit(ins, attrs):
        from kernels.rms_norm import rms_norm

        return [rms_norm(ins[0], ins[1], attrs["eps"])]


@_case("FusedAddRmsNorm")
class _FusedAddRmsNorm(_Case):
    @staticmethod
    def make(variant, big, dtype, device):
        return _norm_inputs(big, dtype, device, residual=True)

    @staticmethod
    def reference(ins, attrs):
        from kernels.rms_norm import fused_add_rms_norm_ref

        return list(fused_add_rms_norm_ref(*ins, attrs["eps"]))

    @staticmethod
    def jit(ins, attrs):
        from kernels.rms_norm import fused_add_rms_norm

        return list(fused_add_rms_norm(*ins, attrs["eps"]))


@_case("SwiGLU")
class _SwiGLU(_Case):
    @staticmethod
    def make(variant, big, dtype, device):
        t, i = (123, 11008) if big else (7, 88)
        return [_t((t, 2 * i), dtype, device, 2.0)], {}

    @staticmethod
    def reference(ins, attrs):
        x = ins[0].float()
        i = x.shape[1] // 2
        return [torch.nn.functional.silu(x[:, :i]) * x[:, i:]]

    @staticmethod
    def jit(ins, attrs):
        from kernels.activation import swiglu

        return [swiglu(ins[0])]


@_case("Rope")
class _Rope(_Case):
    indexing = True

    @staticmethod
    def make(variant, big, dtype, device):
        from kernels.rope import rope_cos_sin_cache

        t, hq, hk, d, r = (123, 32, 8, 128, 128) if big else (7, 4, 2, 16, 16)
        pos = torch.randint(0, 4096, (t,), device=device)
        cache = rope_cos_sin_cache(r, 4096, 500000.0, device=device)
        return [_t((t, hq, d), dtype, device), _t((t, hk, d), dtype, device), pos, cache], {"interleaved": 0}

    @staticmethod
    def reference(ins, attrs):
        from kernels.rope import rotary_embedding_ref

        return list(rotary_embedding_ref(*ins, interleaved=bool(attrs["interleaved"])))

    @staticmethod
    def jit(ins, attrs):
        from kernels.rope import rotary_embedding

        return list(rotary_embedding(*ins, interleaved=bool(attrs["interleaved"])))


def _write_kv_cache_ref(k, v, kc, vc, slots):
    from kernels.attention_ref import write_kv_cache_ref

    kc, vc = kc.clone(), vc.clone()
    write_kv_cache_ref(k, v, kc, vc, slots)
    return [kc, vc]


@_case("WriteKvCache")
class _WriteKvCache(_Case):
    indexing = True

    @staticmethod
    def make(variant, big, dtype, device):
        t, hk, d, page, nb = (123, 8, 128, 16, 64) if big else (7, 2, 16, 4, 8)
        slots = torch.randperm(nb * page)[:t].to(torch.int32)
        slots[1] = -1  # a padded token: skipped
        kc, vc = _t((nb, page, hk, d), dtype, device), _t((nb, page, hk, d), dtype, device)
        return [_t((t, hk, d), dtype, device), _t((t, hk, d), dtype, device), kc, vc, slots.to(device)], {}

    @staticmethod
    def reference(ins, attrs):
        return _write_kv_cache_ref(*ins)

    @staticmethod
    def jit(ins, attrs):
        from kernels.kv_cache import write_kv_cache

        write_kv_cache(*ins)
        return [ins[2], ins[3]]


@_case("RopeWriteKvCache")
class _RopeWriteKvCache(_Case):
    indexing = True

    @staticmethod
    def make(variant, big, dtype, device):  # Rope's q, k, positions and table, then WriteKvCache's v, caches, slots
        (q, k, pos, cache), attrs = _Rope.make("", big, dtype, device)
        (_, v, kc, vc, slots), _ = _WriteKvCache.make("", big, dtype, device)
        return [q, k, v, pos, cache, kc, vc, slots], attrs

    @staticmethod
    def reference(ins, attrs):
        q, k, v, pos, cache, kc, vc, slots = ins
        q_out, k_out = _Rope.reference([q, k, pos, cache], attrs)
        return [q_out, *_write_kv_cache_ref(k_out, v, kc, vc, slots)]

    @staticmethod
    def jit(ins, attrs):
        from kernels.rope import rope_write_kv_cache

        q, k, v, pos, cache, kc, vc, slots = ins
        return [rope_write_kv_cache(q, k, v, pos, cache, kc, vc, slots, bool(attrs["interleaved"])), kc, vc]


@_case("QkvRopeWriteKvCache")
class _QkvRopeWriteKvCache(_Case):
    indexing = True

    @staticmethod
    def make(variant, big, dtype, device):  # RopeWriteKvCache's inputs with q | k | v as one projection output
        (q, k, v, *rest), attrs = _RopeWriteKvCache.make("", big, dtype, device)
        return [torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1), *rest], attrs

    @staticmethod
    def _split(ins):
        qkv, *rest = ins
        hk, d = rest[2].shape[2:]
        hq = qkv.shape[1] // d - 2 * hk
        return [p.reshape(qkv.shape[0], -1, d) for p in qkv.split([hq * d, hk * d, hk * d], dim=1)] + rest

    @staticmethod
    def reference(ins, attrs):  # RopeWriteKvCache's reference on the three slices (independent of the spec's split)
        return _RopeWriteKvCache.reference(_QkvRopeWriteKvCache._split(ins), attrs)

    @staticmethod
    def jit(ins, attrs):  # the torch path: the slices as strided views, the same kernel
        return _RopeWriteKvCache.jit(_QkvRopeWriteKvCache._split(ins), attrs)


@_case("PagedAttention")
class _PagedAttention(_Case):
    variants = ("", "decode")  # decode: the kernel's split-KV decode program; "": the flash-prefill program
    indexing = True

    @staticmethod
    def make(variant, big, dtype, device):
        from trt_plugins.specs.paged_attention import MAX_SPLITS, scratch_shapes

        hq, hk, d, page, nb = (32, 8, 128, 16, 256) if big else (4, 2, 16, 4, 32)
        if variant == "decode":  # one new token per sequence (one with none)
            q_lens, ctx = ([1, 1, 0, 1, 1], [1000, 17, 40, 2500, 333]) if big else ([1, 0, 1], [9, 3, 22])
        else:  # a prefill, a decode token and a chunk in one step
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

    @staticmethod
    def reference(ins, attrs):
        from kernels.attention_ref import paged_attention_ref

        q, kc, vc, bt, sl, cu = ins[:6]
        max_q = int((cu[1:] - cu[:-1]).max())
        return [paged_attention_ref(q, kc, vc, bt, sl, cu, max_q, q.shape[2] ** -0.5), *ins[6:]]

    @staticmethod
    def jit(ins, attrs):
        from kernels.paged_attention import paged_attention_one_launch

        return [paged_attention_one_launch(*ins[:6], scale=ins[0].shape[2] ** -0.5, scratch=tuple(ins[6:]),
                                           max_splits=attrs["max_splits"], q_hint=attrs["q_hint"]), *ins[6:]]


class _WeightOnlyLinear(_Case):
    """The GEMMs, plain and with SwiGLU (``swiglu=1``: the weight's columns taken as (gate, up) pairs, y [m, n / 2])."""
    variants = ("", "swiglu")

    @classmethod
    def weights(cls, variant, big, dtype, device):
        m, k, n = (7, 4096, 4096) if big else (3, 256, 96)
        w = _t((n, k), torch.float32, device, 0.05)
        return _t((m, k), dtype, device), w, int(variant == "swiglu")


@_case("W8A16Linear")
class _W8A16Linear(_WeightOnlyLinear):
    @classmethod
    def make(cls, variant, big, dtype, device):
        from kernels.quant import quantize_int8

        x, w, sw = cls.weights(variant, big, dtype, device)
        qw = quantize_int8(w, scale_dtype=dtype)
        return [x, qw.qweight, qw.scales], {"m_hint": 16, "swiglu": sw}

    @staticmethod
    def reference(ins, attrs):
        from kernels.gemm.w8a16.triton_gemm import w8a16_reference

        return [w8a16_reference(*ins, swiglu=bool(attrs.get("swiglu")))]

    @staticmethod
    def jit(ins, attrs):
        from kernels.gemm.w8a16.triton_gemm import w8a16_gemm

        return [w8a16_gemm(*ins, swiglu=bool(attrs.get("swiglu")))]


@_case("W4A16Linear")
class _W4A16Linear(_WeightOnlyLinear):
    @classmethod
    def make(cls, variant, big, dtype, device):
        from kernels.quant import quantize_int4

        x, w, sw = cls.weights(variant, big, dtype, device)
        qw = quantize_int4(w, 128, scale_dtype=dtype)
        return [x, qw.qweight, qw.scales, qw.zeros], {"group_size": 128, "m_hint": 16, "swiglu": sw}

    @staticmethod
    def reference(ins, attrs):
        from kernels.quant import unpack_int4

        x, qw, s, z = ins
        g = attrs["group_size"]
        w = (unpack_int4(qw).float() - z.float().repeat_interleave(g, 0)) * s.float().repeat_interleave(g, 0)
        y = x.float() @ w
        return [torch.nn.functional.silu(y[:, 0::2]) * y[:, 1::2] if attrs.get("swiglu") else y]

    @staticmethod
    def jit(ins, attrs):
        from kernels.gemm.w4a16.triton_gemm import w4a16_gemm

        return [w4a16_gemm(*ins, attrs["group_size"], swiglu=bool(attrs.get("swiglu")))]


# Every (op, variant) case, "Op" or "Op:variant": what the GPU tests and the memcheck smoke run iterate.
CASES = tuple(sorted(f"{op}:{v}" if v else op for op, c in _OPS.items() for v in c.variants))
# Plugins whose kernels index memory with values read from their inputs.
INDEXING_OPS = tuple(sorted(op for op, c in _OPS.items() if c.indexing))


def _lookup(op: str) -> type[_Case]:
    try:
        return _OPS[op.partition(":")[0]]
    except KeyError:
        raise KeyError(f"no test case for plugin op {op!r}: register one in tests/trt_plugins/cases.py "
                       f"(have {sorted(_OPS)})") from None


def make_case(op: str, size: str = SMALL, dtype=torch.bfloat16, device="cpu"):
    """(inputs, attrs) for plugin ``op``, or for a case of ``CASES`` (``"PagedAttention:decode"``)."""
    cls, variant = _lookup(op), op.partition(":")[2]
    if variant not in cls.variants:
        raise KeyError(f"{op!r}: no variant {variant!r} (have {cls.variants})")
    return cls.make(variant, size == LARGE, dtype, device)


def fp32_reference(op, ins, attrs):
    """The kernels' own fp32 references (or plain torch math), called directly: what every run is judged against."""
    return _lookup(op).reference(ins, attrs)


def jit_run(op, ins, attrs):
    """The same kernels through their torch launchers (Triton JIT), as the torch model runs them."""
    return _lookup(op).jit(ins, attrs)


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

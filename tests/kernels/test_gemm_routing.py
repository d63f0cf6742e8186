"""Weight-only GEMM routing (``kernels.gemm.routing``) and the ops that dispatch on it (``kernels.ops.gemm``).

Equivalence: on every M up to 1024 and the Llama-family shapes, the route is the kernel the ops' cascade called before
the routing existed (``gemm_routing_legacy.py``, a frozen copy), and the ops now make exactly the calls it made (same
kernels, same arguments), both run with stand-ins for every kernel on CPU tensors. The one route added since, W8A16's
wgmma GEMM (Hopper, fp16, no residual, M = 17..1023, operands aligned), and W4A16's wgmma GEMM past the cascade's
range (M = 256..511, and up to 1023 where its plan takes 256-row blocks), are checked against its own rule there: the op
calls that kernel alone, with the op's operands; everywhere else W8A16 still makes the cascade's calls. Then the
routes of the measured shapes on an H100 as a readable table, plans and cards; on the GPU, the op's result is the
routed kernel's, bit for bit."""

import importlib
import inspect
from functools import lru_cache

import pytest
import torch

from kernels.gemm import gemm_wgmma as wg
from kernels.gemm.w4a16 import gemv as cu
from kernels.gemm.w4a16 import gemv_mma as mma
from kernels.gemm.w8a16 import gemv_mma as mma8
from kernels.gemm import routing
from kernels.gemm.dequant import dequant_matmul, dequantize_w4_kn, dequantize_w8_kn
from kernels.gemm.w4a16.triton_gemm import w4a16_gemm, w4a16_reference
from kernels.gemm.w8a16.triton_gemm import w8a16_gemm, w8a16_reference
from kernels.ops import gemm as ops_gemm
from kernels.quant import dequantize, quantize_int4, quantize_int8
from kernels.gemm.routing import H100, H200, Card, route_w4a16, route_w8a16
from tests.helpers import assert_close_to_ref, assert_gemm_close, dequant_baseline, w4_gpu_case
from tests.kernels import gemm_routing_legacy as legacy

A100 = Card("NVIDIA A100-SXM4-80GB", 80, 108)
L40S = Card("NVIDIA L40S", 89, 142)
H100_PCIE = Card("NVIDIA H100 PCIe", 90, 114)

# (name, N, K, INT4 group size): Llama-3-8B, Llama-2-7B, Llama-3.2-1B, Llama-3-70B per GPU of 8, SmolLM2-135M, the
# tiny odd_dims checkpoint, and shapes that each miss one kernel's divisibility rule.
SHAPES = [
    ("l3-8b qkv", 6144, 4096, 128), ("l3-8b o", 4096, 4096, 128), ("l3-8b gate_up", 28672, 4096, 128),
    ("l3-8b down", 4096, 14336, 128), ("8k", 8192, 8192, 128),
    ("l2-7b qkv", 12288, 4096, 128), ("l2-7b gate_up", 22016, 4096, 128), ("l2-7b down", 4096, 11008, 128),
    ("l3-1b qkv", 3072, 2048, 128), ("l3-1b gate_up", 16384, 2048, 128), ("l3-1b down", 2048, 8192, 128),
    ("l3-70b/8 qkv", 1280, 8192, 128), ("l3-70b/8 o", 8192, 1024, 128), ("l3-70b/8 gate_up", 7168, 8192, 128),
    ("l3-70b/8 down", 8192, 3584, 128),
    ("smollm2 qkv", 960, 576, 64), ("smollm2 gate_up", 3072, 576, 64), ("smollm2 down", 576, 1536, 128),
    ("odd_dims qkv", 448, 320, 64), ("odd_dims down", 320, 608, 32),
    ("o g32", 4096, 4096, 32), ("o g64", 4096, 4096, 64), ("g96", 4096, 4608, 96), ("g16", 256, 512, 16),
    ("N 1000", 1000, 512, 128), ("N 36", 36, 256, 64), ("N 4098", 4098, 1024, 128),
    ("K 4112", 4096, 4112, 16),
]
M_ALL = range(0, 1025)
# Every M at which some rule changes, and its neighbours.
M_EDGES = (0, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 23, 24, 31, 32, 33, 63, 64, 65, 127, 128, 129, 200, 255, 256, 257,
           300, 511, 512, 513, 1000, 1023, 1024)
# x as the op may get it: contiguous; 2 bytes off 16-byte alignment; rows padded to K + 8 (aligned) or K + 1 (not);
# 3-D. ``aligned``: what the route's ``aligned`` is for it (the wgmma GEMM needs aligned rows; the W8 GEMV copies a
# strided x to contiguous first).
LAYOUTS = ("contiguous", "misaligned", "strided", "strided_odd", "3d")
W4_ALIGNED = {"contiguous": True, "misaligned": False, "strided": True, "strided_odd": False, "3d": True}
W8_ALIGNED = {"contiguous": True, "misaligned": False, "strided": True, "strided_odd": True, "3d": True}
MAX_M = 1024

# Every kernel the ops may call, by module and attribute, and the name its calls are recorded under.
KERNELS = {
    ("kernels.gemm.w4a16.gemv_mma", "w4a16_gemv_mma"): "w4_gemv_mma",
    ("kernels.gemm.gemm_wgmma", "w4a16_gemm_wgmma"): "w4_gemm_wgmma",
    ("kernels.gemm.w4a16.gemv", "w4a16_gemv"): "w4_gemv",
    ("kernels.gemm.w4a16.triton_gemm", "w4a16_gemm"): "triton_w4_gemm",
    ("kernels.gemm.w4a16.triton_gemm", "w4a16_reference"): "reference",
    ("kernels.gemm.w8a16.gemv_mma", "w8a16_gemv_mma"): "w8_gemv_mma",
    ("kernels.gemm.gemm_wgmma", "w8a16_gemm_wgmma"): "w8_gemm_wgmma",
    ("kernels.gemm.w8a16.triton_gemm", "w8a16_gemm"): "triton_w8_gemm",
    ("kernels.gemm.w8a16.triton_gemm", "w8a16_reference"): "reference",
    ("kernels.gemm.dequant", "dequant_matmul"): "dequant_cublas",
    ("kernels.gemm.dequant", "dequantize_w4_kn"): "dequantize",
    ("kernels.gemm.dequant", "dequantize_w8_kn"): "dequantize",
    ("kernels.activation", "swiglu"): "swiglu",
}
BACKENDS = set(routing.W4_BACKENDS) | set(routing.W8_BACKENDS)


def _key(t):
    """What tells a tensor argument apart: its address, or (meta tensors) its storage offset, and shape and strides."""
    return (t.storage_offset() if t.is_meta else t.data_ptr(), t.shape, t.stride())


class Kernels:
    """Stands in for every kernel of ``KERNELS``: records each call as (name, its arguments by parameter name,
    defaults filled in, tensors described by which input they are or as a new tensor of some shape and strides) and
    returns an output of the shape the kernel would."""

    def __init__(self, monkeypatch):
        self.calls = []
        self.inputs = {}
        for (module, attr), name in KERNELS.items():
            mod = importlib.import_module(module)
            monkeypatch.setattr(mod, attr, self._stub(name, getattr(mod, attr)))

    def _describe(self, v):
        if isinstance(v, torch.Tensor):
            return self.inputs.get(_key(v)) or ("new", tuple(v.shape), v.stride())
        return tuple(sorted(v.items())) if isinstance(v, dict) else v

    def _stub(self, name, fn):
        params = inspect.signature(fn).parameters
        names = list(params)
        defaults = {k: p.default for k, p in params.items() if p.default is not inspect.Parameter.empty}

        def stub(*args, **kwargs):
            a = {**defaults, **dict(zip(names, args)), **kwargs}
            self.calls.append((name, tuple((k, self._describe(v)) for k, v in sorted(a.items()))))
            if name == "dequantize":
                qw = a["qweight"]
                return torch.empty((qw.shape[0] * (8 if qw.dtype == torch.int32 else 1), qw.shape[1]), device="meta")
            # Outputs (and the residual) are meta tensors: the op's residual add after SwiGLU costs nothing.
            x = a["x"]
            if name == "swiglu":
                shape = (*x.shape[:-1], x.shape[-1] // 2)
            elif name == "dequant_cublas":
                shape = (x.shape[0], a["w_kn"].shape[1])
            else:
                n = a["qweight"].shape[1]
                shape = (x.shape[0], n // 2 if a.get("swiglu") else n)
            return torch.empty(shape, dtype=x.dtype, device="meta")

        return stub

    def run(self, op, *args):
        """The calls ``op(*args)`` makes; its tensor arguments (and their 2-D views) are the inputs calls may name."""
        self.calls, self.inputs = [], {}
        for i, t in enumerate(args):
            if isinstance(t, torch.Tensor):
                self.inputs[_key(t)] = f"arg{i}"
                if t.dim() >= 2:  # the view the op flattens it to (its strides may differ, e.g. for one row)
                    self.inputs.setdefault(_key(t.reshape(-1, t.shape[-1])), f"arg{i}")
        op(*args)
        return self.calls

    @staticmethod
    def route_of(calls):
        """(backend, SwiGLU mode) of a recorded call sequence."""
        main = next(c for c in calls if c[0] in BACKENDS)
        if any(name == "swiglu" for name, _ in calls):
            return main[0], "after"
        return main[0], "fused" if dict(main[1]).get("swiglu") else "none"


@pytest.fixture
def kernels(monkeypatch):
    return Kernels(monkeypatch)


@pytest.fixture
def on_card(monkeypatch):
    """``on_card(card)``: the ops and the legacy cascade see CPU tensors as on a GPU ``card`` (None: no GPU)."""

    def point(card):
        monkeypatch.setattr(ops_gemm, "_card", lambda x: card)
        monkeypatch.setattr(legacy, "is_cuda", lambda x: card is not None)
        monkeypatch.setattr(legacy, "device_sm", lambda device: card.sm)
        monkeypatch.setattr(legacy, "device_sm_count", lambda device: card.sm_count)
        # Changed on purpose from the cascade: the W8A16 GEMV takes M up to 8, not 4 (routing.CUDA_W8_GEMV_MAX_M). The
        # cascade with that one constant raised is still the oracle: same operand checks, x copies and SwiGLU.
        assert legacy.CUDA_W8_GEMV_MAX_M == 4 and routing.CUDA_W8_GEMV_MAX_M == 8
        monkeypatch.setattr(legacy, "CUDA_W8_GEMV_MAX_M", routing.CUDA_W8_GEMV_MAX_M)

    return point


@lru_cache(maxsize=2)
def _x_buffer(K, dtype):
    return torch.empty(MAX_M * (K + 8) + 8, dtype=dtype)


def _x(M, K, dtype, layout):
    buf = _x_buffer(K, dtype)
    if layout == "misaligned":
        return buf[1:1 + M * K].view(M, K)
    if layout in ("strided", "strided_odd"):
        pad = 8 if layout == "strided" else 1
        return buf[:M * (K + pad)].view(M, K + pad)[:, :K]
    x = buf[:M * K].view(M, K)
    return x.view(1, M, K) if layout == "3d" else x


@lru_cache(maxsize=2)
def _w4_weight(N, K, group_size, dtype):
    return (torch.empty((K // 8, N), dtype=torch.int32), torch.empty((K // group_size, N), dtype=dtype),
            torch.empty((K // group_size, N), dtype=torch.int8), torch.empty(N + 1, dtype=dtype))


@lru_cache(maxsize=2)
def _w8_weight(N, K, dtype):
    return torch.empty((K, N), dtype=torch.int8), torch.empty(N, dtype=dtype), torch.empty(N + 1, dtype=dtype)


def _residual(x, n, dtype):
    """A meta tensor (no data: the op adds it after SwiGLU at no cost), told apart from the stand-ins' outputs by its
    storage offset."""
    rows = x.shape[:-1].numel()
    return torch.empty(rows * n + 7, dtype=dtype, device="meta")[7:].view(*x.shape[:-1], n)


def _bias(b, kind):
    """None, an aligned bias, or one 2 bytes off 16-byte alignment (``kind``: None / "aligned" / "misaligned")."""
    return None if kind is None else b[:-1] if kind == "aligned" else b[1:]


def w4_args(M, N, K, group_size, dtype, layout="contiguous", residual=False, swiglu=False, bias=None):
    """The op's arguments; with a bias the weight is symmetric (no zero points)."""
    qweight, scales, zeros, b = _w4_weight(N, K, group_size, dtype)
    x = _x(M, K, dtype, layout)
    r = _residual(x, N // 2 if swiglu else N, dtype) if residual else None
    return (x, qweight, scales, None if bias else zeros, group_size, _bias(b, bias), r, swiglu)


def w8_args(M, N, K, dtype, layout="contiguous", residual=False, swiglu=False, bias=None):
    qweight, scales, b = _w8_weight(N, K, dtype)
    x = _x(M, K, dtype, layout)
    r = _residual(x, N // 2 if swiglu else N, dtype) if residual else None
    return (x, qweight, scales, _bias(b, bias), r, swiglu)


# --------------------------------------------------------------------------------------- equivalence with the cascade
FLAGS = [(False, False), (True, False), (False, True), (True, True)]  # (residual, swiglu)
LLAMA = SHAPES[:20]
CARDS = {"h100-pcie": H100_PCIE, "a100": A100, "l40s": L40S, "none": None}


def _every_m(shapes):
    """Every (shape, M, residual, swiglu) with M = 0..1024."""
    for shape in shapes:
        for residual, swiglu in FLAGS:
            for M in M_ALL:
                yield shape, M, residual, swiglu


def _w4_agrees(kernels, card, dtype, shape, M, layout="contiguous", residual=False, swiglu=False, bias=None,
               op=True):
    """``route_w4a16`` names the kernel (and SwiGLU mode) the legacy cascade called; with ``op``, the op makes
    exactly the calls the cascade made."""
    name, N, K, gs = shape
    args = w4_args(M, N, K, gs, dtype, layout, residual, swiglu, bias=bias)
    where = (card, name, M, dtype, layout, residual, swiglu, bias)
    aligned = W4_ALIGNED[layout] and bias != "misaligned"
    if M >= legacy.DEQUANT_MIN_M_W4:  # the wgmma GEMM's range was extended past the cascade's (WGMMA_W4_MAX_M)
        got = route_w4a16(M, N, K, dtype, card, group_size=gs, residual=residual, swiglu=swiglu, aligned=aligned)
        if got.backend == "w4_gemm_wgmma":
            _only_call(kernels, ops_gemm._w4a16_linear, args, "w4_gemm_wgmma", swiglu, bias, where)
            assert card.sm == 90 and not residual and (M <= routing.WGMMA_W4_MAX_M or (
                M <= routing.WGMMA_W4_BIG_MAX_M and got.params["bm"] == 256)
                or routing.wgmma_fills_prefill(M, got.params, card, 4)), where
            return
    got = route_w4a16(M, N, K, dtype, card, group_size=gs, residual=residual, swiglu=swiglu, aligned=aligned)
    if (got.backend == "w4_gemm_wgmma" and M <= legacy.CUDA_GEMV_MMA_MAX_M
            and (got.params["bm"], got.params["wt"]) == (64, 2)):
        # Changed on purpose from the cascade: two-tile 64-row plans (gemm_wgmma.SMALL_WIDE_M) take M = 17..32 from
        # the GEMV whatever warps they keep resident (routing, the note under WGMMA_MIN_WARPS).
        _only_call(kernels, ops_gemm._w4a16_linear, args, "w4_gemm_wgmma", swiglu, bias, where)
        assert card.sm == 90 and not residual and M > routing.GEMV_ONLY_MAX_M, where
        return
    if got.backend == "w4_gemv_mma" and legacy.CUDA_GEMV_MMA_MAX_M < M <= routing.GEMV_FEW_WARPS_MAX_M:
        # Changed on purpose from the cascade: M = 33..64 goes to the tensor-core GEMV where the wgmma plan keeps
        # fewer than WGMMA_FEW_WARPS warps per SM resident (routing, the note there).
        calls = kernels.run(ops_gemm._w4a16_linear, *args)
        assert [c[0] for c in calls] == ["w4_gemv_mma"], where
        a = dict(calls[0][1])  # x: the op's x, or its contiguous copy (strided layouts), as for M <= 32
        assert (a["qweight"], a["scales"], a["swiglu"]) == ("arg1", "arg2", swiglu), where
        assert a["bias"] == (f"arg{len(args) - 3}" if bias else None), where
        assert card.sm == 90 and not residual and routing.gemv_over_few_warps(M, N, K, gs, dtype, card), where
        return
    calls = kernels.run(legacy.w4a16_linear, *args)
    assert not op or kernels.run(ops_gemm._w4a16_linear, *args) == calls, where
    got = route_w4a16(M, N, K, dtype, card, group_size=gs, residual=residual, swiglu=swiglu, aligned=aligned)
    assert (got.backend, got.swiglu) == kernels.route_of(calls), where


def _only_call(kernels, op, args, backend, swiglu, bias, where):
    """``op(*args)`` calls the ``backend`` kernel alone, with the op's own x, weight tensors, bias and SwiGLU flag."""
    calls = kernels.run(op, *args)
    assert [c[0] for c in calls] == [backend], where
    a = dict(calls[0][1])
    assert (a["x"], a["qweight"], a["scales"], a["swiglu"]) == ("arg0", "arg1", "arg2", swiglu), where
    # the op's bias argument is the third from the end, before residual and swiglu (w4_args / w8_args)
    assert a["bias"] == (f"arg{len(args) - 3}" if bias else None) and a["out"] is None, where


# x layouts whose rows the wgmma GEMM takes as they are (16-byte aligned rows and row stride)
WGMMA_X_OK = {"contiguous": True, "misaligned": False, "strided": True, "strided_odd": False, "3d": True}


def _w8_agrees(kernels, card, dtype, shape, M, layout="contiguous", residual=False, swiglu=False, bias=None,
               op=True):
    name, N, K, _ = shape
    args = w8_args(M, N, K, dtype, layout, residual, swiglu, bias=bias)
    where = (card, name, M, dtype, layout, residual, swiglu, bias)
    route = route_w8a16(M, N, K, dtype, card, residual=residual, swiglu=swiglu)
    if route.backend == "w8_gemm_wgmma":  # the route added since the cascade: its operands decide, then the op
        aligned = WGMMA_X_OK[layout] and bias != "misaligned"
        got = route_w8a16(M, N, K, dtype, card, residual=residual, swiglu=swiglu, aligned=aligned)
        if got.backend == "w8_gemm_wgmma":
            assert (routing.WGMMA_W8_MIN_M <= M and card.sm == 90 and dtype == torch.float16 and not residual
                    and (M <= routing.WGMMA_W8_MAX_M or routing.wgmma_fills_prefill(M, got.params, card, 8))), where
            _only_call(kernels, ops_gemm._w8a16_linear, args, "w8_gemm_wgmma", swiglu, bias, where)
            return
    calls = kernels.run(legacy.w8a16_linear, *args)
    if layout.startswith("strided") and calls[0][0] == "triton_w8_gemm":
        # The one intended difference: the cascade made x contiguous before asking whether the GEMV takes the
        # shape, so at M <= 4 a strided x reached the Triton kernel as a copy where the GEMV did not take it (K =
        # 608 here); the op copies it for the GEMV only. Same result: the Triton kernel reads x by its row stride.
        triton = calls[0][0], tuple((k, "arg0" if k == "x" else v) for k, v in calls[0][1])
        calls = [triton, *calls[1:]]
    gemv = route_w8a16(M, N, K, dtype, card, residual=residual, swiglu=swiglu, aligned=W8_ALIGNED[layout])
    if gemv.backend == "w8_gemv_mma" and M > legacy.CUDA_W8_GEMV_MAX_M:
        # Changed on purpose from the cascade: M = 9..16 goes to the GEMV's two-tile build with SwiGLU fused
        # (routing.CUDA_W8_GEMV_SWIGLU_MAX_M), where the cascade ran Triton and then the activation kernel, and without
        # it where its plan passes routing.w8_two_tile_gemv_fits (CUDA_W8_GEMV_TWO_TILE_MAX_M), where the cascade ran
        # Triton.
        calls = kernels.run(ops_gemm._w8a16_linear, *args)
        assert [c[0] for c in calls] == ["w8_gemv_mma"], where
        a = dict(calls[0][1])  # x: the op's x, or its contiguous copy (strided layouts), as for M <= 8
        assert (a["qweight"], a["scales"], a["swiglu"]) == ("arg1", "arg2", swiglu), where
        assert a["bias"] == (f"arg{len(args) - 3}" if bias else None), where
        assert not residual and M <= routing.CUDA_W8_GEMV_SWIGLU_MAX_M == routing.CUDA_W8_GEMV_TWO_TILE_MAX_M, where
        assert swiglu or routing.w8_two_tile_gemv_fits(gemv.params, card), where
        return
    if swiglu and not residual and [c[0] for c in calls] == ["w8_gemv_mma", "swiglu"]:
        # The other change since the cascade: the GEMV's SwiGLU epilogue, one call with swiglu=True where the
        # cascade made the same GEMV call without it and then ran the activation kernel.
        calls = [(calls[0][0], tuple((k, True if k == "swiglu" else v) for k, v in calls[0][1]))]
    assert not op or kernels.run(ops_gemm._w8a16_linear, *args) == calls, where
    aligned = W8_ALIGNED[layout] and (route.backend != "w8_gemm_wgmma")  # wgmma refused: the cascade's kernel
    got = route_w8a16(M, N, K, dtype, card, residual=residual, swiglu=swiglu, aligned=aligned)
    assert (got.backend, got.swiglu) == kernels.route_of(calls), where


AGREES = {"w4": _w4_agrees, "w8": _w8_agrees}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("family", ["w4", "w8"])
def test_route_is_the_old_cascades_choice_for_every_m_on_h100(kernels, on_card, family, dtype):
    """The route on every M (the op's own calls: at the edges, below, which keeps this test's time down)."""
    on_card(H100)
    for shape, M, residual, swiglu in _every_m(LLAMA):
        AGREES[family](kernels, H100, dtype, shape, M, residual=residual, swiglu=swiglu, op=M in M_EDGES)


@pytest.mark.parametrize("family", ["w4", "w8"])
def test_routes_and_calls_are_the_old_cascades_for_odd_shapes_and_operand_layouts(kernels, on_card, family):
    """Shapes that miss a kernel's divisibility rule, x misaligned / strided / 3-D, a misaligned bias: H100, M at
    every threshold's edge."""
    on_card(H100)
    for shape in SHAPES:
        for residual, swiglu in FLAGS:
            for M in M_EDGES:
                for dtype in (torch.float16, torch.bfloat16):
                    AGREES[family](kernels, H100, dtype, shape, M, residual=residual, swiglu=swiglu)
                for layout in LAYOUTS[1:]:
                    AGREES[family](kernels, H100, torch.float16, shape, M, layout, residual, swiglu)
                for bias in ("aligned", "misaligned"):
                    AGREES[family](kernels, H100, torch.float16, shape, M, residual=residual, swiglu=swiglu,
                                   bias=bias)


@pytest.mark.parametrize("card", CARDS.values(), ids=CARDS.keys())
@pytest.mark.parametrize("family", ["w4", "w8"])
def test_routes_and_calls_are_the_old_cascades_on_other_cards(kernels, on_card, family, card):
    """Another SM count (H100 PCIe: other wgmma plans), not Hopper (A100, L40S: no wgmma), no GPU (the reference)."""
    on_card(card)
    for shape in SHAPES:
        for residual, swiglu in FLAGS:
            for M in M_EDGES:
                for dtype in (torch.float16, torch.bfloat16):
                    AGREES[family](kernels, card, dtype, shape, M, residual=residual, swiglu=swiglu)


# ------------------------------------------------------------------------------------------------ the routes, as data
def _ranges(route, shape, ms=range(1, 1025)):
    """[(first M, last M, backend)] of ``route(M, shape)`` over ``ms``."""
    out = []
    for M in ms:
        backend = route(M, shape).backend
        if out and out[-1][2] == backend:
            out[-1][1] = M
        else:
            out.append([M, M, backend])
    return [tuple(r) for r in out]


GEMV, WGMMA, DEQUANT = "w4_gemv_mma", "w4_gemm_wgmma", "dequant_cublas"
# fp16, no residual, no SwiGLU, H100. The wgmma GEMM takes M = 17..32 from the tensor-core GEMV where its plan keeps
# >= 10 warps per SM resident (qkv, gate_up, down, 8k: 11.6-15.5), not at o (7.8). SmolLM2's K = 576 is no multiple
# of 128, which the tensor-core GEMV needs (the scalar GEMV takes M = 1, Triton up to 16); odd_dims' down has 32-wide
# groups, which the wgmma GEMM does not take (64), and K = 608 (Triton up to 255).
# From 512 to 1023 the wgmma GEMM only where its plan takes 256-row blocks (M padded no more than by 128-row blocks:
# 641..768, 897..1023, and 512 itself), dequantize + cuBLAS in between; N = 960 (SmolLM2) has no 128-column tiles.
# At 1024 (a prefill size: WGMMA_PREFILL_MIN_FILL) only where the 256-row grid fills its waves: 4 x 32 = 128 blocks
# (o, down, 70b/8 o at N = 8192: 4 x 64 = 256 of 264 slots), 4 x 224 = 896 of 924 (gate_up), not 4 x 48 = 192 of 264
# (qkv).
_BIG = [(513, 640, DEQUANT), (641, 768, WGMMA), (769, 896, DEQUANT)]
_BIG_FULL = _BIG + [(897, 1024, WGMMA)]
W4_H100 = {
    "l3-8b qkv": [(1, 16, GEMV), (17, 512, WGMMA)] + _BIG + [(897, 1023, WGMMA), (1024, 1024, DEQUANT)],
    "l3-8b o": [(1, 32, GEMV), (33, 512, WGMMA)] + _BIG_FULL,
    "l3-8b gate_up": [(1, 16, GEMV), (17, 512, WGMMA)] + _BIG_FULL,
    "l3-8b down": [(1, 16, GEMV), (17, 512, WGMMA)] + _BIG_FULL,
    "8k": [(1, 16, GEMV), (17, 512, WGMMA)] + _BIG_FULL,
    "l3-70b/8 o": [(1, 32, GEMV), (33, 512, WGMMA)] + _BIG_FULL,
    # K = 576: the tensor-core GEMV with two-row chunks (gemv_mma.U_SHORT), to M = 64 where the wgmma plan keeps
    # too few warps (GEMV_FEW_WARPS_MAX_M)
    "smollm2 qkv": [(1, 64, GEMV), (65, 511, WGMMA), (512, 1024, DEQUANT)],
    "odd_dims down": [(1, 255, "triton_w4_gemm"), (256, 1024, DEQUANT)],
}
# W8A16 (no SwiGLU): the GEMV up to 8 rows, then to 16 its two-tile build where the plan loads 8 bytes a lane or more
# over column blocks for half the SMs or more (q|k|v: vec 8, 96 blocks), else Triton (down: vec 4; SmolLM2's q|k|v:
# 15 blocks; N = 1000: 16), then the wgmma GEMM's INT8 build where it takes the shape (N a multiple of 64, K of 64);
# SmolLM2's qkv (K = 576) takes it too; odd_dims' down (K = 608) and N = 1000 do not.
W8_H100 = {
    "l3-8b qkv": [(1, 16, "w8_gemv_mma"), (17, 1023, "w8_gemm_wgmma"), (1024, 1024, DEQUANT)],
    "l3-8b o": [(1, 8, "w8_gemv_mma"), (9, 16, "triton_w8_gemm"), (17, 1024, "w8_gemm_wgmma")],
    "l2-7b qkv": [(1, 16, "w8_gemv_mma"), (17, 1024, "w8_gemm_wgmma")],
    "l3-8b down": [(1, 8, "w8_gemv_mma"), (9, 16, "triton_w8_gemm"), (17, 1024, "w8_gemm_wgmma")],
    "smollm2 qkv": [(1, 8, "w8_gemv_mma"), (9, 16, "triton_w8_gemm"), (17, 1023, "w8_gemm_wgmma"),
                  (1024, 1024, DEQUANT)],
    "odd_dims down": [(1, 511, "triton_w8_gemm"), (512, 1024, DEQUANT)],  # K = 608: no multiple of 64
    "N 1000": [(1, 8, "w8_gemv_mma"), (9, 511, "triton_w8_gemm"), (512, 1024, DEQUANT)],
}


def test_h100_routes_of_the_measured_shapes():
    shapes = {name: (N, K, gs) for name, N, K, gs in SHAPES}

    def w4(M, shape, **kw):
        N, K, gs = shape
        return route_w4a16(M, N, K, torch.float16, H100, group_size=gs, **kw)

    def w8(M, shape, **kw):
        N, K, _ = shape
        return route_w8a16(M, N, K, torch.float16, H100, **kw)

    for name, want in W4_H100.items():
        assert _ranges(w4, shapes[name]) == want, name
    for name, want in W8_H100.items():
        assert _ranges(w8, shapes[name]) == want, name
    qkv = shapes["l3-8b qkv"]
    # bf16: no CUDA kernel takes it (fp16 only); a residual: only Triton and dequantize + cuBLAS add one.
    assert _ranges(lambda M, s: route_w4a16(M, *s[:2], torch.bfloat16, H100, group_size=128), qkv) == [
        (1, 255, "triton_w4_gemm"), (256, 1024, DEQUANT)]
    assert _ranges(lambda M, s: w4(M, s, residual=True), qkv) == [(1, 255, "triton_w4_gemm"), (256, 1024, DEQUANT)]
    assert _ranges(lambda M, s: w8(M, s, residual=True), qkv) == [(1, 511, "triton_w8_gemm"), (512, 1024, DEQUANT)]
    # SwiGLU: fused where the kernel has the epilogue (W8A16: the GEMV without a residual and the wgmma GEMM), after
    # the GEMM otherwise.
    assert {w4(M, qkv, swiglu=True).swiglu for M in (1, 16, 17, 255)} == {"fused"}
    assert w4(1024, qkv, swiglu=True).swiglu == "after" and w4(1023, qkv, swiglu=True).swiglu == "fused"
    assert w4(1, qkv).swiglu == "none"
    assert {w8(M, qkv, swiglu=True).swiglu for M in (1, 8, 9, 16, 17, 1023)} == {"fused"}
    assert w8(1024, qkv, swiglu=True).swiglu == "after" and w8(9, qkv, residual=True, swiglu=True).swiglu == "after"
    # W8A16 with SwiGLU fused: the GEMV up to 16 rows (two x tiles a block from 9), without it up to 8.
    assert _ranges(lambda M, s: w8(M, s, swiglu=True), qkv) == [
        (1, 16, "w8_gemv_mma"), (17, 1023, "w8_gemm_wgmma"), (1024, 1024, DEQUANT)]
    assert _ranges(lambda M, s: w8(M, s, swiglu=True, residual=True), qkv) == [
        (1, 8, "w8_gemv_mma"), (9, 511, "triton_w8_gemm"), (512, 1024, DEQUANT)]
    # Without SwiGLU the two-tile build only where routing.w8_two_tile_gemv_fits: SmolLM2's gate/up (N = 3072: vec 8,
    # 48 column blocks) takes it with SwiGLU only.
    smollm2_gate_up = shapes["smollm2 gate_up"]
    assert _ranges(lambda M, s: w8(M, s, swiglu=True), smollm2_gate_up, range(1, 17)) == [(1, 16, "w8_gemv_mma")]
    assert _ranges(lambda M, s: w8(M, s), smollm2_gate_up, range(1, 17)) == [
        (1, 8, "w8_gemv_mma"), (9, 16, "triton_w8_gemm")]
    assert w8(1, qkv, swiglu=True).backend == "w8_gemv_mma"
    assert (w8(1, qkv, residual=True, swiglu=True).backend, w8(1, qkv, residual=True, swiglu=True).swiglu) == (
        "w8_gemv_mma", "after")
    assert _ranges(lambda M, s: route_w8a16(M, *s[:2], torch.float16, A100), qkv) == [
        (1, 16, "w8_gemv_mma"), (17, 511, "triton_w8_gemm"), (512, 1024, DEQUANT)]
    # Not Hopper: no wgmma GEMM; the tensor-core GEMV still up to 32.
    assert _ranges(lambda M, s: route_w4a16(M, *s[:2], torch.float16, A100, group_size=128), qkv) == [
        (1, 32, GEMV), (33, 255, "triton_w4_gemm"), (256, 1024, DEQUANT)]
    assert route_w4a16(1, 4096, 4096, torch.float16, None, group_size=128).backend == "reference"


def test_w8_two_tile_gemv_needs_long_loads_over_half_the_sms():
    """routing.w8_two_tile_gemv_fits at its edges (132 SMs: 66 column blocks), and what it means for a route at
    M = 9..16 without SwiGLU: the GEMV where it fits, Triton where it does not; M <= 8 and SwiGLU unaffected."""
    fits = routing.w8_two_tile_gemv_fits
    assert fits({"vec": 8, "grid": (66, 1)}, H100) and fits({"vec": 16, "grid": (448, 1)}, H100)
    assert not fits({"vec": 8, "grid": (65, 1)}, H100) and not fits({"vec": 4, "grid": (128, 1)}, H100)
    for N, K in ((6144, 4096), (4096, 4096), (960, 576), (15360, 5120), (2560, 8192)):
        for M in (8, 9, 16):
            plan = mma8.gemv_plan(M, N, K, sm_count=H100.sm_count)
            want = "w8_gemv_mma" if M <= 8 or fits(plan, H100) else "triton_w8_gemm"
            assert route_w8a16(M, N, K, torch.float16, H100).backend == want, (N, K, M)
            assert route_w8a16(M, N, K, torch.float16, H100, swiglu=True).backend == "w8_gemv_mma", (N, K, M)
    assert route_w8a16(12, 6144, 4096, torch.float16, H100).backend == "w8_gemv_mma"  # vec 8, 96 blocks
    assert route_w8a16(12, 4096, 4096, torch.float16, H100).backend == "triton_w8_gemm"  # vec 4
    assert route_w8a16(12, 960, 576, torch.float16, H100).backend == "triton_w8_gemm"  # vec 8, 15 blocks


def test_prefill_sizes_take_the_wgmma_gemm_where_its_256_row_waves_are_full():
    """Past WGMMA_W4_BIG_MAX_M / WGMMA_W8_MAX_M up to WGMMA_PREFILL_MAX_M (H100, fp16, no residual): the unsplit
    256-row plan where ``wave_fill`` >= WGMMA_PREFILL_MIN_FILL, else dequantize + cuBLAS. Fills by hand: blocks =
    cdiv(M, 256) x N / 128, one per SM, over the slots of their waves, times M / (M padded to 256)."""
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
              "13b_o": (5120, 5120)}
    fills = {("qkv", 1024): 192 / 264, ("qkv", 1280): 240 / 264, ("qkv", 1536): 288 / 396, ("o", 2048): 256 / 264,
             ("gate_up", 2048): 1792 / 1848, ("13b_o", 2048): 320 / 396, ("o", 2000): 256 / 264 * 2000 / 2048}
    for (name, M), want in fills.items():
        N, K = shapes[name]
        assert wg.wave_fill(M, wg.gemm_plan(M, N, K), 132) == pytest.approx(want), (name, M)
    # qkv 48 column tiles: 5 x 48 = 240 of 264 (1280), 288 of 396 (1536, not), 384 of 396 (2000: x 2000 / 2048);
    # o and down 32: only 8 row tiles fill (256 of 264); gate_up 224: 1120 of 1188, 1344 of 1452, 1792 of 1848;
    # 13b_o 40: 240 of 264 at 1536 only (200 of 264, 320 of 396 otherwise).
    takes = {("qkv", 1280), ("qkv", 2000), ("qkv", 2048), ("o", 2000), ("o", 2048), ("down", 2000), ("down", 2048),
             ("gate_up", 1280), ("gate_up", 1536), ("gate_up", 2000), ("gate_up", 2048), ("13b_o", 1536)}
    for name, (N, K) in shapes.items():
        for M in (1280, 1536, 2000, 2048, 2049, 4096):
            w4 = route_w4a16(M, N, K, torch.float16, H100, group_size=128)
            w8 = route_w8a16(M, N, K, torch.float16, H100)
            if (name, M) in takes:
                assert (w4.backend, w8.backend) == (WGMMA, "w8_gemm_wgmma"), (name, M)
                assert w4.params["bm"] == w8.params["bm"] == 256 and w4.params["splits"] == w8.params["splits"] == 1
                assert route_w4a16(M, N, K, torch.float16, H100, group_size=128, swiglu=True).swiglu == "fused"
                assert route_w8a16(M, N, K, torch.float16, H100, swiglu=True).swiglu == "fused"
            else:
                assert (w4.backend, w8.backend) == (DEQUANT, DEQUANT), (name, M)
            # Not with a residual, not in bf16, not off Hopper: the dequantize route, as before.
            assert route_w4a16(M, N, K, torch.float16, H100, group_size=128, residual=True).backend == DEQUANT
            assert route_w8a16(M, N, K, torch.bfloat16, H100).backend == DEQUANT
            assert route_w4a16(M, N, K, torch.float16, A100, group_size=128).backend == DEQUANT


def test_wgmma_takes_over_from_the_gemv_above_16_rows_where_it_keeps_enough_warps():
    """The M = 17..32 rule on the five Llama shapes (plans only, no GPU): the wgmma GEMM for qkv, gate_up, down and
    8k (11.6-15.5 warps per SM), the GEMV for o (7.8) and for every shape at M <= 16."""
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
              "8k": (8192, 8192)}
    for M, expect in ((16, set()), (17, {"qkv", "gate_up", "down", "8k"}), (32, {"qkv", "gate_up", "down", "8k"})):
        assert {name for name, (N, K) in shapes.items()
                if routing.wgmma_over_gemv(M, wg.gemm_plan(M, N, K))} == expect, M


def test_routes_carry_the_plan_their_launcher_computes_for_the_card():
    for card in (H100, H100_PCIE):
        for M in (1, 8, 16, 24, 32, 64, 128, 255):
            for N, K in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
                r = route_w4a16(M, N, K, torch.float16, card, group_size=128)
                want = {GEMV: lambda: mma.gemv_plan(M, N, K, 128, sm_count=card.sm_count),
                        WGMMA: lambda: wg.gemm_plan(M, N, K, card.sm_count)}[r.backend]()
                assert r.params == want and r == route_w4a16(M, N, K, torch.float16, card, group_size=128)
                r8 = route_w8a16(M, N, K, torch.float16, card)
                if M <= routing.CUDA_W8_GEMV_MAX_M or r8.backend == "w8_gemv_mma":
                    assert r8.backend == "w8_gemv_mma" and r8.params == mma8.gemv_plan(M, N, K,
                                                                                       sm_count=card.sm_count)
    assert route_w4a16(1, 960, 576, torch.float16, H100, group_size=96).params == cu.gemv_plan(1, 960)  # not 2^n
    assert route_w4a16(1, 960, 576, torch.float16, H100, group_size=64).params == mma.gemv_plan(1, 960, 576, 64)
    # The SM count counts: down at M = 24 keeps 15.5 warps per SM resident on 132 SMs, 9.0 (< 10) on 114.
    assert route_w4a16(24, 4096, 14336, torch.float16, H100, group_size=128).backend == WGMMA
    assert route_w4a16(24, 4096, 14336, torch.float16, H100_PCIE, group_size=128).backend == GEMV
    assert route_w4a16(1100, 4096, 4096, torch.float16, H100, group_size=128).plan == ()  # dequantize + cuBLAS
    # 512..1023: the wgmma GEMM only with 256-row blocks (M = 600 pads to 640 rows with 128-row blocks, to 768 with 256)
    assert route_w4a16(700, 4096, 4096, torch.float16, H100, group_size=128).params["bm"] == 256
    assert route_w4a16(600, 4096, 4096, torch.float16, H100, group_size=128).backend == DEQUANT
    assert route_w4a16(8, 4096, 4096, torch.float16, H200, group_size=128) == \
        route_w4a16(8, 4096, 4096, torch.float16, H100, group_size=128)


def test_card_of_reads_the_device_when_asked(monkeypatch):
    class Props:
        name, major, minor, multi_processor_count = "NVIDIA H100 PCIe", 9, 0, 114

    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: asked.append(i) or Props)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    routing._card_of_index.cache_clear()
    try:
        assert routing.card_of() == H100_PCIE and routing.card_of("cuda:1") == H100_PCIE
        assert routing.card_of(torch.device("cuda", 0)) == H100_PCIE
        assert asked == [1, 0]  # once per device
    finally:
        routing._card_of_index.cache_clear()


# -------------------------------------------------------------------- on the GPU: the op runs the kernel it routes to
def _gpu_route(family, M, N, K, **kw):
    route = route_w4a16 if family == "w4" else route_w8a16
    return route(M, N, K, torch.float16, routing.card_of(), **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 4, 8, 16, 24, 32])
@pytest.mark.parametrize("N", [2048, 8192])
def test_op_routes_small_fp16_to_gemv_and_agrees_with_triton(M, N):
    x = torch.randn(M, 4096, device="cuda", dtype=torch.float16)
    qw = quantize_int4(torch.randn(N, 4096, dtype=torch.float16), 128).to("cuda")
    args = (x, qw.qweight, qw.scales, qw.zeros, 128)
    y_op = torch.ops.tritrt.w4a16_linear(*args, None, None)
    y_mma = mma.w4a16_gemv_mma(*args)
    y_tr = w4a16_gemm(*args)
    route = _gpu_route("w4", M, N, 4096, group_size=128)
    assert route.backend in (GEMV, WGMMA)
    assert torch.equal(y_op, y_mma if route.backend == GEMV else wg.w4a16_gemm_wgmma(*args))
    ref = w4a16_reference(*args)
    tol = torch.finfo(torch.float16).eps * float(ref.abs().max())  # two independent roundings: one ulp apart at most
    for y in (y_mma, cu.w4a16_gemv(*args)) if M <= cu.MAX_M else (y_mma,):
        assert float((y.float() - y_tr.float()).abs().max()) <= tol


@pytest.mark.gpu
@pytest.mark.parametrize("M, N", [(33, 8192), (64, 8192), (33, 2048), (64, 2048), (128, 2048), (255, 2048)])
def test_op_routes_mid_m_fp16_on_hopper(M, N):
    """M = 33..255 on Hopper: the wgmma GEMM, except at M <= GEMV_FEW_WARPS_MAX_M where its plan keeps fewer than
    WGMMA_FEW_WARPS warps per SM (N = 2048, K = 1024 at M = 33 and 64): the tensor-core GEMV tiled in M."""
    x = torch.randn(M, 1024, device="cuda", dtype=torch.float16)
    qw = quantize_int4(torch.randn(N, 1024, dtype=torch.float16), 128).to("cuda")
    r = torch.randn(M, N, device="cuda", dtype=torch.float16)
    args = (x, qw.qweight, qw.scales, qw.zeros, 128)
    y_op = torch.ops.tritrt.w4a16_linear(*args, None, None)
    if routing.card_of().sm == 90:
        few_warps = routing.gemv_over_few_warps(M, N, 1024, 128, torch.float16, routing.card_of())
        assert few_warps == (N == 2048 and M <= 64)  # the cases are what they say
        want = GEMV if few_warps else WGMMA
        assert _gpu_route("w4", M, N, 1024, group_size=128).backend == want
        assert torch.equal(y_op, mma.w4a16_gemv_mma(*args) if few_warps else wg.w4a16_gemm_wgmma(*args))
    # With a residual the op takes the Triton kernel (the wgmma GEMM has no residual epilogue).
    assert _gpu_route("w4", M, N, 1024, group_size=128, residual=True).backend == "triton_w4_gemm"
    y_res = torch.ops.tritrt.w4a16_linear(*args, None, r)
    assert torch.equal(y_res, w4a16_gemm(*args, residual=r))
    ref = w4a16_reference(*args)
    assert_close_to_ref(y_op, ref, baseline=x @ dequantize(qw).t(), factor=2.0,
                        atol=0.5 * torch.finfo(torch.float16).eps * float(ref.abs().max()))


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 16, 64, 128, 300, 600, 768])
def test_op_swiglu_takes_the_fast_paths_for_fp16(M):
    """``w4a16_linear(..., swiglu=True)``: the tensor-core GEMV up to CUDA_GEMV_MMA_MAX_M (on Hopper up to
    GEMV_FEW_WARPS_MAX_M where the wgmma plan keeps few warps: M = 64 on this shape), the wgmma GEMM (Hopper)
    up to WGMMA_W4_MAX_M (up to WGMMA_W4_BIG_MAX_M with 256-row blocks: M = 768, not 600), from there (and from
    DEQUANT_MIN_M_W4 where the wgmma GEMM does not run: a residual, not Hopper) dequantize + cuBLAS + the SwiGLU kernel
    on interleaved pairs; with a residual the Triton kernel below DEQUANT_MIN_M_W4. All within tolerance of the
    reference."""
    from kernels.activation import swiglu

    N, K = 2048, 1024
    x, qw, bias, _, _ = w4_gpu_case(M, N, K, 128, False, seed=M + 3)
    r = torch.randn(M, N // 2, device="cuda", dtype=torch.float16)
    args = (x, qw.qweight, qw.scales, qw.zeros, 128, bias)

    def dequant_route(residual):
        y = swiglu(dequant_matmul(x, dequantize_w4_kn(qw.qweight, qw.scales, qw.zeros, 128), bias), interleaved=True)
        return y if residual is None else y + residual

    y = torch.ops.tritrt.w4a16_linear(*args, None, True)
    y_res = torch.ops.tritrt.w4a16_linear(*args, r, True)
    route, route_res = (_gpu_route("w4", M, N, K, group_size=128, swiglu=True, residual=res) for res in (False, True))
    hopper = torch.cuda.get_device_capability()[0] == 9
    if M >= routing.DEQUANT_MIN_M_W4:
        assert (route_res.backend, route_res.swiglu) == (DEQUANT, "after") and torch.equal(y_res, dequant_route(r))
        big = M <= routing.WGMMA_W4_BIG_MAX_M and wg.gemm_plan(M, N, K)["bm"] == 256
        if hopper and (M <= routing.WGMMA_W4_MAX_M or big):
            assert (route.backend, route.swiglu) == (WGMMA, "fused")
            assert torch.equal(y, wg.w4a16_gemm_wgmma(*args, swiglu=True))
        else:
            assert (route.backend, route.swiglu) == (DEQUANT, "after") and torch.equal(y, dequant_route(None))
    else:
        assert (route_res.backend, route_res.swiglu) == ("triton_w4_gemm", "fused")
        assert torch.equal(y_res, w4a16_gemm(*args, r, swiglu=True))  # a residual: the Triton epilogue
        assert route.swiglu == "fused"
        if route.backend == GEMV:  # above CUDA_GEMV_MMA_MAX_M only where the wgmma plan keeps few warps (Hopper)
            assert M <= routing.CUDA_GEMV_MMA_MAX_M or (
                hopper and routing.gemv_over_few_warps(M, N, K, 128, torch.float16, routing.card_of()))
            assert torch.equal(y, mma.w4a16_gemv_mma(*args, swiglu=True))
        elif route.backend == WGMMA:
            assert torch.equal(y, wg.w4a16_gemm_wgmma(*args, swiglu=True))
    for out, res in ((y, None), (y_res, r)):
        ref = w4a16_reference(*args, res, True)
        assert_close_to_ref(out, ref, baseline=dequant_baseline(x, qw, bias, res, swiglu=True), factor=2.0,
                            atol=0.5 * torch.finfo(torch.float16).eps * float(ref.abs().max()))


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("M, N", [(2048, 2048), (2000, 2048), (2048, 3072)])
def test_op_routes_prefill_sizes_to_wgmma_where_its_waves_are_full(bits, M, N):
    """M = 2000 / 2048, K = 1024: N = 2048 gives 8 x 16 = 128 blocks of 256 rows (fill 0.97 / 0.94 on an H100): the
    wgmma GEMM; N = 3072 gives 192 (0.73): dequantize + cuBLAS. Either way within tolerance of the reference."""
    K = 1024
    g = torch.Generator().manual_seed(M + N + bits)
    x = torch.randn(M, K, generator=g).half().cuda()
    w = torch.randn(N, K, generator=g).half()
    if bits == 4:
        qw = quantize_int4(w, 128).to("cuda")
        args = (x, qw.qweight, qw.scales, qw.zeros, 128)
        y = torch.ops.tritrt.w4a16_linear(*args, None, None)
        route = _gpu_route("w4", M, N, K, group_size=128)
        kernel, w_kn, ref = wg.w4a16_gemm_wgmma, dequantize_w4_kn(*args[1:]), w4a16_reference(*args)
    else:
        qw = quantize_int8(w).to("cuda")
        args = (x, qw.qweight, qw.scales)
        y = torch.ops.tritrt.w8a16_linear(*args, None, None)
        route = _gpu_route("w8", M, N, K)
        kernel, w_kn, ref = wg.w8a16_gemm_wgmma, dequantize_w8_kn(*args[1:]), w8a16_reference(*args)
    card = routing.card_of()
    takes = card.sm == 90 and routing.wgmma_fills_prefill(M, wg.gemm_plan(M, N, K, card.sm_count, bits=bits), card,
                                                           bits)
    if card.sm == 90 and card.sm_count == 132:  # H100 / H200: the fills above
        assert takes == (N == 2048)
    if takes:
        assert route.backend.endswith("gemm_wgmma") and torch.equal(y, kernel(*args))
    else:
        assert route.backend == DEQUANT and torch.equal(y, dequant_matmul(x, w_kn))
    assert_close_to_ref(y, ref, baseline=x @ dequantize(qw).t(), factor=2.0,
                        atol=0.5 * torch.finfo(torch.float16).eps * float(ref.abs().max()))


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 4, 8, 9, 100])
def test_op_routes_fp16_w8_to_its_kernel_and_agrees_with_triton(M):
    g = torch.Generator().manual_seed(100 + M)
    w = torch.randn(2048, 4096, generator=g).half()
    x = torch.randn(M, 4096, generator=g).half().cuda()
    q = quantize_int8(w).to("cuda")
    bias = torch.randn(2048, generator=g).half().cuda()
    y_op = torch.ops.tritrt.w8a16_linear(x, q.qweight, q.scales, bias, None)
    y_tr = w8a16_gemm(x, q.qweight, q.scales, bias)
    backend = _gpu_route("w8", M, 2048, 4096).backend
    hopper = torch.cuda.get_device_capability()[0] == 9
    assert backend == ("w8_gemv_mma" if M <= routing.CUDA_W8_GEMV_MAX_M else
                       "w8_gemm_wgmma" if hopper and M >= routing.WGMMA_W8_MIN_M else "triton_w8_gemm")
    routed = {"w8_gemv_mma": lambda: mma8.w8a16_gemv_mma(x, q.qweight, q.scales, bias),
              "w8_gemm_wgmma": lambda: wg.w8a16_gemm_wgmma(x, q.qweight, q.scales, bias),
              "triton_w8_gemm": lambda: y_tr}
    assert torch.equal(y_op, routed[backend]())
    ref = w8a16_reference(x, q.qweight, q.scales, bias)
    # Two independent roundings of the output (the wgmma GEMM scales the fp32 sum of q x, Triton rounds q s to fp16
    # first: relative 2^-12 per weight, averaging out over K): one ulp of the largest output apart at most.
    tol = torch.finfo(torch.float16).eps * float(ref.abs().max())
    assert float((y_op.float() - y_tr.float()).abs().max()) <= tol
    # With a residual the op keeps the Triton kernel (the GEMV has no residual input).
    r = torch.randn(M, 2048, device="cuda", dtype=torch.float16)
    assert torch.equal(torch.ops.tritrt.w8a16_linear(x, q.qweight, q.scales, bias, r),
                       w8a16_gemm(x, q.qweight, q.scales, bias, r))


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_ops_route_large_m_through_dequantize_and_cublas(bits, dtype):
    from kernels.activation import swiglu

    M, N, K = (routing.DEQUANT_MIN_M_W4 if bits == 4 else routing.DEQUANT_MIN_M_W8) + 37, 1000, 512
    g = torch.Generator().manual_seed(bits)
    w = torch.randn(N, K, generator=g).to(dtype)
    x = torch.randn(M, K, generator=g).to(dtype).cuda()
    bias = torch.randn(N, generator=g).to(dtype).cuda()
    res = torch.randn(M, N, generator=g).to(dtype).cuda()
    if bits == 4:
        qw = quantize_int4(w, 64).to("cuda")
        y = torch.ops.tritrt.w4a16_linear(x, qw.qweight, qw.scales, qw.zeros, 64, bias, res)
        w_kn = dequantize_w4_kn(qw.qweight, qw.scales, qw.zeros, 64)
        ref = w4a16_reference(x, qw.qweight, qw.scales, qw.zeros, 64, bias, res)
    else:
        qw = quantize_int8(w).to("cuda")
        y = torch.ops.tritrt.w8a16_linear(x, qw.qweight, qw.scales, bias, res)
        w_kn = dequantize_w8_kn(qw.qweight, qw.scales)
        ref = w8a16_reference(x, qw.qweight, qw.scales, bias, res)
    assert torch.equal(w_kn, dequantize(qw).t())
    assert torch.equal(y, dequant_matmul(x, w_kn, bias, res))  # routed here
    assert_gemm_close(y, ref, x @ dequantize(qw).t() + bias + res)
    # swiglu=True (N even: interleaved gate/up pairs): the same matmul, then the SwiGLU kernel on the interleaved
    # pairs, then the residual.
    res2 = res[:, : N // 2].contiguous()
    if bits == 4:
        y2 = torch.ops.tritrt.w4a16_linear(x, qw.qweight, qw.scales, qw.zeros, 64, bias, res2, True)
        ref2 = w4a16_reference(x, qw.qweight, qw.scales, qw.zeros, 64, bias, res2, True)
    else:
        y2 = torch.ops.tritrt.w8a16_linear(x, qw.qweight, qw.scales, bias, res2, True)
        ref2 = w8a16_reference(x, qw.qweight, qw.scales, bias, res2, True)
    assert torch.equal(y2, swiglu(dequant_matmul(x, w_kn, bias), interleaved=True) + res2)
    assert_gemm_close(y2, ref2, dequant_baseline(x, qw, bias, res2, swiglu=True))


def test_w4_gemv_takes_m33_to_64_where_the_wgmma_plan_keeps_few_warps():
    """M = CUDA_GEMV_MMA_MAX_M + 1 .. GEMV_FEW_WARPS_MAX_M on Hopper: the tensor-core GEMV where the wgmma plan keeps
    fewer than WGMMA_FEW_WARPS warps per SM resident (narrow, short weights), the wgmma GEMM elsewhere; not on cards
    without the wgmma GEMM (Triton there, as before), not past 64, not with a residual."""
    def w4(M, N, K, card=routing.H200, **kw):
        return route_w4a16(M, N, K, torch.float16, card, group_size=128, **kw)

    for N, K in ((2048, 2048), (2048, 1536), (576, 1536)):  # Llama-3.2-1B o, Qwen2.5-1.5B q|k|v, SmolLM2-135M down
        for M in (33, 48, 64):
            assert routing.wgmma_plan(M, N, K, 128, torch.float16, routing.H200)["warps_per_sm"] < \
                routing.WGMMA_FEW_WARPS
            assert w4(M, N, K).backend == GEMV, (N, K, M)
            assert w4(M, N, K, swiglu=True).swiglu == "fused"
            assert w4(M, N, K, residual=True).backend != GEMV
            assert w4(M, N, K, card=A100).backend == "triton_w4_gemm"
        assert w4(65, N, K).backend == WGMMA
    for N, K in ((4096, 4096), (6144, 4096), (3072, 2048)):  # Llama-3-8B o (7.8 warps), q|k|v, Llama-3.2-1B q|k|v
        for M in (33, 48, 64):
            assert routing.wgmma_plan(M, N, K, 128, torch.float16, routing.H200)["warps_per_sm"] >= \
                routing.WGMMA_FEW_WARPS
            assert w4(M, N, K).backend == WGMMA, (N, K, M)


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("M", [1, 4, 17, 64])
@pytest.mark.parametrize("K, N", [(4096, 128256), (576, 49152)], ids=["llama3_head", "smollm2_head"])
def test_ops_on_vocab_sized_heads(bits, M, K, N):
    """A quantized lm_head (``export.quantize.quantize_lm_head``): N of a vocabulary, far wider than any projection
    the routes were measured on (Llama-3's 128256; SmolLM2's 49152 over K = 576, int4 groups of 64), at the M of a
    decode batch and of a prefill's last tokens, against the fp32 reference on the dequantized weight."""
    from export.quantize import choose_group_size
    from kernels.quant import linear

    g = torch.Generator().manual_seed(M * 7 + bits)
    w = (torch.randn(N, K, generator=g) * 0.02).half()
    qw = (quantize_int8(w) if bits == 8 else quantize_int4(w, choose_group_size(K))).to("cuda")  # the build's group
    x = torch.randn(M, K, generator=g).half().cuda()
    y = linear(x, qw)
    ref = x.float() @ dequantize(qw, torch.float32).t()
    assert_gemm_close(y, ref, dequant_baseline(x, qw))


# SmolLM2-135M (the default model: K = 576) and SmolLM2-360M (K = 960): K a multiple of 64, not of 128
SHORT_K_SHAPES = [(576, 960, False), (576, 576, False), (576, 3072, True), (960, 1600, False), (960, 5120, True)]
SHORT_K_IDS = ["135m_qkv", "135m_o", "135m_gate_up", "360m_qkv", "360m_gate_up"]


@pytest.mark.parametrize("K, N, swiglu", SHORT_K_SHAPES, ids=SHORT_K_IDS)
def test_short_k_routes_to_tensor_core_gemv_with_two_row_chunks(K, N, swiglu):
    """K % 128 != 0 but K % 64 == 0: the tensor-core GEMV takes it with u = 2 (``gemv_mma.chunk_u``) at decode M,
    instead of the scalar GEMV (M = 1) or Triton (M = 2..16, and gate/up with SwiGLU)."""
    assert mma.chunk_u(K) == mma.U_SHORT == 2 and mma.chunk_u(4096) == mma.U_DEFAULT
    for M in (1, 2, 4, 8, 16):
        r = route_w4a16(M, N, K, torch.float16, H200, group_size=64, swiglu=swiglu)
        assert r.backend == "w4_gemv_mma" and dict(r.plan)["u"] == 2, (M, r)
    assert mma.unsupported_reason(1, N, 160, 32, torch.float16) == \
        "K=160 is not a multiple of 64 (a warp step is 8 packed rows)"


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 3, 8, 16, 33, 64])
@pytest.mark.parametrize("K, N, swiglu", SHORT_K_SHAPES, ids=SHORT_K_IDS)
def test_ops_on_short_k_shapes(M, K, N, swiglu):
    """The routed W4A16 op on the default model's projections (groups of 64, as the build chooses for K = 576 / 960;
    gate/up with SwiGLU as the model runs it), whatever kernel the route picks at M, against the fp32 reference."""
    import kernels.ops  # noqa: F401  (registers torch.ops.tritrt)

    g = torch.Generator().manual_seed(M * 11 + K + N)
    qw = quantize_int4((torch.randn(N, K, generator=g) * 0.02).half(), 64).to("cuda")
    x = torch.randn(M, K, generator=g).half().cuda()
    y = torch.ops.tritrt.w4a16_linear(x, qw.qweight, qw.scales, qw.zeros, 64, None, None, swiglu)
    ref = x.float() @ dequantize(qw, torch.float32).t()
    if swiglu:
        ref = torch.nn.functional.silu(ref[:, 0::2]) * ref[:, 1::2]
    assert_gemm_close(y, ref, dequant_baseline(x, qw, swiglu=swiglu))


@pytest.mark.gpu
@pytest.mark.parametrize("M", [8, 9, 12, 16])
@pytest.mark.parametrize("K, N", [(576, 3072), (4096, 28672)], ids=["smollm2_135m_gate_up", "llama3_8b_gate_up"])
def test_w8_ops_with_swiglu_take_the_two_tile_gemv_to_16_rows(M, K, N):
    """W8A16 gate/up with SwiGLU fused: the tensor-core GEMV up to CUDA_W8_GEMV_SWIGLU_MAX_M rows (two x tiles a block
    from 9), against the fp32 reference on the dequantized weight."""
    import kernels.ops  # noqa: F401  (registers torch.ops.tritrt)

    assert _gpu_route("w8", M, N, K, swiglu=True).backend == "w8_gemv_mma"
    g = torch.Generator().manual_seed(M * 13 + K)
    qw = quantize_int8((torch.randn(N, K, generator=g) * 0.02).half()).to("cuda")
    x = torch.randn(M, K, generator=g).half().cuda()
    y = torch.ops.tritrt.w8a16_linear(x, qw.qweight, qw.scales, None, None, True)
    ref = x.float() @ dequantize(qw, torch.float32).t()
    ref = torch.nn.functional.silu(ref[:, 0::2]) * ref[:, 1::2]
    assert_gemm_close(y, ref, dequant_baseline(x, qw, swiglu=True))


@pytest.mark.gpu
@pytest.mark.parametrize("M", [9, 12, 16])
@pytest.mark.parametrize("K, N", [(4096, 6144), (5120, 15360), (4096, 4096)],
                         ids=["llama3_8b_qkv", "llama2_13b_qkv", "llama3_8b_o"])
def test_w8_ops_without_swiglu_take_the_two_tile_gemv_where_its_plan_fits(M, K, N):
    """W8A16 at M = 9..16 without SwiGLU: the tensor-core GEMV's two-tile build where routing.w8_two_tile_gemv_fits
    (8B and 13B q|k|v: vec 8, 96 / 240 column blocks), Triton where it does not (8B o: vec 4); the op's output is
    the routed launcher's, bitwise, and close to the fp32 reference on the dequantized weight."""
    import kernels.ops  # noqa: F401  (registers torch.ops.tritrt)

    route = _gpu_route("w8", M, N, K)
    assert route.backend == ("triton_w8_gemm" if N == K else "w8_gemv_mma")
    assert route.backend != "w8_gemv_mma" or route.params["mt"] == 2
    g = torch.Generator().manual_seed(M * 7 + N)
    qw = quantize_int8((torch.randn(N, K, generator=g) * 0.02).half()).to("cuda")
    x = torch.randn(M, K, generator=g).half().cuda()
    y = torch.ops.tritrt.w8a16_linear(x, qw.qweight, qw.scales, None, None)
    routed = (mma8.w8a16_gemv_mma if route.backend == "w8_gemv_mma" else w8a16_gemm)(x, qw.qweight, qw.scales)
    assert torch.equal(y, routed)
    ref = x.float() @ dequantize(qw, torch.float32).t()
    assert_gemm_close(y, ref, dequant_baseline(x, qw))

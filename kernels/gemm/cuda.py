"""What the launchers of the CUDA C++ GEMM kernels (``w4a16.gemv``, ``w4a16.gemv_mma``, ``gemm_wgmma``,
``w8a16.gemv_mma``) share: each ``.cu`` beside its launcher is compiled with nvcc through ``kernels.aot.compile_cuda``
(content-addressed cache; ``#include "..."`` headers, such as ``../mma_common.cuh``, resolve from the including file's
folder) and launched through the CUDA driver (``kernels.aot.launcher.AotKernel``). Each .cu also has a TensorRT plugin
entry (``plugin_entry.cuh``), which its launcher's ``plugin_build(plan, ...)`` describes for ``trt_plugins``. Nothing
here touches CUDA at import time."""

from functools import lru_cache, wraps


def cached_plan(plan_fn):
    """``plan_fn`` (a launcher's plan search: a pure function of hashable shapes and overrides, returning a dict)
    memoized, so that an eager launch pays a dictionary lookup rather than the search (~10-15 us of Python on the
    H200's host); every call gets its own copy of the dict."""
    cached = lru_cache(maxsize=4096)(plan_fn)

    @wraps(plan_fn)
    def plan(*args, **kwargs) -> dict:
        return dict(cached(*args, **kwargs))

    plan.cache_clear = cached.cache_clear  # after a plan constant changes (A/B probes, tests)
    return plan


def cached_kernel(cache: dict, compile_variant, *variant):
    """The launchable kernel of one variant on the current GPU: ``compile_variant(*variant, sm=...)`` (nvcc, through
    the AOT cache) on first use, then the same ``AotKernel`` from ``cache`` (one per SM and variant)."""
    from kernels._utils import device_sm
    from kernels.aot.launcher import AotKernel

    key = (device_sm(), *variant)
    k = cache.get(key)
    if k is None:
        k = cache[key] = AotKernel(compile_variant(*variant, sm=key[0]))
    return k


@lru_cache(maxsize=None)
def device_sm_count(device) -> int:
    """Streaming multiprocessors of ``device`` (the launch plans size their grids by it)."""
    import torch

    return torch.cuda.get_device_properties(device).multi_processor_count


def check_operands(kernel: str, x, x_align: int, aligned, scales, bias, out, out_shape, dtype_hint: str = "") -> None:
    """The launch checks every CUDA weight-only kernel here makes, with ``kernel`` naming it in the message: CUDA
    tensors; ``x`` rows contiguous and ``x_align``-byte aligned (its row stride too); each ``(name, tensor, align)``
    of ``aligned`` (None entries skipped) contiguous and aligned for the kernel's vector loads; ``scales`` and
    ``bias`` float16; ``out``, when given, contiguous float16 of ``out_shape``."""
    import torch

    if not x.is_cuda:
        raise ValueError(f"{kernel} needs CUDA tensors")
    if x.stride(1) != 1 or x.stride(0) % (x_align // x.element_size()) or x.data_ptr() % x_align:
        raise ValueError(f"{kernel}: x rows must be contiguous and {x_align}-byte aligned (call .contiguous())")
    for name, t, align in aligned:
        if t is not None and (not t.is_contiguous() or t.data_ptr() % align):
            raise ValueError(f"{kernel}: {name} must be contiguous and {align}-byte aligned")
    if scales.dtype != torch.float16 or (bias is not None and bias.dtype != torch.float16):
        raise ValueError(f"{kernel}: scales and bias must be float16{dtype_hint}")
    if out is not None and (tuple(out.shape) != tuple(out_shape) or out.dtype != torch.float16
                            or not out.is_contiguous()):
        raise ValueError(f"{kernel}: out must be contiguous float16 {tuple(out_shape)}")


def plugin_build(source, entry: str, variant_flags: tuple, threads: int, shared: int = 0, arch_specific: bool = False,
                 group_size: int | None = None, swiglu: bool = False):
    """The ``kernels.aot.CudaBuild`` of a .cu's TensorRT plugin entry ``entry`` for the variant of ``variant_flags``
    (the flags the torch launcher builds the same plan with): the same kernel body, compiled with
    ``-DTRITRT_PLUGIN_ENTRY`` (``plugin_entry.cuh``); W4A16 entries bake ``group_size`` in; ``swiglu`` builds the
    entry with SwiGLU in the epilogue (``-DTRITRT_SWIGLU=1``: W's columns interleaved (gate, up) pairs, y ``[M, N /
    2]``)."""
    from kernels.aot.compile import CudaBuild

    flags = (*variant_flags, "-DTRITRT_PLUGIN_ENTRY") + ((f"-DTRITRT_GROUP_SIZE={group_size}",) if group_size else ())
    flags += ("-DTRITRT_SWIGLU=1",) if swiglu else ()
    return CudaBuild(str(source), entry, flags, threads=threads, shared=shared, arch_specific=arch_specific)

"""CUDA C++ kernels (``*.cu``) and their Python launchers; compiled with nvcc through ``kernels.aot.compile_cuda``
(content-addressed cache) and launched through the CUDA driver (``kernels.aot.launcher.AotKernel``). Nothing here
touches CUDA at import time."""

from functools import lru_cache


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

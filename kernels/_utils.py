"""Small launch helpers shared by the kernel launchers."""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


def interpreting() -> bool:
    """True when Triton runs kernels in its interpreter (CPU tensors): ``TRITON_INTERPRET`` as Triton itself reads
    it (1/true/on), so that this agrees with what ``@triton.jit`` made of the kernels."""
    return bool(triton.knobs.runtime.interpret)


def check_device(*tensors: torch.Tensor) -> None:
    """Triton needs CUDA tensors, except in the interpreter, which needs CPU tensors."""
    want_cuda = not interpreting()
    for t in tensors:
        if t is not None and t.is_cuda != want_cuda:
            where = "CUDA" if want_cuda else "CPU (TRITON_INTERPRET=1)"
            raise ValueError(f"tensor on {t.device} but the Triton kernels here run on {where} tensors")


def device_sm(device=None) -> int:
    """Compute capability of ``device`` (default: the current CUDA device) as one int, e.g. 90 for sm_90: the
    number ``kernels.aot`` compiles for. Queries the GPU, so call it at launch/build time, never at import."""
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Start of a kernel launched as a programmatic dependent (``kernels._launch``, PDL): let the next kernel in the
    stream be scheduled, then wait until the previous one has finished and its writes are visible. Call it before the
    kernel's first read or write of anything but weights. A no-op (not compiled in) when ``PDL`` is False."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()

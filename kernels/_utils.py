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
    kernel's first read or write of anything but what ``kernels._launch`` allows before the wait. A no-op (not compiled
    in) when ``PDL`` is False."""
    pdl_trigger(PDL)
    pdl_wait(PDL)


@triton.jit
def pdl_trigger(PDL: tl.constexpr):
    """``pdl_enter``'s first half: the next kernel in the stream may be scheduled now (it still waits for this one)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """``pdl_enter``'s second half: wait until the previous kernel has finished and its writes are visible."""
    if PDL:
        gdc_wait()


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the lines at ``ptrs`` (any shape of pointers; no value comes back, nothing waits for it). Safe before
    a PDL wait on memory the previous kernel may still write: L2 is where the device's writes meet, and the prefetch
    fills no L1 line. Compiled code only (inline PTX): not in the Triton interpreter."""
    tl.inline_asm_elementwise("mov.b32 $0, 0;\n\tprefetch.global.L2 [$1];", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)

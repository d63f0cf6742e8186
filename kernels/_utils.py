"""Small launch helpers shared by the kernel launchers."""

import functools

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


def check_index(name: str, t: torch.Tensor) -> None:
    """A 1-D index tensor (positions, a slot mapping, sequence lengths or offsets) must be dense: the kernels read
    element i at ``ptr + i`` (a strided view rotated q / k by other positions and wrote the cache at other slots)."""
    if t.dim() == 1 and t.shape[0] > 1 and t.stride(0) != 1:
        raise ValueError(f"{name} must be dense (stride 1), got a view of stride {t.stride(0)}: call .contiguous()")


def table_row_stride(block_table: torch.Tensor) -> int:
    """The block table's row stride as the attention kernels take it, which also bounds a row's KV length (stride x
    block size): a one-row table's ``stride(0)`` is whatever torch made it (size-1 dims do not count for
    contiguity, so ``(1, W)`` may have stride 1), so its width."""
    # A table of width 0 has no row to read: torch gives it stride 1 (and no storage), which let a sequence claim
    # one page per row of it (reads past the table: a null pointer); 0 clamps every KV length to 0.
    if block_table.shape[1] == 0:
        return 0
    return block_table.stride(0) if block_table.shape[0] > 1 else block_table.shape[1]


def device_sm(device=None) -> int:
    """Compute capability of ``device`` (default: the current CUDA device) as one int, e.g. 90 for sm_90: the
    number ``kernels.aot`` compiles for. Queries the GPU on first use of each device (so call it at launch/build
    time, never at import), cached after that: launchers ask on every call, and torch's query costs ~10 us of host
    time a call (H200 host; ``torch.cuda.get_device_capability``)."""
    if isinstance(device, int):
        return _sm_of_index(device)
    if not isinstance(device, torch.device):  # None, "cuda", "cuda:1"
        device = torch.device("cuda" if device is None else device)
    return _sm_of_index(torch.cuda.current_device() if device.index is None else device.index)


@functools.lru_cache(maxsize=None)
def _sm_of_index(index: int) -> int:
    major, minor = torch.cuda.get_device_capability(index)
    return 10 * major + minor


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Start of a kernel launched as a programmatic dependent (``kernels._launch``, PDL): let the next kernel in the
    stream be scheduled, then wait until the previous one has finished and its writes are visible. Call it before the
    kernel's first read or write of anything but weights. A no-op (not compiled in) when ``PDL`` is False."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()

"""How a kernel is launched, as data: shared by the JIT launchers, ``kernels.aot`` and the plugin specs.

Every plugin kernel's launcher computes its launch in a pure function of integer shapes and attributes that returns
a ``LaunchConfig``; the launcher then calls ``cfg.launch(*args)``. The AOT compiler and the TensorRT plugin specs
call the same function, so the JIT run, the AOT artifact and the engine use the same constexprs, warps and grid.

AOT rules every plugin kernel follows (TensorRT AOT plugins: trt_plugins/specs/__init__.py):
- one launch per op call; runtime arguments are tensors and int32 scalars only;
- floats (eps, softmax scale) and layout choices are ``tl.constexpr`` (baked in at compile time);
- scratch memory (e.g. split-KV partials) is an explicit tensor argument, never allocated inside the kernel;
- the grid is a function of tensor shapes and attributes only (no value read back from the device).

Programmatic dependent launch (PDL, sm_90+): a kernel whose config carries the constexpr ``PDL`` (False there: what
the AOT artifact and a TensorRT plugin get) is launched from torch with ``PDL=True`` and Triton's ``launch_pdl``
when ``pdl_enabled()``. Such a kernel first calls ``gdc_launch_dependents()`` (the next kernel in the stream may be
scheduled now; it still waits for this one) and ``gdc_wait()`` (this kernel waits for the previous one to finish and
its writes to be visible) before it reads or writes any tensor an earlier kernel may touch: weights may be read
before the wait, nothing else. On a decode step, where a kernel is a few microseconds, this overlaps each kernel's
launch and ramp-up with the tail of the one before (``benchmarks/results/dev-logs/h100/pdl_probe.md``).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from ._utils import device_sm, interpreting


@dataclass(frozen=True)
class LaunchConfig:
    kernel: Any  # a @triton.jit function
    grid: tuple[int, ...]
    constexprs: dict = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 3

    def launch(self, *args):
        """JIT launch with the runtime ``args`` in the kernel's parameter order (constexprs by keyword); a kernel with
        the ``PDL`` constexpr is launched as a programmatic dependent when ``pdl_enabled()``."""
        if "PDL" in self.constexprs and pdl_enabled():
            return self.kernel[self.grid](*args, **self._pdl_constexprs, num_warps=self.num_warps,
                                          num_stages=self.num_stages, launch_pdl=True)
        return self.kernel[self.grid](*args, **self.constexprs, num_warps=self.num_warps, num_stages=self.num_stages)

    @functools.cached_property  # per config, not per launch (configs are lru-cached by their launchers)
    def _pdl_constexprs(self) -> dict:
        return {**self.constexprs, "PDL": True}


PDL_ENV = "TRITRT_PDL"  # "0": launch every kernel as a plain stream-ordered launch (A/B timing, debugging)


def pdl_enabled() -> bool:
    """Whether torch-side launches use programmatic dependent launch: a CUDA device of compute capability >= 9 (the
    current device), not the Triton interpreter, and ``TRITRT_PDL`` not "0"."""
    if os.environ.get(PDL_ENV, "1") == "0" or interpreting():
        return False
    return torch.cuda.is_available() and _sm(torch.cuda.current_device()) >= 90


_sm = device_sm  # cached per device; a module name of its own, which tests replace to fake a GPU

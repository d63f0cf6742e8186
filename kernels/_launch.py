"""How a kernel is launched, as data: shared by the JIT launchers, ``kernels.aot`` and the plugin specs.

Every plugin kernel's launcher computes its launch in a pure function of integer shapes and attributes that returns
a ``LaunchConfig``; the launcher then calls ``cfg.launch(*args)``. The AOT compiler and the TensorRT plugin specs
call the same function, so the JIT run, the AOT artifact and the engine use the same constexprs, warps and grid.

AOT rules every plugin kernel follows (TensorRT AOT plugins: trt_plugins/specs/__init__.py):
- one launch per op call; runtime arguments are tensors and int32 scalars only;
- floats (eps, softmax scale) and layout choices are ``tl.constexpr`` (baked in at compile time);
- scratch memory (e.g. split-KV partials) is an explicit tensor argument, never allocated inside the kernel;
- the grid is a function of tensor shapes and attributes only (no value read back from the device).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class LaunchConfig:
    kernel: Any  # a @triton.jit function
    grid: tuple[int, ...]
    constexprs: dict = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 3

    def launch(self, *args):
        """JIT launch with the runtime ``args`` in the kernel's parameter order (constexprs by keyword)."""
        return self.kernel[self.grid](*args, **self.constexprs, num_warps=self.num_warps, num_stages=self.num_stages)

"""Ahead-of-time compilation of our kernels, and a CUDA-driver launcher for the artifacts.

- ``kernels.aot.compile``: ``compile_triton`` (Triton kernel -> PTX + cubin for sm_80/86/89/90, no GPU needed, every
  specialisation explicit) and ``compile_cuda`` (nvcc; ``CudaBuild`` describes one variant's build),
  ``strip_hidden_params`` (PTX for TensorRT's argument list).
- ``kernels.aot.cache``: content-addressed on-disk cache (``$TRITRT_AOT_CACHE``, default
  ``$TRITRT_CACHE/aot`` or ``~/.cache/tritrt/aot``).
- ``kernels.aot.files``: ``cache_dir`` (``$TRITRT_CACHE`` or ``~/.cache/tritrt``) and ``write_atomic`` (temp name, then
  rename), for every artifact written.
- ``kernels.aot.wrapper``: generates a plugin entry kernel that calls a kernel with its arguments reordered.
- ``kernels.aot.launcher``: ``AotKernel`` loads a cubin/PTX with ``cuda.bindings.driver`` and launches it on torch's
  current stream; no Triton JIT involved.
Compiling every plugin kernel (``python -m trt_plugins.aot``) lives with the plugin specs, above this package.

Nothing here imports CUDA at import time.
"""

from .cache import AotCache  # noqa: F401
from .compile import (AotError, Artifact, CudaBuild, compile_cuda, compile_triton,  # noqa: F401
                      strip_hidden_params)

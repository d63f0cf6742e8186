"""Weight-only GEMM kernels, by family, and the one function that picks among them.

- ``routing``: which kernel runs for (M, N, K, dtype, card, flags) -- a pure function, used by the torch ops
  (``kernels.ops.gemm``) and meant for the TensorRT plugins alike.
"""

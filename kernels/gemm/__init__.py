"""Weight-only GEMM kernels (and the fp16 GEMV), by family, and the functions that pick among them.

- ``routing``: which kernel runs for (M, N, K, dtype, card, flags) -- pure functions, used by the torch ops
  (``kernels.ops.gemm``) and meant for the TensorRT plugins alike.
- ``w4a16``: INT4 group-wise weights -- the Triton GEMM (``triton_gemm``, also the plugins' kernel) and the CUDA GEMVs
  (``gemv``: scalar; ``gemv_mma``: tensor cores, tiled in M up to 32 rows).
- ``w8a16``: INT8 per-channel weights -- the Triton GEMM (``triton_gemm``) and the tensor-core CUDA GEMV (``gemv_mma``).
- ``fp16``: unquantized fp16 weights -- the tensor-core CUDA GEMV for decode sizes (``gemv_mma``; cuBLAS elsewhere).
- ``gemm_wgmma``: the Hopper warpgroup-MMA GEMM for both formats (one kernel body, the weight format a compile flag).
- shared: ``common`` (the Triton kernels' split-K finish and epilogue), ``dequant`` (prefill M: dequantize once, then
  cuBLAS), ``cuda`` (compile / launch / operand checks of the CUDA kernels), ``mma_common.cuh``.

Weights come from ``kernels.quant``; the torch ops are ``kernels.ops.gemm``. Nothing here touches the GPU at import.
"""

// Device helpers shared by the tensor-core weight-only kernels (w4a16/gemv_mma.cu, w8a16/gemv_mma.cu): single PTX
// instructions that nvcc would otherwise not pick (lop3 with a chosen truth table, prmt byte permutes, half2 arithmetic
// on raw registers) and the mma.sync.m16n8k16 fp16 -> fp32 tile product. Header-only; kernels.aot.compile_cuda
// hashes local includes into its cache key.
#pragma once
#include <cuda_fp16.h>
#include <stdint.h>

namespace tritrt {
// Programmatic dependent launch (kernels._launch): let the next kernel in the stream be scheduled, then wait for the
// previous one to finish and its writes to be visible. Call before the first read or write of anything but weights.
// A no-op when the kernel was not launched as a programmatic dependent (TensorRT, plain launches) and before sm_90.
__device__ __forceinline__ void pdl_enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Ask L2 for a line of weights (no register result): issued before pdl_enter, the first chunk's weights stream in
// while the previous kernel finishes.
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

__device__ __forceinline__ uint32_t lop3_and_or(uint32_t a, uint32_t mask, uint32_t magic) {
  uint32_t r;
  // (a & mask) | magic in one instruction: immLut = (0xF0 & 0xCC) | 0xAA = 0xEA.
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "r"(mask), "r"(magic));
  return r;
}

__device__ __forceinline__ uint32_t lop3_and_xor(uint32_t a, uint32_t mask, uint32_t flip) {
  uint32_t r;
  // (a & mask) ^ flip in one instruction: immLut = (0xF0 & 0xCC) ^ 0xAA = 0x6A. Bits outside mask become flip's bits
  // (a constant), bits inside are a's bits, inverted where flip is set.
  asm("lop3.b32 %0, %1, %2, %3, 0x6A;" : "=r"(r) : "r"(a), "r"(mask), "r"(flip));
  return r;
}

// SwiGLU of one interleaved (gate, up) column pair, in fp32: silu(gate) * up. __expf's and __fdividef's errors (a few
// fp32 ulps) are far below the fp16 rounding of the result; a gate below about -88 gives exp = inf and silu = -0 (its
// quotient is 0 from a denominator of 2^126 on), as it should. With the IEEE division it replaced, the wgmma GEMM
// with SwiGLU ran 1-6% slower at M = 128-2048 on H100 (benchmarks/results/dev-logs/h100/fused_swiglu.md).
__device__ __forceinline__ float silu_mul(float gate, float up) { return __fdividef(gate, 1.f + __expf(-gate)) * up; }

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

__device__ __forceinline__ uint32_t hsub2_u(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("sub.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

__device__ __forceinline__ uint32_t hfma2_u(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t r;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}

__device__ __forceinline__ void mma16816(float c[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The same product without ``volatile``: the compiler may reorder it against other instructions (it is a pure
// function of its operands), so independent tile products can be interleaved to hide the HMMA latency.
__device__ __forceinline__ void mma16816_sched(float c[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
}  // namespace tritrt

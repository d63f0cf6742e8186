// INT4 (kernels.quant layout) -> fp16 mma fragments for the W4A16 tensor-core GEMV (gemv_mma.cu; the wgmma GEMM
// uses hmul2_u). See gemv_mma.cu's header for the k order of the fragments and why each step is exact.
#pragma once
#include "../mma_common.cuh"

namespace tritrt {
__device__ __forceinline__ uint32_t hmul2_u(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("mul.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

// q - z for the 8 nibbles of one packed int32, as 4 half2: {n0,n4}, {n1,n5}, {n2,n6}, {n3,n7}.
__device__ __forceinline__ void dequant8(uint32_t q, uint32_t zlo, uint32_t zhi, uint32_t h[4]) {
  constexpr uint32_t kMagic = 0x64006400u;    // fp16 1024 in both halves
  constexpr uint32_t kSixteenth = 0x2C002C00u;  // fp16 1/16 in both halves
  const uint32_t q8 = q >> 8;
  h[0] = hsub2_u(lop3_and_or(q, 0x000F000Fu, kMagic), zlo);
  h[1] = hfma2_u(lop3_and_or(q, 0x00F000F0u, kMagic), kSixteenth, zhi);
  h[2] = hsub2_u(lop3_and_or(q8, 0x000F000Fu, kMagic), zlo);
  h[3] = hfma2_u(lop3_and_or(q8, 0x00F000F0u, kMagic), kSixteenth, zhi);
}

// The per-column constants of dequant8 for zero point z (0..16): {1024 + z} for the low nibbles, {-(64 + z)} for the
// high ones, each in both halves of a half2.
__device__ __forceinline__ uint32_t zero_lo(uint32_t z) { return (0x6400u + z) * 0x00010001u; }
__device__ __forceinline__ uint32_t zero_hi(uint32_t z) { return (0xD400u + (z << 4)) * 0x00010001u; }
}  // namespace tritrt

// W4A16 GEMV for small M (1..8), fp16 activations: y[M, N] = x[M, K] @ W^T (+ bias), W in kernels.quant's INT4 layout.
//
// Layout read: qweight int32 [K/8, N] (8 nibbles along K per int32, k = 8r + j at bits 4j), scales fp16 [K/G, N],
// zeros int8 [K/G, N] (0..16, read as bytes; or none: zero point 8). The weight is the only big operand, so the
// kernel is built around streaming it at full bandwidth: each thread loads 16 bytes (4 columns x 8 k) per packed row, ROWS rows per step with
// all loads issued before any math (ROWS x 16 B in flight per thread), a warp reads TN x 16 contiguous bytes of each
// of 32/TN rows. Unpacking uses the fp32 exponent trick: (nibble | 0x4B000000) is the float 2^23 + nibble, so
// (q - z) costs a shift, a LOP3 and an FADD -- no int->float conversion (quarter rate on sm_90). The weight is exact
// (q - z) in fp32 and the group scale multiplies a row's partial sum, so the result equals x @ ((q - z) * s) up to
// fp32 summation order. Threads along K reduce through shared memory at the end; one launch, no memset.
//
// Compile-time: GEMV_M (max rows, 1..8; runtime M <= GEMV_M), GEMV_TN (threads across N: 4 or 8),
// GEMV_PREFETCH (register double buffer of the next step's weights: more overlap, more registers). Requirements the
// Python launcher checks: N % 4 == 0, K % 64 == 0, group_size % 32 == 0, x rows 16-byte aligned.
#include <cuda_fp16.h>
#include <stdint.h>

#include "../plugin_entry.cuh"

#ifndef GEMV_M
#define GEMV_M 1
#endif
#ifndef GEMV_TN
#define GEMV_TN 8
#endif
#ifndef GEMV_PREFETCH
#define GEMV_PREFETCH 1
#endif

namespace {
constexpr int kThreads = 256;
constexpr int kTN = GEMV_TN;               // threads across N, 4 columns each
constexpr int kTK = kThreads / kTN;        // threads across K
constexpr int kCols = 4 * kTN;             // output columns per block
constexpr int kRows = 8;                   // packed rows (64 k) per thread per step

__device__ __forceinline__ float nibble(uint32_t q, int j) {
  return __int_as_float(((q >> (4 * j)) & 0xFu) | 0x4B000000u);  // 2^23 + nibble j, exact
}
}  // namespace

TRITRT_ENTRY(__launch_bounds__(kThreads))
w4a16_gemv(const half* __restrict__ x, const int* __restrict__ qweight, const half* __restrict__ scales,
           const uint8_t* __restrict__ zeros, const half* __restrict__ bias, half* __restrict__ out,
           int M, int N, int K, int group_size, int stride_xm, int has_zeros, int has_bias) {
  __shared__ float red[kTK][GEMV_M][kCols];
  const int tn = threadIdx.x % kTN;
  const int tk = threadIdx.x / kTN;
  const int col0 = blockIdx.x * kCols + tn * 4;
  const int kp = K / 8;

  float acc[GEMV_M][4];
#pragma unroll
  for (int m = 0; m < GEMV_M; ++m)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[m][c] = 0.f;

  if (col0 < N) {
    // Register double buffer: the next step's weight loads are issued before this step's math, so DRAM latency
    // overlaps the unpacking instead of adding to it (the math is ~3.5 us of issue per step per scheduler).
    int4 qn[kRows];
    if (tk * kRows < kp) {
#pragma unroll
      for (int u = 0; u < kRows; ++u)
        qn[u] = __ldg(reinterpret_cast<const int4*>(qweight + (size_t)(tk * kRows + u) * N + col0));
    }
    for (int r0 = tk * kRows; r0 < kp; r0 += kTK * kRows) {
      int4 q[kRows];
#pragma unroll
      for (int u = 0; u < kRows; ++u) q[u] = qn[u];
      if (!GEMV_PREFETCH && r0 != tk * kRows) {  // no double buffer: load this step's rows now
#pragma unroll
        for (int u = 0; u < kRows; ++u)
          q[u] = __ldg(reinterpret_cast<const int4*>(qweight + (size_t)(r0 + u) * N + col0));
      }
      const int r1 = r0 + kTK * kRows;
      if (GEMV_PREFETCH && r1 < kp) {
#pragma unroll
        for (int u = 0; u < kRows; ++u)
          qn[u] = __ldg(reinterpret_cast<const int4*>(qweight + (size_t)(r1 + u) * N + col0));
      }
      // group_size >= 32 (4 packed rows) and r0 % 8 == 0: rows r0..r0+3 share a group, and so do r0+4..r0+7.
      float s[2][4], zm[2][4];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int g = 8 * (r0 + 4 * h) / group_size;
        const uint2 sraw = __ldg(reinterpret_cast<const uint2*>(scales + (size_t)g * N + col0));
        const float2 s01 = __half22float2(*reinterpret_cast<const half2*>(&sraw.x));
        const float2 s23 = __half22float2(*reinterpret_cast<const half2*>(&sraw.y));
        s[h][0] = s01.x; s[h][1] = s01.y; s[h][2] = s23.x; s[h][3] = s23.y;
        // 2^23 + z by the same exponent trick as the weights (no int->float conversion).
        const uint32_t zraw = has_zeros ? __ldg(reinterpret_cast<const unsigned int*>(zeros + (size_t)g * N + col0))
                                        : 0x08080808u;
#pragma unroll
        for (int c = 0; c < 4; ++c) zm[h][c] = __int_as_float(((zraw >> (8 * c)) & 0xFFu) | 0x4B000000u);
      }
#pragma unroll
      for (int u = 0; u < kRows; ++u) {
        const int k0 = 8 * (r0 + u);
        const int h = u / 4;
        const uint32_t qc[4] = {(uint32_t)q[u].x, (uint32_t)q[u].y, (uint32_t)q[u].z, (uint32_t)q[u].w};
#pragma unroll
        for (int m = 0; m < GEMV_M; ++m) {
          if (m < M) {
            const int4 xraw = __ldg(reinterpret_cast<const int4*>(x + (size_t)m * stride_xm + k0));
            const half2* xh = reinterpret_cast<const half2*>(&xraw);
            float xf[8];
#pragma unroll
            for (int p = 0; p < 4; ++p) {
              const float2 f = __half22float2(xh[p]);
              xf[2 * p] = f.x;
              xf[2 * p + 1] = f.y;
            }
#pragma unroll
            for (int c = 0; c < 4; ++c) {
              float part = 0.f;
#pragma unroll
              for (int j = 0; j < 8; ++j) part = fmaf(xf[j], nibble(qc[c], j) - zm[h][c], part);
              acc[m][c] = fmaf(part, s[h][c], acc[m][c]);
            }
          }
        }
      }
    }
  }

#pragma unroll
  for (int m = 0; m < GEMV_M; ++m)
    *reinterpret_cast<float4*>(&red[tk][m][tn * 4]) = make_float4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]);
  __syncthreads();
  for (int t = threadIdx.x; t < GEMV_M * kCols; t += kThreads) {
    const int m = t / kCols, col = t % kCols;
    const int n = blockIdx.x * kCols + col;
    if (m < M && n < N) {
      float sum = 0.f;
#pragma unroll 8
      for (int i = 0; i < kTK; ++i) sum += red[i][m][col];
      if (has_bias) sum += __half2float(bias[n]);
      out[(size_t)m * N + n] = __float2half_rn(sum);
    }
  }
}

#ifdef TRITRT_PLUGIN_ENTRY
// TensorRT plugin entry (W4A16Linear, trt_plugins/specs/linear.py). TensorRT's AOT plugins pass the inputs, the
// int32 extra args, then the outputs: (x, qweight, scales, zeros, M, N, K, unused, y); the unused int is the Triton
// entry's output row stride. The kernel above runs with what a plugin has: zero points, no bias, no SwiGLU (the
// routing never picks this GEMV for it), x rows of K halves, the group size baked in (TRITRT_GROUP_SIZE). It takes at
// most GEMV_M rows, so grid z walks
// the row tiles of any M: grid (N / (4 GEMV_TN), 1, cdiv(M, GEMV_M)), each tile the launch the torch path makes for
// its rows.
#ifndef TRITRT_GROUP_SIZE
#error "the plugin entry needs -DTRITRT_GROUP_SIZE=<group size>"
#endif
extern "C" __global__ void __launch_bounds__(kThreads)
tritrt_w4a16_gemv(const half* __restrict__ x, const int* __restrict__ qweight, const half* __restrict__ scales,
                  const uint8_t* __restrict__ zeros, int M, int N, int K, int /*unused*/, half* __restrict__ y) {
  const int m0 = blockIdx.z * GEMV_M;
  w4a16_gemv(x + (size_t)m0 * K, qweight, scales, zeros, scales, y + (size_t)m0 * N, min(M - m0, GEMV_M), N, K,
             TRITRT_GROUP_SIZE, K, 1, 0);
}
#endif  // TRITRT_PLUGIN_ENTRY

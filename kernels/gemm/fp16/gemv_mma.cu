// fp16 GEMV on tensor cores for M <= 8: y[M, N] = x[M, K] @ W^T (+ bias), W an fp16 nn.Linear weight [N, K]
// (row-major, rows of K contiguous), fp32 accumulation, one fp16 rounding at the store.
//
// Why: at decode sizes (M = 1..8) the weight read is the whole cost, and cuBLAS's plan for some shapes leaves SMs
// idle: Llama-3-8B's o projection (4096 x 4096) ran as 64 CTAs of a 64 x 8 tile at 54% of copy bandwidth on the H100
// (benchmarks/results/h100/bench_e2e.json, the fp16 decode profile), and its q|k|v and down projections as split-K
// GEMMs plus a reduction kernel (~2 us each, 64 a step). Here a block takes 16 rows of W and the whole of K, and the
// launcher's plan sizes the grid so that every SM holds work.
//
// Fragment mapping (PTX ISA, mma.m16n8k16 f16): lane = 4 g + t holds A rows g and g + 8 at k slots {2t, 2t+1, 2t+8,
// 2t+9}, B k slots {2t, 2t+1, 2t+8, 2t+9} of column g, C rows g, g + 8 at columns 2t, 2t + 1. The k order is ours as
// long as A and B agree, so a lane loads 16 bytes (8 adjacent k) of each of its two W rows and of x row g, and feeds
// two mmas with them as they come: the first takes halves {0, 1} as slots {2t, 2t+1} and {2, 3} as {2t+8, 2t+9},
// the second halves {4, 5} and {6, 7}. A is W (16 rows of W = 16 outputs), B is x (8 rows of x), so C row r, column
// m is y[m][n0 + r]. No permutes, no dequantisation: per 16 bytes of weight a lane issues one load and one mma.
//
// Work split: a block = GEMV_WARPS warps on the same 16 rows of W; a step is 32 k (the quad t = 0..3 reads 64
// contiguous bytes of each row), a chunk GEMV_U steps (64 * U contiguous bytes of each row), and warps take chunks in
// turn with a register double buffer (the next chunk's weights and x are loaded before this chunk's mmas), then sum
// through shared memory in a fixed order (deterministic). The launcher checks: K % (32 * GEMV_U) == 0, x rows and W
// 16-byte aligned. Rows past N read row N - 1 (valid memory) and are never stored.
#include "../mma_common.cuh"

#ifndef GEMV_WARPS
#define GEMV_WARPS 8
#endif
#ifndef GEMV_U
#define GEMV_U 4  // 32-k steps per chunk: a lane holds 3 * GEMV_U 16-byte loads per buffer
#endif
#ifndef GEMV_MINB
#define GEMV_MINB 1  // blocks per SM asked of ptxas (__launch_bounds__): caps the registers per thread
#endif

namespace {
using namespace tritrt;
constexpr int kWarps = GEMV_WARPS;
constexpr int kU = GEMV_U;
static_assert(kWarps >= 1 && kWarps <= 32, "GEMV_WARPS is 1..32");

// One chunk's registers: per step, the lane's 8 k of W rows g (a[0]) and g + 8 (a[1]) and of x row g.
struct Chunk {
  int4 a[kU][2];
  int4 x[kU];
};
}  // namespace

extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS, GEMV_MINB)
fp16_gemv_mma(const half* __restrict__ x, const half* __restrict__ w, const half* __restrict__ bias,
              half* __restrict__ out, int M, int N, int K, int stride_xm, int has_bias) {
  __shared__ float red[kWarps][8][16];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int n0 = blockIdx.x * 16;
  const int chunks = K / (32 * kU);

  // W rows n0 + g and n0 + g + 8 (clamped to N - 1), from this lane's first k (8 t): int4 number j of a row is k 8 j.
  const int4* wr[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int n = min(n0 + g + 8 * h, N - 1);
    wr[h] = reinterpret_cast<const int4*>(w + (size_t)n * K) + t;
  }
  // B column g is x row g: rows >= M feed zeros (no load).
  const bool x_ok = g < M;
  const int4* xr = reinterpret_cast<const int4*>(x + (size_t)(x_ok ? g : 0) * stride_xm) + t;

  auto load_chunk = [&](int c, Chunk& b) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int i = (c * kU + u) * 4;  // int4 index of this step's k within a row
      b.a[u][0] = __ldg(wr[0] + i);
      b.a[u][1] = __ldg(wr[1] + i);
      b.x[u] = x_ok ? __ldg(xr + i) : make_int4(0, 0, 0, 0);
    }
  };

  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  auto process_chunk = [&](const Chunk& b) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int4 lo = b.a[u][0], hi = b.a[u][1], xv = b.x[u];
      mma16816(acc, lo.x, hi.x, lo.y, hi.y, xv.x, xv.y);
      mma16816(acc, lo.z, hi.z, lo.w, hi.w, xv.z, xv.w);
    }
  };

  if (warp < chunks) {  // this warp's first chunk of weights, into L2 while the previous kernel finishes
#pragma unroll
    for (int u = 0; u < kU; ++u)
#pragma unroll
      for (int h = 0; h < 2; ++h) prefetch_l2(wr[h] + (warp * kU + u) * 4);
  }
  pdl_enter();  // x, and the output, only after the previous kernel

  // Two register buffers used in turn (no copies): the next chunk's loads are in flight during this chunk's mmas.
  Chunk ba, bb;
  if (warp < chunks) load_chunk(warp, ba);
  for (int c = warp; c < chunks; c += 2 * kWarps) {
    if (c + kWarps < chunks) load_chunk(c + kWarps, bb);
    process_chunk(ba);
    if (c + kWarps >= chunks) break;
    if (c + 2 * kWarps < chunks) load_chunk(c + 2 * kWarps, ba);
    process_chunk(bb);
  }

  // C rows g, g + 8 (outputs n0 + g, n0 + g + 8) at columns 2t, 2t + 1 (x rows).
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    red[warp][2 * t + j][g] = acc[j];
    red[warp][2 * t + j][g + 8] = acc[2 + j];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < 8 * 16; i += 32 * kWarps) {
    const int m = i / 16, n = n0 + i % 16;
    if (m < M && n < N) {
      float sum = 0.f;
#pragma unroll
      for (int v = 0; v < kWarps; ++v) sum += red[v][m][i % 16];
      if (has_bias) sum += __half2float(bias[n]);
      out[(size_t)m * N + n] = __float2half_rn(sum);
    }
  }
}

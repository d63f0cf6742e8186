// W4A16 GEMV on tensor cores for M <= 8, fp16 activations: y[M, N] = x[M, K] @ W^T (+ bias), W in kernels.quant's
// INT4 layout (qweight int32 [K/8, N], nibble j of row r is k = 8r + j; scales fp16 [K/G, N]; zeros int8 [K/G, N],
// 0..16 read as bytes, or none = 8). With `swiglu` W's columns are interleaved (gate, up) pairs and y = silu(gate) * up, [M, N / 2].
//
// Why: the scalar GEMV (gemv.cu) spends ~4 ALU instructions per weight and is issue-bound. Here a weight costs
// 9/8 instructions of dequantisation and a 1/8 share of an mma (sm_90 SASS of the loop, 256 weights per lane: LOP3
// 139, HADD2 72, HFMA2 64, SHF 43, PRMT 32, HMMA 32, ~510 in all with addressing: ~2.0 per weight, 93-117 registers,
// no local memory):
//   * LOP3 (q & 0x000F000F) | 0x64006400 is the half2 {1024 + n0, 1024 + n4}; with mask 0x00F000F0 it is
//     {1024 + 16 n1, 1024 + 16 n5}; the same two on q >> 8 give nibbles 2, 6 and 3, 7 (one shift per int32).
//   * one HSUB2 by {1024 + z} (low nibbles) or HFMA2 by {1/16, -(64 + z)} (high nibbles) leaves q - z, exact in fp16
//     (integers <= 16), so the zero point is free.
//   * mma.sync.m16n8k16 (fp32 accumulate) multiplies the exact (q - z) weights, as the A operand (16 columns of W x
//     16 k), with x as B (16 k x 8 rows of x); the group scale multiplies the fp32 partial sum of each group. So the
//     only roundings are fp32 accumulation and the final fp16 store: more accurate than cuBLAS on the fp16 weight.
// The tensor core does 8 x more MACs than M=1 needs; it has ~8 x more throughput than the dequantisation needs, so
// that is free, and M up to 8 costs the same as M = 1.
//
// Fragment mapping (PTX ISA, mma.m16n8k16 f16): lane = 4 g + t holds A rows g and g + 8, k columns {2t, 2t+1, 2t+8,
// 2t+9}; B k rows {2t, 2t+1, 2t+8, 2t+9} of column g; C rows g, g+8, columns 2t, 2t+1. The mma's k order is ours to
// choose as long as A and B agree, so lane (g, t) feeds it its own packed row 4u + t: A = the LOP3 outputs as they
// come ({n0, n4}, {n1, n5} for the first mma, {n2, n6}, {n3, n7} for the second), B = x[g][8r..8r+7] permuted the same
// way with 4 PRMTs. Lane g loads 16 B = 4 adjacent columns (4g..4g+3) of its packed row: tile 0 takes columns 4g, 4g+1
// as rows g, g+8, tile 1 columns 4g+2, 4g+3. A warp's load of one u covers 4 packed rows x 128 contiguous bytes.
//
// Work split: a block = GEMV_WARPS warps on the same 32 columns, warps splitting K in chunks of 4 * GEMV_U packed rows
// (register double buffer: the next chunk's loads, with GEMV_SZ_AHEAD / GEMV_X_AHEAD its scales and zero points / its
// x values too, are issued before this chunk's math), reduced through shared memory at the end, where bias and
// SwiGLU are applied; one launch, no memset. The launcher checks: N % 4 == 0, K % (32 * GEMV_U) == 0, group_size a
// multiple of 32 with GEMV_GSTEPS = min(group_size / 32, GEMV_U) dividing GEMV_U (a scale run never straddles a
// group), x rows 16-byte aligned.
#include "../plugin_entry.cuh"
#include "w4_dequant.cuh"

#ifndef GEMV_WARPS
#define GEMV_WARPS 8
#endif
#ifndef GEMV_U
#define GEMV_U 4  // packed rows per lane per chunk (16 B each): 4 * U * 8 k per warp step
#endif
#ifndef GEMV_GSTEPS
#define GEMV_GSTEPS 4  // u steps per scale group
#endif
#ifndef GEMV_MMAX
#define GEMV_MMAX 8  // 1: only row 0 of x (skips the loads and scale FMAs of the other rows)
#endif
#ifndef GEMV_CHAINS
#define GEMV_CHAINS 1  // 2: the two mmas of a u step go to separate accumulators (shorter HMMA dependency chains)
#endif
#ifndef GEMV_MT
#define GEMV_MT 1  // x tiles of 8 rows per block (M > 8: a block covers rows m0 .. m0 + 8 MT - 1; needs GEMV_MMAX 8)
#endif
#ifndef GEMV_WSCALE
#define GEMV_WSCALE 0  // 1: scale the fp16 weights before the mma (one accumulator set; for large MT: registers)
#endif
#ifndef GEMV_L2_256
#define GEMV_L2_256 0  // 1: weight loads ask L2 to fetch 256 B (the neighbouring block's columns of the same rows)
#endif
#ifndef GEMV_SZ_AHEAD
#define GEMV_SZ_AHEAD 0  // 1: a chunk's scales and zero points are loaded with its weights, not when its math starts
#endif
#ifndef GEMV_X_AHEAD
#define GEMV_X_AHEAD 0  // 1: a chunk's x fragments are loaded with its weights too (16 registers per buffer and tile)
#endif
#ifndef GEMV_MINB
#define GEMV_MINB 1  // blocks per SM asked of ptxas (__launch_bounds__): caps the registers per thread
#endif
#ifndef GEMV_KSPLIT
#define GEMV_KSPLIT 1  // blocks of one thread-block cluster (grid y) splitting K: 1 to 8
#endif
#if GEMV_KSPLIT > 1
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#error "GEMV_KSPLIT > 1 uses thread-block clusters (sm_90+); build with GEMV_KSPLIT=1 for older GPUs"
#endif
#include <cooperative_groups.h>
#define GEMV_CLUSTER_DIMS __cluster_dims__(1, GEMV_KSPLIT, 1)
#else
#define GEMV_CLUSTER_DIMS
#endif

namespace {
using namespace tritrt;
constexpr int kWarps = GEMV_WARPS;
constexpr int kU = GEMV_U;
constexpr int kG = GEMV_GSTEPS;
static_assert(kU % kG == 0, "GEMV_GSTEPS must divide GEMV_U");
static_assert(GEMV_MMAX == 1 || GEMV_MMAX == 8, "GEMV_MMAX is 1 or 8");
static_assert(GEMV_CHAINS == 1 || GEMV_CHAINS == 2, "GEMV_CHAINS is 1 or 2");
static_assert(GEMV_MT >= 1 && GEMV_MT <= 8, "GEMV_MT is 1..8");
static_assert(GEMV_MT == 1 || (GEMV_MMAX == 8 && GEMV_CHAINS == 1), "GEMV_MT > 1 needs GEMV_MMAX 8, GEMV_CHAINS 1");
static_assert(GEMV_KSPLIT >= 1 && GEMV_KSPLIT <= 8, "GEMV_KSPLIT is 1 to 8 (portable cluster sizes)");
constexpr int kRows = GEMV_MT * GEMV_MMAX;  // x rows per block

// One chunk in registers: the weights (kU packed rows of 4 columns per lane); with GEMV_SZ_AHEAD the raw scales
// (4 fp16) and zero points (4 bytes) of each of its kU / kG scale groups; with GEMV_X_AHEAD the x values of its kU
// steps (8 per lane and step, zeros for rows past M).
struct Chunk {
  int4 q[kU];
#if GEMV_SZ_AHEAD
  uint2 s[kU / kG];
  uint32_t z[kU / kG];
#endif
#if GEMV_X_AHEAD
  int4 x[GEMV_MT][kU];
#endif
};

// Read-only 16-byte weight load; optionally with the L2 256-byte prefetch hint.
__device__ __forceinline__ int4 load_weight(const int4* p) {
#if GEMV_L2_256
  int4 r;
  asm volatile("ld.global.nc.L2::256B.v4.s32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
#else
  return __ldg(p);
#endif
}

}  // namespace

TRITRT_ENTRY(GEMV_CLUSTER_DIMS __launch_bounds__(32 * GEMV_WARPS, GEMV_MINB))
w4a16_gemv_mma(const half* __restrict__ x, const int* __restrict__ qweight, const half* __restrict__ scales,
               const uint8_t* __restrict__ zeros, const half* __restrict__ bias, half* __restrict__ out,
               int M, int N, int K, int group_size, int stride_xm, int has_zeros, int has_bias,
               int swiglu) {
  __shared__ float red[kWarps][kRows][32];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  // 1-D grid, row tiles fastest: the blocks of one column slice run together, so its weights come from DRAM once.
  const int mtiles = (M + kRows - 1) / kRows;
  const int m0 = (blockIdx.x % mtiles) * kRows;
  const int col = (blockIdx.x / mtiles) * 32 + 4 * g;
  const bool col_ok = col < N;              // N % 4 == 0: a lane's 4 columns are all in or all out
  // chunk = 4 * kU packed rows; with GEMV_KSPLIT the cluster's blocks (grid y) take consecutive runs of chunks
  // (the launcher checks that KSPLIT divides the chunks), so a run starts on a scale group as a chunk does.
  const int chunks = K / (32 * kU) / GEMV_KSPLIT;
  const int cbase = GEMV_KSPLIT > 1 ? (int)blockIdx.y * chunks : 0;
  const int gshift = __ffs(group_size) - 1;  // group_size is a power of two (launcher)

  float acc[GEMV_MT][2][4];
#pragma unroll
  for (int mt = 0; mt < GEMV_MT; ++mt)
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[mt][i][j] = 0.f;

  // Lanes past N read column N - 4 instead (valid memory, no predication); their sums are never stored.
  const int colc = col_ok ? col : N - 4;
  // Packed row r of this lane's 4 columns is the int4 at qweight + r * N + colc: a u step is 4 rows (N int4s).
  const int4* qw = reinterpret_cast<const int4*>(qweight + colc) + (size_t)t * (N / 4);
  // B column g of tile mt is x row m0 + 8 mt + g; rows >= M (and g >= GEMV_MMAX) feed zeros. int4 r = x[row][8r..8r+7]
  bool x_ok[GEMV_MT];
  const int4* xw[GEMV_MT];
#pragma unroll
  for (int mt = 0; mt < GEMV_MT; ++mt) {
    const int row = m0 + 8 * mt + g;
    x_ok[mt] = g < GEMV_MMAX && row < M;
    xw[mt] = reinterpret_cast<const int4*>(x + (size_t)(x_ok[mt] ? row : 0) * stride_xm) + t;
  }
  const size_t q_u = (size_t)N;

  // Scale/zero offset of the group of this lane's packed rows at k (one group per run of kG u-steps of the quad:
  // the launcher's GSTEPS rule).
  auto group_offset = [&](int k) { return (size_t)(k >> gshift) * N + colc; };
  auto load_sz = [&](size_t goff, uint2& sraw, uint32_t& zraw) {
    sraw = __ldg(reinterpret_cast<const uint2*>(scales + goff));
    zraw = has_zeros ? __ldg(reinterpret_cast<const unsigned int*>(zeros + goff)) : 0x08080808u;
  };

  // x values of u-step u of chunk c for x tile mt (zeros for rows past M).
  auto load_x = [&](int mt, int c, int u) {
    return x_ok[mt] ? __ldg(xw[mt] + (size_t)(c * kU + u) * 4) : make_int4(0, 0, 0, 0);
  };

  auto load_chunk = [&](int c, Chunk& b) {  // c: this block's chunk index (its run starts at cbase)
    c += cbase;
    const int4* p = qw + (size_t)c * kU * N;
#pragma unroll
    for (int u = 0; u < kU; ++u) b.q[u] = load_weight(p + u * q_u);
#if GEMV_X_AHEAD
#pragma unroll
    for (int mt = 0; mt < GEMV_MT; ++mt)
#pragma unroll
      for (int u = 0; u < kU; ++u) b.x[mt][u] = load_x(mt, c, u);
#endif
#if GEMV_SZ_AHEAD
#pragma unroll
    for (int i = 0; i < kU / kG; ++i) load_sz(group_offset(c * 32 * kU + 32 * kG * i), b.s[i], b.z[i]);
#endif
  };

  auto process_chunk = [&](int c, const Chunk& b) {
    c += cbase;
    const int4 (&q)[kU] = b.q;
#if GEMV_WSCALE
    uint32_t s2[4];  // the 4 columns' scales, each in both halves of a half2
#else
    float cg[GEMV_CHAINS][GEMV_MT][2][4];  // this group's sums of exact (q - z) x, scaled in fp32 at the group's end
    float s[4];
#endif
    uint32_t zlo[4], zhi[4];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      if (u % kG == 0) {
#if GEMV_SZ_AHEAD
        const uint2 sraw = b.s[u / kG];
        const uint32_t zraw = b.z[u / kG];
#else
        uint2 sraw;
        uint32_t zraw;
        load_sz(group_offset(c * 32 * kU + 32 * u), sraw, zraw);
#endif
#if GEMV_WSCALE
        s2[0] = prmt(sraw.x, sraw.x, 0x1010u); s2[1] = prmt(sraw.x, sraw.x, 0x3232u);
        s2[2] = prmt(sraw.y, sraw.y, 0x1010u); s2[3] = prmt(sraw.y, sraw.y, 0x3232u);
#else
        const float2 s01 = __half22float2(*reinterpret_cast<const half2*>(&sraw.x));
        const float2 s23 = __half22float2(*reinterpret_cast<const half2*>(&sraw.y));
        s[0] = s01.x; s[1] = s01.y; s[2] = s23.x; s[3] = s23.y;
#pragma unroll
        for (int a = 0; a < GEMV_CHAINS; ++a)
#pragma unroll
          for (int mt = 0; mt < GEMV_MT; ++mt)
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
              for (int j = 0; j < 4; ++j) cg[a][mt][i][j] = 0.f;
#endif
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint32_t z = (zraw >> (8 * j)) & 0xFFu;  // 0..16
          zlo[j] = zero_lo(z);
          zhi[j] = zero_hi(z);
        }
      }
      uint32_t h[4][4];
      dequant8((uint32_t)q[u].x, zlo[0], zhi[0], h[0]);
      dequant8((uint32_t)q[u].y, zlo[1], zhi[1], h[1]);
      dequant8((uint32_t)q[u].z, zlo[2], zhi[2], h[2]);
      dequant8((uint32_t)q[u].w, zlo[3], zhi[3], h[3]);
#if GEMV_WSCALE
      // (q - z) * s rounded once to fp16: the dequantized weight itself, as cuBLAS would see it.
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) h[j][i] = hmul2_u(h[j][i], s2[j]);
#endif
#pragma unroll
      for (int mt = 0; mt < GEMV_MT; ++mt) {
#if GEMV_X_AHEAD
        const int4 xv = b.x[mt][u];
#else
        const int4 xv = load_x(mt, c, u);
#endif
        // x halves (x0..x7) -> the k order of the A fragments: {x0,x4}, {x1,x5} | {x2,x6}, {x3,x7}.
        const uint32_t b00 = prmt(xv.x, xv.z, 0x5410u), b01 = prmt(xv.x, xv.z, 0x7632u);
        const uint32_t b10 = prmt(xv.y, xv.w, 0x5410u), b11 = prmt(xv.y, xv.w, 0x7632u);
#pragma unroll
        for (int T = 0; T < 2; ++T) {
#if GEMV_WSCALE
          mma16816(acc[mt][T], h[2 * T][0], h[2 * T + 1][0], h[2 * T][1], h[2 * T + 1][1], b00, b01);
          mma16816(acc[mt][T], h[2 * T][2], h[2 * T + 1][2], h[2 * T][3], h[2 * T + 1][3], b10, b11);
#else
          mma16816(cg[0][mt][T], h[2 * T][0], h[2 * T + 1][0], h[2 * T][1], h[2 * T + 1][1], b00, b01);
          mma16816(cg[GEMV_CHAINS - 1][mt][T], h[2 * T][2], h[2 * T + 1][2], h[2 * T][3], h[2 * T + 1][3], b10, b11);
#endif
        }
      }
#if !GEMV_WSCALE
      if (u % kG == kG - 1) {
        // C rows g, g+8 are columns 4g+2T, 4g+2T+1; C columns 2t, 2t+1 are rows of x (only 2t matters at M = 1).
#pragma unroll
        for (int a = 0; a < GEMV_CHAINS; ++a)
#pragma unroll
          for (int mt = 0; mt < GEMV_MT; ++mt)
#pragma unroll
            for (int T = 0; T < 2; ++T) {
              acc[mt][T][0] = fmaf(cg[a][mt][T][0], s[2 * T], acc[mt][T][0]);
              acc[mt][T][2] = fmaf(cg[a][mt][T][2], s[2 * T + 1], acc[mt][T][2]);
              if (GEMV_MMAX > 1) {
                acc[mt][T][1] = fmaf(cg[a][mt][T][1], s[2 * T], acc[mt][T][1]);
                acc[mt][T][3] = fmaf(cg[a][mt][T][3], s[2 * T + 1], acc[mt][T][3]);
              }
            }
      }
#endif
    }
  };

  // Two register buffers used in turn (no copies): the next chunk's loads are in flight during this chunk's math.
  Chunk ba, bb;
  if (warp < chunks) {  // this warp's first chunk of weights, into L2 while the previous kernel finishes
    const int4* p = qw + (size_t)(warp + cbase) * kU * N;
#pragma unroll
    for (int u = 0; u < kU; ++u) prefetch_l2(p + u * q_u);
  }
  pdl_enter();  // x, and the output, only after the previous kernel
  if (warp < chunks) load_chunk(warp, ba);
  for (int c = warp; c < chunks; c += 2 * kWarps) {
    if (c + kWarps < chunks) load_chunk(c + kWarps, bb);
    process_chunk(c, ba);
    if (c + kWarps >= chunks) break;
    if (c + 2 * kWarps < chunks) load_chunk(c + 2 * kWarps, ba);
    process_chunk(c + kWarps, bb);
  }

  // Per-warp partial sums -> shared -> sum over warps (fixed order: deterministic).
#pragma unroll
  for (int mt = 0; mt < GEMV_MT; ++mt)
#pragma unroll
    for (int T = 0; T < 2; ++T) {
      const int cl = 4 * g + 2 * T;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int m = 8 * mt + 2 * t + j;
        if (m < kRows) {
          red[warp][m][cl] = acc[mt][T][j];
          red[warp][m][cl + 1] = acc[mt][T][2 + j];
        }
      }
    }
  __syncthreads();
  // Outputs of this block: 32 columns per x row, or with SwiGLU 16 = silu(column 2j) * column 2j + 1 (out is
  // [M, N / 2]; N is a multiple of 4, so a pair never straddles N).
  const int per_row = swiglu ? 16 : 32, n_out = swiglu ? N / 2 : N;
#if GEMV_KSPLIT == 1
  auto column_sum = [&](int r, int cl, int n) {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += red[w][r][cl];
    return has_bias ? sum + __half2float(bias[n]) : sum;
  };
  const int i0 = 0, i1 = kRows * per_row;
#else
  // Sum over warps into red[0] (each thread reads and writes only its own (m, cl)), then over the cluster: block r
  // finishes outputs r * n / KSPLIT .. of the tile from every block's red[0], read through DSMEM in a fixed order
  // (deterministic). The second cluster barrier keeps each block's shared memory alive until all reads are done.
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  for (int i = threadIdx.x; i < kRows * 32; i += 32 * kWarps) {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += red[w][i / 32][i % 32];
    red[0][i / 32][i % 32] = sum;
  }
  cluster.sync();
  auto column_sum = [&](int r, int cl, int n) {
    float sum = 0.f;
#pragma unroll
    for (int q = 0; q < GEMV_KSPLIT; ++q) sum += *cluster.map_shared_rank(&red[0][r][cl], q);
    return has_bias ? sum + __half2float(bias[n]) : sum;
  };
  const int i0 = (int)cluster.block_rank() * (kRows * per_row) / GEMV_KSPLIT;
  const int i1 = ((int)cluster.block_rank() + 1) * (kRows * per_row) / GEMV_KSPLIT;
#endif
  for (int i = i0 + threadIdx.x; i < i1; i += 32 * kWarps) {
    const int r = i / per_row, m = m0 + r, cl = swiglu ? 2 * (i % per_row) : i % per_row;
    const int n = (blockIdx.x / mtiles) * 32 + cl;
    if (m < M && n < N) {
      const float v = swiglu ? silu_mul(column_sum(r, cl, n), column_sum(r, cl + 1, n + 1)) : column_sum(r, cl, n);
      out[(size_t)m * n_out + (swiglu ? n / 2 : n)] = __float2half_rn(v);
    }
  }
#if GEMV_KSPLIT > 1
  cluster.sync();
#endif
}

#ifdef TRITRT_PLUGIN_ENTRY
// TensorRT plugin entry (W4A16Linear, trt_plugins/specs/linear.py). TensorRT's AOT plugins pass the inputs, the
// int32 extra args, then the outputs: (x, qweight, scales, zeros, M, N, K, unused, y); the unused int is the Triton
// entry's output row stride. The kernel above runs with what a plugin has: zero points, no bias, x rows of K halves,
// the group size baked in (TRITRT_GROUP_SIZE), SwiGLU or not baked in (TRITRT_SWIGLU; y [M, N / 2] with it).
// The kernel tiles any M itself (the launcher's grid).
#ifndef TRITRT_GROUP_SIZE
#error "the plugin entry needs -DTRITRT_GROUP_SIZE=<group size>"
#endif
#ifndef TRITRT_SWIGLU
#define TRITRT_SWIGLU 0
#endif
extern "C" __global__ void GEMV_CLUSTER_DIMS __launch_bounds__(32 * GEMV_WARPS, GEMV_MINB)
tritrt_w4a16_gemv_mma(const half* __restrict__ x, const int* __restrict__ qweight, const half* __restrict__ scales,
                      const uint8_t* __restrict__ zeros, int M, int N, int K, int /*unused*/, half* __restrict__ y) {
  w4a16_gemv_mma(x, qweight, scales, zeros, scales, y, M, N, K, TRITRT_GROUP_SIZE, K, 1, 0, TRITRT_SWIGLU);
}
#endif  // TRITRT_PLUGIN_ENTRY

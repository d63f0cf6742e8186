// W8A16 GEMV on tensor cores for M <= 8 * GEMV_MT (8 or 16), fp16 activations: y[M, N] = x[M, K] @ W^T (+ bias), W
// in kernels.quant's INT8 layout (qweight int8 [K, N], w[n, k] = q[k, n] * s[n], q in [-127, 127], scales fp16 [N]).
// With `swiglu` W's columns are interleaved (gate, up) pairs and y = silu(gate) * up, [M, N / 2] (a pair never
// straddles two blocks or two cluster slices: both hold an even number of columns).
//
// Why: the Triton W8A16 GEMV reaches 1.39-1.73x cuBLAS fp16 at M = 1 (H200); bytes alone allow ~1.9x. As in
// w4a16/gemv_mma.cu the weights are the mma's A operand (16 columns of W x 16 k) and x is B (16 k x 8 rows of x),
// fp32 accumulation; here the per-column scale is constant over K, so it multiplies the fp32 sum once at the end.
//
// Dequantisation (exact): int8 -> fp16 by the magic number 1024. A byte b = q & 0xFF with its top bit flipped is
// q + 128 (0..255) as unsigned; the half 0x64xx with that byte as mantissa is 1024 + q + 128; one HSUB2 by 1152
// leaves q, exact in fp16 (integers <= 2048). The flip and the 0x64 exponent byte are one LOP3: (v & 0x00FF00FF) ^
// 0x64806480 (bytes 0, 2 kept with bit 7 flipped, bytes 1, 3 forced to 0x64).
//
// Layout: an mma register is a half2 of two k values of one W column, while a 32-bit word of a qweight row holds 4
// columns at one k. One PRMT of the words of two k rows puts column c's byte of row k0 in byte 0 and of row k1 in byte
// 2 (selector {c, c, 4 + c, 4 + c}; bytes 1, 3 are overwritten by the LOP3). So a pair of weights costs PRMT + LOP3 +
// HSUB2 = 1.5 instructions per weight, plus a 1/8 share of an HMMA; x needs no permute (below).
//
// Fragment mapping (PTX ISA, mma.m16n8k16 f16): lane = 4 g + t holds A rows g, g + 8 at k {2t, 2t+1, 2t+8, 2t+9}, B
// k rows {2t, 2t+1, 2t+8, 2t+9} of column g, C rows g, g + 8, columns 2t, 2t+1. The k order is ours as long as A and
// B agree, so lane (g, t) feeds the mma's k {2t, 2t+1, 2t+8, 2t+9} with the actual rows 4t, 4t+1, 4t+2, 4t+3 of the
// 16-row step: its 4 weight loads are those 4 rows, and its B registers are x[g][4t .. 4t+3], one 8-byte load in the
// order the mma wants. Each weight load is GEMV_VEC bytes = VEC adjacent columns at one k: lane g owns columns
// g * VEC .. g * VEC + VEC - 1 of the block, tile T (0 .. VEC/2 - 1) takes columns 2T, 2T + 1 of them as its rows g,
// g + 8. A block covers 8 * VEC columns; a warp load instruction reads 4 rows (t) x 8 * VEC contiguous bytes (g).
//
// VEC (16, 8 or 4 bytes) trades run length for block count: VEC = 16 reads 128-byte runs but gives only N / 128
// column blocks (32 at N = 4096: too few SMs busy), VEC = 4 gives N / 32 with 32-byte (one sector) runs and 4 x the
// load instructions. GEMV_KSPLIT > 1 (sm_90) keeps the long runs and splits K over a thread-block cluster of KSPLIT
// blocks (grid y) instead: each block reduces its warps in shared memory, then every block of the cluster sums one
// slice of the columns over the cluster's shared memories (DSMEM, fixed order), so there is still one launch, no
// global scratch, no memset, and the result is deterministic. The launcher's plan picks VEC and KSPLIT from N, K and
// the SM count.
//
// Instruction budget per weight (VEC = 16): 1.5 dequantisation + 1/8 HMMA + 1/16 LDG.128 + 1/64 x LDG, plus loop
// addressing. VEC = 4: LDG.32 instead, 1/4 per weight. sm_90 SASS of the main loop (nvcc 13.0; two chunks): VEC = 16,
// U = 1 (128 weights per lane): 263 instructions = 2.05 per weight (LOP3 69, PRMT 64, HADD2 64, HMMA 16, IMAD 15,
// LDG 10, IADD3 8, ...), 95 registers, no local memory (U = 2: 1.94 per weight but 141 registers); VEC = 4, U = 4
// (128 weights): 326 = 2.55 per weight (LDG 40, IMAD 35: 4 x more, narrower loads). The chunk pointers advance
// instead of being recomputed from the chunk index: with an index, ptxas rematerialised the whole address (S2R, LDC,
// 64-bit IMADs) at every load, 2.51 per weight. At 4.3 TB/s (H200) an SM must retire ~16 weights per cycle: VEC = 16
// then issues ~1 of its 4 warp-instructions per cycle, so the loop stays memory-bound.
//
// Work split: a block = GEMV_WARPS warps on the same 8 * VEC columns and K / KSPLIT rows, warps splitting them in
// chunks of GEMV_U 16-row steps (register double buffer: the next chunk's loads are issued before this chunk's math),
// reduced through shared memory (and DSMEM across the cluster) at the end with scale and bias. GEMV_MT = 2 (M 9..16):
// each dequantised weight pair feeds the mmas of two x tiles of 8 rows (B operands), twice the accumulators (167
// registers at VEC = 16 against 95), and the epilogue reduces tile by tile through the same shared buffer. The
// launcher checks: N % VEC == 0, K % (16 * GEMV_U * KSPLIT) == 0, x rows 8-byte aligned, qweight 16-byte aligned.
#include "../mma_common.cuh"
#include "../plugin_entry.cuh"

#ifndef GEMV_WARPS
#define GEMV_WARPS 8
#endif
#ifndef GEMV_VEC
#define GEMV_VEC 16  // bytes (= columns) per lane per weight load: 16, 8 or 4
#endif
#ifndef GEMV_U
#define GEMV_U 1  // 16-row k steps per chunk: a lane holds 4 * GEMV_U weight loads per buffer
#endif
#ifndef GEMV_L2_128
#define GEMV_L2_128 0  // 1: weight loads ask L2 to fetch the whole 128-byte line (neighbouring blocks' columns)
#endif
#ifndef GEMV_KSPLIT
#define GEMV_KSPLIT 1  // blocks (one cluster, grid y) splitting K: 1 to 8
#endif
#ifndef GEMV_MT
#define GEMV_MT 1  // x tiles of 8 rows (B operands) per block: M <= 8 * GEMV_MT, each dequantised weight feeds MT mmas
#endif
#if GEMV_KSPLIT > 1
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#error "GEMV_KSPLIT > 1 uses thread-block clusters (sm_90+); build with GEMV_KSPLIT=1 for older GPUs"
#endif
#include <cooperative_groups.h>
#define TRITRT_CLUSTER_DIMS __cluster_dims__(1, GEMV_KSPLIT, 1)
#else
#define TRITRT_CLUSTER_DIMS
#endif

namespace {
using namespace tritrt;
constexpr int kWarps = GEMV_WARPS;
constexpr int kVec = GEMV_VEC;
constexpr int kWords = kVec / 4;  // 32-bit words per row load
constexpr int kTiles = kVec / 2;  // mma tiles per lane (2 columns of each lane's VEC per tile)
constexpr int kCols = 8 * kVec;   // columns per block
constexpr int kU = GEMV_U;
constexpr int kSplit = GEMV_KSPLIT;
constexpr int kMt = GEMV_MT;
static_assert(kVec == 4 || kVec == 8 || kVec == 16, "GEMV_VEC is 4, 8 or 16");
static_assert(kSplit >= 1 && kSplit <= 8, "GEMV_KSPLIT is 1 to 8 (portable cluster sizes)");
static_assert(kMt == 1 || kMt == 2, "GEMV_MT is 1 or 2");
// red[] below is kWarps * 8 * kCols floats: keep it within 32 KB of static shared memory.
static_assert(kWarps * kCols <= 1024, "GEMV_WARPS * 8 * GEMV_VEC must be <= 1024 (shared-memory reduction)");

struct Row {
  uint32_t w[kWords];
};

// One chunk's registers: 4 weight rows per 16-row step, and the step's x[8 mt + g][4t .. 4t+3] (B of x tile mt),
// loaded together so that the x load's latency is hidden behind the previous chunk's math like the weights'.
struct Chunk {
  Row q[kU][4];
  uint2 x[kU][kMt];
};

// Read-only load of VEC bytes (one k row, VEC columns); optionally with the L2 128-byte prefetch hint.
__device__ __forceinline__ Row load_row(const uint8_t* p) {
  Row r;
#if GEMV_L2_128
#define TRITRT_L2 ".L2::128B"
#else
#define TRITRT_L2 ""
#endif
  if constexpr (kWords == 4) {
    asm volatile("ld.global.nc" TRITRT_L2 ".v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.w[0]), "=r"(r.w[1]), "=r"(r.w[2]), "=r"(r.w[3]) : "l"(p));
  } else if constexpr (kWords == 2) {
    asm volatile("ld.global.nc" TRITRT_L2 ".v2.u32 {%0,%1}, [%2];" : "=r"(r.w[0]), "=r"(r.w[1]) : "l"(p));
  } else {
    asm volatile("ld.global.nc" TRITRT_L2 ".u32 %0, [%1];" : "=r"(r.w[0]) : "l"(p));
  }
#undef TRITRT_L2
  return r;
}

// Column c (0..3) of the words of rows k0 (lo) and k1 (hi) -> half2 {q[k0], q[k1]}, exact.
__device__ __forceinline__ uint32_t pair_to_half2(uint32_t lo, uint32_t hi, int c) {
  constexpr uint32_t kMask = 0x00FF00FFu;  // keep bytes 0 and 2
  constexpr uint32_t kFlip = 0x64806480u;  // flip bit 7 of the kept bytes (q + 128), bytes 1, 3 = 0x64 (2^10)
  constexpr uint32_t k1152 = 0x64806480u;  // fp16 1152 = 1024 + 128 in both halves
  const uint32_t sel = (uint32_t)c * 0x11u + (uint32_t)(4 + c) * 0x1100u;  // bytes {c, c, 4+c, 4+c}
  return hsub2_u(lop3_and_xor(prmt(lo, hi, sel), kMask, kFlip), k1152);
}

}  // namespace

TRITRT_ENTRY(TRITRT_CLUSTER_DIMS __launch_bounds__(32 * GEMV_WARPS, 1))
w8a16_gemv_mma(const half* __restrict__ x, const int8_t* __restrict__ qweight, const half* __restrict__ scales,
               const half* __restrict__ bias, half* __restrict__ out, int M, int N, int K, int stride_xm,
               int has_bias, int swiglu) {
  __shared__ float red[kWarps][8][kCols];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int col = blockIdx.x * kCols + kVec * g;
  const bool col_ok = col < N;    // N % VEC == 0: a lane's VEC columns are all in or all out
  const int k_rows = K / kSplit;  // this block's slice of K: rows blockIdx.y * k_rows ..
  const int chunks = k_rows / (16 * kU);

  float acc[kMt][kTiles][4];
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
    for (int i = 0; i < kTiles; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[mt][i][j] = 0.f;

  // Lanes past N read columns N - VEC .. N - 1 instead (valid memory, no predication); their sums are never stored.
  const int colc = col_ok ? col : N - kVec;
  // Row k of this lane's columns starts at qweight + k * N + colc; the lane's rows of step s are 16 s + 4 t + j.
  const size_t k_first = (size_t)blockIdx.y * k_rows;
  const uint8_t* qw = reinterpret_cast<const uint8_t*>(qweight) + (k_first + 4 * t) * N + colc;
  // B column g of x tile mt is x row 8 mt + g: x[8 mt + g][16 s + 4t .. 16 s + 4t + 3] = the B registers of step s,
  // uint2 number 4 s from the row's start (px[mt] starts at this warp's first chunk). Rows >= M read row 0 (valid
  // memory, no branch in the loop), zeroed by the mask.
  const uint2* px[kMt];
  uint32_t x_mask[kMt];
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt) {
    const bool x_ok = 8 * mt + g < M;
    px[mt] = reinterpret_cast<const uint2*>(x + (size_t)(x_ok ? 8 * mt + g : 0) * stride_xm + k_first + 4 * t) +
             warp * (4 * kU);
    x_mask[mt] = x_ok ? 0xFFFFFFFFu : 0u;
  }
  const size_t row_n = (size_t)N;

  // Chunk pointers advance by kWarps chunks per load (no per-load index arithmetic in the loop).
  const uint8_t* pq = qw + (size_t)warp * (16 * kU) * row_n;
  const size_t q_step = (size_t)kWarps * (16 * kU) * row_n;
  auto load_chunk = [&](Chunk& b) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
#pragma unroll
      for (int j = 0; j < 4; ++j) b.q[u][j] = load_row(pq + (size_t)(16 * u + j) * row_n);
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt) b.x[u][mt] = __ldg(px[mt] + 4 * u);
    }
    pq += q_step;
#pragma unroll
    for (int mt = 0; mt < kMt; ++mt) px[mt] += kWarps * 4 * kU;
  };

  auto process_chunk = [&](const Chunk& b) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const Row(&q)[4] = b.q[u];
      uint2 xv[kMt];
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt) xv[mt] = make_uint2(b.x[u][mt].x & x_mask[mt], b.x[u][mt].y & x_mask[mt]);
#pragma unroll
      for (int w = 0; w < kWords; ++w) {
        // Columns 4w .. 4w+3 of the lane: tile 2w takes 4w (row g), 4w+1 (row g+8); tile 2w+1 takes 4w+2, 4w+3.
        uint32_t lo[4], hi[4];  // lo: k rows 4t, 4t+1 (mma k 2t, 2t+1); hi: rows 4t+2, 4t+3 (mma k 2t+8, 2t+9)
#pragma unroll
        for (int cc = 0; cc < 4; ++cc) {
          lo[cc] = pair_to_half2(q[0].w[w], q[1].w[w], cc);
          hi[cc] = pair_to_half2(q[2].w[w], q[3].w[w], cc);
        }
#pragma unroll
        for (int mt = 0; mt < kMt; ++mt) {  // the dequantised weights feed every x tile
          mma16816(acc[mt][2 * w], lo[0], lo[1], hi[0], hi[1], xv[mt].x, xv[mt].y);
          mma16816(acc[mt][2 * w + 1], lo[2], lo[3], hi[2], hi[3], xv[mt].x, xv[mt].y);
        }
      }
    }
  };

  // Two register buffers used in turn (no copies): the next chunk's loads are in flight during this chunk's math.
  // Chunks warp, warp + kWarps, ... are loaded in that order (each load_chunk advances the pointers by one).
  Chunk qa, qb;
  if (warp < chunks) {  // this warp's first chunk of weights, into L2 while the previous kernel finishes
#pragma unroll
    for (int u = 0; u < kU; ++u)
#pragma unroll
      for (int j = 0; j < 4; ++j) prefetch_l2(pq + (size_t)(16 * u + j) * row_n);
  }
  pdl_enter();  // x, and the output, only after the previous kernel
  if (warp < chunks) load_chunk(qa);
  for (int c = warp; c < chunks; c += 2 * kWarps) {
    if (c + kWarps < chunks) load_chunk(qb);
    process_chunk(qa);
    if (c + kWarps >= chunks) break;
    if (c + 2 * kWarps < chunks) load_chunk(qa);
    process_chunk(qb);
  }

  // Per-warp partial sums -> shared -> sum over warps (fixed order: deterministic), then scale and bias; x tile by x
  // tile through the same buffer.
  const int per = swiglu ? 2 : 1;  // with SwiGLU each thread takes a (gate, up) pair of columns, n even
  auto finish = [&](int n, float sum) {  // column n's finished value from its fp32 sum
    sum *= __half2float(scales[n]);
    return has_bias ? sum + __half2float(bias[n]) : sum;
  };
  // The block's columns c0 .. c0 + cols - 1 (cols even) of x rows m0 .. m0 + 7 (one x tile), each column's fp32 sum
  // given by column_sum(m, cl) for row m0 + m, finished and stored for rows < M and columns < N (with SwiGLU: one
  // output per pair).
  auto store_columns = [&](int m0, int c0, int cols, auto column_sum) {
    for (int i = threadIdx.x; i < 8 * cols / per; i += 32 * kWarps) {
      const int m = i / (cols / per), cl = c0 + per * (i % (cols / per));
      const int n = blockIdx.x * kCols + cl;
      if (m0 + m < M && n < N) {
        const float y = finish(n, column_sum(m, cl));
        if (swiglu)
          out[(size_t)(m0 + m) * (N / 2) + n / 2] = __float2half_rn(silu_mul(y, finish(n + 1, column_sum(m, cl + 1))));
        else
          out[(size_t)(m0 + m) * N + n] = __float2half_rn(y);
      }
    }
  };
#if GEMV_KSPLIT > 1
  // Block r of the cluster finishes whole (gate, up) pairs r * P / KSPLIT .. (r + 1) * P / KSPLIT of the block's P.
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  constexpr int kPairs = kCols / 2;
  const int rank = (int)cluster.block_rank();
  const int c_lo = 2 * (rank * kPairs / kSplit), c_hi = 2 * ((rank + 1) * kPairs / kSplit);
#endif
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt) {
    const int m0 = 8 * mt;  // x row of this tile's C column 0
    if (m0 >= M) break;     // uniform over the block and the cluster
    if (mt > 0) __syncthreads();  // the previous tile's reads of red are done
    // C of tile T: rows g, g+8 = the lane's columns 2T, 2T+1; C columns 2t, 2t+1 = x rows m0 + 2t, m0 + 2t + 1.
#pragma unroll
    for (int T = 0; T < kTiles; ++T) {
      const int cl = kVec * g + 2 * T;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        red[warp][2 * t + j][cl] = acc[mt][T][j];
        red[warp][2 * t + j][cl + 1] = acc[mt][T][2 + j];
      }
    }
    __syncthreads();
#if GEMV_KSPLIT == 1
    store_columns(m0, 0, kCols, [&](int m, int cl) {
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) sum += red[w][m][cl];
      return sum;
    });
#else
    // Sum over warps into red[0] (each thread reads and writes only its own (m, cl): no race), then over the
    // cluster, through DSMEM. The second cluster barrier keeps every block (and its shared memory) alive, and red
    // unchanged, until all reads are done.
    for (int i = threadIdx.x; i < 8 * kCols; i += 32 * kWarps) {
      const int m = i / kCols, cl = i % kCols;
      if (m0 + m < M) {
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) sum += red[w][m][cl];
        red[0][m][cl] = sum;
      }
    }
    cluster.sync();
    store_columns(m0, c_lo, c_hi - c_lo, [&](int m, int cl) {
      float sum = 0.f;
#pragma unroll
      for (int r = 0; r < kSplit; ++r) sum += *cluster.map_shared_rank(&red[0][m][cl], r);
      return sum;
    });
    cluster.sync();
#endif
  }
}

#ifdef TRITRT_PLUGIN_ENTRY
// TensorRT plugin entry (W8A16Linear, trt_plugins/specs/linear.py). TensorRT's AOT plugins pass the inputs, the
// int32 extra args, then the outputs: (x, qweight, scales, M, N, K, unused, y); the unused int is the Triton entry's
// output row stride. The kernel above runs with no bias, x rows of K halves and SwiGLU or not baked in (TRITRT_SWIGLU;
// y [M, N / 2] with it). It takes at most 8 GEMV_MT rows, so grid z walks the row tiles of any M: grid
// (N / (8 GEMV_VEC), GEMV_KSPLIT, cdiv(M, 8 GEMV_MT)), each tile the launch the torch path makes for its rows.
#ifndef TRITRT_SWIGLU
#define TRITRT_SWIGLU 0
#endif
extern "C" __global__ void TRITRT_CLUSTER_DIMS __launch_bounds__(32 * GEMV_WARPS, 1)
tritrt_w8a16_gemv_mma(const half* __restrict__ x, const int8_t* __restrict__ qweight, const half* __restrict__ scales,
                      int M, int N, int K, int /*unused*/, half* __restrict__ y) {
  const int m0 = blockIdx.z * 8 * GEMV_MT;
  w8a16_gemv_mma(x + (size_t)m0 * K, qweight, scales, scales, y + (size_t)m0 * (TRITRT_SWIGLU ? N / 2 : N),
                 min(M - m0, 8 * GEMV_MT), N, K, K, 0, TRITRT_SWIGLU);
}
#endif  // TRITRT_PLUGIN_ENTRY

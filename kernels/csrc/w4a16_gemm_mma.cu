// EXPERIMENTAL (not routed; measured 0.2-0.5x cuBLAS at M >= 64, see w4a16_gemm_mma.py).
// W4A16 GEMM on tensor cores for M from ~16 to a few hundred, fp16 activations: y[M, N] = x[M, K] @ W^T (+ bias),
// W in kernels.quant's INT4 layout (qweight int32 [K/8, N], nibble j of packed row r is k = 8r + j; scales fp16
// [K/G, N]; zeros uint8 [K/G, N] or none = 8).
//
// Why a second kernel: the tiled GEMV (w4a16_gemv_mma.cu) reads x through L1 once per 32-column slice, so at M >= 64
// the x traffic (M K 2 bytes x N / 32) outgrows the weights and it falls to 0.4-0.8x cuBLAS. Here a block covers
// BN = 32 NT WN columns, so x crosses L2 N / BN times, through shared memory:
//   * a stage of BK = 32 U values of k holds the x tile [BM, BK], the packed weight tile [BK / 8, BN] and its scales
//     (and zeros), copied with cp.async; GEMM_STAGES stages are in flight (the usual multistage pipeline).
//   * warp w owns columns 32 NT w .. 32 NT (w + 1) - 1 of the tile: it reads its weights from shared memory in the
//     same fragment order as the GEMV (lane (g, t) reads 16 B = 4 adjacent columns of packed row 4u + t), dequantizes
//     them once with w4_dequant.cuh (exact q - z), scales them in fp16 ((q - z) s rounded once: the dequantized
//     weight cuBLAS would see), and multiplies each A fragment with the B fragments of all MT x tiles (8 rows each).
//   * the mma's k order is the GEMV's (A = {n0,n4},{n1,n5} | {n2,n6},{n3,n7}, x permuted to match with PRMT).
//   * row strides in shared memory are padded so that each quarter-warp's 16-byte reads hit distinct banks: x rows by
//     64 B (rows g and g + 1 in opposite bank halves), weight rows by 32 B (4 packed rows in 4 bank quarters).
//   * split-K over gridDim.y when the tiles alone do not fill the GPU: each split writes its fp32 partial tile to
//     `workspace` ([splits, M, N]); the last block of a tile to arrive (per-tile counter, threadfence) sums the splits
//     in split order (deterministic), adds the bias, stores fp16 and resets the counter to 0 for the next launch. So
//     counters start (and end) at 0: they must not be shared by two launches running at the same time.
// Launcher checks: N % 16 == 0, K % BK == 0, group_size a power of two >= 32 with GSTEPS = min(group_size / 32, U),
// x rows 16-byte aligned.
#include "w4_dequant.cuh"

#ifndef GEMM_WN
#define GEMM_WN 4  // warps per block, side by side along N
#endif
#ifndef GEMM_NT
#define GEMM_NT 2  // 32-column groups per warp
#endif
#ifndef GEMM_MT
#define GEMM_MT 4  // x tiles of 8 rows per block: BM = 8 MT
#endif
#ifndef GEMM_U
#define GEMM_U 4  // 32-k steps per stage: BK = 32 U
#endif
#ifndef GEMM_GSTEPS
#define GEMM_GSTEPS 4  // 32-k steps per scale group: min(group_size / 32, U)
#endif
#ifndef GEMM_STAGES
#define GEMM_STAGES 3
#endif
#ifndef GEMM_MINB
#define GEMM_MINB 1  // __launch_bounds__ min blocks per SM (caps registers at 64K / (MINB * threads))
#endif

namespace {
using namespace tritrt;
constexpr int kWN = GEMM_WN, kNT = GEMM_NT, kMT = GEMM_MT, kU = GEMM_U, kG = GEMM_GSTEPS, kStages = GEMM_STAGES;
constexpr int kThreads = 32 * kWN;
constexpr int kBM = 8 * kMT, kBN = 32 * kNT * kWN, kBK = 32 * kU;
constexpr int kGRows = kU / kG;         // scale groups per stage
constexpr int kXStride = 2 * kBK + 64;  // bytes per x row in shared memory (see header: bank padding)
constexpr int kWStride = 4 * kBN + 32;  // bytes per packed weight row
constexpr int kXBytes = kBM * kXStride;
constexpr int kWBytes = (kBK / 8) * kWStride;
constexpr int kSBytes = kGRows * kBN * 2;
constexpr int kZBytes = kGRows * kBN;
constexpr int kStageBytes = kXBytes + kWBytes + kSBytes + kZBytes;
static_assert(kU % kG == 0, "GEMM_GSTEPS must divide GEMM_U");
static_assert(kStages >= 2, "GEMM_STAGES >= 2");
static_assert(kXBytes % 16 == 0 && kWBytes % 16 == 0 && kSBytes % 16 == 0 && kZBytes % 16 == 0,
              "shared regions must stay 16-byte aligned");

// 16-byte global -> shared copy, zero-filled when !valid (src is not read then, but must be a mapped address).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }
}  // namespace

extern "C" __global__ void __launch_bounds__(32 * GEMM_WN, GEMM_MINB)
w4a16_gemm_mma(const half* __restrict__ x, const int* __restrict__ qweight, const half* __restrict__ scales,
               const uint8_t* __restrict__ zeros, const half* __restrict__ bias, half* __restrict__ out,
               float* __restrict__ workspace, int* __restrict__ counters, int M, int N, int K, int group_size,
               int stride_xm, int has_zeros, int has_bias, int splits) {
  extern __shared__ __align__(16) char smem[];
  __shared__ int is_last;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int mtiles = (M + kBM - 1) / kBM;  // row tiles fastest: the blocks of one column tile run together
  const int m0 = (blockIdx.x % mtiles) * kBM;
  const int n0 = (blockIdx.x / mtiles) * kBN;
  const int gshift = __ffs(group_size) - 1;
  const int ktiles = K / kBK;
  const int per = (ktiles + splits - 1) / splits;
  const int kb = blockIdx.y * per;
  const int nk = max(0, min(ktiles, kb + per) - kb);

  auto load_stage = [&](int kt, int buf) {
    char* xs = smem + buf * kStageBytes;
    char* ws = xs + kXBytes;
    char* ss = ws + kWBytes;
    char* zs = ss + kSBytes;
    const int k0 = kt * kBK;
    for (int i = threadIdx.x; i < kBM * (kBK / 8); i += kThreads) {
      const int r = i / (kBK / 8), c = i % (kBK / 8);
      const bool ok = m0 + r < M;  // rows past M are zeros
      cp_async16(xs + r * kXStride + 16 * c, x + (size_t)(ok ? m0 + r : 0) * stride_xm + k0 + 8 * c, ok);
    }
    for (int i = threadIdx.x; i < (kBK / 8) * (kBN / 4); i += kThreads) {
      const int r = i / (kBN / 4), c = i % (kBN / 4);
      const bool ok = n0 + 4 * c < N;  // N % 16 == 0: a 16-byte chunk is all in or all out
      cp_async16(ws + r * kWStride + 16 * c, qweight + (size_t)(k0 / 8 + r) * N + (ok ? n0 + 4 * c : 0), ok);
    }
    for (int i = threadIdx.x; i < kGRows * (kBN / 8); i += kThreads) {
      const int r = i / (kBN / 8), c = i % (kBN / 8);
      const bool ok = n0 + 8 * c < N;
      const size_t grp = (size_t)((k0 + 32 * kG * r) >> gshift);
      cp_async16(ss + r * kBN * 2 + 16 * c, scales + grp * N + (ok ? n0 + 8 * c : 0), ok);
    }
    if (has_zeros) {
      for (int i = threadIdx.x; i < kGRows * (kBN / 16); i += kThreads) {
        const int r = i / (kBN / 16), c = i % (kBN / 16);
        const bool ok = n0 + 16 * c < N;
        const size_t grp = (size_t)((k0 + 32 * kG * r) >> gshift);
        cp_async16(zs + r * kBN + 16 * c, zeros + grp * N + (ok ? n0 + 16 * c : 0), ok);
      }
    }
  };

  float acc[kNT][kMT][2][4];
#pragma unroll
  for (int a = 0; a < kNT; ++a)
#pragma unroll
    for (int b = 0; b < kMT; ++b)
#pragma unroll
      for (int c = 0; c < 2; ++c)
#pragma unroll
        for (int d = 0; d < 4; ++d) acc[a][b][c][d] = 0.f;

  auto compute_stage = [&](int buf) {
    const char* xs = smem + buf * kStageBytes;
    const char* ws = xs + kXBytes;
    const char* ss = ws + kWBytes;
    const char* zs = ss + kSBytes;
    uint32_t s2[kNT][4], zlo[kNT][4], zhi[kNT][4];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      if (u % kG == 0) {
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
          const int cl = 32 * (kNT * warp + nt) + 4 * g;  // this lane's first column in the tile
          const uint2 sraw = *reinterpret_cast<const uint2*>(ss + (u / kG) * kBN * 2 + 2 * cl);
          const uint32_t zraw = has_zeros ? *reinterpret_cast<const uint32_t*>(zs + (u / kG) * kBN + cl)
                                          : 0x08080808u;
          s2[nt][0] = prmt(sraw.x, sraw.x, 0x1010u);
          s2[nt][1] = prmt(sraw.x, sraw.x, 0x3232u);
          s2[nt][2] = prmt(sraw.y, sraw.y, 0x1010u);
          s2[nt][3] = prmt(sraw.y, sraw.y, 0x3232u);
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const uint32_t z = (zraw >> (8 * j)) & 0xFFu;
            zlo[nt][j] = zero_lo(z);
            zhi[nt][j] = zero_hi(z);
          }
        }
      }
      uint32_t h[kNT][4][4];
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
        const int cl = 32 * (kNT * warp + nt) + 4 * g;
        const uint4 q = *reinterpret_cast<const uint4*>(ws + (4 * u + t) * kWStride + 4 * cl);
        dequant8(q.x, zlo[nt][0], zhi[nt][0], h[nt][0]);
        dequant8(q.y, zlo[nt][1], zhi[nt][1], h[nt][1]);
        dequant8(q.z, zlo[nt][2], zhi[nt][2], h[nt][2]);
        dequant8(q.w, zlo[nt][3], zhi[nt][3], h[nt][3]);
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int i = 0; i < 4; ++i) h[nt][j][i] = hmul2_u(h[nt][j][i], s2[nt][j]);
      }
      // x[8 mt + g][32 u + 8 t .. + 7] -> the k order of the A fragments: {x0,x4}, {x1,x5} | {x2,x6}, {x3,x7}
      uint32_t bx[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        const uint4 xv = *reinterpret_cast<const uint4*>(xs + (8 * mt + g) * kXStride + 2 * (32 * u + 8 * t));
        bx[mt][0] = prmt(xv.x, xv.z, 0x5410u);
        bx[mt][1] = prmt(xv.x, xv.z, 0x7632u);
        bx[mt][2] = prmt(xv.y, xv.w, 0x5410u);
        bx[mt][3] = prmt(xv.y, xv.w, 0x7632u);
      }
      // Both k halves of the step; within a half the NT x MT x 2 products are independent, so the HMMAs need not
      // wait for each other (the second half's accumulate into the first half's results).
#pragma unroll
      for (int hf = 0; hf < 2; ++hf)
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
          for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
            for (int T = 0; T < 2; ++T)
              mma16816_sched(acc[nt][mt][T], h[nt][2 * T][2 * hf], h[nt][2 * T + 1][2 * hf], h[nt][2 * T][2 * hf + 1],
                             h[nt][2 * T + 1][2 * hf + 1], bx[mt][2 * hf], bx[mt][2 * hf + 1]);
    }
  };

  // The pipeline: stages kb .. kb + STAGES - 2 in flight before the first compute; one commit group per stage
  // (empty past the end, so that wait_group counts stay uniform).
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < nk) load_stage(kb + s, s);
    cp_async_commit();
  }
  for (int i = 0; i < nk; ++i) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // stage i landed for every thread; everyone is done with the buffer loaded next
    if (i + kStages - 1 < nk) load_stage(kb + i + kStages - 1, (i + kStages - 1) % kStages);
    cp_async_commit();
    compute_stage(i % kStages);
  }
  cp_async_wait<0>();

  // acc[nt][mt][T]: C rows g, g + 8 are columns c = 32 (NT warp + nt) + 4 g + 2T and c + 1; C columns 2t, 2t + 1 are
  // x rows 8 mt + 2t and + 1. So {acc[0], acc[2]} and {acc[1], acc[3]} are adjacent column pairs of two rows.
  if (splits == 1) {
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int T = 0; T < 2; ++T) {
        const int col = n0 + 32 * (kNT * warp + nt) + 4 * g + 2 * T;
        if (col >= N) continue;  // N % 16 == 0: col + 1 < N too
        const float b0 = has_bias ? __half2float(bias[col]) : 0.f, b1 = has_bias ? __half2float(bias[col + 1]) : 0.f;
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const int row = m0 + 8 * mt + 2 * t + j;
            if (row < M)
              *reinterpret_cast<half2*>(out + (size_t)row * N + col) =
                  __floats2half2_rn(acc[nt][mt][T][j] + b0, acc[nt][mt][T][2 + j] + b1);
          }
      }
    return;
  }

  float* part = workspace + (size_t)blockIdx.y * M * N;
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
    for (int T = 0; T < 2; ++T) {
      const int col = n0 + 32 * (kNT * warp + nt) + 4 * g + 2 * T;
      if (col >= N) continue;
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int row = m0 + 8 * mt + 2 * t + j;
          if (row < M)
            __stcg(reinterpret_cast<float2*>(part + (size_t)row * N + col),
                   make_float2(acc[nt][mt][T][j], acc[nt][mt][T][2 + j]));
        }
    }
  __threadfence();  // this block's partials are visible device-wide before it is counted
  __syncthreads();
  if (threadIdx.x == 0) {
    const int arrived = atomicAdd(counters + blockIdx.x, 1) + 1;
    is_last = arrived == splits;
    if (is_last) counters[blockIdx.x] = 0;  // every split has arrived: ready for the next launch
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  for (int i = threadIdx.x; i < kBM * (kBN / 2); i += kThreads) {
    const int row = m0 + i / (kBN / 2), col = n0 + 2 * (i % (kBN / 2));
    if (row >= M || col >= N) continue;
    float2 sum = make_float2(0.f, 0.f);
    for (int s = 0; s < splits; ++s) {  // split order: the same sum whichever block arrives last
      const float2 v = __ldcg(reinterpret_cast<const float2*>(workspace + ((size_t)s * M + row) * N + col));
      sum.x += v.x;
      sum.y += v.y;
    }
    if (has_bias) {
      sum.x += __half2float(bias[col]);
      sum.y += __half2float(bias[col + 1]);
    }
    *reinterpret_cast<half2*>(out + (size_t)row * N + col) = __floats2half2_rn(sum.x, sum.y);
  }
}

// Weight-only GEMM for Hopper (sm_90a) on warpgroup MMAs, fp16 activations, M from ~17 to ~1000:
// y[M, N] = x[M, K] @ W^T (+ bias), or with WG_SWIGLU (W's columns interleaved gate/up pairs) silu(gate) * up ->
// [M, N / 2]. One kernel for both of kernels.quant's layouts (WG_BITS):
//   4: INT4, qweight int32 [K/8, N], nibble j of packed row r is k = 8r + j; scales fp16 [K/G, N]; zeros int8 [K/G, N],
//      0..16, read as bytes, or none = 8. The weight is rounded once to fp16, (q - z) s, as cuBLAS would see it.
//   8: INT8, qweight int8 [K, N], one fp16 scale per column: the MMAs run on q itself (exact in fp16) and the fp32
//      sums are scaled per column in the epilogue, s * sum_k q x (one rounding fewer than the dequantized weight).
//
// The product is computed transposed, y^T = W x^T, so that the weight is wgmma's A operand, which may come from
// registers: each thread dequantizes its own A fragment and nothing dequantized goes through shared memory. x is the
// B operand, read by the tensor cores straight from shared memory (K-major rows, 128-byte swizzle).
//   * Block: WG_WGS warpgroups, each owning WG_WT tiles of 64 output columns (wgmma M = 64; BN = 64 WT WGS columns
//     per block), times BM = WG_BM rows of x (wgmma N). A stage is BK = 64 values of k: x [BM, 64] (one 128-byte row
//     per x row), the weight's [64 k, BN] slice (INT4: 8 packed int32 rows; INT8: 64 byte rows, each padded by 16
//     bytes in shared memory so that 8 consecutive rows start in 8 different bank groups) and, INT4, one row of
//     scales (and zeros) -- group_size % 64 == 0, so a stage never spans two groups. The stages form a
//     WG_STAGES-deep cp.async ring filled STAGES - 2 stages ahead; each thread's copy pointers are computed once and
//     advance one stage per load.
//     WG_TMA: x's tile of a stage is one tensor copy instead (cp.async.bulk.tensor with the launcher's tensor map
//     of x, 128-byte swizzle, rows past M zero-filled), issued by thread 0 and completing the buffer's mbarrier,
//     which every thread waits on after the stage's block barrier; the weight slices stay cp.async copies. The
//     torch launcher only (a TensorRT plugin has no tensor map).
//   * A fragment of warp w in a 64-column tile (rows 16 w + g and 16 w + g + 8, g = lane / 4, t = lane % 4;
//     k = 2t, 2t+1, 2t+8, 2t+9 of each 16): the two rows are made the ADJACENT columns n = 2 (8 w + g) and n + 1 of
//     the tile.
//     INT4: one 8-byte shared load gives both rows' int32 of a packed row. Byte t of the packed rows 2s and 2s + 1
//     of a 32-k step holds exactly the nibble pairs (k = 16 s + 2t, + 1) and (16 s + 2t + 8, + 9) of k16 step s: one
//     PRMT puts byte t in both halves, one LOP3 makes {1024 + q_lo, 1024 + 16 q_hi}, one HFMA2 by {1, 1/16} with
//     {-(1024 + z), -(64 + z)} gives q - z exactly, and one HMUL2 scales it.
//     INT8: the warp's 16 columns are 16 bytes of each k row, so one ldmatrix.x4.trans per 32-k half hands lane
//     (g, t) the 16-bit column pair g at k rows 2t and 2t + 1 of each 8-row quarter: bytes {q(2t, n), q(2t, n+1),
//     q(2t+1, n), q(2t+1, n+1)}. Bytes 0, 2 are row g's A register, bytes 1, 3 row g + 8's: one LOP3 (SHF + LOP3
//     for the odd bytes) makes {1024 + 128 + q, ...} (sign bit flipped, 0x64 exponent bytes), one HSUB2 of 1152
//     leaves q exactly.
//   * Async: each k16 step's wgmmas (one per tile) are committed as one group, and after step j only step
//     j - ASETS + 1 is waited for, so the dequantization of the next steps runs while the tensor cores work; the A
//     registers cycle through WG_ASETS sets (2 or 4). A stage's buffer is refilled two iterations after its wgmmas
//     were issued (prefetch distance STAGES - 2), when they are known complete (at most 3 of the 4 steps after them
//     are outstanding). Blocks of 128 or 256 rows, and 64-row blocks of 5 stages or more, take one block barrier per
//     stage (the refill waits for it: the barrier that says stage i has landed also says every warpgroup is past
//     stage i - 1, so stage i - 2's buffer is free), other 64-row blocks two (refill first, the wait covers one more
//     stage in flight; see kOneBarrier).
//   * Split-K over grid y (WG_SPLITS blocks per tile) when the tiles alone leave SMs idle, summed in split order
//     (deterministic) one of two ways. WG_DSMEM 0: fp32 partials in `workspace` [splits, M, N]; the last block of a
//     tile to arrive sums them and resets the tile's counter to 0 (so counters start and end at 0; two launches
//     sharing them must not run concurrently). WG_DSMEM 1: the tile's blocks form a thread-block cluster; each writes
//     its partial tile to its own shared memory (the drained stage buffers), and after a cluster barrier block r sums
//     rows r * BM / SPLITS .. of all of them over DSMEM: no global traffic, and the sum is spread over the blocks.
// Launcher checks: N % BN == 0, K % 64 == 0, INT4 group_size % 64 == 0, x rows and all operands 16-byte aligned.
#include <cooperative_groups.h>
#include <type_traits>

#include "plugin_entry.cuh"
#include "w4a16/w4_dequant.cuh"

#ifndef WG_BITS
#define WG_BITS 4  // weight bits: 4 (INT4, group scales and zeros) or 8 (INT8, one scale per column)
#endif
#ifndef WG_BM
#define WG_BM 128  // rows of x per block: the wgmma N (64, 128 or 256)
#endif
#ifndef WG_WGS
#define WG_WGS 2  // warpgroups per block, 64 WG_WT output columns each
#endif
#ifndef WG_WT
#define WG_WT 1  // 64-column tiles per warpgroup (wgmmas per k16 step)
#endif
#ifndef WG_STAGES
#define WG_STAGES 4
#endif
#ifndef WG_SPLITS
#define WG_SPLITS 1  // blocks per tile (grid y) splitting K: 1..8 (with WG_DSMEM, one cluster)
#endif
#ifndef WG_DSMEM
#define WG_DSMEM 0  // split-K partials summed over the cluster's shared memory (1) or through a global workspace (0)
#endif
#ifndef WG_SWIGLU
#define WG_SWIGLU 0  // 1: W's columns are interleaved (gate, up) pairs; out [M, N / 2] = silu(gate) * up
#endif
#ifndef WG_ASETS
#define WG_ASETS 2  // A-fragment register sets: k16 steps whose wgmmas may be in flight while the next is dequantized
#endif
#ifndef WG_TMA
#define WG_TMA 0  // 1: x stages copied by the tensor memory accelerator (one thread, tensor map tmap_x), not cp.async
#endif
#if WG_TMA
#include <cuda.h>  // CUtensorMap
#endif
#if WG_SPLITS > 1 && WG_DSMEM
#define WG_CLUSTER_DIMS __cluster_dims__(1, WG_SPLITS, 1)
#else
#define WG_CLUSTER_DIMS
#endif

namespace {
using namespace tritrt;
constexpr int kBits = WG_BITS;
constexpr int kBM = WG_BM, kWGs = WG_WGS, kWT = WG_WT, kStages = WG_STAGES, kSplits = WG_SPLITS, kASets = WG_ASETS;
constexpr bool kSwiglu = WG_SWIGLU;
constexpr int kThreads = 128 * kWGs;
constexpr int kBN = 64 * kWT * kWGs, kBK = 64;
constexpr int kXBytes = kBM * 128;                     // x tile, 128-byte swizzled rows
// The stage's weight slice: INT4 8 packed rows of BN int32, INT8 64 rows of BN bytes (pitch + 16: conflict-free
// ldmatrix). kColBytes: bytes per column of a global row.
constexpr int kColBytes = kBits == 4 ? 4 : 1;
constexpr int kWRows = kBits == 4 ? kBK / 8 : kBK, kWPitch = kBits == 4 ? kBN * 4 : kBN + 16;
constexpr int kWBytes = kWRows * kWPitch;
constexpr int kSBytes = kBits == 4 ? kBN * 2 : 0, kZBytes = kBits == 4 ? kBN : 0;  // INT4: one scale / zero row
static_assert(kBits == 4 || kBits == 8, "WG_BITS is 4 or 8");
using QWord = std::conditional_t<kBits == 4, int, int8_t>;  // qweight's element
constexpr int kStageBytes = (kXBytes + kWBytes + kSBytes + kZBytes + 1023) / 1024 * 1024;  // x stays 1024-aligned
static_assert(kBM == 64 || kBM == 128 || kBM == 256, "WG_BM must be 64, 128 or 256");
static_assert(kWT * kBM <= 256, "at most 128 fp32 accumulators per thread (WG_WT * WG_BM / 2)");
static_assert(kStages >= 3, "WG_STAGES >= 3 (prefetch distance STAGES - 2)");
static_assert(kSplits >= 1 && kSplits <= 8, "WG_SPLITS is 1..8 (with WG_DSMEM: the portable cluster size)");
static_assert(kASets == 2 || kASets == 4, "WG_ASETS is 2 or 4 (a stage's 4 k16 steps cycle through them)");
// One block barrier per pipeline stage instead of two (the refill issued after it), which leaves STAGES - 3 stages
// in flight at the wait instead of STAGES - 2. H100, every routed plan forced, one vs two barriers in one process
// (benchmarks/results/dev-logs/h100/wgmma_one_barrier.md): read off the five Llama-3-8B shapes at M = 24-768, 128-
// and 256-row blocks 1.023x (W4) / 1.016x (W8) geometric mean, 64-row blocks 1.000-1.002x; judged on 20 other
// shapes, 128 / 256 rows 1.022x / 1.017x (2 of 232 rows below 0.98x, 0.977x at worst), 64 rows 1.000-1.006x with
// INT8's two-warpgroup blocks split 14 slower / 15 faster. The 64-row blocks run short stages, where the deeper wait
// of two barriers is worth more than the barrier: they take one barrier only with a fifth stage, which restores the
// depth (the plans give it to INT8 64-row DSMEM-split blocks alone on their SMs, gemm_wgmma.py SOLO_STAGES).
constexpr bool kOneBarrier = kBM >= 128 || kStages >= 5;
// The split-K partial tile (fp32, rows padded by 4 floats against bank conflicts) reuses the stage buffers.
constexpr int kTileStride = kBN + 4;
static_assert(kSplits == 1 || !WG_DSMEM || kBM * kTileStride * 4 <= kStages * kStageBytes,
              "the fp32 partial tile must fit in the stage buffers (fewer columns per block or more stages)");

__device__ __forceinline__ void cp_async16(uint32_t smem, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem), "l"(gmem), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

// Shared-memory matrix descriptor of a K-major tile with 128-byte swizzle: rows of 128 bytes, 8-row groups 1024
// bytes apart (SBO), leading offset unused for swizzled K-major layouts (1 by convention).
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr) {
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) | ((uint64_t)1 << 62);
}

// WG_TMA: one mbarrier per stage buffer; thread 0 arms it with the x tile's bytes and the tensor copy completes it.
__device__ __forceinline__ uint32_t smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {  // until that phase has completed
  uint32_t done;
  do {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
  } while (!done);
}
// The [64 k, rows] box of x at (k, m) into shared memory (128-byte swizzle, rows past M zero-filled), completing bar.
__device__ __forceinline__ void tma_load_x(uint32_t dst, const void* tmap, int k, int m, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
      ::"r"(dst), "l"(tmap), "r"(k), "r"(m), "r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }

#define WG_D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
    "+f"(d[i + 6]), "+f"(d[i + 7])

// d[64 x BM] += A (registers, 64 x 16) * B (shared memory via desc, 16 x BM); fp32 accumulators.
__device__ __forceinline__ void wgmma_rs(float* d, const uint32_t a[4], uint64_t desc) {
  if constexpr (kBM == 64) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,"
        "%29,%30,%31}, {%32,%33,%34,%35}, %36, 1, 1, 1, 0;"
        : WG_D8(0), WG_D8(8), WG_D8(16), WG_D8(24)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
  } else if constexpr (kBM == 128) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,"
        "%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,"
        "%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, 1, 1, 1, 0;"
        : WG_D8(0), WG_D8(8), WG_D8(16), WG_D8(24), WG_D8(32), WG_D8(40), WG_D8(48), WG_D8(56)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
  } else {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,"
        "%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,"
        "%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,"
        "%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,"
        "%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,"
        "%127}, {%128,%129,%130,%131}, %132, 1, 1, 1, 0;"
        : WG_D8(0), WG_D8(8), WG_D8(16), WG_D8(24), WG_D8(32), WG_D8(40), WG_D8(48), WG_D8(56), WG_D8(64),
          WG_D8(72), WG_D8(80), WG_D8(88), WG_D8(96), WG_D8(104), WG_D8(112), WG_D8(120)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
  }
}
#undef WG_D8

// Keeps the compiler from moving accumulator reads/writes across the asynchronous wgmmas.
__device__ __forceinline__ void fence_acc(float* d) {
#pragma unroll
  for (int i = 0; i < kBM / 2; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// {q_lo - z, q_hi - z} * s of one byte (two nibbles) of `word`, byte chosen by `sel` (t | 4 << 4 | t << 8 | 4 << 12).
__device__ __forceinline__ uint32_t dequant_pair(uint32_t word, uint32_t sel, uint32_t zc, uint32_t s2) {
  const uint32_t y = prmt(word, 0u, sel);                        // [byte, 0, byte, 0]
  const uint32_t v = lop3_and_or(y, 0x00F0000Fu, 0x64006400u);  // {1024 + q_lo, 1024 + 16 q_hi}
  return hmul2_u(hfma2_u(v, 0x2C003C00u, zc), s2);               // ({1, 1/16} v - {1024 + z, 64 + z}) s
}

// Four 8x8 16-bit matrices from shared memory, transposed (lanes 8j .. 8j + 7 give matrix j's row addresses).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// {q0, q2} as half2 of the int8 bytes 0 and 2 of v, exactly: the sign bit flipped under exponent byte 0x64 is
// 1024 + 128 + q, then minus 1152.
__device__ __forceinline__ uint32_t i8_pair(uint32_t v) {
  return hsub2_u(lop3_and_xor(v, 0x00FF00FFu, 0x64806480u), 0x64806480u);
}
}  // namespace

// The torch launcher's entry, one name per weight format; INT8 ignores zeros and group_size.
#if WG_BITS == 8
#define WG_KERNEL w8a16_gemm_wgmma
#else
#define WG_KERNEL w4a16_gemm_wgmma
#endif
TRITRT_ENTRY(WG_CLUSTER_DIMS __launch_bounds__(128 * WG_WGS, 1))
WG_KERNEL(const half* __restrict__ x, const QWord* __restrict__ qweight, const half* __restrict__ scales,
                 const uint8_t* __restrict__ zeros, const half* __restrict__ bias, half* __restrict__ out,
                 float* __restrict__ workspace, int* __restrict__ counters, int M, int N, int K, int group_size,
                 int stride_xm, int has_zeros, int has_bias
#if WG_TMA
                 , const __grid_constant__ CUtensorMap tmap_x  // x [M, K] fp16, box [64, WG_BM], 128-byte swizzle
#endif
                 ) {
  extern __shared__ __align__(16) char smem_raw[];
  // Stage buffers start on a 1024-byte boundary (the 128-byte swizzle pattern repeats every 1024 bytes).
  const uint32_t smem0 = (static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw)) + 1023u) & ~1023u;
  char* const smem = smem_raw + (smem0 - static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw)));
  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;
  const int wg = warp >> 2, wi = warp & 3;
  const int g = lane >> 2, t = lane & 3;
  const int mtiles = (M + kBM - 1) / kBM;  // row tiles fastest: the blocks of one column tile run together
  const int m0 = (blockIdx.x % mtiles) * kBM;
  const int n0 = (blockIdx.x / mtiles) * kBN;
  const int ktiles = K / kBK;
  const int per = (ktiles + kSplits - 1) / kSplits;
  const int kb = blockIdx.y * per;
  const int nk = max(0, min(ktiles, kb + per) - kb);
  // This thread's A rows: columns n0 + nl + 64 wt and the next one, for each of the warpgroup's kWT tiles.
  const int nl = 64 * kWT * wg + 16 * wi + 2 * g;

  // Each thread's share of a stage's copies is the same every stage; stages are loaded in order kb, kb + 1, ..., so
  // its source pointers start at stage kb and advance by one stage per load (a 64-bit add each: no index math in the
  // loop; recomputing them from k cost 131 of the 266 SASS instructions of a bm = 128 stage). x: 16-byte chunk column
  // tid % 8 of rows tid / 8 + j (threads / 8); weight: 16-byte chunk tid % kWCols of its rows tid / kWCols + j
  // (threads / kWCols); INT4 scales (zeros): 16-byte chunk tid of the stage's group row, which moves on every
  // group_size / 64 stages.
  constexpr int kXPer = kBM * 8 / kThreads, kWCols = kBN * kColBytes / 16, kWPer = kWRows * kWCols / kThreads;
  static_assert(kBM * 8 % kThreads == 0 && kThreads % kWCols == 0 && kWRows * kWCols % kThreads == 0,
                "a stage's copies must split evenly over the block");
  const char* xsrc[kXPer];
  uint32_t xdst[kXPer];
  bool xok[kXPer];
#pragma unroll
  for (int j = 0; j < kXPer; ++j) {
    const int r = (tid >> 3) + j * (kThreads / 8), c = tid & 7;
    xok[j] = m0 + r < M;  // rows past M are zeros (a 0-byte copy from row 0)
    xsrc[j] = reinterpret_cast<const char*>(x + (size_t)(xok[j] ? m0 + r : 0) * stride_xm + 8 * c + kb * kBK);
    xdst[j] = r * 128 + ((c ^ (r & 7)) << 4);
  }
  const char* wsrc[kWPer];
  uint32_t wdst[kWPer];
#pragma unroll
  for (int j = 0; j < kWPer; ++j) {
    const int r = tid / kWCols + j * (kThreads / kWCols), c = tid % kWCols;
    wsrc[j] = reinterpret_cast<const char*>(qweight + (size_t)(kb * kWRows + r) * N + n0) + 16 * c;
    wdst[j] = r * kWPitch + 16 * c;
  }
  const size_t w_step = (size_t)kWRows * N * kColBytes;  // bytes of weight per stage
  const int gstages = kBits == 4 ? group_size / kBK : 1;  // INT4: stages per scale group (group_size % 64 == 0)
  int gleft = gstages - kb % gstages;               // stages left in the current group, this one included
  const size_t grow = (size_t)(kb / gstages) * N + n0;
  const half* ssrc = scales + grow + 8 * tid;
  const uint8_t* zsrc = zeros + grow + 16 * tid;

#if WG_TMA
  // x by the tensor memory accelerator: thread 0 arms buffer b's barrier with the tile's bytes and issues one copy;
  // stage i (of this block's run) is buffer i % STAGES in phase i / STAGES. The weights stay cp.async copies.
  static_assert(kBM <= 256 && kOneBarrier, "WG_TMA: one box of at most 256 rows; one block barrier per stage");
  __shared__ __align__(8) uint64_t xbar[kStages];
  if (tid == 0) {
    for (int b = 0; b < kStages; ++b) mbar_init(xbar + b, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");  // visible to the async proxy
  }
  __syncthreads();
  int xk = kb * kBK;  // k of the next x tile to load
#endif
  // A stage's copies in two parts: x (written by the previous kernel) and the weight with its INT4 scales / zeros,
  // which the prologue issues before the PDL wait. So weights must not be written by a kernel that lets its
  // dependents start early (kernels._launch's PDL kernels -- norms, RoPE, KV writes, activations, attention, the
  // GEMVs -- write activations only); a kernel that never triggers its dependents lets them start only after all its
  // blocks have exited, and these copies read through L2 (cp.async.cg).
  auto load_x_stage = [&](int buf) {
    const uint32_t xs = smem0 + buf * kStageBytes;
#if WG_TMA
    if (tid == 0) {
      mbar_expect_tx(xbar + buf, kXBytes);
      tma_load_x(xs, &tmap_x, xk, m0, xbar + buf);
    }
    xk += kBK;
#else
#pragma unroll
    for (int j = 0; j < kXPer; ++j) {
      cp_async16(xs + xdst[j], xsrc[j], xok[j]);
      xsrc[j] += kBK * 2;
    }
#endif
  };
  auto load_w_stage = [&](int buf) {
    const uint32_t ws = smem0 + buf * kStageBytes + kXBytes, ss = ws + kWBytes, zs = ss + kSBytes;
#pragma unroll
    for (int j = 0; j < kWPer; ++j) {
      cp_async16(ws + wdst[j], wsrc[j], true);
      wsrc[j] += w_step;
    }
    if constexpr (kBits == 4) {
      if (tid < kSBytes / 16) cp_async16(ss + 16 * tid, ssrc, true);
      if (has_zeros && tid < kZBytes / 16) cp_async16(zs + 16 * tid, zsrc, true);
      if (--gleft == 0) {
        gleft = gstages;
        ssrc += N;
        zsrc += N;
      }
    }
  };

  float d[kWT][kBM / 2];
#pragma unroll
  for (int wt = 0; wt < kWT; ++wt)
#pragma unroll
    for (int i = 0; i < kBM / 2; ++i) d[wt][i] = 0.f;

  const uint32_t sel = t | (4u << 4) | (t << 8) | (4u << 12);  // INT4: byte t of a packed row, in both halves
  // A fragments [k16 step % ASETS][tile][register]: a step's A stays intact while its wgmmas are in flight (up to
  // ASETS - 1 step groups may be outstanding while the next step is dequantized).
  uint32_t a[kASets][kWT][4];

  // The wgmmas of the stage's k16 step j (A in set j % ASETS), committed as one group; then wait until step
  // j - ASETS + 1 is complete: its A registers are free for the next step.
  auto issue_step = [&](uint32_t xs, int j) {
    wgmma_fence();
#pragma unroll
    for (int wt = 0; wt < kWT; ++wt) {
      fence_acc(d[wt]);
      wgmma_rs(d[wt], a[j % kASets][wt], sw128_desc(xs + 32 * j));
      fence_acc(d[wt]);
    }
    wgmma_commit();
    wgmma_wait<kASets - 1>();
  };

  auto compute_stage = [&](int buf) {
    const uint32_t xs = smem0 + buf * kStageBytes;
    if constexpr (kBits == 4) {
      const char* ws = smem + buf * kStageBytes + kXBytes;
      const char* ss = ws + kWBytes;
      const char* zs = ss + kSBytes;
      uint32_t slo[kWT], shi[kWT], zc0[kWT], zc1[kWT];
#pragma unroll
      for (int wt = 0; wt < kWT; ++wt) {
        const int c = nl + 64 * wt;
        const uint32_t sp = *reinterpret_cast<const uint32_t*>(ss + 2 * c);  // scales of the two rows
        slo[wt] = prmt(sp, 0u, 0x1010u);
        shi[wt] = prmt(sp, 0u, 0x3232u);
        zc0[wt] = zc1[wt] = 0xD480E408u;  // z = 8: {-(1024 + 8), -(64 + 8)}
        if (has_zeros) {
          const uint32_t z0 = (uint8_t)zs[c], z1 = (uint8_t)zs[c + 1];
          zc0[wt] = (0xE400u + z0) | ((0xD400u + (z0 << 4)) << 16);
          zc1[wt] = (0xE400u + z1) | ((0xD400u + (z1 << 4)) << 16);
        }
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // 32-k halves of the stage
        uint2 w[kWT][4];
#pragma unroll
        for (int wt = 0; wt < kWT; ++wt)
#pragma unroll
          for (int p = 0; p < 4; ++p)
            w[wt][p] = *reinterpret_cast<const uint2*>(ws + (4 * h + p) * kBN * 4 + 4 * (nl + 64 * wt));
#pragma unroll
        for (int s = 0; s < 2; ++s) {  // k16 step j = 2h + s of the stage
#pragma unroll
          for (int wt = 0; wt < kWT; ++wt) {
            uint32_t* f = a[(2 * h + s) % kASets][wt];
            f[0] = dequant_pair(w[wt][2 * s].x, sel, zc0[wt], slo[wt]);      // row g,     k 2t, 2t+1
            f[1] = dequant_pair(w[wt][2 * s].y, sel, zc1[wt], shi[wt]);      // row g + 8, k 2t, 2t+1
            f[2] = dequant_pair(w[wt][2 * s + 1].x, sel, zc0[wt], slo[wt]);  // row g,     k 2t+8, 2t+9
            f[3] = dequant_pair(w[wt][2 * s + 1].y, sel, zc1[wt], shi[wt]);  // row g + 8, k 2t+8, 2t+9
          }
          issue_step(xs, 2 * h + s);
        }
      }
    } else {
      // INT8: one ldmatrix.x4.trans per tile and 32-k half: lane L addresses k row 32 h + L (quarter L / 8) at the
      // warp's 16 columns; q[wt][i] holds quarter i's rows 2t, 2t + 1 of column pair g.
      const uint32_t wsa = xs + kXBytes;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        uint32_t q[kWT][4];
#pragma unroll
        for (int wt = 0; wt < kWT; ++wt)
          ldmatrix_x4_trans(q[wt], wsa + (32 * h + lane) * kWPitch + (nl - 2 * g) + 64 * wt);
#pragma unroll
        for (int s = 0; s < 2; ++s) {  // k16 step j = 2h + s of the stage
#pragma unroll
          for (int wt = 0; wt < kWT; ++wt) {
            uint32_t* f = a[(2 * h + s) % kASets][wt];
            f[0] = i8_pair(q[wt][2 * s]);           // row g,     k 2t, 2t+1
            f[1] = i8_pair(q[wt][2 * s] >> 8);      // row g + 8, k 2t, 2t+1
            f[2] = i8_pair(q[wt][2 * s + 1]);       // row g,     k 2t+8, 2t+9
            f[3] = i8_pair(q[wt][2 * s + 1] >> 8);  // row g + 8, k 2t+8, 2t+9
          }
          issue_step(xs, 2 * h + s);
        }
      }
    }
  };

  // Prologue: stages kb .. kb + STAGES - 3 in flight; one commit group per stage (empty ones past the end keep the
  // wait_group counts uniform). Their weights are issued first, before the PDL wait (pdl_enter: launched as a
  // programmatic dependent, this block may start while the previous kernel finishes; x, the output, the workspace and
  // the counters are touched only after the wait), so they stream in during the previous kernel's tail; they join
  // the first stage's commit group, so waiting for a stage still waits for its weights.
#pragma unroll
  for (int s = 0; s < kStages - 2; ++s)
    if (s < nk) load_w_stage(s);
  pdl_enter();
#pragma unroll
  for (int s = 0; s < kStages - 2; ++s) {
    if (s < nk) load_x_stage(s);
    cp_async_commit();
  }
  // Stage i + STAGES - 2 into the buffer of stage i - 2, whose wgmmas are complete in every warpgroup once all of them
  // are past compute_stage(i - 1) (it leaves at most ASETS - 1 <= 3 steps in flight, all of stage i - 1); one commit
  // group per iteration, empty past the end.
  auto refill = [&](int i) {
    if (i + kStages - 2 < nk) {
      load_x_stage((i + kStages - 2) % kStages);
      load_w_stage((i + kStages - 2) % kStages);
    }
    cp_async_commit();
  };
  for (int i = 0; i < nk; ++i) {
    if constexpr (!kOneBarrier) refill(i);  // every warpgroup passed the barrier after compute_stage(i - 1)
    cp_async_wait<kOneBarrier ? kStages - 3 : kStages - 2>();  // stage i has landed (this thread's copies)
    __syncthreads();  // ... everyone's (one barrier: and every warpgroup is past compute_stage(i - 1))
#if WG_TMA
    mbar_wait(xbar + i % kStages, (i / kStages) & 1);  // x by the tensor copy (async proxy, as the wgmmas read it)
#else
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // cp.async writes -> visible to the tensor cores
#endif
    if constexpr (kOneBarrier) refill(i);
    compute_stage(i % kStages);
    if constexpr (!kOneBarrier) __syncthreads();  // every warpgroup is past compute_stage(i) before the next refill
  }
  wgmma_wait<0>();
#pragma unroll
  for (int wt = 0; wt < kWT; ++wt) fence_acc(d[wt]);
  cp_async_wait<0>();

  // d[4 i + e]: A row g (column n0 + nl) and d[4 i + 2 + e]: row g + 8 (column n0 + nl + 1), both for x row
  // m0 + 8 i + 2 t + e.
#if WG_SPLITS == 1
#pragma unroll
  for (int wt = 0; wt < kWT; ++wt) {
    const int col = n0 + nl + 64 * wt;
    const float b0 = has_bias ? __half2float(bias[col]) : 0.f, b1 = has_bias ? __half2float(bias[col + 1]) : 0.f;
    // INT8: the columns' scales (INT4 sums are already scaled)
    const float s0 = kBits == 8 ? __half2float(scales[col]) : 1.f, s1 = kBits == 8 ? __half2float(scales[col + 1]) : 1.f;
#pragma unroll
    for (int i = 0; i < kBM / 8; ++i)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int row = m0 + 8 * i + 2 * t + e;
        if (row >= M) continue;
        const float y0 = d[wt][4 * i + e] * s0 + b0, y1 = d[wt][4 * i + 2 + e] * s1 + b1;
        if (kSwiglu)  // (gate, up) = columns (col, col + 1) -> out [M, N / 2] column col / 2
          out[(size_t)row * (N / 2) + col / 2] = __float2half_rn(silu_mul(y0, y1));
        else
          *reinterpret_cast<half2*>(out + (size_t)row * N + col) = __floats2half2_rn(y0, y1);
      }
  }
#else
  // Split-K. One quad (4 adjacent columns) of a tile's sum: + bias, to fp16 (with SwiGLU: 2 outputs), stored.
  auto store_quad = [&](int row, int col, float4 sum) {
    if constexpr (kBits == 8) {  // the columns' scales (INT4 sums are already scaled)
      const uint2 ss = *reinterpret_cast<const uint2*>(scales + col);
      const float2 s01 = __half22float2(*reinterpret_cast<const half2*>(&ss.x));
      const float2 s23 = __half22float2(*reinterpret_cast<const half2*>(&ss.y));
      sum.x *= s01.x;
      sum.y *= s01.y;
      sum.z *= s23.x;
      sum.w *= s23.y;
    }
    if (has_bias) {
      const uint2 bb = *reinterpret_cast<const uint2*>(bias + col);
      const float2 b01 = __half22float2(*reinterpret_cast<const half2*>(&bb.x));
      const float2 b23 = __half22float2(*reinterpret_cast<const half2*>(&bb.y));
      sum.x += b01.x;
      sum.y += b01.y;
      sum.z += b23.x;
      sum.w += b23.y;
    }
    if (kSwiglu) {
      *reinterpret_cast<half2*>(out + (size_t)row * (N / 2) + col / 2) =
          __floats2half2_rn(silu_mul(sum.x, sum.y), silu_mul(sum.z, sum.w));
      return;
    }
    const half2 lo = __floats2half2_rn(sum.x, sum.y), hi = __floats2half2_rn(sum.z, sum.w);
    uint2 o;
    o.x = *reinterpret_cast<const uint32_t*>(&lo);
    o.y = *reinterpret_cast<const uint32_t*>(&hi);
    *reinterpret_cast<uint2*>(out + (size_t)row * N + col) = o;
  };
  auto add4 = [](float4& a, const float4& b) {
    a.x += b.x;
    a.y += b.y;
    a.z += b.z;
    a.w += b.w;
  };
#if WG_DSMEM
  // This block's partial tile -> its shared memory (every warp is past its last read of the stage buffers, and all
  // copies and wgmmas are complete) -> cluster barrier -> block r sums its rows of every block's tile over DSMEM in
  // rank order -> cluster barrier (no block exits while others still read its shared memory).
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  float* tile = reinterpret_cast<float*>(smem);
  __syncthreads();
#pragma unroll
  for (int wt = 0; wt < kWT; ++wt)
#pragma unroll
    for (int i = 0; i < kBM / 8; ++i)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        *reinterpret_cast<float2*>(tile + (8 * i + 2 * t + e) * kTileStride + nl + 64 * wt) =
            make_float2(d[wt][4 * i + e], d[wt][4 * i + 2 + e]);
  cluster.sync();
  constexpr int kRowsPer = (kBM + kSplits - 1) / kSplits, kQuadsPerRow = kBN / 4;
  const int r0 = (int)cluster.block_rank() * kRowsPer;
  const int rows = max(0, min(kRowsPer, min(kBM, M - m0) - r0));  // this block's rows that exist
  for (int q = tid; q < rows * kQuadsPerRow; q += kThreads) {
    const int r = r0 + q / kQuadsPerRow, c = 4 * (q % kQuadsPerRow);
    float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int b = 0; b < kSplits; ++b)
      add4(sum, *cluster.map_shared_rank(reinterpret_cast<float4*>(tile + r * kTileStride + c), b));
    store_quad(m0 + r, n0 + c, sum);
  }
  cluster.sync();
#else
  // Partials -> workspace; the last block of the tile to arrive sums them.
  __shared__ int is_last;
  float* part = workspace + (size_t)blockIdx.y * M * N;
#pragma unroll
  for (int wt = 0; wt < kWT; ++wt)
#pragma unroll
    for (int i = 0; i < kBM / 8; ++i)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int row = m0 + 8 * i + 2 * t + e;
        if (row < M)
          __stcg(reinterpret_cast<float2*>(part + (size_t)row * N + n0 + nl + 64 * wt),
                 make_float2(d[wt][4 * i + e], d[wt][4 * i + 2 + e]));
      }
  __threadfence();  // this block's partials are visible device-wide before it is counted
  __syncthreads();
  if (tid == 0) {
    const int arrived = atomicAdd(counters + blockIdx.x, 1) + 1;
    is_last = arrived == kSplits;
    if (is_last) counters[blockIdx.x] = 0;  // every split has arrived: ready for the next launch
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  // float4s of 4 adjacent columns, kU of them per thread in flight at once (the loads, not the adds, are the cost:
  // one block reads splits x kBM x kBN floats through its SM).
  constexpr int kU = 4, kQuads = kBM * kBN / 4;
  static_assert(kQuads % (kThreads * kU) == 0, "tile quads must split evenly over the block");
  for (int q0 = tid; q0 < kQuads; q0 += kThreads * kU) {
    float4 sum[kU];
    int row[kU], c[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int q = q0 + u * kThreads;
      row[u] = m0 + q / (kBN / 4);
      c[u] = n0 + 4 * (q % (kBN / 4));
      sum[u] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    for (int b = 0; b < kSplits; ++b) {  // split order: the same sum whichever block arrives last
      float4 v[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u)
        v[u] = row[u] < M ? __ldcg(reinterpret_cast<const float4*>(workspace + ((size_t)b * M + row[u]) * N + c[u]))
                          : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int u = 0; u < kU; ++u) add4(sum[u], v[u]);
    }
#pragma unroll
    for (int u = 0; u < kU; ++u)
      if (row[u] < M) store_quad(row[u], c[u], sum[u]);
  }
#endif
#endif
}

#ifdef TRITRT_PLUGIN_ENTRY
// TensorRT plugin entries (W4A16Linear / W8A16Linear, trt_plugins/specs/linear.py). TensorRT's AOT plugins pass the
// inputs, the int32 extra args, then the outputs: W4 (x, qweight, scales, zeros, M, N, K, unused, y), W8 (x, qweight,
// scales, M, N, K, unused, y); the unused int is the Triton entry's output row stride. The kernel above runs with
// what a plugin has: W4 with zero points and the group size baked in (TRITRT_GROUP_SIZE), no bias, x rows of K
// halves, SwiGLU as built (WG_SWIGLU; y [M, N / 2] with it), and no workspace: a plugin has no zeroed counters that
// persist from launch to launch, so only variants that do not sum their K splits through the workspace (no split, or
// the DSMEM sum) have this entry.
static_assert(kSplits == 1 || WG_DSMEM, "the plugin entry has no workspace: split K over DSMEM (WG_DSMEM 1) or not");
static_assert(!WG_TMA, "the plugin entry has no tensor map for x (TensorRT passes pointers): build it with WG_TMA 0");
#if WG_BITS == 4
#ifndef TRITRT_GROUP_SIZE
#error "the W4 plugin entry needs -DTRITRT_GROUP_SIZE=<group size>"
#endif
extern "C" __global__ void WG_CLUSTER_DIMS __launch_bounds__(128 * WG_WGS, 1)
tritrt_w4a16_gemm_wgmma(const half* __restrict__ x, const int* __restrict__ qweight, const half* __restrict__ scales,
                        const uint8_t* __restrict__ zeros, int M, int N, int K, int /*unused*/,
                        half* __restrict__ y) {
  w4a16_gemm_wgmma(x, qweight, scales, zeros, scales, y, nullptr, nullptr, M, N, K, TRITRT_GROUP_SIZE, K, 1, 0);
}
#else
extern "C" __global__ void WG_CLUSTER_DIMS __launch_bounds__(128 * WG_WGS, 1)
tritrt_w8a16_gemm_wgmma(const half* __restrict__ x, const int8_t* __restrict__ qweight,
                        const half* __restrict__ scales, int M, int N, int K, int /*unused*/, half* __restrict__ y) {
  w8a16_gemm_wgmma(x, qweight, scales, nullptr, scales, y, nullptr, nullptr, M, N, K, 0, K, 0, 0);
}
#endif
#endif  // TRITRT_PLUGIN_ENTRY

// W4A8 grouped GEMM for sm_90a: NVFP4 weights decoded to e4m3 in registers, fp8 activations with
// one float32 scale per row and 128 columns of K (lab/w4a8.py is the definition; its `gemm` is
// the contract this kernel computes):
//
//   out[r, n] = 2^p[e] * alpha[e] * sum_g s_x[r, g] * sum_{k in g} x8[r, k] * w8[e, n, k]
//               for offsets[e] <= r < offsets[e+1]
//
// Operand swap, as in the fp16 GEMM: weight rows are wgmma's M (64, A from registers, where the
// decode puts them) and tokens its N (T = 8, 16, 32, 64 or 128, the template argument), so that an
// expert with a few tokens wastes columns of an 8-wide N, not rows of a 64-row tile.
//
// Grid (N/64, token blocks, E): CTA (b, y, e) computes weight rows 64b..64b+63 of expert e
// against the expert's token blocks y, y + gridDim.y, ... (T tokens each), so any grid height
// covers every token; CTAs of empty experts or of blocks past the count return at once. One
// warpgroup (128 threads) per CTA, no warp specialization; w4a8_gemm_wide is the same with two
// warpgroups (grid N/128: CTA b's warpgroup w takes rows 64 (2b + w) .. + 63) over one activation
// tile. Below, w is the warp within its warpgroup.
//
// K permutation: inside each k32 step the tensor core's k = kappa multiplies logical k
// sigma(kappa), sigma(4m + i) = 8m + i for m < 4 and 8(m - 4) + 4 + i for m >= 4, in both operands
// (the sum does not care which logical k sits where, as long as A and B agree). So lane c's
// fragment below holds logical k 8c .. 8c+7, one 16-block of a row, one table row to decode.
//
// What thread (warp w, lane l; g = l / 4, c = l % 4) owns, per the PTX ISA's fragments of
// wgmma m64nNk32 with 8-bit A (k the tensor core's):
//   A (weights), one k32 step: four b32 registers of four e4m3 bytes, low byte first:
//       a0 = row 16w + g,     k = 4c .. 4c+3        a2 = row 16w + g,     k = 16 + 4c .. 16 + 4c+3
//       a1 = row 16w + g + 8, k = 4c .. 4c+3        a3 = row 16w + g + 8, k = 16 + 4c .. 16 + 4c+3
//   (logical k 8c .. 8c+3 in a0 / a1 and 8c+4 .. 8c+7 in a2 / a3)
//   D (fp32 accumulators), j = 0 .. T/8 - 1:
//       d[j][0] = (row 16w + g, token 8j + 2c)      d[j][1] = (row 16w + g, token 8j + 2c + 1)
//       d[j][2] = (row 16w + g + 8, token 8j + 2c)  d[j][3] = (row 16w + g + 8, token 8j + 2c + 1)
//
// Prepared weights (lab/kernels/w4a8_gemm.py prepare_w4a8_weights):
//   words  (E, N/64, K/32, 128) uint2: thread t = 32w + l's two words of step s, .x for row
//          16w + g, .y for row 16w + g + 8: word c of a row's step is its codes for logical k
//          8c .. 8c+7 in their natural order (decode_words' layout, lab/w4a8.py), the eight elements
//          of a0 and a2 (or a1 and a3), all in 16-block 2s + c / 2: one table row decodes them
//          (decode_fp8_word). One step is 1 KiB, read coalesced.
//   scales (E, N/64, ceil(K/128), 64, 8) uint8: the e4m3 block scales of the 64 rows for one
//          128-column group (8 blocks; zero past K), 8 bytes per row: a thread reads one uint2 for
//          row 16w + g and one for row 16w + g + 8 per group.
//   tables (P, 128) uint2: lab/w4a8.py magnitude_table(p) for each distinct p; table_of[e] picks
//          expert e's, which the CTA copies into shared memory (1 KiB).
//
// Activations: x8 (rows, K) uint8 e4m3 row-major, s_x (rows, ceil(K/128)) float32. Per 128-column
// group the CTA copies its T tokens' bytes into shared memory with cp.async, in the same ring
// stage as the group's weights (STAGES deep: groups g+1 .. g+STAGES-1 are in flight while group g
// multiplies), zero-filled for tokens past the expert's count, so no row of another expert is
// read. The weights' words and block scales go to shared memory unchanged and are decoded from
// there, each thread reading its own 8 bytes per step (consecutive threads, consecutive words). Shared layout of one group: wgmma's K-major B
// without swizzle, in core matrices of 8 tokens x 16 bytes (rows 16 bytes apart, 128 bytes each):
//   byte (s * T * 32) + (j / 8) * 256 + h * 128 + (j % 8) * 16 + q   holds token j, tensor-core
//   k = 16h + q of step s, which is logical k 32s + sigma(16h + q): its 4-byte chunk q / 4 of half
//   h is logical chunk 2 (q / 4) + h of the step, copied 4 bytes at a time (GroupLoader)
// so one step's descriptor has start = its first byte, LBO = 128 (the next core matrix along K)
// and SBO = 256 (the next 8 tokens), the fp16 GEMM's no-swizzle convention on 16-byte rows.
//
// Promotion: fp8 wgmma adds up a k32 step with fewer mantissa bits than fp32, so each group's
// steps go into a temporary accumulator (the first step with scale-d = 0 replaces it) and, once
// they retire, acc += tmp * s_x[token, g] in fp32. The epilogue writes acc * alpha[e] * 2^p[e]
// for the tokens below the count only. PROMOTE = false is the form without promotion, kept for
// the accuracy study only (scripts/w4a8_promotion_study.py): every step of every group goes into
// the one wgmma accumulator and the epilogue applies s_x[token, 0], so it computes the contract
// only where each row has one scale (all its groups' s_x equal; the launcher checks). K must be a multiple of 64 (lab/problem.py): a last
// group of 64 columns is two steps of data and two of zeros.
#include "gemm/ptx.cuh"
#include "gemm/wgmma.cuh"
#include "gemm/decode_fp8.cuh"
#include "w4a8_act.cuh"
#include "nvfp4_act.cuh"

namespace lab_w4a8 {

using lab_gemm::uint32_t;
using lab_gemm::uint64_t;
using lab_gemm::uint8_t;
using lab_gemm::size_t;
using lab_w4a8_act::uint16_t;

constexpr int THREADS = 128;   // one warpgroup
constexpr int ROWS = 64;       // weight rows per CTA: wgmma's M
constexpr int GROUP_K = 128;   // columns of K per activation scale
constexpr int STEP_K = 32;     // K of one fp8 wgmma
constexpr int STEPS = GROUP_K / STEP_K;

// wgmma m64n(8F)k32, f32 (+)= e4m3 x e4m3, A from registers, B (K-major, no swizzle) by
// descriptor. accumulate = 0 sets scale-d false: d = A * B, the old d ignored.
template <int F> struct WgmmaE4M3;
template <> struct WgmmaE4M3<1> {
  static __device__ __forceinline__ void run(float (&d)[1][4], const uint32_t (&a)[4], uint64_t desc, int accumulate) {
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %9, 0;\n wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1;\n}\n"
                 : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate));
  }
};
template <> struct WgmmaE4M3<2> {
  static __device__ __forceinline__ void run(float (&d)[2][4], const uint32_t (&a)[4], uint64_t desc, int accumulate) {
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %13, 0;\n wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1;\n}\n"
                 : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate));
  }
};
template <> struct WgmmaE4M3<4> {
  static __device__ __forceinline__ void run(float (&d)[4][4], const uint32_t (&a)[4], uint64_t desc, int accumulate) {
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %21, 0;\n wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1;\n}\n"
                 : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate));
  }
};
template <> struct WgmmaE4M3<8> {
  static __device__ __forceinline__ void run(float (&d)[8][4], const uint32_t (&a)[4], uint64_t desc, int accumulate) {
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %37, 0;\n wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
                 : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate));
  }
};

template <> struct WgmmaE4M3<16> {
  static __device__ __forceinline__ void run(float (&d)[16][4], const uint32_t (&a)[4], uint64_t desc, int accumulate) {
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %69, 0;\n wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
                 : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate));
  }
};

// 16 bytes global -> shared, or 16 zero bytes when !valid (src-size 0 reads nothing).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// One stage of the ring: a 128-column group's weights for each of the CTA's W warpgroups
// (STEPS x 1 KiB of words each, then each one's 64 rows' 8 block scales) and its T tokens'
// activation bytes (the header's core-matrix layout) and scales, which the W warpgroups share.
// 128-byte aligned, so every stage's activations are where a descriptor may point.
template <int T, int W = 1>
struct __align__(128) Stage {
  uint2 ws[W * STEPS * THREADS];
  uint2 scs[W * ROWS];
  uint8_t xs[STEPS * T * 32];
  float sx[T];
  // byte offsets of the members, for the cp.async destinations (shared addresses)
  static constexpr uint32_t WS = 0, SCS = W * STEPS * THREADS * 8, XS = SCS + W * ROWS * 8, SX = XS + STEPS * T * 32;
};

// What one thread copies of each group of a token block, its addresses worked out once per block
// (a group's are these plus gi times a constant): 4-byte activation chunks, one per lane of one core
// matrix per copy (below), its tokens' scale when tid < T,
// two 16-byte pieces of its warpgroup's 4 KiB of weights, and a piece of that warpgroup's 512
// bytes of block scales when its index in the warpgroup is below 32 (wp, sp: the warpgroup's). Tokens past `valid` are zeros (codes 0, scale 0), and so are activation pieces and
// weight steps past K in a 64-column last group (code-0 words decode to zero whatever the table;
// the prepared scales are zero there too).
//
// The activations are stored K-permuted (the header's sigma): a group's T x 4 x 2 core matrices (8
// tokens x 16 bytes: token octet o, step s, half h) are copied one per warp and copy, lane l taking
// token 8o + l / 4 and the core matrix's 4-byte chunk q = l % 4, which is logical chunk 2q + h of
// the step: 32 banks a warp on the shared side, 16 of each 32 bytes of a token's row on the global
// side (the other 16 are the other half's, from L1). Core matrix cm = warp + NW r (NW warps a CTA)
// is h = cm % 2, s = cm / 2 % 4, o = cm / 8.
template <int T, int W = 1>
struct GroupLoader {
  static constexpr int CTA_THREADS = W * THREADS;
  static constexpr int NW = CTA_THREADS / 32;     // warps: 4 or 8
  static constexpr int XP = T / NW;  // core matrices a warp copies per group (a group has T)
  static_assert(T % NW == 0 && (NW == 4 || NW == 8), "whole core matrices a warp");
  static constexpr int OCT = T / 8;     // token octets of a tile
  static constexpr bool KEEP = OCT <= 4;  // the octets' row offsets kept in registers (else worked out a copy)
  const uint8_t* x_blk;   // the block's first row of x8, at the thread's column of step 0 (group 0)
  uint32_t x_off[KEEP ? OCT : 1];  // octet o's offset from x_blk: its token's row, or row 0 for a token
                                   // past `valid` (a readable byte: the copy reads nothing then)
  uint32_t x_jk, x_k8;    // (!KEEP) its token's row in octet 0, and 8 rows
  uint32_t x_in;          // bit o: octet o's token is below `valid`
  uint32_t x_dst;         // copy 0's offset in a stage
  int x_col;              // copy 0's column within its group
  const float* sx_src;    // group 0's scale of token tid (any scale when !sx_ok)
  bool sx_ok;
  const uint8_t* w_src;   // the CTA's words and scales, this thread's piece, group 0
  const uint8_t* sc_src;
  int tid;

  __device__ __forceinline__ GroupLoader(const uint8_t* x8, const float* s_x, const uint2* wp, const uint8_t* sp,
                                         size_t row0, int valid, int K, int G, int tid_)
      : tid(tid_) {
    const int cm = tid >> 5, l = tid & 31;  // copy 0's core matrix (h = cm % 2, s = cm / 2 % 4, o = 0)
    const int h = cm & 1, s = (cm >> 1) & 3, jj = l >> 2, q = l & 3;
    x_col = s * STEP_K + (2 * q + h) * 4;
    x_blk = x8 + row0 * (size_t)K + x_col;
    x_jk = (uint32_t)(jj * K);
    x_k8 = (uint32_t)(8 * K);
    x_in = 0;
#pragma unroll
    for (int o = 0; o < OCT; ++o) {
      x_in |= (jj + 8 * o < valid ? 1u : 0u) << o;
      if constexpr (KEEP) x_off[o] = jj + 8 * o < valid ? x_jk + o * x_k8 : 0u;
    }
    x_dst = Stage<T, W>::XS + s * (T * 32) + h * 128 + jj * 16 + q * 4;
    sx_ok = tid < valid;
    sx_src = s_x + (sx_ok ? (row0 + tid) * (size_t)G : 0);
    w_src = reinterpret_cast<const uint8_t*>(wp) + wt() * 16;
    sc_src = sp + wt() * 16;
  }

  // the thread's warpgroup, and its index in it
  __device__ __forceinline__ int wg() const { return W == 1 ? 0 : tid / THREADS; }
  __device__ __forceinline__ int wt() const { return W == 1 ? tid : tid % THREADS; }

  __device__ __forceinline__ void load(uint32_t stage, int gi, int K) const {
    // Every group has 128 columns of K but a last one of 64 (K % 128 == 64), whose copies past
    // them read nothing (from 64 columns back, a readable byte) and leave zeros: activation
    // chunks at column 64 and up, and weight steps 2, 3. With four warps a copy's column is
    // below 64 at even r and 64 up at odd r; with eight, x_col's for all its copies.
    const bool full = K - gi * GROUP_K > GROUP_K / 2;
    const uint8_t* xg = x_blk + gi * GROUP_K;
    const bool lo_in = NW == 4 || full || x_col < GROUP_K / 2;  // the copies at ds = 0
    const uint8_t* x_lo = lo_in ? xg : xg - GROUP_K / 2;
    const uint8_t* x_hi = xg + (full ? GROUP_K / 2 : 0);           // (NW = 4) those at ds = 2
#pragma unroll
    for (int r = 0; r < XP; ++r) {
      // copy r: core matrix tid / 32 + NW r; with NW = 4 its step advances by 2 (r odd) and its
      // octet by r / 2, with NW = 8 its octet by r
      const int ds = NW == 4 ? 2 * (r & 1) : 0, o = NW == 4 ? r >> 1 : r;
      const bool in_t = (x_in >> o) & 1u;
      const uint32_t off = KEEP ? x_off[KEEP ? o : 0] : in_t ? x_jk + o * x_k8 : 0u;
      cp_async4(stage + x_dst + ds * (T * 32) + o * 256, (ds ? x_hi : x_lo) + off, (ds ? full : lo_in) && in_t);
    }
    if (tid < T) cp_async4(stage + Stage<T, W>::SX + tid * 4, sx_src + (sx_ok ? gi : 0), sx_ok);
    const uint8_t* wg_src = w_src + (size_t)gi * (STEPS * THREADS * 8);
    const uint32_t wdst = stage + Stage<T, W>::WS + wg() * (STEPS * THREADS * 8) + wt() * 16;
    cp_async16(wdst, wg_src, true);
    cp_async16(wdst + 2048, wg_src + (full ? 2048 : 0), full);
    if (wt() < ROWS * 8 / 16)
      cp_async16(stage + Stage<T, W>::SCS + wg() * (ROWS * 8) + wt() * 16, sc_src + (size_t)gi * (ROWS * 8), true);
  }
};

// Where a token block's results go once its groups are summed: Epilogue::store<PROMOTE>(acc, tmp,
// factor, row0, valid, b, warp, g, c, e, G, s_x), called by every thread with its accumulators
// (acc the promoted sum; tmp the last group's temporary or, unpromoted, the whole sum).
template <int T>
struct StoreOut {  // out[r, n] = the sum times alpha 2^p, fp32: the contract's output
  float* __restrict__ out;
  int N;
  template <bool PROMOTE>
  __device__ __forceinline__ void store(const float (&acc)[T / 8][4], const float (&tmp)[T / 8][4], float factor,
                                        size_t row0, int valid, int b, int warp, int g, int c, int, int G,
                                        const float* __restrict__ s_x) {
    float* o = out + row0 * (size_t)N + b * ROWS + 16 * warp + g;
#pragma unroll
    for (int j = 0; j < T / 8; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int col = 8 * j + 2 * c + (i & 1);
        if (col < valid)
          o[(size_t)col * N + 8 * (i >> 1)] = (PROMOTE ? acc[j][i] : tmp[j][i] * s_x[(row0 + col) * G]) * factor;
      }
  }
};

// out[r, n] as bf16 bits: StoreOut's float32 value rounded as to_bf16 rounds it (nvfp4_act.cuh
// bf16x2_bits), the layer's output written by w2's epilogue where the conversion pass would reread
// it; `bad` counts the non-finite values written (the conversion's count).
template <int T>
struct StoreBf16 {
  uint16_t* __restrict__ out;
  int N;
  uint32_t bad;
  template <bool PROMOTE>
  __device__ __forceinline__ void store(const float (&acc)[T / 8][4], const float (&)[T / 8][4], float factor,
                                        size_t row0, int valid, int b, int warp, int g, int c, int, int,
                                        const float* __restrict__) {
    static_assert(PROMOTE, "the bf16 output takes the promoted sums");
    uint16_t* o = out + row0 * (size_t)N + b * ROWS + 16 * warp + g;
#pragma unroll
    for (int j = 0; j < T / 8; ++j)
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int col = 8 * j + 2 * c + q;
        if (col < valid) {  // rows g and g + 8: the pair's low and high halves
          const uint32_t bits = lab_act::bf16x2_bits(acc[j][q] * factor, acc[j][2 + q] * factor);
          bad += lab_act::bf16x2_nonfinite(bits);
          o[(size_t)col * N] = (uint16_t)(bits & 0xFFFFu);
          o[(size_t)col * N + 8] = (uint16_t)(bits >> 16);
        }
      }
  }
};

// Stages of the ring by token tile: as deep as 48 KiB of static shared memory allows with the
// fused epilogue's arrays (a stage is 4.5 KiB of weights and T x 132 bytes of activations).
template <int T>
struct DefaultStages {
  static constexpr int value = T == 128 ? 2 : T == 64 ? 3 : 4;
};

// ------------------------------------------------------------------------------ both operands in shared memory
//
// w4a8_gemm_ss: the two-warpgroup CTA with the decoded weights as wgmma's A from shared memory
// instead of registers (large token tiles: 64 and 128). Why: with A in registers each warpgroup
// must hold its group's sixteen A registers until its wgmmas retire, so decode and multiply take
// turns, and the 128-token tile's accumulators leave no room (191 registers); from shared memory
// the decode of group g + 1 runs while group g's wgmmas do, and A costs no registers.
// Per group, each warpgroup decodes its own 64 rows (4 steps x 64 rows x 32 bytes = 8 KiB) into one
// of two buffers, thread (warp w, lane l) the rows 16w + l % 8 and 16w + l % 8 + 8 of step l / 8
// (four words each, from the ring's words as gemm_body reads them), so that eight lanes store one
// core matrix's 128 contiguous bytes. Layout of a buffer, wgmma's K-major A without swizzle, as
// the activations' (LBO 128 along K, SBO 256 along M):
//   byte s * 2048 + (r / 8) * 256 + h * 128 + (r % 8) * 16 + q   holds row r, tensor-core k = 16h + q
// of step s; with the header's K permutation a word's low four bytes (logical k 8c .. 8c+3) are
// half 0's chunk c and its high four (8c+4 .. 8c+7) half 1's, as a0 / a2 hold them in registers.
// Each output is the same wgmmas over the same k order as gemm_body's on the same tile.
// Per group gi (the ring as gemm_body's, STAGES >= 3: group gi + 1 must have landed while gi
// multiplies):
//   wait for group gi + 1's copies; CTA barrier (everyone is past group gi - 1: its stage refills)
//   copy group gi + STAGES - 1; decode group gi + 1 into the other buffer    [wgmma(gi) running]
//   retire wgmma(gi); promote its sums with the tokens' scales (acc += tmp * s_x)
//   proxy fence; the warpgroup's barrier (its four warps' rows written); issue wgmma(gi + 1)
// Measured slower than the register-A kernel (H200, mean 512: +14-15% at 128 tokens, +37% at 64;
// results/studies/w4a8_layer_and_smem_a_h200.json; not profiled: one CTA of eight warps an SM
// against two is what differs by construction): it runs on request (GemmPlan.smem_a), the base of a warp-specialized form (notes/w4a8.md).

template <int F> struct WgmmaE4M3SS;
template <> struct WgmmaE4M3SS<8> {
  static __device__ __forceinline__ void run(float (&d)[8][4], uint64_t desc_a, uint64_t desc_b, int accumulate) {
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %34, 0;\n wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1;\n}\n"
                 : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate));
  }
};
template <> struct WgmmaE4M3SS<16> {
  static __device__ __forceinline__ void run(float (&d)[16][4], uint64_t desc_a, uint64_t desc_b, int accumulate) {
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %66, 0;\n wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1;\n}\n"
                 : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate));
  }
};

template <int T>
struct SsStages {
  static constexpr int value = T == 128 ? 3 : 4;
};
constexpr int SS_ABUF = 4 * ROWS * 32;  // one warpgroup's decoded group: 8 KiB

// Group gi's 64 rows of this warpgroup, decoded into `abuf` (its buffer): the thread's two rows of
// step s, four words each.
// (St: the ring's Stage<T, 2>, or the image kernels' ImageStage<T>: the same words and scales first)
template <class St>
__device__ __forceinline__ void decode_to_smem(const St& st, const uint2* table, uint32_t abuf, int wg,
                                               int warp, int lane) {
  const int gr = lane & 7, s = lane >> 3;
  const uint4* src = reinterpret_cast<const uint4*>(&st.ws[(wg * STEPS + s) * THREADS + 32 * warp + 4 * gr]);
  const uint4 w01 = src[0], w23 = src[1];  // words c = 0 .. 3: .x row 16w + gr, .y row 16w + gr + 8
  const uint2 sc0 = st.scs[wg * ROWS + 16 * warp + gr], sc1 = st.scs[wg * ROWS + 16 * warp + gr + 8];
  // step s's 16-blocks are 2s (words 0, 1) and 2s + 1 (words 2, 3): bytes 2 (s & 1) and 2 (s & 1) + 1
  // of scs.x (s < 2) or scs.y
  const uint32_t b0 = ((s >> 1) ? sc0.y : sc0.x) >> (16 * (s & 1)), b1 = ((s >> 1) ? sc1.y : sc1.x) >> (16 * (s & 1));
  const uint2 t00 = table[b0 & 0x7Fu], t01 = table[(b0 >> 8) & 0x7Fu];
  const uint2 t10 = table[b1 & 0x7Fu], t11 = table[(b1 >> 8) & 0x7Fu];
  uint32_t lo0[4], hi0[4], lo1[4], hi1[4];
  lab_gemm::decode_fp8_word(w01.x, t00.x, t00.y, lo0[0], hi0[0]);
  lab_gemm::decode_fp8_word(w01.y, t10.x, t10.y, lo1[0], hi1[0]);
  lab_gemm::decode_fp8_word(w01.z, t00.x, t00.y, lo0[1], hi0[1]);
  lab_gemm::decode_fp8_word(w01.w, t10.x, t10.y, lo1[1], hi1[1]);
  lab_gemm::decode_fp8_word(w23.x, t01.x, t01.y, lo0[2], hi0[2]);
  lab_gemm::decode_fp8_word(w23.y, t11.x, t11.y, lo1[2], hi1[2]);
  lab_gemm::decode_fp8_word(w23.z, t01.x, t01.y, lo0[3], hi0[3]);
  lab_gemm::decode_fp8_word(w23.w, t11.x, t11.y, lo1[3], hi1[3]);
  const uint32_t row0 = abuf + s * 2048 + (2 * warp) * 256 + gr * 16;  // row 16w + gr: octet 2w
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(row0), "r"(lo0[0]), "r"(lo0[1]), "r"(lo0[2]), "r"(lo0[3]) : "memory");
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(row0 + 128), "r"(hi0[0]), "r"(hi0[1]), "r"(hi0[2]), "r"(hi0[3]) : "memory");
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(row0 + 256), "r"(lo1[0]), "r"(lo1[1]), "r"(lo1[2]), "r"(lo1[3]) : "memory");
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(row0 + 384), "r"(hi1[0]), "r"(hi1[1]), "r"(hi1[2]), "r"(hi1[3]) : "memory");
}

__device__ __forceinline__ void warpgroup_sync(int wg) {  // the warpgroup's 128 threads (barriers 1, 2)
  asm volatile("bar.sync %0, 128;" ::"r"(1 + wg) : "memory");
}

// The mainloop of every instantiation, one token block at a time, handing each block's sums to
// `epi` (the shared memory it declares is the kernel's). Each 128-column group's weights and
// activations come through a ring of STAGES shared buffers filled by cp.async: while group gi
// multiplies, groups gi + 1 .. gi + STAGES - 1 are in flight, so a CTA keeps up to
// (STAGES - 1) x 4.5 KiB of reads outstanding (the read rate at decode sizes is bytes in flight
// per SM over latency).
// Zeroes a thread's accumulator fragments (F of four floats).
template <int F>
__device__ __forceinline__ void zero_frags(float (&a)[F][4]) {
#pragma unroll
  for (int j = 0; j < F; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) a[j][i] = 0.0f;
}

// The ring's storage: STAGES static stages, or (DYN) a placeholder, the ring then being the dynamic
// shared memory the launcher passes (a ring past 48 KiB).
template <class St, int STAGES, bool DYN>
struct RingStorage {
  St stages[STAGES];
};
template <class St, int STAGES>
struct RingStorage<St, STAGES, true> {
  uint32_t unused;
};

template <int T, bool PROMOTE, int STAGES, int W, bool DYN, class Epilogue, bool SMEM_A = false>
__device__ __forceinline__ void gemm_body(const uint2* __restrict__ words, const uint8_t* __restrict__ scales,
                                          const uint2* __restrict__ tables, const int* __restrict__ table_of,
                                          const int* __restrict__ p, const float* __restrict__ alpha,
                                          const uint8_t* __restrict__ x8, const float* __restrict__ s_x,
                                          const int* __restrict__ offsets, int N, int K, Epilogue& epi) {
  static_assert(T == 8 || T == 16 || T == 32 || T == 64 || T == 128, "token tile: 8, 16, 32, 64 or 128");
  static_assert(STAGES >= 2, "the ring needs a stage to fill while one multiplies");
  constexpr int F = T / 8;
  static_assert(W == 1 || W == 2, "one or two warpgroups a CTA");
  using St = Stage<T, W>;
  static_assert(sizeof(St) % 128 == 0 && St::SX + 4 * T <= sizeof(St), "a stage's layout");
  __shared__ RingStorage<St, STAGES, DYN> ring_static;
  extern __shared__ __align__(128) uint8_t ring_dynamic[];
  St* const ring = DYN ? reinterpret_cast<St*>(ring_dynamic) : reinterpret_cast<St*>(&ring_static);
  __shared__ uint2 table[128];

  const int e = blockIdx.z, b = blockIdx.x;
  const int r0 = offsets[e];
  const int count = offsets[e + 1] - r0;
  if ((int)blockIdx.y * T >= count) return;  // the whole CTA: no barrier is left waiting

  // wg: the thread's warpgroup, which owns weight rows 64 (W b + wg) .. + 63; wt, warp: its thread
  // and warp within the warpgroup
  const int tid = threadIdx.x, wg = W == 1 ? 0 : tid / THREADS, wt = W == 1 ? tid : tid % THREADS;
  const int warp = wt >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
  const int bw = W == 1 ? b : W * b + wg;
  const int G = (K + GROUP_K - 1) / GROUP_K, KS = K / STEP_K, NB = N / ROWS;
  if (W == 1 || tid < 128) table[tid] = tables[(size_t)table_of[e] * 128 + tid];
  const float factor = ldexpf(alpha[e], p[e]);
  const uint2* wp = words + (size_t)(e * NB + bw) * KS * THREADS;         // the warpgroup's words, step 0
  const uint8_t* sp = scales + (size_t)(e * NB + bw) * G * (ROWS * 8);    // its block scales, group 0

  float tmp[F][4];
  zero_frags(tmp);

  for (int tb = blockIdx.y; tb * T < count; tb += gridDim.y) {
    const int t0 = tb * T;
    const int valid = min(T, count - t0);
    const size_t row0 = (size_t)r0 + t0;
    float acc[F][4];
    zero_frags(acc);

    // every thread is past the previous block's reads of the ring (and the table's first write
    // is visible) before the prologue refills it
    __syncthreads();
    const GroupLoader<T, W> loader(x8, s_x, wp, sp, row0, valid, K, G, tid);
    if constexpr (SMEM_A) {  // (w4a8_gemm_ss: W = 2, DYN, promoted)
#include "w4a8_ss_block.inc"
    } else {
#include "w4a8_block.inc"
    }

    epi.template store<PROMOTE>(acc, tmp, factor, row0, valid, bw, warp, g, c, e, G, s_x);
  }
}

template <int T, bool PROMOTE = true, int STAGES = DefaultStages<T>::value>
__global__ void __launch_bounds__(THREADS, 1)
    w4a8_gemm(const uint2* __restrict__ words, const uint8_t* __restrict__ scales, const uint2* __restrict__ tables,
              const int* __restrict__ table_of, const int* __restrict__ p, const float* __restrict__ alpha,
              const uint8_t* __restrict__ x8, const float* __restrict__ s_x, const int* __restrict__ offsets,
              float* __restrict__ out, int N, int K) {
  StoreOut<T> epi{out, N};
  gemm_body<T, PROMOTE, STAGES, 1, false>(words, scales, tables, table_of, p, alpha, x8, s_x, offsets, N, K, epi);
}

// Stages of the two-warpgroup CTA's ring: its stage holds twice the weights (9 KiB). At 8, 16 and 64
// tokens within 48 KiB of static shared memory; at 32 a ring of four (52.5 KiB: 5-7% faster than
// three on an H100, results/studies/w4a8_wide_depths_h100.json) and at 128 one of three (76.5 KiB,
// two CTAs an SM by shared memory) are dynamic shared memory, as is any ring past 46 KiB (the depth
// study's). The fused kernel's rings stay static (FusedWideStages: its epilogue's arrays beside them).
template <int T>
struct WideStages {
  static constexpr int value = T == 128 ? 3 : T == 64 ? 2 : 4;
};
template <int T>
struct FusedWideStages {
  static constexpr int value = T == 64 ? 2 : T == 32 ? 3 : 4;
};
template <int T, int STAGES>
struct WideRingIsDynamic {
  static constexpr bool value = T == 128 || STAGES * sizeof(Stage<T, 2>) > 46 * 1024;
};

// Two warpgroups a CTA (w4a8_gemm_wide): 128 weight rows, 64 a warpgroup, over one activation
// tile in shared memory, so each expert's activations are read from L2 by N / 128 CTAs, not
// N / 64 (at large batches the 64-row CTA is bound by that traffic). Each output is computed by
// the same wgmmas in the same order as in w4a8_gemm: the same bits. Needs N % 128 == 0.
template <int T, int STAGES = WideStages<T>::value>
__global__ void __launch_bounds__(2 * THREADS, 1)
    w4a8_gemm_wide(const uint2* __restrict__ words, const uint8_t* __restrict__ scales,
                   const uint2* __restrict__ tables, const int* __restrict__ table_of, const int* __restrict__ p,
                   const float* __restrict__ alpha, const uint8_t* __restrict__ x8, const float* __restrict__ s_x,
                   const int* __restrict__ offsets, float* __restrict__ out, int N, int K) {
  StoreOut<T> epi{out, N};
  gemm_body<T, true, STAGES, 2, WideRingIsDynamic<T, STAGES>::value>(words, scales, tables, table_of, p, alpha, x8, s_x, offsets, N, K, epi);
}

// ------------------------------------------------------------------------------ SwiGLU epilogue
//
// w4a8_gemm_swiglu: w13 with the act stage in its epilogue (w4a8-fused). The prepared w13 pairs
// rows (lab/kernels/w4a8_gemm.py paired_rows): CTA b's row 16w + g is gate column
// i = 32b + 8w + g of I and row 16w + 8 + g the up row of the same i, so each thread holds both
// halves of its SwiGLU (d[j][0] with d[j][2], d[j][1] with d[j][3]). h = sum x alpha 2^p is
// rounded as the plain kernel rounds it and never written; a = swiglu_f32(h_gate, h_up) and its
// 1x128 quantize are w4a8_act.cuh's functions, so a8 and s_a are swiglu_quant's bits on the h the
// plain kernel writes. A 128-column group of I is four CTAs (b = 4gi .. 4gi+3): a cluster of four
// along x. Each CTA reduces its 32 columns' |a| per token (shuffles over g, then its four warps
// through shared memory), the cluster barrier publishes the partials, each CTA reads the four
// through distributed shared memory (fmaxf: exact and order-free, as the act kernel's butterfly),
// then quantizes its own columns; rank 0 writes s_a. A second barrier keeps every partial alive
// until the cluster has read it. Needs I % 128 == 0 (the launcher checks).

__device__ __forceinline__ void cluster_sync() {  // every thread of the cluster; release / acquire
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ float cluster_load(const float* p, uint32_t rank) {  // *p in CTA `rank`'s shared memory
  uint32_t remote;
  float v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(lab_gemm::smem_addr(p)), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
  return v;
}

constexpr int CLUSTER = 4;  // 64-row blocks (one-warpgroup CTAs) of one 128-column group of I

template <int T, int W = 1>
struct SwigluQuant {
  lab_w4a8_act::uint8_t* __restrict__ a8;  // (rows, I)
  float* __restrict__ s_a;                 // (rows, I / 128)
  uint32_t* __restrict__ nonfinite;
  const float* __restrict__ gate_global;
  const float* __restrict__ up_global;
  int I;
  float (*part)[T];  // [4 W warps][T] shared: each warp's |a| maximum per token
  float* cta;        // [T] shared: the CTA's, read by the cluster

  template <bool PROMOTE>
  __device__ __forceinline__ void store(const float (&acc)[T / 8][4], const float (&)[T / 8][4], float factor,
                                        size_t row0, int valid, int b, int warp, int g, int c, int e, int,
                                        const float* __restrict__) {
    static_assert(PROMOTE, "the fused epilogue takes the promoted sums");
    constexpr int F = T / 8;
    const float gs = gate_global[e], us = up_global[e];
    const int i = 32 * b + 8 * warp + g;
    float a[F][2], m[F][2];
    uint32_t bad = 0;
#pragma unroll
    for (int j = 0; j < F; ++j)
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const float hg = acc[j][q] * factor, hu = acc[j][2 + q] * factor;  // the plain kernel's h
        a[j][q] = lab_w4a8_act::swiglu_f32(hg, hu, gs, us);
        const bool live = 8 * j + 2 * c + q < valid;
        bad += live && !(lab_w4a8_act::finite(hg) && lab_w4a8_act::finite(hu) && lab_w4a8_act::finite(a[j][q]));
        m[j][q] = live ? fabsf(a[j][q]) : 0.0f;
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) m[j][q] = fmaxf(m[j][q], __shfl_xor_sync(0xffffffffu, m[j][q], o));
      }
    if (g == 0) {
#pragma unroll
      for (int j = 0; j < F; ++j)
#pragma unroll
        for (int q = 0; q < 2; ++q) part[(W == 1 ? 0 : 4 * (threadIdx.x / THREADS)) + warp][8 * j + 2 * c + q] = m[j][q];
    }
    __syncthreads();
    const int tid = threadIdx.x;
    if (tid < T) {
      float v = fmaxf(fmaxf(part[0][tid], part[1][tid]), fmaxf(part[2][tid], part[3][tid]));
      if (W == 2) v = fmaxf(v, fmaxf(fmaxf(part[4][tid], part[5][tid]), fmaxf(part[6][tid], part[7][tid])));
      cta[tid] = v;
    }
    cluster_sync();  // every CTA's partials written and visible to the cluster
    const int G = I / 128, gi = b / CLUSTER;
#pragma unroll
    for (int j = 0; j < F; ++j)
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int t = 8 * j + 2 * c + q;
        float mt = 0.0f;
#pragma unroll
        for (int r = 0; r < CLUSTER / W; ++r) mt = fmaxf(mt, cluster_load(cta + t, r));
        const float amax = fmaxf(mt, 0x1p-116f);
        const float inv = __fdiv_rn(448.0f, amax);
        if (t < valid) {
          a8[(row0 + t) * I + i] = (lab_w4a8_act::uint8_t)(lab_w4a8_act::e4m3x2(lab_w4a8_act::times_inv(a[j][q], inv), 0.0f) & 0xFFu);
          if (b % CLUSTER == 0 && warp == 0 && g == 0) s_a[(row0 + t) * G + gi] = __fdiv_rn(amax, 448.0f);
        }
      }
    cluster_sync();  // no CTA refills or leaves its partials while another reads them
    if (bad) atomicAdd(nonfinite, bad);
  }
};

template <int T, int STAGES = DefaultStages<T>::value>
__global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(THREADS, 1)
    w4a8_gemm_swiglu(const uint2* __restrict__ words, const uint8_t* __restrict__ scales,
                     const uint2* __restrict__ tables, const int* __restrict__ table_of, const int* __restrict__ p,
                     const float* __restrict__ alpha, const uint8_t* __restrict__ x8, const float* __restrict__ s_x,
                     const int* __restrict__ offsets, int N, int K, const float* __restrict__ gate_global,
                     const float* __restrict__ up_global, uint8_t* __restrict__ a8, float* __restrict__ s_a,
                     uint32_t* __restrict__ nonfinite) {
  __shared__ float part[4][T];
  __shared__ float cta[T];
  SwigluQuant<T> epi{a8, s_a, nonfinite, gate_global, up_global, N / 2, part, cta};
  gemm_body<T, true, STAGES, 1, false>(words, scales, tables, table_of, p, alpha, x8, s_x, offsets, N, K, epi);
}

// The fused epilogue on the two-warpgroup CTA: a 128-column group of I is two CTAs of 64 columns,
// each reducing its eight warps' |a| before the cluster's exchange; the same a8 and s_a.
// (At 64 tokens the loader's eight octets would take 136 registers unbounded: the bound keeps two
// CTAs an SM.)
template <int T, int STAGES = FusedWideStages<T>::value>
__global__ void __cluster_dims__(CLUSTER / 2, 1, 1) __launch_bounds__(2 * THREADS, T == 64 ? 2 : 1)
    w4a8_gemm_swiglu_wide(const uint2* __restrict__ words, const uint8_t* __restrict__ scales,
                          const uint2* __restrict__ tables, const int* __restrict__ table_of,
                          const int* __restrict__ p, const float* __restrict__ alpha, const uint8_t* __restrict__ x8,
                          const float* __restrict__ s_x, const int* __restrict__ offsets, int N, int K,
                          const float* __restrict__ gate_global, const float* __restrict__ up_global,
                          uint8_t* __restrict__ a8, float* __restrict__ s_a, uint32_t* __restrict__ nonfinite) {
  __shared__ float part[8][T];
  __shared__ float cta[T];
  SwigluQuant<T, 2> epi{a8, s_a, nonfinite, gate_global, up_global, N / 2, part, cta};
  gemm_body<T, true, STAGES, 2, false>(words, scales, tables, table_of, p, alpha, x8, s_x, offsets, N, K, epi);
}

// The shared-memory-A kernel (its loop: w4a8_ss_block.inc; what it is: above gemm_body).
template <int T, int STAGES = SsStages<T>::value>
__global__ void __launch_bounds__(2 * THREADS, 1)  // (at 64 tokens a bound of 128 registers spills)
    w4a8_gemm_ss(const uint2* __restrict__ words, const uint8_t* __restrict__ scales, const uint2* __restrict__ tables,
                 const int* __restrict__ table_of, const int* __restrict__ p, const float* __restrict__ alpha,
                 const uint8_t* __restrict__ x8, const float* __restrict__ s_x, const int* __restrict__ offsets,
                 float* __restrict__ out, int N, int K) {
  static_assert(T == 64 || T == 128, "the shared-memory-A tiles: 64 and 128 tokens");
  static_assert(STAGES >= 3, "group gi + 1 lands while gi multiplies");
  StoreOut<T> epi{out, N};
  gemm_body<T, true, STAGES, 2, true, StoreOut<T>, true>(words, scales, tables, table_of, p, alpha, x8, s_x, offsets,
                                                         N, K, epi);
}

// ------------------------------------------------------------------------------ activations resident
//
// w4a8_gemm_res: the one-warpgroup CTA with its token block's activations resident in shared
// memory for the whole of K, so that the group loop copies nothing per thread. Why: at decode
// sizes the ring kernel issues ~200 instructions a warp a group at 8 tokens, about 100 of them
// the decode and most of the rest the copies (six cp.async a thread a group, their addresses,
// the placeholders ptxas puts before them, their waits); on the H200 that issue, not the read,
// binds (notes/w4a8.md). Here, per token block:
//   prologue: the ring's first STAGES - 1 groups of weights and scales by bulk copies (one thread,
//       one mbarrier a stage); the block's T x K activation bytes, K-permuted as gemm_body's stages
//       hold them (two 16-byte loads and two 16-byte stores a token's k32 step: logical chunks
//       0, 2, 4, 6 are half 0's row of the core matrix, 1, 3, 5, 7 half 1's), and its T x G scales;
//       zeros for tokens past the count. A proxy fence and the CTA's barrier.
//   group gi: wait on its stage's mbarrier; the CTA's barrier (everyone is done with gi - 1's
//       stage); thread 0 refills that stage with group gi + STAGES - 1; decode and the four wgmmas
//       (B: group gi's resident activations); retire; promote.
// The same wgmmas in the same order on the same values as w4a8_gemm<T>: the same bits. K must be a
// multiple of 128 (no 64-column last group; the launcher refuses others). Dynamic shared memory:
// the ring, then G x T x 128 bytes of activations, then G x T scales (res_smem_bytes in
// w4a8_gemm.py): 51 KiB at 8 tokens and K = 4096.
// The group loop: ~150 instructions a warp a group with thread 0's refills, ~125 without, against
// the ring kernel's 196 at 8 tokens. Measured on an H100 only (results/studies/
// w4a8_resident_h100.json): equal to the ring kernel at mean 1, where both read at 96-98%; at 8
// tokens and mean 8 5-12% faster than the ring kernel at 8 (not faster than the 16-token
// two-warpgroup plan); at 16 tokens and K = 4096 (84 KiB, two CTAs an SM) 23% slower. Default
// plans take it at 8 tokens only (w4a8_gemm.py resident_by_default).
struct __align__(128) WeightStage {  // one group of one warpgroup: 4 KiB of words, 512 bytes of scales
  uint2 ws[STEPS * THREADS];
  uint2 scs[ROWS];
};

template <int T>
struct ResStages {
  static constexpr int value = 4;
};

// The block's activations, group-major in gemm_body's stage layout (group gi at gi x T x 128),
// and its scales sx[gi][j]. Thread i of the CTA handles token steps i, i + THREADS, ... of the
// block's T x (K / 32): each a 32-byte piece of one token's row, two 16-byte loads, stored as
// two 16-byte rows of core matrices. Tokens at `valid` and past: zeros.
template <int T>
__device__ __forceinline__ void load_resident_x(const uint8_t* __restrict__ x8, const float* __restrict__ s_x,
                                                size_t row0, int valid, int K, int G, uint32_t xres, float* sxres,
                                                int tid) {
  const int KS = K / STEP_K, pieces = T * KS;
  constexpr int BATCH = 4;  // pieces in flight a thread (8 registers each)
  for (int i0 = tid; i0 < pieces; i0 += BATCH * THREADS) {
    uint4 lo[BATCH], hi[BATCH];
#pragma unroll
    for (int u = 0; u < BATCH; ++u) {
      const int i = i0 + u * THREADS, j = i % T, ks = i / T;  // token j, step ks: consecutive threads, tokens
      lo[u] = hi[u] = make_uint4(0u, 0u, 0u, 0u);
      if (i < pieces && j < valid) {
        const uint4* src = reinterpret_cast<const uint4*>(x8 + (row0 + j) * (size_t)K + ks * STEP_K);
        lo[u] = __ldg(src);
        hi[u] = __ldg(src + 1);
      }
    }
#pragma unroll
    for (int u = 0; u < BATCH; ++u) {
      const int i = i0 + u * THREADS, j = i % T, ks = i / T;
      if (i < pieces) {
        // group ks / 4, step ks % 4: byte (s T 32) + (j / 8) 256 + h 128 + (j % 8) 16 in its group
        const uint32_t row = xres + (ks >> 2) * (T * 128) + (ks & 3) * (T * 32) + (j >> 3) * 256 + (j & 7) * 16;
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(row), "r"(lo[u].x), "r"(lo[u].z), "r"(hi[u].x),
                     "r"(hi[u].z) : "memory");
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(row + 128), "r"(lo[u].y), "r"(lo[u].w),
                     "r"(hi[u].y), "r"(hi[u].w) : "memory");
      }
    }
  }
  for (int i = tid; i < G * T; i += THREADS) {
    const int gi = i / T, j = i % T;
    sxres[i] = j < valid ? s_x[(row0 + j) * (size_t)G + gi] : 0.0f;
  }
}

template <int T, int STAGES = ResStages<T>::value>
__global__ void __launch_bounds__(THREADS, 1)
    w4a8_gemm_res(const uint2* __restrict__ words, const uint8_t* __restrict__ scales,
                  const uint2* __restrict__ tables, const int* __restrict__ table_of, const int* __restrict__ p,
                  const float* __restrict__ alpha, const uint8_t* __restrict__ x8, const float* __restrict__ s_x,
                  const int* __restrict__ offsets, float* __restrict__ out, int N, int K) {
  static_assert(T == 8 || T == 16, "the resident tiles: 8 and 16 tokens");
  constexpr int F = T / 8;
  extern __shared__ __align__(128) uint8_t res_smem[];
  WeightStage* const ring = reinterpret_cast<WeightStage*>(res_smem);
  __shared__ uint2 table[128];
  __shared__ __align__(8) uint64_t full[STAGES];  // stage s's words and scales have landed

  const int e = blockIdx.z, b = blockIdx.x;
  const int r0 = offsets[e];
  const int count = offsets[e + 1] - r0;
  if ((int)blockIdx.y * T >= count) return;  // the whole CTA: no barrier is left waiting

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
  const int G = K / GROUP_K, KS = K / STEP_K, NB = N / ROWS;
  table[tid] = tables[(size_t)table_of[e] * 128 + tid];
  const uint32_t ring0 = lab_gemm::smem_addr(ring), bar0 = lab_gemm::smem_addr(&full[0]);
  const uint32_t xres = ring0 + STAGES * (uint32_t)sizeof(WeightStage);
  float* const sxres = reinterpret_cast<float*>(res_smem + STAGES * sizeof(WeightStage) + (size_t)G * T * 128);
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) lab_gemm::mbar_init(bar0 + 8 * s, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  const float factor = ldexpf(alpha[e], p[e]);
  const uint8_t* wsrc = reinterpret_cast<const uint8_t*>(words + (size_t)(e * NB + b) * KS * THREADS);
  const uint8_t* ssrc = scales + (size_t)(e * NB + b) * G * (ROWS * 8);
  constexpr uint32_t WBYTES = STEPS * THREADS * 8, SBYTES = ROWS * 8;
  // thread 0: group gi's words and scales into stage s, completing on its barrier
  auto fill_stage = [&](int s, int gi) {
    const uint32_t dst = ring0 + s * (uint32_t)sizeof(WeightStage), bar = bar0 + 8 * s;
    lab_gemm::mbar_arrive_expect_tx(bar, WBYTES + SBYTES);
    lab_gemm::bulk_copy(dst, wsrc + (size_t)gi * WBYTES, WBYTES, bar);
    lab_gemm::bulk_copy(dst + WBYTES, ssrc + (size_t)gi * SBYTES, SBYTES, bar);
  };
  uint32_t phase = 0;  // bit s: the parity stage s's barrier completes next

  float tmp[F][4];
  zero_frags(tmp);

  for (int tb = blockIdx.y; tb * T < count; tb += gridDim.y) {
    const int t0 = tb * T;
    const int valid = min(T, count - t0);
    const size_t row0 = (size_t)r0 + t0;
    float acc[F][4];
    zero_frags(acc);

    // everyone is past the previous block's reads of the ring and the activations (and the
    // barriers' initialization and the table are visible) before they are refilled
    __syncthreads();
    if (tid == 0) {
#pragma unroll
      for (int i = 0; i < STAGES - 1; ++i)
        if (i < G) fill_stage(i, i);
    }
    load_resident_x<T>(x8, s_x, row0, valid, K, G, xres, sxres, tid);
    lab_gemm::fence_proxy_async();  // the activations' generic stores, before wgmma reads them
    __syncthreads();

    const uint32_t desc_lo = (uint32_t)lab_gemm::smem_desc(xres, 128, 256);
    // group gi in stage `stage` (a constant where the loops below unroll: no stage arithmetic)
    auto group = [&](int gi, int stage) {
      lab_gemm::mbar_wait(bar0 + 8 * stage, (phase >> stage) & 1u);
      phase ^= 1u << stage;
      __syncthreads();  // everyone is done with group gi - 1's stage, which refills now
      if (tid == 0 && gi + STAGES - 1 < G) fill_stage((stage + STAGES - 1) % STAGES, gi + STAGES - 1);

      const WeightStage& st = ring[stage];
      const uint32_t cs = 8 * (c >> 1);
      const uint2 sc0 = st.scs[16 * warp + g], sc1 = st.scs[16 * warp + g + 8];
      const uint32_t b0[2] = {sc0.x >> cs, sc0.y >> cs}, b1[2] = {sc1.x >> cs, sc1.y >> cs};
      uint32_t a[STEPS][4];
#pragma unroll
      for (int s = 0; s < STEPS; ++s) {
        const uint2 w = st.ws[s * THREADS + tid];
        const uint2 t0w = table[(b0[s >> 1] >> (16 * (s & 1))) & 0x7Fu];
        const uint2 t1w = table[(b1[s >> 1] >> (16 * (s & 1))) & 0x7Fu];
        lab_gemm::decode_fp8_word(w.x, t0w.x, t0w.y, a[s][0], a[s][2]);
        lab_gemm::decode_fp8_word(w.y, t1w.x, t1w.y, a[s][1], a[s][3]);
      }
      const uint32_t dlo = desc_lo + gi * (uint32_t)(T * 128 / 16);
      lab_gemm::wgmma_fence();
#pragma unroll
      for (int s = 0; s < STEPS; ++s)
        WgmmaE4M3<F>::run(tmp, a[s], (uint64_t)(256 >> 4) << 32 | (dlo + s * (T * 2)), s);
      lab_gemm::wgmma_commit();
      lab_gemm::wgmma_wait<0>();
      lab_gemm::fence_acc(tmp);
#pragma unroll
      for (int s = 0; s < STEPS; ++s)  // the A registers stay allocated until the wgmmas retire
        asm volatile("" ::"r"(a[s][0]), "r"(a[s][1]), "r"(a[s][2]), "r"(a[s][3]));
#pragma unroll
      for (int j = 0; j < F; ++j) {
        const float s0 = sxres[gi * T + 8 * j + 2 * c], s1 = sxres[gi * T + 8 * j + 2 * c + 1];
        acc[j][0] = fmaf(tmp[j][0], s0, acc[j][0]);
        acc[j][1] = fmaf(tmp[j][1], s1, acc[j][1]);
        acc[j][2] = fmaf(tmp[j][2], s0, acc[j][2]);
        acc[j][3] = fmaf(tmp[j][3], s1, acc[j][3]);
      }
    };
    int gi = 0;
    for (; gi + STAGES <= G; gi += STAGES) {  // whole rounds of the ring
#pragma unroll
      for (int s = 0; s < STAGES; ++s) group(gi + s, s);
    }
#pragma unroll 1
    for (int s = 0; gi < G; ++s, ++gi) group(gi, s);  // the last G % STAGES groups
    StoreOut<T> epi{out, N};
    epi.template store<true>(acc, tmp, factor, row0, valid, b, warp, g, c, e, G, s_x);
  }
}

// ------------------------------------------------------------------------------ activation image
//
// w4a8_gemm_image: the two-warpgroup CTA for large token tiles (64, 128) with every copy a bulk
// copy and the two warpgroups unsynchronized. Why: the ring kernel's CTA copies a 128-token
// group's activations as 4096 four-byte cp.async (the K permutation interleaves 4-byte chunks of
// each 32-byte step), and its group loop is ~460 instructions a warp at 128 tokens, ~200 of them
// copy addresses and predicates; with a CTA barrier a group both warpgroups wait, decode and
// promote at the same time, so the tensor core idles while they do (w13 at 512 tokens per
// expert ran at ~22% of the fp8 peak, 1 CTA an SM).
// A pre-pass (w4a8_x_image) writes the activations once more, as each stage wants them: token
// block tb of expert e at image row offsets[e] + e T + tb T (each expert padded by T rows, so no
// two blocks overlap and no host reads the counts), group gi's bytes at (that row) x K + gi T 128,
// laid out as [step s][half h][token j][16 bytes] (16-byte piece 2s + h of the group holds half h
// of step s in the tensor core's k order: logical chunks h, h + 2, h + 4, h + 6), zeros for
// tokens past the count; its scales at (that row) x G + gi T + j. So a stage's activations are
// one contiguous bulk copy, and wgmma's K-major B descriptor has LBO = 16 T (the other half) and
// SBO = 128 (the next 8 tokens).
// CTA: warpgroups 0 and 1 consume (rows 64 (2b + wg) .. + 63, as w4a8_gemm_wide), warp 8's lane
// 0 produces: per group, six bulk copies (each warpgroup's 4 KiB of words and 512 bytes of block
// scales, the group's activations and scales) into the stage's `full` barrier, once every
// consumer thread has arrived on its `empty` barrier (each thread after its own last read of the
// stage: one arrival a warp after __syncwarp is the same order, but racecheck reports it). A consumer waits on `full`, decodes, issues
// the four wgmmas, retires them, promotes, and arrives on `empty`: no CTA barrier in the loop.
// The same decode, wgmmas and promotion order as w4a8_gemm_wide<T>: the same bits. Needs
// N % 128 == 0 and K % 512 == 0 (whole groups; a scale image row of 16-byte pieces). Tiles 64 and
// 128, and 192 in the decode-ahead form with each group's wgmmas in batches of 64 tokens
// (image_body's U): fewer token blocks, so fewer decodes of the same weights.
template <int T>
struct __align__(128) ImageStage {
  uint2 ws[2 * STEPS * THREADS];
  uint2 scs[2 * ROWS];
  uint8_t xs[T * GROUP_K];
  float sx[T];
};

template <int T>
struct ImageStages {
  static constexpr int value = 4;
};
constexpr int IMAGE_THREADS = 2 * THREADS + 32;  // two consumer warpgroups and the producer warp
// With the decode ahead the producer is a whole warpgroup, whose registers setmaxnreg hands to the
// consumers (ptxas budgets wgmma kernels by warpgroups: 168 a thread at 288 threads as at 384)
constexpr int IMAGE_AHEAD_THREADS = 3 * THREADS, IMAGE_PRODUCER_REGS = 56, IMAGE_CONSUMER_REGS = 224;
// Token octets of a batch whose scales the decode-ahead form reads before the batch's wgmmas retire
// (scales_ahead): 2 P registers a thread, live across the wait.
constexpr int IMAGE_SX_AHEAD = 4;

// The pre-pass. Grid (ceil(T x K / 32 / 256), token blocks, E), 256 threads: piece i of a block is
// token i % T's step i / T (32 bytes: two 16-byte loads, two 16-byte stores), consecutive threads
// consecutive tokens; pieces below T x G also copy token i % T's scale of group i / T.
template <int T>
__global__ void __launch_bounds__(256)
    w4a8_x_image(const uint8_t* __restrict__ x8, const float* __restrict__ s_x, const int* __restrict__ offsets,
                 uint8_t* __restrict__ ximg, float* __restrict__ sximg, int K) {
  const int e = blockIdx.z, r0 = offsets[e], count = offsets[e + 1] - r0;
  const int KS = K / STEP_K, G = K / GROUP_K;
  const int i = blockIdx.x * 256 + threadIdx.x, j = i % T, ks = i / T;
  for (int tb = blockIdx.y; tb * T < count; tb += gridDim.y) {
    const size_t img = (size_t)r0 + (size_t)e * T + (size_t)tb * T;  // the block's image row
    const bool in = j < count - tb * T;
    const size_t row = (size_t)r0 + (size_t)tb * T + j;
    if (ks < KS) {
      uint4 lo = make_uint4(0u, 0u, 0u, 0u), hi = lo;
      if (in) {
        const uint4* src = reinterpret_cast<const uint4*>(x8 + row * K + ks * STEP_K);
        lo = __ldg(src);
        hi = __ldg(src + 1);
      }
      // half 0: logical chunks 0, 2, 4, 6 of the step; half 1: 1, 3, 5, 7
      uint8_t* dst = ximg + img * K + (ks >> 2) * (T * GROUP_K) + (2 * (ks & 3)) * (T * 16) + j * 16;
      *reinterpret_cast<uint4*>(dst) = make_uint4(lo.x, lo.z, hi.x, hi.z);
      *reinterpret_cast<uint4*>(dst + T * 16) = make_uint4(lo.y, lo.w, hi.y, hi.w);
    }
    if (ks < G) sximg[img * G + ks * T + j] = in ? s_x[row * G + ks] : 0.0f;
  }
}

// The promotion: acc's sub-tile u (tokens U u .. U u + U - 1, U = 8 FU; FU = F: the whole tile)
// += t x its tokens' scales
template <int F, int FU, int u>
__device__ __forceinline__ void promote_sub(float (&acc)[F][4], const float (&t)[FU][4], const float* sx, int c) {
  static_assert(FU * (u + 1) <= F, "a sub-tile of the accumulator");
#pragma unroll
  for (int j = 0; j < FU; ++j) {
    const float s0 = sx[8 * (FU * u + j) + 2 * c], s1 = sx[8 * (FU * u + j) + 2 * c + 1];
    acc[FU * u + j][0] = fmaf(t[j][0], s0, acc[FU * u + j][0]);
    acc[FU * u + j][1] = fmaf(t[j][1], s1, acc[FU * u + j][1]);
    acc[FU * u + j][2] = fmaf(t[j][2], s0, acc[FU * u + j][2]);
    acc[FU * u + j][3] = fmaf(t[j][3], s1, acc[FU * u + j][3]);
  }
}

// The scales of sub-tile u's first P token octets (this thread's two tokens of each), read before
// its wgmmas retire: the promotion's first FMAs then wait on no shared-memory load (ncu put those
// waits at ~8% of the image kernel's stall samples at 192 tokens; notes/w4a8.md).
template <int FU, int u, int P>
__device__ __forceinline__ void scales_ahead(float2 (&pre)[P], const float* sx, int c) {
  static_assert(P <= FU, "octets of the sub-tile");
#pragma unroll
  for (int j = 0; j < P; ++j) pre[j] = *reinterpret_cast<const float2*>(sx + 8 * (FU * u + j) + 2 * c);
}

// promote_sub with the first P octets' scales from scales_ahead
template <int F, int FU, int u, int P>
__device__ __forceinline__ void promote_sub(float (&acc)[F][4], const float (&t)[FU][4], const float* sx, int c,
                                            const float2 (&pre)[P]) {
  static_assert(FU * (u + 1) <= F && P <= FU, "a sub-tile of the accumulator");
#pragma unroll
  for (int j = 0; j < FU; ++j) {
    const float2 s = j < P ? pre[j < P ? j : 0] : *reinterpret_cast<const float2*>(sx + 8 * (FU * u + j) + 2 * c);
    acc[FU * u + j][0] = fmaf(t[j][0], s.x, acc[FU * u + j][0]);
    acc[FU * u + j][1] = fmaf(t[j][1], s.y, acc[FU * u + j][1]);
    acc[FU * u + j][2] = fmaf(t[j][2], s.x, acc[FU * u + j][2]);
    acc[FU * u + j][3] = fmaf(t[j][3], s.y, acc[FU * u + j][3]);
  }
}

// The image kernels' producer (one thread): per token block of this CTA and per group, once every
// reader has released the stage (`empty`, from the ring's second round), six bulk copies into it
// on its `full` barrier: both 64-row blocks' words and block scales, the group's activations and
// their scales from the image. The split-roles kernel's producer is the same.
template <int T, int STAGES>
__device__ __forceinline__ void image_produce(const uint2* __restrict__ words, const uint8_t* __restrict__ scales,
                                              const uint8_t* __restrict__ ximg, const float* __restrict__ sximg,
                                              int e, int b, size_t img0, int blocks, int G, int KS, int NB, int K,
                                              uint32_t ring0, uint32_t full0, uint32_t empty0) {
  using St = ImageStage<T>;
  constexpr uint32_t WBYTES = STEPS * THREADS * 8, SBYTES = ROWS * 8;
  constexpr uint32_t XS = 2 * WBYTES + 2 * SBYTES, SX = XS + T * GROUP_K;  // St's members
  const uint8_t* w0 = reinterpret_cast<const uint8_t*>(words + (size_t)(e * NB + 2 * b) * KS * THREADS);
  const uint8_t* s0 = scales + (size_t)(e * NB + 2 * b) * G * SBYTES;
  const size_t wstride = (size_t)KS * THREADS * 8, sstride = (size_t)G * SBYTES;  // the next 64-row block's
  int stage = 0;
  uint32_t phase = 0;  // bit s: the parity of stage s's next `empty` completion
  bool first = true;   // the ring's first round: nothing to wait for
  for (int tb = blockIdx.y; tb < blocks; tb += gridDim.y) {
    const size_t img = img0 + (size_t)tb * T;
    for (int gi = 0; gi < G; ++gi) {
      if (!first) {
        lab_gemm::mbar_wait(empty0 + 8 * stage, (phase >> stage) & 1u);
        phase ^= 1u << stage;
      }
      const uint32_t dst = ring0 + stage * (uint32_t)sizeof(St), bar = full0 + 8 * stage;
      lab_gemm::mbar_arrive_expect_tx(bar, 2 * WBYTES + 2 * SBYTES + T * GROUP_K + 4 * T);
      lab_gemm::bulk_copy(dst, w0 + (size_t)gi * WBYTES, WBYTES, bar);
      lab_gemm::bulk_copy(dst + WBYTES, w0 + wstride + (size_t)gi * WBYTES, WBYTES, bar);
      lab_gemm::bulk_copy(dst + 2 * WBYTES, s0 + (size_t)gi * SBYTES, SBYTES, bar);
      lab_gemm::bulk_copy(dst + 2 * WBYTES + SBYTES, s0 + sstride + (size_t)gi * SBYTES, SBYTES, bar);
      lab_gemm::bulk_copy(dst + XS, ximg + img * K + (size_t)gi * (T * GROUP_K), T * GROUP_K, bar);
      lab_gemm::bulk_copy(dst + SX, sximg + img * G + (size_t)gi * T, 4 * T, bar);
      if (++stage == STAGES) {
        stage = 0;
        first = false;
      }
    }
  }
}

// The image kernels' body, their epilogue aside: Epi::setup(tid) runs with the CTA's barrier
// setup (before its one CTA-wide barrier), Epi::start() once after it, Epi::store per token block
// (as gemm_body's epilogues), Epi::finish() once a consumer thread is done.
template <int T, int STAGES, bool AHEAD, class Epi, int U = T>
__device__ __forceinline__ void image_body(const uint2* __restrict__ words, const uint8_t* __restrict__ scales,
                                           const uint2* __restrict__ tables, const int* __restrict__ table_of,
                                           const int* __restrict__ p, const float* __restrict__ alpha,
                                           const uint8_t* __restrict__ ximg, const float* __restrict__ sximg,
                                           const int* __restrict__ offsets, int N, int K, Epi& epi) {
  static_assert(T == 64 || T == 128 || T == 192, "the image tiles: 64, 128 and 192 tokens");
  static_assert(U == T || (AHEAD && U == 64 && T % U == 0 && T / U <= 3),
                "sub-tiles (U < T): 64 tokens, two or three of them, in the decode-ahead form");
  static_assert(U < T || T <= 128, "a 192-token tile only in sub-tiles (its tmp would not fit)");
  constexpr int F = T / 8;
  using St = ImageStage<T>;
  extern __shared__ __align__(128) uint8_t image_smem[];
  St* const ring = reinterpret_cast<St*>(image_smem);
  __shared__ uint2 table[128];
  __shared__ __align__(8) uint64_t full[STAGES], empty[STAGES];

  const int e = blockIdx.z, b = blockIdx.x;
  const int r0 = offsets[e];
  const int count = offsets[e + 1] - r0;
  if ((int)blockIdx.y * T >= count) return;  // the whole CTA: no barrier is left waiting

  const int tid = threadIdx.x;
  const int G = K / GROUP_K, KS = K / STEP_K, NB = N / ROWS, blocks = (count + T - 1) / T;
  const size_t img0 = (size_t)r0 + (size_t)e * T;  // the expert's first image row
  if (tid < 128) table[tid] = tables[(size_t)table_of[e] * 128 + tid];
  const uint32_t full0 = lab_gemm::smem_addr(&full[0]), empty0 = lab_gemm::smem_addr(&empty[0]);
  epi.setup(tid);  // (before the fence below, which publishes its barriers' initialization too)
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      lab_gemm::mbar_init(full0 + 8 * s, 1);
      lab_gemm::mbar_init(empty0 + 8 * s, 2 * THREADS);  // every consumer thread arrives
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();  // the table and the barriers; the last CTA-wide barrier
  epi.start();

  constexpr uint32_t WBYTES = STEPS * THREADS * 8, SBYTES = ROWS * 8;
  constexpr uint32_t XS = 2 * WBYTES + 2 * SBYTES, SX = XS + T * GROUP_K;  // St's members
  static_assert(sizeof(St) % 128 == 0 && sizeof(St) >= SX + 4 * T, "a stage's layout");
  const uint32_t ring0 = lab_gemm::smem_addr(ring);
  if (tid >= 2 * THREADS) {  // the producer warp: its lane 0 issues every copy
    if constexpr (AHEAD) lab_gemm::setmaxnreg_dec<IMAGE_PRODUCER_REGS>();
    if (tid == 2 * THREADS)
      image_produce<T, STAGES>(words, scales, ximg, sximg, e, b, img0, blocks, G, KS, NB, K, ring0, full0, empty0);
    return;
  }

  if constexpr (AHEAD) lab_gemm::setmaxnreg_inc<IMAGE_CONSUMER_REGS>();
  const int wg = tid / THREADS, wt = tid % THREADS;
  const int warp = wt >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
  const int bw = 2 * b + wg;
  const float factor = ldexpf(alpha[e], p[e]);
  // B of stage 0, step 0: halves 16 T bytes apart (LBO), token octets 128 (SBO); a step adds 32 T
  const uint64_t desc0 = lab_gemm::smem_desc(ring0 + XS, 16 * T, 128);
  float tmp[F][4];
  zero_frags(tmp);
  int stage = 0;
  uint32_t phase = 0;  // bit s: the parity of stage s's next `full` completion

  for (int tb = blockIdx.y; tb < blocks; tb += gridDim.y) {
    const int t0 = tb * T;
    const int valid = min(T, count - t0);
    const size_t row0 = (size_t)r0 + t0;
    float acc[F][4];
    zero_frags(acc);
    if constexpr (AHEAD) {
      // group gi + 1 decoded into the other A registers while gi's wgmmas run; then gi retired and
      // promoted, its stage released, and gi + 1 issued
      auto decode = [&](uint32_t(&a)[STEPS][4]) {
        lab_gemm::mbar_wait(full0 + 8 * stage, (phase >> stage) & 1u);
        phase ^= 1u << stage;
        const St& st = ring[stage];
        const uint32_t cs = 8 * (c >> 1);
        const uint2 sc0 = st.scs[wg * ROWS + 16 * warp + g], sc1 = st.scs[wg * ROWS + 16 * warp + g + 8];
        const uint32_t b0[2] = {sc0.x >> cs, sc0.y >> cs}, b1[2] = {sc1.x >> cs, sc1.y >> cs};
#pragma unroll
        for (int s = 0; s < STEPS; ++s) {
          const uint2 w = st.ws[(wg * STEPS + s) * THREADS + wt];
          const uint2 t0w = table[(b0[s >> 1] >> (16 * (s & 1))) & 0x7Fu];
          const uint2 t1w = table[(b1[s >> 1] >> (16 * (s & 1))) & 0x7Fu];
          lab_gemm::decode_fp8_word(w.x, t0w.x, t0w.y, a[s][0], a[s][2]);
          lab_gemm::decode_fp8_word(w.y, t1w.x, t1w.y, a[s][1], a[s][3]);
        }
      };
      // Sub-tiles (U < T): each group's wgmmas as T / U batches of U tokens, each its own commit
      // group, into two U-token buffers in turn: while one batch's sums are promoted the next runs,
      // and a tile larger than tmp's registers allow (192) fits. The first two batches always run
      // (ptxas serializes every wgmma where a wait may leave a batch it reads in flight on some
      // path); the third only for a block with more than 2 U tokens.
      constexpr int FU = U / 8, NS = T / U;
      float tb0[FU][4], tb1[FU][4];
      zero_frags(tb0);
      zero_frags(tb1);
      const int nsv = U < T ? (valid + U - 1) / U : 1;  // batches with tokens (>= 1)
      auto issue_sub = [&](const uint32_t(&a)[STEPS][4], int u, float(&t)[FU][4], int stg) {
        const uint64_t desc = desc0 + stg * (uint32_t)(sizeof(St) / 16) + u * U;  // + U x 16 bytes
        lab_gemm::wgmma_fence();
#pragma unroll
        for (int s = 0; s < STEPS; ++s) WgmmaE4M3<FU>::run(t, a[s], desc + s * (T * 2), s);
        lab_gemm::wgmma_commit();
      };
      auto issue = [&](const uint32_t(&a)[STEPS][4]) {
        if constexpr (U < T) {
          issue_sub(a, 0, tb0, stage);
          issue_sub(a, 1, tb1, stage);
        } else {
          const uint64_t desc = desc0 + stage * (uint32_t)(sizeof(St) / 16);
          lab_gemm::wgmma_fence();
#pragma unroll
          for (int s = 0; s < STEPS; ++s) WgmmaE4M3<F>::run(tmp, a[s], desc + s * (T * 2), s);
          lab_gemm::wgmma_commit();
        }
      };
      auto retire = [&](const uint32_t(&a)[STEPS][4], int stg) {
        if constexpr (U < T) {
          const St& st = ring[stg];
          const bool third = NS > 2 && nsv > 2;
          float2 pre[IMAGE_SX_AHEAD];
          scales_ahead<FU, 0>(pre, st.sx, c);
          lab_gemm::wgmma_wait<1>();
          lab_gemm::fence_acc(tb0);
          promote_sub<F, FU, 0>(acc, tb0, st.sx, c, pre);
          scales_ahead<FU, 1>(pre, st.sx, c);
          if (third) {  // (one branch: ptxas does not correlate two tests of `third`)
            issue_sub(a, 2, tb0, stg);
            lab_gemm::wgmma_wait<1>();
            lab_gemm::fence_acc(tb1);
            promote_sub<F, FU, 1>(acc, tb1, st.sx, c, pre);
            scales_ahead<FU, 2 % NS>(pre, st.sx, c);
            lab_gemm::wgmma_wait<0>();
            lab_gemm::fence_acc(tb0);
            promote_sub<F, FU, 2 % NS>(acc, tb0, st.sx, c, pre);
          } else {
            lab_gemm::wgmma_wait<0>();
            lab_gemm::fence_acc(tb1);
            promote_sub<F, FU, 1>(acc, tb1, st.sx, c, pre);
          }
#pragma unroll
          for (int s = 0; s < STEPS; ++s)  // the A registers stay allocated until the wgmmas retire
            asm volatile("" ::"r"(a[s][0]), "r"(a[s][1]), "r"(a[s][2]), "r"(a[s][3]));
          lab_gemm::mbar_arrive(empty0 + 8 * stg);
        } else {
          float2 pre[IMAGE_SX_AHEAD];
          scales_ahead<F, 0>(pre, ring[stg].sx, c);
          lab_gemm::wgmma_wait<0>();
          lab_gemm::fence_acc(tmp);
#pragma unroll
          for (int s = 0; s < STEPS; ++s)  // the A registers stay allocated until the wgmmas retire
            asm volatile("" ::"r"(a[s][0]), "r"(a[s][1]), "r"(a[s][2]), "r"(a[s][3]));
          promote_sub<F, F, 0>(acc, tmp, ring[stg].sx, c, pre);
          lab_gemm::mbar_arrive(empty0 + 8 * stg);  // this thread is done with the stage
        }
      };
      auto advance = [&]() {
        if (++stage == STAGES) stage = 0;
      };
      uint32_t a0[STEPS][4], a1[STEPS][4];
      decode(a0);
      issue(a0);
      int cur = stage;  // the stage of the group in flight
      advance();
      for (int gi = 0;; gi += 2) {  // a0: group gi in flight
        if (gi + 1 < G) decode(a1);
        retire(a0, cur);
        if (gi + 1 == G) break;
        issue(a1);
        cur = stage;
        advance();
        if (gi + 2 < G) decode(a0);
        retire(a1, cur);
        if (gi + 2 == G) break;
        issue(a0);
        cur = stage;
        advance();
      }
    } else {
    for (int gi = 0; gi < G; ++gi) {
      lab_gemm::mbar_wait(full0 + 8 * stage, (phase >> stage) & 1u);
      phase ^= 1u << stage;
      const St& st = ring[stage];
      const uint32_t cs = 8 * (c >> 1);
      const uint2 sc0 = st.scs[wg * ROWS + 16 * warp + g], sc1 = st.scs[wg * ROWS + 16 * warp + g + 8];
      const uint32_t b0[2] = {sc0.x >> cs, sc0.y >> cs}, b1[2] = {sc1.x >> cs, sc1.y >> cs};
      uint32_t a[STEPS][4];
#pragma unroll
      for (int s = 0; s < STEPS; ++s) {
        const uint2 w = st.ws[(wg * STEPS + s) * THREADS + wt];
        const uint2 t0w = table[(b0[s >> 1] >> (16 * (s & 1))) & 0x7Fu];
        const uint2 t1w = table[(b1[s >> 1] >> (16 * (s & 1))) & 0x7Fu];
        lab_gemm::decode_fp8_word(w.x, t0w.x, t0w.y, a[s][0], a[s][2]);
        lab_gemm::decode_fp8_word(w.y, t1w.x, t1w.y, a[s][1], a[s][3]);
      }
      const uint64_t desc = desc0 + stage * (uint32_t)(sizeof(St) / 16);
      lab_gemm::wgmma_fence();
#pragma unroll
      for (int s = 0; s < STEPS; ++s) WgmmaE4M3<F>::run(tmp, a[s], desc + s * (T * 2), s);
      lab_gemm::wgmma_commit();
      lab_gemm::wgmma_wait<0>();
      lab_gemm::fence_acc(tmp);
#pragma unroll
      for (int s = 0; s < STEPS; ++s)  // the A registers stay allocated until the wgmmas retire
        asm volatile("" ::"r"(a[s][0]), "r"(a[s][1]), "r"(a[s][2]), "r"(a[s][3]));
      promote_sub<F, F, 0>(acc, tmp, st.sx, c);
      lab_gemm::mbar_arrive(empty0 + 8 * stage);  // this thread is done with the stage
      if (++stage == STAGES) stage = 0;
    }
    }
    if constexpr (U < T)
      epi.template store<true>(acc, acc, factor, row0, valid, bw, warp, g, c, e, G, sximg);
    else
      epi.template store<true>(acc, tmp, factor, row0, valid, bw, warp, g, c, e, G, sximg);
  }
  epi.finish();
}

// An epilogue of gemm_body's kind with the image body's hooks (none of them does anything)
template <class Store>
struct ImageEpi : Store {
  __device__ __forceinline__ void setup(int) {}
  __device__ __forceinline__ void start() {}
  __device__ __forceinline__ void finish() {}
};
// The bf16 output's: its non-finite count added once a thread is done
template <int T>
struct ImageEpiBf16 : StoreBf16<T> {
  uint32_t* __restrict__ nonfinite;
  __device__ __forceinline__ void setup(int) {}
  __device__ __forceinline__ void start() {}
  __device__ __forceinline__ void finish() {
    if (this->bad) atomicAdd(nonfinite, this->bad);
  }
};

template <int T, int STAGES = ImageStages<T>::value, bool AHEAD = false, bool BF16 = false, int U = T>
__global__ void __launch_bounds__(AHEAD ? IMAGE_AHEAD_THREADS : IMAGE_THREADS, 1)
    w4a8_gemm_image(const uint2* __restrict__ words, const uint8_t* __restrict__ scales,
                    const uint2* __restrict__ tables, const int* __restrict__ table_of, const int* __restrict__ p,
                    const float* __restrict__ alpha, const uint8_t* __restrict__ ximg,
                    const float* __restrict__ sximg, const int* __restrict__ offsets, void* __restrict__ out, int N,
                    int K, uint32_t* __restrict__ nonfinite) {
  if constexpr (BF16) {
    ImageEpiBf16<T> epi{{static_cast<uint16_t*>(out), N, 0u}, nonfinite};
    image_body<T, STAGES, AHEAD, decltype(epi), U>(words, scales, tables, table_of, p, alpha, ximg, sximg, offsets, N, K, epi);
  } else {
    ImageEpi<StoreOut<T>> epi{{static_cast<float*>(out), N}};
    image_body<T, STAGES, AHEAD, decltype(epi), U>(words, scales, tables, table_of, p, alpha, ximg, sximg, offsets, N, K, epi);
  }
}

#include "w4a8_split.inc"

// The SwiGLU + quantize epilogue on the image kernel (w4a8-fused's w13 at large batches): as
// SwigluQuant (the same a8 and s_a bits), with the cluster's exchange on mbarriers among the
// consumers alone, since the producer warp runs ahead into the next token block and a cluster
// barrier would wait for it. A 128-column group of I is two CTAs of 128 paired rows (a cluster of
// two along x). Per token block each CTA reduces its eight warps' |a| per token (shuffles, then
// shared memory and the consumers' named barrier), its thread t < T stores token t's maximum in
// its own `mine` and in the peer's `theirs` and arrives on the peer's `xbar` (release, cluster
// scope); every consumer thread then waits on its own `xbar` (acquire, cluster scope) and takes
// the larger of the two. Both by token-block parity: a CTA writes its peer's buffer b again only
// after the peer has sent it the next block's maximum, which the peer does after reading b.
__device__ __forceinline__ uint32_t cluster_peer_addr(uint32_t local, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  return remote;
}
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

template <int T>
struct ImageSwiglu {
  lab_w4a8_act::uint8_t* __restrict__ a8;  // (rows, I)
  float* __restrict__ s_a;                 // (rows, I / 128)
  uint32_t* __restrict__ nonfinite;
  const float* __restrict__ gate_global;
  const float* __restrict__ up_global;
  int I;
  float (*part)[T];    // [8 warps][T] shared
  float (*mine)[T];    // [2][T] shared: this CTA's maximum per token, by block parity
  float (*theirs)[T];  // [2][T] shared: the peer's, written by the peer
  float (*invs)[T];    // [2][T] shared: 448 / amax per token, by its owner thread (tid < T)
  uint64_t* xbar;      // [2] shared: the peer's T arrivals
  uint32_t k;          // token blocks done
  uint32_t bad;

  __device__ __forceinline__ void setup(int tid) {
    if (tid == 0) {
      lab_gemm::mbar_init(lab_gemm::smem_addr(&xbar[0]), T);
      lab_gemm::mbar_init(lab_gemm::smem_addr(&xbar[1]), T);
    }
  }
  __device__ __forceinline__ void start() { cluster_sync(); }  // the peer's barriers initialized
  // The consumers leave together (the producer warp has exited: exited threads count as arrived),
  // so no CTA exits while its peer's last store into it may be in flight.
  __device__ __forceinline__ void finish() {
    if (bad) atomicAdd(nonfinite, bad);
    cluster_sync();
  }

  template <bool PROMOTE>
  __device__ __forceinline__ void store(const float (&acc)[T / 8][4], const float (&)[T / 8][4], float factor,
                                        size_t row0, int valid, int b, int warp, int g, int c, int e, int,
                                        const float* __restrict__) {
    static_assert(PROMOTE, "the fused epilogue takes the promoted sums");
    constexpr int F = T / 8;
    const int tid = threadIdx.x, wg = tid / THREADS;
    const float gs = gate_global[e], us = up_global[e];
    const int i = 32 * b + 8 * warp + g;  // b: the 64-row block (2 x + wg)
    float a[F][2];
#pragma unroll
    for (int j = 0; j < F; ++j)
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const float hg = acc[j][q] * factor, hu = acc[j][2 + q] * factor;  // the plain kernel's h
        a[j][q] = lab_w4a8_act::swiglu_f32(hg, hu, gs, us);
        const bool live = 8 * j + 2 * c + q < valid;
        bad += live && !(lab_w4a8_act::finite(hg) && lab_w4a8_act::finite(hu) && lab_w4a8_act::finite(a[j][q]));
        float m = live ? fabsf(a[j][q]) : 0.0f;
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        if (g == 0) part[4 * wg + warp][8 * j + 2 * c + q] = m;
      }
    lab_gemm::named_bar_sync<1, 2 * THREADS>();
    const uint32_t buf = k & 1u;
    if (tid < T) {
      float v = fmaxf(fmaxf(part[0][tid], part[1][tid]), fmaxf(part[2][tid], part[3][tid]));
      v = fmaxf(v, fmaxf(fmaxf(part[4][tid], part[5][tid]), fmaxf(part[6][tid], part[7][tid])));
      mine[buf][tid] = v;
      const uint32_t peer = cluster_rank() ^ 1u;
      const uint32_t dst = cluster_peer_addr(lab_gemm::smem_addr(&theirs[buf][tid]), peer);
      const uint32_t bar = cluster_peer_addr(lab_gemm::smem_addr(&xbar[buf]), peer);
      asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(dst), "f"(v) : "memory");
      asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(bar) : "memory");
    }
    lab_gemm::named_bar_sync<1, 2 * THREADS>();  // `mine` written; `part` read (free for the next block)
    {
      const uint32_t bar = lab_gemm::smem_addr(&xbar[buf]), parity = (k >> 1) & 1u;
      uint32_t done;
      do {
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
            " selp.u32 %0, 1, 0, p;\n}"
            : "=r"(done) : "r"(bar), "r"(parity) : "memory");
      } while (!done);
    }
    // Each token's scale and inverse once, by its owner thread, for the 64 threads that hold its
    // values (a round-to-nearest division is ~15 instructions: 32 a thread a block otherwise)
    const int G = I / 128, gi = b / CLUSTER;
    if (tid < T) {
      const float amax = fmaxf(fmaxf(0.0f, fmaxf(mine[buf][tid], theirs[buf][tid])), 0x1p-116f);
      invs[buf][tid] = __fdiv_rn(448.0f, amax);
      if (b % CLUSTER == 0 && tid < valid) s_a[(row0 + tid) * G + gi] = __fdiv_rn(amax, 448.0f);
    }
    lab_gemm::named_bar_sync<1, 2 * THREADS>();  // invs written
#pragma unroll
    for (int j = 0; j < F; ++j)
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int t = 8 * j + 2 * c + q;
        if (t < valid)
          a8[(row0 + t) * I + i] = (lab_w4a8_act::uint8_t)(
              lab_w4a8_act::e4m3x2(lab_w4a8_act::times_inv(a[j][q], invs[buf][t]), 0.0f) & 0xFFu);
      }
    ++k;
  }
};

// w13 on the image kernel with the SwiGLU + quantize epilogue (ImageSwiglu): w4a8_gemm_swiglu_wide's
// a8 and s_a, a cluster of two CTAs along x.
template <int T, int STAGES = ImageStages<T>::value, bool AHEAD = false>
__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(AHEAD ? IMAGE_AHEAD_THREADS : IMAGE_THREADS, 1)
    w4a8_gemm_image_swiglu(const uint2* __restrict__ words, const uint8_t* __restrict__ scales,
                           const uint2* __restrict__ tables, const int* __restrict__ table_of,
                           const int* __restrict__ p, const float* __restrict__ alpha,
                           const uint8_t* __restrict__ ximg, const float* __restrict__ sximg,
                           const int* __restrict__ offsets, int N, int K, const float* __restrict__ gate_global,
                           const float* __restrict__ up_global, uint8_t* __restrict__ a8, float* __restrict__ s_a,
                           uint32_t* __restrict__ nonfinite) {
  __shared__ float part[8][T];
  __shared__ float mine[2][T], theirs[2][T], invs[2][T];
  __shared__ __align__(8) uint64_t xbar[2];
  ImageSwiglu<T> epi{a8, s_a, nonfinite, gate_global, up_global, N / 2, part, mine, theirs, invs, xbar, 0u, 0u};
  image_body<T, STAGES, AHEAD>(words, scales, tables, table_of, p, alpha, ximg, sximg, offsets, N, K, epi);
}

// ------------------------------------------------------------------------------ the layer in one launch
//
// w4a8_layer (w4a8-layer): w13 with the SwiGLU + quantize epilogue, then w2 writing the bf16
// output, as one persistent launch of two-warpgroup CTAs (the grid is what fits on the device at
// once). Units, claimed in order from one counter, expert-major so that each expert's w13 is done
// early:
//   w13 unit (expert e, token block, group ig of I): the 256 paired rows of one 128-column group of
//       I as two 128-row sub-blocks, 64-row blocks 4 ig + 2 h + wg for h = 0, 1 (the fused wide
//       kernel's cluster of two, here one CTA in turn). Each sub-block's SwiGLU values stay in
//       registers until both are done; the group's amax per token then comes from both through
//       shared memory, and a8, s_a are written as w4a8_gemm_swiglu_wide writes them: the same bits.
//   w2 unit (e, token block, 128-row block of H): those rows of out, bf16 (nvfp4_act.cuh
//       bf16x2_bits, the conversion the other variants' to_bf16 applies to the same fp32 values),
//       once ready[e] counts every w13 unit of e.
// A token block is T tokens of one expert; expert e's blocks are first_block[e] .. first_block[e+1]
// - 1 of all (prefix sums of ceil(count / T), which each CTA works out from offsets as it starts),
// so no unit is empty. sync = [claim counter, CTAs done, ready[0 .. E-1]], zero before the launch.
// Each w13 unit of e adds one to ready[e] after its a8 / s_a writes (every thread's fence, the
// CTA's barrier, then a release add). A w2 unit of e copies activations only after its thread 0
// has seen ready[e] reach blocks(e) x I / 128 with an acquire, and after the CTA's barrier each
// thread acquires the count again for its own copies.
// No deadlock: every w13 unit precedes every w2 unit in the claim order, and a w13 unit never
// waits. A CTA claims its next unit while it works on the current one, so a CTA waiting on
// ready[e] holds w2 units only, and it waits on w13 units that running CTAs hold and finish.
// Units nobody has claimed belong to nobody. The last CTA out zeroes sync, so launches and graph
// replays need no host work.
// Measured slower than w4a8's separate launches (H200: +13% at 1 token per expert, +5% at 8;
// results/studies/w4a8_layer_and_smem_a_h200.json). Not profiled; likely each unit's ring
// starting empty, where the separate launches overlap many CTAs' starts (notes/w4a8.md).

constexpr int LAYER_MAX_EXPERTS = 1024;  // first_block in static shared memory (4 KiB)

template <int T>
struct LayerStages {  // the ring, dynamic shared memory: 41.5, 44.5 and 52.5 KiB
  static constexpr int value = 4;
};

// first_block[0 .. E] = prefix sums of the experts' token blocks, by the CTA's 256 threads (four
// experts each, E <= 1024); returns after a barrier.
template <int T>
__device__ __forceinline__ void block_prefix(const int* __restrict__ offsets, int E, int* first_block, int* warp_sum) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int n[4], s = 0;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int e = 4 * tid + q;
    n[q] = e < E ? (offsets[e + 1] - offsets[e] + T - 1) / T : 0;
    s += n[q];
  }
  int incl = s;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += v;
  }
  if (lane == 31) warp_sum[warp] = incl;
  __syncthreads();
  int before = incl - s;
  for (int w = 0; w < warp; ++w) before += warp_sum[w];
  if (tid == 0) first_block[0] = 0;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    before += n[q];
    if (4 * tid + q < E) first_block[4 * tid + q + 1] = before;
  }
  __syncthreads();
}

// The expert that token block `blk` belongs to: the largest e with first_block[e] <= blk.
__device__ __forceinline__ int expert_of(const int* first_block, int E, int blk) {
  int lo = 0, hi = E - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (first_block[mid] <= blk) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

template <int T, int STAGES = LayerStages<T>::value>
__global__ void __launch_bounds__(2 * THREADS, 2)  // two CTAs an SM: 128 registers at most
    w4a8_layer(const uint2* __restrict__ words13, const uint8_t* __restrict__ scales13,
               const uint2* __restrict__ tables13, const int* __restrict__ table_of13, const int* __restrict__ p13,
               const float* __restrict__ alpha13, const uint2* __restrict__ words2,
               const uint8_t* __restrict__ scales2, const uint2* __restrict__ tables2,
               const int* __restrict__ table_of2, const int* __restrict__ p2, const float* __restrict__ alpha2,
               const uint8_t* __restrict__ x8, const float* __restrict__ s_x, const int* __restrict__ offsets,
               int E, int H, int I, const float* __restrict__ gate_global, const float* __restrict__ up_global,
               uint8_t* __restrict__ a8, float* __restrict__ s_a, uint16_t* __restrict__ out,
               uint32_t* __restrict__ nonfinite, int* __restrict__ sync) {
  constexpr int F = T / 8, W = 2;
  constexpr bool PROMOTE = true;
  using St = Stage<T, W>;
  static_assert(T == 8 || T == 16 || T == 32, "the layer's token tiles: 8, 16, 32");
  static_assert(sizeof(St) % 128 == 0 && St::SX + 4 * T <= sizeof(St), "a stage's layout");
  extern __shared__ __align__(128) uint8_t ring_dynamic[];
  St* const ring = reinterpret_cast<St*>(ring_dynamic);
  __shared__ uint2 table[128];
  __shared__ int first_block[LAYER_MAX_EXPERTS + 1];
  __shared__ float part[8][T];
  __shared__ int warp_sum[8];
  __shared__ int next_unit[2];

  const int tid = threadIdx.x, wg = tid / THREADS, wt = tid % THREADS;
  const int warp = wt >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
  int* const ready = sync + 2;
  if (tid == 0) next_unit[0] = atomicAdd(&sync[0], 1);
  block_prefix<T>(offsets, E, first_block, warp_sum);  // (its barriers publish next_unit[0])
  const int blocks = first_block[E], NG = I / GROUP_K, NH = H / (2 * ROWS);
  const int units13 = blocks * NG, units = units13 + blocks * NH;
  const int G13 = (H + GROUP_K - 1) / GROUP_K;
  uint32_t bad = 0;

  for (int slot = 0;; slot ^= 1) {
    const int u = next_unit[slot];  // written before a barrier this thread has passed
    if (u >= units) break;
    if (tid == 0) next_unit[slot ^ 1] = atomicAdd(&sync[0], 1);  // the claim's latency under this unit
    const bool w13 = u < units13;
    const int blk = w13 ? u / NG : (u - units13) / NH;
    const int e = expert_of(first_block, E, blk);
    const int r0 = offsets[e], count = offsets[e + 1] - r0;
    const int t0 = (blk - first_block[e]) * T, valid = min(T, count - t0);
    const size_t row0 = (size_t)r0 + t0;
    float tmp[F][4], acc[F][4];
#pragma unroll
    for (int j = 0; j < F; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) tmp[j][i] = 0.0f;

    __syncthreads();  // every thread past the previous unit's reads of the ring, the table and part
    if (tid < 128) table[tid] = w13 ? tables13[(size_t)table_of13[e] * 128 + tid] : tables2[(size_t)table_of2[e] * 128 + tid];

    if (w13) {
      const int ig = u % NG;
      const float factor = ldexpf(alpha13[e], p13[e]);
      const float gs = gate_global[e], us = up_global[e];
      float a[2][F][2], m[F][2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int bw = 4 * ig + 2 * h + wg;  // the warpgroup's 64-row block of the paired w13
        const uint2* wp = words13 + (size_t)(e * (2 * I / ROWS) + bw) * (H / STEP_K) * THREADS;
        const uint8_t* sp = scales13 + (size_t)(e * (2 * I / ROWS) + bw) * G13 * (ROWS * 8);
        if (h == 1) __syncthreads();  // every thread past the first sub-block's reads of the ring
#pragma unroll
        for (int j = 0; j < F; ++j)
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[j][i] = 0.0f;
        const GroupLoader<T, W> loader(x8, s_x, wp, sp, row0, valid, H, G13, tid);
        {
          const int G = G13, K = H;
#include "w4a8_block.inc"
        }
#pragma unroll
        for (int j = 0; j < F; ++j)
#pragma unroll
          for (int q = 0; q < 2; ++q) {  // SwigluQuant's arithmetic, on the h the plain kernel writes
            const float hg = acc[j][q] * factor, hu = acc[j][2 + q] * factor;
            a[h][j][q] = lab_w4a8_act::swiglu_f32(hg, hu, gs, us);
            const bool live = 8 * j + 2 * c + q < valid;
            bad += live && !(lab_w4a8_act::finite(hg) && lab_w4a8_act::finite(hu) && lab_w4a8_act::finite(a[h][j][q]));
            const float v = live ? fabsf(a[h][j][q]) : 0.0f;
            m[j][q] = h == 0 ? v : fmaxf(m[j][q], v);
          }
      }
      // the group's amax per token: this thread's two columns, the eight g of its warp, the
      // CTA's eight warps (fmaxf: exact and order-free, so the cluster kernel's value)
#pragma unroll
      for (int j = 0; j < F; ++j)
#pragma unroll
        for (int q = 0; q < 2; ++q) {
#pragma unroll
          for (int o = 4; o < 32; o <<= 1) m[j][q] = fmaxf(m[j][q], __shfl_xor_sync(0xffffffffu, m[j][q], o));
          if (g == 0) part[4 * wg + warp][8 * j + 2 * c + q] = m[j][q];
        }
      __syncthreads();
#pragma unroll
      for (int j = 0; j < F; ++j)
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          const int t = 8 * j + 2 * c + q;
          float mt = 0.0f;
#pragma unroll
          for (int w = 0; w < 8; ++w) mt = fmaxf(mt, part[w][t]);
          const float amax = fmaxf(mt, 0x1p-116f);
          const float inv = __fdiv_rn(448.0f, amax);
          if (t < valid) {
#pragma unroll
            for (int h = 0; h < 2; ++h)
              a8[(row0 + t) * I + 32 * (4 * ig + 2 * h + wg) + 8 * warp + g] =
                  (uint8_t)(lab_w4a8_act::e4m3x2(lab_w4a8_act::times_inv(a[h][j][q], inv), 0.0f) & 0xFFu);
            if (wg == 0 && warp == 0 && g == 0) s_a[(row0 + t) * NG + ig] = __fdiv_rn(amax, 448.0f);
          }
        }
      __threadfence();  // this thread's a8 / s_a, before the release below
      __syncthreads();
      if (tid == 0) lab_gemm::red_release_add(ready + e, 1);
    } else {
      const int bw = 2 * ((u - units13) % NH) + wg;  // the warpgroup's 64-row block of H
      const int need = (first_block[e + 1] - first_block[e]) * NG;
      if (tid == 0)
        while (lab_gemm::load_acquire(ready + e) < need) __nanosleep(128);
      __syncthreads();
      (void)lab_gemm::load_acquire(ready + e);  // this thread's own acquire, before its copies of a8
      const float factor = ldexpf(alpha2[e], p2[e]);
      const uint2* wp = words2 + (size_t)(e * (H / ROWS) + bw) * (I / STEP_K) * THREADS;
      const uint8_t* sp = scales2 + (size_t)(e * (H / ROWS) + bw) * NG * (ROWS * 8);
#pragma unroll
      for (int j = 0; j < F; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[j][i] = 0.0f;
      const GroupLoader<T, W> loader(a8, s_a, wp, sp, row0, valid, I, NG, tid);
      {
        const int G = NG, K = I;
#include "w4a8_block.inc"
      }
      uint16_t* o = out + row0 * (size_t)H + bw * ROWS + 16 * warp + g;
#pragma unroll
      for (int j = 0; j < F; ++j)
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          const int col = 8 * j + 2 * c + q;
          if (col < valid) {  // rows g and g + 8 of the warp: the pair's low and high halves
            const uint32_t bits = lab_act::bf16x2_bits(acc[j][q] * factor, acc[j][2 + q] * factor);
            bad += lab_act::bf16x2_nonfinite(bits);
            o[(size_t)col * H] = (uint16_t)(bits & 0xFFFFu);
            o[(size_t)col * H + 8] = (uint16_t)(bits >> 16);
          }
        }
    }
  }
  if (bad) atomicAdd(nonfinite, bad);
  __syncthreads();
  if (tid == 0) {  // the last CTA out zeroes the counters for the next launch
    __threadfence();
    if (atomicAdd(&sync[1], 1) == (int)gridDim.x - 1) {
      for (int e = 0; e < E; ++e) ready[e] = 0;
      sync[0] = 0;
      sync[1] = 0;
      __threadfence();
    }
  }
}

}  // namespace lab_w4a8

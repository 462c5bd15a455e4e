// NVFP4 x NVFP4 block-scaled grouped GEMM for sm_90 (no FP4 tensor cores).
//
//   out[r, n] = alpha[e] * sum_k xdec[r, k] * wdec[e, n, k]      for offsets[e] <= r < offsets[e+1]
//
// xdec / wdec are e2m1 x e4m3 (the global scales live in alpha). e2m1 x e4m3 is exact in fp16,
// products of two fp16 are exact in fp32, so the tensor cores compute exactly the NVFP4 product
// and only the fp32 accumulation rounds.
//
// Operand swap: weight rows fill the M side of mma.m16n8k16 and tokens its 8-wide N side, so a
// handful of tokens wastes at most 7 columns of an 8-wide fragment instead of 120 rows of 128.
//
// CTA = W consumer warps + 1 producer warp + DW activation-decoder warps (2 for token tiles of
// 32 or more); a unit of work is one (expert, block of BN = W*R*16 weight rows).
//   producer: per stage, one TMA tensor copy of the stage's prepared weights (evict-first; the
//             map in lab/kernels/tensor_map.py makes a whole stage one box), plus cp.async of
//             the stage's raw NVFP4 activation rows (L2 resident), all completing on the
//             stage's `full` mbarrier; STAGES deep.
//   decoders: turn the stage's raw activations into fp16 B operands (mma.sync fragments, or
//             wgmma core matrices), then arrive on `full` (weights' bytes + decoders = ready).
//   consumers: each warp streams its R row tiles: 16-byte LDS of codes, bit decode, e4m3
//             scale via cvt and one HMUL2 per pair, then mma.sync m16n8k16 per 8-token fragment
//             (MMA = 0) or one wgmma m64n(8F)k16 per warpgroup and row-tile index (MMA = 1).
//             The fragment count F is dispatched once per stage to a compile-time body.
//             Each consumer thread arrives on `empty` when done with the stage.
//   Unit ring: the producer publishes each claimed unit in a small shared ring; consumers and
//   decoders read it at the unit's first stage, through that stage's barriers.
//   Experts with more than 8*FMAX tokens take several passes over their weights.
//   Persistent: the grid is sized to the resident CTAs; each CTA claims units (expert with tokens,
//   row block) from a device counter, and its pipeline runs on across unit boundaries.
//   Dynamic shared memory = Config::SMEM + 4 * (num_experts0 + num_experts1) (compacted experts).
//   Two problems (w13 and w2, say) may share one launch: their units are claimed from one
//   counter, problem 0's first. Plain, the kernel does not order them: a unit of problem 1 may
//   read activations that problem 0 of the same launch has not written (the one-launch-2G
//   ceiling).
//   FUSE (below, at the epilogue warps): problem 0 is w13 ending in SwiGLU + quantize; with bit 1
//   problem 1 is w2 on its output and the launch is the whole layer. A w2 unit of expert e lets
//   its producer copy activations only once ready[e] counts every (w13 block, pass, epilogue
//   warp) of e: writers publish with a fence and a release add, the producer's lanes acquire.
//   No deadlock: units are claimed in order, all of w13 before any of w2, so a CTA waiting on
//   ready[e] waits only for w13 units already claimed by running CTAs; those units' stages were
//   all issued before their CTA's producer reached any w2 unit, and their consumers and
//   epilogue warps never wait on a w2 unit. Units not yet claimed belong to nobody. The last
//   CTA to finish zeroes the unit counter and ready[], so launches and graph replays need no
//   host work.
//
// Prepared weight layout (lab/kernels/grouped_gemm.py, prepare_weights): atoms of 16 rows x 64 k,
// 576 bytes each, ordered [expert][BN-row block][BK chunk][16-row tile][k atom] (one stage is
// one contiguous run):
//   bytes [0, 512):   lane L = 4g + t holds 16 bytes: word j (k16 step j) = the 8 codes of its
//                     mma A fragment (rows g, g+8; k slots 2t, 2t+1, 2t+8, 2t+9, slot c being
//                     k = K_SLOTS[c] of the step, the order decode_x gives the activations),
//                     bit-encoded so that decode_a() turns them into four fp16x2 registers.
//   bytes [512, 576): group g's 8 bytes: e4m3 scales s(g, j), s(g+8, j) for j = 0..3.
// Decoded weights and activations are v * s * 2^-14 (exact in fp16, subnormals included); the
// epilogue multiplies the fp32 accumulator by 2^28 (exact) and then by alpha.

// No system headers: NVRTC compiles this as is (jit.source() inlines nvfp4_act.cuh); fp16
// arithmetic goes through inline PTX.
#include "nvfp4_act.cuh"

namespace lab_gemm {

typedef unsigned char uint8_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
typedef unsigned long long size_t;

constexpr int ATOM_BYTES = 576;
// Both operands are decoded to v * s * 2^-14 (exact in fp16, subnormals included), so the fp32
// accumulator holds the product times 2^-28; the epilogue's multiply by 2^28 is exact.
constexpr float ACC_SCALE = 268435456.0f;
constexpr int ATOM_CODE_BYTES = 512;

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  } while (!done);
}
// For warps off the critical path (the SwiGLU epilogue): sleep between polls, so that waiting
// for the next h tile does not take issue slots from the consumers, which are issue bound.
__device__ __forceinline__ void mbar_wait_sleep(uint32_t bar, uint32_t parity) {
  uint32_t done;
  for (;;) {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    if (done) return;
    __nanosleep(1000);
  }
}
__device__ __forceinline__ void cp_async_arrive_noinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}
// Stage `stage` of a weight tensor map (box = one whole stage, lab/kernels/tensor_map.py) into
// shared memory at dst (128-byte aligned). The same bytes in the same order as one 1-D
// cp.async.bulk of the stage, but the tensor path streams faster: +2 points of the read roofline
// at @8, +6-7 at @2 (results/probes_gemm_v13.json, runs E and F).
__device__ __forceinline__ void tensor_copy_stage(uint32_t dst, const void* map, int stage, uint32_t bar,
                                                  uint64_t pol) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%2, %3, %4}], [%5], %6;"
      ::"r"(dst), "l"(map), "r"(0), "r"(0), "r"(stage), "r"(bar), "l"(pol) : "memory");
}
template <int BYTES>
__device__ __forceinline__ void cp_async(uint32_t dst, const void* src) {
  if constexpr (BYTES == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(dst), "l"(src), "n"(BYTES) : "memory");
  }
}
__device__ __forceinline__ void named_barrier(int id, int nthreads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(nthreads) : "memory");
}

__device__ __forceinline__ void mma16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t two_bytes) {
  uint32_t r;
  asm("{\n .reg .b16 lo;\n cvt.u16.u32 lo, %1;\n cvt.rn.f16x2.e4m3x2 %0, lo;\n}" : "=r"(r) : "r"(two_bytes));
  return r;
}
// The same for the word's upper two bytes: F2FP reads a register's high half directly (.H1), so
// this costs no shift (one ALU instruction less per odd k16 step of every weight tile).
__device__ __forceinline__ uint32_t e4m3x2_hi_to_f16x2(uint32_t word) {
  uint32_t r;
  asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, hi;\n}" : "=r"(r) : "r"(word));
  return r;
}
// fp16x2 multiply (IEEE, subnormals kept: mul.f16x2 has no flush-to-zero unless asked).
__device__ __forceinline__ uint32_t hmul2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
// a * (low half of s, broadcast) and a * (high half of s, broadcast); ptxas folds the
// broadcast into the HMUL2 operand selector.
__device__ __forceinline__ uint32_t hmul2_lo(uint32_t a, uint32_t s) {
  uint32_t d;
  asm("{\n .reg .b16 lo, hi;\n .reg .b32 bb;\n mov.b32 {lo, hi}, %2;\n mov.b32 bb, {lo, lo};\n"
      " mul.rn.f16x2 %0, %1, bb;\n}" : "=r"(d) : "r"(a), "r"(s));
  return d;
}
__device__ __forceinline__ uint32_t hmul2_hi(uint32_t a, uint32_t s) {
  uint32_t d;
  asm("{\n .reg .b16 lo, hi;\n .reg .b32 bb;\n mov.b32 {lo, hi}, %2;\n mov.b32 bb, {hi, hi};\n"
      " mul.rn.f16x2 %0, %1, bb;\n}" : "=r"(d) : "r"(a), "r"(s));
  return d;
}

// One word of 8 prepared codes -> four fp16x2 registers holding v * 2^-14: eight bit operations
// (four shifts, four LOP3) for eight codes. An fp16 with e2m1's exponent and mantissa at bits
// 11..9 and its sign at bit 15 is exactly v * 2^-14 (e2m1's subnormal 0.5 lands on fp16's).
// Each output is mask & (one shifted copy) or mask & (word ^ one shifted copy); prepare_weights
// stores the word through the inverse of this GF(2)-linear map, so output q carries the two
// codes of fp16x2 register q. (One shift per pair cannot work: translates of the bit set
// {9, 10, 11, 15} do not tile 16 bits; no 7-op form of this kind exists either.)
constexpr uint32_t DECODE_MASK = 0x8E008E00u;
__device__ __forceinline__ void decode_a(uint32_t w, uint32_t& p0, uint32_t& p1, uint32_t& p2, uint32_t& p3) {
  p0 = (w << 6) & DECODE_MASK;
  p1 = (w << 9) & DECODE_MASK;
  p2 = (w ^ (w << 2)) & DECODE_MASK;
  p3 = (w ^ (w >> 3)) & DECODE_MASK;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
template <int FMAX>
__device__ __forceinline__ void fence_acc(float (&c)[FMAX][4]) {
#pragma unroll
  for (int f = 0; f < FMAX; ++f)
    asm volatile("" : "+f"(c[f][0]), "+f"(c[f][1]), "+f"(c[f][2]), "+f"(c[f][3])::"memory");
}
// Shared-memory matrix descriptor, no swizzle: start, LBO (next core matrix along K), SBO (next
// core matrix along N), all in 16-byte units.
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return (uint64_t)((addr >> 4) & 0x3FFFu) | ((uint64_t)((lbo >> 4) & 0x3FFFu) << 16) |
         ((uint64_t)((sbo >> 4) & 0x3FFFu) << 32);
}

// wgmma m64n(8F)k16, f32 += f16 x f16, A from registers (this warp's 16 rows, the mma.m16n8k16
// A fragment), B (K-major, no swizzle) by descriptor. Accumulates (scale-d = 1). Generated for
// F = 1..8 so that the token count picks the instruction's N at run time.
template <int F, int FMAX> struct Wgmma;
template <int FMAX> struct Wgmma<1, FMAX> {
  static __device__ __forceinline__ void run(float (&c)[FMAX][4], uint32_t a0, uint32_t a1, uint32_t a2,
                                             uint32_t a3, uint64_t desc) {
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, 1, 0;\n wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1, 0;\n}\n"
                 : "+f"(c[0][0]), "+f"(c[0][1]), "+f"(c[0][2]), "+f"(c[0][3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));
  }
};
template <int FMAX> struct Wgmma<2, FMAX> {
  static __device__ __forceinline__ void run(float (&c)[FMAX][4], uint32_t a0, uint32_t a1, uint32_t a2,
                                             uint32_t a3, uint64_t desc) {
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, 1, 0;\n wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"
                 : "+f"(c[0][0]), "+f"(c[0][1]), "+f"(c[0][2]), "+f"(c[0][3]), "+f"(c[1][0]), "+f"(c[1][1]), "+f"(c[1][2]), "+f"(c[1][3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));
  }
};
template <int FMAX> struct Wgmma<3, FMAX> {
  static __device__ __forceinline__ void run(float (&c)[FMAX][4], uint32_t a0, uint32_t a1, uint32_t a2,
                                             uint32_t a3, uint64_t desc) {
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, 1, 0;\n wgmma.mma_async.sync.aligned.m64n24k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11}, {%12, %13, %14, %15}, %16, p, 1, 1, 0;\n}\n"
                 : "+f"(c[0][0]), "+f"(c[0][1]), "+f"(c[0][2]), "+f"(c[0][3]), "+f"(c[1][0]), "+f"(c[1][1]), "+f"(c[1][2]), "+f"(c[1][3]), "+f"(c[2][0]), "+f"(c[2][1]), "+f"(c[2][2]), "+f"(c[2][3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));
  }
};
template <int FMAX> struct Wgmma<4, FMAX> {
  static __device__ __forceinline__ void run(float (&c)[FMAX][4], uint32_t a0, uint32_t a1, uint32_t a2,
                                             uint32_t a3, uint64_t desc) {
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, 1, 0;\n wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
                 : "+f"(c[0][0]), "+f"(c[0][1]), "+f"(c[0][2]), "+f"(c[0][3]), "+f"(c[1][0]), "+f"(c[1][1]), "+f"(c[1][2]), "+f"(c[1][3]), "+f"(c[2][0]), "+f"(c[2][1]), "+f"(c[2][2]), "+f"(c[2][3]), "+f"(c[3][0]), "+f"(c[3][1]), "+f"(c[3][2]), "+f"(c[3][3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));
  }
};
template <int FMAX> struct Wgmma<5, FMAX> {
  static __device__ __forceinline__ void run(float (&c)[FMAX][4], uint32_t a0, uint32_t a1, uint32_t a2,
                                             uint32_t a3, uint64_t desc) {
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, 1, 0;\n wgmma.mma_async.sync.aligned.m64n40k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19}, {%20, %21, %22, %23}, %24, p, 1, 1, 0;\n}\n"
                 : "+f"(c[0][0]), "+f"(c[0][1]), "+f"(c[0][2]), "+f"(c[0][3]), "+f"(c[1][0]), "+f"(c[1][1]), "+f"(c[1][2]), "+f"(c[1][3]), "+f"(c[2][0]), "+f"(c[2][1]), "+f"(c[2][2]), "+f"(c[2][3]), "+f"(c[3][0]), "+f"(c[3][1]), "+f"(c[3][2]), "+f"(c[3][3]), "+f"(c[4][0]), "+f"(c[4][1]), "+f"(c[4][2]), "+f"(c[4][3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));
  }
};
template <int FMAX> struct Wgmma<6, FMAX> {
  static __device__ __forceinline__ void run(float (&c)[FMAX][4], uint32_t a0, uint32_t a1, uint32_t a2,
                                             uint32_t a3, uint64_t desc) {
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, 1, 0;\n wgmma.mma_async.sync.aligned.m64n48k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23}, {%24, %25, %26, %27}, %28, p, 1, 1, 0;\n}\n"
                 : "+f"(c[0][0]), "+f"(c[0][1]), "+f"(c[0][2]), "+f"(c[0][3]), "+f"(c[1][0]), "+f"(c[1][1]), "+f"(c[1][2]), "+f"(c[1][3]), "+f"(c[2][0]), "+f"(c[2][1]), "+f"(c[2][2]), "+f"(c[2][3]), "+f"(c[3][0]), "+f"(c[3][1]), "+f"(c[3][2]), "+f"(c[3][3]), "+f"(c[4][0]), "+f"(c[4][1]), "+f"(c[4][2]), "+f"(c[4][3]), "+f"(c[5][0]), "+f"(c[5][1]), "+f"(c[5][2]), "+f"(c[5][3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));
  }
};
template <int FMAX> struct Wgmma<7, FMAX> {
  static __device__ __forceinline__ void run(float (&c)[FMAX][4], uint32_t a0, uint32_t a1, uint32_t a2,
                                             uint32_t a3, uint64_t desc) {
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, 1, 0;\n wgmma.mma_async.sync.aligned.m64n56k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27}, {%28, %29, %30, %31}, %32, p, 1, 1, 0;\n}\n"
                 : "+f"(c[0][0]), "+f"(c[0][1]), "+f"(c[0][2]), "+f"(c[0][3]), "+f"(c[1][0]), "+f"(c[1][1]), "+f"(c[1][2]), "+f"(c[1][3]), "+f"(c[2][0]), "+f"(c[2][1]), "+f"(c[2][2]), "+f"(c[2][3]), "+f"(c[3][0]), "+f"(c[3][1]), "+f"(c[3][2]), "+f"(c[3][3]), "+f"(c[4][0]), "+f"(c[4][1]), "+f"(c[4][2]), "+f"(c[4][3]), "+f"(c[5][0]), "+f"(c[5][1]), "+f"(c[5][2]), "+f"(c[5][3]), "+f"(c[6][0]), "+f"(c[6][1]), "+f"(c[6][2]), "+f"(c[6][3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));
  }
};
template <int FMAX> struct Wgmma<8, FMAX> {
  static __device__ __forceinline__ void run(float (&c)[FMAX][4], uint32_t a0, uint32_t a1, uint32_t a2,
                                             uint32_t a3, uint64_t desc) {
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, 1, 0;\n wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
                 : "+f"(c[0][0]), "+f"(c[0][1]), "+f"(c[0][2]), "+f"(c[0][3]), "+f"(c[1][0]), "+f"(c[1][1]), "+f"(c[1][2]), "+f"(c[1][3]), "+f"(c[2][0]), "+f"(c[2][1]), "+f"(c[2][2]), "+f"(c[2][3]), "+f"(c[3][0]), "+f"(c[3][1]), "+f"(c[3][2]), "+f"(c[3][3]), "+f"(c[4][0]), "+f"(c[4][1]), "+f"(c[4][2]), "+f"(c[4][3]), "+f"(c[5][0]), "+f"(c[5][1]), "+f"(c[5][2]), "+f"(c[5][3]), "+f"(c[6][0]), "+f"(c[6][1]), "+f"(c[6][2]), "+f"(c[6][3]), "+f"(c[7][0]), "+f"(c[7][1]), "+f"(c[7][2]), "+f"(c[7][3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));
  }
};

// Raw NVFP4 word (codes of k = 0..7, standard order) -> fp16x2 of v * 2^-14 for k = A and
// A + 4 (16 bits apart in the word, as the two halves of an fp16x2 are): exponent and mantissa
// 4A..4A+2 -> 9..11 and the sign 4A+3 -> 15, both halves at once, so two shifts and two LOP3.
// Register A fills MMA k slots 2A and 2A+1, hence K_SLOTS (grouped_gemm.py), which
// prepare_weights applies to the weights so that both operands agree.
template <int A>
__device__ __forceinline__ uint32_t decode_x(uint32_t x) {
  constexpr int EM = 9 - 4 * A, SG = 12 - 4 * A;
  const uint32_t em = EM >= 0 ? x << (EM & 31) : x >> (-EM & 31);
  const uint32_t sg = SG >= 0 ? x << (SG & 31) : x >> (-SG & 31);
  return (em & 0x0E000E00u) | (sg & 0x80008000u);
}

// MMA: 0 = mma.sync m16n8k16 per 8-token fragment; 1 = wgmma m64n(8F)k16 per warpgroup (tokens as
// N, B from shared memory in core matrices: LBO = next core matrix along K, SBO = along N; the
// exchanged descriptor was measured wrong on the H200).
template <int W, int R, int BK, int STAGES, int FMAX, int MMA, int FUSE = 0>
struct Config {
  // activation-decoder warps: a third for 64-token tiles (+1.5 points at @32); not with the fused
  // epilogue, whose extra warps would then push registers below what the accumulators need.
  // Fused CTAs of small token tiles take two and one epilogue warp (same 8 warps): fused-layer
  // @8 12-20 us faster; the plain 6-warp CTA gains nothing from a second one (notes/layer.md).
  static constexpr int DW = FMAX >= 8 && FUSE == 0 ? 3 : FMAX >= 4 || FUSE != 0 ? 2 : 1;
  // SwiGLU epilogue warps: they fill the CTA's last group of four warps (ptxas budgets registers
  // for whole groups, so a fifth group would cut every thread's registers)
  static constexpr int EW = !(FUSE & 1) ? 0 : (W + 1 + DW) % 4 ? 4 - (W + 1 + DW) % 4 : 2;
  static constexpr int BN = W * R * 16;
  static constexpr int KATOMS = BK / 64;
  static constexpr int KSTEPS = BK / 16;
  static constexpr int TOKENS = 8 * FMAX;
  static constexpr int STAGE_W = W * R * KATOMS * ATOM_BYTES;
  static constexpr int STAGE_XQ = TOKENS * (BK / 2);
  static constexpr int STAGE_XS = TOKENS * (BK / 16);
  static constexpr int XF = FMAX * KSTEPS * 32 * 8;  // fp16 B fragments of one stage
  // wgmma: k16 steps per commit group. A whole atom where registers allow (the group's and the
  // previous group's A fragments live at once: 8 * R * GS registers); ptxas serializes every wgmma
  // of a kernel short of them, and the CPU tests check that it does not
  static constexpr int GS = R >= 4 ? 1 : (FUSE & 2) ? 2 : 4;
  static constexpr int OFF_BAR = 0;  // full, empty, raw per stage; then epi_full, epi_empty
  static constexpr int OFF_W = 128 * (((3 * STAGES + 2) * 8 + 127) / 128);  // tensor copies: 128-B aligned
  static constexpr int OFF_XQ = OFF_W + STAGES * STAGE_W;
  static constexpr int OFF_XS = OFF_XQ + STAGES * STAGE_XQ;
  static constexpr int OFF_XF = 16 * ((OFF_XS + STAGES * STAGE_XS + 15) / 16);
  // FUSE: one pass's h tile, fp32 [token][BN + 4] (the pad spreads a fragment's 4 token rows
  // over distinct banks), handed from the consumers to the epilogue warps
  static constexpr int H_STRIDE = BN + 4;
  static constexpr int OFF_H = 16 * ((OFF_XF + STAGES * XF + 15) / 16);
  static constexpr int SMEM = OFF_H + (EW ? TOKENS * H_STRIDE * 4 : 0);
  static constexpr int THREADS = (W + 1 + DW + EW) * 32;
};

// The A fragment (rows g, g+8) of k16 step jj (compile-time after unrolling) of one atom: the
// word's eight codes, each pair times the block scale (v * 2^-14 and s are exact in fp16, and so
// is their product).
__device__ __forceinline__ void decode_tile(const uint4& code, const uint2& scl, int jj, uint32_t (&a)[4]) {
  const uint32_t word = jj == 0 ? code.x : jj == 1 ? code.y : jj == 2 ? code.z : code.w;
  const uint32_t sw = jj < 2 ? scl.x : scl.y;
  const uint32_t s2 = (jj & 1) ? e4m3x2_hi_to_f16x2(sw) : e4m3x2_to_f16x2(sw);
  uint32_t p0, p1, p2, p3;
  decode_a(word, p0, p1, p2, p3);
  a[0] = hmul2_lo(p0, s2);
  a[1] = hmul2_hi(p1, s2);
  a[2] = hmul2_lo(p2, s2);
  a[3] = hmul2_hi(p3, s2);
}

// One k atom of a consumer warp's R row tiles: its lane's 16 bytes of codes per tile (four k16
// steps of A fragments) and its group's 8 bytes of scales. Tile r*W + warp: the W warps' r-th
// tiles are consecutive (a warpgroup's 64 rows for wgmma).
template <int W, int R, int KATOMS>
__device__ __forceinline__ void load_atoms(uint4 (&code)[R], uint2 (&scl)[R], const uint8_t* wst, int ka, int warp,
                                           int lane) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const uint8_t* atom = wst + ((r * W + warp) * KATOMS + ka) * ATOM_BYTES;
    code[r] = *reinterpret_cast<const uint4*>(atom + lane * 16);
    scl[r] = *reinterpret_cast<const uint2*>(atom + ATOM_CODE_BYTES + (lane >> 2) * 8);
  }
}

// One pipeline stage of one consumer warp (mma.sync): R row tiles x BK of prepared weights
// against F fragments of decoded activations (fp16, in shared memory), accumulated into acc.
template <int W, int R, int BK, int FMAX, int F>
__device__ __forceinline__ void stage_math(float (&acc)[R][FMAX][4], const uint8_t* wst, const uint8_t* xf, int warp,
                                           int lane) {
  constexpr int KATOMS = BK / 64;
  constexpr int KSTEPS = BK / 16;
#pragma unroll
  for (int ka = 0; ka < KATOMS; ++ka) {
    uint4 code[R];
    uint2 scl[R];
    load_atoms<W, R, KATOMS>(code, scl, wst, ka, warp, lane);
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      const int j = ka * 4 + jj;
      uint2 b[F];
#pragma unroll
      for (int f = 0; f < F; ++f) b[f] = reinterpret_cast<const uint2*>(xf)[(f * KSTEPS + j) * 32 + lane];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        uint32_t a[4];
        decode_tile(code[r], scl[r], jj, a);
#pragma unroll
        for (int f = 0; f < F; ++f) mma16816(acc[r][f], a[0], a[1], a[2], a[3], b[f].x, b[f].y);
      }
    }
  }
}

// One pipeline stage of one consumer warpgroup (wgmma): per group of GS k16 steps, decode the
// A fragments of every row tile, then one wgmma per (step, 64-row group), all in one commit
// group. wait_group 1 then retires the previous group, so a group runs while the next one
// decodes; `hold` keeps the previous group's A registers allocated until it retires (the
// hardware reads them asynchronously). The stage ends with every group retired: a group left
// running across the consumer loop's branches makes ptxas serialize every wgmma of the kernel.
template <int W, int R, int BK, int FMAX, int GS, int F>
__device__ __forceinline__ void stage_wgmma(float (&acc)[R][FMAX][4], const uint8_t* wst, const uint8_t* xf, int warp,
                                            int lane) {
  constexpr int KATOMS = BK / 64;
  static_assert(4 % GS == 0, "a wgmma group takes 1, 2 or 4 k16 steps of one atom");
  const uint32_t xf_addr = smem_addr(xf);
  uint4 code[R];
  uint2 scl[R];
  auto load = [&](int ka) { load_atoms<W, R, KATOMS>(code, scl, wst, ka, warp, lane); };
  auto keep = [](const uint32_t (&h)[R][GS][4]) {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int q = 0; q < GS; ++q)
        asm volatile("" ::"r"(h[r][q][0]), "r"(h[r][q][1]), "r"(h[r][q][2]), "r"(h[r][q][3]));
  };
  uint32_t hold[R][GS][4];
  load(0);
#pragma unroll
  for (int ka = 0; ka < KATOMS; ++ka) {
#pragma unroll
    for (int jg = 0; jg < 4 / GS; ++jg) {
      uint32_t a[R][GS][4];
#pragma unroll
      for (int q = 0; q < GS; ++q)
#pragma unroll
        for (int r = 0; r < R; ++r) decode_tile(code[r], scl[r], jg * GS + q, a[r][q]);
      if (jg == 4 / GS - 1 && ka + 1 < KATOMS) load(ka + 1);  // in flight while the group issues
      wgmma_fence();
#pragma unroll
      for (int q = 0; q < GS; ++q) {
        const uint64_t desc = smem_desc(xf_addr + (ka * 4 + jg * GS + q) * FMAX * 256, 128, 256);
#pragma unroll
        for (int r = 0; r < R; ++r) Wgmma<F, FMAX>::run(acc[r], a[r][q][0], a[r][q][1], a[r][q][2], a[r][q][3], desc);
      }
      wgmma_commit();
      asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
      if (ka + jg > 0) keep(hold);
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int q = 0; q < GS; ++q)
#pragma unroll
          for (int i = 0; i < 4; ++i) hold[r][q][i] = a[r][q][i];
    }
  }
  wgmma_wait_all();
  keep(hold);
#pragma unroll
  for (int r = 0; r < R; ++r) fence_acc<FMAX>(acc[r]);
}

// FUSE bit 0: problem 0's epilogue is SwiGLU + NVFP4 quantize instead of the fp32 store. Its
// weights are w13 laid out so that each BN-row block holds BN/2 gate rows and the matching BN/2
// up rows (prepare_weights(..., pair_gate_up=True)). At the end of each pass the consumers put
// h = (acc * 2^14) * alpha (the value the plain epilogue stores) into a shared tile and go on
// with the next unit; EW epilogue warps take the tile and run the activation kernel's own
// functions on it (nvfp4_act.cuh: swiglu, quantize4, same lane mapping), so the result equals
// the separate kernels' bit for bit, and its divisions and shuffles overlap the weight stream
// instead of stalling it (done in the consumers, they cost more than the whole SwiGLU kernel).
__device__ __forceinline__ int load_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void red_release_add(int* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// A decoder's or consumer's next stage: its k chunk and pass within the unit (by increments: no
// division on run-time values), the ring slot and that slot's parity.
template <int STAGES>
__device__ __forceinline__ void advance_stage(int& kc, int& pass, int& s, uint32_t& phase, int kchunks, int passes) {
  if (++kc == kchunks) {
    kc = 0;
    if (++pass == passes) pass = 0;
  }
  if (++s == STAGES) {
    s = 0;
    phase ^= 1;
  }
}

// READ_ONLY = true runs the same grid, pipeline and copies but skips decode, MMA and stores:
// the achievable read rate of exactly this access pattern.
template <int W, int R, int BK, int STAGES, int FMAX, int MMA, bool READ_ONLY = false, int FUSE = 0>
__global__ void __launch_bounds__(Config<W, R, BK, STAGES, FMAX, MMA, FUSE>::THREADS, 1)
grouped_gemm_nvfp4(  // problem 0; problem 1 (num_experts1 = 0 for a single problem) the same
    const void* __restrict__ wmap0, const uint8_t* __restrict__ xq0, const uint8_t* __restrict__ xs0,
    const int* __restrict__ offsets0, const float* __restrict__ alpha0, float* __restrict__ out0,
    int N0, int K0, int num_experts0,
    const void* __restrict__ wmap1, const uint8_t* __restrict__ xq1, const uint8_t* __restrict__ xs1,
    const int* __restrict__ offsets1, const float* __restrict__ alpha1, float* __restrict__ out1,
    int N1, int K1, int num_experts1,
    int* __restrict__ sched,  // [next unit, CTAs done]: zero before the launch, zero after
    // FUSE bit 0 (problem 0 = w13 paired gate/up, N0 = 2I): SwiGLU with these per-expert globals,
    // quantized with act_global into a_packed (T, I/2) / a_scales (T, I/16); out0 is not written.
    const float* __restrict__ gate_global, const float* __restrict__ up_global, float act_global,
    uint8_t* __restrict__ a_packed, uint8_t* __restrict__ a_scales,
    // FUSE bit 1 (problem 1 = w2 of the same experts): a unit of expert e starts reading its
    // activations once ready[e] counts every (w13 block, pass, warp) of e; problem 1's output
    // goes to out1_bf16 as bf16 bits, written by the epilogue warps (out1 is not written).
    int* __restrict__ ready, unsigned short* __restrict__ out1_bf16,
    unsigned int* __restrict__ nonfinite) {  // SwiGLU values or bf16 outputs that are not finite
  // A unit of problem p reads that problem's arguments: kernel parameters selected, not copied.
#define LAB_P(name) (p ? name##1 : name##0)
  using C = Config<W, R, BK, STAGES, FMAX, MMA, FUSE>;
  static_assert(!(FUSE & 1) || C::BN % 32 == 0, "the SwiGLU tile splits BN/2 columns into 16-element blocks");
  static_assert(MMA == 0 || W % 4 == 0, "wgmma needs whole warpgroups of consumers");
  static_assert(MMA == 0 || MMA == 1, "MMA: 0 = mma.sync, 1 = wgmma");
  static_assert(!(READ_ONLY && FUSE), "the read-only pattern has no epilogue to fuse");
  extern __shared__ __align__(128) uint8_t smem[];

  const int NB0 = N0 / C::BN, NB1 = N1 / C::BN;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;

  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + C::OFF_BAR);
  const uint32_t full0 = smem_addr(bars);
  const uint32_t empty0 = smem_addr(bars + STAGES);
  const uint32_t raw0 = smem_addr(bars + 2 * STAGES);
  const uint32_t epi_full = smem_addr(bars + 3 * STAGES);   // consumers -> epilogue warps: h tile ready
  const uint32_t epi_empty = smem_addr(bars + 3 * STAGES + 1);  // epilogue warps -> consumers: tile free
  float* htile = reinterpret_cast<float*>(smem + C::OFF_H);
  // the tile's pass: token 0 of it, tokens, first row, first column (along I for w13, along the
  // output for w2), expert (-1: stop), problem
  __shared__ int epi_meta[6];
  int* active = reinterpret_cast<int*>(smem + C::SMEM);  // experts with tokens, in order
  __shared__ int warp_count[C::THREADS / 32];
  __shared__ int n_active_s;
  // Units in the order this CTA's producer claimed them, as {p << 16 | row block, expert, first
  // row, tokens} (row blocks < 2^15: GemmConfig.validate), x = -1 when there are no more.
  // Consumers and decoders read entry i when they reach unit i's first stage, published by that
  // stage's barriers; the producer runs at most STAGES stages (so at most STAGES units) ahead. The
  // producer loads the expert's offsets anyway, so the other warps start a unit without an L2
  // round trip of their own.
  constexpr int RING = 16;
  static_assert(STAGES < RING, "unit ring too small");
  __shared__ int4 unit_ring[RING];

  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full0 + 8 * s, 1 + 32 * C::DW);  // producer's expect_tx arrive + the decoder warps
      mbar_init(empty0 + 8 * s, W * 32);  // every consumer thread
      mbar_init(raw0 + 8 * s, 33);        // the producer's cp.async arrivals + lane 0 (unit ring)
    }
    mbar_init(epi_full, W * 32);
    mbar_init(epi_empty, C::EW * 32 + (C::EW == 0));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    n_active_s = 0;
  }
  // Compact the experts that have tokens (block-wide ballot scan): units are (active expert,
  // row block), handed out round-robin, so empty experts cost nothing and CTAs stay balanced.
  __shared__ int n_active0_s;
  for (int p = 0; p < 2; ++p) {
    const int num_experts = LAB_P(num_experts);
    const int* offsets = LAB_P(offsets);
    for (int base = 0; base < num_experts; base += C::THREADS) {
      __syncthreads();
      const int ex = base + (int)threadIdx.x;
      const bool has = ex < num_experts && offsets[ex + 1] > offsets[ex];
      const uint32_t ballot = __ballot_sync(0xffffffffu, has);
      if (lane == 0) warp_count[warp] = __popc(ballot);
      __syncthreads();
      int before = n_active_s;
      for (int w = 0; w < warp; ++w) before += warp_count[w];
      if (has) active[before + __popc(ballot & ((1u << lane) - 1u))] = ex;
      __syncthreads();
      if (threadIdx.x == 0) {
        int total = 0;
        for (int w = 0; w < C::THREADS / 32; ++w) total += warp_count[w];
        n_active_s += total;
      }
    }
    __syncthreads();
    if (p == 0 && threadIdx.x == 0) n_active0_s = n_active_s;
  }
  const int n_active0 = n_active0_s;
  const int n_units0 = n_active0 * NB0;
  const int n_units = n_units0 + (n_active_s - n_active0) * NB1;
  // unit u -> problem p, expert e (local to p), row block nb; problem 0's units come first
  struct Unit {
    int p, e, nb;
  };
  auto unit_of = [&](int u) {
    Unit r;
    r.p = u >= n_units0;
    const int uu = u - (r.p ? n_units0 : 0);
    const int nbs = r.p ? NB1 : NB0;
    r.e = active[(r.p ? n_active0 : 0) + uu / nbs];
    r.nb = uu - (uu / nbs) * nbs;
    return r;
  };

  if (warp == W) {
    // ---------------- producer warp ----------------
    // Units (active expert, row block) are claimed one at a time from a device counter, so a CTA
    // that drew cheap units (few tokens) takes more of them: no static imbalance at the tail.
    const uint64_t pol = evict_first_policy();
    if (lane == 0) {  // the maps' bytes were written through the generic proxy (a copy from the host)
      asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;" ::"l"(wmap0) : "memory");
      asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;" ::"l"(wmap1) : "memory");
    }
    int it = 0, s = 0;  // stages posted; ring slot of the next one
    uint32_t phase = 0;
    for (int useq = 0;; ++useq) {
      int u = 0;
      if (lane == 0) u = atomicAdd(&sched[0], 1);
      u = __shfl_sync(0xffffffffu, u, 0);
      const bool done = u >= n_units;
      const Unit un = done ? Unit{0, 0, 0} : unit_of(u);
      const int p = un.p, e = un.e, nb = un.nb;
      const int* offsets = LAB_P(offsets);
      const uint8_t* xq = LAB_P(xq);
      const uint8_t* xs = LAB_P(xs);
      const int K = LAB_P(K), NB = LAB_P(NB), kchunks = K / BK;
      const int row0 = offsets[e];
      const int count = done ? 0 : offsets[e + 1] - row0;
      // a finished CTA still posts one stage so that consumers and decoders read the -1
      const int passes = done ? 1 : (count + C::TOKENS - 1) / C::TOKENS;
      const int kcs = done ? 1 : kchunks;
      // Block-major layout: one stage's weights (BN rows x BK) are one contiguous run, stage
      // (e * NB + nb) * kchunks + kc of the map, so each stage is a single copy and DRAM sees long
      // sequential bursts.
      const int stage0 = (e * NB + nb) * kchunks;
      for (int pass = 0; pass < passes; ++pass)
      for (int kc = 0; kc < kcs; ++kc, ++it) {
        const bool first = pass == 0 && kc == 0;
        if (it >= STAGES) mbar_wait(empty0 + 8 * s, phase ^ 1);
        if (lane == 0) {
          if (first) unit_ring[useq % RING] = done ? make_int4(-1, 0, 0, 0) : make_int4((p << 16) | nb, e, row0, count);
          mbar_arrive(raw0 + 8 * s);  // release: the ring entry before any barrier of this stage
          if (done) {
            mbar_arrive(full0 + 8 * s);
          } else {
            mbar_arrive_expect_tx(full0 + 8 * s, C::STAGE_W);
            tensor_copy_stage(smem_addr(smem + C::OFF_W + s * C::STAGE_W), LAB_P(wmap), stage0 + kc, full0 + 8 * s,
                              pol);
          }
        }
        if constexpr ((FUSE & 2) != 0) {
          // The weights of this stage are already on their way; the activations are a_q, which
          // expert e's w13 units write. Every lane acquires, so its own copies see them.
          if (p == 1 && first && !done) {
            const int passes0 = (offsets0[e + 1] - offsets0[e] + C::TOKENS - 1) / C::TOKENS;
            const int target = NB0 * C::EW * passes0;
            while (load_acquire(ready + e) < target) __nanosleep(64);
          }
        }
        const int tok0 = pass * C::TOKENS;
        const int ntok = min(C::TOKENS, count - tok0);
        constexpr int QCHUNKS = BK / 32;  // 16-byte pieces of one row's codes in this chunk
        uint8_t* qdst = smem + C::OFF_XQ + s * C::STAGE_XQ;
        uint8_t* sdst = smem + C::OFF_XS + s * C::STAGE_XS;
        for (int i = lane; i < ntok * QCHUNKS; i += 32) {
          const int tr = i / QCHUNKS, q = i - tr * QCHUNKS;
          const uint8_t* src = xq + (size_t)(row0 + tok0 + tr) * (K / 2) + kc * (BK / 2) + q * 16;
          cp_async<16>(smem_addr(qdst + tr * (BK / 2) + q * 16), src);
        }
        for (int tr = lane; tr < ntok; tr += 32) {
          const uint8_t* src = xs + (size_t)(row0 + tok0 + tr) * (K / 16) + kc * (BK / 16);
          cp_async<BK / 16>(smem_addr(sdst + tr * (BK / 16)), src);
        }
        cp_async_arrive_noinc(raw0 + 8 * s);
        if (++s == STAGES) {
          s = 0;
          phase ^= 1;
        }
      }
      if (done) break;
    }
    goto finish;
  }

  if (C::EW != 0 && warp > W + C::DW) {
    // ---------------- SwiGLU epilogue warps (FUSE bit 0) ----------------
    // Item = 4 consecutive gate columns of one token (and the 4 matching up columns); the 4
    // lanes of a quad hold one 16-column block, as in the SwiGLU kernel.
    if constexpr (C::EW != 0) {
      const int ew = warp - W - 1 - C::DW;
      constexpr int Q = C::BN / 8;  // items per token row
      const float six_g = __fmul_rn(6.0f, act_global);
      const int I = N0 / 2;
      uint32_t bad = 0;
      for (int it = 0;; ++it) {
        mbar_wait_sleep(epi_full, it & 1);
        const int tok0 = epi_meta[0], ntok = epi_meta[1], row0 = epi_meta[2], col0 = epi_meta[3], e = epi_meta[4];
        if (e < 0) break;
        if constexpr ((FUSE & 2) != 0) {
          if (epi_meta[5] != 0) {
            // A w2 tile: the output values the consumers computed, as bf16. Item = two adjacent
            // columns of one token, consecutive along the row across lanes: one 4-byte store each,
            // a warp's 32 of them one 128-byte line.
            constexpr int PAIRS = C::BN / 2;
            for (int item = ew * 32 + lane; item < ntok * PAIRS; item += 32 * C::EW) {
              const int tr = item / PAIRS, cp = item - tr * PAIRS;
              const float2 v = *reinterpret_cast<const float2*>(htile + tr * C::H_STRIDE + 2 * cp);
              const uint32_t b = lab_act::bf16x2_bits(v.x, v.y);
              *reinterpret_cast<uint32_t*>(out1_bf16 + (size_t)(row0 + tok0 + tr) * N1 + col0 + 2 * cp) = b;
              bad += lab_act::bf16x2_nonfinite(b);
            }
            mbar_arrive(epi_empty);
            continue;
          }
        }
        const float gs = gate_global[e], us = up_global[e];
        for (int item = ew * 32 + lane; item < ntok * Q; item += 32 * C::EW) {  // quads are all in or out
          const int tr = item / Q, c4 = item - tr * Q;
          const float4 hg = *reinterpret_cast<const float4*>(htile + tr * C::H_STRIDE + 4 * c4);
          const float4 hu = *reinterpret_cast<const float4*>(htile + tr * C::H_STRIDE + C::BN / 2 + 4 * c4);
          float a[4];
          a[0] = lab_act::swiglu(hg.x, hu.x, gs, us);
          a[1] = lab_act::swiglu(hg.y, hu.y, gs, us);
          a[2] = lab_act::swiglu(hg.z, hu.z, gs, us);
          a[3] = lab_act::swiglu(hg.w, hu.w, gs, us);
#pragma unroll
          for (int i = 0; i < 4; ++i) bad += !lab_act::finite(a[i]);
          const size_t row = (size_t)(row0 + tok0 + tr);
          lab_act::quantize4(a, act_global, six_g, c4, a_packed + row * (I / 2) + col0 / 2,
                             a_scales + row * (I / 16) + col0 / 16);
        }
        if constexpr ((FUSE & 2) != 0) {
          // Publish this warp's part of expert e's a_q: every lane's stores, then one release.
          __threadfence();
          __syncwarp();
          if (lane == 0) red_release_add(ready + e, 1);
        }
        mbar_arrive(epi_empty);
      }
      if (bad) atomicAdd(nonfinite, bad);
    }
    goto finish;
  }

  if (warp > W) {
    // ---------------- activation decoder warps ----------------
    // Raw NVFP4 activations of stage s -> fp16 B fragments xf[s], then arrive on full[s]:
    // consumers never synchronise with each other. Item = (fragment, k16 block, token row), the
    // row fastest, so that the 8 lanes of one (fragment, block) write 256 contiguous bytes.
    // B holds v * s * 2^-14 (exact in fp16); the epilogue's ACC_SCALE takes both 2^-14 out.
    int s = 0, count = 0, kc = 0, pass = 0, passes = 0, kchunks = 1;
    uint32_t phase = 0;
    for (int useq = 0;;) {
      mbar_wait(raw0 + 8 * s, phase);
      if (kc == 0 && pass == 0) {
        const int4 ent = unit_ring[useq % RING];
        ++useq;
        if (ent.x < 0) {
          mbar_arrive(full0 + 8 * s);
          goto finish;
        }
        const int p = ent.x >> 16;
        count = ent.w;
        kchunks = LAB_P(K) / BK;
        passes = (count + C::TOKENS - 1) / C::TOKENS;
      }
      {
        const int tok0 = pass * C::TOKENS;
        const int ntok = min(C::TOKENS, count - tok0);
        const int frags = (ntok + 7) >> 3;
        if constexpr (!READ_ONLY) {
          const uint8_t* qsrc = smem + C::OFF_XQ + s * C::STAGE_XQ;
          const uint8_t* ssrc = smem + C::OFF_XS + s * C::STAGE_XS;
          uint8_t* xf = smem + C::OFF_XF + s * C::XF;
#pragma unroll 2
          for (int item = (warp - W - 1) * 32 + lane; item < frags * 8 * C::KSTEPS; item += 32 * C::DW) {
            const int f = item / (8 * C::KSTEPS), j = (item >> 3) & (C::KSTEPS - 1), tr = f * 8 + (item & 7);
            uint2 raw = make_uint2(0u, 0u);
            uint32_t sbits = 0;
            if (tr < ntok) {
              raw = *reinterpret_cast<const uint2*>(qsrc + tr * (BK / 2) + j * 8);
              sbits = ssrc[tr * (BK / 16) + j];
            }
            const uint32_t sc = e4m3x2_to_f16x2(sbits);  // low half = this block's scale
            // k slots 0..7 and 8..15 of this block (K_SLOTS order), fp16x2 pairs
            const uint32_t h0[4] = {hmul2_lo(decode_x<0>(raw.x), sc), hmul2_lo(decode_x<1>(raw.x), sc),
                                    hmul2_lo(decode_x<2>(raw.x), sc), hmul2_lo(decode_x<3>(raw.x), sc)};
            const uint32_t h1[4] = {hmul2_lo(decode_x<0>(raw.y), sc), hmul2_lo(decode_x<1>(raw.y), sc),
                                    hmul2_lo(decode_x<2>(raw.y), sc), hmul2_lo(decode_x<3>(raw.y), sc)};
            if constexpr (MMA == 0) {
              // mma.sync B fragments: [f][k16 step][lane = 4*row + t][b0 b1], i.e. item * 4
              uint2* dst = reinterpret_cast<uint2*>(xf) + item * 4;
#pragma unroll
              for (int q = 0; q < 4; ++q) dst[q] = make_uint2(h0[q], h1[q]);
            } else {
              // wgmma core matrices (8 tokens x 8 k, 128 B): [k16 step][f][k half][token row][16 B]
              uint4* dst = reinterpret_cast<uint4*>(xf + ((j * FMAX + f) * 2) * 128 + (item & 7) * 16);
              dst[0] = make_uint4(h0[0], h0[1], h0[2], h0[3]);
              dst[8] = make_uint4(h1[0], h1[1], h1[2], h1[3]);
            }
          }
          if constexpr (MMA != 0) fence_proxy_async();  // generic-proxy writes read by wgmma
        }
        mbar_arrive(full0 + 8 * s);
      }
      advance_stage<STAGES>(kc, pass, s, phase, kchunks, passes);
    }
  }

  {  // ---------------- consumer warps ----------------
  const int g = lane >> 2;
  const int t4 = lane & 3;
  float acc[R][FMAX][4];
  // Zeroed here and after each pass's epilogue (not at each pass's first stage, where the
  // compiler would select every accumulator on every stage).
  auto zero_acc = [&]() {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int f = 0; f < FMAX; ++f)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[r][f][i] = 0.f;
  };
  zero_acc();
  int nb = 0, row0 = 0, count = 0, kc = 0, pass = 0, passes = 0, kchunks = 1, N = 0, unit_p = 0, unit_e = 0;
  int s = 0;
  uint32_t phase = 0;
  float out_scale = 0.f;
  float* out = out0;
  int epi_it = 0;    // h tiles handed to the epilogue warps
  // Stage s of the ring (phase: its use's parity); kc, pass: this stage's place in its unit.
  auto next_stage = [&]() { advance_stage<STAGES>(kc, pass, s, phase, kchunks, passes); };
  for (int useq = 0;;) {
    mbar_wait(full0 + 8 * s, phase);
    if (kc == 0 && pass == 0) {
      const int4 ent = unit_ring[useq % RING];
      ++useq;
      if (ent.x < 0) {
        if constexpr (C::EW != 0) {  // stop the epilogue warps once they are done with the last tile
          if (epi_it > 0) mbar_wait(epi_empty, (epi_it - 1) & 1);
          if (warp == 0 && lane == 0) epi_meta[4] = -1;
          mbar_arrive(epi_full);
        }
        break;
      }
      const int p = ent.x >> 16, e = ent.y;
      unit_p = p;
      unit_e = e;
      nb = ent.x & 0xffff;
      row0 = ent.z;
      count = ent.w;
      kchunks = LAB_P(K) / BK;
      passes = (count + C::TOKENS - 1) / C::TOKENS;
      out_scale = LAB_P(alpha)[e];
      out = LAB_P(out);
      N = LAB_P(N);
    }
    const int tok0 = pass * C::TOKENS;
    const int ntok = min(C::TOKENS, count - tok0);
    const int frags = (ntok + 7) >> 3;
    if constexpr (READ_ONLY) {
      mbar_arrive(empty0 + 8 * s);
      next_stage();
      continue;
    }
    (void)out_scale;

    const uint8_t* wst = smem + C::OFF_W + s * C::STAGE_W;
    const uint8_t* xf = smem + C::OFF_XF + s * C::XF;
    // One dispatch per stage to a body with a compile-time fragment count: no per-MMA predicates
    // (each cost an ISETP and a WARPSYNC) and, for wgmma, a single instruction shape.
    switch (frags) {
#define LAB_STAGE_CASE(F) \
      case F:                                                                                              \
        if constexpr (F <= FMAX) {                                                                         \
          if constexpr (MMA == 0) stage_math<W, R, BK, FMAX, F>(acc, wst, xf, warp, lane);                 \
          else stage_wgmma<W, R, BK, FMAX, C::GS, F>(acc, wst, xf, warp, lane);                            \
        }                                                                                                  \
        break;
      LAB_STAGE_CASE(1) LAB_STAGE_CASE(2) LAB_STAGE_CASE(3) LAB_STAGE_CASE(4)
      LAB_STAGE_CASE(5) LAB_STAGE_CASE(6) LAB_STAGE_CASE(7) LAB_STAGE_CASE(8)
#undef LAB_STAGE_CASE
      default: break;
    }
    mbar_arrive(empty0 + 8 * s);

    if constexpr (C::EW != 0) {
      if (kc == kchunks - 1 && ((FUSE & 2) != 0 || unit_p == 0)) {
        // Hand this pass's values to the epilogue warps (D rows are weight rows, columns tokens):
        // h for SwiGLU, or in the fused layer the w2 output for its bf16 stores, which keeps the
        // conversion, the non-finite count and the scattered 2-byte stores off the consumers.
        if (epi_it > 0) mbar_wait(epi_empty, (epi_it - 1) & 1);
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const int n = (r * W + warp) * 16 + g;  // column within the block (w13: gate half, then up half)
#pragma unroll
          for (int f = 0; f < FMAX; ++f) {
            if (f < frags) {
              float* hrow = htile + (f * 8 + 2 * t4) * C::H_STRIDE + n;
              hrow[0] = (acc[r][f][0] * ACC_SCALE) * out_scale;
              hrow[8] = (acc[r][f][2] * ACC_SCALE) * out_scale;
              hrow[C::H_STRIDE] = (acc[r][f][1] * ACC_SCALE) * out_scale;
              hrow[C::H_STRIDE + 8] = (acc[r][f][3] * ACC_SCALE) * out_scale;
            }
          }
        }
        if (warp == 0 && lane == 0) {
          epi_meta[0] = tok0;
          epi_meta[1] = ntok;
          epi_meta[2] = row0;
          epi_meta[3] = unit_p ? nb * C::BN : nb * (C::BN / 2);
          epi_meta[4] = unit_e;
          epi_meta[5] = unit_p;
        }
        mbar_arrive(epi_full);
        ++epi_it;
        zero_acc();
        next_stage();
        continue;
      }
    }
    if (kc == kchunks - 1) {  // (the fused layer hands every pass off above)
      // Epilogue: D rows are weight rows (output columns), D columns are tokens.
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int n = (nb * (W * R) + r * W + warp) * 16 + g;
#pragma unroll
        for (int f = 0; f < FMAX; ++f) {
          if (f < frags) {
            const int tok = tok0 + f * 8 + 2 * t4;
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {  // tokens tok and tok + 1
              if (tok + hh < count) {
                const size_t at = (size_t)(row0 + tok + hh) * N + n;
                const float v0 = (acc[r][f][hh] * ACC_SCALE) * out_scale;
                const float v1 = (acc[r][f][2 + hh] * ACC_SCALE) * out_scale;
                if (out != nullptr) {
                  out[at] = v0;
                  out[at + 8] = v1;
                }
              }
            }
          }
        }
      }
      zero_acc();
    }
    next_stage();
  }
  }

finish:
  // The last CTA to finish leaves the unit counter (and the readiness counters) at zero for the
  // next launch or graph replay: every thread of every CTA is past its last use of them.
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(&sched[1], 1) == (int)gridDim.x - 1) {
      atomicExch(&sched[0], 0);
      atomicExch(&sched[1], 0);
      if constexpr ((FUSE & 2) != 0) {
        for (int e = 0; e < num_experts0; ++e) ready[e] = 0;
        __threadfence();
      }
    }
  }
#undef LAB_P
}

}  // namespace lab_gemm

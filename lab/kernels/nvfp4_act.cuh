// NVFP4 activation arithmetic shared by the activation kernels (swiglu_quant.cu) and the grouped
// GEMM's fused SwiGLU epilogue (grouped_gemm.cu): one definition, so that the fused and the
// separate paths compute the same function bit for bit. jit.source() inlines this file where a
// kernel source includes it (NVRTC gets one string; nvcc finds it beside the source).
//
// Quantization is lab/nvfp4.py's definition: every step is one IEEE float32 operation in the
// docstring's order (__fdiv_rn / __fmul_rn so that no reciprocal or FMA creeps in):
//   s_in  = block_amax / (6 * g)          then min(s_in, 448), RNE to e4m3 (cvt ... satfinite)
//   denom = e4m3(s_in) * g                (decoded scale times global, rounded once)
//   q     = x / denom, clip to [-6, 6], RNE to e2m1 by exact thresholds (ties to the even code)
//   denom == 0 -> all 16 codes +0; otherwise the sign bit of q is kept (-0.0 -> nibble 8).
#pragma once

namespace lab_act {

typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long size_t;

__device__ __forceinline__ bool finite(float v) { return (__float_as_uint(v) & 0x7f800000u) != 0x7f800000u; }

// float32 >= 0 -> e4m3 bits, RNE, saturating at 448 (sm_89+ conversion).
__device__ __forceinline__ uint32_t e4m3_encode(float s) {
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(s));
  return r & 0xffu;  // the second operand lands in the low byte
}

// e4m3 bits (sign 0, not NaN) -> float32, exactly: exponent field 0 is subnormal (m * 2^-9).
__device__ __forceinline__ float e4m3_decode(uint32_t c) {
  const uint32_t e = (c >> 3) & 0xfu, m = c & 0x7u;
  return e == 0 ? __fmul_rn((float)m, 0.001953125f) : __uint_as_float(((e + 120u) << 23) | (m << 20));
}

// q in [-6, 6] -> e2m1 nibble. Grid {0, .5, 1, 1.5, 2, 3, 4, 6}: each midpoint rounds to the
// even code, so the comparisons alternate > (tie goes down) and >= (tie goes up).
__device__ __forceinline__ uint32_t e2m1_encode(float q) {
  const float a = fabsf(q);
  const uint32_t i = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) +
                     (a > 5.0f);
  return i | ((__float_as_uint(q) >> 28) & 0x8u);
}

// fp32 -> bf16 bits, two at a time, v0 in the low half: round to nearest even (subnormals kept,
// overflow to Inf as in ml_dtypes), a NaN as a quiet NaN with its sign and top payload bits (the
// value's top 16 bits, quiet bit set). cvt.rn.bf16x2.f32 does the rounding for the pair in one
// instruction (the w2 epilogue is issue bound: ~5 us of fused-layer went to a per-value form); its
// NaN is canonical, so a NaN half takes the quiet form by a select, not a branch: a branch per
// pair made the image tiles' bf16 epilogue ~3000 instructions of short blocks (BSSY/BSYNC,
// instruction-cache misses), 1.9x the fp32 epilogue's count (Nsight Compute, notes/gemm-log.md v31).
__device__ __forceinline__ uint32_t bf16x2_bits(float v0, float v1) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(v1), "f"(v0));  // first source -> high half
  const uint32_t quiet = __byte_perm(__float_as_uint(v0), __float_as_uint(v1), 0x7632) | 0x00400040u;
  const uint32_t nan = (v0 != v0 ? 0x0000ffffu : 0u) | (v1 != v1 ? 0xffff0000u : 0u);
  return (r & ~nan) | (quiet & nan);
}
__device__ __forceinline__ uint32_t bf16x2_nonfinite(uint32_t b) {
  return ((b & 0x7f80u) == 0x7f80u) + ((b & 0x7f800000u) == 0x7f800000u);
}
// Of two bf16 values, those fp16 cannot hold (the W4A16 GEMM converts its activations to fp16):
// |v| >= 65536 (the bf16 below it, 65280, converts exactly), Inf and NaN.
__device__ __forceinline__ uint32_t bf16x2_past_fp16(uint32_t b) {
  return ((b & 0x7fffu) >= 0x4780u) + (((b >> 16) & 0x7fffu) >= 0x4780u);
}

// A 16-element block's scale from its amax (the max of |x| over the block, NaN ignored):
// returns the e4m3 code and sets denom = decoded scale * g. six_g = 6 * g rounded once.
__device__ __forceinline__ uint32_t block_scale(float amax, float g, float six_g, float& denom) {
  const float s_in = fminf(__fdiv_rn(amax, six_g), 448.0f);
  const uint32_t code = e4m3_encode(s_in);
  denom = __fmul_rn(e4m3_decode(code), g);
  return code;
}

// a * b rounded to nearest with gradual underflow, whatever -ftz the module is compiled with
// (an inline mul.rn.f32 carries no .ftz; __fmul_rn under -ftz=true becomes mul.rn.ftz.f32).
__device__ __forceinline__ float mul_ieee(float a, float b) {
  float r;
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// Division without the branch of div.rn: CUDA's own division takes exactly this route (one
// Newton step on the hardware reciprocal, then one residual correction) whenever its range
// check passes, which it does for normal operands far from overflow and underflow; there the
// result is the correctly rounded quotient. Without the branch to the slow path the compiler
// can interleave independent divisions, and a block's 16 elements share one reciprocal.
__device__ __forceinline__ float rcp_refined(float d) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
  return __fmaf_rn(r, __fmaf_rn(-d, r, 1.0f), r);
}
__device__ __forceinline__ float div_refined(float v, float d, float r_refined) {
  const float q0 = __fmul_rn(v, r_refined);
  return __fmaf_rn(r_refined, __fmaf_rn(-d, q0, v), q0);
}
// The block's denominators for which quantize_fast equals quantize_element on every finite or
// NaN element: every quotient that the e2m1 rounding can tell apart (|q| in [2^-3, 8]) then has
// normal operands far from the limits, smaller ones round to 0 either way and larger to 6.
__device__ __forceinline__ bool fast_block(float denom, float amax) {
  return denom >= 0x1p-60f && denom <= 0x1p60f && amax <= 0x1p60f;
}
__device__ __forceinline__ uint32_t quantize_fast(float v, float denom, float r_refined) {
  // |v| / d with v's sign put back: the residual step would turn -0 into +0
  const float q = __int_as_float(__float_as_int(div_refined(fabsf(v), denom, r_refined)) |
                                 (__float_as_int(v) & (int)0x80000000));
  return e2m1_encode(fminf(fmaxf(q, -6.0f), 6.0f));
}

// One element's e2m1 nibble given its block's denom (denom == 0: +0).
__device__ __forceinline__ uint32_t quantize_element(float v, float denom) {
  if (denom == 0.0f) return 0u;
  return e2m1_encode(fminf(fmaxf(__fdiv_rn(v, denom), -6.0f), 6.0f));
}

// Four consecutive elements v of a row (elements 4*c4 .. 4*c4+3) -> 2 bytes of codes; the 4
// lanes of an aligned quad hold one 16-element block and share its amax by two shuffles (all
// four lanes must be here); lane 0 of the quad writes the block's scale. g is the float32
// global, six_g = 6 * g rounded once.
__device__ __forceinline__ void quantize4(const float (&v)[4], float g, float six_g, int c4,
                                          uint8_t* __restrict__ packed_row, uint8_t* __restrict__ scales_row) {
  const uint32_t lane = threadIdx.x & 31u;
  const uint32_t quad = 0xfu << (lane & 28u);
  float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
  amax = fmaxf(amax, __shfl_xor_sync(quad, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(quad, amax, 2));
  float denom;
  const uint32_t code = block_scale(amax, g, six_g, denom);
  uint32_t nib = 0;
  if (denom != 0.0f && fast_block(denom, amax)) {
    const float r = rcp_refined(denom);
#pragma unroll
    for (int i = 0; i < 4; ++i) nib |= quantize_fast(v[i], denom, r) << (4 * i);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) nib |= quantize_element(v[i], denom) << (4 * i);
  }
  reinterpret_cast<uint16_t*>(packed_row)[c4] = (uint16_t)nib;
  if ((lane & 3u) == 0) scales_row[c4 >> 2] = (uint8_t)code;
}

// SwiGLU of one column pair, option (a): each half times its own per-expert global, then
//   a = (g * sigmoid(g)) * u,  sigmoid(g) = 1 / (1 + t) for g >= 0 and t / (1 + t) below,
// t = expf(-|g|) (as lab/reference.py writes it: t never overflows, so silu stays accurate for
// g << 0; CUDA's expf is within 2 ulp, not the fast-math __expf). The division is div_refined:
// 1 + t is in [1, 2], so it is the correctly rounded quotient except where t is far below
// 2^-60 (|g| > 41, silu(g) < 1e-17), where it may be an ulp off.
// Its four products keep subnormals (mul_ieee): CuPy compiles every kernel with -ftz=true, which
// flushed a subnormal product to zero: a = 0 where the float64 SwiGLU gives 4.8e-39, or a
// subnormal g times a large u that should give a normal a (tests/test_swiglu_quant.py).
__device__ __forceinline__ float swiglu(float h_gate, float h_up, float gate_global, float up_global) {
  const float g = mul_ieee(h_gate, gate_global);
  const float u = mul_ieee(h_up, up_global);
  const float t = expf(-fabsf(g));  // in (0, 1]
  const float one_t = __fadd_rn(1.0f, t);
  const float sig = div_refined(g >= 0.0f ? 1.0f : t, one_t, rcp_refined(one_t));
  return mul_ieee(mul_ieee(g, sig), u);
}

}  // namespace lab_act

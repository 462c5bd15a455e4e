// Device functions of the W4A8 activation quantize and SwiGLU, shared by w4a8_act.cu (the
// stand-alone kernels) and w4a8_gemm.cu (the SwiGLU + quantize epilogue): one definition, so the
// fused epilogue computes the act kernel's bits. Their contracts are described in w4a8_act.cu.
#pragma once

namespace lab_w4a8_act {

typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long size_t;

__device__ __forceinline__ void load4(const float* p, float (&v)[4]) {
  const float4 t = *reinterpret_cast<const float4*>(p);
  v[0] = t.x; v[1] = t.y; v[2] = t.z; v[3] = t.w;
}
__device__ __forceinline__ void load4(const uint16_t* p, float (&v)[4]) {  // bf16 bits: exact in float32
  const uint2 t = *reinterpret_cast<const uint2*>(p);
  v[0] = __uint_as_float(t.x << 16); v[1] = __uint_as_float(t.x & 0xffff0000u);
  v[2] = __uint_as_float(t.y << 16); v[3] = __uint_as_float(t.y & 0xffff0000u);
}

// x * inv rounded once, as IEEE float32 without flushing. A subnormal x would be flushed under
// -ftz=true, though x * inv can be an e4m3 value as large as 2^-10 x 448: it is taken as its
// integer significand (x * 2^149, exact) times inv * 2^-149 (exact where it matters: inv > 2^116
// then, so inv * 2^-149 > 2^-33 is normal; smaller inv flushes it to zero, which is x * inv's
// e4m3 code anyway). The sign is applied last: round to nearest even is symmetric. A result
// that is itself subnormal in float32 is flushed to a zero of x's sign, also e4m3's code for it.
__device__ __forceinline__ float times_inv(float v, float inv) {
  const uint32_t b = __float_as_uint(v);
  if ((b & 0x7f800000u) != 0u) return __fmul_rn(v, inv);
  const float r = __fmul_rn(__int2float_rn((int)(b & 0x007fffffu)), __fmul_rn(__fmul_rn(inv, 0x1p-75f), 0x1p-74f));
  return (b >> 31) ? -r : r;
}

__device__ __forceinline__ bool finite(float v) { return (__float_as_uint(v) & 0x7f800000u) != 0x7f800000u; }

// Two float32 -> two e4m3 bytes, lo in the low byte (the instruction puts its first source high).
__device__ __forceinline__ uint32_t e4m3x2(float lo, float hi) {
  uint16_t d;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
  return d;
}

// One warp's (row, group gi of G): lane l's four values v (zeros where !live) at columns col..col+3
// of a K-column row, m = the largest of their |v| (fmaxf from 0, which the caller folds into its
// loop over v) -> their four codes in x8 and, from lane 0, the group's scale in s_x. Every lane
// of the warp must be here. The addresses are formed in here, not by the caller: so quantize_act
// compiles to the same SASS as before it shared this function (the H200-tested code, unchanged).
__device__ __forceinline__ void quantize_group(const float (&v)[4], float m, bool live, int lane, size_t row, int K,
                                               int col, int G, int gi, uint8_t* __restrict__ x8,
                                               float* __restrict__ s_x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  const float amax = fmaxf(m, 0x1p-116f);  // a subnormal that fabsf/fmaxf flushed is below this floor
  const float inv = __fdiv_rn(448.0f, amax);
  if (live) {
    const uint32_t lo = e4m3x2(times_inv(v[0], inv), times_inv(v[1], inv));
    const uint32_t hi = e4m3x2(times_inv(v[2], inv), times_inv(v[3], inv));
    *reinterpret_cast<uint32_t*>(x8 + row * K + col) = lo | hi << 16;
  }
  if (lane == 0) s_x[row * G + gi] = __fdiv_rn(amax, 448.0f);
}

// ------------------------------------------------------------------------------ SwiGLU arithmetic

__device__ __forceinline__ float add_rn(float a, float b) {
  float r;
  asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ float sub_rn(float a, float b) {
  float r;
  asm("sub.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ float mul_rn(float a, float b) {
  float r;
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ float div_rn(float a, float b) {  // IEEE division, subnormals included
  float r;
  asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ float max_ieee(float a, float b) {  // a NaN operand gives the other one, as np.fmax
  float r;
  asm("max.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ float rint_rn(float a) {  // nearest integer, ties to even, as np.rint
  float r;
  asm("cvt.rni.f32.f32 %0, %1;" : "=f"(r) : "f"(a));
  return r;
}

// lab/w4a8.py's constants, as their float32 bits (tests/test_w4a8.py reads them from here)
constexpr uint32_t LOG2E_BITS = 0x3fb8aa3bu;
constexpr uint32_t LN2_HI_BITS = 0x3f317200u;
constexpr uint32_t LN2_LO_BITS = 0x35bfbe8eu;
// EXP_POLY, 1/7! .. 1/0!
constexpr uint32_t EXP_POLY_BITS_0 = 0x39500d01u, EXP_POLY_BITS_1 = 0x3ab60b61u, EXP_POLY_BITS_2 = 0x3c088889u,
                   EXP_POLY_BITS_3 = 0x3d2aaaabu, EXP_POLY_BITS_4 = 0x3e2aaaabu, EXP_POLY_BITS_5 = 0x3f000000u,
                   EXP_POLY_BITS_6 = 0x3f800000u, EXP_POLY_BITS_7 = 0x3f800000u;
constexpr float EXP_FLOOR = -128.0f;

// v * 2^k rounded once, k in [-185, 0]: v * 2^(k+64) is exact (a normal power of two times a
// value that stays normal, lab/w4a8.py), so only the product by 2^-64 rounds.
__device__ __forceinline__ float scale_2k(float v, int k) {
  return mul_rn(mul_rn(v, __int_as_float((k + 64 + 127) << 23)), 0x1p-64f);
}

// lab/w4a8.py silu_f32, operation by operation.
__device__ __forceinline__ float silu_f32(float g) {
  const uint32_t gb = __float_as_uint(g);
  const float x = max_ieee(__uint_as_float(gb | 0x80000000u), EXP_FLOOR);  // max(-|g|, -128)
  const float kf = rint_rn(mul_rn(x, __uint_as_float(LOG2E_BITS)));
  const int k = (int)kf;  // an integer in [-185, 0]: exact
  const float r = sub_rn(sub_rn(x, mul_rn(kf, __uint_as_float(LN2_HI_BITS))), mul_rn(kf, __uint_as_float(LN2_LO_BITS)));
  float q = __uint_as_float(EXP_POLY_BITS_0);
  q = add_rn(mul_rn(q, r), __uint_as_float(EXP_POLY_BITS_1));
  q = add_rn(mul_rn(q, r), __uint_as_float(EXP_POLY_BITS_2));
  q = add_rn(mul_rn(q, r), __uint_as_float(EXP_POLY_BITS_3));
  q = add_rn(mul_rn(q, r), __uint_as_float(EXP_POLY_BITS_4));
  q = add_rn(mul_rn(q, r), __uint_as_float(EXP_POLY_BITS_5));
  q = add_rn(mul_rn(q, r), __uint_as_float(EXP_POLY_BITS_6));
  q = add_rn(mul_rn(q, r), __uint_as_float(EXP_POLY_BITS_7));
  const float d = add_rn(1.0f, scale_2k(q, k));
  return (gb >> 31) ? scale_2k(div_rn(mul_rn(x, q), d), k) : div_rn(g, d);
}

// lab/w4a8.py swiglu_f32 of one column pair.
__device__ __forceinline__ float swiglu_f32(float h_gate, float h_up, float gate_global, float up_global) {
  return mul_rn(silu_f32(mul_rn(h_gate, gate_global)), mul_rn(h_up, up_global));
}

__device__ __forceinline__ int row_expert(const int* __restrict__ offsets, int experts, int row) {
  int lo = 0, hi = experts;
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (offsets[mid] <= row) lo = mid; else hi = mid;
  }
  return lo;
}

}  // namespace lab_w4a8_act

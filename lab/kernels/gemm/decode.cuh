// The e2m1 / e4m3 decode: prepared weight words and raw NVFP4 activation words to fp16x2
// registers holding v * 2^-14, and e4m3 block scales to fp16x2. Exact: every e2m1 x e4m3 value
// is an fp16 (subnormals included), and the scale multiply rounds nothing.
#pragma once
#include "ptx.cuh"

namespace lab_gemm {

constexpr int ATOM_BYTES = 576;
constexpr int ATOM_CODE_BYTES = 512;

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
// Raw NVFP4 word (codes of k = 0..7, standard order) -> fp16x2 of v * 2^-14 for k = A and
// A + 4 (16 bits apart in the word, as the two halves of an fp16x2 are): exponent and mantissa
// 4A..4A+2 -> 9..11 and the sign 4A+3 -> 15, both halves at once, so two shifts and two LOP3.
// Register A fills MMA k slots 2A and 2A+1, hence K_SLOTS (gemm_weights.py), which
// prepare_weights applies to the weights so that both operands agree.
template <int A>
__device__ __forceinline__ uint32_t decode_x(uint32_t x) {
  constexpr int EM = 9 - 4 * A, SG = 12 - 4 * A;
  const uint32_t em = EM >= 0 ? x << (EM & 31) : x >> (-EM & 31);
  const uint32_t sg = SG >= 0 ? x << (SG & 31) : x >> (-SG & 31);
  return (em & 0x0E000E00u) | (sg & 0x80008000u);
}
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

// One k16 block of one NVFP4 activation row (raw: its 16 codes, k = 0..7 then 8..15; sc: its
// scale in the low half) -> k slots 0..7 and 8..15 in K_SLOTS order, times the scale (the image's
// two writers, gemm/act_image.cuh).
__device__ __forceinline__ void decode_nvfp4_block(const uint2& raw, uint32_t sc, uint32_t (&h0)[4],
                                                   uint32_t (&h1)[4]) {
  h0[0] = hmul2_lo(decode_x<0>(raw.x), sc);
  h0[1] = hmul2_lo(decode_x<1>(raw.x), sc);
  h0[2] = hmul2_lo(decode_x<2>(raw.x), sc);
  h0[3] = hmul2_lo(decode_x<3>(raw.x), sc);
  h1[0] = hmul2_lo(decode_x<0>(raw.y), sc);
  h1[1] = hmul2_lo(decode_x<1>(raw.y), sc);
  h1[2] = hmul2_lo(decode_x<2>(raw.y), sc);
  h1[3] = hmul2_lo(decode_x<3>(raw.y), sc);
}

// bf16 (the low or the high half of a word) -> float32, exactly.
__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
// Two float32 -> fp16x2 (lo in the low half), round to nearest even: exact for bf16 values of
// magnitude in [2^-14, 65504] and for zeros (bf16's 8 significant bits fit fp16's 11); smaller
// ones round to fp16 subnormals, larger ones overflow (the W4A16 path refuses those upstream).
__device__ __forceinline__ uint32_t f32x2_to_f16x2(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
// One k16 block of one bf16 activation row (w: its 16 values, two per word, k even in the low
// half) -> k slots 0..7 and 8..15 in K_SLOTS order, as decode_x gives NVFP4 rows: register A of
// each half holds k = A (low) and A + 4 (high) of that half.
__device__ __forceinline__ void decode_bf16_block(const uint4& lo, const uint4& hi, uint32_t (&h0)[4],
                                                  uint32_t (&h1)[4]) {
  h0[0] = f32x2_to_f16x2(bf16_lo(lo.x), bf16_lo(lo.z));
  h0[1] = f32x2_to_f16x2(bf16_hi(lo.x), bf16_hi(lo.z));
  h0[2] = f32x2_to_f16x2(bf16_lo(lo.y), bf16_lo(lo.w));
  h0[3] = f32x2_to_f16x2(bf16_hi(lo.y), bf16_hi(lo.w));
  h1[0] = f32x2_to_f16x2(bf16_lo(hi.x), bf16_lo(hi.z));
  h1[1] = f32x2_to_f16x2(bf16_hi(hi.x), bf16_hi(hi.z));
  h1[2] = f32x2_to_f16x2(bf16_lo(hi.y), bf16_lo(hi.w));
  h1[3] = f32x2_to_f16x2(bf16_hi(hi.y), bf16_hi(hi.w));
}

}  // namespace lab_gemm

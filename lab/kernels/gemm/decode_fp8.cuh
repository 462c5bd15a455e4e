// W4A8 weight decode: eight NVFP4 codes of one 32-bit word -> eight e4m3 bytes (two words), through
// the block's magnitude table (lab/w4a8.py magnitude_table: the eight e4m3 bytes of
// E2M1_GRID[j] * scale * 2^-p, as two words, magnitudes 0..3 then 4..7). A table row is read once
// per block; the decode itself is byte permutes and bit operations, no arithmetic per element.
//
// Word layout (lab/w4a8.py decode_words, which prepare_weights applies): elements e0..e7 of one
// word; bits 4j..4j+2 hold e_j's magnitude index (j = 0..7, the standard nibble order), and the
// eight nibble sign bits are re-laid: bit 8j+7 is e_j's sign, bit 8j+3 is e_(4+j)'s (j = 0..3).
// That is the standard NVFP4 word with its sign bits permuted and nothing else.
//
// Why this layout: prmt reads four 4-bit selectors from c[15:0]; bits 2..0 pick one of the eight
// table bytes, bit 3 would replicate the picked byte's sign instead of copying it, so every
// selector's bit 3 must be clear (one AND for both halves), and the high half's selectors must
// be shifted down (one shift). The signs of e0..e3 then lie on their output bytes' bit 7 as
// stored (one LOP3 ORs them in through a mask), those of e4..e7 four bits lower (a shift and a
// LOP3). Per 8 elements:
//
//     LOP3 (index mask) + SHF (high selectors) + 2 PRMT + LOP3 (signs lo) + SHF + LOP3 (signs hi)
//     = 7 instructions, 0.875 per element, plus one 8-byte table load per block row.
//
// Within this family (shifts, masks, permutes, three-input logic) 7 is the least: the 32 bits
// carry 24 index bits and 8 signs, so both selectors need a mask; the high selectors come from
// the word's upper half by a shift of 16, which maps the sign positions {7,15,23,31} onto
// themselves, so the second sign set needs a shift of its own. The two output words may use two
// different tables (decode_fp8_word2), e.g. when a fragment's word spans two blocks, at no cost.
#pragma once
#include <cstdint>

namespace lab_gemm {

// PTX prmt.b32 in its generic form: tmp = {b, a}; byte n of the result is tmp's byte c[4n+2:4n],
// or, with c[4n+3] set, that byte's bit 7 replicated over the byte. (CUDA's __byte_perm documents
// only the three index bits; the decode never sets the fourth.) The host version is the same
// function written out, so host tests run the decode as the device does.
__host__ __device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t c) {
#ifdef __CUDA_ARCH__
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
#else
  const uint64_t src = (uint64_t)b << 32 | a;
  uint32_t d = 0;
  for (int n = 0; n < 4; ++n) {
    const uint32_t sel = (c >> (4 * n)) & 0xFu;
    uint32_t byte = (uint32_t)(src >> (8 * (sel & 7u))) & 0xFFu;
    if (sel & 8u) byte = (byte & 0x80u) ? 0xFFu : 0u;
    d |= byte << (8 * n);
  }
  return d;
#endif
}

constexpr uint32_t FP8_INDEX_MASK = 0x77777777u;  // the eight 3-bit magnitude indices
constexpr uint32_t FP8_SIGN_MASK = 0x80808080u;   // bit 7 of each output byte

// w: one word in decode_words' layout. lo0/lo1: the table row of e0..e3's block, hi0/hi1: e4..e7's.
// lo: bytes j = e4m3 of e_j, hi: bytes j = e4m3 of e_(4+j).
__host__ __device__ __forceinline__ void decode_fp8_word2(uint32_t w, uint32_t lo0, uint32_t lo1, uint32_t hi0,
                                                          uint32_t hi1, uint32_t& lo, uint32_t& hi) {
  const uint32_t sel = w & FP8_INDEX_MASK;
  lo = prmt(lo0, lo1, sel) | (w & FP8_SIGN_MASK);
  hi = prmt(hi0, hi1, sel >> 16) | ((w << 4) & FP8_SIGN_MASK);
}

// The usual case: all eight elements in one 16-element block, one table row (t0, t1).
__host__ __device__ __forceinline__ void decode_fp8_word(uint32_t w, uint32_t t0, uint32_t t1, uint32_t& lo,
                                                         uint32_t& hi) {
  decode_fp8_word2(w, t0, t1, t0, t1, lo, hi);
}

}  // namespace lab_gemm

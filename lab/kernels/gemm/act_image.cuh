// The activation image: the GEMM's B operand decoded once per launch by a pre-pass, for tiles
// with no decoder warps (Config DECODER_WARPS = 0, GemmConfig.image). With token tiles past 64
// the decoder warps' work per stage (TOKEN_TILE x K_STEP values, for every row block of the
// expert again) is what bounds the tile (notes/gemm.md v20); the image moves it out of the GEMM
// and the producer copies each stage's activations as they are.
//
// Layout, fp16 as the decoders write it (v * s * 2^-14 for NVFP4 rows, bf16 rows converted):
//   image[q][grp][half][row][8 values]   256 bytes per (q, grp)
// q = k / 16 over the whole K; grp an 8-token group; half: k slots 0..7 or 8..15 of the block
// (K_SLOTS order, as decode_x gives them); row: the token within its group. Expert e's tokens
// fill ceil(count / 8) groups from image_group0(offsets, e) = offsets[e] / 8 + e, the last one
// padded with zeros: with image_groups(offsets, E) = offsets[E] / 8 + E + 1 groups per q no two
// experts' groups overlap (floor(o / 8) + ceil(c / 8) <= floor((o + c) / 8) + 1). Both kernels
// read the count from offsets on the device (a launch reads no counts back); the host sizes the
// image for T = rows of x >= offsets[E]. One stage (k chunk kc, pass)
// of expert e is then K_STEP / 16 runs of F * 256 contiguous bytes, one per k16 step: the
// consumers' wgmma core-matrix layout [k16 step][fragment][half][row][16 B] (mainloop.cuh).
#pragma once
#include "decode.cuh"
#include "pipeline.cuh"

namespace lab_gemm {

__device__ __forceinline__ int image_group0(const int* offsets, int e) { return offsets[e] / 8 + e; }
__device__ __forceinline__ int image_groups(const int* offsets, int num_experts) {
  return offsets[num_experts] / 8 + num_experts + 1;
}

// Threads: one token slot (group, row) each, QB consecutive k16 blocks (a 32-byte read of NVFP4
// codes, 128 bytes of bf16); blockIdx.y picks the k16 blocks. Eight consecutive threads write one
// whole 256-byte (q, grp) piece. Slots past an expert's tokens (and the groups between experts)
// are written as zeros. Experts with tokens outside count_lo..count_hi are not written at all (a
// GEMM launch over the others does not read them: grouped_gemm's counts_in); the groups of empty
// experts are zeros whatever the range.
constexpr int IMAGE_QB = 4;
constexpr int IMAGE_THREADS = 128;

template <Act ACT>
__global__ void __launch_bounds__(IMAGE_THREADS) act_image(const uint8_t* __restrict__ xq,
                                                           const uint8_t* __restrict__ xs,
                                                           const int* __restrict__ offsets, int num_experts, int K,
                                                           uint8_t* __restrict__ image, int count_lo, int count_hi) {
  const int groups = image_groups(offsets, num_experts);
  const int slot = blockIdx.x * IMAGE_THREADS + threadIdx.x;
  if (slot >= groups * 8) return;
  const int grp = slot >> 3, row = slot & 7;
  int lo = 0, hi = num_experts - 1;  // the last expert whose groups start at or before grp
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (image_group0(offsets, mid) <= grp) lo = mid;
    else hi = mid - 1;
  }
  const int count = offsets[lo + 1] - offsets[lo];
  if (count > 0 && (count < count_lo || count > count_hi)) return;
  const int local = (grp - image_group0(offsets, lo)) * 8 + row;
  const bool valid = local < count;
  const size_t r = (size_t)offsets[lo] + local;
#pragma unroll
  for (int i = 0; i < IMAGE_QB; ++i) {
    const int q = blockIdx.y * IMAGE_QB + i;
    uint32_t h0[4] = {0u, 0u, 0u, 0u}, h1[4] = {0u, 0u, 0u, 0u};
    if (valid) {
      if constexpr (ACT == Act::bf16) {
        const uint4* src = reinterpret_cast<const uint4*>(xq + (r * K + q * 16) * 2);
        decode_bf16_block(src[0], src[1], h0, h1);
      } else {
        const uint2 raw = *reinterpret_cast<const uint2*>(xq + r * (K / 2) + q * 8);
        const uint32_t sc = e4m3x2_to_f16x2(xs[r * (K / 16) + q]);  // low half = this block's scale
        h0[0] = hmul2_lo(decode_x<0>(raw.x), sc);
        h0[1] = hmul2_lo(decode_x<1>(raw.x), sc);
        h0[2] = hmul2_lo(decode_x<2>(raw.x), sc);
        h0[3] = hmul2_lo(decode_x<3>(raw.x), sc);
        h1[0] = hmul2_lo(decode_x<0>(raw.y), sc);
        h1[1] = hmul2_lo(decode_x<1>(raw.y), sc);
        h1[2] = hmul2_lo(decode_x<2>(raw.y), sc);
        h1[3] = hmul2_lo(decode_x<3>(raw.y), sc);
      }
    }
    uint4* dst = reinterpret_cast<uint4*>(image + ((size_t)q * groups + grp) * 256 + row * 16);
    dst[0] = make_uint4(h0[0], h0[1], h0[2], h0[3]);
    dst[8] = make_uint4(h1[0], h1[1], h1[2], h1[3]);
  }
}

}  // namespace lab_gemm

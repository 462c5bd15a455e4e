// The activation image: the GEMM's B operand decoded once per launch, for tiles with no decoder
// warps (Config DECODER_WARPS = 0, GemmConfig.image). With token tiles past 64 the decoder warps'
// work per stage (TOKEN_TILE x K_STEP values, for every row block of the expert again) is what
// bounds the tile (notes/gemm-log.md v20); the image moves it out of the consumers, and the producer
// copies each stage's activations as they are. Two writers of the same bytes:
//   act_image       a pre-pass kernel before the GEMM (the 64- and 96-token tiles, and a split's
//                   larger size class on any image tile: grouped_gemm.prepass_by_default);
//   image_builders  inside the GEMM, on the producer warpgroup's three otherwise idle warps (the
//                   128- and 160-token tiles, Config::BUILDERS; the smaller ones too with
//                   GemmConfig.build_image, a study tile): there the GEMM is compute bound,
//                   so the image's bytes move beside the tensor work instead of before it, and the
//                   producer waits for each unit's pieces of the image, not for a whole pre-pass.
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
        decode_nvfp4_block(raw, sc, h0, h1);
      }
    }
    uint4* dst = reinterpret_cast<uint4*>(image + ((size_t)q * groups + grp) * 256 + row * 16);
    dst[0] = make_uint4(h0[0], h0[1], h0[2], h0[3]);
    dst[8] = make_uint4(h1[0], h1[1], h1[2], h1[3]);
  }
}

// The in-kernel form. A piece is one (active expert i, k chunk kc, token block tb): the image of
// one stage of one split unit, TOKEN_TILE rows x K_STEP, as act_image writes it (rows past the
// block's tokens as zeros). Pieces are numbered problem 0's first, then expert by expert, k chunk
// major: piece0(i) + kc * blocks(i) + tb, the order in which the units' stages need them (units
// claim token blocks fastest, so the first units of an expert take every token block of its first
// row block, all at k chunk 0). Each builder warp claims pieces from sched[2] one at a time, writes
// one, and publishes it with a release on image_ready[piece]; a producer acquires that before it
// copies the piece. No deadlock: a builder never waits, and a piece is claimed only by a running
// warp. The builders are not paced: they write the image well ahead of the units' need, at the
// DRAM rate the GEMM leaves; holding each expert's pieces until the unit counter came within 1, 4
// or 16 waves of its first unit timed level with this (notes/gemm-log.md v34).
//
// unit_end as split_units leaves it; units0: problem 0's split units. Returns the pieces of the
// launch (n_pieces0: problem 0's).
template <int K_STEP>
__host__ __device__ __forceinline__ int image_pieces(const int* unit_end, int n_active, int n_active0, int K0, int K1, int NB0,
                                            int NB1, int& n_pieces0) {
  const int units0 = n_active0 ? unit_end[n_active0 - 1] : 0;
  const int units = n_active ? unit_end[n_active - 1] : 0;
  n_pieces0 = NB0 ? units0 / NB0 * (K0 / K_STEP) : 0;
  return n_pieces0 + (units > units0 ? (units - units0) / NB1 * (K1 / K_STEP) : 0);
}

// The first piece of active expert i (of problem p), from its split units (blocks(i) = its units / NB).
template <int K_STEP>
__host__ __device__ __forceinline__ int image_piece0(const int* unit_end, int i, int p, int n_active0, int n_pieces0, int NB,
                                            int K) {
  const int ubase = p && n_active0 ? unit_end[n_active0 - 1] : 0;
  const int ustart = i ? unit_end[i - 1] : 0;
  return (p ? n_pieces0 : 0) + (ustart - ubase) / NB * (K / K_STEP);
}

// Piece `piece` -> its active expert i (problem p's experts only: a binary search over their first
// pieces), k chunk, token block and the expert's token blocks. (Host-callable: tests/test_gemm_image.py
// checks the numbering on the CPU.)
struct ImagePiece {
  int p, i, kc, tb, blocks;
};
template <int K_STEP>
__host__ __device__ __forceinline__ ImagePiece image_piece_of(int piece, const int* unit_end, int n_active,
                                                              int n_active0, int n_pieces0, int NB0, int NB1, int K0,
                                                              int K1) {
  const int p = piece >= n_pieces0;
  const int NB = LAB_P(NB), K = LAB_P(K);
  int lo = p ? n_active0 : 0, hi = (p ? n_active : n_active0) - 1;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (image_piece0<K_STEP>(unit_end, mid + 1, p, n_active0, n_pieces0, NB, K) > piece) hi = mid;
    else lo = mid + 1;
  }
  ImagePiece r;
  r.p = p;
  r.i = lo;
  r.blocks = (unit_end[lo] - (lo ? unit_end[lo - 1] : 0)) / NB;
  const int local = piece - image_piece0<K_STEP>(unit_end, lo, p, n_active0, n_pieces0, NB, K);
  r.kc = local / r.blocks;
  r.tb = local - r.kc * r.blocks;
  return r;
}

template <class C>
__device__ __forceinline__ void image_builders(const uint8_t* xq0, const uint8_t* xq1, const uint8_t* xs0,
                                               const uint8_t* xs1, const int* offsets0, const int* offsets1, int K0,
                                               int K1, int num_experts0, int num_experts1, int NB0, int NB1,
                                               uint8_t* image0, uint8_t* image1, int* image_ready, int* sched,
                                               const int* active, const int* unit_end, int n_active, int n_active0,
                                               int lane) {
  constexpr int K_STEP = C::K_STEP, KSTEPS = C::KSTEPS;
  int n_pieces0;
  const int n_pieces = image_pieces<K_STEP>(unit_end, n_active, n_active0, K0, K1, NB0, NB1, n_pieces0);
  for (;;) {
    int piece = 0;
    if (lane == 0) piece = atomicAdd(&sched[2], 1);
    piece = __shfl_sync(0xffffffffu, piece, 0);
    if (piece >= n_pieces) return;
    const int p = piece >= n_pieces0;
    const int K = LAB_P(K);
    const int* offsets = LAB_P(offsets);
    const ImagePiece ip = image_piece_of<K_STEP>(piece, unit_end, n_active, n_active0, n_pieces0, NB0, NB1, K0, K1);
    const int kc = ip.kc, tb = ip.tb;
    const int e = active[ip.i];
    const int rows0 = offsets[e] + tb * C::TOKEN_TILE;
    const int count = min(C::TOKEN_TILE, offsets[e + 1] - rows0);
    const int groups = image_groups(offsets, LAB_P(num_experts));
    const int grp0 = image_group0(offsets, e) + tb * C::MAX_FRAGS;
    const uint8_t* xq = LAB_P(xq);
    const uint8_t* xs = LAB_P(xs);
    uint8_t* image = LAB_P(image);
    // lane: token row (lane & 7) of every fourth 8-token group; per row the chunk's K_STEP values
    for (int g = lane >> 3; g < (count + 7) >> 3; g += 4) {
      const int tok = g * 8 + (lane & 7);
      const bool valid = tok < count;
      const size_t r = (size_t)rows0 + tok;
      uint8_t* dst = image + ((size_t)(kc * KSTEPS) * groups + grp0 + g) * 256 + (lane & 7) * 16;
      uint32_t sw[KSTEPS / 4];  // the chunk's block scales, four to a word (K / 16 is a multiple of 8)
#pragma unroll
      for (int w = 0; w < KSTEPS / 4; ++w)
        sw[w] = C::ACT == Act::nvfp4 && valid ? reinterpret_cast<const uint32_t*>(xs + r * (K / 16) + kc * KSTEPS)[w] : 0u;
#pragma unroll
      for (int j = 0; j < KSTEPS; ++j) {
        uint32_t h0[4] = {0u, 0u, 0u, 0u}, h1[4] = {0u, 0u, 0u, 0u};
        if (valid) {
          if constexpr (C::ACT == Act::bf16) {
            const uint4* src = reinterpret_cast<const uint4*>(xq + (r * K + kc * K_STEP + j * 16) * 2);
            decode_bf16_block(src[0], src[1], h0, h1);
          } else {
            const uint2 raw = *reinterpret_cast<const uint2*>(xq + r * (K / 2) + kc * (K_STEP / 2) + j * 8);
            const uint32_t sc = e4m3x2_to_f16x2(sw[j >> 2] >> (8 * (j & 3)));  // low half: block j's scale
            decode_nvfp4_block(raw, sc, h0, h1);
          }
        }
        uint4* d = reinterpret_cast<uint4*>(dst + (size_t)j * groups * 256);
        d[0] = make_uint4(h0[0], h0[1], h0[2], h0[3]);
        d[8] = make_uint4(h1[0], h1[1], h1[2], h1[3]);
      }
    }
    fence_proxy_async_global();  // these generic-proxy writes, before the bulk copies that read them
    __threadfence();
    __syncwarp();
    if (lane == 0) red_release_add(image_ready + piece, 1);
  }
}

}  // namespace lab_gemm

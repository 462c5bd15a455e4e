// The GEMM's epilogues, each a function of one pass's accumulators or of one h tile and its
// EpiTile header, so that an epilogue can change without touching the mainloop.
//   store_tile:   plain; the consumers write out = (acc * ACC_SCALE) * alpha as fp32
//                 (store_tile_bf16: as bf16 bits, on image tiles that are asked to; store_tile_ss:
//                 either, from the transposed accumulator of the MMA = 2 tile).
//   handoff_tile: fused; the consumers put the same values into the shared h tile, fp32
//                 [token][BLOCK_ROWS + 4], for the epilogue warps.
//   swiglu_regs:  the same from the accumulators, on the producer-warpgroup image tiles
//   swiglu_tile:  epilogue warps, w13 tile: SwiGLU with each half's global, then NVFP4 quantize
//                 (nvfp4_act.cuh, the SwiGLU kernel's own functions and lane mapping, so the
//                 result equals the separate kernels' bit for bit).
//   bf16_tile:    epilogue warps, w2 tile of the fused layer: bf16 output.
// D rows are weight rows (output columns), D columns are tokens: acc[r][f] holds rows g, g + 8
// of row tile r * WARPS + warp and tokens 2 * t4, 2 * t4 + 1 of fragment f.
#pragma once
#include "../nvfp4_act.cuh"
#include "pipeline.cuh"
#include "decode.cuh"

namespace lab_gemm {

template <class C>
__device__ __forceinline__ void store_tile(const float (&acc)[C::ROW_TILES][C::MAX_FRAGS][4], float* out, int N,
                                           int nb, int row0, int tok0, int count, int frags, float out_scale,
                                           int warp, int g, int t4) {
  constexpr int WARPS = C::WARPS, ROW_TILES = C::ROW_TILES;
#pragma unroll
  for (int r = 0; r < ROW_TILES; ++r) {
    const int n = (nb * (WARPS * ROW_TILES) + r * WARPS + warp) * 16 + g;
#pragma unroll
    for (int f = 0; f < C::MAX_FRAGS; ++f) {
      if (f < frags) {
        const int tok = tok0 + f * 8 + 2 * t4;
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {  // tokens tok and tok + 1
          if (tok + hh < count) {
            const size_t at = (size_t)(row0 + tok + hh) * N + n;
            const float v0 = (acc[r][f][hh] * C::ACC_SCALE) * out_scale;
            const float v1 = (acc[r][f][2 + hh] * C::ACC_SCALE) * out_scale;
            if (out != nullptr) {
              out[at] = v0;
              out[at + 8] = v1;
            }
          }
        }
      }
    }
  }
}

// store_tile's values as bf16 bits (image tiles asked for a bf16 output): each value rounded as
// the separate conversion rounds it (lab_act::bf16x2_bits, element by element), so the bits equal
// store_tile followed by to_bf16; `bad` counts the outputs that are not finite. Lanes g and g + 1
// (lane ^ 4) hold adjacent columns: one exchange gives the even lane both columns of token tok
// and the odd lane both of token tok + 1, so each store is 4 bytes.
template <class C>
__device__ __forceinline__ void store_tile_bf16(const float (&acc)[C::ROW_TILES][C::MAX_FRAGS][4], unsigned short* out,
                                                int N, int nb, int row0, int tok0, int count, int frags,
                                                float out_scale, int warp, int g, int t4, uint32_t& bad) {
  constexpr int WARPS = C::WARPS, ROW_TILES = C::ROW_TILES;
  const int odd = g & 1;
#pragma unroll
  for (int r = 0; r < ROW_TILES; ++r) {
    const int n = (nb * (WARPS * ROW_TILES) + r * WARPS + warp) * 16 + g - odd;  // the pair's even column
#pragma unroll
    for (int f = 0; f < C::MAX_FRAGS; ++f) {
      if (f < frags) {  // (warp-uniform: every lane takes part in the exchange)
        const int tok = tok0 + f * 8 + 2 * t4 + odd;  // the token this lane stores
#pragma unroll
        for (int j = 0; j < 2; ++j) {  // rows g and g + 8
          const float v0 = (acc[r][f][2 * j] * C::ACC_SCALE) * out_scale;      // token tok0 + f * 8 + 2 * t4
          const float v1 = (acc[r][f][2 * j + 1] * C::ACC_SCALE) * out_scale;  // and the next
          const float mine = odd ? v1 : v0;
          const float theirs = __shfl_xor_sync(0xffffffffu, odd ? v0 : v1, 4);  // the partner's value of `tok`
          const uint32_t b = odd ? lab_act::bf16x2_bits(theirs, mine) : lab_act::bf16x2_bits(mine, theirs);
          if (tok < count) {
            *reinterpret_cast<uint32_t*>(out + (size_t)(row0 + tok) * N + n + 8 * j) = b;
            bad += lab_act::bf16x2_nonfinite(b);
          }
        }
      }
    }
  }
}

// MMA = 2 (tokens as D rows, weight rows as D columns): store_tile's values, or store_tile_bf16's
// bits, from the m64n128 accumulator of warpgroup wg: lane (g, t4) of warp wq (within the
// warpgroup) holds tokens 16 wq + g and 16 wq + g + 8 of the tile, columns 8 i + 2 t4 and the next
// of the warpgroup's 128 (d[4 i + c] = acc[i / 8][i % 8][c]): two adjacent outputs per store.
template <class C>
__device__ __forceinline__ void store_tile_ss(const float (&acc)[2][8][4], float* out, unsigned short* out_bf16,
                                              int N, int nb, int row0, int count, float out_scale, int warp, int g,
                                              int t4, uint32_t& bad) {
  const int n0 = nb * C::BLOCK_ROWS + (warp >> 2) * 128 + 2 * t4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {  // tokens 16 wq + g, + 8
    const int tok = (warp & 3) * 16 + g + 8 * h;
    if (tok < count) {
      const size_t at = (size_t)(row0 + tok) * N + n0;
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const float v0 = (acc[i >> 3][i & 7][2 * h] * C::ACC_SCALE) * out_scale;
        const float v1 = (acc[i >> 3][i & 7][2 * h + 1] * C::ACC_SCALE) * out_scale;
        if (out_bf16 != nullptr) {
          const uint32_t b = lab_act::bf16x2_bits(v0, v1);
          *reinterpret_cast<uint32_t*>(out_bf16 + at + 8 * i) = b;
          bad += lab_act::bf16x2_nonfinite(b);
        } else if (out != nullptr) {
          *reinterpret_cast<float2*>(out + at + 8 * i) = make_float2(v0, v1);
        }
      }
    }
  }
}

// Mode::swiglu on the producer-warpgroup image tiles (no epilogue warps): SwiGLU + NVFP4 quantize
// from the accumulators. pair_gate_up puts a block's gate rows in row tile 0 and the matching up
// rows in row tile 1, so lane (g, t4) holds both halves of columns c0 + g and c0 + g + 8 of two
// tokens, c0 = this warp's 16 columns: one NVFP4 block per token, spread over the 8 lanes of one
// t4 (lane bits 2-4). Its amax by three exchanges, each lane's two codes by the SwiGLU kernel's
// functions, the block's 8 bytes gathered by three more (ORs of disjoint nibbles): the same bits
// as swiglu_tile and the separate kernels. `bad` counts SwiGLU values that are not finite.
// SWIGLU_GROUP fragments go through each step together: the steps are a chain of dependent
// latencies (expf, exchanges, divisions), and with two consumer warps per scheduler one
// fragment's chain leaves the issue slots idle while the tensor work waits for the epilogue
// (ncu at 128 tokens per expert: 52% tensor-pipe activity against the plain tile's 81%). Past the
// pass's fragments the accumulators are zero (zero_acc) and their tokens past `count`: computed,
// never stored or counted. The quantize takes quantize_fast unless a block's denominator is out
// of its range, then quantize_element, the same choice per block as before.
constexpr int SWIGLU_GROUP = 2;
template <class C>
__device__ __forceinline__ void swiglu_regs(const float (&acc)[C::ROW_TILES][C::MAX_FRAGS][4], float gs, float us,
                                            float act_global, float six_g, int I, uint8_t* a_packed,
                                            uint8_t* a_scales, int nb, int row0, int tok0, int count, int frags,
                                            float out_scale, int warp, int g, int t4, uint32_t& bad) {
  static_assert(C::ROW_TILES == 2, "row tile 0: the gate rows; row tile 1: the matching up rows");
  static_assert(C::MAX_FRAGS % SWIGLU_GROUP == 0, "whole fragment groups");
  constexpr int K = 2 * SWIGLU_GROUP;  // (fragment, token of the lane's pair) items of a group
  const int c0 = nb * (C::BLOCK_ROWS / 2) + warp * 16;
#pragma unroll
  for (int f0 = 0; f0 < C::MAX_FRAGS; f0 += SWIGLU_GROUP) {
    if (f0 < frags) {  // (warp-uniform: every lane takes part in the exchanges)
      float a[K][2], amax[K], denom[K];
      uint32_t code[K], lo[K], hi[K];
      bool fast = true;
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int f = f0 + (k >> 1), hh = k & 1;
#pragma unroll
        for (int j = 0; j < 2; ++j)  // columns c0 + g, c0 + g + 8
          a[k][j] = lab_act::swiglu((acc[0][f][2 * j + hh] * C::ACC_SCALE) * out_scale,
                                    (acc[1][f][2 * j + hh] * C::ACC_SCALE) * out_scale, gs, us);
        amax[k] = fmaxf(fabsf(a[k][0]), fabsf(a[k][1]));
      }
#pragma unroll
      for (int m = 4; m <= 16; m <<= 1)
#pragma unroll
        for (int k = 0; k < K; ++k) amax[k] = fmaxf(amax[k], __shfl_xor_sync(0xffffffffu, amax[k], m));
#pragma unroll
      for (int k = 0; k < K; ++k) {
        code[k] = lab_act::block_scale(amax[k], act_global, six_g, denom[k]);
        fast = fast && denom[k] != 0.0f && lab_act::fast_block(denom[k], amax[k]);
        const float rr = lab_act::rcp_refined(denom[k]);
        lo[k] = lab_act::quantize_fast(a[k][0], denom[k], rr) << (4 * g);  // nibble g of columns 0-7
        hi[k] = lab_act::quantize_fast(a[k][1], denom[k], rr) << (4 * g);  // and of columns 8-15
      }
      if (!fast) {  // a denominator out of quantize_fast's range (zero blocks among them): redo those
#pragma unroll
        for (int k = 0; k < K; ++k) {
          if (!(denom[k] != 0.0f && lab_act::fast_block(denom[k], amax[k]))) {
            lo[k] = lab_act::quantize_element(a[k][0], denom[k]) << (4 * g);
            hi[k] = lab_act::quantize_element(a[k][1], denom[k]) << (4 * g);
          }
        }
      }
#pragma unroll
      for (int m = 4; m <= 16; m <<= 1)
#pragma unroll
        for (int k = 0; k < K; ++k) {
          lo[k] |= __shfl_xor_sync(0xffffffffu, lo[k], m);
          hi[k] |= __shfl_xor_sync(0xffffffffu, hi[k], m);
        }
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int tok = tok0 + (f0 + (k >> 1)) * 8 + 2 * t4 + (k & 1);  // the same for the block's 8 lanes
        if (tok < count) {
          bad += !lab_act::finite(a[k][0]) + !lab_act::finite(a[k][1]);
          if (g == 0) {
            const size_t row = (size_t)(row0 + tok);
            *reinterpret_cast<uint2*>(a_packed + row * (I / 2) + c0 / 2) = make_uint2(lo[k], hi[k]);
            a_scales[row * (I / 16) + c0 / 16] = (uint8_t)code[k];
          }
        }
      }
    }
  }
}

template <class C>
__device__ __forceinline__ void handoff_tile(const float (&acc)[C::ROW_TILES][C::MAX_FRAGS][4], float* htile,
                                             int frags, float out_scale, int warp, int g, int t4) {
#pragma unroll
  for (int r = 0; r < C::ROW_TILES; ++r) {
    const int n = (r * C::WARPS + warp) * 16 + g;  // column within the block (w13: gate half, then up half)
#pragma unroll
    for (int f = 0; f < C::MAX_FRAGS; ++f) {
      if (f < frags) {
        float* hrow = htile + (f * 8 + 2 * t4) * C::H_STRIDE + n;
        hrow[0] = (acc[r][f][0] * C::ACC_SCALE) * out_scale;
        hrow[8] = (acc[r][f][2] * C::ACC_SCALE) * out_scale;
        hrow[C::H_STRIDE] = (acc[r][f][1] * C::ACC_SCALE) * out_scale;
        hrow[C::H_STRIDE + 8] = (acc[r][f][3] * C::ACC_SCALE) * out_scale;
      }
    }
  }
}

// Item = 4 consecutive gate columns of one token (and the 4 matching up columns); the 4 lanes of
// a quad hold one 16-column block, as in the SwiGLU kernel. w13 is laid out so that each block
// of BLOCK_ROWS rows holds BLOCK_ROWS/2 gate rows and the matching up rows (pair_gate_up).
// `bad` counts SwiGLU values that are not finite.
template <class C>
__device__ __forceinline__ void swiglu_tile(const EpiTile& t, const float* htile, const float* gate_global,
                                            const float* up_global, float act_global, float six_g, int I,
                                            uint8_t* a_packed, uint8_t* a_scales, int ew, int lane, uint32_t& bad) {
  constexpr int Q = C::BLOCK_ROWS / 8;  // items per token row
  const float gs = gate_global[t.expert], us = up_global[t.expert];
  for (int item = ew * 32 + lane; item < t.ntok * Q; item += 32 * C::EPILOGUE_WARPS) {  // quads are all in or out
    const int tr = item / Q, c4 = item - tr * Q;
    const float4 hg = *reinterpret_cast<const float4*>(htile + tr * C::H_STRIDE + 4 * c4);
    const float4 hu = *reinterpret_cast<const float4*>(htile + tr * C::H_STRIDE + C::BLOCK_ROWS / 2 + 4 * c4);
    float a[4];
    a[0] = lab_act::swiglu(hg.x, hu.x, gs, us);
    a[1] = lab_act::swiglu(hg.y, hu.y, gs, us);
    a[2] = lab_act::swiglu(hg.z, hu.z, gs, us);
    a[3] = lab_act::swiglu(hg.w, hu.w, gs, us);
#pragma unroll
    for (int i = 0; i < 4; ++i) bad += !lab_act::finite(a[i]);
    const size_t row = (size_t)(t.row0 + t.tok0 + tr);
    lab_act::quantize4(a, act_global, six_g, c4, a_packed + row * (I / 2) + t.col0 / 2,
                       a_scales + row * (I / 16) + t.col0 / 16);
  }
}

// W4A16 (bf16 activations): the same SwiGLU values as swiglu_tile, rounded to bf16 (the w2 GEMM's
// input, a (rows, I)) instead of quantized; 4 columns = one 8-byte store. `bad` counts the values
// the w2 GEMM's fp16 conversion cannot hold (|a| >= 65536, Inf, NaN).
template <class C>
__device__ __forceinline__ void swiglu_bf16_tile(const EpiTile& t, const float* htile, const float* gate_global,
                                                 const float* up_global, int I, unsigned short* a_bf16, int ew,
                                                 int lane, uint32_t& bad) {
  constexpr int Q = C::BLOCK_ROWS / 8;  // items per token row
  const float gs = gate_global[t.expert], us = up_global[t.expert];
  for (int item = ew * 32 + lane; item < t.ntok * Q; item += 32 * C::EPILOGUE_WARPS) {
    const int tr = item / Q, c4 = item - tr * Q;
    const float4 hg = *reinterpret_cast<const float4*>(htile + tr * C::H_STRIDE + 4 * c4);
    const float4 hu = *reinterpret_cast<const float4*>(htile + tr * C::H_STRIDE + C::BLOCK_ROWS / 2 + 4 * c4);
    const uint32_t b01 = lab_act::bf16x2_bits(lab_act::swiglu(hg.x, hu.x, gs, us), lab_act::swiglu(hg.y, hu.y, gs, us));
    const uint32_t b23 = lab_act::bf16x2_bits(lab_act::swiglu(hg.z, hu.z, gs, us), lab_act::swiglu(hg.w, hu.w, gs, us));
    const size_t row = (size_t)(t.row0 + t.tok0 + tr);
    *reinterpret_cast<uint2*>(a_bf16 + row * I + t.col0 + 4 * c4) = make_uint2(b01, b23);
    bad += lab_act::bf16x2_past_fp16(b01) + lab_act::bf16x2_past_fp16(b23);
  }
}

// Item = two adjacent columns of one token, consecutive along the row across lanes: one 4-byte
// store each, a warp's 32 of them one 128-byte line. `bad` counts outputs that are not finite.
template <class C>
__device__ __forceinline__ void bf16_tile(const EpiTile& t, const float* htile, unsigned short* out1_bf16, int N1, int ew,
                                          int lane, uint32_t& bad) {
  constexpr int PAIRS = C::BLOCK_ROWS / 2;
  for (int item = ew * 32 + lane; item < t.ntok * PAIRS; item += 32 * C::EPILOGUE_WARPS) {
    const int tr = item / PAIRS, cp = item - tr * PAIRS;
    const float2 v = *reinterpret_cast<const float2*>(htile + tr * C::H_STRIDE + 2 * cp);
    const uint32_t b = lab_act::bf16x2_bits(v.x, v.y);
    *reinterpret_cast<uint32_t*>(out1_bf16 + (size_t)(t.row0 + t.tok0 + tr) * N1 + t.col0 + 2 * cp) = b;
    bad += lab_act::bf16x2_nonfinite(b);
  }
}

}  // namespace lab_gemm

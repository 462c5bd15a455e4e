// The W4A8 activation kernels: quantize_act (the 1x128 fp8 quantize, below) and swiglu_quant (the
// SwiGLU of the w13 output, then the same quantize; at the end of the file).
//
// 1x128 fp8 activation quantize for W4A8 (lab/w4a8.py quantize_act, bit for bit): per row and per
// group of 128 columns of K,
//
//   amax = max(max |x|, 2^-116)     inv = 448 / amax     s_x = amax / 448
//   x8   = e4m3(x * inv), round to nearest even, saturating to +-448
//
// every operation in IEEE float32 with round to nearest (explicit _rn intrinsics, so neither a
// fast-math build nor FMA contraction can change them). CuPy appends -ftz=true to every NVRTC
// compile, so a float32 op flushes subnormal operands to zero; a subnormal x is multiplied in
// two exact steps instead (times_inv). The last group of a K that is not a multiple of 128 is
// the zero-padded one.
//
// Saturation: cvt.rn.satfinite.e4m3x2.f32 rounds to nearest even and clamps finite results past
// 448 to +-448, which is quantize_act's clip followed by its cast (a clip first would also turn
// NaN into -448; the instruction keeps NaN as NaN instead). x * inv lies within two float32 ulps
// of 448 at most, so only the amax element and its near ties ever saturate.
//
// Threads: one warp per (row, group); lane l owns columns 128g + 4l .. 4l + 3 (one 16-byte fp32
// or 8-byte bf16 load, one 4-byte store of codes). The group's amax is a butterfly of fmaxf over
// the warp (exact, order-free); lane 0 writes s_x. Lanes past K load nothing and contribute 0.
//
// Non-finite inputs (the reference refuses them): fmaxf skips NaN, so a NaN element's own code is
// the e4m3 NaN (0x7F or 0xFF) and the rest of its group is quantized as without it; an Inf makes
// amax infinite, inv 0 and the group's codes 0 except its own NaN. Each thread adds the number of
// non-finite values it read to *nonfinite, for the caller to check.
//
// Layout: x (rows, K) float32 or uint16 (bf16 bits) row-major, K % 4 == 0; x8 (rows, K) uint8;
// s_x (rows, ceil(K / 128)) float32.

#include "w4a8_act.cuh"

namespace lab_w4a8_act {

template <typename T>
__global__ void quantize_act(const T* __restrict__ x, int rows, int K, uint8_t* __restrict__ x8,
                             float* __restrict__ s_x, uint32_t* __restrict__ nonfinite) {
  const int G = (K + 127) / 128;
  const long long unit = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (unit >= (long long)rows * G) return;  // whole warps: the shuffles below see all 32 lanes
  const int lane = threadIdx.x & 31;
  const size_t row = (size_t)(unit / G);
  const int gi = (int)(unit % G);
  const int col = gi * 128 + 4 * lane;
  const bool live = col < K;  // K % 4 == 0: a lane's four columns are all in or all out

  float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  if (live) load4(x + row * K + col, v);
  uint32_t bad = 0;
  float m = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    bad += !finite(v[i]);
    m = fmaxf(m, fabsf(v[i]));
  }
  quantize_group(v, m, live, lane, row, K, col, G, gi, x8, s_x);
  if (bad) atomicAdd(nonfinite, bad);
}

// ------------------------------------------------------------------------------ SwiGLU + quantize
//
// swiglu_quant: h (rows, 2I) float32, the w13 GEMM's output (gate in columns [0, I), up in
// [I, 2I), no weight globals), rows grouped by expert through offsets (E+1,) int32;
//
//   a = silu(h_gate * gate_global[e]) * (h_up * up_global[e])     lab/w4a8.py swiglu_f32
//   a8, s_a = the 1x128 quantize of a (quantize_group above)      lab/w4a8.py quantize_act
//
// bit for bit with lab/w4a8.py swiglu_quant. The SwiGLU is that module's float32 definition, its
// own exponential included (not expf: two libraries' exp do not round alike, and this one NumPy
// repeats operation by operation): every operation is inline PTX without .ftz, so -ftz=true
// flushes none of it and nothing contracts into an FMA. Threads as quantize_act: one warp per
// (row, group of 128 columns of I), lane l owns columns 128g + 4l .. 4l + 3; the warp finds its
// row's expert by binary search on offsets (the last e with offsets[e] <= row: empty experts
// are passed over). a_out, when not null, receives a (rows, I) float32 for checks. Each thread
// adds to *nonfinite the number of its columns with NaN or Inf in h_gate, h_up or a.
// Layout: I % 4 == 0; a8 (rows, I) uint8; s_a (rows, ceil(I / 128)) float32.

__global__ void swiglu_quant(const float* __restrict__ h, const int* __restrict__ offsets, int experts, int rows,
                             int I, const float* __restrict__ gate_global, const float* __restrict__ up_global,
                             uint8_t* __restrict__ a8, float* __restrict__ s_a, float* __restrict__ a_out,
                             uint32_t* __restrict__ nonfinite) {
  const int G = (I + 127) / 128;
  const long long unit = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (unit >= (long long)rows * G) return;  // whole warps: the group's shuffles see all 32 lanes
  const int lane = threadIdx.x & 31;
  const size_t row = (size_t)(unit / G);
  const int gi = (int)(unit % G);
  const int col = gi * 128 + 4 * lane;
  const bool live = col < I;  // I % 4 == 0: a lane's four columns are all in or all out

  float hg[4] = {0.0f, 0.0f, 0.0f, 0.0f}, hu[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  if (live) {  // issued before the search, which waits only on offsets
    load4(h + row * (2 * (size_t)I) + col, hg);
    load4(h + row * (2 * (size_t)I) + I + col, hu);
  }
  const int e = row_expert(offsets, experts, (int)row);
  const float gs = gate_global[e], us = up_global[e];
  float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  uint32_t bad = 0;
  float m = 0.0f;
  if (live) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      a[i] = swiglu_f32(hg[i], hu[i], gs, us);
      bad += !(finite(hg[i]) && finite(hu[i]) && finite(a[i]));  // (a NaN or Inf h_gate can give a finite a)
      m = fmaxf(m, fabsf(a[i]));
    }
    if (a_out) *reinterpret_cast<float4*>(a_out + row * I + col) = make_float4(a[0], a[1], a[2], a[3]);
  }
  quantize_group(a, m, live, lane, row, I, col, G, gi, a8, s_a);
  if (bad) atomicAdd(nonfinite, bad);
}

}  // namespace lab_w4a8_act

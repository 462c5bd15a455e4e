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
  if (bad) atomicAdd(nonfinite, bad);
}

}  // namespace lab_w4a8_act

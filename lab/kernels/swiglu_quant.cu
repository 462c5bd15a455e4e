// Activation kernels of the MoE layer: NVFP4 quantize of rows (the input quantizer, optionally
// gathering token rows), SwiGLU + quantize (w13 output -> w2 input), and fp32 -> bf16 (the output).
//
// Quantization and SwiGLU arithmetic: nvfp4_act.cuh (shared with the GEMM's fused epilogue).
//
// Layout (plain row-major, what the grouped GEMM reads):
//   packed (rows, K/2)  uint8  element 2j in the low nibble of byte j
//   scales (rows, K/16) uint8  raw e4m3 bits, one per 16 elements
//
// Threads: grid (rows, ceil(K/4 / blockDim)); a thread owns 4 consecutive elements (one 16-byte
// fp32 load, two bytes of codes), the 4 lanes of an aligned quad own one 16-element block and
// share its amax by two shuffles; lane 0 of the quad writes the scale byte. A warp reads 512
// contiguous bytes per load and writes 64 contiguous bytes of codes. One step per thread keeps
// blocks short, so the last wave of a few thousand rows is a small fraction of the kernel.
//
// Non-finite values (NaN or Inf in the input, or in a = silu(g) * u, which any non-finite h or
// overflow of g reaches) are counted into *nonfinite (one atomicAdd per thread that saw any);
// their codes are meaningless and the caller must read the counter after a checked run.

#include "nvfp4_act.cuh"

namespace lab_act {

// ------------------------------------------------------------------------------ quantize

__device__ __forceinline__ void load4(const float* p, float (&v)[4]) {
  const float4 t = *reinterpret_cast<const float4*>(p);
  v[0] = t.x; v[1] = t.y; v[2] = t.z; v[3] = t.w;
}
__device__ __forceinline__ void load4(const uint16_t* p, float (&v)[4]) {  // bf16 bits
  const uint2 t = *reinterpret_cast<const uint2*>(p);
  v[0] = __uint_as_float(t.x << 16); v[1] = __uint_as_float(t.x & 0xffff0000u);
  v[2] = __uint_as_float(t.y << 16); v[3] = __uint_as_float(t.y & 0xffff0000u);
}

// out row r = NVFP4(x[row_src ? row_src[r] : r]) with global g. T: float or uint16_t (bf16 bits).
// Requires K % 16 == 0 and blockDim.x % 32 == 0.
template <typename T>
__global__ void quantize_rows(const T* __restrict__ x, const int* __restrict__ row_src, int K, float g,
                              uint8_t* __restrict__ packed, uint8_t* __restrict__ scales,
                              uint32_t* __restrict__ nonfinite) {
  const int r = blockIdx.x;
  const int c4 = blockIdx.y * blockDim.x + threadIdx.x;
  if (c4 >= K / 4) return;  // K/4 and blockDim are multiples of 4: quads leave together
  const size_t src = row_src ? (size_t)row_src[r] : (size_t)r;
  float v[4];
  load4(x + src * K + 4 * c4, v);
  uint32_t bad = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) bad += !finite(v[i]);
  quantize4(v, g, __fmul_rn(6.0f, g), c4, packed + (size_t)r * (K / 2), scales + (size_t)r * (K / 16));
  if (bad) atomicAdd(nonfinite, bad);
}

// ------------------------------------------------------------------------------ SwiGLU + quantize

// Row r's expert e (offsets[e] <= r < offsets[e+1]; empty experts skipped by taking the last e
// with offsets[e] <= r), found by thread 0 while the block's h loads are in flight, into the
// block's shared `row_expert`; every thread waits for it.
__device__ __forceinline__ void find_row_expert(const int* __restrict__ offsets, int experts, int r, int& row_expert) {
  if (threadIdx.x == 0) {
    int lo = 0, hi = experts;
    while (hi - lo > 1) {
      const int mid = (lo + hi) >> 1;
      if (offsets[mid] <= r) lo = mid; else hi = mid;
    }
    row_expert = lo;
  }
  __syncthreads();
}

// h (rows, 2I) fp32: gate in columns [0, I), up in [I, 2I), no weight globals applied.
// Row r belongs to expert e with offsets[e] <= r < offsets[e+1]: thread 0 of the block finds it
// by binary search while the h loads are in flight (empty experts have offsets[e] ==
// offsets[e+1] and are skipped by taking the last e with offsets[e] <= r).
//   a = swiglu(h_gate, h_up, gate_global[e], up_global[e])   (nvfp4_act.cuh)
// a is quantized with the static global g2 into packed (rows, I/2) / scales (rows, I/16); when
// a_out is not null the fp32 a (rows, I) is written too (for checks). Only the rows of experts
// with count_lo..count_hi tokens are read and written (as the grouped GEMM's counts_in: one size
// class of a split plan; the others' rows keep what they hold).
__global__ void swiglu_quant(const float* __restrict__ h, const int* __restrict__ offsets, int experts, int I,
                             const float* __restrict__ gate_global, const float* __restrict__ up_global,
                             float g2, uint8_t* __restrict__ packed, uint8_t* __restrict__ scales,
                             float* __restrict__ a_out, uint32_t* __restrict__ nonfinite, int count_lo,
                             int count_hi) {
  __shared__ int row_expert;
  const int r = blockIdx.x;
  const int c4 = blockIdx.y * blockDim.x + threadIdx.x;
  const bool active = c4 < I / 4;  // quads are all in or all out
  float hg[4], hu[4], a[4];
  const float* hr = h + (size_t)r * (2 * I);
  if (active) {  // issued before the search, which only waits on offsets
    load4(hr + 4 * c4, hg);
    load4(hr + I + 4 * c4, hu);
  }
  find_row_expert(offsets, experts, r, row_expert);
  if (!active) return;
  if (count_lo > 1 || count_hi < 0x7fffffff) {  // (a size class: one more load, only then)
    const int count = offsets[row_expert + 1] - offsets[row_expert];
    if (count < count_lo || count > count_hi) return;  // (the whole block: one row, one expert)
  }
  const float gs = gate_global[row_expert], us = up_global[row_expert];
  uint32_t bad = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    a[i] = swiglu(hg[i], hu[i], gs, us);
    bad += !finite(a[i]);  // NaN or Inf anywhere in h reaches a (0 * Inf is NaN)
  }
  if (a_out) *reinterpret_cast<float4*>(a_out + (size_t)r * I + 4 * c4) = make_float4(a[0], a[1], a[2], a[3]);
  quantize4(a, g2, __fmul_rn(6.0f, g2), c4, packed + (size_t)r * (I / 2), scales + (size_t)r * (I / 16));
  if (bad) atomicAdd(nonfinite, bad);
}

// ------------------------------------------------------------------------------ W4A16

// The W4A16 layer's activations are bf16: what its GEMMs read (converted to fp16 there, so a
// value fp16 cannot hold is counted into *bad, as the NVFP4 path counts non-finite ones).

// y row r = bf16 bits of x[row_src[r]] (T: float, rounded to nearest even; or uint16_t, bf16
// bits copied). Grid and threads as quantize_rows.
template <typename T>
__global__ void gather_bf16(const T* __restrict__ x, const int* __restrict__ row_src, int K,
                            uint16_t* __restrict__ y, uint32_t* __restrict__ bad) {
  const int r = blockIdx.x;
  const int c4 = blockIdx.y * blockDim.x + threadIdx.x;
  if (c4 >= K / 4) return;
  float v[4];
  load4(x + (size_t)row_src[r] * K + 4 * c4, v);
  const uint32_t b01 = bf16x2_bits(v[0], v[1]), b23 = bf16x2_bits(v[2], v[3]);
  reinterpret_cast<uint2*>(y + (size_t)r * K)[c4] = make_uint2(b01, b23);
  const uint32_t n = bf16x2_past_fp16(b01) + bf16x2_past_fp16(b23);
  if (n) atomicAdd(bad, n);
}

// a = swiglu(h_gate, h_up, gate_global[e], up_global[e]) as bf16 bits into a_bf16 (rows, I): as
// swiglu_quant up to a, then rounded to bf16 instead of quantized.
__global__ void swiglu_bf16(const float* __restrict__ h, const int* __restrict__ offsets, int experts, int I,
                            const float* __restrict__ gate_global, const float* __restrict__ up_global,
                            uint16_t* __restrict__ a_bf16, uint32_t* __restrict__ bad) {
  __shared__ int row_expert;
  const int r = blockIdx.x;
  const int c4 = blockIdx.y * blockDim.x + threadIdx.x;
  const bool active = c4 < I / 4;
  float hg[4], hu[4];
  const float* hr = h + (size_t)r * (2 * I);
  if (active) {
    load4(hr + 4 * c4, hg);
    load4(hr + I + 4 * c4, hu);
  }
  find_row_expert(offsets, experts, r, row_expert);
  if (!active) return;
  const float gs = gate_global[row_expert], us = up_global[row_expert];
  const uint32_t b01 = bf16x2_bits(swiglu(hg[0], hu[0], gs, us), swiglu(hg[1], hu[1], gs, us));
  const uint32_t b23 = bf16x2_bits(swiglu(hg[2], hu[2], gs, us), swiglu(hg[3], hu[3], gs, us));
  reinterpret_cast<uint2*>(a_bf16 + (size_t)r * I)[c4] = make_uint2(b01, b23);
  const uint32_t n = bf16x2_past_fp16(b01) + bf16x2_past_fp16(b23);
  if (n) atomicAdd(bad, n);
}

// ------------------------------------------------------------------------------ output

// y = bf16 bits of x, n4 = n / 4 groups of 4 elements; counts non-finite outputs (NaN, Inf in
// x, or finite values that overflow bf16).
__global__ void to_bf16(const float* __restrict__ x, uint16_t* __restrict__ y, size_t n4,
                        uint32_t* __restrict__ nonfinite) {
  uint32_t bad = 0;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += (size_t)gridDim.x * blockDim.x) {
    const float4 v = reinterpret_cast<const float4*>(x)[i];
    const uint32_t b01 = bf16x2_bits(v.x, v.y), b23 = bf16x2_bits(v.z, v.w);
    bad += bf16x2_nonfinite(b01) + bf16x2_nonfinite(b23);
    reinterpret_cast<uint2*>(y)[i] = make_uint2(b01, b23);
  }
  if (bad) atomicAdd(nonfinite, bad);
}

// ------------------------------------------------------------------------------ checks

// For tests: counts the pairs (v[i], d[i]) where div_refined differs from div.rn. The callers
// draw d in fast_block's range and v / d where the e2m1 rounding looks (|q| in [2^-3, 8]).
__global__ void div_check(const float* __restrict__ v, const float* __restrict__ d, size_t n,
                          unsigned long long* __restrict__ mismatches) {
  unsigned long long bad = 0;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const float a = div_refined(v[i], d[i], rcp_refined(d[i]));
    bad += __float_as_uint(a) != __float_as_uint(__fdiv_rn(v[i], d[i]));
  }
  if (bad) atomicAdd(mismatches, bad);
}

}  // namespace lab_act

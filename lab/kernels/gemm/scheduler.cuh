// The persistent schedule. Units of work are (problem, expert with tokens, row block), problem
// 0's first; each CTA's producer claims them one at a time from a device counter, so a CTA that
// drew cheap units (few tokens) takes more of them and no static imbalance is left at the tail.
#pragma once
#include "pipeline.cuh"

namespace lab_gemm {

// Compact the experts that have tokens (block-wide ballot scan) into active[], problem 0's then
// problem 1's: units are (active expert, row block), so empty experts cost nothing. With
// COUNTS_IN only experts of count_lo..count_hi tokens (count_lo >= 1) count as active: a launch
// can take the experts of one size class, another launch with another tile the rest.
// n_active: both problems' active experts; n_active0: problem 0's. Ends with the CTA in step.
template <int THREADS, bool COUNTS_IN>
__device__ __forceinline__ void compact_experts(const int* offsets0, const int* offsets1, int num_experts0,
                                                int num_experts1, int count_lo, int count_hi, int* active,
                                                int* warp_count, int& n_active, int& n_active0, int warp, int lane) {
  for (int p = 0; p < 2; ++p) {
    const int num_experts = LAB_P(num_experts);
    const int* offsets = LAB_P(offsets);
    for (int base = 0; base < num_experts; base += THREADS) {
      __syncthreads();
      const int ex = base + (int)threadIdx.x;
      bool has;
      if constexpr (COUNTS_IN) {
        const int count = ex < num_experts ? offsets[ex + 1] - offsets[ex] : 0;
        has = count >= count_lo && count <= count_hi;
      } else {
        has = ex < num_experts && offsets[ex + 1] > offsets[ex];
      }
      const uint32_t ballot = __ballot_sync(0xffffffffu, has);
      if (lane == 0) warp_count[warp] = __popc(ballot);
      __syncthreads();
      int before = n_active;
      for (int w = 0; w < warp; ++w) before += warp_count[w];
      if (has) active[before + __popc(ballot & ((1u << lane) - 1u))] = ex;
      __syncthreads();
      if (threadIdx.x == 0) {
        int total = 0;
        for (int w = 0; w < THREADS / 32; ++w) total += warp_count[w];
        n_active += total;
      }
    }
    __syncthreads();
    if (p == 0 && threadIdx.x == 0) n_active0 = n_active;
  }
}

// unit u -> problem p, expert e (local to p), row block nb; problem 0's units come first
// (the kernel's unit_of, a lambda over the compacted list: as a struct method ptxas schedules the
// producer differently)
struct Unit {
  int p, e, nb;
};
// An image tile's unit: the same and its token block (a type of its own, so that the other
// tiles' producers compile as they did before split units); i: the expert's place in the
// compacted list and blocks: its token blocks (the in-kernel image's piece numbers, act_image.cuh)
struct SplitUnit {
  int p, e, nb, tb, i, blocks;
};

// Image tiles (no decoder warps, large token counts): units are (problem, active expert, row
// block, token block of TOKEN_TILE), the token block fastest, one pass each. The CTAs that take
// one row block's token blocks then stream its weights at about the same time, once from DRAM
// and the rest from L2, where a unit of several passes re-read them from DRAM once per pass
// (notes/gemm-log.md v21). The producer warp's scan: unit_end[i] = units of active experts 0..i;
// returns their total.
template <int TOKEN_TILE>
__device__ __forceinline__ int split_units(const int* active, int n_active, int n_active0, const int* offsets0,
                                          const int* offsets1, int NB0, int NB1, int* unit_end, int lane) {
  int carry = 0;
  for (int base = 0; base < n_active; base += 32) {
    const int i = base + lane;
    int v = 0;
    if (i < n_active) {
      const int p = i >= n_active0;
      const int* offsets = LAB_P(offsets);
      const int e = active[i];
      v = LAB_P(NB) * ((offsets[e + 1] - offsets[e] + TOKEN_TILE - 1) / TOKEN_TILE);
    }
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int o = __shfl_up_sync(0xffffffffu, v, d);
      if (lane >= d) v += o;
    }
    if (i < n_active) unit_end[i] = carry + v;
    carry += __shfl_sync(0xffffffffu, v, 31);
  }
  __syncwarp();
  return carry;
}

// split unit u -> (problem, expert, row block, token block): the first active expert whose
// unit_end passes u, then row block and token block within its units.
__device__ __forceinline__ SplitUnit split_unit_of(int u, const int* active, const int* unit_end, int n_active,
                                              int n_active0, int NB0, int NB1) {
  int lo = 0, hi = n_active - 1;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (unit_end[mid] > u) hi = mid;
    else lo = mid + 1;
  }
  const int start = lo ? unit_end[lo - 1] : 0;
  const int p = lo >= n_active0;
  const int blocks = (unit_end[lo] - start) / LAB_P(NB);  // token blocks of this expert
  const int local = u - start;
  SplitUnit r;
  r.p = p;
  r.e = active[lo];
  r.nb = local / blocks;
  r.tb = local - r.nb * blocks;
  r.i = lo;
  r.blocks = blocks;
  return r;
}

}  // namespace lab_gemm

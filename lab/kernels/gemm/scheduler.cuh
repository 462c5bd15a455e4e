// The persistent schedule. Units of work are (problem, expert with tokens, row block), problem
// 0's first; each CTA's producer claims them one at a time from a device counter, so a CTA that
// drew cheap units (few tokens) takes more of them and no static imbalance is left at the tail.
#pragma once
#include "pipeline.cuh"

namespace lab_gemm {

// Compact the experts that have tokens (block-wide ballot scan) into active[], problem 0's then
// problem 1's: units are (active expert, row block), so empty experts cost nothing.
// n_active: both problems' active experts; n_active0: problem 0's. Ends with the CTA in step.
template <int THREADS>
__device__ __forceinline__ void compact_experts(const int* offsets0, const int* offsets1, int num_experts0,
                                                int num_experts1, int* active, int* warp_count, int& n_active,
                                                int& n_active0, int warp, int lane) {
  for (int p = 0; p < 2; ++p) {
    const int num_experts = LAB_P(num_experts);
    const int* offsets = LAB_P(offsets);
    for (int base = 0; base < num_experts; base += THREADS) {
      __syncthreads();
      const int ex = base + (int)threadIdx.x;
      const bool has = ex < num_experts && offsets[ex + 1] > offsets[ex];
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

}  // namespace lab_gemm

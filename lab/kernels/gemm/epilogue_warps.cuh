// The epilogue warps of the fused modes: they take each h tile the consumers hand over and run
// its epilogue (SwiGLU + quantize for w13, or SwiGLU to bf16 with bf16 activations; bf16 stores
// for the fused layer's w2), so that the
// divisions, shuffles and scattered stores overlap the weight stream instead of stalling the
// consumers, which are issue bound. In the fused layer they also publish expert readiness.
#pragma once
#include "epilogue.cuh"

namespace lab_gemm {

template <class C>
__device__ __forceinline__ void epilogue_warps(int N0, int N1, const float* gate_global, const float* up_global,
                                               float act_global, uint8_t* a_packed, uint8_t* a_scales, int* ready,
                                               unsigned short* out1_bf16, unsigned int* nonfinite, const Pipe& pipe,
                                               int warp, int lane) {
  const int ew = warp - C::WARPS - 1 - C::DECODER_WARPS;
  const float six_g = __fmul_rn(6.0f, act_global);
  const int I = N0 / 2;
  uint32_t bad = 0;
  for (int it = 0;; ++it) {
    mbar_wait_sleep(pipe.epi_full, it & 1);
    EpiTile t;
    t.tok0 = pipe.epi->tok0;
    t.ntok = pipe.epi->ntok;
    t.row0 = pipe.epi->row0;
    t.col0 = pipe.epi->col0;
    t.expert = pipe.epi->expert;
    if (t.expert < 0) break;
    if constexpr (C::MODE == Mode::layer) {
      t.problem = pipe.epi->problem;
      if (t.problem != 0) {
        bf16_tile<C>(t, pipe.htile, out1_bf16, N1, ew, lane, bad);
        mbar_arrive(pipe.epi_empty);
        continue;
      }
    }
    if constexpr (C::ACT == Act::nvfp4) {
      swiglu_tile<C>(t, pipe.htile, gate_global, up_global, act_global, six_g, I, a_packed, a_scales, ew, lane, bad);
    } else {  // W4A16: a_packed holds the bf16 a (rows, I)
      swiglu_bf16_tile<C>(t, pipe.htile, gate_global, up_global, I, reinterpret_cast<unsigned short*>(a_packed), ew,
                          lane, bad);
    }
    if constexpr (C::MODE == Mode::layer) {
      // Publish this warp's part of expert e's a_q: every lane's stores, then one release.
      __threadfence();
      __syncwarp();
      if (lane == 0) red_release_add(ready + t.expert, 1);
    }
    mbar_arrive(pipe.epi_empty);
  }
  if (bad) atomicAdd(nonfinite, bad);
}

}  // namespace lab_gemm

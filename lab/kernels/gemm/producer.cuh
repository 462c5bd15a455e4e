// The producer warp: claims units, publishes each in the unit ring, and per stage issues one TMA
// tensor copy of the stage's prepared weights (evict-first; the map in tensor_map.py makes a
// whole stage one box) and cp.async of the stage's raw activation rows (L2 resident), or with no
// decoder warps bulk copies of the stage's activation image (act_image.cuh), all completing on
// the stage's barriers, STAGES deep.
#pragma once
#include "act_image.cuh"
#include "scheduler.cuh"

namespace lab_gemm {

__device__ __forceinline__ constexpr int split_tb(const Unit&) { return 0; }
__device__ __forceinline__ int split_tb(const SplitUnit& u) { return u.tb; }

// BUILDERS (act_image.cuh, image_builders): a unit's stages copy their image from image0 / image1
// once image_ready[piece_of(unit, kc)] says the builders wrote it, for every kc of the unit, all
// acquired at its first stage.
template <class C, bool BUILDERS = false, class UnitOf, class PieceOf = int>
__device__ __forceinline__ void producer_warp(const void* wmap0, const void* wmap1, const uint8_t* xq0, const uint8_t* xq1,
                                              const uint8_t* xs0, const uint8_t* xs1, const int* offsets0,
                                              const int* offsets1, int K0, int K1, int num_experts0,
                                              int num_experts1, int* ready, const Pipe& pipe,
                                              const UnitOf& unit_of, int n_units, int NB0, int NB1, int* sched,
                                              int lane, const uint8_t* image0 = nullptr, const uint8_t* image1 = nullptr,
                                              const int* image_ready = nullptr, const PieceOf& piece_of = 0) {
  constexpr int K_STEP = C::K_STEP, STAGES = C::STAGES;
  const uint64_t pol = evict_first_policy();
  if (lane == 0) {  // the maps' bytes were written through the generic proxy (a copy from the host)
    asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;" ::"l"(wmap0) : "memory");
    asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;" ::"l"(wmap1) : "memory");
  }
  int it = 0, s = 0;  // stages posted; ring slot of the next one
  uint32_t phase = 0;
  for (int useq = 0;; ++useq) {
    int u = 0;
    if (lane == 0) u = atomicAdd(&sched[0], 1);
    u = __shfl_sync(0xffffffffu, u, 0);
    const bool done = u >= n_units;
    using U = decltype(unit_of(u));  // Unit, or SplitUnit on image tiles
    const U un = done ? U{} : unit_of(u);
    const int p = un.p, e = un.e, nb = un.nb;
    const int* offsets = LAB_P(offsets);
    const uint8_t* xq = LAB_P(xq);
    const uint8_t* xs = LAB_P(xs);
    const int K = LAB_P(K), NB = LAB_P(NB), kchunks = K / K_STEP;
    int row0 = offsets[e];
    int count = done ? 0 : offsets[e + 1] - row0;
    if constexpr (C::SPLIT) {  // one token block of the expert: its rows, one pass
      row0 += split_tb(un) * C::TOKEN_TILE;
      count = min(C::TOKEN_TILE, count - split_tb(un) * C::TOKEN_TILE);
    }
    // a finished CTA still posts one stage so that consumers and decoders read the -1
    const int passes = done ? 1 : (count + C::TOKEN_TILE - 1) / C::TOKEN_TILE;
    const int kcs = done ? 1 : kchunks;
    // Block-major layout: one stage's weights (BLOCK_ROWS x K_STEP) are one contiguous run, stage
    // (e * NB + nb) * kchunks + kc of the map, so each stage is a single copy and DRAM sees long
    // sequential bursts.
    const int stage0 = (e * NB + nb) * kchunks;
    for (int pass = 0; pass < passes; ++pass)
    for (int kc = 0; kc < kcs; ++kc, ++it) {
      const bool first = pass == 0 && kc == 0;
      if (it >= STAGES) mbar_wait(pipe.empty0 + 8 * s, phase ^ 1);
      if constexpr (C::IMAGE) {
        // The activation image (act_image.cuh): one bulk copy per k16 step of the pass's F
        // fragments, straight into the consumers' B operand; the stage's barrier counts both
        // copies' bytes (lane 0 posts them before any lane's copy can complete).
        const int frags = done ? 0 : (min(C::TOKEN_TILE, count - pass * C::TOKEN_TILE) + 7) >> 3;
        if (lane == 0) {
          if (first) pipe.unit_ring[useq % RING] = done ? make_int4(-1, 0, 0, 0) : make_int4((p << 16) | nb, e, row0, count);
          if (done) {
            mbar_arrive(pipe.full0 + 8 * s);
          } else {
            mbar_arrive_expect_tx(pipe.full0 + 8 * s, C::STAGE_W + C::KSTEPS * frags * 256);
            tensor_copy_stage(smem_addr(smem + C::OFF_W + s * C::STAGE_W), LAB_P(wmap), stage0 + kc,
                              pipe.full0 + 8 * s, pol);
          }
        }
        __syncwarp();
        if constexpr (BUILDERS) {
          // The unit's pieces of the image, every k chunk at once, at its first stage: one round
          // trip to L2 per unit rather than one before each stage's copies (with three stages in
          // the ring, a stage's copies have about two stages' time to land; the acquire ate into it).
          if (!done && kc == 0) {
            for (int c = lane; c < kcs; c += 32) {
              const int* piece = image_ready + piece_of(un, c);
              while (load_acquire(piece) == 0) __nanosleep(32);
            }
            __syncwarp();  // (orders the lanes' acquires before every lane's copies below)
            fence_proxy_async_global();  // the builders' generic writes, before these async-proxy reads
          }
        }
        if (!done && lane < C::KSTEPS) {
          const uint8_t* img = xq;  // (the launcher passes the pre-pass's image as the activations)
          if constexpr (BUILDERS) img = LAB_P(image);
          const int groups = image_groups(offsets, LAB_P(num_experts));
          const int grp = image_group0(offsets, e) + (row0 - offsets[e]) / 8 + pass * C::MAX_FRAGS;
          bulk_copy(smem_addr(smem + C::OFF_XF + s * C::XF + lane * C::MAX_FRAGS * 256),
                    img + ((size_t)(kc * C::KSTEPS + lane) * groups + grp) * 256, frags * 256, pipe.full0 + 8 * s);
        }
        if (++s == STAGES) {
          s = 0;
          phase ^= 1;
        }
        continue;
      }
      if (lane == 0) {
        if (first) pipe.unit_ring[useq % RING] = done ? make_int4(-1, 0, 0, 0) : make_int4((p << 16) | nb, e, row0, count);
        mbar_arrive(pipe.raw0 + 8 * s);  // release: the ring entry before any barrier of this stage
        if (done) {
          mbar_arrive(pipe.full0 + 8 * s);
        } else {
          mbar_arrive_expect_tx(pipe.full0 + 8 * s, C::STAGE_W);
          tensor_copy_stage(smem_addr(smem + C::OFF_W + s * C::STAGE_W), LAB_P(wmap), stage0 + kc,
                            pipe.full0 + 8 * s, pol);
        }
      }
      if constexpr (C::MODE == Mode::layer) {
        // The weights of this stage are already on their way; the activations are a_q, which
        // expert e's w13 units write. Every lane acquires, so its own copies see them.
        if (p == 1 && first && !done) {
          const int passes0 = (offsets0[e + 1] - offsets0[e] + C::TOKEN_TILE - 1) / C::TOKEN_TILE;
          const int target = NB0 * C::EPILOGUE_WARPS * passes0;
          while (load_acquire(ready + e) < target) __nanosleep(64);
        }
      }
      const int tok0 = pass * C::TOKEN_TILE;
      const int ntok = min(C::TOKEN_TILE, count - tok0);
      uint8_t* qdst = smem + C::OFF_XQ + s * C::STAGE_XQ;
      if constexpr (C::ACT == Act::bf16) {
        constexpr int XCHUNKS = K_STEP / 8;  // 16-byte pieces of one bf16 row in this chunk
        for (int i = lane; i < ntok * XCHUNKS; i += 32) {
          const int tr = i / XCHUNKS, q = i - tr * XCHUNKS;
          const uint8_t* src = xq + ((size_t)(row0 + tok0 + tr) * K + kc * K_STEP) * 2 + q * 16;
          cp_async<16>(smem_addr(qdst + tr * (K_STEP * 2) + q * 16), src);
        }
        cp_async_arrive_noinc(pipe.raw0 + 8 * s);
        if (++s == STAGES) {
          s = 0;
          phase ^= 1;
        }
        continue;
      }
      constexpr int QCHUNKS = K_STEP / 32;  // 16-byte pieces of one row's codes in this chunk
      uint8_t* sdst = smem + C::OFF_XS + s * C::STAGE_XS;
      for (int i = lane; i < ntok * QCHUNKS; i += 32) {
        const int tr = i / QCHUNKS, q = i - tr * QCHUNKS;
        const uint8_t* src = xq + (size_t)(row0 + tok0 + tr) * (K / 2) + kc * (K_STEP / 2) + q * 16;
        cp_async<16>(smem_addr(qdst + tr * (K_STEP / 2) + q * 16), src);
      }
      for (int tr = lane; tr < ntok; tr += 32) {
        const uint8_t* src = xs + (size_t)(row0 + tok0 + tr) * (K / 16) + kc * (K_STEP / 16);
        cp_async<K_STEP / 16>(smem_addr(sdst + tr * (K_STEP / 16)), src);
      }
      cp_async_arrive_noinc(pipe.raw0 + 8 * s);
      if (++s == STAGES) {
        s = 0;
        phase ^= 1;
      }
    }
    if (done) break;
  }
}

}  // namespace lab_gemm

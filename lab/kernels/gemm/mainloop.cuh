// The consumers' mainloop: one pipeline stage of prepared weights (a block of ROW_TILES x WARPS
// 16-row tiles by K_STEP) against F 8-token fragments of decoded activations, accumulated in
// fp32 registers, by mma.sync (stage_math) or wgmma (stage_wgmma); with the weights decoded into
// shared memory by warps of their own (decode_w_stage) and both operands read from there
// (stage_wgmma_ss); and the stage ring's walk.
#pragma once
#include "decode.cuh"
#include "wgmma.cuh"

namespace lab_gemm {

// One k atom of a consumer warp's ROW_TILES row tiles: its lane's 16 bytes of codes per tile (four
// k16 steps of A fragments) and its group's 8 bytes of scales. Tile r*WARPS + warp: the warps'
// r-th tiles are consecutive (a warpgroup's 64 rows for wgmma).
template <int WARPS, int ROW_TILES, int KATOMS>
__device__ __forceinline__ void load_atoms(uint4 (&code)[ROW_TILES], uint2 (&scl)[ROW_TILES], const uint8_t* wst,
                                           int ka, int warp, int lane) {
#pragma unroll
  for (int r = 0; r < ROW_TILES; ++r) {
    const uint8_t* atom = wst + ((r * WARPS + warp) * KATOMS + ka) * ATOM_BYTES;
    code[r] = *reinterpret_cast<const uint4*>(atom + lane * 16);
    scl[r] = *reinterpret_cast<const uint2*>(atom + ATOM_CODE_BYTES + (lane >> 2) * 8);
  }
}

// One pipeline stage of one consumer warp (mma.sync): ROW_TILES row tiles x K_STEP of prepared
// weights against F fragments of decoded activations (fp16, in shared memory), into acc.
template <int WARPS, int ROW_TILES, int K_STEP, int MAX_FRAGS, int F>
__device__ __forceinline__ void stage_math(float (&acc)[ROW_TILES][MAX_FRAGS][4], const uint8_t* wst,
                                           const uint8_t* xf, int warp, int lane) {
  constexpr int KATOMS = K_STEP / 64;
  constexpr int KSTEPS = K_STEP / 16;
#pragma unroll
  for (int ka = 0; ka < KATOMS; ++ka) {
    uint4 code[ROW_TILES];
    uint2 scl[ROW_TILES];
    load_atoms<WARPS, ROW_TILES, KATOMS>(code, scl, wst, ka, warp, lane);
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      const int j = ka * 4 + jj;
      uint2 b[F];
#pragma unroll
      for (int f = 0; f < F; ++f) b[f] = reinterpret_cast<const uint2*>(xf)[(f * KSTEPS + j) * 32 + lane];
#pragma unroll
      for (int r = 0; r < ROW_TILES; ++r) {
        uint32_t a[4];
        decode_tile(code[r], scl[r], jj, a);
#pragma unroll
        for (int f = 0; f < F; ++f) mma16816(acc[r][f], a[0], a[1], a[2], a[3], b[f].x, b[f].y);
      }
    }
  }
}

// One pipeline stage of one consumer warpgroup (wgmma): per group of GS k16 steps, decode the
// A fragments of every row tile, then one wgmma per (step, 64-row group), all in one commit
// group. wait_group 1 then retires the previous group, so a group runs while the next one
// decodes; `hold` keeps the previous group's A registers allocated until it retires (the
// hardware reads them asynchronously). The stage ends with every group retired: a group left
// running across the consumer loop's branches makes ptxas serialize every wgmma of the kernel.
// NS = 2 (image tiles): two consecutive ring stages (wst, xf, then wst2, xf2) in one call, so
// that the groups run on across the stage boundary and the drain at the end comes once per two
// stages.
template <int WARPS, int ROW_TILES, int K_STEP, int MAX_FRAGS, int GS, int F, int NS = 1>
__device__ __forceinline__ void stage_wgmma(float (&acc)[ROW_TILES][MAX_FRAGS][4], const uint8_t* wst,
                                            const uint8_t* xf, int warp, int lane, const uint8_t* wst2 = nullptr,
                                            const uint8_t* xf2 = nullptr) {
  constexpr int KATOMS = K_STEP / 64;
  constexpr int R = ROW_TILES;
  static_assert(4 % GS == 0, "a wgmma group takes 1, 2 or 4 k16 steps of one atom");
  static_assert(NS == 1 || NS == 2, "one or two stages per call");
  uint4 code[R];
  uint2 scl[R];
  auto load = [&](int ka) {
    if (NS == 2 && ka >= KATOMS) load_atoms<WARPS, R, KATOMS>(code, scl, wst2, ka - KATOMS, warp, lane);
    else load_atoms<WARPS, R, KATOMS>(code, scl, wst, ka, warp, lane);
  };
  auto keep = [](const uint32_t (&h)[R][GS][4]) {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int q = 0; q < GS; ++q)
        asm volatile("" ::"r"(h[r][q][0]), "r"(h[r][q][1]), "r"(h[r][q][2]), "r"(h[r][q][3]));
  };
  uint32_t hold[R][GS][4];
  load(0);
#pragma unroll
  for (int ka = 0; ka < NS * KATOMS; ++ka) {
    const uint32_t xf_addr = smem_addr(NS == 2 && ka >= KATOMS ? xf2 : xf);
    const int kk = NS == 2 && ka >= KATOMS ? ka - KATOMS : ka;  // atom within its stage
#pragma unroll
    for (int jg = 0; jg < 4 / GS; ++jg) {
      uint32_t a[R][GS][4];
#pragma unroll
      for (int q = 0; q < GS; ++q)
#pragma unroll
        for (int r = 0; r < R; ++r) decode_tile(code[r], scl[r], jg * GS + q, a[r][q]);
      if (jg == 4 / GS - 1 && ka + 1 < NS * KATOMS) load(ka + 1);  // in flight while the group issues
      wgmma_fence();
#pragma unroll
      for (int q = 0; q < GS; ++q) {
        const uint64_t desc = smem_desc(xf_addr + (kk * 4 + jg * GS + q) * MAX_FRAGS * 256, 128, 256);
#pragma unroll
        for (int r = 0; r < R; ++r)
          Wgmma<F, MAX_FRAGS>::run(acc[r], a[r][q][0], a[r][q][1], a[r][q][2], a[r][q][3], desc);
      }
      wgmma_commit();
      wgmma_wait<1>();
      if (ka + jg > 0) keep(hold);
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int q = 0; q < GS; ++q)
#pragma unroll
          for (int i = 0; i < 4; ++i) hold[r][q][i] = a[r][q][i];
    }
  }
  wgmma_wait<0>();
  keep(hold);
#pragma unroll
  for (int r = 0; r < R; ++r) fence_acc<MAX_FRAGS>(acc[r]);
}

// MMA = 2 (tokens as wgmma's A, decoded weights as its B, both from shared memory). The weight
// decoders' stage: every (16-row tile, k atom) of the stage's prepared weights to fp16 in wb, as
// B core matrices (8 weight rows x 8 k slots, 128 B) [k16 step][8-row group][k half][row][16 B]:
// LBO 128 (next k half), SBO 256 (next 8-row group), the activation image's layout with weight
// rows for tokens. A lane's four decoded registers are 4-byte pieces of four core matrices (rows
// g, g + 8; k slots 2t.. and 2t + 8..), so each store of a warp fills one 128-byte core matrix:
// no bank conflicts, and the prepared layout serves both tile families unchanged. Decoder warp
// dw (of DW) takes the stage's atoms dw, dw + DW, ...
template <int TILES, int KATOMS, int DW>
__device__ __forceinline__ void decode_w_stage(const uint8_t* wst, uint8_t* wb, int dw, int lane) {
  static_assert((TILES * KATOMS) % DW == 0, "every decoder warp takes as many atoms");
  uint8_t* dst = wb + (lane >> 2) * 16 + (lane & 3) * 4;
#pragma unroll
  for (int i = 0; i < TILES * KATOMS / DW; ++i) {
    const int atom = i * DW + dw;  // stage order [tile][k atom]
    const int tile = atom / KATOMS, ka = atom - tile * KATOMS;
    const uint8_t* src = wst + atom * ATOM_BYTES;
    const uint4 code = *reinterpret_cast<const uint4*>(src + lane * 16);
    const uint2 scl = *reinterpret_cast<const uint2*>(src + ATOM_CODE_BYTES + (lane >> 2) * 8);
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      uint32_t a[4];
      decode_tile(code, scl, jj, a);
      uint8_t* at = dst + (ka * 4 + jj) * (TILES * 16 * 32) + tile * 512;
      *reinterpret_cast<uint32_t*>(at) = a[0];        // rows g,     k slots 2t, 2t + 1
      *reinterpret_cast<uint32_t*>(at + 256) = a[1];  // rows g + 8
      *reinterpret_cast<uint32_t*>(at + 128) = a[2];  // rows g,     k slots 2t + 8, 2t + 9
      *reinterpret_cast<uint32_t*>(at + 384) = a[3];  // rows g + 8
    }
  }
}

// MMA = 2, one consumer warpgroup's stage: per k16 step one wgmma m64n128k16, A = the stage's 64
// image token rows (rows past the unit's tokens hold stale image data: they only reach D rows
// that are never stored), B = its warpgroup's 128 decoded weight rows. The descriptors are the
// stage's first plus compile-time offsets (the 14-bit address field cannot carry: shared
// addresses stay below 2^18), so no address arithmetic sits between the wgmmas.
template <int BLOCK_ROWS, int K_STEP, int MAX_FRAGS>
__device__ __forceinline__ void stage_wgmma_ss(float (&acc)[2][8][4], const uint8_t* xf, const uint8_t* wb, int wg) {
  static_assert(MAX_FRAGS == 8 && BLOCK_ROWS == 256, "64 tokens x 2 warpgroups of 128 weight rows");
  const uint64_t da = smem_desc(smem_addr(xf), 128, 256);
  const uint64_t db = smem_desc(smem_addr(wb) + wg * 128 * 32, 128, 256);
  wgmma_fence();
#pragma unroll
  for (int j = 0; j < K_STEP / 16; ++j)
    wgmma_ss_n128(acc, da + (uint64_t)((j * MAX_FRAGS * 256) >> 4), db + (uint64_t)((j * BLOCK_ROWS * 32) >> 4));
  wgmma_commit();
  wgmma_wait<0>();
  fence_acc<8>(acc[0]);
  fence_acc<8>(acc[1]);
}

// The activation decoders' store of one item (fragment f, k16 block j, token row item & 7) into
// the stage's B operand, k slots 0..7 (h0) and 8..15 (h1): mma.sync fragments [f][k16 step][lane =
// 4*row + t][b0 b1], i.e. item * 4; or wgmma core matrices (8 tokens x 8 k, 128 B) [k16 step][f]
// [k half][token row][16 B].
template <class C>
__device__ __forceinline__ void store_b_fragments(uint8_t* xf, int item, int f, int j, const uint32_t (&h0)[4],
                                                  const uint32_t (&h1)[4]) {
  if constexpr (C::MMA == 0) {
    uint2* dst = reinterpret_cast<uint2*>(xf) + item * 4;
#pragma unroll
    for (int q = 0; q < 4; ++q) dst[q] = make_uint2(h0[q], h1[q]);
  } else {
    uint4* dst = reinterpret_cast<uint4*>(xf + ((j * C::MAX_FRAGS + f) * 2) * 128 + (item & 7) * 16);
    dst[0] = make_uint4(h0[0], h0[1], h0[2], h0[3]);
    dst[8] = make_uint4(h1[0], h1[1], h1[2], h1[3]);
  }
}

// A fragment count as a type, for the consumer loop's dispatch to a generic lambda.
template <int F>
struct FragCount {
  static constexpr int value = F;
};

// CASE(F) for every fragment count a tile may have (1..20: 8-token fragments up to 160 tokens),
// for the consumer loop's switches on the run-time count.
#define LAB_FRAG_CASES(CASE)                                                                       \
  CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) CASE(9) CASE(10) CASE(11) CASE(12) \
  CASE(13) CASE(14) CASE(15) CASE(16) CASE(17) CASE(18) CASE(19) CASE(20)

// A decoder's or consumer's next stage: its k chunk and pass within the unit (by increments: no
// division on run-time values), the ring slot and that slot's parity.
template <int STAGES>
__device__ __forceinline__ void advance_stage(int& kc, int& pass, int& s, uint32_t& phase, int kchunks, int passes) {
  if (++kc == kchunks) {
    kc = 0;
    if (++pass == passes) pass = 0;
  }
  if (++s == STAGES) {
    s = 0;
    phase ^= 1;
  }
}

}  // namespace lab_gemm

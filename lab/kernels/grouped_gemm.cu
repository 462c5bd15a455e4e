// NVFP4 x NVFP4 block-scaled grouped GEMM for sm_90 (no FP4 tensor cores).
//
//   out[r, n] = alpha[e] * sum_k xdec[r, k] * wdec[e, n, k]      for offsets[e] <= r < offsets[e+1]
//
// xdec / wdec are e2m1 x e4m3 (the global scales live in alpha). e2m1 x e4m3 is exact in fp16,
// products of two fp16 are exact in fp32, so the tensor cores compute exactly the NVFP4 product
// and only the fp32 accumulation rounds.
//
// Operand swap: weight rows fill the M side of the MMA and tokens its 8-wide N side, so a
// handful of tokens wastes at most 7 columns of an 8-wide fragment instead of 120 rows of 128.
//
// A unit of work is one (problem, expert with tokens, block of BLOCK_ROWS = WARPS * ROW_TILES * 16
// weight rows); experts with more than TOKEN_TILE = 8 * MAX_FRAGS tokens take several passes over
// the unit's weights. The CTA's warps, by role:
//   consumers (WARPS, warps 0..)   their loop gemm/consumer_loop.inc; stage math gemm/mainloop.cuh
//                                  (mma.sync or wgmma), epilogues gemm/epilogue.cuh
//   producer (1)                   gemm/producer.cuh; the unit schedule gemm/scheduler.cuh
//   activation decoders            their loop gemm/decoder_loops.inc; the e2m1 / e4m3 decode
//                                  gemm/decode.cuh. None on the image path (large token tiles): a
//                                  pre-pass decodes the activations once per launch, gemm/act_image.cuh
//   weight decoders (MMA = 2)      gemm/decoder_loops.inc: each stage's weights once into shared memory
//                                  (gemm/mainloop.cuh decode_w_stage), tokens then being wgmma's A
//                                  operand from the image and the decoded weights its B
//   epilogue warps (fused modes)   gemm/epilogue_warps.cuh, on gemm/epilogue.cuh's tile functions
// PTX wrappers: gemm/ptx.cuh, gemm/wgmma.cuh. What the roles share (mode, barriers, the h tile's
// header, the unit ring): gemm/pipeline.cuh. The consumer and decoder loops are fragments of the
// kernel body, #included where they run: moved into functions of their own, they compile to the
// same PTX up to register order, and that alone makes ptxas schedule most of the kernels
// differently (notes/gemm-log.md v19; scripts/same_sass.py compares two trees' machine code).
//
// Persistent: the grid is sized to the resident CTAs; each CTA claims units from a device
// counter, and its pipeline runs on across unit boundaries. The producer publishes each claimed
// unit in a small shared ring; consumers and decoders read it at the unit's first stage, through
// that stage's barriers. Dynamic shared memory = Config::SMEM + 4 * (num_experts0 + num_experts1)
// (the compacted expert list), plus as much again on image tiles (their units' prefix sums).
//
// Two problems (w13 and w2, say) may share one launch: their units are claimed from one counter,
// problem 0's first. Mode::plain does not order them: a unit of problem 1 may read activations
// that problem 0 of the same launch has not written (the one-launch-2G ceiling).
// Mode::swiglu: problem 0 is w13 ending in SwiGLU + quantize (gemm/epilogue.cuh).
// Mode::layer: in addition problem 1 is w2 on its output and the launch is the whole layer. A w2
// unit of expert e lets its producer copy activations only once ready[e] counts every (w13
// block, pass, epilogue warp) of e: writers publish with a fence and a release add, the
// producer's lanes acquire. No deadlock: units are claimed in order, all of w13 before any of
// w2, so a CTA waiting on ready[e] waits only for w13 units already claimed by running CTAs;
// those units' stages were all issued before their CTA's producer reached any w2 unit, and their
// consumers and epilogue warps never wait on a w2 unit. Units not yet claimed belong to nobody.
// The last CTA to finish zeroes the unit counter and ready[], so launches and graph replays need
// no host work.
//
// Prepared weight layout (lab/kernels/gemm_weights.py, prepare_weights): atoms of 16 rows x 64 k,
// 576 bytes each, ordered [expert][row block][K_STEP chunk][16-row tile][k atom] (one stage is
// one contiguous run):
//   bytes [0, 512):   lane L = 4g + t holds 16 bytes: word j (k16 step j) = the 8 codes of its
//                     mma A fragment (rows g, g+8; k slots 2t, 2t+1, 2t+8, 2t+9, slot c being
//                     k = K_SLOTS[c] of the step, the order decode_x gives the activations),
//                     bit-encoded so that decode_a() turns them into four fp16x2 registers.
//   bytes [512, 576): group g's 8 bytes: e4m3 scales s(g, j), s(g+8, j) for j = 0..3.
// Decoded weights and activations are v * s * 2^-14 (exact in fp16, subnormals included); the
// epilogue multiplies the fp32 accumulator by 2^28 (exact) and then by alpha.
#include "gemm/epilogue.cuh"
#include "gemm/epilogue_warps.cuh"
#include "gemm/mainloop.cuh"
#include "gemm/producer.cuh"

namespace lab_gemm {

// One instantiation's sizes and shared-memory layout. MMA: 0 = mma.sync m16n8k16 per 8-token
// fragment; 1 = wgmma m64n(8F)k16 per warpgroup (tokens as N, B from shared memory in core
// matrices: LBO = next core matrix along K, SBO = along N; the exchanged descriptor was measured
// wrong on the H200). The warp counts per role are arguments, set by GemmConfig (gemm_config.py,
// where their rule lives); everything else derives from the arguments here.
template <int WARPS_, int ROW_TILES_, int K_STEP_, int STAGES_, int MAX_FRAGS_, int MMA_, int DECODER_WARPS_,
          int EPILOGUE_WARPS_, Mode MODE_, Act ACT_, bool BUILDERS_ = false>
struct Config {
  static constexpr int WARPS = WARPS_, ROW_TILES = ROW_TILES_, K_STEP = K_STEP_, STAGES = STAGES_;
  static constexpr int MAX_FRAGS = MAX_FRAGS_, MMA = MMA_;
  static constexpr int DECODER_WARPS = DECODER_WARPS_, EPILOGUE_WARPS = EPILOGUE_WARPS_;
  static constexpr Mode MODE = MODE_;
  static constexpr Act ACT = ACT_;
  // The accumulator holds the product times 2^-28 (both operands decoded as v * s * 2^-14) or
  // 2^-14 (bf16 activations as they are): the epilogue's multiply by its inverse is exact.
  static constexpr float ACC_SCALE = ACT == Act::nvfp4 ? 268435456.0f : 16384.0f;
  static constexpr int BLOCK_ROWS = WARPS * ROW_TILES * 16;
  static constexpr int KATOMS = K_STEP / 64;
  static constexpr int KSTEPS = K_STEP / 16;
  static constexpr int TOKEN_TILE = 8 * MAX_FRAGS;
  static constexpr int STAGE_W = WARPS * ROW_TILES * KATOMS * ATOM_BYTES;
  // The activation image (gemm/act_image.cuh) feeds the tiles with no activation decoders, and
  // MMA = 2, whose decoder warps decode the weights instead: each stage into a ring of DSTAGES
  // decoded stages (WB: BLOCK_ROWS x K_STEP fp16 as wgmma B core matrices, mainloop.cuh
  // decode_w_stage) with barriers of its own, so that the raw ring stays deep (the decoded form
  // is four times the raw bytes) while the decoded one is only as deep as the decode runs ahead
  static constexpr bool IMAGE = DECODER_WARPS == 0 || MMA == 2;
  static constexpr int DSTAGES = MMA == 2 ? 2 : 0;
  static constexpr int STAGE_WB = MMA == 2 ? BLOCK_ROWS * K_STEP * 2 : 0;
  // activations of one stage: NVFP4 codes and scales, or bf16 values (then no scales)
  // (none with no decoder warps: the producer copies the activation image into XF directly)
  static constexpr int STAGE_XQ = IMAGE               ? 0
                                  : ACT == Act::nvfp4 ? TOKEN_TILE * (K_STEP / 2)
                                                      : TOKEN_TILE * K_STEP * 2;
  static constexpr int STAGE_XS = ACT == Act::nvfp4 && !IMAGE ? TOKEN_TILE * (K_STEP / 16) : 0;
  static constexpr int XF = MAX_FRAGS * KSTEPS * 32 * 8;  // fp16 B fragments of one stage
  // Image tiles of 8 warps whose accumulators outgrow the 168 registers 9 warps leave each thread
  // (256 rows x 128 tokens): a producer warpgroup, one warp of it working, hands the consumers its
  // registers by setmaxnreg (384 threads enter with 168, then 8 x 224 + 4 x 56 warps' worth: the
  // producer's unit scan needs more than 40, ptxas spills there)
  // The same warpgroup on the 64- and 96-token image tiles when they build their image in the
  // launch (BUILDERS_: its three other warps are the builders, gemm/act_image.cuh); WIDE, the
  // accumulators' reason for it, keeps deciding what depends on the registers (GS, the register SwiGLU)
  static constexpr bool WIDE = DECODER_WARPS == 0 && WARPS == 8 && ROW_TILES * MAX_FRAGS > 24;
  static constexpr int PRODUCER_WARPS = WIDE || (BUILDERS_ && DECODER_WARPS == 0 && MMA == 1 && WARPS == 8) ? 4 : 1;
  static constexpr int CONSUMER_REGS = 224, PRODUCER_REGS = 56;
  // wgmma: k16 steps per commit group. A whole atom where registers allow (the group's and the
  // previous group's A fragments live at once: 8 * ROW_TILES * GS registers); ptxas serializes
  // every wgmma of a kernel short of them, and the CPU tests check that it does not
  // On the producer-warpgroup tiles two (their 224 registers hold two groups of two steps; four
  // spill at 160 tokens): at 37501c1, one process, 2 against 1 at 128 / 512 tokens per expert,
  // the 160-token tile's w13 1.5% / 4.9% faster, w2 1.9% / 6.6%; the 128-token one level.
  static constexpr int GS = WIDE ? 2 : ROW_TILES >= 4 || (DECODER_WARPS == 0 && MAX_FRAGS * ROW_TILES >= 24) ? 1 : MODE == Mode::layer ? 2 : 4;
  // Image tiles split units by token block (scheduler.cuh, split_units); their dynamic shared
  // memory holds a second list after the compacted experts (GemmConfig.launch_smem)
  static constexpr bool SPLIT = IMAGE;
  // Consumer stages per mainloop call: two on image tiles past 64 tokens with an even ring
  // (GemmConfig.validate asks K for an even number of K_STEP chunks there). bench_gemm at 2f96693,
  // one process: the 96-token tile 3% faster at 64-128 tokens per expert and 13% at 512 than
  // unpaired; the 64-token tile 3% slower at 32, so it stays unpaired.
  static constexpr int NS = SPLIT && STAGES % 2 == 0 && MAX_FRAGS > 8 ? 2 : 1;
  // full, empty, raw per stage; then epi_full, epi_empty; then dfull, dempty per decoded stage
  static constexpr int OFF_BAR = 0;
  static constexpr int OFF_DBAR = (3 * STAGES + 2) * 8;
  static constexpr int OFF_W = 128 * (((3 * STAGES + 2 + 2 * DSTAGES) * 8 + 127) / 128);  // tensor copies: 128-B aligned
  static constexpr int OFF_XQ = OFF_W + STAGES * STAGE_W;
  static constexpr int OFF_XS = OFF_XQ + STAGES * STAGE_XQ;
  static constexpr int OFF_XF = 16 * ((OFF_XS + STAGES * STAGE_XS + 15) / 16);
  // The fused modes: one pass's h tile, fp32 [token][BLOCK_ROWS + 4] (the pad spreads a
  // fragment's 4 token rows over distinct banks), handed from the consumers to the epilogue warps
  static constexpr int H_STRIDE = BLOCK_ROWS + 4;
  static constexpr int OFF_WB = STAGE_WB ? 128 * ((OFF_XF + STAGES * XF + 127) / 128) : OFF_XF + STAGES * XF;
  static constexpr int OFF_H = 16 * ((OFF_WB + DSTAGES * STAGE_WB + 15) / 16);
  static constexpr int SMEM = OFF_H + (EPILOGUE_WARPS ? TOKEN_TILE * H_STRIDE * 4 : 0);
  static constexpr int THREADS = (WARPS + PRODUCER_WARPS + DECODER_WARPS + EPILOGUE_WARPS) * 32;
};

// READ_ONLY = true runs the same grid, pipeline and copies but skips decode, MMA and stores:
// the achievable read rate of exactly this access pattern. COUNTS_IN = true takes only the experts
// of count_lo..count_hi tokens (a launch over one size class: grouped_gemm's counts_in); false
// ignores both arguments and compiles to the same code as a kernel without them. BF16_OUT = true
// (register-A image tiles, Mode::plain): problem 0's output as bf16 bits in out_bf16, its own
// instantiation, so that neither output form carries the other's epilogue (each is unrolled over
// every fragment count: ~1700 and ~3000 instructions, cold in the instruction cache once a unit).
template <int WARPS, int ROW_TILES, int K_STEP, int STAGES, int MAX_FRAGS, int MMA, int DECODER_WARPS,
          int EPILOGUE_WARPS, Mode MODE, Act ACT, bool READ_ONLY, bool COUNTS_IN, bool BF16_OUT = false,
          bool BUILDERS = false>
__global__ void __launch_bounds__(
    Config<WARPS, ROW_TILES, K_STEP, STAGES, MAX_FRAGS, MMA, DECODER_WARPS, EPILOGUE_WARPS, MODE, ACT, BUILDERS>::THREADS, 1)
grouped_gemm_nvfp4(  // problem 0; problem 1 (num_experts1 = 0 for a single problem) the same
    const void* __restrict__ wmap0, const uint8_t* __restrict__ xq0, const uint8_t* __restrict__ xs0,
    const int* __restrict__ offsets0, const float* __restrict__ alpha0, float* __restrict__ out0,
    int N0, int K0, int num_experts0,
    const void* __restrict__ wmap1, const uint8_t* __restrict__ xq1, const uint8_t* __restrict__ xs1,
    const int* __restrict__ offsets1, const float* __restrict__ alpha1, float* __restrict__ out1,
    int N1, int K1, int num_experts1,
    int* __restrict__ sched,  // [next unit, CTAs done]: zero before the launch, zero after
    // Mode::swiglu and ::layer (problem 0 = w13 paired gate/up, N0 = 2I): SwiGLU with these
    // per-expert globals, quantized with act_global into a_packed (T, I/2) / a_scales (T, I/16);
    // out0 is not written.
    const float* __restrict__ gate_global, const float* __restrict__ up_global, float act_global,
    uint8_t* __restrict__ a_packed, uint8_t* __restrict__ a_scales,
    // Mode::layer (problem 1 = w2 of the same experts): a unit of expert e starts reading its
    // activations once ready[e] counts every (w13 block, pass, warp) of e; problem 1's output
    // goes to out_bf16 as bf16 bits, written by the epilogue warps (out1 is not written).
    // Mode::plain on an image tile, one problem: BF16_OUT (or, on the MMA = 2 tile, out_bf16
    // non-null) takes problem 0's output as bf16 bits in out_bf16 instead of out0 (the consumers
    // round as the separate conversion does, and count the outputs that are not finite in
    // *nonfinite).
    int* __restrict__ ready, unsigned short* __restrict__ out_bf16,
    unsigned int* __restrict__ nonfinite,  // SwiGLU values or bf16 outputs that are not finite
    // COUNTS_IN: the experts this launch computes are those of count_lo..count_hi tokens
    // (count_lo >= 1; both problems). The rest keep their output as it was.
    int count_lo, int count_hi,
    // BUILDERS: xq / xs are the raw activations (NVFP4 codes and scales, or bf16 rows); the
    // producer warpgroup's idle warps write their image into image0 / image1 piece by piece,
    // publishing each in image_ready (zero before the launch, zero after; sched[2] hands out the
    // pieces), and the producer copies from there (gemm/act_image.cuh, image_builders).
    uint8_t* __restrict__ image0, uint8_t* __restrict__ image1, int* __restrict__ image_ready) {
  using C = Config<WARPS, ROW_TILES, K_STEP, STAGES, MAX_FRAGS, MMA, DECODER_WARPS, EPILOGUE_WARPS, MODE, ACT, BUILDERS>;
  // The SwiGLU epilogue in the consumers' registers (gemm/epilogue.cuh, swiglu_regs) on the
  // producer-warpgroup tiles; every other fused tile hands its h tile to epilogue warps.
  constexpr bool SWIGLU_REGS = MODE == Mode::swiglu && C::WIDE && ACT == Act::nvfp4;
  static_assert(DECODER_WARPS >= 1 || (MMA == 1 && (MODE == Mode::plain || SWIGLU_REGS)),
                "no decoder warps (the activation image): wgmma, and the plain or register SwiGLU epilogue");
  static_assert(MMA != 2 || (MODE == Mode::plain && DECODER_WARPS >= 1 && WARPS == 8 && ROW_TILES == 2 && MAX_FRAGS == 8),
                "MMA = 2: weight decoder warps, the plain epilogue, 64 tokens x 2 warpgroups of 128 rows");
  static_assert((MODE == Mode::plain || SWIGLU_REGS) == (EPILOGUE_WARPS == 0),
                "epilogue warps exactly in the fused modes, but the register SwiGLU epilogue");
  static_assert(C::MODE == Mode::plain || C::BLOCK_ROWS % 32 == 0,
                "the SwiGLU tile splits BLOCK_ROWS/2 columns into 16-element blocks");
  static_assert(MMA == 0 || WARPS % 4 == 0, "wgmma needs whole warpgroups of consumers");
  static_assert(MMA == 0 || MMA == 1 || MMA == 2,
                "MMA: 0 = mma.sync, 1 = wgmma (weights from registers), 2 = wgmma (both from shared memory)");
  static_assert(MAX_FRAGS <= 8 || (MMA == 1 && (MODE == Mode::plain || SWIGLU_REGS)),
                "token tiles past 64 (up to 160): wgmma, plain epilogue only");
  static_assert(MAX_FRAGS <= 20, "wgmma N at most 160 (gemm/wgmma.cuh)");
  static_assert(!(READ_ONLY && C::MODE != Mode::plain), "the read-only pattern has no epilogue to fuse");
  static_assert(!BF16_OUT || (C::SPLIT && MMA == 1 && MODE == Mode::plain && !READ_ONLY),
                "BF16_OUT: the plain epilogue of a register-A image tile");
  static_assert(STAGES < RING, "unit ring too small");
  static_assert(!BUILDERS || (C::SPLIT && MMA == 1 && C::PRODUCER_WARPS == 4),
                "BUILDERS: a register-A image tile with a producer warpgroup (its three idle warps build)");
  const int NB0 = N0 / C::BLOCK_ROWS, NB1 = N1 / C::BLOCK_ROWS;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;

  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + C::OFF_BAR);
  __shared__ EpiTile epi_tile;
  int* active = reinterpret_cast<int*>(smem + C::SMEM);  // experts with tokens, in order
  __shared__ int warp_count[C::THREADS / 32];
  __shared__ int n_active_s;
  // Units in the order this CTA's producer claimed them (row blocks < 2^15: GemmConfig.validate).
  // Consumers and decoders read entry i when they reach unit i's first stage, published by that
  // stage's barriers; the producer runs at most STAGES stages (so at most STAGES units) ahead. The
  // producer loads the expert's offsets anyway, so the other warps start a unit without an L2
  // round trip of their own.
  __shared__ int4 unit_ring[RING];
  const Pipe pipe{smem_addr(bars),
                  smem_addr(bars + STAGES),
                  smem_addr(bars + 2 * STAGES),
                  smem_addr(bars + 3 * STAGES),      // consumers -> epilogue warps: h tile ready
                  smem_addr(bars + 3 * STAGES + 1),  // epilogue warps -> consumers: tile free
                  reinterpret_cast<float*>(smem + C::OFF_H),
                  &epi_tile,
                  unit_ring};

  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      // producer's expect_tx arrive + the activation decoders
      mbar_init(pipe.full0 + 8 * s, 1 + (MMA == 2 ? 0 : 32 * C::DECODER_WARPS));
      mbar_init(pipe.empty0 + 8 * s, (WARPS + (MMA == 2 ? DECODER_WARPS : 0)) * 32);  // every consumer (and weight decoder) thread
      mbar_init(pipe.raw0 + 8 * s, 33);        // the producer's cp.async arrivals + lane 0 (unit ring)
    }
    for (int d = 0; d < C::DSTAGES; ++d) {  // MMA = 2: decoded stage d ready; consumed
      mbar_init(smem_addr(smem + C::OFF_DBAR) + 8 * d, DECODER_WARPS * 32);
      mbar_init(smem_addr(smem + C::OFF_DBAR) + 8 * (C::DSTAGES + d), WARPS * 32);
    }
    mbar_init(pipe.epi_full, WARPS * 32);
    mbar_init(pipe.epi_empty, C::EPILOGUE_WARPS * 32 + (C::EPILOGUE_WARPS == 0));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    n_active_s = 0;
  }
  __shared__ int n_active0_s;
  compact_experts<C::THREADS, COUNTS_IN>(offsets0, offsets1, num_experts0, num_experts1, count_lo, count_hi, active, warp_count,
                              n_active_s, n_active0_s, warp, lane);
  const int n_active0 = n_active0_s;
  const int n_units0 = n_active0 * NB0;
  const int n_units = n_units0 + (n_active_s - n_active0) * NB1;
  auto unit_of = [&](int u) {
    Unit r;
    r.p = u >= n_units0;
    const int uu = u - (r.p ? n_units0 : 0);
    const int nbs = r.p ? NB1 : NB0;
    r.e = active[(r.p ? n_active0 : 0) + uu / nbs];
    r.nb = uu - (uu / nbs) * nbs;
    return r;
  };

  if (C::PRODUCER_WARPS > 1 ? warp >= WARPS : warp == WARPS) {
    if constexpr (C::PRODUCER_WARPS > 1) {  // the producer warpgroup (image tiles: no other roles)
      setmaxnreg_dec<C::PRODUCER_REGS>();
      if (warp > WARPS) {
        if constexpr (BUILDERS) {  // the activation image, once the producer's unit scan is in shared memory
          named_bar_sync<1, 128>();
          image_builders<C>(xq0, xq1, xs0, xs1, offsets0, offsets1, K0, K1, num_experts0, num_experts1, NB0, NB1,
                            image0, image1, image_ready, sched, active, active + num_experts0 + num_experts1,
                            n_active_s, n_active0, lane);
        }
        goto finish;
      }
    }
    if constexpr (C::SPLIT) {  // units by token block (scheduler.cuh), planned by this warp alone
      int* unit_end = active + num_experts0 + num_experts1;
      const int n_active = n_active_s;
      const int n_split = split_units<C::TOKEN_TILE>(active, n_active, n_active0, offsets0, offsets1, NB0, NB1,
                                                     unit_end, lane);
      auto split_of = [&](int u) { return split_unit_of(u, active, unit_end, n_active, n_active0, NB0, NB1); };
      if constexpr (BUILDERS) {
        named_bar_arrive<1, 128>();  // (split_units ends with __syncwarp: unit_end is written)
        int n_pieces0;
        image_pieces<K_STEP>(unit_end, n_active, n_active0, K0, K1, NB0, NB1, n_pieces0);
        auto piece_of = [&](const SplitUnit& un, int kc) {
          const int p = un.p;
          return image_piece0<K_STEP>(unit_end, un.i, p, n_active0, n_pieces0, LAB_P(NB), LAB_P(K)) + kc * un.blocks +
                 un.tb;
        };
        producer_warp<C, true>(wmap0, wmap1, xq0, xq1, xs0, xs1, offsets0, offsets1, K0, K1, num_experts0,
                               num_experts1, ready, pipe, split_of, n_split, NB0, NB1, sched, lane, image0, image1,
                               image_ready, piece_of);
      } else {
        producer_warp<C>(wmap0, wmap1, xq0, xq1, xs0, xs1, offsets0, offsets1, K0, K1, num_experts0, num_experts1,
                         ready, pipe, split_of, n_split, NB0, NB1, sched, lane);
      }
    } else {
      producer_warp<C>(wmap0, wmap1, xq0, xq1, xs0, xs1, offsets0, offsets1, K0, K1, num_experts0, num_experts1, ready,
                       pipe, unit_of, n_units,
                       NB0, NB1, sched, lane);
    }
    goto finish;
  }
  if (C::EPILOGUE_WARPS != 0 && warp > WARPS + C::DECODER_WARPS) {
    if constexpr (C::EPILOGUE_WARPS != 0)
      epilogue_warps<C>(N0, N1, gate_global, up_global, act_global, a_packed, a_scales, ready, out_bf16, nonfinite,
                        pipe, warp, lane);
    goto finish;
  }
#include "gemm/decoder_loops.inc"

#include "gemm/consumer_loop.inc"

finish:  // The last CTA to finish leaves the unit counter (and the readiness counters) at zero for the
  // next launch or graph replay: every thread of every CTA is past its last use of them.
  __syncthreads();
  if constexpr (BUILDERS) {  // the same, and the image's piece counter and flags (by the whole CTA)
    __shared__ int last_cta;
    if (threadIdx.x == 0) {
      __threadfence();
      last_cta = atomicAdd(&sched[1], 1) == (int)gridDim.x - 1;
    }
    __syncthreads();
    if (last_cta) {
      int n_pieces0;
      const int n_pieces = image_pieces<K_STEP>(active + num_experts0 + num_experts1, n_active_s, n_active0, K0, K1,
                                                NB0, NB1, n_pieces0);
      for (int i = threadIdx.x; i < n_pieces; i += C::THREADS) image_ready[i] = 0;
      if (threadIdx.x == 0) {
        atomicExch(&sched[0], 0);
        atomicExch(&sched[1], 0);
        atomicExch(&sched[2], 0);
      }
    }
    return;
  }
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(&sched[1], 1) == (int)gridDim.x - 1) {
      atomicExch(&sched[0], 0);
      atomicExch(&sched[1], 0);
      if constexpr (C::MODE == Mode::layer) {
        for (int e = 0; e < num_experts0; ++e) ready[e] = 0;
        __threadfence();
      }
    }
  }
}

}  // namespace lab_gemm

// What the grouped GEMM's warp roles share: the launch's mode, the CTA's pipeline state in
// shared memory and the h tile's header.
#pragma once
#include "ptx.cuh"

namespace lab_gemm {

// What a launch computes: grouped GEMMs of one or two problems (fp32 out), w13 ending in SwiGLU +
// NVFP4 quantize, or the whole layer (w13 with that epilogue, then w2 to bf16, in one launch).
enum class Mode : int { plain = 0, swiglu = 1, layer = 2 };

// What the activations (the GEMMs' token operand) are: NVFP4 codes and e4m3 block scales,
// decoded to fp16 as v * s * 2^-14 (W4A4); or bf16, converted to fp16 as they are (W4A16).
enum class Act : int { nvfp4 = 0, bf16 = 1 };

// Problem p of a launch reads its own kernel arguments (name0 or name1), each role taking the
// ones it needs as plain parameters: a select of the two, never a copy into an indexed struct.
#define LAB_P(name) (p ? name##1 : name##0)

// The pass a consumer hands to the epilogue warps through the h tile: token 0 of the pass, its
// tokens, the expert's first row, the first output column (along I for w13, along the output
// for w2), the expert (-1: stop) and the problem (0: w13, 1: w2).
struct EpiTile {
  int tok0, ntok, row0, col0, expert, problem;
};

// The CTA's pipeline: per stage `full` (weights landed and activations decoded), `empty`
// (consumers done), `raw` (activations copied); the h tile's `epi_full` / `epi_empty`; the
// unit ring (RING entries {p << 16 | row block, expert, first row, tokens}, x = -1: no more).
struct Pipe {
  uint32_t full0, empty0, raw0, epi_full, epi_empty;
  float* htile;
  EpiTile* epi;
  int4* unit_ring;
};
constexpr int RING = 16;

// The CTA's dynamic shared memory, laid out by Config (grouped_gemm.cu): barriers, the stages'
// weights, raw and decoded activations, the h tile, then the compacted expert list. Named here
// so that every role addresses it as the kernel does.
extern __shared__ __align__(128) uint8_t smem[];

}  // namespace lab_gemm

// wgmma wrappers (sm_90a): fence, commit and wait of the asynchronous warpgroup MMA, the
// shared-memory matrix descriptor, and wgmma m64n(8F)k16 for every fragment count F.
#pragma once
#include "ptx.cuh"

namespace lab_gemm {

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
// Retire all but the newest N commit groups.
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }
template <int FMAX>
__device__ __forceinline__ void fence_acc(float (&c)[FMAX][4]) {
#pragma unroll
  for (int f = 0; f < FMAX; ++f)
    asm volatile("" : "+f"(c[f][0]), "+f"(c[f][1]), "+f"(c[f][2]), "+f"(c[f][3])::"memory");
}
// Shared-memory matrix descriptor, no swizzle: start, LBO (next core matrix along K), SBO (next
// core matrix along N), all in 16-byte units.
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return (uint64_t)((addr >> 4) & 0x3FFFu) | ((uint64_t)((lbo >> 4) & 0x3FFFu) << 16) |
         ((uint64_t)((sbo >> 4) & 0x3FFFu) << 32);
}

// wgmma m64n(8F)k16, f32 += f16 x f16, A from registers (this warp's 16 rows, the mma.m16n8k16
// A fragment), B (K-major, no swizzle) by descriptor. Accumulates (scale-d = 1). Generated for
// F = 1..8 so that the token count picks the instruction's N at run time.
template <int F, int FMAX> struct Wgmma;
template <int FMAX> struct Wgmma<1, FMAX> {
  static __device__ __forceinline__ void run(float (&c)[FMAX][4], uint32_t a0, uint32_t a1, uint32_t a2,
                                             uint32_t a3, uint64_t desc) {
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, 1, 0;\n wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1, 0;\n}\n"
                 : "+f"(c[0][0]), "+f"(c[0][1]), "+f"(c[0][2]), "+f"(c[0][3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));
  }
};
template <int FMAX> struct Wgmma<2, FMAX> {
  static __device__ __forceinline__ void run(float (&c)[FMAX][4], uint32_t a0, uint32_t a1, uint32_t a2,
                                             uint32_t a3, uint64_t desc) {
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, 1, 0;\n wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"
                 : "+f"(c[0][0]), "+f"(c[0][1]), "+f"(c[0][2]), "+f"(c[0][3]), "+f"(c[1][0]), "+f"(c[1][1]), "+f"(c[1][2]), "+f"(c[1][3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));
  }
};
template <int FMAX> struct Wgmma<3, FMAX> {
  static __device__ __forceinline__ void run(float (&c)[FMAX][4], uint32_t a0, uint32_t a1, uint32_t a2,
                                             uint32_t a3, uint64_t desc) {
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, 1, 0;\n wgmma.mma_async.sync.aligned.m64n24k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11}, {%12, %13, %14, %15}, %16, p, 1, 1, 0;\n}\n"
                 : "+f"(c[0][0]), "+f"(c[0][1]), "+f"(c[0][2]), "+f"(c[0][3]), "+f"(c[1][0]), "+f"(c[1][1]), "+f"(c[1][2]), "+f"(c[1][3]), "+f"(c[2][0]), "+f"(c[2][1]), "+f"(c[2][2]), "+f"(c[2][3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));
  }
};
template <int FMAX> struct Wgmma<4, FMAX> {
  static __device__ __forceinline__ void run(float (&c)[FMAX][4], uint32_t a0, uint32_t a1, uint32_t a2,
                                             uint32_t a3, uint64_t desc) {
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, 1, 0;\n wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
                 : "+f"(c[0][0]), "+f"(c[0][1]), "+f"(c[0][2]), "+f"(c[0][3]), "+f"(c[1][0]), "+f"(c[1][1]), "+f"(c[1][2]), "+f"(c[1][3]), "+f"(c[2][0]), "+f"(c[2][1]), "+f"(c[2][2]), "+f"(c[2][3]), "+f"(c[3][0]), "+f"(c[3][1]), "+f"(c[3][2]), "+f"(c[3][3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));
  }
};
template <int FMAX> struct Wgmma<5, FMAX> {
  static __device__ __forceinline__ void run(float (&c)[FMAX][4], uint32_t a0, uint32_t a1, uint32_t a2,
                                             uint32_t a3, uint64_t desc) {
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, 1, 0;\n wgmma.mma_async.sync.aligned.m64n40k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19}, {%20, %21, %22, %23}, %24, p, 1, 1, 0;\n}\n"
                 : "+f"(c[0][0]), "+f"(c[0][1]), "+f"(c[0][2]), "+f"(c[0][3]), "+f"(c[1][0]), "+f"(c[1][1]), "+f"(c[1][2]), "+f"(c[1][3]), "+f"(c[2][0]), "+f"(c[2][1]), "+f"(c[2][2]), "+f"(c[2][3]), "+f"(c[3][0]), "+f"(c[3][1]), "+f"(c[3][2]), "+f"(c[3][3]), "+f"(c[4][0]), "+f"(c[4][1]), "+f"(c[4][2]), "+f"(c[4][3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));
  }
};
template <int FMAX> struct Wgmma<6, FMAX> {
  static __device__ __forceinline__ void run(float (&c)[FMAX][4], uint32_t a0, uint32_t a1, uint32_t a2,
                                             uint32_t a3, uint64_t desc) {
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, 1, 0;\n wgmma.mma_async.sync.aligned.m64n48k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23}, {%24, %25, %26, %27}, %28, p, 1, 1, 0;\n}\n"
                 : "+f"(c[0][0]), "+f"(c[0][1]), "+f"(c[0][2]), "+f"(c[0][3]), "+f"(c[1][0]), "+f"(c[1][1]), "+f"(c[1][2]), "+f"(c[1][3]), "+f"(c[2][0]), "+f"(c[2][1]), "+f"(c[2][2]), "+f"(c[2][3]), "+f"(c[3][0]), "+f"(c[3][1]), "+f"(c[3][2]), "+f"(c[3][3]), "+f"(c[4][0]), "+f"(c[4][1]), "+f"(c[4][2]), "+f"(c[4][3]), "+f"(c[5][0]), "+f"(c[5][1]), "+f"(c[5][2]), "+f"(c[5][3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));
  }
};
template <int FMAX> struct Wgmma<7, FMAX> {
  static __device__ __forceinline__ void run(float (&c)[FMAX][4], uint32_t a0, uint32_t a1, uint32_t a2,
                                             uint32_t a3, uint64_t desc) {
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, 1, 0;\n wgmma.mma_async.sync.aligned.m64n56k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27}, {%28, %29, %30, %31}, %32, p, 1, 1, 0;\n}\n"
                 : "+f"(c[0][0]), "+f"(c[0][1]), "+f"(c[0][2]), "+f"(c[0][3]), "+f"(c[1][0]), "+f"(c[1][1]), "+f"(c[1][2]), "+f"(c[1][3]), "+f"(c[2][0]), "+f"(c[2][1]), "+f"(c[2][2]), "+f"(c[2][3]), "+f"(c[3][0]), "+f"(c[3][1]), "+f"(c[3][2]), "+f"(c[3][3]), "+f"(c[4][0]), "+f"(c[4][1]), "+f"(c[4][2]), "+f"(c[4][3]), "+f"(c[5][0]), "+f"(c[5][1]), "+f"(c[5][2]), "+f"(c[5][3]), "+f"(c[6][0]), "+f"(c[6][1]), "+f"(c[6][2]), "+f"(c[6][3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));
  }
};
template <int FMAX> struct Wgmma<8, FMAX> {
  static __device__ __forceinline__ void run(float (&c)[FMAX][4], uint32_t a0, uint32_t a1, uint32_t a2,
                                             uint32_t a3, uint64_t desc) {
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, 1, 0;\n wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
                 : "+f"(c[0][0]), "+f"(c[0][1]), "+f"(c[0][2]), "+f"(c[0][3]), "+f"(c[1][0]), "+f"(c[1][1]), "+f"(c[1][2]), "+f"(c[1][3]), "+f"(c[2][0]), "+f"(c[2][1]), "+f"(c[2][2]), "+f"(c[2][3]), "+f"(c[3][0]), "+f"(c[3][1]), "+f"(c[3][2]), "+f"(c[3][3]), "+f"(c[4][0]), "+f"(c[4][1]), "+f"(c[4][2]), "+f"(c[4][3]), "+f"(c[5][0]), "+f"(c[5][1]), "+f"(c[5][2]), "+f"(c[5][3]), "+f"(c[6][0]), "+f"(c[6][1]), "+f"(c[6][2]), "+f"(c[6][3]), "+f"(c[7][0]), "+f"(c[7][1]), "+f"(c[7][2]), "+f"(c[7][3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));
  }
};
}  // namespace lab_gemm

"""Probe: which warp slot (%warpid, so which of four schedulers) each warp gets when two CTAs share an SM."""
# For the plain (6-warp) and fused (8-warp) CTA sizes: the kernel's argument for where its decoder
# warps sit rests on this mapping (notes/layer-log.md v15).
import argparse
import collections
import sys

from lab.gpu import require_gpu, run_script

SRC = r"""
extern "C" __global__ void slots(int* out) {
  extern __shared__ char pad[];
  unsigned sm, wid;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  asm volatile("mov.u32 %0, %%warpid;" : "=r"(wid));
  long long t0 = clock64();
  while (clock64() - t0 < 2000000) {}  // keep both CTAs of an SM resident together
  if ((threadIdx.x & 31) == 0) {
    int* o = out + 3 * (blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32);
    o[0] = sm; o[1] = wid; o[2] = pad[0] * 0;
  }
}
"""


def main(argv=None):
    argparse.ArgumentParser(description=__doc__).parse_args(argv)
    cp = require_gpu("warp_slot_probe")  # before any output: without a GPU, one line
    k = cp.RawKernel(SRC, "slots")
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    smem = 100 * 1024  # two CTAs per SM at most
    k.max_dynamic_shared_size_bytes = smem
    for warps in (6, 7, 8):
        out = cp.full((2 * sms * warps, 3), -1, cp.int32)
        k((2 * sms,), (32 * warps,), (out,), shared_mem=smem)
        h = out.get().reshape(2 * sms, warps, 3)
        per_sm = collections.defaultdict(list)
        for b in range(2 * sms):
            per_sm[h[b, 0, 0]].append(tuple(int(x) for x in h[b, :, 1]))
        patterns = collections.Counter(tuple(sorted(v)) for v in per_sm.values())
        print(f"{warps} warps per CTA: {len(per_sm)} SMs; (CTA's warp slots) per SM, most common:")
        for pat, n in patterns.most_common(4):
            print(f"  x{n}: " + " | ".join(",".join(map(str, p)) for p in pat)
                  + "   schedulers: " + " | ".join("".join(str(s % 4) for s in p) for p in pat))


if __name__ == "__main__":
    sys.exit(run_script(main, "warp_slot_probe"))

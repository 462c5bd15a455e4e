"""Probe: what one tensor-core instruction costs on this GPU, alone and beside integer or FP work."""
# Away from any GEMM: each CTA's warpgroups issue back-to-back wgmma m64nNk16 (f32 += f16 x f16, A
# from registers "RS" or shared memory "SS", B from shared memory) on `chains` independent
# accumulators, one commit group per round of chains, wait_group 1 after each; or mma.sync
# m16n8k16 on `chains` accumulators per warp. It prints SM cycles per instruction per SM (clock64
# around the loop, averaged over CTAs), which tells whether small-N wgmma is bound by the tensor
# work (N-proportional) or by a per-instruction cost. With --split, read the cycles "by events"
# (the launch timed by CUDA events, ~10 cycles per round of launch cost included): thread 0's
# clock64 after the closing __syncthreads (BAR.SYNC.DEFER_BLOCKING) does not always wait for the
# other warpgroup, and reads short.
import argparse
import sys

import numpy as np

from lab.cli import output_path
from lab.gemm_bench import write_json
from lab.gpu import require_gpu, run_script

ITERS = 2048


def wgmma_asm(n: int, rs: bool) -> str:
    regs = n // 2
    d = ", ".join(f"%{i}" for i in range(regs))
    if rs:
        a = ", ".join(f"%{regs + i}" for i in range(4))
        b = f"%{regs + 4}"
        op = f"{{{d}}}, {{{a}}}, {b}, p, 1, 1, 0;"
    else:
        op = f"{{{d}}}, %{regs}, %{regs + 1}, p, 1, 1, 0, 0;"
    return ("{\\n .reg .pred p;\\n setp.ne.b32 p, 1, 0;\\n"
            f" wgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16 {op}\\n}}")


ALU_OPS = {
    "ffma": "w[x] = w[x] * 1.0001f + 0.5f;",
    "lop3": 'asm("lop3.b32 %0, %0, %1, 0x8E008E00, 0x6c;" : "+r"(wi[x]) : "r"(wi[(x + 1) & 7]));',
    "hmul2": 'asm("mul.rn.f16x2 %0, %0, %1;" : "+r"(wi[x]) : "r"(wi[(x + 3) & 7]));',
    # volatile: ptxas keeps every instruction (the plain lop3 loop was shortened by the compiler)
    "lop3v": 'asm volatile("lop3.b32 %0, %0, %1, 0x8E008E00, 0x6c;" : "+r"(wi[x]) : "r"(wi[(x + 1) & 7]));',
    "shfv": 'asm volatile("shf.r.wrap.b32 %0, %0, %1, 3;" : "+r"(wi[x]) : "r"(wi[(x + 1) & 7]));',
    "imadv": 'asm volatile("mad.lo.u32 %0, %0, 0x9E3779B9, %1;" : "+r"(wi[x]) : "r"(wi[(x + 1) & 7]));',
    # 16 bytes per thread into the shared memory the SS wgmma reads (x picks a 2 KB slice of its
    # 32 KB): the traffic of warps that would write decoded A tiles beside the tensor work. The
    # values the wgmma then reads change; the probe times, it does not check them
    "stsv": 'asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};" :: "r"(base + ((threadIdx.x * 16u + x * 2048u) '
            '& 32767u)), "r"(wi[x]) : "memory");',
}


def source(n: int, chains: int, rs: bool, kind: str, steps: int = 1, alu: int = 0, alt: bool = False,
           alu_op: str = "ffma", split: bool = False, mma_off: bool = False) -> str:
    """split: the ALU work runs on a second warpgroup of its own, the first issues the MMAs
    (none with mma_off: the ALU work alone)."""
    mma_alu = 0 if split else alu
    regs = n // 2
    sets = 2 if alt else 1
    if kind == "wgmma":
        outs = ", ".join(f'"+f"(acc[c + CH * (it & {sets - 1})][{i}])' for i in range(regs))
        ins = '"r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(db)' if rs else '"l"(da), "l"(db)'
        body = f'''
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int s = 0; s < {steps}; ++s)
#pragma unroll
    for (int c = 0; c < CH; ++c)
      asm volatile("{wgmma_asm(n, rs)}" : {outs} : {ins});
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    // ptxas spreads these ALU instructions among the group's wgmmas, as it would a decode
#pragma unroll
    for (int i = 0; i < {mma_alu}; ++i)
#pragma unroll
      for (int x = 0; x < 8; ++x) {ALU_OPS[alu_op]}
    asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");'''
        tail = 'asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");'
        regs_per = regs
    else:
        body = '''
#pragma unroll
    for (int c = 0; c < CH; ++c)
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                   : "+f"(acc[c][0]), "+f"(acc[c][1]), "+f"(acc[c][2]), "+f"(acc[c][3])
                   : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(a0), "r"(a1));''' + f'''
#pragma unroll
    for (int i = 0; i < {mma_alu}; ++i)
#pragma unroll
      for (int x = 0; x < 8; ++x) {ALU_OPS[alu_op]}'''
        tail = ""
        regs_per = 4
    return f'''
#define CH {chains}
extern "C" __global__ void rate(float* out, long long* cycles, int iters) {{
  __shared__ __align__(128) unsigned char sm[32768];
  for (int i = threadIdx.x; i < 32768 / 4; i += blockDim.x) reinterpret_cast<unsigned*>(sm)[i] = 0x3c003c00u;
  __syncthreads();
  const unsigned base = (unsigned)__cvta_generic_to_shared(sm);
  // no swizzle, LBO 128 B, SBO 256 B (the GEMM's B layout); contents are 1.0 everywhere
  const unsigned long long db = (unsigned long long)((base >> 4) & 0x3FFF) | (8ull << 16) | (16ull << 32);
  const unsigned long long da = db;
  (void)da;
  unsigned a0 = 0x3c003c00u ^ threadIdx.x, a1 = 0x3c003c00u, a2 = 0x3c003c00u, a3 = 0x3c003c00u;
  float acc[CH * {sets}][{regs_per}];
#pragma unroll
  for (int c = 0; c < CH * {sets}; ++c)
#pragma unroll
    for (int i = 0; i < {regs_per}; ++i) acc[c][i] = 0.f;
  float w[8];
  unsigned wi[8];
#pragma unroll
  for (int x = 0; x < 8; ++x) {{ w[x] = (float)(threadIdx.x + x); wi[x] = threadIdx.x * 0x9E3779B9u + x; }}
  const long long t0 = clock64();
  if ({int(split)} && threadIdx.x >= 128) {{
    for (int it = 0; it < iters; ++it) {{
#pragma unroll
      for (int i = 0; i < {alu}; ++i)
#pragma unroll
        for (int x = 0; x < 8; ++x) {ALU_OPS[alu_op]}
    }}
  }} else {{
#pragma unroll 2
  for (int it = 0; it < iters; ++it) {{{"" if mma_off else body}
  }}
  {tail}
  }}
  __syncthreads();
  const long long t1 = clock64();
  float s = w[0] + w[1] + w[2] + w[3] + w[4] + w[5] + w[6] + w[7] + (float)(wi[0] ^ wi[1] ^ wi[2] ^ wi[3] ^ wi[4] ^ wi[5] ^ wi[6] ^ wi[7]);
#pragma unroll
  for (int c = 0; c < CH * {sets}; ++c)
#pragma unroll
    for (int i = 0; i < {regs_per}; ++i) s += acc[c][i];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}}
'''


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, nargs="+", default=[8, 16, 32, 40, 64, 128])
    ap.add_argument("--chains", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--warpgroups", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, nargs="+", default=[1], help="links per chain in one commit group")
    ap.add_argument("--alu", type=int, nargs="+", default=[0],
                    help="x8 independent FMAs per thread between a group's commit and its wait")
    ap.add_argument("--no-mma-sync", action="store_true")
    ap.add_argument("--split", type=int, nargs="+", default=[0],
                    help="1: the ALU work on a warpgroup of its own (the MMAs on warpgroup 0 only)")
    ap.add_argument("--alu-op", nargs="+", default=["ffma"], choices=list(ALU_OPS))
    ap.add_argument("--alt", type=int, nargs="+", default=[0],
                    help="1: consecutive groups use two accumulator sets (a group never waits on the last)")
    ap.add_argument("--ss", action="store_true", help="also A from shared memory")
    ap.add_argument("--mma-off", action="store_true", help="also each split case with no MMAs (the ALU work alone)")
    ap.add_argument("--json", type=output_path, metavar="PATH")
    args = ap.parse_args(argv)
    cp = require_gpu("wgmma_rate_probe")  # before any output: without a GPU, one line

    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    clock_hz = cp.cuda.Device().attributes["ClockRate"] * 1e3
    rows = []
    cases = [] if args.no_mma_sync else [("mma.sync", 8, c, wg, False, 1, alu, 0) for wg in args.warpgroups
                                         for c in args.chains for alu in args.alu]
    cases += [(f"wgmma-{'rs' if rs else 'ss'}", n, c, wg, rs, st, alu, alt)
              for rs in ((True, False) if args.ss else (True,)) for n in args.n for wg in args.warpgroups
              for c in args.chains for st in args.steps for alu in args.alu for alt in args.alt
              if c * n // 2 * (1 + alt) <= 128]  # accumulators fit
    cases = [c + (op,) for c in cases for op in (args.alu_op if c[6] else args.alu_op[:1])]
    cases = [c + (sp,) for c in cases for sp in args.split if not (sp and c[3] != 2)]
    cases = [c + (off,) for c in cases for off in ((0, 1) if args.mma_off and c[-1] and c[6] else (0,))]
    for name, n, chains, wgs, rs, steps, alu, alt, op, split, off in cases:
        kind = "mma" if name == "mma.sync" else "wgmma"
        mod = cp.RawModule(code=source(n, chains, rs, kind, steps, alu, bool(alt), op, bool(split), bool(off)), options=("-arch=sm_90a", "-std=c++17"))
        k = mod.get_function("rate")
        threads = 128 * wgs
        out = cp.zeros(sms * threads, cp.float32)
        cyc = cp.zeros(sms, cp.int64)
        k((sms,), (threads,), (out, cyc, np.int32(ITERS)))
        ev0, ev1 = cp.cuda.Event(), cp.cuda.Event()
        ev0.record()
        k((sms,), (threads,), (out, cyc, np.int32(ITERS)))
        ev1.record()
        ev1.synchronize()
        cycles = float(cyc.get().mean())
        # the whole launch by events, in cycles of the SM clock (a cross-check of clock64: a
        # warp that never waits for the others would read a short interval)
        wall_cycles = cp.cuda.get_elapsed_time(ev0, ev1) * 1e-3 * clock_hz
        # instructions per SM: per warpgroup ITERS * chains wgmma; mma.sync per warp
        inst = ITERS * chains * steps * (1 if split else wgs) * (4 if kind == "mma" else 1)
        fma = inst * (16 * 8 * 16 if kind == "mma" else 64 * n * 16)
        row = {"instr": name, "n": n, "chains": chains, "steps": steps, "alu": alu, "alu_op": op, "alt": alt,
               "split": split, "mma_off": off, "warpgroups": wgs, "cycles_per_instr": cycles / inst,
               "cycles_per_group": cycles / ITERS, "wall_cycles_per_group": wall_cycles / ITERS, "fma_per_cycle": fma / cycles}
        rows.append(row)
        print(f"{name:9s} N {n:3d} chains {chains} steps {steps} alu {alu:3d} {op:5s} alt {alt} split {split} "
              f"WGs {wgs}{' no-mma' if off else ''}: {cycles / inst:6.1f} cycles/instr/SM, {cycles / ITERS:7.1f} cycles/group ({wall_cycles / ITERS:7.1f} by events), {fma / cycles:6.0f} FMA/cycle/SM", flush=True)
    write_json(args.json, "scripts/probes/wgmma_rate_probe.py", rows=rows)


if __name__ == "__main__":
    sys.exit(run_script(main, "wgmma_rate_probe"))

"""Probe: do the lab's kernels run on green-context streams, on the SMs given them, and does such an SM partition let a skewed split's two launches run side by side?"""
# sm_partition_probe caps each launch's grid, but where CTAs land is the block scheduler's choice:
# the small class's CTAs spread over every SM before the large class's can be placed
# (studies/skew_split_classes_on_sms.json sm_partition_probe). A green context (CUDA 12.4+ driver
# API) owns a set of SMs; work on its streams runs there only. This asks, in order, and says where
# it stops:
#   1. does the driver split the SMs (the partition sizes it grants for the asked counts)?
#   2. does a CuPy kernel, loaded in the primary context, launch on a green context's stream, and on
#      which SMs does it run (%smid per block, the two partitions disjoint)?
#   3. the skewed split with its large class on an S-SM green context and its small class on the
#      rest, against the shipped split on two ordinary streams, every output bit compared; timed by
#      the host clock around each run (no event crosses contexts), launches included alike.
import argparse
import ctypes
import sys
import time

import numpy as np

from lab.cli import output_path
from lab.gemm_bench import GemmBench, class_rows, log, write_json
from lab.gpu import require_gpu, run_script
from lab.kernels import gemm_config as gc
from lab.kernels import grouped_gemm as gg
from lab.problem import MoEProblem

TAG = "green-ctx"
CU_DEV_RESOURCE_TYPE_SM = 1
CU_GREEN_CTX_DEFAULT_STREAM = 1
CU_STREAM_NON_BLOCKING = 1
WHERE = r"""
extern "C" __global__ void where(unsigned* out) {
  if (threadIdx.x == 0) { unsigned s; asm volatile("mov.u32 %0, %%smid;" : "=r"(s)); out[blockIdx.x] = s; }
}
"""


class SmResource(ctypes.Structure):  # CUdevSmResource (cuda.h, CUDA 13.0)
    _fields_ = [("smCount", ctypes.c_uint), ("minSmPartitionSize", ctypes.c_uint),
                ("smCoscheduledAlignment", ctypes.c_uint)]


class _Union(ctypes.Union):
    _fields_ = [("sm", SmResource), ("_oversize", ctypes.c_ubyte * 48)]


class DevResource(ctypes.Structure):  # CUdevResource: type, 92 bytes of padding, a 48-byte union
    _anonymous_ = ("u",)
    _fields_ = [("type", ctypes.c_int), ("_pad", ctypes.c_ubyte * 92), ("u", _Union)]


class Driver:
    """The few driver entry points the probe needs, through ctypes (every call checked)."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        if not hasattr(self.lib, "cuGreenCtxCreate"):
            raise RuntimeError("this driver has no green contexts (cuGreenCtxCreate)")

    def __call__(self, name, *args):
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            msg = ctypes.c_char_p()
            self.lib.cuGetErrorString(rc, ctypes.byref(msg))
            raise RuntimeError(f"{name}: CUresult {rc} ({(msg.value or b'?').decode()})")

    def device(self, ordinal: int) -> ctypes.c_int:
        dev = ctypes.c_int()
        self("cuDeviceGet", ctypes.byref(dev), ordinal)
        return dev

    def sm_resource(self, dev) -> DevResource:
        res = DevResource()
        self("cuDeviceGetDevResource", dev, ctypes.byref(res), CU_DEV_RESOURCE_TYPE_SM)
        return res

    def split(self, full: DevResource, count: int) -> tuple[DevResource, DevResource]:
        """One group of at least `count` SMs (the driver rounds up to its granularity) and the rest."""
        group, rest, nb = (DevResource * 1)(), DevResource(), ctypes.c_uint(1)
        self("cuDevSmResourceSplitByCount", group, ctypes.byref(nb), ctypes.byref(full), ctypes.byref(rest), 0, count)
        if nb.value != 1:
            raise RuntimeError(f"cuDevSmResourceSplitByCount: {nb.value} groups of {count} SMs")
        return group[0], rest

    def green_stream(self, dev, res: DevResource) -> int:
        """A non-blocking stream of a new green context that owns `res` (kept for the process)."""
        desc, ctx, stream = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        self("cuDevResourceGenerateDesc", ctypes.byref(desc), ctypes.byref(res), 1)
        self("cuGreenCtxCreate", ctypes.byref(ctx), desc, dev, CU_GREEN_CTX_DEFAULT_STREAM)
        self("cuGreenCtxStreamCreate", ctypes.byref(stream), ctx, CU_STREAM_NON_BLOCKING, 0)
        return stream.value


def wall_ms(fn, sync, iterations: int, warmup: int = 3) -> list[float]:
    for _ in range(warmup):
        fn()
        sync()
    out = []
    for _ in range(iterations):
        t0 = time.perf_counter()
        fn()
        sync()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def partition(cp, hot_sms, parts: dict, checks: list, info: dict) -> None:
    """Steps 1 and 2: for each asked count a green context for the large class and one for the
    rest; `parts[ask]` = ((hot stream, rest stream), (hot SMs, rest SMs)); `checks` says where a
    kernel on each stream ran."""
    drv = Driver()
    dev = drv.device(cp.cuda.Device().id)
    full = drv.sm_resource(dev)
    info.update(sms=full.sm.smCount, min_partition=full.sm.minSmPartitionSize,
                coscheduled_alignment=full.sm.smCoscheduledAlignment)
    log(TAG, f"SM resource: {info}")
    where = cp.RawKernel(WHERE, "where")
    for ask in hot_sms:
        hot_res, rest_res = drv.split(full, ask)
        streams = [cp.cuda.ExternalStream(drv.green_stream(dev, r)) for r in (hot_res, rest_res)]
        got = (hot_res.sm.smCount, rest_res.sm.smCount)
        ran = []
        for s, n in zip(streams, got):  # 8 blocks per SM of the whole device: each partition's SMs all show
            ids = cp.full(8 * full.sm.smCount, 0xFFFFFFFF, cp.uint32)
            where((ids.size,), (32,), (ids,), stream=s)
            s.synchronize()
            ran.append(set(int(v) for v in ids.get()))
        check = {"asked": ask, "granted": got, "sms_used": [len(r) for r in ran], "disjoint": not (ran[0] & ran[1]),
                 "within": [len(r) <= n for r, n in zip(ran, got)]}
        log(TAG, f"partition: {check}")
        checks.append(check)
        parts[ask] = (streams, got)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--skews", type=float, nargs="+", default=[1.2, 0.8])
    ap.add_argument("--gemms", nargs="+", choices=["w13", "w2"], default=["w13", "w2"])
    ap.add_argument("--mean-tokens", type=float, default=8.0)
    ap.add_argument("--hot-sms", type=int, nargs="+", default=[24, 32, 40],
                    help="SMs asked for the large class's green context (the driver may round up)")
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=output_path, metavar="PATH")
    args = ap.parse_args(argv)
    cp = require_gpu("green_ctx_probe")
    cp.zeros(1)  # (the primary context, before any green one retains it)
    parts, checks, info = {}, [], {}
    try:
        partition(cp, args.hot_sms, parts, checks, info)
    except (RuntimeError, cp.cuda.driver.CUDADriverError, cp.cuda.runtime.CUDARuntimeError) as exc:
        log(TAG, f"stopped before the GEMMs: {exc}")
        write_json(args.json, "scripts/probes/green_ctx_probe.py", sm_resource=info, partitions=checks,
                   stopped=str(exc), rows=[])
        return 1
    rows = []
    bench = GemmBench(MoEProblem(), tag=TAG)
    s_cold, s_hot = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    for skew, gemm, case, plan in bench.split_cases(args.skews, args.gemms, args.mean_tokens):
        cold, hot = plan
        prep = bench.prepared(gemm, (cold[0].block_rows, cold[0].k_step))

        def one(launch, stream, on=None):
            gg.grouped_gemm(prep, case.d_xp, case.d_xs, case.d_off, case.d_alpha, case.out, launch[0], stream=stream,
                            counts_in=launch[1], sms=on)

        modes = {"shipped, two streams": ((cold, s_cold, None), (hot, s_hot, None)),
                 "cold class alone": ((cold, s_cold, None),), "hot class alone": ((hot, s_hot, None),)}
        for ask, ((g_hot, g_cold), (n_hot, n_cold)) in parts.items():
            modes[f"green: hot on {n_hot} SMs, cold on {n_cold}"] = ((hot, g_hot, n_hot), (cold, g_cold, n_cold))
            modes[f"green: hot alone on {n_hot} SMs"] = ((hot, g_hot, n_hot),)
            modes[f"green: cold alone on {n_cold} SMs"] = ((cold, g_cold, n_cold),)

        def run(launches):
            for launch, s, on in launches:
                one(launch, s, on)

        def sync(launches):
            for _, s, _ in launches:
                s.synchronize()

        def writes(launches):
            return np.logical_or.reduce([class_rows(case.counts, launch[1]) for launch, _, _ in launches])

        bits = {}
        for m, launches in modes.items():
            case.out.fill(cp.nan)
            cp.cuda.Device().synchronize()
            run(launches)
            sync(launches)
            bits[m] = case.out.get().view(np.uint32)
        ms = {m: [] for m in modes}
        for _ in range(args.rounds):
            for m, launches in modes.items():
                ms[m].append(float(np.median(wall_ms(lambda: run(launches), lambda: sync(launches), args.iterations))))
        ref = bits["shipped, two streams"]
        for m, launches in modes.items():
            w = writes(launches)
            row = {"gemm": gemm, "skew": skew, "mean_tokens": args.mean_tokens, "mode": m,
                   "plan": gc.plan_record(plan), "round_median_ms": ms[m], "ms": min(ms[m]),
                   "rows_written": int(w.sum()), "differ": int((bits[m][w] != ref[w]).sum()),
                   "unwritten": int(np.isnan(bits[m][w].view(np.float32)).sum())}
            rows.append(row)
            log(TAG, f"{gemm} skew {skew} {m:40s} rounds {' '.join(f'{v:.4f}' for v in ms[m])} ms (host clock)  "
                     f"differ {row['differ']} unwritten {row['unwritten']}")
    write_json(args.json, "scripts/probes/green_ctx_probe.py", sm_resource=info, partitions=checks, rows=rows)
    bad = any(r["differ"] or r["unwritten"] for r in rows) or not all(c["disjoint"] and all(c["within"]) for c in checks)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(run_script(main, "green_ctx_probe"))

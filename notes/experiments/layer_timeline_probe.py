"""Probe: the per-CTA timeline of one fused-layer launch (w13 units with the SwiGLU epilogue,
then w2 units that wait on ready[e]). The timeline probe's stamps plus: the time each CTA's
producer claimed its first w2 unit, the last w13 unit it claimed, and the nanoseconds its
producer spent waiting on ready[]. Timing only.

    python notes/experiments/layer_timeline_probe.py --mean-tokens 8 --json results/timeline_layer.json
"""
import json
import sys

import numpy as np

from lab.gemm_bench import study_parser
from lab.kernels import grouped_gemm as gg, jit
from lab.variants import make
from probe_common import edit_kernel, start_layer, study_layer
from timeline_probe import EDITS, MAX_CTAS, SLOTS, summary

LAYER_EDITS = {
    **EDITS,
    "      const int p = un.p, e = un.e, nb = un.nb;\n":
        "      const int p = un.p, e = un.e, nb = un.nb;\n"
        "      if (lane == 0 && !done && p == 0) LAB_STAMP(10);\n"
        f"      if (lane == 0 && !done && p == 1 && lab_timeline[blockIdx.x * {SLOTS} + 8] == 0) LAB_STAMP(8);\n",
    "            while (load_acquire(ready + e) < target) __nanosleep(64);\n":
        "            const unsigned long long lab_t0 = lab_now();\n"
        "            while (load_acquire(ready + e) < target) __nanosleep(64);\n"
        f"            if (lane == 0) LAB_SET(9, lab_timeline[blockIdx.x * {SLOTS} + 9] + (lab_now() - lab_t0));\n",
}


def main():
    ap = study_parser(__doc__, [8], 5)
    ap.add_argument("--variant", default="fused-layer")
    args = ap.parse_args()
    edit_kernel(LAYER_EDITS)
    modules = []
    compiled = jit._module

    def recording(name, exprs):
        mod = compiled(name, exprs)
        if name == gg.SOURCE and (mod, exprs) not in modules:
            modules.append((mod, exprs))
        return mod

    jit._module = recording
    import cupy as cp

    _, problem, dweights = start_layer(args, roofline=False)
    report = []
    for mean in args.mean_tokens:
        runner, layer = study_layer(problem, dweights, mean, args.seed)
        v = make(args.variant)
        runner.prepare(v, layer)
        t = runner.time(v, layer, iterations=args.iterations, warmup=2)
        for mod, exprs in modules:
            try:
                ptr = mod.get_global("lab_timeline")
            except Exception:
                continue
            cp.ndarray((MAX_CTAS, SLOTS), cp.uint64, ptr).fill(0)
        cp.cuda.Device().synchronize()  # the runner launches on its own stream
        runner.run(v, layer)
        runner.synchronize()
        for mod, exprs in modules:
            raw = cp.ndarray((MAX_CTAS, SLOTS), cp.uint64, mod.get_global("lab_timeline")).get()
            used = raw[raw[:, 0] > 0]
            if not used.shape[0]:
                continue
            s = summary(used)
            t0 = int(used[:, 0].min())
            extra = {
                "first_w2_claim_us": (used[:, 8].astype(np.int64) - t0) / 1e3,
                "last_w13_claim_us": (used[:, 10].astype(np.int64) - t0) / 1e3,
                "ready_wait_us": used[:, 9] / 1e3,
            }
            for k, vals in extra.items():
                s[k] = {q: float(np.percentile(vals, q)) for q in (0, 50, 100)}
            print(f"{args.variant} @{mean:g} {exprs[0]}: {used.shape[0]} CTAs, median {t.median_ms:.3f} ms",
                  flush=True)
            for name, val in s.items():
                print(f"  {name:18s} min {val[0]:9.1f}  median {val[50]:9.1f}  max {val[100]:9.1f}", flush=True)
            report.append({"variant": args.variant, "mean_tokens": mean, "kernel": exprs[0],
                           "ctas": int(used.shape[0]), "timed_ms": t.median_ms, "us_from_first_entry": s})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"script": "notes/experiments/layer_timeline_probe.py", "argv": sys.argv[1:],
                       "runs": report}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())

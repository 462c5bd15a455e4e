"""Probe: the grouped GEMM in a short burst after an idle pause (what bench_gemm times) against
the same GEMM run back to back for about a second (the power-capped state that the layer reaches
under sustained load, notes/layer.md v15), with the flat read timed both ways beside it. Run
nvidia-smi beside it to see the SM clock and the power cap's reason. `--edits` times cost_probe's
removal variants too (timing only: their outputs are wrong), to see which part of the kernel's
work the held figure pays for: `--edits shipped no-decoder consumer-half no-store`."""
import sys
import time

import cupy as cp
import numpy as np

from lab.gemm_bench import study_parser, write_json
from lab.kernels import grouped_gemm as gg
from lab.kernels.stream_read import stream_read
from lab.timing import time_cuda_samples
from probe_common import edit_kernel, start


def main():
    ap = study_parser(__doc__, [8, 2], 20)
    ap.add_argument("--sustain-ms", type=float, default=1000.0)
    ap.add_argument("--edits", nargs="+", default=["shipped"], help="cost_probe.py variants to time")
    args = ap.parse_args()
    import cost_probe
    unknown = [e for e in args.edits if e not in cost_probe.VARIANTS]
    if unknown:
        ap.error(f"--edits: unknown {unknown}; known: {list(cost_probe.VARIANTS)}")
    roof, bench = start(args)
    flat = cp.random.default_rng(1).integers(0, 2**31 - 1, size=4_077_000_000 // 4, dtype=cp.int32)
    sink = cp.zeros(1, dtype=cp.uint32)
    rows = []

    def both(name, fn, one_ms, nbytes):
        cp.cuda.Device().synchronize()
        time.sleep(0.5)
        burst = float(np.median(time_cuda_samples(fn, args.iterations, 3)))
        warm = max(1, int(args.sustain_ms / one_ms))
        held = float(np.median(time_cuda_samples(fn, args.iterations, warm)))
        row = {"what": name, "burst_ms": burst, "sustained_ms": held, "warm_runs": warm,
               "burst_gbps": nbytes / burst / 1e6, "sustained_gbps": nbytes / held / 1e6}
        rows.append(row)
        print(f"{name:12s} burst {burst:.4f} ms ({row['burst_gbps']:.0f} GB/s)  sustained {held:.4f} ms "
              f"({row['sustained_gbps']:.0f} GB/s, after {warm} runs)  {100 * (held / burst - 1):+.1f}%", flush=True)

    both("flat-read", lambda: stream_read(flat, sink), 0.9, flat.nbytes)
    cases = {(gemm, mean): bench.case(gemm, mean) for mean in args.mean_tokens for gemm in ("w13", "w2")}
    for edit in args.edits:
        edit_kernel(dict(cost_probe.VARIANTS[edit]))
        for (gemm, mean), case in cases.items():
            cfg = gg.heuristic(case.n, case.k, case.counts)
            prep = bench.prepared(gemm, (cfg.block_n, cfg.k_step))

            def run(case=case, cfg=cfg, prep=prep):
                gg.grouped_gemm(prep, case.d_xp, case.d_xs, case.d_off, case.d_alpha, case.out, cfg)
            nbytes = bench.required_bytes(case)
            both(f"{gemm} @{mean:g}" + ("" if edit == "shipped" else f" {edit}"), run, nbytes / (roof * 1e6), nbytes)
    for r in rows:
        r["roofline_gbps"] = roof
    write_json(args.json, "notes/experiments/sustained_gemm_probe.py", roofline_gbps=roof, rows=rows)


if __name__ == "__main__":
    sys.exit(main())

"""Probe: the GEMM with and without split experts (grouped_gemm.SPLIT_TAIL), heuristic tiles,
alternating in one process so that both see the same machine. Needs
notes/experiments/split_tail.patch applied (`git apply`)."""
import sys

from lab.gemm_bench import study_parser
from lab.kernels import grouped_gemm as gg
from probe_common import start


def main():
    ap = study_parser(__doc__, [2, 4, 8, 32], 10)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    roof, bench = start(args)
    for mean in args.mean_tokens:
        for gemm in ("w13", "w2"):
            case = bench.case(gemm, mean)
            cfg = gg.heuristic(case.n, case.k, case.counts)
            split = int(gg.split_experts(case.counts, case.k).sum())
            for rnd in range(args.rounds):
                for on in (False, True):
                    gg.SPLIT_TAIL = on
                    row = bench.measure(case, cfg, roof, args.iterations, read_pattern=False)
                    print(f"{gemm} @{mean:g} split {'on ' if on else 'off'} ({split} experts) round {rnd}: "
                          f"{row['ms']:.4f} ms {row['roof_pct']:.1f}%", flush=True)
    gg.SPLIT_TAIL = True


if __name__ == "__main__":
    sys.exit(main())

"""Probe: what holds the fused w13 phase back. With the tensor-copy weight stream plain w13 @8 runs
0.682 ms but fused-swiglu's w13 + SwiGLU stage stays at 0.708 ms. Variants (kernel edited in
memory; timing only where the values change): `epi-off`, the epilogue warps take each h tile and
hand it back without the SwiGLU and quantize work (a_q keeps the previous run's values); `sleep-100`,
the epilogue warps poll for the next tile every 0.1 us instead of 1 us (same values); `dw1`, fused
CTAs of small token tiles take one decoder warp and two epilogue warps, the form before ffb00f2
(same values); for fused-layer's w2 phase, `no-ready` (producers do not wait on ready[e]; timing
only, a unit may read a_q before it is written) and `no-bf16` (the epilogue warps store no bf16
output for w2 tiles; since c61052f they, not the consumers, write it); `no-fence` (the epilogue warps publish ready[e] without their __threadfence: timing
only, the release is then not guaranteed to cover every lane's a_q); `no-handoff` (consumers
hand no tile to the epilogue warps, w2 tiles included, so there is no output; with no-ready:
nothing else could finish); `floor`
(no-fence, epi-off and no-bf16 together); `bf16-single` (the bf16 conversion one value at a
time, as before bf16x2_bits; same bits). Times whole variants through the runner, with their stage table."""
import sys

from lab.gemm_bench import study_parser, write_json
from lab.variants import make
from probe_common import edit_kernel, settled_ms, start_layer, study_layer

VARIANTS = {
    "as-is": {},
    "epi-off": {"item < ntok * Q; item += 32 * C::EW) {": "item < 0 * ntok; item += 32 * C::EW) {"},
    "sleep-100": {"    __nanosleep(1000);\n": "    __nanosleep(100);\n"},
    # one decoder warp and two epilogue warps in fused CTAs of 8-16-token tiles, as before ffb00f2
    # (that commit shipped the two-decoder form the probe's earlier `dw2` variant measured)
    "dw1": {"FMAX >= 8 && FUSE == 0 ? 3 : FMAX >= 4 || FUSE != 0 ? 2 : 1;": "FMAX >= 8 && FUSE == 0 ? 3 : FMAX >= 4 ? 2 : 1;"},
    "no-ready": {"while (load_acquire(ready + e) < target) __nanosleep(64);":
                 "while (target < 0 && load_acquire(ready + e) < target) __nanosleep(64);"},
    "no-bf16": {"item < ntok * PAIRS; item += 32 * C::EW) {": "item < 0 * ntok; item += 32 * C::EW) {"},
    "no-fence": {"          __threadfence();\n          __syncwarp();": "          __syncwarp();"},
}
VARIANTS["no-handoff"] = {
    **VARIANTS["no-ready"],
    "if (kc == kchunks - 1 && ((FUSE & 2) != 0 || unit_p == 0)) {":
        "if (kc == kchunks - 1 && ((FUSE & 2) != 0 || unit_p == 0)) { zero_acc(); next_stage(); continue; }\n"
        "      if (false) {"}
# the w2 epilogue's bf16 conversion one value at a time, as before bf16x2_bits (same bits)
VARIANTS["bf16-single"] = {
    "const uint32_t b = lab_act::bf16x2_bits(v.x, v.y);\n":
        "const uint32_t b = lab_act::bf16_bits(v.x) | (lab_act::bf16_bits(v.y) << 16);\n",
    "bad += lab_act::bf16x2_nonfinite(b);":
        "bad += lab_act::bf16_nonfinite(b & 0xffffu) + lab_act::bf16_nonfinite(b >> 16);"}
VARIANTS["floor"] = {**VARIANTS["no-fence"], **VARIANTS["epi-off"], **VARIANTS["no-bf16"]}
VARIANTS["floor-no-handoff"] = {**VARIANTS["floor"], **VARIANTS["no-handoff"]}


def main():
    ap = study_parser(__doc__, [8], 10)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--settle-ms", type=float, default=0.0,
                    help="idle pause before each timed burst (500: every burst from the uncapped state)")
    ap.add_argument("--layer-variants", nargs="+", default=["cuda-graph", "fused-swiglu", "fused-layer"])
    args = ap.parse_args()
    _, problem, dweights = start_layer(args, roofline=False)
    rows = []
    for name in args.variants:
        edit_kernel(VARIANTS[name])
        for mean in args.mean_tokens:
            runner, layer = study_layer(problem, dweights, mean, args.seed)
            for lv in args.layer_variants:
                v = make(lv)
                ms = settled_ms(runner, v, layer, args.iterations, args.settle_ms)
                st = {}
                if args.settle_ms == 0:  # with settled bursts the stage table's burst would heat the next
                    try:
                        st = {k: s.median_ms for k, s in runner.time_stages(v, layer, iterations=args.iterations,
                                                                              warmup=1).items()}
                    except Exception as e:  # a variant without stage events
                        print(f"  (no stage table for {lv}: {e})")
                rows.append({"edit": name, "variant": lv, "mean_tokens": mean, "ms": ms, "stages": st})
                print(f"{name:10s} {lv:13s} @{mean:g}: {ms:.4f} ms  stages "
                      + "  ".join(f"{k} {v:.3f}" for k, v in st.items()), flush=True)
    write_json(args.json, "notes/experiments/fused_epilogue_probe.py", rows=rows)


if __name__ == "__main__":
    sys.exit(main())

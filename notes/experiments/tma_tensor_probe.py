"""Probe: the weight stream through TMA tensor copies instead of 1-D bulk copies.

The producer's one `cp.async.bulk` per stage (STAGE_W contiguous bytes) becomes one
`cp.async.bulk.tensor.2d` of a box of STAGE_W / 256 rows x 256 bytes, over a tensor map that
views the prepared weights as rows of 256 bytes: the same bytes land in the same shared-memory
order, but the copy engine issues them as tensor rows, with the map's L2 promotion (none, 64,
128 or 256 B) shaping the L2 requests. v8 found L2 near its request throughput at @8 with the
1-D copies (twice the flat read's requests for the same bytes), so fewer, larger requests could
lift the stream. --row-bytes sets the rows' width (the stage is STAGE_W / width rows; at most
256 of them). The maps live in a __device__ array of the edited module, encoded on the host
with the driver's cuTensorMapEncodeTiled through ctypes. Values do not change: every row is
checked against float64 on a sample of experts.

Written for the kernel before its weight copies became TMA tensor copies (commit 4b1b07e, with
`git checkout 4b1b07e -- lab/kernels`): its anchor, the 1-D `bulk_copy` of a stage, is gone.
The tensor copies it measured are now shipped, with a 3-D map (lab/kernels/tensor_map.py)."""
import ctypes
import sys

import numpy as np

from lab.gemm_bench import study_parser, write_json
from lab.kernels import grouped_gemm as gg, jit
from probe_common import check_sample, edit_kernel, measure_tile, start

COPY = ("            bulk_copy(smem_addr(smem + C::OFF_W + s * C::STAGE_W), wblock + (size_t)kc * C::STAGE_W, "
        "C::STAGE_W,\n                      full0 + 8 * s, pol);\n")
TENSOR_COPY = """            {
              static_assert(C::STAGE_W % ROWB == 0, "a stage is whole rows");
              const int row = (int)((((size_t)e * NB + nb) * kchunks + kc) * (C::STAGE_W / ROWB));
              asm volatile(
                  "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"
                  " [%0], [%1, {%2, %3}], [%4], %5;"
                  ::"r"(smem_addr(smem + C::OFF_W + s * C::STAGE_W)), "l"(lab_tmap + 128 * p), "r"(0), "r"(row),
                    "r"(full0 + 8 * s), "l"(pol) : "memory");
            }
"""
POLICY = "    const uint64_t pol = evict_first_policy();\n"
FENCE = POLICY + """    if (lane == 0) {  // the maps were written by the host since the last launch
      asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;" ::"l"(lab_tmap) : "memory");
      asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;" ::"l"(lab_tmap + 128) : "memory");
    }
"""


def edits(row_bytes: int) -> dict:
    return {
    "namespace lab_gemm {\n": f"__device__ __align__(128) unsigned char lab_tmap[256];\n#define ROWB {row_bytes}\n\n"
                              "namespace lab_gemm {\n",
    # tensor copies want a 128-byte aligned destination
    "static constexpr int OFF_W = 16 * (((3 * STAGES + 2) * 8 + 15) / 16);":
        "static constexpr int OFF_W = 128 * (((3 * STAGES + 2) * 8 + 127) / 128);",
    COPY: TENSOR_COPY,
    POLICY: FENCE,
    }
SHIPPED_SMEM = gg.GemmConfig.smem_bytes


def encode_map(data_ptr: int, nbytes: int, row_bytes: int, stage_rows: int, promotion: int) -> bytes:
    """A 2-D tensor map: rows of row_bytes (uint8 elements up to 256 bytes, then 256 elements of
    2, 4 or 8 bytes), boxes of stage_rows rows."""
    esize = max(1, row_bytes // 256)
    dtype = {1: 0, 2: 1, 4: 2, 8: 4}[esize]  # CU_TENSOR_MAP_DATA_TYPE_UINT8 / UINT16 / UINT32 / UINT64
    cuda = ctypes.CDLL("libcuda.so.1")
    buf = ctypes.create_string_buffer(128 + 64)
    addr = (ctypes.addressof(buf) + 63) & ~63
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    dims = (u64 * 2)(row_bytes // esize, nbytes // row_bytes)
    strides = (u64 * 1)(row_bytes)
    box = (u32 * 2)(row_bytes // esize, stage_rows)
    elem = (u32 * 2)(1, 1)
    # (map, dtype UINT8, rank, address, dims, strides, box, element strides, no interleave,
    # no swizzle, L2 promotion, no OOB fill)
    rc = cuda.cuTensorMapEncodeTiled(ctypes.c_void_p(addr), dtype, 2, ctypes.c_void_p(data_ptr), dims, strides, box, elem,
                                     0, 0, promotion, 0)
    if rc != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {rc}")
    return ctypes.string_at(addr, 128)


def set_maps(cfg: gg.GemmConfig, prep: gg.PreparedWeights, row_bytes: int, promotion: int) -> None:
    tmap = encode_map(prep.data.data.ptr, prep.data.nbytes, row_bytes, cfg.stage_bytes // row_bytes, promotion)
    host = np.frombuffer(tmap * 2, np.uint8)  # problem 1 of a plain launch has no experts
    glob = jit._module(gg.SOURCE, (cfg.expression_for(False),)).get_global("lab_tmap")
    glob.copy_from_host(host.ctypes.data, host.nbytes)


def main():
    ap = study_parser(__doc__, [8, 2, 32], 10)
    ap.add_argument("--promotions", type=int, nargs="+", default=[-1, 0, 2, 3],
                    help="-1: the shipped 1-D bulk copy; 0 / 1 / 2 / 3: tensor copies, L2 promotion none / 64 / 128 / 256 B")
    ap.add_argument("--row-bytes", type=int, nargs="+", default=[256], help="the tensor rows' width (64 .. 2048)")
    ap.add_argument("--gemms", nargs="+", default=["w13", "w2"])
    ap.add_argument("--check-experts", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    roof, bench = start(args)
    rows = []
    rng = np.random.default_rng(args.seed)
    # the edited layout moves OFF_W to a 128-byte boundary: up to 112 bytes more per CTA
    gg.GemmConfig.smem_bytes = property(lambda self: SHIPPED_SMEM.fget(self) + 128)
    for rnd in range(args.rounds):
        for promo, rb in [(p, rb) for p in args.promotions for rb in (args.row_bytes if p >= 0 else [0])]:
            edit_kernel(edits(rb) if promo >= 0 else None)
            for mean in args.mean_tokens:
                for gemm in args.gemms:
                    case = bench.case(gemm, mean)
                    cfg = gg.heuristic(case.n, case.k, case.counts)
                    if promo >= 0:
                        set_maps(cfg, bench.prepared(gemm, (cfg.block_n, cfg.k_step)), rb, promo)
                    row = measure_tile(bench, case, cfg, roof, args.iterations)
                    if row is None:
                        continue
                    row["rel_err"] = check_sample(bench, case, rng, args.check_experts)
                    row.update(promotion=promo, row_bytes=rb, round=rnd)
                    rows.append(row)
                    name = "bulk-1d" if promo < 0 else f"tensor-{rb}B-L2p{promo}"
                    print(f"r{rnd} {name:12s} {gemm} @{mean:g}: {row['ms']:.3f} ms {row['roof_pct']:.1f}% "
                          f"err {row['rel_err']:.1e} unwritten {row['unwritten']}", flush=True)
    write_json(args.json, "notes/experiments/tma_tensor_probe.py", read_roofline_gbps=roof, rows=rows)


if __name__ == "__main__":
    sys.exit(main())

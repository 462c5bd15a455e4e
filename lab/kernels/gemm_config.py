"""The grouped GEMM's tile configuration: the template arguments of one kernel instantiation
(`GemmConfig`), its shared-memory sizing, the warp counts per role, the tile heuristic, and the
instantiations the lab ships. Plain Python, testable without a GPU; the kernel's `Config`
(grouped_gemm.cu) derives the same sizes from the same arguments (a CPU test compiles both).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import numpy as np

from lab.kernels import tensor_map
from lab.kernels.gemm_weights import ATOM_BYTES, ATOM_K, ATOM_ROWS, default_layout

SMEM_LIMIT = 227 * 1024  # H200 opt-in dynamic shared memory per block
MAX_FRAGS_CHOICES = (1, 2, 4, 8)  # 8-token fragments per pass, compiled variants
# Token tiles past 64 (96, 128, 160): wgmma with the plain epilogue only. The heuristic picks one on
# the activation image where an expert's 99th-percentile count passes 64 tokens: the 96-token tile
# up to 96, the 160-token one past that (IMAGE_FRAGS).
LARGE_FRAGS = (12, 16, 20)
IMAGE_FRAGS = (12, 20)
# What a launch computes (lab_gemm::Mode): grouped GEMMs with fp32 output; w13 ending in SwiGLU +
# NVFP4 quantize; the whole layer, w2 after it in the same launch, bf16 output.
MODES = ("plain", "swiglu", "layer")
# The activations (lab_gemm::Act): NVFP4 codes and e4m3 scales (W4A4), or bf16 as they are (W4A16).
ACTS = ("nvfp4", "bf16")


@dataclass(frozen=True)
class GemmConfig:
    """warps: consumer warps; row_tiles: 16-row tiles per warp; k_step: K per pipeline stage;
    stages: pipeline depth; max_frags: 8-token fragments held per pass (token tile = 8*max_frags);
    mma: 0 = mma.sync m16n8k16, 1 = wgmma m64n(8F)k16 (sm_90a, warps a multiple of 4), weights as
    the register A operand; 2 = wgmma m64n128k16 with tokens as A and the weights as B, both from
    shared memory: decoder warps of their own decode each stage's weights once into shared memory
    for both consumer warpgroups (on the activation image; 8 warps x 2 row tiles, 64 tokens);
    mode: one of MODES (the fused ones through `fused_config`); act: one of ACTS;
    ctas_per_sm: at most this many CTAs per SM in the persistent grid (0: as many as fit). Not a
    template argument: it only sizes the grid.
    image: the activations reach the GEMM as an fp16 image a pre-pass writes once per launch
    (gemm/act_image.cuh): no decoder warps, the producer copies each stage's B operand as it is.
    wgmma and the plain epilogue only; meant for token tiles of 64 and more. The 128- and 160-token
    image tiles write that image inside the launch instead (`builders`); build_image: the 64- and
    96-token ones too, with a producer warpgroup whose three other warps build it (a study tile:
    the heuristic does not pick it)."""

    warps: int = 8
    row_tiles: int = 2
    k_step: int = 128
    stages: int = 4
    max_frags: int = 2
    mma: int = 0  # 0: mma.sync per 8-token fragment; 1: wgmma m64n(8F)k16 per warpgroup; 2: wgmma SS
    mode: str = "plain"
    ctas_per_sm: int = 0
    act: str = "nvfp4"
    image: bool = False
    build_image: bool = False

    @property
    def block_rows(self) -> int:
        """Weight rows of one unit of work (one CTA pass): warps x row_tiles 16-row tiles."""
        return self.warps * self.row_tiles * ATOM_ROWS

    @property
    def token_tile(self) -> int:
        return 8 * self.max_frags

    @property
    def threads(self) -> int:
        # consumers, producer(s), activation decoders, epilogue warps
        return (self.warps + self.producer_warps + self.decoder_warps + self.epilogue_warps) * 32

    @property
    def producer_warps(self) -> int:
        """Config::PRODUCER_WARPS: a whole producer warpgroup (one warp working, three building the
        activation image) on image tiles of 8 warps whose accumulators pass 168 registers (256 rows x
        128 or 160 tokens), so that setmaxnreg can move its registers to the consumers, and on the
        smaller 8-warp image tiles with build_image; else the one producer warp."""
        return 4 if self.wide or (self.build_image and self.image and self.mma == 1 and self.warps == 8) else 1

    @property
    def wide(self) -> bool:
        """Config::WIDE: an image tile of 8 warps whose accumulators pass 168 registers, the reason
        for its producer warpgroup (and for what depends on the registers: the wgmma group size, the
        register SwiGLU)."""
        return self.image and self.mma != 2 and self.warps == 8 and self.row_tiles * self.max_frags > 24

    @property
    def decoder_warps(self) -> int:
        """Activation-decoder warps: a third for 64-token plain tiles, which decode the most per
        stage; two for 32-token tiles and for every fused CTA, whose epilogue warps then complete
        the last group of four; one otherwise (notes/gemm.md, notes/layer.md); none with the
        activation image, except with mma 2, whose four decoder warps decode the weights."""
        if self.mma == 2:
            return 4
        if self.image:
            return 0
        if self.max_frags >= 8 and self.mode == "plain":
            return 3
        return 2 if self.max_frags >= 4 or self.mode != "plain" else 1

    @property
    def epilogue_warps(self) -> int:
        """The fused modes' epilogue warps fill the CTA's last group of four warps (ptxas budgets
        registers for whole groups, so a fifth group would cut every thread's registers). None on
        image tiles: the plain epilogue, or SwiGLU in the consumers' registers (swiglu_regs)."""
        if self.mode == "plain" or self.image:
            return 0
        rest = (self.warps + 1 + self.decoder_warps) % 4
        return 4 - rest if rest else 2

    @property
    def swiglu_regs(self) -> bool:
        """The kernel's SWIGLU_REGS: w13's SwiGLU + quantize epilogue in the consumers' registers, on
        a producer-warpgroup image tile with NVFP4 activations (gemm/epilogue.cuh, swiglu_regs)."""
        return self.mode == "swiglu" and self.wide and self.act == "nvfp4"

    @property
    def builders(self) -> bool:
        """Config::BUILDERS can be asked of this tile: a register-A image tile with a producer
        warpgroup, whose three idle warps write the activation image inside the GEMM
        (gemm/act_image.cuh, image_builders) instead of a pre-pass kernel before it."""
        return self.image and self.mma == 1 and self.producer_warps == 4

    @property
    def paired_stages(self) -> bool:
        """Config::NS == 2: an image tile past 64 tokens with an even ring takes its stages in
        pairs (one drain of the wgmma groups per two stages), so K holds K_STEP chunks in pairs."""
        return self.image and self.stages % 2 == 0 and self.max_frags > 8

    @property
    def expression(self) -> str:
        return self.expression_for(read_only=False)

    def expression_for(self, read_only: bool, counts_in: bool = False, bf16_out: bool = False,
                       builders: bool = False) -> str:
        """The kernel's instantiation; `counts_in`: the one that takes a size class of experts
        (grouped_gemm's counts_in), a separate compile so the others keep their code; `bf16_out`:
        a register-A image tile's bf16 output (BF16_OUT), likewise; `builders`: the image written
        inside the launch (BUILDERS, where `self.builders` allows it)."""
        if builders and not self.builders:
            raise ValueError(f"builders: the in-kernel image needs a register-A image tile with a producer "
                             f"warpgroup, got {self}")
        b = {True: "true", False: "false"}
        tail = ", true" if bf16_out and self.mma == 1 else ""  # (the MMA = 2 tile chooses at run time)
        if builders:
            tail = f", {b[bool(bf16_out)]}, true"
        return (f"lab_gemm::grouped_gemm_nvfp4<{self.warps}, {self.row_tiles}, {self.k_step}, {self.stages}, "
                f"{self.max_frags}, {self.mma}, {self.decoder_warps}, {self.epilogue_warps}, "
                f"lab_gemm::Mode::{self.mode}, lab_gemm::Act::{self.act}, {b[bool(read_only)]}, {b[bool(counts_in)]}"
                f"{tail}>")


    @property
    def smem_bytes(self) -> int:
        """Config<>::SMEM in grouped_gemm.cu."""
        ksteps, tokens = self.k_step // 16, self.token_tile
        stage_w = self.stage_bytes
        stage_xq = 0 if self.image else tokens * (self.k_step // 2) if self.act == "nvfp4" else tokens * self.k_step * 2
        stage_xs = tokens * (self.k_step // 16) if self.act == "nvfp4" and not self.image else 0
        xf = self.max_frags * ksteps * 32 * 8
        stage_wb = self.block_rows * self.k_step * 2 if self.mma == 2 else 0
        dstages = 2 if self.mma == 2 else 0  # Config::DSTAGES, decoded weight stages
        off_w = 128 * (((3 * self.stages + 2 + 2 * dstages) * 8 + 127) // 128)
        off_xs = off_w + self.stages * (stage_w + stage_xq)
        off_xf = 16 * ((off_xs + self.stages * stage_xs + 15) // 16)
        off_wb = 128 * ((off_xf + self.stages * xf + 127) // 128) if stage_wb else off_xf + self.stages * xf
        off_h = 16 * ((off_wb + dstages * stage_wb + 15) // 16)
        return off_h + (tokens * (self.block_rows + 4) * 4 if self.epilogue_warps else 0)

    def launch_smem(self, experts: int) -> int:
        """Dynamic shared memory of a launch: the pipeline plus the compacted expert list (and on
        image tiles the prefix sums of their split units, as long)."""
        return self.smem_bytes + (2 if self.image else 1) * 16 * ((4 * experts + 15) // 16)

    @property
    def stage_bytes(self) -> int:
        """Weight bytes of one pipeline stage (Config<>::STAGE_W): block_rows x k_step."""
        return self.warps * self.row_tiles * (self.k_step // ATOM_K) * ATOM_BYTES

    @property
    def bytes_in_flight(self) -> int:
        """Weight bytes one CTA keeps requested ahead of its consumers."""
        return self.stages * self.stage_bytes

    def validate(self, n: int | None = None, k: int | None = None) -> "GemmConfig":
        if self.mode not in MODES or (self.mode != "plain" and self.block_rows % 32):
            raise ValueError(f"mode must be one of {MODES} (a fused mode with a block of a multiple of 32 rows), "
                             f"got mode={self.mode!r}, block_rows={self.block_rows}")
        if self.act not in ACTS:
            raise ValueError(f"act must be one of {ACTS}, got {self.act!r}")
        if self.mma not in (0, 1, 2) or (self.mma and self.warps % 4):
            raise ValueError(f"mma must be 0 (mma.sync), 1 or 2 (wgmma, warps a multiple of 4), got {self.mma} "
                             f"with {self.warps} warps")
        if self.mma == 2 and (not self.image or self.mode != "plain" or (self.warps, self.row_tiles, self.max_frags)
                              != (8, 2, 8)):
            raise ValueError(f"mma=2 (weights decoded into shared memory) needs image=True, mode='plain', 8 warps, "
                             f"2 row tiles and max_frags 8, got image={self.image}, mode={self.mode!r}, "
                             f"warps={self.warps}, row_tiles={self.row_tiles}, max_frags={self.max_frags}")
        if self.image and (self.mma == 0 or (self.mode != "plain" and not self.swiglu_regs)):
            raise ValueError(f"image: the activation image needs wgmma (mma=1 or 2) and the plain epilogue (or swiglu "
                             f"on a producer-warpgroup tile with NVFP4 activations), got mma={self.mma}, "
                             f"mode={self.mode!r}")
        if self.build_image and not (self.image and self.mma == 1 and self.warps == 8 and self.mode == "plain"):
            raise ValueError(f"build_image: the in-kernel image on an image tile of 8 wgmma warps (mma=1) with the "
                             f"plain epilogue, got image={self.image}, mma={self.mma}, warps={self.warps}, "
                             f"mode={self.mode!r}")
        if self.k_step not in (64, 128, 256):
            raise ValueError(f"k_step must be 64, 128 or 256, got {self.k_step}")
        large = self.max_frags in LARGE_FRAGS and self.mma == 1 and (self.mode == "plain" or self.swiglu_regs)
        if self.max_frags not in MAX_FRAGS_CHOICES and not large:
            raise ValueError(f"max_frags must be one of {MAX_FRAGS_CHOICES}, or {LARGE_FRAGS} with wgmma (mma=1) "
                             f"and the plain epilogue, got {self.max_frags} (mma={self.mma}, mode={self.mode!r})")
        if not 1 <= self.warps <= 16 or self.row_tiles not in (1, 2, 4):
            raise ValueError(f"warps in 1..16 and row_tiles in (1, 2, 4), got {self.warps}, {self.row_tiles}")
        if self.ctas_per_sm < 0:
            raise ValueError(f"ctas_per_sm must be >= 0 (0: as many as fit), got {self.ctas_per_sm}")
        if not 2 <= self.stages <= 12:
            raise ValueError(f"stages must be 2..12, got {self.stages}")
        if self.warps * self.row_tiles > 32:
            raise ValueError("warps * row_tiles must be at most 32 (one producer lane per row tile)")
        try:
            tensor_map.stage_geometry(self.stage_bytes)
        except ValueError as e:
            raise ValueError(f"{self}: {e}") from None
        if self.smem_bytes + 4096 > SMEM_LIMIT:
            raise ValueError(f"{self}: needs {self.smem_bytes} B of shared memory, limit {SMEM_LIMIT}")
        if n is not None and n % self.block_rows:
            raise ValueError(f"N={n} is not a multiple of the block's {self.block_rows} rows ({self})")
        if n is not None and n // self.block_rows >= 1 << 15:  # the unit ring packs the row block in 15 bits
            raise ValueError(f"N={n} has {n // self.block_rows} row blocks of {self.block_rows}; at most {(1 << 15) - 1}")
        if k is not None and k % self.k_step:
            raise ValueError(f"K={k} is not a multiple of k_step={self.k_step} ({self})")
        if k is not None and self.paired_stages and k % (2 * self.k_step):
            # an image tile with an even ring takes its stages in pairs (grouped_gemm.cu, Config::NS)
            raise ValueError(f"K={k}: an image tile with {self.stages} stages takes K_STEP chunks in pairs; "
                             f"K must be a multiple of {2 * self.k_step} ({self})")
        return self


SM_SMEM = 228 * 1024  # shared memory per SM (H100/H200)
SM_REGS = 65536
SM_THREADS = 2048
SMEM_PER_CTA_RESERVED = 1024  # the runtime's per-block reservation


def resident_ctas(cfg: GemmConfig, experts: int, registers: int) -> int:
    """CTAs of `cfg` that fit on one SM at once (shared memory, registers, threads)."""
    by_smem = SM_SMEM // (cfg.launch_smem(experts) + SMEM_PER_CTA_RESERVED)
    regs_per_warp = 256 * -(-registers * 32 // 256)
    by_regs = SM_REGS // (regs_per_warp * (cfg.threads // 32))
    fit = max(1, min(by_smem, by_regs, SM_THREADS // cfg.threads))
    return min(fit, cfg.ctas_per_sm) if cfg.ctas_per_sm else fit


def frags_for(max_count: int) -> int:
    """Smallest compiled fragment count covering `max_count` tokens in one pass (capped at 8)."""
    need = max(1, -(-int(max_count) // 8))
    return next((f for f in MAX_FRAGS_CHOICES if f >= need), MAX_FRAGS_CHOICES[-1])


# The token-tile model (notes/gemm-log.md v20). One pass of a unit (an expert's row block) with token
# tile 8 * max_frags costs max(floor, a + b * F) times reading its weights at the flat-read rate, F
# the 8-token fragments the pass holds: (floor, a, b) per max_frags, fitted to bench_gemm on the H200
# at the study's shape (uniform means 2-32 at 927f4c5: 97% at 2 and 89-90% at 8 for the 8- and
# 16-token tiles, 57-59% at 32 for the 64-token one; mean 8 at skew 0.4 and 1.2, every tile, and
# the 64-token tile at 128-512 tokens, at 5d03f04-927f4c5).
PASS_COST = {1: (1.03, 1.03, 0.0), 2: (1.03, 0.93, 0.10), 4: (1.20, 1.00, 0.135), 8: (1.40, 0.50, 0.26)}
# Units are claimed in expert order and the hot experts sit anywhere in it: this share of the
# longest unit's time (at one CTA's share of the machine) is added as its tail (skew 1.2: 16-token
# tile 60.5% measured, 70% without the tail).
TAIL_SHARE = 0.15
# The model moves the heuristic off the percentile rule only for skewed routing (active counts whose
# variance exceeds SKEWED_DISPERSION times their mean: a uniform router's are near-binomial, at most
# 1.4 over the lab's model shapes and means 1-2048; skew 0.4 at mean 8 gives 3.5) and only for a
# predicted gain of at least MODEL_MARGIN: it is fitted to a few runs, and uniform routings keep the
# tiles their results were measured with.
SKEWED_DISPERSION = 2.0
MODEL_MARGIN = 0.05
MODEL_SMS = 132  # H200


def modelled_time(counts, max_frags: int, row_blocks: int, ctas_per_sm: int) -> float:
    """The token-tile model's time for one grouped GEMM over `counts`, in units of reading every
    active expert's weights once at the flat-read rate (1.0: at the roofline)."""
    active = np.asarray(counts)
    active = active[active > 0].astype(np.int64)
    if not active.size:
        return 1.0
    floor, a, b = PASS_COST[max_frags]
    tile = 8 * max_frags
    full, rest = np.divmod(active, tile)
    unit = full * max(floor, a + b * max_frags) + np.where(rest > 0, np.maximum(floor, a + b * ((rest + 7) // 8)), 0.0)
    tail = ctas_per_sm * MODEL_SMS / row_blocks * unit.max()
    return (max(unit.sum(), tail) + TAIL_SHARE * tail) / active.size


def heuristic(n: int, k: int, counts, layout: tuple[int, int] | None = None, act: str = "nvfp4",
              wgmma: bool = True) -> GemmConfig:
    """Default tile for a problem whose weights were prepared with `layout` (default
    `default_layout`): a token tile that holds the routine expert in one pass (or, where the
    token-tile model predicts a clear gain under skewed routing, the tile it prefers), four (or
    two) 16-row tiles per warp, and stages for ~80 KB of weights in flight per CTA. `wgmma=False`
    keeps to mma.sync tiles (64 tokens at most): gemm_plan's W4A16 splits, whose k16 sums round and
    so may differ between the two instruction families."""
    block_rows, k_step = layout or default_layout(n, k)
    counts = np.asarray(counts)
    active = counts[counts > 0]
    # Cover the 99th percentile in one pass; rarer, larger experts take a second pass...
    q = int(np.ceil(np.quantile(active, 0.99))) if active.size else 8
    frags = frags_for(q)
    # ...unless the routing is skewed and the model predicts another tile clearly faster: there a
    # few hot experts set the percentile, and a larger tile slows every pass of the others.
    if active.size and active.var() > SKEWED_DISPERSION * active.mean():
        t = {f: modelled_time(counts, f, n // block_rows, 2 if f <= 2 else 1) for f in MAX_FRAGS_CHOICES}
        best = min(t, key=t.get)
        if t[best] < (1 - MODEL_MARGIN) * t[frags]:
            frags = best
    # Past 64 tokens an image tile of 256 rows: 96 tokens up to 96, else 160 (bench_gemm at d01e6e5:
    # the 96-token tile 8-29% faster than the 64-token one at 64-512; at 37501c1, one process, the
    # 160-token tile 1.33-1.35x faster than the 96-token one at mean 128, 1.13-1.16x at 256 and
    # 1.03-1.20x at 512, and 1.01-1.16x faster than the 128-token one; 128 rows x 128 tokens loses
    # to all)
    if frags == MAX_FRAGS_CHOICES[-1] and q > 8 * frags:
        frags = next((f for f in IMAGE_FRAGS if 8 * f >= q), IMAGE_FRAGS[-1])
    tiles = block_rows // ATOM_ROWS
    # Four 16-row tiles per warp share each B fragment and give each warp four independent
    # decode+MMA chains, best for token tiles of 8-16; with 32-64 token tiles the accumulators
    # crowd the registers and two tiles per warp win (notes/gemm.md, the tile study).
    row_tiles = 4 if frags <= 2 and tiles % 4 == 0 else (2 if tiles % 2 == 0 and tiles >= 4 else 1)
    warps = tiles // row_tiles
    stage_w = tiles * (k_step // ATOM_K) * ATOM_BYTES
    if frags <= 2:
        # ~54 KB of weights in flight per CTA and two CTAs per SM (a third would fit, and loses);
        # larger tiles keep ~80 KB per CTA, one CTA per SM (notes/gemm.md, stages).
        stages, cap = max(2, min(8, (54 * 1024) // stage_w)), 2
    else:
        stages, cap = max(3, min(8, (80 * 1024) // stage_w)), 0
    # 64-token tiles: wgmma, one commit group per k atom; smaller tiles stay on mma.sync, which
    # wgmma did not beat there (notes/gemm-log.md v9-v12).
    mma = 1 if frags >= 8 and warps % 4 == 0 and wgmma else 0
    image = mma == 1
    if frags > 8 and (not image or warps != 8 or row_tiles != 2):
        frags = 8
    # wgmma tiles read the activation image: no decoder warps, the decode once per launch instead
    # of once per row block (bench_gemm at d01e6e5, 64-token tile: 2-3% faster with NVFP4
    # activations at mean 32, 12% with bf16; 8-16% at 64-512)
    cfg = GemmConfig(warps, row_tiles, k_step, stages, frags, mma, ctas_per_sm=cap, act=act, image=image)
    while cfg.smem_bytes + 4096 > SMEM_LIMIT and cfg.stages > 2:
        cfg = replace(cfg, stages=cfg.stages - 1)
    if cfg.paired_stages and k % (2 * k_step):  # paired stages need K in pairs of chunks
        cfg = replace(cfg, max_frags=8, stages=stages)
    return cfg.validate(n, k)


ALL_COUNTS = (1, 2**31 - 1)  # grouped_gemm's counts_in for every expert with tokens


def counts_range(counts_in) -> tuple[int, int]:
    """`counts_in` as the kernels take it: (lo, hi), the experts of lo..hi tokens; None: every
    expert with tokens (ALL_COUNTS)."""
    if counts_in is None:
        return ALL_COUNTS
    try:
        lo, hi = (int(v) for v in counts_in)
        ok = all(float(v) == int(v) for v in counts_in)
    except (TypeError, ValueError):
        ok = False
    if not ok or not 1 <= lo <= hi <= ALL_COUNTS[1]:
        raise ValueError(f"counts_in: expected (lo, hi), integers with 1 <= lo <= hi < 2**31, got {counts_in!r}")
    return lo, hi


# Skewed routing on a mma.sync tile runs as two launches (gemm_plan): the experts of up to
# SPLIT_AT tokens on the 16-token tile, the others on theirs (bench_gemm --split at mean 8, 2eab60f
# and 9d76701: the split at 16 beat the one launch by 1.13-1.18x at skew 1.2 and 1.08-1.12x at 0.8;
# at 32 and 64 by less; with the hot experts on the 64-token mma.sync tile instead of the
# 160-token image tile only 1.04-1.10x; three or four classes lost to two, notes/gemm-log.md v26).
SPLIT_AT = 16


def split_configs(n: int, k: int, counts, hot_from, layout: tuple[int, int] | None = None,
                  act: str = "nvfp4", wgmma: bool = True) -> list[tuple[GemmConfig, tuple[int, int]]]:
    """One grouped GEMM as launches by expert size (skewed routing): `hot_from`, one bound or an
    increasing sequence b1 < b2 < ..., cuts the counts into classes 1..b1, b1+1..b2, ..., past
    the last; each class runs the heuristic's tile for its counts (an image tile once they pass
    64, unless `wgmma` is False), as (config, grouped_gemm's counts_in). Empty classes get no
    launch."""
    counts = np.asarray(counts)
    bounds = [hot_from] if np.isscalar(hot_from) else list(hot_from)
    try:
        ints = [int(b) for b in bounds]
        ok = (bool(ints) and all(isinstance(b, (int, float, np.number)) and float(b) == i for b, i in zip(bounds, ints))
              and ints[0] >= 1 and all(a < b for a, b in zip(ints, ints[1:])))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"hot_from: expected an integer >= 1 or increasing integers >= 1, got {hot_from!r}")
    edges = [0] + ints + [ALL_COUNTS[1]]
    plan = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        mine = np.where((counts > lo) & (counts <= hi), counts, 0)
        if mine.any():
            plan.append((heuristic(n, k, mine, layout, act, wgmma), (lo + 1, hi)))
    return plan


def gemm_plan(n: int, k: int, counts, layout: tuple[int, int] | None = None,
              act: str = "nvfp4") -> tuple[tuple[GemmConfig, tuple[int, int]], ...]:
    """The launches of one grouped GEMM, as (config, counts_in): the heuristic's tile over every
    expert, or, for skewed routing whose one launch is a mma.sync tile, with experts on both sides
    of SPLIT_AT, split_configs' two launches at SPLIT_AT. With NVFP4 activations that includes the
    16-token tile (hot experts of 17-45 tokens at skew 0.4 each took up to three passes; their
    class on the image tile beside the rest on two streams is 4% faster, notes/gemm-log.md v26); with
    bf16 ones only tiles past 16 tokens (measured there).
    Every tile writes the same bits: the 16 products of a k16 step share one pair of block scales,
    each being an e2m1 x e2m1 product (a multiple of 1/4, at most 36) times that pair, so their sum
    has at most ~20 significant bits and is exact in fp32 in any order; mma.sync and wgmma differ
    only in that order, and both add each step's sum into the accumulator in K order (W4A4; checked
    on the H200 by test_split_launches_write_their_experts_as_their_tiles_do). With bf16
    activations (W4A16) the sums round, so there the split keeps to mma.sync tiles, the one
    launch's family."""
    cfg = heuristic(n, k, counts, layout, act)
    active = np.asarray(counts)
    active = active[active > 0]
    if (cfg.mma == 0 and (cfg.max_frags > 2 or act == "nvfp4") and active.size and active.var() > SKEWED_DISPERSION * active.mean()
            and (active <= SPLIT_AT).any() and (active > SPLIT_AT).any()):
        return tuple(split_configs(n, k, counts, SPLIT_AT, layout, act, wgmma=act == "nvfp4"))
    return ((cfg, ALL_COUNTS),)


def plan_record(plan) -> list[dict]:
    """A plan (gemm_plan's (config, counts_in) pairs) as JSON: each launch's config fields and
    its size class [lo, hi] (hi 2**31 - 1: no upper bound)."""
    return [{"config": dict(cfg.__dict__), "counts_in": [int(lo), int(hi)]} for cfg, (lo, hi) in plan]


SHIPPED_CONFIGS = tuple(
    GemmConfig(w, r, ks, st, f, mma)
    for (w, r, ks, st, mma) in ((4, 4, 128, 3, 0), (4, 4, 128, 4, 0), (8, 2, 128, 4, 0), (8, 2, 128, 3, 0),
                                (4, 2, 128, 6, 0), (8, 2, 256, 2, 0), (8, 2, 64, 8, 0), (4, 4, 128, 4, 1),
                                (8, 2, 128, 4, 1))
    for f in MAX_FRAGS_CHOICES)


# Fused tiles of 8-16 tokens take at least four stages where the plain ones take three: faster
# for fused-layer, slower for the plain GEMMs (notes/layer-log.md v16).
FUSED_SMALL_STAGES = 4
# Shared memory the compacted expert list may take beside a small fused tile's pipeline when
# two CTAs share an SM: up to 512 experts (launch_smem).
FUSED_EXPERT_LIST = 4 * 512


@functools.lru_cache(maxsize=None)
def fused_config(cfg: GemmConfig, mode: str) -> GemmConfig:
    """`cfg` in a fused mode: one to three more warps and the h tile in shared memory (a stage
    fewer wherever the two would not fit), and for tiles of up to 16 tokens at least
    FUSED_SMALL_STAGES stages. The fused epilogues hold at most 64 tokens and read decoded
    activations from their decoder warps, so a large or image tile fuses as the 64-token one;
    but the producer-warpgroup tiles take w13's SwiGLU (NVFP4) in their consumers' registers, as
    they are. Cached: launchers ask on every launch."""
    if mode == "swiglu" and replace(cfg, mode=mode).swiglu_regs:
        return replace(cfg, mode=mode).validate()  # SwiGLU in the consumers' registers, on the image
    fused = replace(cfg, mode=mode, image=False, build_image=False, max_frags=min(cfg.max_frags, 8))
    if cfg.image:  # (as from the 64- and 96-token image tiles: the 160-token one has 3 stages)
        fused = replace(fused, stages=max(fused.stages, 4))
    if cfg.max_frags <= 2:
        fused = replace(fused, stages=max(fused.stages, FUSED_SMALL_STAGES))
        # ...but two CTAs per SM, as the plain tile runs: bf16 activation stages (W4A16) are 3.5x
        # the NVFP4 ones, and at four stages only one CTA fits (ncu at mean 8: the fused W4A16 w13
        # launch 0.82 ms, the W4A4 one 0.69; notes/gemm.md, W4A16)
        while fused.stages > cfg.stages and 2 * (fused.smem_bytes + FUSED_EXPERT_LIST + SMEM_PER_CTA_RESERVED) > SM_SMEM:
            fused = replace(fused, stages=fused.stages - 1)
    while fused.smem_bytes + 4096 > SMEM_LIMIT and fused.stages > 2:
        fused = replace(fused, stages=fused.stages - 1)
    return fused.validate()


# W4A16 (bf16 activations): the heuristic's tiles of the study's two GEMMs, as for NVFP4 ones.
SHIPPED_W4A16 = tuple(dict.fromkeys(heuristic(n, k, [8 * f] * 4, act="bf16")
                                    for f in MAX_FRAGS_CHOICES for n, k in ((4096, 4096), (4096, 2048))))


# 128-token tiles that compile without spills (one row tile per warp with 8 warps, or two with
# 4): for the large-token GEMM, timed through bench_gemm --config, not picked by the heuristic.
SHIPPED_LARGE = (GemmConfig(8, 1, 128, 4, 16, 1), GemmConfig(4, 2, 128, 4, 16, 1))


# Tiles on the activation image (no decoder warps) that compile without spills, for the large-token
# GEMM: 256 rows x 64 or 96 tokens (9 warps, 168 registers at most), 128 x 128, and 256 x 128 or 160
# (a producer warpgroup and setmaxnreg: 224 registers per consumer thread; 160 tokens fit 3 stages).
SHIPPED_IMAGE = tuple(GemmConfig(w, r, 128, st, f, 1, act=act, image=True)
                      for (w, r, f, st) in ((8, 2, 8, 4), (8, 2, 12, 4), (8, 1, 16, 4), (4, 2, 16, 4), (8, 2, 16, 4),
                                            (8, 2, 20, 3))
                      for act in ACTS)


# The tile with the weights decoded into shared memory (mma 2): 256 rows x 64 tokens, k_step 64,
# eight raw stages (72 KB of weights in flight) and two decoded ones (205 KB in all). Timed
# through bench_gemm --config 8,2,64,8,2,0,8,1; not picked by the heuristic.
SHIPPED_SS = tuple(GemmConfig(8, 2, 64, 8, 8, 2, act=act, image=True) for act in ACTS)

# The fused instantiations the heuristic's tiles lead to (four row tiles per warp up to 16 tokens).
SHIPPED_FUSED = tuple(fused_config(heuristic(4096, 4096, [8 * f] * 4), mode)
                      for f in MAX_FRAGS_CHOICES for mode in ("swiglu", "layer")) + (
    fused_config(heuristic(4096, 4096, [150] * 4), "swiglu"),)  # (the 160-token tile, swiglu_regs)
SHIPPED_FUSED_W4A16 = tuple(fused_config(heuristic(4096, 4096, [8 * f] * 4, act="bf16"), mode)
                            for f in MAX_FRAGS_CHOICES for mode in ("swiglu", "layer"))

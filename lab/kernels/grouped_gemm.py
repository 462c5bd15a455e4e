"""NVFP4 x NVFP4 block-scaled grouped GEMM (source: grouped_gemm.cu).

    out[r, n] = alpha[e] * sum_k (e2m1 x e4m3)(x)[r, k] * (e2m1 x e4m3)(w)[e, n, k]
                for offsets[e] <= r < offsets[e+1]

Shapes and dtypes (all CuPy arrays on the launch's device):
    x_packed   (T, K/2)  uint8   activation codes, even element in the low nibble
    x_scales   (T, K/16) uint8   activation e4m3 block scales (raw bits)
    offsets    (E+1,)    int32   rows of expert e are offsets[e]:offsets[e+1]; offsets[E] == T
    alpha      (E,)      float32 per-expert factor (activation global x weight global, or what
                                 the caller wants; the globals are not applied otherwise)
    weights    PreparedWeights   from `prepare_weights` (E, N, K) NVFP4 in the kernel's layout
    out        (T, N)    float32 every row of every expert with tokens is written

This module holds the kernel's contract: the weight layout and its preparation (NumPy or CuPy,
same code), the tile configuration and its heuristic (plain Python, testable without a GPU),
shared-memory sizing, and the checked launch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import numpy as np

from lab.kernels import jit, tensor_map

SOURCE = "grouped_gemm.cu"
ATOM_ROWS = 16  # mma M
ATOM_K = 64  # four k16 steps: one 16-byte load of codes per lane
ATOM_CODE_BYTES = 512
ATOM_BYTES = 576  # codes + 64 bytes of e4m3 scales
SMEM_LIMIT = 227 * 1024  # H200 opt-in dynamic shared memory per block
MAX_FRAGS_CHOICES = (1, 2, 4, 8)  # 8-token fragments per pass, compiled variants

# MMA k slot -> k within a 16-element block. The kernel decodes a raw activation word (codes of
# k = 0..7) into fp16x2 registers holding k = (a, a + 4), the pair 16 bits apart in the word, for
# two shifts and two LOP3 per register (decode_x in grouped_gemm.cu); that register fills slots
# 2a, 2a+1. The weights are prepared in the same slot order, and the scale is per block, so the
# product is unchanged. Slots 8..15 repeat the pattern on k = 8..15.
K_SLOTS = np.array([0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15])


# ---------------------------------------------------------------------------------------------
# Weight layout: the GF(2) code words the kernel's decode_a() reads
# ---------------------------------------------------------------------------------------------

DECODE_MASK = 0x8E008E00  # fp16x2 sign (15, 31) and e2m1 exponent+mantissa (9..11, 25..27)
_TARGET_BITS = [b for b in range(32) if DECODE_MASK >> b & 1]


def _shl(w, s):
    return (w << s) & 0xFFFFFFFF


def decode_words(words):
    """The kernel's decode_a(): a uint32 word -> four fp16x2 words (u32) holding v * 2^-14."""
    w = np.asarray(words, dtype=np.uint64)
    m = np.uint64(DECODE_MASK)
    full = np.uint64(0xFFFFFFFF)
    p0 = ((w << np.uint64(6)) & full) & m
    p1 = ((w << np.uint64(9)) & full) & m
    p2 = (w ^ ((w << np.uint64(2)) & full)) & m
    p3 = (w ^ (w >> np.uint64(3))) & m
    return [p.astype(np.uint32) for p in (p0, p1, p2, p3)]


def _decode_rows() -> list[int]:
    """Rows of the GF(2) matrix D: payload bit 8q+i = XOR of the word bits in row (8q+i).

    Payload byte q is the NVFP4 byte (low code, high code) of fp16x2 register q: code bit i
    (i = 0..3: mantissa, exponent lo, exponent hi, sign) lands on target bit i of each half.
    """
    rows = []
    for q in range(4):
        for i in range(8):
            pos = _TARGET_BITS[[0, 1, 2, 3, 4, 5, 6, 7][i]]
            unit = [0] * 32
            sources = {0: [pos - 6], 1: [pos - 9], 2: [pos, pos - 2], 3: [pos, pos + 3]}[q]
            mask = 0
            for src in sources:
                if 0 <= src < 32:
                    mask ^= 1 << src
            rows.append(mask)
            del unit
    # payload bit index within byte q: low code bits 0..3 -> target bits 9,10,11,15;
    # high code bits 4..7 -> 25,26,27,31 (that is _TARGET_BITS order).
    return rows


def _invert_gf2(rows: list[int]) -> list[int]:
    """Inverse of a 32x32 GF(2) matrix given as row bitmasks; raises if singular."""
    n = 32
    a = list(rows)
    inv = [1 << i for i in range(n)]
    for col in range(n):
        piv = next((r for r in range(col, n) if a[r] >> col & 1), None)
        if piv is None:
            raise ValueError("decode map is singular")
        a[col], a[piv] = a[piv], a[col]
        inv[col], inv[piv] = inv[piv], inv[col]
        for r in range(n):
            if r != col and a[r] >> col & 1:
                a[r] ^= a[col]
                inv[r] ^= inv[col]
    return inv


def _encode_tables() -> np.ndarray:
    """(4, 256) uint32: word = T[0][byte0] ^ T[1][byte1] ^ T[2][byte2] ^ T[3][byte3]."""
    d = _decode_rows()
    e_rows = _invert_gf2(d)  # word bit j = parity(e_rows[j] & payload)
    tables = np.zeros((4, 256), dtype=np.uint32)
    for q in range(4):
        for v in range(256):
            payload = v << (8 * q)
            word = 0
            for j in range(32):
                if bin(e_rows[j] & payload).count("1") & 1:
                    word |= 1 << j
            tables[q, v] = word
    return tables


ENCODE_TABLES = _encode_tables()


@dataclass
class PreparedWeights:
    """(E, N, K) NVFP4 weights in the kernel's layout: `data` is
    (E, N/block_rows, K/k_step, block_rows/16, k_step/64, 576) uint8, so that one pipeline stage
    (block_rows x k_step of one expert) is one contiguous run: a single TMA tensor copy, through
    the map `tensor_map.device_map` makes (at preparation, when `data` is on the GPU)."""

    data: object  # numpy or cupy uint8 array
    experts: int
    n: int
    k: int
    block_rows: int
    k_step: int
    pair_gate_up: bool = False  # rows reordered by pair_gate_up_rows (the fused SwiGLU epilogue)

    @property
    def stage_bytes(self) -> int:
        """One pipeline stage: block_rows x k_step of one expert."""
        return (self.block_rows // ATOM_ROWS) * (self.k_step // ATOM_K) * ATOM_BYTES

    def experts_slice(self, e0: int, e1: int) -> "PreparedWeights":
        """A view of experts e0..e1-1 (no copy; on the GPU its tensor map is made now, so that
        launches on it may be captured into graphs)."""
        part = PreparedWeights(self.data[e0:e1], e1 - e0, self.n, self.k, self.block_rows, self.k_step,
                               self.pair_gate_up)
        _make_map(part)
        return part


def _make_map(prep: PreparedWeights) -> None:
    if not isinstance(prep.data, np.ndarray) and prep.experts:
        tensor_map.device_map(prep.data, prep.stage_bytes)


def pair_gate_up_rows(a, block_rows: int, xp=np):
    """w13 rows [gate (I rows); up (I rows)] -> each block of `block_rows` rows holds gate rows
    c..c+block_rows/2 then up rows c..c+block_rows/2 (c = block * block_rows/2), so that the CTA
    computing a block has both halves of the same SwiGLU columns. `a` is (E, 2I, ...)."""
    e, n2 = a.shape[:2]
    half = block_rows // 2
    if n2 % 2 or block_rows % 32 or (n2 // 2) % half:
        raise ValueError(f"pair_gate_up: 2I={n2} rows must split into gate and up halves that are multiples "
                         f"of block_rows/2={half} (block_rows a multiple of 32)")
    rest = a.shape[2:]
    v = a.reshape((e, 2, n2 // 2 // half, half) + rest)
    return xp.ascontiguousarray(v.swapaxes(1, 2)).reshape((e, n2) + rest)


def unpair_gate_up_rows(a, block_rows: int, xp=np):
    """Inverse of pair_gate_up_rows."""
    e, n2 = a.shape[:2]
    half = block_rows // 2
    rest = a.shape[2:]
    v = a.reshape((e, n2 // 2 // half, 2, half) + rest)
    return xp.ascontiguousarray(v.swapaxes(1, 2)).reshape((e, n2) + rest)


def default_layout(n: int, k: int) -> tuple[int, int]:
    """(block_rows, k_step) the heuristic uses for an (N, K) weight: the widest block of rows
    that divides N (256 = 8 warps x 2 tiles), and k_step 128 (else 64 or 256) dividing K."""
    block_rows = next((b for b in (256, 128, 64) if n % b == 0), None)
    if block_rows is None:
        raise ValueError(f"N={n} must be a multiple of 64")
    k_step = next((s for s in (128, 64, 256) if k % s == 0), None)
    if k_step is None:
        raise ValueError(f"K={k} must be a multiple of 64")
    return block_rows, k_step


def permute_k(packed, order, xp=np):
    """(..., K/2) packed codes -> the same with each 16-element block's codes reordered:
    out[16b + i] = in[16b + order[i]] (in code units)."""
    codes = xp.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[:-1] + (-1, 16))
    codes = codes[..., xp.asarray(order)].reshape(packed.shape[:-1] + (-1, 2))
    return (codes[..., 0] | (codes[..., 1] << 4)).astype(xp.uint8)


def decode_x_words(words):
    """The kernel's decode_x<a>() for a = 0..3: raw uint32 words (codes of k = 0..7) -> four
    fp16x2 words (u32) holding v * 2^-14 of k = a (low half) and k = a + 4 (high half)."""
    w = np.asarray(words, dtype=np.uint64)
    full = np.uint64(0xFFFFFFFF)

    def sh(x, n):
        return ((x << np.uint64(n)) & full) if n >= 0 else (x >> np.uint64(-n))

    return [((sh(w, 9 - 4 * a) & np.uint64(0x0E000E00)) | (sh(w, 12 - 4 * a) & np.uint64(0x80008000))).astype(
        np.uint32) for a in range(4)]


def check_weight_shapes(packed, scales) -> tuple[int, int, int]:
    if packed.ndim != 3 or packed.dtype != np.uint8:
        raise ValueError(f"w_packed: expected (E, N, K/2) uint8, got {packed.shape} {packed.dtype}")
    e, n, k2 = packed.shape
    k = 2 * k2
    if scales.shape != (e, n, k // 16) or scales.dtype != np.uint8:
        raise ValueError(f"w_scales: expected ({e}, {n}, {k // 16}) uint8 (e4m3 bits), "
                         f"got {scales.shape} {scales.dtype}")
    if n % 64 or k % 64 or n == 0 or k == 0:
        raise ValueError(f"weights: N and K must be positive multiples of 64, got N={n}, K={k}")
    return e, n, k


def prepare_weights(packed, scales, xp=np, layout: tuple[int, int] | None = None,
                    chunk_experts: int = 8, pair_gate_up: bool = False) -> PreparedWeights:
    """Lay (E, N, K) NVFP4 weights out as the kernel's atoms; NumPy or CuPy (`xp`), same result.

    `layout` = (block_rows, k_step), default `default_layout(N, K)`; atoms are ordered
    [expert][row block][k chunk][16-row tile in block][k atom in chunk].
    `pair_gate_up`: w13 (N = 2I) for the fused SwiGLU epilogue: rows first reordered by
    `pair_gate_up_rows`, so each row block holds matching gate and up columns.

    Atom (expert e, row tile nt, k atom ka) = 576 bytes: lane L = 4g + t gets 16 bytes, word j
    (k16 step j) being the encoded bytes [W(g, 2t..), W(g+8, 2t..), W(g, 2t+8..), W(g+8, 2t+8..)]
    of that step, where column c of the step means k = K_SLOTS[c]; then 8 groups x 8 bytes of
    scales [s(g, j), s(g+8, j)] for j = 0..3.
    """
    e, n, k = check_weight_shapes(packed, scales)
    block_rows, k_step = layout or default_layout(n, k)
    if block_rows % ATOM_ROWS or n % block_rows or k_step % ATOM_K or k % k_step:
        raise ValueError(f"layout (block_rows={block_rows}, k_step={k_step}) must divide N={n}, K={k} "
                         f"in units of {ATOM_ROWS} rows and {ATOM_K} k")
    nt, ka = n // ATOM_ROWS, k // ATOM_K
    if pair_gate_up:
        packed, scales = (pair_gate_up_rows(xp.asarray(a), block_rows, xp) for a in (packed, scales))
    tables = xp.asarray(ENCODE_TABLES)
    atoms = xp.empty((chunk_experts, nt, ka, ATOM_BYTES), dtype=xp.uint8)
    nb, kc, tiles, katoms = n // block_rows, k // k_step, block_rows // ATOM_ROWS, k_step // ATOM_K
    out = xp.empty((e, nb, kc, tiles, katoms, ATOM_BYTES), dtype=xp.uint8)
    for e0 in range(0, e, chunk_experts):
        e1 = min(e, e0 + chunk_experts)
        m = e1 - e0
        p = permute_k(xp.asarray(packed[e0:e1]), K_SLOTS, xp)
        # byte index in a row = ka*32 + j*8 + qq*4 + t ; row = nt*16 + h*8 + g
        pv = p.reshape(m, nt, 2, 8, ka, 4, 2, 4)
        b = pv.transpose(0, 1, 4, 3, 7, 5, 6, 2).reshape(m, nt, ka, 32, 4, 4)  # [.., lane, j, q]
        words = (tables[0][b[..., 0]] ^ tables[1][b[..., 1]] ^ tables[2][b[..., 2]] ^ tables[3][b[..., 3]])
        atoms[:m, :, :, :ATOM_CODE_BYTES] = words.astype(xp.uint32).reshape(m, nt, ka, 32 * 4).view(
            xp.uint8).reshape(m, nt, ka, ATOM_CODE_BYTES)
        s = xp.asarray(scales[e0:e1]).reshape(m, nt, 2, 8, ka, 4)
        atoms[:m, :, :, ATOM_CODE_BYTES:] = s.transpose(0, 1, 4, 3, 5, 2).reshape(m, nt, ka, 64)
        out[e0:e1] = atoms[:m].reshape(m, nb, tiles, kc, katoms, ATOM_BYTES).transpose(0, 1, 3, 2, 4, 5)
    prep = PreparedWeights(out, e, n, k, block_rows, k_step, pair_gate_up)
    _make_map(prep)
    return prep


def unprepare_weights(prep: PreparedWeights) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of prepare_weights (NumPy): back to (E, N, K/2) codes and (E, N, K/16) scales."""
    data = np.asarray(prep.data if isinstance(prep.data, np.ndarray) else prep.data.get())
    e, n, k = prep.experts, prep.n, prep.k
    nt, ka = n // ATOM_ROWS, k // ATOM_K
    data = data.transpose(0, 1, 3, 2, 4, 5).reshape(e, nt, ka, ATOM_BYTES)  # back to [e][tile][k atom]
    words = data[..., :ATOM_CODE_BYTES].copy().view(np.uint32).reshape(e, nt, ka, 32, 4)
    regs = decode_words(words)  # four (e, nt, ka, 32, 4) fp16x2 words
    payload = np.stack([_regs_to_byte(r) for r in regs], axis=-1)  # [.., lane, j, q]
    b = payload.reshape(e, nt, ka, 8, 4, 4, 2, 2)  # [.., g, t, j, qq, h]
    packed = b.transpose(0, 1, 7, 3, 2, 5, 6, 4).reshape(e, n, k // 2)
    s = data[..., ATOM_CODE_BYTES:].reshape(e, nt, ka, 8, 4, 2)  # [.., g, j, h]
    scales = s.transpose(0, 1, 5, 3, 2, 4).reshape(e, n, k // 16)
    packed = permute_k(packed, np.argsort(K_SLOTS))
    if prep.pair_gate_up:
        packed, scales = (unpair_gate_up_rows(a, prep.block_rows) for a in (packed, scales))
    return np.ascontiguousarray(packed), np.ascontiguousarray(scales)


def _regs_to_byte(reg: np.ndarray) -> np.ndarray:
    """fp16x2 word with code bits on the target positions -> the NVFP4 byte (low, high code)."""
    r = reg.astype(np.uint32)
    byte = np.zeros(r.shape, dtype=np.uint32)
    for i, pos in enumerate(_TARGET_BITS):
        byte |= ((r >> np.uint32(pos)) & np.uint32(1)) << np.uint32(i)
    return byte.astype(np.uint8)


# ---------------------------------------------------------------------------------------------
# Tile configuration
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GemmConfig:
    """warps: consumer warps; row_tiles: 16-row tiles per warp; k_step: K per pipeline stage;
    stages: pipeline depth; max_frags: 8-token fragments held per pass (token tile = 8*max_frags);
    mma: 0 = mma.sync m16n8k16, 1 = wgmma m64n(8F)k16 (sm_90a, warps a multiple of 4);
    fuse: 0, FUSE_SWIGLU or FUSE_LAYER (the fused instantiations; see `fused_config`);
    ctas_per_sm: at most this many CTAs per SM in the persistent grid (0: as many as fit). Not a
    template argument: it only sizes the grid."""

    warps: int = 8
    row_tiles: int = 2
    k_step: int = 128
    stages: int = 4
    max_frags: int = 2
    mma: int = 0  # 0: mma.sync per 8-token fragment; 1: wgmma m64n(8F)k16 per warpgroup
    fuse: int = 0
    ctas_per_sm: int = 0

    @property
    def block_n(self) -> int:
        return self.warps * self.row_tiles * ATOM_ROWS

    @property
    def token_tile(self) -> int:
        return 8 * self.max_frags

    @property
    def threads(self) -> int:
        # consumers, producer, activation decoders, SwiGLU epilogue warps
        return (self.warps + 1 + self.decoder_warps + self.epilogue_warps) * 32

    @property
    def epilogue_warps(self) -> int:
        """Mirror of Config<>::EW: they fill the CTA's last group of four warps."""
        if not self.fuse & 1:
            return 0
        rest = (self.warps + 1 + self.decoder_warps) % 4
        return 4 - rest if rest else 2

    @property
    def decoder_warps(self) -> int:
        """Mirror of Config<>::DW."""
        return 3 if self.max_frags >= 8 and not self.fuse else 2 if self.max_frags >= 4 or self.fuse else 1

    @property
    def expression(self) -> str:
        return self.expression_for(read_only=False)

    def expression_for(self, read_only: bool) -> str:
        return (f"lab_gemm::grouped_gemm_nvfp4<{self.warps}, {self.row_tiles}, {self.k_step}, "
                f"{self.stages}, {self.max_frags}, {self.mma}, {'true' if read_only else 'false'}, {self.fuse}>")

    @property
    def smem_bytes(self) -> int:
        """Mirror of Config<>::SMEM in grouped_gemm.cu."""
        ksteps, tokens = self.k_step // 16, self.token_tile
        stage_w = self.stage_bytes
        stage_xq = tokens * (self.k_step // 2)
        stage_xs = tokens * (self.k_step // 16)
        xf = self.max_frags * ksteps * 32 * 8
        off_w = 128 * (((3 * self.stages + 2) * 8 + 127) // 128)
        off_xs = off_w + self.stages * (stage_w + stage_xq)
        off_xf = 16 * ((off_xs + self.stages * stage_xs + 15) // 16)
        off_h = 16 * ((off_xf + self.stages * xf + 15) // 16)
        return off_h + (tokens * (self.block_n + 4) * 4 if self.epilogue_warps else 0)

    def launch_smem(self, experts: int) -> int:
        """Dynamic shared memory of a launch: the pipeline plus the compacted expert list."""
        return self.smem_bytes + 16 * ((4 * experts + 15) // 16)

    @property
    def stage_bytes(self) -> int:
        """Weight bytes of one pipeline stage (Config<>::STAGE_W): block_n rows x k_step."""
        return self.warps * self.row_tiles * (self.k_step // ATOM_K) * ATOM_BYTES

    @property
    def bytes_in_flight(self) -> int:
        """Weight bytes one CTA keeps requested ahead of its consumers."""
        return self.stages * self.stage_bytes

    def validate(self, n: int | None = None, k: int | None = None) -> "GemmConfig":
        if self.fuse not in (0, FUSE_SWIGLU, FUSE_LAYER) or (self.fuse and self.block_n % 32):
            raise ValueError(f"fuse must be 0, {FUSE_SWIGLU} or {FUSE_LAYER} (with a block of a multiple of 32 "
                             f"rows), got fuse={self.fuse}, block_n={self.block_n}")
        if self.mma not in (0, 1) or (self.mma and self.warps % 4):
            raise ValueError(f"mma must be 0 (mma.sync) or 1 (wgmma, warps a multiple of 4), got {self.mma} "
                             f"with {self.warps} warps")
        if self.k_step not in (64, 128, 256):
            raise ValueError(f"k_step must be 64, 128 or 256, got {self.k_step}")
        if self.max_frags not in MAX_FRAGS_CHOICES:
            raise ValueError(f"max_frags must be one of {MAX_FRAGS_CHOICES}, got {self.max_frags}")
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
        if n is not None and n % self.block_n:
            raise ValueError(f"N={n} is not a multiple of the block's {self.block_n} rows ({self})")
        if n is not None and n // self.block_n >= 1 << 15:  # the unit ring packs the row block in 15 bits
            raise ValueError(f"N={n} has {n // self.block_n} row blocks of {self.block_n}; at most {(1 << 15) - 1}")
        if k is not None and k % self.k_step:
            raise ValueError(f"K={k} is not a multiple of k_step={self.k_step} ({self})")
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


def heuristic(n: int, k: int, counts, layout: tuple[int, int] | None = None) -> GemmConfig:
    """Default tile for a problem whose weights were prepared with `layout` (default
    `default_layout`): a token tile that holds the routine expert in one pass, four (or two)
    16-row tiles per warp, and stages for ~80 KB of weights in flight per CTA."""
    block_rows, k_step = layout or default_layout(n, k)
    counts = np.asarray(counts)
    active = counts[counts > 0]
    # Cover the 99th percentile in one pass; rarer, larger experts take a second pass.
    q = int(np.ceil(np.quantile(active, 0.99))) if active.size else 8
    frags = frags_for(q)
    tiles = block_rows // ATOM_ROWS
    # Four 16-row tiles per warp share each B fragment and give each warp four independent
    # decode+MMA chains: measured best for token tiles of 8-16 (results/bench_gemm_tiles2.json,
    # w13 @2: 88% vs 81% with two tiles); with 32-64 token tiles the accumulators crowd the
    # registers and two tiles per warp win (26% vs 24% @32).
    row_tiles = 4 if frags <= 2 and tiles % 4 == 0 else (2 if tiles % 2 == 0 and tiles >= 4 else 1)
    warps = tiles // row_tiles
    stage_w = tiles * (k_step // ATOM_K) * ATOM_BYTES
    if frags <= 2:
        # ~54 KB of weights in flight per CTA and two CTAs per SM (a third would fit): against
        # 4 stages, +2 points at @2 and +0.5-0.8 at @4-8; with a third CTA, 4-5 points less at @2
        # (results/bench_gemm_stages.json). Larger tiles keep ~80 KB per CTA, one CTA per SM.
        stages, cap = max(2, min(8, (54 * 1024) // stage_w)), 2
    else:
        stages, cap = max(3, min(8, (80 * 1024) // stage_w)), 0
    # 64-token tiles: wgmma, one commit group per k atom (results/probes_gemm_v12.json, @32 in one
    # run: w13 57.7 vs 54.6%, w2 57.8 vs 55.3% with mma.sync). Smaller tiles stay on mma.sync,
    # which wgmma did not beat there (results/bench_gemm_wgmma_v9.json).
    mma = 1 if frags >= 8 and warps % 4 == 0 else 0
    cfg = GemmConfig(warps, row_tiles, k_step, stages, frags, mma, ctas_per_sm=cap)
    while cfg.smem_bytes + 4096 > SMEM_LIMIT and cfg.stages > 2:
        cfg = replace(cfg, stages=cfg.stages - 1)
    return cfg.validate(n, k)


FUSE_SWIGLU = 1  # problem 0 (w13, gate/up paired) ends in SwiGLU + quantize
FUSE_LAYER = 3  # ... and problem 1 (w2) waits per expert for it, writing bf16 output

SHIPPED_CONFIGS = tuple(
    GemmConfig(w, r, ks, st, f, mma)
    for (w, r, ks, st, mma) in ((4, 4, 128, 3, 0), (4, 4, 128, 4, 0), (8, 2, 128, 4, 0), (8, 2, 128, 3, 0),
                                (4, 2, 128, 6, 0), (8, 2, 256, 2, 0), (8, 2, 64, 8, 0), (4, 4, 128, 4, 1),
                                (8, 2, 128, 4, 1))
    for f in MAX_FRAGS_CHOICES)


# Fused tiles of 8-16 tokens take at least four stages where the plain ones take three:
# fused-layer @8 1.020-1.022 against 1.026-1.027 ms with three, alternating in one process, bits
# unchanged (notes/layer.md v16, run A of results/probes_layer_v16.json); the plain GEMMs keep
# three, which four cost 1-1.6 points at @2 and did not speed up cuda-graph or separate at @8.
FUSED_SMALL_STAGES = 4


@functools.lru_cache(maxsize=None)
def fused_config(cfg: GemmConfig, fuse: int) -> GemmConfig:
    """`cfg` with the fused epilogue: one to three more warps and the h tile in shared memory
    (a stage fewer wherever the two would not fit), and for tiles of up to 16 tokens at least
    FUSED_SMALL_STAGES stages. Cached: launchers ask on every launch."""
    fused = replace(cfg, fuse=fuse)
    if cfg.max_frags <= 2:
        fused = replace(fused, stages=max(fused.stages, FUSED_SMALL_STAGES))
    while fused.smem_bytes + 4096 > SMEM_LIMIT and fused.stages > 2:
        fused = replace(fused, stages=fused.stages - 1)
    return fused.validate()


# The fused instantiations the heuristic's tiles lead to (four row tiles per warp up to 16 tokens).
SHIPPED_FUSED = tuple(fused_config(heuristic(4096, 4096, [8 * f] * 4), fuse)
                      for f in MAX_FRAGS_CHOICES for fuse in (FUSE_SWIGLU, FUSE_LAYER))


# ---------------------------------------------------------------------------------------------
# Launch
# ---------------------------------------------------------------------------------------------


def _check_activation(x_packed, x_scales, offsets, alpha, out, prep: PreparedWeights, optional_out=False):
    import cupy as cp

    t = x_packed.shape[0] if x_packed.ndim == 2 else -1
    if x_packed.ndim != 2 or x_packed.dtype != cp.uint8 or x_packed.shape[1] * 2 != prep.k:
        raise ValueError(f"x_packed: expected (T, {prep.k // 2}) uint8, got {x_packed.shape} {x_packed.dtype}")
    if x_scales.shape != (t, prep.k // 16) or x_scales.dtype != cp.uint8:
        raise ValueError(f"x_scales: expected ({t}, {prep.k // 16}) uint8, got {x_scales.shape} {x_scales.dtype}")
    if offsets.shape != (prep.experts + 1,) or offsets.dtype != cp.int32:
        raise ValueError(f"offsets: expected ({prep.experts + 1},) int32, got {offsets.shape} {offsets.dtype}")
    if alpha.shape != (prep.experts,) or alpha.dtype != cp.float32:
        raise ValueError(f"alpha: expected ({prep.experts},) float32, got {alpha.shape} {alpha.dtype}")
    if out is None and optional_out:
        out = x_packed  # nothing to check: the fused epilogue writes elsewhere
    elif out is None or out.shape != (t, prep.n) or out.dtype != cp.float32:
        got = None if out is None else (out.shape, out.dtype)
        raise ValueError(f"out: expected ({t}, {prep.n}) float32, got {got}")
    for name, a in (("x_packed", x_packed), ("x_scales", x_scales), ("out", out)):
        if not a.flags.c_contiguous:
            raise ValueError(f"{name}: must be C-contiguous")


def check_offsets_host(offsets_host, rows: int, experts: int) -> np.ndarray:
    off = np.asarray(offsets_host)
    if off.shape != (experts + 1,):
        raise ValueError(f"offsets: expected ({experts + 1},), got {off.shape}")
    if off[0] != 0 or off[-1] != rows or np.any(np.diff(off) < 0):
        raise ValueError(f"offsets: must start at 0, be non-decreasing and end at T={rows}; "
                         f"got first {off[0]}, last {off[-1]}")
    return off


def grouped_gemm(prep: PreparedWeights, x_packed, x_scales, offsets, alpha, out,
                 cfg: GemmConfig, stream=None, read_only: bool = False) -> None:
    """Launch the grouped GEMM on `stream` (CuPy stream or None for the current one).

    `cfg` comes from `heuristic` (it needs the host-side token counts, which the caller has when
    it plans a run); offsets are not read back here, so the launch can be graph-captured.
    `read_only` launches the same pipeline without decode, MMA or stores (the achievable rate of
    this access pattern).
    """
    _launch([(prep, x_packed, x_scales, offsets, alpha, out)], cfg, stream, read_only)


def grouped_gemm_pair(first: tuple, second: tuple, cfg: GemmConfig, stream=None) -> None:
    """Two grouped GEMMs in one launch: `first` and `second` are each (prep, x_packed, x_scales,
    offsets, alpha, out) as for `grouped_gemm`, sharing `cfg` (its block and k_step must divide
    both). The launch does not order them: if `second` reads what `first` writes, it reads a
    stale buffer (that is what the one-launch-2G ceiling measures)."""
    _launch([first, second], cfg, stream, False)


@dataclass
class Fusion:
    """What the fused instantiations add to a launch (see grouped_gemm.cu, FUSE).

    swiglu (problem 0 is w13 prepared with pair_gate_up=True): per-expert gate/up globals (E,)
    float32, the w2 input global, and the NVFP4 output a_packed (T, I/2) / a_scales (T, I/16).
    layer: problem 1 is w2 on a_packed / a_scales and waits per expert; out_bf16 (T, H) uint16
    receives its output (its fp32 `out` may be None). counter (1,) uint32 counts non-finite
    SwiGLU values and bf16 outputs."""

    gate_global: object
    up_global: object
    act_global: float
    a_packed: object
    a_scales: object
    counter: object
    out_bf16: object = None  # layer only

    @property
    def fuse(self) -> int:
        return FUSE_LAYER if self.out_bf16 is not None else FUSE_SWIGLU


def _check_fusion(fz: Fusion, w13: PreparedWeights, rows: int, cfg: GemmConfig, w2=None) -> None:
    import cupy as cp

    from lab.kernels import swiglu_quant as sq

    if not w13.pair_gate_up:
        raise ValueError("w13: the fused SwiGLU epilogue needs weights prepared with pair_gate_up=True")
    i = w13.n // 2
    e = w13.experts
    for name, a, shape, dtype in (("gate_global", fz.gate_global, (e,), cp.float32),
                                  ("up_global", fz.up_global, (e,), cp.float32),
                                  ("a_packed", fz.a_packed, (rows, i // 2), cp.uint8),
                                  ("a_scales", fz.a_scales, (rows, i // 16), cp.uint8),
                                  ("counter", fz.counter, (1,), cp.uint32)):
        if tuple(a.shape) != shape or a.dtype != dtype or not a.flags.c_contiguous:
            raise ValueError(f"{name}: expected C-contiguous {shape} {cp.dtype(dtype).name}, got {tuple(a.shape)} {a.dtype}")
    sq.check_global("act_global", fz.act_global)
    if w2 is not None:
        if (w2.experts, w2.k) != (e, i):
            raise ValueError(f"w2: expected {e} experts with K = I = {i} to follow w13, got {w2.experts} and K={w2.k}")
        if fz.out_bf16 is None or tuple(fz.out_bf16.shape) != (rows, w2.n) or fz.out_bf16.dtype != cp.uint16:
            got = None if fz.out_bf16 is None else (tuple(fz.out_bf16.shape), fz.out_bf16.dtype)
            raise ValueError(f"out_bf16: expected ({rows}, {w2.n}) uint16, got {got}")
        if not fz.out_bf16.flags.c_contiguous or fz.out_bf16.data.ptr % 4:
            # the epilogue warps store two adjacent bf16 values as one 4-byte word
            raise ValueError(f"out_bf16: expected a C-contiguous array at a 4-byte aligned address, got "
                             f"strides {fz.out_bf16.strides} at {fz.out_bf16.data.ptr:#x}")
        # ready[e] counts (w13 block, pass, warp) triples; the largest count must fit an int32
        most = (w13.n // cfg.block_n) * cfg.warps * -(-rows // cfg.token_tile)
        if most >= 2 ** 31:
            raise ValueError(f"fused layer: {most} readiness signals per expert do not fit the int32 counters")


def swiglu_gemm(w13: PreparedWeights, x_packed, x_scales, offsets, alpha, fusion: Fusion, cfg: GemmConfig,
                stream=None) -> None:
    """The w13 grouped GEMM with SwiGLU + NVFP4 quantize as its epilogue: h never reaches memory;
    writes fusion.a_packed / a_scales exactly as swiglu_quant.swiglu_quant would from h."""
    _check_fusion(fusion, w13, x_packed.shape[0] if x_packed.ndim == 2 else -1, cfg)
    if fusion.out_bf16 is not None:
        raise ValueError("swiglu_gemm: out_bf16 belongs to fused_layer")
    _launch([(w13, x_packed, x_scales, offsets, alpha, None)], cfg, stream, False, fusion)


def fused_layer(w13: PreparedWeights, x_packed, x_scales, offsets, w13_alpha, w2: PreparedWeights, w2_alpha,
                fusion: Fusion, cfg: GemmConfig, stream=None) -> None:
    """The whole layer in one persistent launch: w13 units with the SwiGLU epilogue, then w2
    units on its a_q, each w2 expert starting once its w13 units are written (per-expert
    counters, release/acquire). Output: fusion.out_bf16 only (no fp32 copy: the w2 passes go
    to the epilogue warps, which write bf16)."""
    rows = x_packed.shape[0] if x_packed.ndim == 2 else -1
    _check_fusion(fusion, w13, rows, cfg, w2)
    _launch([(w13, x_packed, x_scales, offsets, w13_alpha, None),
             (w2, fusion.a_packed, fusion.a_scales, offsets, w2_alpha, None)], cfg, stream, False, fusion)


def _launch(problems: list, cfg: GemmConfig, stream, read_only: bool, fusion: Fusion | None = None) -> None:
    import cupy as cp

    if fusion is not None:
        cfg = fused_config(cfg, fusion.fuse)
    elif cfg.fuse:
        cfg = replace(cfg, fuse=0)
    for pi, (prep, x_packed, x_scales, offsets, alpha, out) in enumerate(problems):
        fused_out = fusion is not None and (pi == 0 or fusion.fuse == FUSE_LAYER)
        _check_activation(x_packed, x_scales, offsets, alpha, out, prep, optional_out=fused_out)
        cfg.validate(prep.n, prep.k)
        if (cfg.block_n, cfg.k_step) != (prep.block_rows, prep.k_step):
            raise ValueError(f"cfg: block {cfg.block_n} x k_step {cfg.k_step} does not match the weights' "
                             f"layout ({prep.block_rows}, {prep.k_step}); prepare with layout=(block_n, k_step)")
    if fusion is not None and fusion.fuse == FUSE_LAYER and problems[0][3] is not problems[1][3]:
        raise ValueError("fused layer: w13 and w2 must share one offsets array")
    keep = [pr for pr in problems if pr[1].shape[0] and pr[0].experts]
    if not keep:
        return
    if fusion is not None and len(keep) != len(problems):
        return  # no rows: nothing to compute, and the fused problems come as a whole
    problems = keep
    if len(problems) == 1:  # problem 1 of the kernel: no experts
        prep, x_packed, x_scales, offsets, alpha, out = problems[0]
        problems.append((PreparedWeights(prep.data, 0, prep.n, prep.k, prep.block_rows, prep.k_step),
                         x_packed, x_scales, offsets, alpha, out))
    experts = sum(pr[0].experts for pr in problems)
    smem = cfg.launch_smem(experts)
    fuse = cfg.fuse
    fn = jit.kernel(SOURCE, cfg.expression_for(read_only), smem)
    units = sum(pr[0].experts * (pr[0].n // cfg.block_n) for pr in problems)
    grid = (min(units, jit.sm_count() * resident_ctas(cfg, experts, fn.num_regs)),)
    args = []
    # problem 1 of a single-problem launch has no experts: problem 0's map stands in for its own
    maps = [tensor_map.device_map(pr[0].data, pr[0].stage_bytes) for pr in problems if pr[0].experts]
    maps += maps[:1] * (2 - len(maps))
    for (prep, x_packed, x_scales, offsets, alpha, out), wmap in zip(problems, maps):
        args += [wmap, x_packed, x_scales, offsets, alpha, _NULL if out is None else out,
                 np.int32(prep.n), np.int32(prep.k), np.int32(prep.experts)]
    stream = stream if stream is not None else cp.cuda.get_current_stream()
    first_out = problems[0][5] if fusion is None else fusion.a_packed
    second_out = problems[1][5] if problems[1][5] is not None else fusion.out_bf16
    with stream:
        sched, ready = _scheduler_state(cp, first_out, problems[0][3], second_out, problems[0][0].experts)
        args.append(sched)
        if fusion is None:
            args += [_NULL, _NULL, np.float32(1.0), _NULL, _NULL, _NULL, _NULL, _NULL]
        else:
            args += [fusion.gate_global, fusion.up_global, np.float32(fusion.act_global), fusion.a_packed,
                     fusion.a_scales, ready if fuse == FUSE_LAYER else _NULL,
                     _NULL if fusion.out_bf16 is None else fusion.out_bf16, fusion.counter]
        fn(grid, (cfg.threads,), tuple(args), shared_mem=smem)


_NULL = np.uint64(0)  # a null pointer argument
_SCHED: dict = {}


def _scheduler_state(cp, out, offsets, out1, experts0: int):
    """The kernel's unit counter and per-expert readiness counters, one set per (output, offsets)
    pair: launches that may run at the same time (chunks on two streams) write different
    outputs, so they never share counters. The kernel leaves them at zero, so graph replays
    need no reset. Allocated on first use, which the runner does before any capture."""
    key = (cp.cuda.Device().id, out.data.ptr, offsets.data.ptr, None if out1 is None else out1.data.ptr, experts0)
    state = _SCHED.get(key)
    if state is None:
        state = _SCHED[key] = (cp.zeros(2, dtype=cp.int32), cp.zeros(max(1, experts0), dtype=cp.int32))
    return state

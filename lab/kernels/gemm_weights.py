"""The grouped GEMM's prepared-weight format: (E, N, K) NVFP4 weights laid out as the kernel's
576-byte atoms, with each 8-code word stored through the inverse of the GF(2)-linear map that the
kernel's decode_a() applies (lab/kernels/gemm/decode.cuh), and the k-slot order both operands
share. NumPy or CuPy (`xp`), same result; `unprepare_weights` inverts it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lab.kernels import tensor_map

ATOM_ROWS = 16  # mma M
ATOM_K = 64  # four k16 steps: one 16-byte load of codes per lane
ATOM_CODE_BYTES = 512
ATOM_BYTES = 576  # codes + 64 bytes of e4m3 scales

# MMA k slot -> k within a 16-element block. The kernel decodes a raw activation word (codes of
# k = 0..7) into fp16x2 registers holding k = (a, a + 4), the pair 16 bits apart in the word, for
# two shifts and two LOP3 per register (decode_x in gemm/decode.cuh); that register fills slots
# 2a, 2a+1. The weights are prepared in the same slot order, and the scale is per block, so the
# product is unchanged. Slots 8..15 repeat the pattern on k = 8..15.
K_SLOTS = np.array([0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15])

DECODE_MASK = 0x8E008E00  # fp16x2 sign (15, 31) and e2m1 exponent+mantissa (9..11, 25..27)
_TARGET_BITS = [b for b in range(32) if DECODE_MASK >> b & 1]


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
            pos = _TARGET_BITS[i]
            sources = {0: [pos - 6], 1: [pos - 9], 2: [pos, pos - 2], 3: [pos, pos + 3]}[q]
            mask = 0
            for src in sources:
                if 0 <= src < 32:
                    mask ^= 1 << src
            rows.append(mask)
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
    return shared_layout([(n, k)])


def shared_layout(shapes) -> tuple[int, int]:
    """(block_rows, k_step) that every (N, K) in `shapes` can be prepared with: the widest block
    of rows dividing every N and the first of k_step 128, 64, 256 dividing every K. Two GEMMs
    in one launch (the fused layer, one-launch-2G) share one tile, so they need one layout;
    N and K multiples of 64 always have one (64, 64)."""
    shapes = [(int(n), int(k)) for n, k in shapes]
    block_rows = next((b for b in (256, 128, 64) if all(n % b == 0 for n, _ in shapes)), None)
    if block_rows is None:
        raise ValueError(f"N={' and '.join(str(n) for n, _ in shapes)} must be multiples of 64")
    k_step = next((s for s in (128, 64, 256) if all(k % s == 0 for _, k in shapes)), None)
    if k_step is None:
        raise ValueError(f"K={' and '.join(str(k) for _, k in shapes)} must be multiples of 64")
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

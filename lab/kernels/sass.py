"""What ptxas made of a kernel instantiation, read without a GPU: its SASS (nvcc for sm_90a through
`jit.compile_cubin`, then nvdisasm), the loops that hold its tensor instructions (the consumers'
stage loops), and each loop's instruction mix per weight tile-step.

A tile-step is one warp's 16 weight rows by one k16 step: eight codes per thread. The decode costs
thirteen instructions of it (eight bit operations, four HMUL2 for the block scale, one scale
conversion, gemm/decode.cuh); what else a stage loop issues per tile-step (its loads, descriptors,
barriers, the wgmma issue itself) is the overhead that notes/gemm.md weighs against the tensor work.
Static counts say nothing of stalls: they size the instruction budget, and two trees' counts show
whether an edit moved the hot loop at all (a same-process A/B on the GPU still decides speed).

    rows = stage_mixes(gg.SOURCE, cfg.expression)     # one row per tensor loop: shape, counts by class
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from lab.kernels import jit


def nvdisasm_path() -> str | None:
    """nvdisasm from PATH, the CUDA toolkit, or the `nvidia-cuda-nvdisasm` wheel (the test extra)."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    roots = [os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
    spec = importlib.util.find_spec("nvidia")
    if spec is not None and spec.submodule_search_locations:
        roots += [str(Path(p) / "cu13") for p in spec.submodule_search_locations]
    for root in roots:
        if root and (Path(root) / "bin" / "nvdisasm").is_file():
            return str(Path(root) / "bin" / "nvdisasm")
    return None


@dataclass(frozen=True)
class Instr:
    offset: int  # bytes from the function's start
    predicate: str  # "@P0", "@!P2", or ""
    opcode: str  # with its modifiers: "HGMMA.64x32x16.F32", "IMAD.SHL.U32"
    operands: str
    target: int | None = None  # a branch's target offset

    @property
    def base(self) -> str:
        return self.opcode.split(".", 1)[0]


_SECTION = re.compile(r"^\s*\.section\s+\.text\.([^,\s]+)", re.M)
_LABEL = re.compile(r"^(\.L_x_\d+):")
_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Za-z0-9_.]*)\s*([^;]*);")
_BRANCH_TARGET = re.compile(r"`\((\.L_x_\d+)\)")


def parse_nvdisasm(text: str) -> dict[str, list[Instr]]:
    """Each function's instructions from `nvdisasm -c` output, branch targets resolved to offsets."""
    funcs: dict[str, list[tuple]] = {}
    labels: dict[str, dict[str, int]] = {}
    name, pending = None, []
    for line in text.splitlines():
        m = _SECTION.match(line)
        if m:
            name, pending = m.group(1), []
            funcs[name], labels[name] = [], {}
            continue
        if name is None:
            continue
        m = _LABEL.match(line.strip())
        if m:
            pending.append(m.group(1))
            continue
        m = _INSTR.match(line)
        if m:
            offset = int(m.group(1), 16)
            for label in pending:
                labels[name][label] = offset
            pending = []
            funcs[name].append((offset, (m.group(2) or "").strip(), m.group(3), m.group(4).strip()))
    out = {}
    for fn, rows in funcs.items():
        instrs = []
        for offset, pred, opcode, operands in rows:
            t = _BRANCH_TARGET.search(operands)
            target = labels[fn].get(t.group(1)) if t and opcode.startswith(("BRA", "BRX")) else None
            instrs.append(Instr(offset, pred, opcode, operands, target))
        out[fn] = instrs
    return out


def kernel_sass(name: str, expression: str, tree: Path | None = None) -> list[Instr]:
    """The SASS of one instantiation of source file `name` (from `tree`, default lab/kernels)."""
    return _kernel_sass(name, expression, None if tree is None else Path(tree).resolve())


@functools.lru_cache(maxsize=64)
def _kernel_sass(name: str, expression: str, tree: Path | None) -> list[Instr]:
    disasm = nvdisasm_path()
    if disasm is None:
        raise RuntimeError("reading SASS needs nvdisasm (the CUDA toolkit, or pip install nvidia-cuda-nvdisasm)")
    with tempfile.TemporaryDirectory() as tmp:
        cubin, report = jit.compile_cubin(name, expression, Path(tmp), tree)
        proc = subprocess.run([disasm, "-c", str(cubin)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"nvdisasm failed on {expression}:\n{proc.stderr[-2000:]}")
    funcs = parse_nvdisasm(proc.stdout)
    mangled = jit.entry_name(report, expression)
    if mangled not in funcs:
        raise RuntimeError(f"no function {mangled} ({expression}) in the disassembly; found {sorted(funcs)}")
    return funcs[mangled]


TENSOR = ("HGMMA", "HMMA", "QGMMA")  # QGMMA: fp8 wgmma (the W4A8 GEMM)

# Instruction classes, by base opcode (the first dotted part); IMAD's shift and move forms count
# as integer work, which they are (ptxas issues shifts on the FMA pipe's IMAD to balance pipes).
CLASSES = {
    "tensor": TENSOR,
    "fp16": ("HMUL2", "HFMA2", "HADD2", "HMNMX2"),
    "fp32": ("FFMA", "FMUL", "FADD", "FMNMX", "FSETP", "FSEL"),
    "convert": ("F2FP", "F2F", "I2F", "F2I", "I2FP", "F2IP"),
    "integer": ("LOP3", "SHF", "IMAD", "IADD3", "VIADD", "LEA", "SEL", "ISETP", "PLOP3", "MOV", "PRMT", "IABS",
                "IMNMX", "VIMNMX", "POPC", "FLO", "BREV", "P2R", "R2P", "SGXT", "BMSK", "LOP", "SHL", "SHR"),
    "uniform": ("R2UR", "S2UR", "ULDC", "UMOV", "UIADD3", "ULOP3", "USHF", "UIMAD", "ULEA", "USEL", "UISETP",
                "UPLOP3", "UPRMT"),
    "shared": ("LDS", "STS", "LDSM", "ATOMS", "LDGSTS"),
    "global": ("LDG", "STG", "ATOMG", "RED", "UBLKCP", "UTMALDG", "UTMAPF", "UBLKPF", "CCTL"),
    "sync": ("WARPGROUP", "SYNCS", "BAR", "WARPSYNC", "BSYNC", "BSSY", "DEPBAR", "MEMBAR", "FENCE", "ERRBAR",
             "YIELD", "NANOSLEEP", "SHFL", "VOTE", "VOTEU", "MATCH", "ELECT", "USETMAXREG"),
    "branch": ("BRA", "BRX", "EXIT", "RET", "CALL", "JMP", "NOP"),
}
_CLASS_OF = {op: cls for cls, ops in CLASSES.items() for op in ops}


def class_of(instr: Instr) -> str:
    return _CLASS_OF.get(instr.base, "other")


def tensor_loops(instrs: list[Instr]) -> list[tuple[int, int]]:
    """The innermost loops that hold tensor instructions, as [first, last] index ranges into
    `instrs`: a loop is a backward branch and the code from its target to it. Branches from past
    the function's last unconditional EXIT are ptxas's out-of-line retry loops of barrier waits,
    which jump back into the code above them, not loops of it."""
    end = max((i for i, x in enumerate(instrs) if x.opcode == "EXIT" and not x.predicate), default=len(instrs) - 1)
    index = {x.offset: i for i, x in enumerate(instrs)}
    spans = []
    for i, x in enumerate(instrs[:end + 1]):
        if x.target is not None and x.target <= x.offset and x.target in index:
            first = index[x.target]
            if any(y.base in TENSOR for y in instrs[first:i + 1]):
                spans.append((first, i))
    # innermost: no other such loop nested inside
    return sorted(s for s in set(spans)
                  if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in spans))


@dataclass(frozen=True)
class LoopMix:
    first: int  # offset of the loop's first instruction
    last: int
    tensor_ops: tuple[str, ...]  # the distinct tensor instructions, e.g. ("HGMMA.64x32x16.F32",)
    n_tensor: int  # tensor instructions in one trip
    counts: dict  # class -> instructions in one trip
    opcodes: dict  # opcode -> instructions in one trip

    @property
    def instructions(self) -> int:
        return sum(self.counts.values())

    @property
    def tokens(self) -> int:
        """N of the loop's register-A wgmma (8 x fragments); 0 for any other loop (mma.sync, whose
        one loop holds every fragment count's case, or mixed shapes)."""
        ns = {int(m.group(1)) for op in self.tensor_ops if (m := re.match(r"HGMMA\.64x(\d+)x16", op))}
        return ns.pop() if len(ns) == 1 and len(self.tensor_ops) == 1 else 0


def loop_mix(instrs: list[Instr], span: tuple[int, int]) -> LoopMix:
    body = instrs[span[0]:span[1] + 1]
    tensor = [x for x in body if x.base in TENSOR]
    return LoopMix(body[0].offset, body[-1].offset, tuple(sorted({x.opcode for x in tensor})), len(tensor),
                   dict(Counter(class_of(x) for x in body)), dict(Counter(x.opcode for x in body)))


# A wgmma's work on each SM sub-partition's tensor core, in cycles at the dense rate (fp16: 512
# multiply-adds a cycle a sub-partition, fp8: 1024), by its shape m64nNkK: the warp's 16 rows x N x K.
_WGMMA_SHAPE = re.compile(r"^(HGMMA|QGMMA)\.64x(\d+)x(\d+)\.")
_MACS_A_CYCLE = {"HGMMA": 512, "QGMMA": 1024}


def tensor_cycles(opcode: str) -> float:
    """Cycles of one sub-partition's tensor core that one wgmma occupies (its warp's 16 x N x K
    multiply-adds at the dense rate): a QGMMA.64x64x32 is 32, an HGMMA.64x64x16 is 32."""
    m = _WGMMA_SHAPE.match(opcode)
    if m is None:
        raise ValueError(f"tensor cycles are defined for wgmma (HGMMA / QGMMA .64xNxK), got {opcode}")
    return 16 * int(m.group(2)) * int(m.group(3)) / _MACS_A_CYCLE[m.group(1)]


@dataclass(frozen=True)
class LoopPath:
    """One way through one trip of a loop: what a warp issues on it."""
    instructions: int
    tensor_ops: int  # wgmma instructions on the path
    tensor_cycles: float  # their work on the warp's tensor core (tensor_cycles), summed
    releases: int  # SYNCS.ARRIVE on the path: stage releases, one a group in the W4A8 loops

    @property
    def groups(self) -> int:
        """The groups (ring stages) one trip takes: its stage releases, or one where the loop
        releases none by mbarrier (the W4A8 ring kernels, one group a trip)."""
        return self.releases or 1

    @property
    def issue_per_tensor_cycle(self) -> float:
        """Issue slots the warp's scheduler needs per cycle of the path's tensor work: above 1, the
        issue alone keeps the tensor core below full (at most 1 / this busy); below 1, the share of
        issue slots that keeps it full. The same for every warp a scheduler hosts in the CTA's loop."""
        return self.instructions / self.tensor_cycles if self.tensor_cycles else float("inf")


def loop_paths(instrs: list[Instr], span: tuple[int, int]) -> list[LoopPath]:
    """Every distinct path through one trip of the loop at `span` (tensor_loops' [first, last]),
    from its first instruction to its back edge. A conditional branch forward inside the loop forks
    the path; one that leaves the loop (the loop's exit, or ptxas's out-of-line retry of a barrier
    wait, which returns) counts as not taken, since the trip goes on only that way; an unconditional
    branch out of the loop, or an unconditional EXIT, ends a path that is no trip. Predicated
    instructions count: they take an issue slot either way. Sorted, shortest first."""
    first, last = span
    index = {x.offset: i for i, x in enumerate(instrs)}
    rest: dict[int, set] = {}  # from instruction i to the back edge: (instructions, tensor ops, cycles, releases)
    for i in range(last, first - 1, -1):  # every edge kept inside the loop runs forward
        x = instrs[i]
        tensor = x.base in TENSOR
        here = (1, int(tensor), tensor_cycles(x.opcode) if tensor else 0.0, int(x.opcode.startswith("SYNCS.ARRIVE")))
        if i == last:
            rest[i] = {here}
            continue
        nexts: list[int] = [i + 1]
        if x.base == "BRA" and x.target is not None:
            j = index.get(x.target)
            inside = j is not None and i < j <= last
            if x.predicate:
                nexts = [i + 1, j] if inside else [i + 1]
            else:
                nexts = [j] if inside else []
        elif x.base == "EXIT" and not x.predicate:
            nexts = []
        rest[i] = {tuple(a + b for a, b in zip(here, tail)) for n in nexts for tail in rest[n]}
    return [LoopPath(n, t, c, r) for n, t, c, r in sorted(rest[first])]


def steady_paths(paths: list[LoopPath], steps: int = 4) -> list[LoopPath]:
    """The paths a loop runs in the steady state: for each count of wgmmas a group, the longest path
    (the shorter ones skip work, such as the decode of a group past the last), keeping only paths
    whose wgmmas a group are whole batches of `steps` (a trip of a two-batch and a three-batch group
    averages ten, a path of the code that no token block runs). Fewest wgmmas a group first."""
    longest: dict[float, LoopPath] = {}
    for path in paths:
        if path.tensor_ops % (path.groups * steps):
            continue
        key = path.tensor_ops / path.groups
        if key not in longest or path.instructions > longest[key].instructions:
            longest[key] = path
    return [longest[n] for n in sorted(longest)]


def stage_mixes(name: str, expression: str, tree: Path | None = None) -> list[LoopMix]:
    """Every tensor loop of the instantiation, in code order."""
    instrs = kernel_sass(name, expression, tree)
    return [loop_mix(instrs, s) for s in tensor_loops(instrs)]


def tile_steps(mix: LoopMix) -> int:
    """A consumer warp's tile-steps in one trip of a register-A wgmma loop: each wgmma covers one
    of the warp's 16-row tiles by one k16 step."""
    if not mix.tokens:
        raise ValueError(f"tile-steps are counted on loops of one register-A wgmma shape, got {mix.tensor_ops}")
    return mix.n_tensor

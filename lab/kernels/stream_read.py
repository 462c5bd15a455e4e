"""Flat streaming read (source: stream_read.cu): the lab's own read roofline, measured in the
same process as every figure that is reported as a ratio to it."""

from __future__ import annotations

import numpy as np

from lab.gpu import require_gpu
from lab.kernels import jit
from lab.timing import Timing, time_cuda

SOURCE = "stream_read.cu"
UNROLL = 4
THREADS = 512
BLOCKS_PER_SM = 4


def stream_read(buf, sink, stream=None) -> None:
    """Read every byte of `buf` (a CuPy array whose nbytes is a multiple of 16) once."""
    cp = require_gpu("stream_read")
    if buf.nbytes % 16 or not buf.flags.c_contiguous:
        raise ValueError(f"buf: need a C-contiguous array of a multiple of 16 bytes, got {buf.nbytes}")
    fn = jit.kernel(SOURCE, f"lab_read::stream_read<{UNROLL}>")
    sms = jit.sm_count()
    stream = stream if stream is not None else cp.cuda.get_current_stream()
    with stream:
        fn((sms * BLOCKS_PER_SM,), (THREADS,), (buf, np.uint64(buf.nbytes // 16), sink))


def measure_read_roofline(nbytes: int = 4_077_000_000, iterations: int = 20, seed: int = 0) -> dict:
    """Time a flat read of `nbytes` of random data; returns GB/s (decimal) with its timing."""
    cp = require_gpu("measure_read_roofline")
    n16 = -(-nbytes // 16)
    buf = cp.random.default_rng(seed).integers(0, 2**31 - 1, size=n16 * 4, dtype=cp.int32).view(cp.uint8)
    sink = cp.zeros(1, dtype=cp.uint32)
    t: Timing = time_cuda(lambda: stream_read(buf, sink), iterations=iterations, warmup=3)
    gbps = buf.nbytes / (t.median_ms * 1e-3) / 1e9
    return {"bytes": int(n16 * 16), "gbps": gbps, "timing": t.as_dict()}

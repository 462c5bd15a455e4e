"""The weight stream's TMA tensor maps: geometry on the CPU, the encoded map on the GPU."""

from __future__ import annotations

import numpy as np
import pytest

from lab.kernels import gemm_config as gc
from lab.kernels import gemm_weights as gw
from lab.kernels import tensor_map as tm


@pytest.mark.parametrize("k_step", [64, 128, 256])
def test_every_tile_stage_is_one_box_of_whole_rows(k_step):
    for warps in range(1, 17):
        for rows in (1, 2, 4):
            if warps * rows > 32:
                continue
            cfg = gc.GemmConfig(warps, rows, k_step, 2, 1)
            sb = cfg.stage_bytes
            geo = tm.stage_geometry(sb)
            assert geo.rows * geo.row_bytes == sb, cfg
            assert geo.rows <= tm.MAX_BOX and geo.elems <= tm.MAX_BOX and geo.row_bytes % 16 == 0, cfg
            assert geo.elem_bytes in (1, 2, 4, 8)


def test_rows_are_256_bytes_for_the_shipped_stages():
    for cfg in gc.SHIPPED_CONFIGS:
        geo = tm.stage_geometry(cfg.stage_bytes)
        assert (geo.elem_bytes, geo.elems) == (1, 256), cfg  # the width measured in results/probes_gemm_v13.json


def test_geometry_widens_rows_and_rejects_what_no_box_holds():
    assert tm.stage_geometry(576) == tm.StageGeometry(1, 64, 9)
    assert tm.stage_geometry(1152) == tm.StageGeometry(1, 128, 9)
    assert tm.stage_geometry(128 * 576) == tm.StageGeometry(2, 256, 144)  # 288 rows of 256 B would not fit
    for bad in (0, -64, 100, 29 * 576):
        with pytest.raises(ValueError, match="stage"):
            tm.stage_geometry(bad)


def test_encode_args_view_the_weights_as_stage_row_element():
    a = tm.encode_args(0x7F0000000000, 18432 * 288 * 16 * 32, 18432)
    assert a["rank"] == 3 and a["dtype"] == 0
    assert a["dims"] == (256, 72, 288 * 16 * 32)
    assert a["strides"] == (256, 18432) and a["box"] == (256, 72, 1) and a["element_strides"] == (1, 1, 1)
    with pytest.raises(ValueError, match="aligned"):
        tm.encode_args(0x7F0000000008, 18432, 18432)
    with pytest.raises(ValueError, match="whole stages"):
        tm.encode_args(0x7F0000000000, 18432 + 64, 18432)


def test_prepared_weights_know_their_stage():
    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, (2, 128, 128), dtype=np.uint8)
    scales = rng.integers(1, 127, (2, 128, 16), dtype=np.uint8)
    prep = gw.prepare_weights(packed, scales, layout=(64, 128))
    assert prep.stage_bytes == 4 * 2 * gw.ATOM_BYTES
    assert prep.data[0, 0, 0].nbytes == prep.stage_bytes  # one stage = one contiguous run of the layout


@pytest.mark.gpu
def test_device_map_is_made_once_per_array_and_slice():
    import cupy as cp

    rng = np.random.default_rng(1)
    packed = rng.integers(0, 256, (3, 256, 256), dtype=np.uint8)
    scales = rng.integers(1, 127, (3, 256, 32), dtype=np.uint8)
    prep = gw.prepare_weights(packed, scales, xp=cp, layout=(256, 128))
    m = tm.device_map(prep.data, prep.stage_bytes)
    assert m.nbytes == tm.MAP_BYTES and m.data.ptr % 64 == 0
    assert tm.device_map(prep.data, prep.stage_bytes) is m  # made at preparation, found again
    part = prep.experts_slice(1, 3)
    assert tm.device_map(part.data, part.stage_bytes) is not m
    assert bytes(m.get()) != bytes(tm.device_map(part.data, part.stage_bytes).get())  # another base address


@pytest.mark.gpu
def test_device_map_is_not_made_during_capture():
    import cupy as cp

    fresh = cp.zeros(18432 * 4, cp.uint8)
    tm._MAPS.pop((fresh.data.ptr, fresh.nbytes, 18432), None)  # freed memory of an earlier test's weights
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        try:
            with pytest.raises(RuntimeError, match="before stream capture"):
                tm.device_map(fresh, 18432)
        finally:
            stream.end_capture()


@pytest.mark.parametrize("stage_bytes", [576, 1152, 4608, 18432, 36864, 128 * 576])
def test_box_of_stage_s_is_exactly_the_stages_contiguous_bytes_in_order(stage_bytes):
    """What the kernel relies on: the box at coordinates {0, 0, s} reads bytes
    [s * stage_bytes, (s + 1) * stage_bytes) of the weights, in shared memory in the same order
    (TMA fills the box innermost dimension first)."""
    stages, base = 3, 0x7F0000000000
    a = tm.encode_args(base, stages * stage_bytes, stage_bytes)
    esize = {0: 1, 1: 2, 2: 4, 4: 8}[a["dtype"]]
    elems, rows, _ = a["box"]
    row_stride, stage_stride = a["strides"]
    for s in range(stages):
        z, y, x = np.meshgrid([s], np.arange(rows), np.arange(elems), indexing="ij")
        addr = (base + x * esize + y * row_stride + z * stage_stride).ravel()  # box order
        expect = base + s * stage_bytes + np.arange(0, stage_bytes, esize)
        np.testing.assert_array_equal(addr, expect)

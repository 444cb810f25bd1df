"""The IQ3_XXS GEMM that dequantizes in its main loop (strata_rt/gemm/fused_gemm.py,
kernels/iq3_xxs/ fused.cu) and its variant object (STRATA_MMQ_KERNEL=f16_fused: IQ3XXS with
variant f16_fused, strata_rt/formats/ggml_format.py).

CPU: the tile table against the CUDA source and the hardware, register budgets, the variant
object (native layout and images, fp16 activations, f16_gemm's reference on the decoded
blocks), launch geometry and argument checks through a recording kernel. GPU: on fresh random
blocks and activations, outputs poisoned with NaN first, the fused kernel gives the same bytes
as the f16_gemm kernel on the dequantized images, for every tile, rows_hint and repeat, and
agrees with the float64 references (same fp16 inputs; exact weights and float32 activations).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from _device_buffers import launch_poisoned, upload
from _gemm_cases import assert_fits_registers, assert_refused
from _recording import RecordingKernel

from strata_rt.errors import FormatError
from strata_rt.formats.activations import F16
from strata_rt.formats.contract import MMQ_GROUP
from strata_rt.formats.ggml_format import F16_FUSED, FLOAT64_NMSE_BOUND
from strata_rt.formats.launchers import MMQ_TABLE_ARG_TYPES
from strata_rt.formats.numerics import nmse
from strata_rt.formats.testing_abi import Recorder
from strata_rt.gemm.fused_gemm import (
    FUSED_SOURCE,
    IQ3_BLOCK_BYTES,
    TILES,
    TILES_BY_NAME,
    FusedGemm,
    at_name,
    native_image_bytes,
    pick_tile,
    tab_name,
)
from strata_rt.gemm.grouped_gemm import GroupedGemm, gemm_reference
from strata_rt.quants.iq3_xxs import IQ3XXS
from strata_rt.quants.iq3_xxs_device import IQ3XXSF16Kernels
from strata_rt.runtime.compile import nvcc_available

#: the native blocks' object (an exact variant: images are the blob's ranges), f16_gemm's and
#: f16_fused's
IQ3 = IQ3XXS("f16_pipe")
GEMM = IQ3XXS()
FUSED = IQ3.for_variant(F16_FUSED)
#: kernel vs float64 products of the same fp16 inputs (f16_gemm's bound: the bytes are its own)
GEMM_NMSE = 1e-6
NAN_F32 = np.uint32(0xFFFFFFFF)  # what `poisoned` fills with


def dequant_iq3_images(blob: np.ndarray, hidden: int, ffn: int):
    """f16_gemm's images of a blob (the dequantizing gather's twin)."""
    return GEMM.images(blob, hidden, ffn)


def native_images_to_f16(images: np.ndarray, n: int, m: int, k: int) -> np.ndarray:
    """n native images -> float16 [n, m, k], as the fused kernel decodes them."""
    img = np.asarray(images, dtype=np.uint8).reshape(n, -1)
    return np.stack([FUSED.native_f16(img[p], m, k) for p in range(n)])


def fused_reference(images, expert_ids, acts, bounds, m, k) -> np.ndarray:
    return FUSED.mmq_reference(images, expert_ids, acts, bounds, m, k)


def _parts(hidden: int, ffn: int) -> dict[str, tuple[int, int]]:
    return {"gate_up": (2 * ffn, hidden), "down": (hidden, ffn)}


def _blob(rng, hidden: int, ffn: int, overflow: bool = False) -> np.ndarray:
    """A random expert whose first blocks of each range have d = 0, -0, negative, subnormal and
    large scales: with `overflow` so large that weights overflow fp16 (infinite), else the
    largest that keep every weight finite (so products stay finite and comparable)."""
    blob = IQ3.random_expert(rng, hidden, ffn).copy()
    lay = IQ3.layout(hidden, ffn)
    big = [3.0e4, 65504.0] if overflow else [100.0, 130.0]  # 130 * 15.5/2 * 62 < 65504
    specials = np.array([0.0, -0.0, -0.0123, 6e-8, *big], dtype="<f2")
    for off in (lay.gate_up_offset, lay.down_offset):
        blocks = blob[off: off + specials.size * 98].reshape(-1, 98)
        blocks[:, :2] = specials.view(np.uint8).reshape(-1, 2)
    return blob


def _native(blob: np.ndarray, hidden: int, ffn: int, part: str) -> np.ndarray:
    gu, dn = IQ3.images(blob, hidden, ffn)
    return np.asarray(gu if part == "gate_up" else dn)


# ------------------------------------------------------------------------------ CPU
def test_tile_table_matches_the_cuda_source():
    lines = re.findall(r"^FUSED_KERNEL\((\w+),\s*(\d+),\s*(\d+),\s*(\d+),\s*(\d+)\)",
                       FUSED_SOURCE.read_text(), re.M)
    assert lines, "no FUSED_KERNEL lines found"
    in_source = {name: tuple(int(v) for v in rest) for name, *rest in lines}
    in_python = {t.name: (t.bm, t.warps, t.stages, t.min_blocks) for t in TILES}
    assert in_source == in_python
    # the in-place and table twins: one per tile, with the tile's parameters
    for macro, name_of in (("FUSED_AT_KERNEL", at_name), ("FUSED_TABLE_KERNEL", tab_name)):
        twins = re.findall(rf"^{macro}\((\w+),\s*(\d+),\s*(\d+),\s*(\d+),\s*(\d+)\)",
                           FUSED_SOURCE.read_text(), re.M)
        assert {name: tuple(int(v) for v in rest) for name, *rest in twins} == {
            name_of(t): in_python[t.name] for t in TILES}, macro


def test_tiles_fit_the_hardware():
    for t in TILES:
        assert t.bm in (16, 32, 64) and t.bn == 128 and t.threads == 256, t
        assert t.smem <= 163 * 1024, t  # sm_80's per-block limit
        # sm_90 per SM: dynamic + the 1 KiB grid table + 1 KiB reserved, per block
        assert t.min_blocks * (t.smem + 2048) <= 228 * 1024, t


@pytest.mark.skipif(not nvcc_available(), reason="nvcc not found")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_kernels_fit_their_register_budget(tmp_path, arch):
    """Every tile, and its in-place and table twins, keeps its min_blocks per SM without
    spilling (ptxas -v); the source defines exactly those kernels."""
    assert_fits_registers(FUSED_SOURCE, arch,
                          {**TILES_BY_NAME, **{at_name(t): t for t in TILES},
                           **{tab_name(t): t for t in TILES}}, tmp_path)


def test_pick_tile_covers_short_prompts():
    picked = [pick_tile(h).bm for h in (0, 1, 16, 17, 32, 33, 64, 65, 10 ** 6)]
    assert picked == [16, 16, 16, 32, 32, 64, 64, 64, 64]


def test_native_image_bytes():
    assert native_image_bytes(1536, 2048) == 1536 * 8 * 98 == IQ3.layout(2048, 768).gate_up_bytes
    assert native_image_bytes(4096, 1536) == IQ3.layout(4096, 1536).down_bytes
    for m, k in ((128, 100), (128, 0), (0, 256)):
        with pytest.raises(FormatError, match=f"m={m}, k={k}"):
            native_image_bytes(m, k)


def test_variant_object():
    assert F16_FUSED in IQ3.mmq_variants() and IQ3.mmq_variants()[0] == "f16_gemm"
    assert type(FUSED) is IQ3XXS and FUSED.variant == F16_FUSED
    assert FUSED.for_variant(F16_FUSED) is FUSED
    assert FUSED.for_variant(None).variant == "f16_gemm"
    assert FUSED.for_variant("int8").variant == "int8" and FUSED.variant == F16_FUSED
    assert FUSED.activation is F16 and not FUSED.exact and FUSED.native
    assert FUSED.name == IQ3.name and FUSED.ggml_type == IQ3.ggml_type
    assert FUSED.image_dtype is np.float16
    assert FUSED.kernel_sources() == [FUSED_SOURCE]
    assert FUSED.kernels_class() is IQ3XXSF16Kernels
    assert repr(FUSED) == "<IQ3XXS iq3_xxs (f16_fused)>"
    for h, f in ((512, 256), (2048, 768), (4096, 1536)):
        assert FUSED.layout(h, f) == IQ3.layout(h, f)  # native images: byte-copy gathers


@pytest.mark.parametrize("hidden,ffn", [(512, 256), (2048, 768)])
def test_images_and_image_matrix(rng, hidden, ffn):
    blob = _blob(rng, hidden, ffn, overflow=True)
    gu, dn = FUSED.images(blob, hidden, ffn)
    want_gu, want_dn = IQ3.images(blob, hidden, ffn)
    assert np.array_equal(gu, want_gu) and np.array_equal(dn, want_dn)
    gate, up, down = IQ3.unpack_expert(blob, hidden, ffn)
    f16_gu, f16_dn = dequant_iq3_images(blob, hidden, ffn)
    with np.errstate(over="ignore"):
        for img, rows, cols, exact, f16 in ((gu, 2 * ffn, hidden, np.vstack([gate, up]), f16_gu),
                                            (dn, hidden, ffn, down, f16_dn)):
            got = FUSED.image_matrix(img, rows, cols)
            assert got.dtype == np.float32 and got.shape == (rows, cols)
            assert np.array_equal(got, exact.astype(np.float16).astype(np.float32))
            # the same fp16 bits as f16_gemm's images (signed zeros and infinities included)
            bits = native_images_to_f16(img, 1, rows, cols)[0].view(np.uint16).reshape(-1)
            assert np.array_equal(bits, f16.view(np.uint16))
            assert np.isinf(got).any() and (bits == 0x8000).any()
    with pytest.raises(FormatError, match="takes"):
        native_images_to_f16(gu[:-98], 1, 2 * ffn, hidden)


@pytest.mark.parametrize("part", ["gate_up", "down"])
def test_reference_is_f16_gemm_reference_on_the_decoded_blocks(rng, part):
    hidden, ffn = 512, 256
    m, k = _parts(hidden, ffn)[part]
    counts = [3, 0, 17, 1, 5]
    ids = (0, 1, 2, 4)  # expert 3 (one row) is outside the group
    bounds = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    blobs = [_blob(rng, hidden, ffn) for _ in ids]
    native = np.stack([_native(b, hidden, ffn, part) for b in blobs])
    f16 = np.stack([dequant_iq3_images(b, hidden, ffn)[0 if part == "gate_up" else 1]
                    for b in blobs])
    x = FUSED.prepare_activations(rng.standard_normal((int(bounds[-1]), k), dtype=np.float32))
    got = FUSED.mmq_reference(native, ids, x, bounds, m, k)
    want = GEMM.mmq_reference(f16, ids, x, bounds, m, k)
    assert got.dtype == np.float32 and got.shape == (int(bounds[-1]), m)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert not got[20:21].any() and got[:3].any()


def _recording() -> tuple[FusedGemm, dict[str, RecordingKernel]]:
    fg = FusedGemm.__new__(FusedGemm)  # the launch logic without a device
    fg._kernels = {t.name: RecordingKernel() for t in TILES}
    fg._at = {t.name: RecordingKernel() for t in TILES}
    fg._tab = {t.name: RecordingKernel() for t in TILES}
    return fg, fg._kernels


@pytest.mark.parametrize("hint,tile,rows_tiles", [
    (1, "iq3_fused_m16", 1), (20, "iq3_fused_m32", 1), (300, "iq3_fused_m64", 5)])
def test_in_place_launch_geometry_and_arguments(hint, tile, rows_tiles):
    """gemm_at: the tile gemm would take, its in-place twin launched with the 16 image
    addresses (unused ones 0) before the expert ids; gemm's kernels untouched."""
    fg, kern = _recording()
    srcs = [1 << 20, 7 << 20, 3 << 20]
    fg.gemm_at(None, srcs, (3, 5, 9), 8192, 12288, 16384, 1536, 2048, hint)
    (call,) = fg._at[tile].calls
    assert call.grid == (1536 // 128, 3, rows_tiles) and call.block == (256, 1, 1)
    assert call.shared == TILES_BY_NAME[tile].smem
    assert call.args == (*srcs, *([0] * 13), 3, 5, 9, *([-1] * 13), 8192, 12288, 16384, 1536,
                         2048)
    assert sum(len(k.calls) for k in fg._at.values()) == 1
    assert not any(k.calls for k in kern.values())


@pytest.mark.parametrize("change,match", [
    ({"sources": [1 << 20]}, "1 image addresses for 2 experts"),
    ({"sources": [1 << 20, (2 << 20) + 8]}, "image 1"),
    ({"m": 1000}, "m=1000"),
    ({"k": 2048 + 64}, "k=2112"),
    ({"acts": 8200}, "acts"),
    ({"expert_ids": (2, -1)}, "-1"),
])
def test_in_place_argument_checks(change, match):
    fg, _ = _recording()
    args = {"stream": None, "sources": [1 << 20, 2 << 20], "expert_ids": (1, 2), "acts": 8192,
            "bounds": 12288, "out": 16384, "m": 1536, "k": 2048, "rows_hint": 16, **change}
    with pytest.raises(FormatError, match=match):
        fg.gemm_at(**args)
    assert not any(k.calls for k in fg._at.values())


@pytest.mark.parametrize("hint,tile,rows_tiles", [
    (1, "iq3_fused_m16", 1), (20, "iq3_fused_m32", 1), (300, "iq3_fused_m64", 5),
    (0, "iq3_fused_m16", 1)])
def test_table_launch_geometry_and_arguments(hint, tile, rows_tiles):
    """gemm_table: the tile gemm_at would take, its table twin launched over every expert of
    the layer (grid.y) with (table, offset, acts, bounds, out, m, k); nothing else launched."""
    fg, kern = _recording()
    fg.gemm_table(None, 1 << 20, 4096, 8192, 12288, 16384, 1536, 2048, hint, 128)
    (call,) = fg._tab[tile].calls
    assert call.grid == (1536 // 128, 128, rows_tiles) and call.block == (256, 1, 1)
    assert call.shared == TILES_BY_NAME[tile].smem
    assert call.args == (1 << 20, 4096, 8192, 12288, 16384, 1536, 2048)
    fg.gemm_table(None, 1 << 20, 0, 8192, 12288, 16384, 2048, 768, hint, 1, tile="iq3_fused_m16")
    assert fg._tab["iq3_fused_m16"].calls[-1].grid[:2] == (2048 // 128, 1)
    assert sum(len(k.calls) for k in fg._tab.values()) == 2
    assert not any(k.calls for k in [*kern.values(), *fg._at.values()])


@pytest.mark.parametrize("change,match", [
    ({"table": (1 << 20) + 4}, "not a nonzero multiple of 8"),
    ({"table": 0}, "not a nonzero multiple of 8"),
    ({"offset": 4104}, "offset 4104"),
    ({"offset": -16}, "offset -16"),
    ({"n_experts": 0}, "got 0"),
    ({"n_experts": 65536}, "got 65536"),
    ({"m": 1000}, "m=1000"),
    ({"k": 2048 + 64}, "k=2112"),
    ({"acts": 8200}, "acts"),
    ({"out": 16388}, "out"),
    ({"rows_hint": -1}, "-1"),
    ({"tile": "iq3_fused_tab_m16"}, "iq3_fused_tab_m16"),
    ({"m": 1 << 24, "k": 256, "n_experts": 65535}, "32-bit block numbering"),
])
def test_table_argument_checks(change, match):
    fg, _ = _recording()
    args = {"stream": None, "table": 1 << 20, "offset": 4096, "acts": 8192, "bounds": 12288,
            "out": 16384, "m": 1536, "k": 2048, "rows_hint": 16, "n_experts": 128, **change}
    with pytest.raises(FormatError, match=re.escape(match)):
        fg.gemm_table(**args)
    assert not any(k.calls for k in fg._tab.values())


@pytest.mark.parametrize("hint,tile,rows_tiles", [
    (1, "iq3_fused_m16", 1), (16, "iq3_fused_m16", 1), (17, "iq3_fused_m32", 1),
    (40, "iq3_fused_m64", 1), (300, "iq3_fused_m64", 5), (0, "iq3_fused_m16", 1)])
def test_launch_geometry_and_arguments(hint, tile, rows_tiles):
    fg, kern = _recording()
    fg.gemm(None, 4096, (3, 5, 9), 8192, 12288, 16384, 1536, 2048, hint)
    (call,) = kern[tile].calls
    assert call.grid == (1536 // 128, 3, rows_tiles) and call.block == (256, 1, 1)
    assert call.shared == TILES_BY_NAME[tile].smem
    assert call.args == (3, 5, 9, *([-1] * 13), 4096, 8192, 12288, 16384, 1536, 2048)
    assert sum(len(k.calls) for k in kern.values()) == 1


def test_explicit_tile():
    fg, kern = _recording()
    fg.gemm(None, 4096, (1,), 8192, 12288, 16384, 2048, 768, 200, tile="iq3_fused_m16")
    (call,) = kern["iq3_fused_m16"].calls
    assert call.grid == (16, 1, 13)


@pytest.mark.parametrize("change,match", [
    ({"m": 1000}, "m=1000"),
    ({"k": 2048 + 64}, "k=2112"),
    ({"expert_ids": tuple(range(17))}, "1..16"),
    ({"expert_ids": (2, -1)}, "-1"),
    ({"acts": 8200}, "acts"),
    ({"weights": 4098}, "weights"),
    ({"out": 16388}, "out"),
    ({"rows_hint": -1}, "-1"),
    ({"tile": "gemm_f16_m32"}, "gemm_f16_m32"),
])
def test_argument_checks(change, match):
    fg, kern = _recording()
    assert_refused(fg, kern, change, match)


def test_launchers_copy_blocks_and_run_the_fused_kernel():
    """The variant's launchers: the byte-copy gathers (batched too) and one fused launch per
    mmq, prepared with the MMQ argument types."""
    rec = Recorder()
    lay = FUSED.layout(2048, 768)
    kern = FUSED.kernels(rec, lay)  # type: ignore[arg-type]
    assert isinstance(kern, IQ3XXSF16Kernels)
    assert set(TILES_BY_NAME) <= set(rec.kernels)
    assert all(rec.kernels[tab_name(t)] == MMQ_TABLE_ARG_TYPES for t in TILES)
    assert {"gather_one", "gather_batch"} <= set(rec.kernels)
    kern.gather_batch(None, [1 << 20, 2 << 20], 3, 1 << 30, 2 << 30)
    kern.mmq(None, 1 << 30, (7, 8), 3 << 30, 4 << 30, 5 << 30, 1536, 2048, 20)
    names = [launch.name for launch in rec.launches]
    assert names == ["gather_batch", "iq3_fused_m32"]
    # after the 16 sources: the group buffers, the blob ranges, the native image sizes, the
    # first position (a byte copy: images are the ranges)
    assert rec.launches[0].args[16:25] == (
        1 << 30, 2 << 30, lay.gate_up_offset, lay.gate_up_bytes, lay.down_offset,
        lay.down_bytes, lay.gate_up_bytes, lay.down_bytes, 3)
    assert lay.gate_up_image_bytes == native_image_bytes(1536, 2048)


def test_table_products_run_the_iq3_table_kernel():
    """mmq_table on the IQ3_XXS fp16 variant launches fused.cu's own table kernel (not the
    generic GGML template's), with the table, the part's offset and a grid over every expert."""
    rec = Recorder()
    lay = FUSED.layout(2048, 768)
    kern = FUSED.kernels(rec, lay)  # type: ignore[arg-type]
    kern.mmq_table(None, 1 << 30, lay.down_offset, 3 << 30, 4 << 30, 5 << 30, 2048, 768, 20,
                   128)
    (launch,) = rec.launches
    assert launch.name == "iq3_fused_tab_m32"
    assert launch.args[:2] == (1 << 30, lay.down_offset)


# ------------------------------------------------------------------------------ GPU
#: (hidden, ffn, part, rows of each of the layer's experts, the group's expert ids): both
#: geometries, gate/up (m = 2*ffn, k = hidden) and down (m = hidden, k = ffn); 0, 1, odd and
#: tile-straddling rows; full groups of 16; one expert holding every row; a group of one;
#: experts outside the group; nothing to do
FUSED_CASES = [
    (2048, 768, "gate_up", [0, 1, 7, 33, 64, 65, 17, 3, 0, 300, 2, 31, 96, 160, 5, 16, 1],
     tuple(range(16))),
    (2048, 768, "down", [5, 0, 1, 70, 3, 129, 0, 17], (0, 1, 2, 3, 5, 7)),
    (4096, 1536, "gate_up", [0, 200, 1, 0, 61], (1, 2, 4)),
    (4096, 1536, "down", [15, 0, 1, 33, 2, 9, 64, 3, 0, 48, 1, 17, 31, 5, 130, 7],
     tuple(range(16))),
    (2048, 768, "gate_up", [0, 0, 700, 0, 0, 0], (0, 1, 2, 3, 4)),
    (4096, 1536, "down", [4, 1000, 4], (1,)),
    (2048, 768, "down", [1], (0,)),
    (512, 256, "gate_up", [0, 0, 0], (0, 1, 2)),
]


#: run(out pointer) into a NaN-poisoned output; the raw uint32 words [rows, m]
_launch = launch_poisoned


@pytest.mark.gpu
@pytest.mark.parametrize("hidden,ffn,part,counts,ids", FUSED_CASES)
def test_gpu_fused_is_f16_gemm_byte_for_byte(rt, rng, hidden, ffn, part, counts, ids):
    """The fused kernel on group-buffer images and its in-place twin on images scattered
    over separate allocations: every tile and rows_hint gives f16_gemm's bytes."""
    m, k = _parts(hidden, ffn)[part]
    bounds = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    rows = int(bounds[-1])
    blobs = [_blob(rng, hidden, ffn) for _ in ids]
    native = np.stack([_native(b, hidden, ffn, part) for b in blobs])
    f16 = np.stack([dequant_iq3_images(b, hidden, ffn)[0 if part == "gate_up" else 1]
                    for b in blobs])
    x32 = rng.standard_normal((rows, k), dtype=np.float32)
    if rows:
        x32[rng.integers(rows)] *= 40.0  # an outlier row
    x = x32.astype(np.float16)
    exact_rows = max(1, max(int(bounds[e + 1] - bounds[e]) for e in ids))

    s = rt.stream("test")
    fg, gg = FusedGemm(rt), GroupedGemm(rt, iq3_gather=False)
    bufs = [upload(rt, s, a) for a in (native, f16, x if rows else np.zeros(8, np.float16),
                                       bounds)]
    d_native, d_f16, d_x, d_bounds = (b.ptr for b in bufs)
    # in place: each image in an allocation of its own, allocated last position first, so
    # the addresses are neither contiguous nor in position order
    apart = [upload(rt, s, native[p]) for p in reversed(range(len(ids)))][::-1]
    bufs += apart
    try:
        def fused(hint, tile=None):
            return _launch(rt, s, lambda out: fg.gemm(s, d_native, ids, d_x, d_bounds, out, m, k,
                                                      hint, tile=tile), rows, m)

        def in_place(hint, tile=None):
            return _launch(rt, s, lambda out: fg.gemm_at(s, [b.ptr for b in apart], ids, d_x,
                                                         d_bounds, out, m, k, hint, tile=tile),
                           rows, m)

        baseline = _launch(rt, s, lambda out: gg.gemm(s, d_f16, ids, d_x, d_bounds, out, m, k,
                                                      exact_rows), rows, m)
        outs = [fused(h) for h in (exact_rows, 1, 4 * exact_rows + 100)]
        outs += [fused(exact_rows, t.name) for t in TILES] + [fused(exact_rows)]  # + a repeat
        outs += [in_place(h) for h in (exact_rows, 1)]
        outs += [in_place(exact_rows, t.name) for t in TILES]
    finally:
        for b in bufs:
            b.free()

    inside = np.zeros(rows, bool)
    for e in ids:
        inside[bounds[e]: bounds[e + 1]] = True
    raw = outs[0]
    assert np.all(raw[~inside] == NAN_F32), "rows of experts outside the group were written"
    for i, other in enumerate(outs):
        bad = np.argwhere(other != baseline)
        assert bad.size == 0, (f"fused launch {i}: {len(bad)} value(s) differ from f16_gemm's, "
                               f"first at (row, col) {tuple(bad[0])}")
    if not inside.any():
        return
    got = raw[inside].view(np.float32)
    assert np.isfinite(got).all(), "rows of the group's experts left unwritten or not finite"
    want = fused_reference(native, ids, x, bounds, m, k)[inside]
    err = nmse(got, want)
    print(f"f16_fused {part} {hidden}/{ffn}: same bytes as f16_gemm; NMSE {err:.3g} vs float64 "
          "of the same fp16 inputs")
    assert err <= GEMM_NMSE


#: experts of the layer a table launch covers
TABLE_EXPERTS = 128


def _random_native(rng, n: int, m: int, k: int) -> np.ndarray:
    """n native images [n, bytes] of random blocks (every grid index, sign word and scale
    nibble is a valid IQ3_XXS block), each block's fp16 d within +-0.02 so products stay
    finite."""
    blocks = rng.integers(0, 256, (n, m * (k // 256), IQ3_BLOCK_BYTES), dtype=np.uint8)
    d = rng.uniform(-0.02, 0.02, blocks.shape[:2]).astype("<f2")
    blocks[:, :, :2] = d.view(np.uint8).reshape(*d.shape, 2)
    return blocks.reshape(n, -1)


@pytest.mark.gpu
@pytest.mark.parametrize("offset", [0, 4096])
@pytest.mark.parametrize("part", ["gate_up", "down"])
def test_gpu_table_is_in_place_byte_for_byte(rt, rng, part, offset):
    """One table launch over a layer of 128 experts gives every expert the bytes of the
    in-place launches (groups of 16) on the same images, for every tile and rows_hint: rows
    routed unevenly (a third of the experts without rows, one over three 64-row tiles), each
    image `offset` bytes into its blob and the blobs scattered over one device buffer (the
    gaps 0xFF: NaN scales if read), and a random subset of experts (two with rows at least)
    left out of the table (entry 0): their rows stay poisoned."""
    hidden, ffn = 2048, 768
    m, k = _parts(hidden, ffn)[part]
    n = TABLE_EXPERTS
    counts = rng.integers(1, 24, n)
    counts[rng.random(n) < 0.35] = 0
    big = int(rng.integers(n))
    counts[big] = 150
    bounds = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    rows, exact = int(bounds[-1]), int(counts.max())
    skipped = rng.random(n) < 0.2
    with_rows = np.flatnonzero(counts)
    skipped[rng.choice(with_rows[with_rows != big], 2, replace=False)] = True
    skipped[big] = False
    native = _random_native(rng, n, m, k)
    img = native.shape[1]
    assert img == native_image_bytes(m, k)
    # blob e at slot perm[e] of a pool with spare slots, its image `offset` bytes into it
    stride = -(-(offset + img) // 256) * 256 + 256
    perm = rng.permutation(n + 32)[:n]
    pool = np.full((n + 32) * stride, 0xFF, np.uint8)
    for e in range(n):
        pool[perm[e] * stride + offset: perm[e] * stride + offset + img] = native[e]
    x = rng.standard_normal((rows, k), dtype=np.float32).astype(np.float16)

    s = rt.stream("test")
    fg = FusedGemm(rt)
    bufs = [upload(rt, s, a) for a in (pool, x, bounds)]
    d_pool, d_x, d_bounds = (b.ptr for b in bufs)
    blob = [d_pool + int(perm[e]) * stride for e in range(n)]
    table = np.array([0 if skipped[e] else blob[e] for e in range(n)], np.uint64)
    bufs.append(upload(rt, s, table))
    d_table = bufs[-1].ptr
    live = [e for e in range(n) if not skipped[e]]
    try:
        def in_place(out):
            for g in range(0, len(live), MMQ_GROUP):
                ids = tuple(live[g: g + MMQ_GROUP])
                fg.gemm_at(s, [blob[e] + offset for e in ids], ids, d_x, d_bounds, out, m, k,
                           exact)

        def tab(hint, tile=None):
            return _launch(rt, s, lambda out: fg.gemm_table(s, d_table, offset, d_x, d_bounds,
                                                            out, m, k, hint, n, tile=tile),
                           rows, m)

        baseline = _launch(rt, s, in_place, rows, m)
        outs = [tab(h) for h in (exact, 1, 40)] + [tab(exact, t.name) for t in TILES]
    finally:
        for b in bufs:
            b.free()

    out_rows = np.zeros(rows, bool)
    for e in np.flatnonzero(skipped):
        out_rows[bounds[e]: bounds[e + 1]] = True
    assert out_rows.any() and np.all(baseline[out_rows] == NAN_F32)
    assert np.isfinite(baseline[~out_rows].view(np.float32)).all(), "a routed row unwritten"
    for i, got in enumerate(outs):
        assert np.all(got[out_rows] == NAN_F32), f"table launch {i} wrote a skipped expert's rows"
        bad = np.argwhere(got != baseline)
        assert bad.size == 0, (f"table launch {i}: {len(bad)} value(s) differ from the in-place "
                               f"launches', first at (row, col) {tuple(bad[0])}")
    r0, r1 = int(bounds[big]), int(bounds[big + 1])
    want = fused_reference(native[big][None], (0,), x[r0:r1], np.array([0, r1 - r0], np.int32),
                           m, k)
    assert nmse(baseline[r0:r1].view(np.float32), want) <= GEMM_NMSE


@pytest.mark.gpu
@pytest.mark.parametrize("hidden,ffn", [(2048, 768), (4096, 1536)])
def test_gpu_fused_end_to_end_through_the_variant(rt, rng, hidden, ffn):
    """The variant as the engine runs it (byte-copy batched gather, device fp16 activations,
    fused MMQ) against float64 products of the exact weights and float32 activations."""
    from strata_rt.formats.activations import ActivationKernels

    s = rt.stream("test")
    lay = FUSED.layout(hidden, ffn)
    kern = FUSED.kernels(rt, lay)
    n = 5
    blobs = np.stack([IQ3.random_expert(rng, hidden, ffn) for _ in range(n)])
    slots = np.zeros((n, lay.slot_bytes), np.uint8)
    slots[:, : lay.blob_bytes] = blobs
    counts = [int(c) for c in rng.integers(0, 90, n)]
    counts[0], counts[1] = 0, 1
    bounds = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    rows, ids = int(bounds[-1]), tuple(range(n))
    src, d_bounds = upload(rt, s, slots), upload(rt, s, bounds)
    gu = rt.alloc(n * lay.gate_up_image_bytes)
    dn = rt.alloc(n * lay.down_image_bytes)
    acts = rt.alloc(F16.nbytes(rows, max(hidden, ffn)))
    try:
        kern.gather_batch(s, [src.ptr + p * lay.slot_bytes for p in ids], 0, gu.ptr, dn.ptr)
        for part, buf in (("gate_up", gu), ("down", dn)):
            m, k = _parts(hidden, ffn)[part]
            x32 = rng.standard_normal((rows, k), dtype=np.float32)
            dx = upload(rt, s, x32)
            ActivationKernels(rt).launch(F16, s, dx.ptr, k, 0, acts.ptr, rows, k)
            got = _launch(rt, s, lambda out, w=buf.ptr, m=m, k=k: kern.mmq(
                s, w, ids, acts.ptr, d_bounds.ptr, out, m, k, max(counts)), rows, m)
            dx.free()
            got = got.view(np.float32)
            exact = np.zeros((rows, m))
            for p in ids:
                w = IQ3.unpack_expert(blobs[p], hidden, ffn)
                w = np.vstack(w[:2]) if part == "gate_up" else w[2]
                r0, r1 = bounds[p], bounds[p + 1]
                exact[r0:r1] = x32[r0:r1].astype(np.float64) @ w.astype(np.float64).T
            e64 = nmse(got, exact)
            print(f"f16_fused {part} {hidden}/{ffn}: NMSE {e64:.3g} vs float64 of the exact "
                  "weights and float32 activations")
            assert e64 <= FLOAT64_NMSE_BOUND
    finally:
        for b in (src, d_bounds, gu, dn, acts):
            b.free()


def test_reference_helper_rejects_other_activations(rng):
    native = np.zeros((1, native_image_bytes(128, 256)), np.uint8)
    with pytest.raises(FormatError, match="float16"):
        fused_reference(native, (0,), np.zeros((1, 256), np.float32),
                        np.array([0, 1], np.int32), 128, 256)
    assert not gemm_reference(np.zeros((1, 128, 256), np.float16), (0,),
                              np.zeros((1, 256), np.float16), np.array([0, 1], np.int32),
                              128, 256).any()

"""IQ3_XXS on the GPU: gathers (one and batched) byte for byte, and every exact MMQ variant
(f16_pipe, f16, int8, int8_occ2; each through its own format object, IQ3XXS(variant)) bit for
bit against the numpy reference, against float64, and against itself on a repeat. The default
variant, f16_gemm, is tested in test_variants.py and test_gemm_f16.py."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from _format_harness import run_mmq, untouched, upload
from _iq3_blocks import QWEN3_30B, SMALL, case, group_of

from strata_rt.errors import FormatError
from strata_rt.formats.contract import ExpertLayout
from strata_rt.formats.launchers import NativeKernels
from strata_rt.formats.numerics import nmse
from strata_rt.quants.iq3_xxs import IQ3XXS
from strata_rt.quants.iq3_xxs_device import MMQ_VARIANTS, IQ3XXSKernels

pytestmark = pytest.mark.gpu
FMT = IQ3XXS("f16_pipe")  # the exact kernels: native images, q8_1 activations


# ------------------------------------------------------------------------------ gathers
def odd_layout() -> ExpertLayout:
    """A native layout whose sizes and offsets are not multiples of 16 (forces the fallback)."""
    gu, dn = 4099, 1203
    return ExpertLayout(hidden=0, ffn=0, gate_up_offset=7, gate_up_bytes=gu,
                        down_offset=7 + gu + 5, down_bytes=dn, blob_bytes=7 + gu + 5 + dn + 3,
                        gate_up_image_bytes=gu + 13, down_image_bytes=dn + 1)


def gather_both(rt, rng, lay: ExpertLayout, n: int, first: int, src_shift: int,
                kern_cls=NativeKernels):
    """Runs gather_batch and n single gathers into equal random-prefilled buffers; returns
    (batched gu, batched down, single gu, single down, sources host bytes, src offsets, kern)."""
    stream = rt.stream("test")
    kern = kern_cls(FMT, rt, lay)
    pitch = lay.slot_bytes + 64
    src = rng.integers(0, 256, 16 * pitch + 64, dtype=np.uint8)
    offs = [int(rng.integers(0, 16)) * pitch + src_shift for _ in range(n)]
    gu0 = rng.integers(0, 256, 16 * lay.gate_up_image_bytes, dtype=np.uint8)
    dn0 = rng.integers(0, 256, 16 * lay.down_image_bytes, dtype=np.uint8)
    bufs = [upload(rt, stream, a) for a in (src, gu0, dn0, gu0, dn0)]
    try:
        base = bufs[0].ptr
        kern.gather_batch(stream, [base + o for o in offs], first, bufs[1].ptr, bufs[2].ptr)
        for i, o in enumerate(offs):
            kern.gather(stream, base + o, first + i, bufs[3].ptr, bufs[4].ptr)
        got = [np.empty_like(a) for a in (gu0, dn0, gu0, dn0)]
        for h, b in zip(got, bufs[1:]):
            rt.memcpy_dtoh(h, b.ptr, stream)
        stream.synchronize()
    finally:
        for b in bufs:
            b.free()
    return (*got, src, offs, kern, gu0, dn0)


def expected(lay, src, offs, first, gu0, dn0):
    gu, dn = gu0.copy(), dn0.copy()
    for i, o in enumerate(offs):
        p = first + i
        gu[p * lay.gate_up_image_bytes: p * lay.gate_up_image_bytes + lay.gate_up_bytes] = \
            src[o + lay.gate_up_offset: o + lay.gate_up_offset + lay.gate_up_bytes]
        dn[p * lay.down_image_bytes: p * lay.down_image_bytes + lay.down_bytes] = \
            src[o + lay.down_offset: o + lay.down_offset + lay.down_bytes]
    return gu, dn


@pytest.mark.parametrize("n,first", [(1, 0), (3, 5), (7, 9), (16, 0), (1, 15)])
@pytest.mark.parametrize("dims", [SMALL, QWEN3_30B], ids=["small", "qwen3_30b"])
def test_gather_batch_equals_single_gathers(rt, rng, n, first, dims):
    lay = FMT.layout(*dims)
    if dims == QWEN3_30B:
        assert lay.blob_bytes == 1_806_336
    bgu, bdn, sgu, sdn, src, offs, kern, gu0, dn0 = gather_both(rt, rng, lay, n, first, 0)
    assert kern.fallbacks == 0
    assert np.array_equal(bgu, sgu) and np.array_equal(bdn, sdn)
    wgu, wdn = expected(lay, src, offs, first, gu0, dn0)
    assert np.array_equal(bgu, wgu) and np.array_equal(bdn, wdn)


@pytest.mark.parametrize("shift", [1, 2, 8])
def test_gather_batch_misaligned_sources_fall_back(rt, rng, caplog, shift):
    lay = FMT.layout(*SMALL)
    with caplog.at_level(logging.WARNING, logger="strata_rt.formats.launchers"):
        bgu, bdn, sgu, sdn, src, offs, kern, gu0, dn0 = gather_both(rt, rng, lay, 6, 4, shift)
    assert "falls back" in caplog.text and "not a multiple of 16" in caplog.text
    assert kern.fallbacks == 1
    assert np.array_equal(bgu, sgu) and np.array_equal(bdn, sdn)
    wgu, wdn = expected(lay, src, offs, 4, gu0, dn0)
    assert np.array_equal(bgu, wgu) and np.array_equal(bdn, wdn)


def test_gather_sizes_not_multiple_of_16(rt, rng, caplog):
    lay = odd_layout()
    with caplog.at_level(logging.WARNING, logger="strata_rt.formats.launchers"):
        bgu, bdn, sgu, sdn, src, offs, kern, gu0, dn0 = gather_both(rt, rng, lay, 16, 0, 3)
    assert "gate/up bytes = 4099" in caplog.text
    assert kern.fallbacks == 1
    wgu, wdn = expected(lay, src, offs, 0, gu0, dn0)
    assert np.array_equal(bgu, wgu) and np.array_equal(bdn, wdn)
    assert np.array_equal(sgu, wgu) and np.array_equal(sdn, wdn)


# ------------------------------------------------------------------------------ MMQ
MMQ_ROWS = {
    "zero_one_odd": [0, 1, 37, 3, 0],
    "tile_edges": [31, 32, 33, 64, 65, 127, 128, 129, 200],
    "full_group": [5, 0, 17, 1, 40, 2, 0, 9, 33, 3, 7, 0, 11, 64, 1, 300],
}


def check_mmq(rt, c, variant: str, monkeypatch) -> None:
    # the launcher takes the variant from the format object; an environment naming another
    # one must not matter
    monkeypatch.setenv("STRATA_MMQ_KERNEL", "int8" if variant != "int8" else "f16_pipe")
    c.fmt = FMT.for_variant(variant)
    assert c.fmt.variant == variant and c.fmt.exact
    want = c.reference()
    got = run_mmq(rt, c)
    again = run_mmq(rt, c)
    mask = c.group_rows()
    assert untouched(got, ~mask), "rows outside the group were written"
    bad = np.argwhere(got[mask].view(np.uint32) != want[mask].view(np.uint32))
    assert bad.size == 0, (f"{variant}: {len(bad)} elements differ from the reference, first "
                           f"at {bad[0].tolist()}: {got[mask][tuple(bad[0])]!r} vs "
                           f"{want[mask][tuple(bad[0])]!r}")
    assert np.array_equal(got.view(np.uint32), again.view(np.uint32)), "repeat differs"
    if mask.any():
        assert nmse(got[mask], c.float64_product()[mask]) <= 5e-4


@pytest.mark.parametrize("variant", MMQ_VARIANTS)
@pytest.mark.parametrize("part", ["gate_up", "down"])
@pytest.mark.parametrize("rows", list(MMQ_ROWS), ids=list(MMQ_ROWS))
def test_mmq_bit_exact_small(rt, rng, monkeypatch, variant, part, rows):
    counts, ids = group_of([2, 0, 5], MMQ_ROWS[rows], rng)
    check_mmq(rt, case(rng, SMALL, part, counts, ids), variant, monkeypatch)


@pytest.mark.parametrize("variant", MMQ_VARIANTS)
@pytest.mark.parametrize("part", ["gate_up", "down"])
def test_mmq_bit_exact_qwen3_shapes(rt, rng, monkeypatch, variant, part):
    counts, ids = group_of([0, 3], [5, 0, 150, 64, 1], rng, n_layer=12)
    c = case(rng, QWEN3_30B, part, counts, ids)
    assert (c.m, c.k) == ((1536, 2048) if part == "gate_up" else (2048, 768))
    check_mmq(rt, c, variant, monkeypatch)


class LowHint:
    """A case whose rows_hint understates the rows: the kernel's row-tile loop must cover."""

    def __init__(self, base):
        self.base = base

    def __getattr__(self, name):
        return getattr(self.base, name)

    def rows_hint(self) -> int:
        return 1


@pytest.mark.parametrize("variant", MMQ_VARIANTS)
def test_mmq_rows_hint_too_small_still_exact(rt, rng, monkeypatch, variant):
    counts, ids = group_of([1], [150, 7, 70], rng, n_layer=6)
    check_mmq(rt, LowHint(case(rng, SMALL, "gate_up", counts, ids)), variant, monkeypatch)


def test_mmq_refuses_bad_shapes(rt):
    kern = IQ3XXSKernels(FMT, rt, FMT.layout(*SMALL), variant="int8")
    assert kern.variant == "int8" and isinstance(kern, NativeKernels)
    stream = rt.stream("test")
    with pytest.raises(FormatError, match="m % 128"):
        kern.mmq(stream, 0, (0,), 0, 0, 0, 200, 512, 4)
    with pytest.raises(FormatError, match="1..16"):
        kern.mmq(stream, 0, tuple(range(17)), 0, 0, 0, 256, 512, 4)

"""The batched dequantizing gather of every GGML type (kernels/ggml/gather.cu) on the GPU: fresh
random blocks (finite scales) of each type, read from unaligned addresses (F32, whose stage
reads depend on the source's alignment, from every address residue modulo 16), gathered into
poisoned fp16 images, compared with gguf.quants.dequantize rounded to fp16, bit for bit (NaN
where the reference has NaN: the float types carry NaN patterns, whose payload the device need
not keep). Members with address 0, and members the routing gave no rows, keep the poison;
nothing outside the images is written.

Run: python -m pytest -q -m gpu tests/test_ggml_gather_gpu.py
"""

from __future__ import annotations

import numpy as np
import pytest
from _ggml_blocks import random_blocks

from strata_rt.errors import FormatError
from strata_rt.formats.ggml_types import TYPES, GgmlType, ggml_type
from strata_rt.gemm.ggml_gather import GgmlGather, image_bytes, images_reference

pytestmark = pytest.mark.gpu
#: the byte every output buffer starts as; what the gather must not write is compared with it
#: byte for byte
POISON = 0xA5
IDS = [t.name for t in TYPES]


@pytest.fixture(scope="module")
def gg(rt) -> GgmlGather:
    return GgmlGather(rt)


def expert_blocks(rng: np.random.Generator, t: GgmlType, rows: int, cols: int) -> np.ndarray:
    """One expert's rows x cols matrix of t as raw blocks (uint8, row after row)."""
    nblocks = rows * cols // t.block_values
    return random_blocks(rng, t, nblocks).reshape(-1)


def run_gather(rt, gg: GgmlGather, rng: np.random.Generator, t: GgmlType, rows: int, cols: int,
               present: list[bool], first_pos: int, *, stride_pad: int = 32,
               bounds: np.ndarray | None = None, first_expert: int = 0,
               residues: list[int] | None = None):
    """Uploads one random expert per member, runs one gather into a poisoned 16-position
    buffer; returns (output bytes, stride, each member's raw blocks or None). Member i's
    source address is residues[i] modulo 16 where given, else 1 + 2 * (i % 3) bytes past i
    pitches of the largest member's bytes + 7 (unaligned addresses of several residues)."""
    stream = rt.stream("test")
    stride = image_bytes(rows, cols) + stride_pad
    raws = [expert_blocks(rng, t, rows, cols) if p else None for p in present]
    size = max(r.size for r in raws if r is not None)
    pitch = size + 7 if residues is None else -(-size // 16) * 16 + 16
    src = rng.integers(0, 256, pitch * len(present) + 64, dtype=np.uint8)
    out = np.full(16 * stride + 64, POISON, dtype=np.uint8)
    bufs = [rt.alloc(a.nbytes) for a in (src, out)]
    offs = []
    for i, raw in enumerate(raws):
        if residues is None:
            off = i * pitch + 1 + 2 * (i % 3)
        else:  # pitch is a multiple of 16: the slot's address has the buffer's residue
            off = i * pitch + (residues[i] - bufs[0].ptr) % 16
        offs.append(off)
        if raw is not None:
            src[off:off + raw.size] = raw
    bnd = rt.alloc(bounds.nbytes) if bounds is not None else None
    try:
        rt.memcpy_htod(bufs[0].ptr, src, stream)
        rt.memcpy_htod(bufs[1].ptr, out, stream)
        if bnd is not None:
            rt.memcpy_htod(bnd.ptr, bounds, stream)
        ptrs = [bufs[0].ptr + o if r is not None else 0 for o, r in zip(offs, raws)]
        gg.gather(stream, t, ptrs, bufs[1].ptr, rows, cols, first_pos=first_pos,
                  image_stride=stride, bounds=0 if bnd is None else bnd.ptr,
                  first_expert=first_expert)
        rt.memcpy_dtoh(out, bufs[1].ptr, stream)
        stream.synchronize()
    finally:
        for b in [*bufs, *([bnd] if bnd is not None else [])]:
            b.free()
    return out, stride, raws


def assert_image(t: GgmlType, got_bytes: np.ndarray, raw: np.ndarray, rows: int, cols: int):
    want = images_reference(t, raw, rows, cols).reshape(-1)
    got = got_bytes.view(np.float16)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan), f"{t.name}: NaN positions differ"
    bad = np.flatnonzero(got[~nan].view(np.uint16) != want[~nan].view(np.uint16))
    assert bad.size == 0, (f"{t.name}: {bad.size} of {got.size} values differ; first: got "
                           f"{got[~nan][bad[0]]!r}, want {want[~nan][bad[0]]!r}")


def check_output(t, out, stride, raws, first_pos, rows, cols, written):
    """Each written member's image equals the reference; everything else holds the poison."""
    expect_poison = np.ones(out.size, dtype=bool)
    for i, raw in enumerate(raws):
        if raw is None or not written[i]:
            continue
        start = (first_pos + i) * stride
        assert_image(t, out[start:start + image_bytes(rows, cols)], raw, rows, cols)
        expect_poison[start:start + image_bytes(rows, cols)] = False
    assert (out[expect_poison] == POISON).all(), f"{t.name}: bytes outside the images written"


@pytest.mark.parametrize("name", IDS)
def test_gather_every_type_bit_exact(rt, gg, rng, name):
    t = ggml_type(name)
    rows, cols = 12, 512
    present = [True, True, False, True, True]  # member 2: address 0, skipped
    out, stride, raws = run_gather(rt, gg, rng, t, rows, cols, present, first_pos=3)
    check_output(t, out, stride, raws, 3, rows, cols, present)


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "IQ2_XXS", "IQ1_M", "MXFP4", "Q8_0"])
def test_gather_full_group_of_16(rt, gg, rng, name):
    t = ggml_type(name)
    rows, cols = 40, 2048
    out, stride, raws = run_gather(rt, gg, rng, t, rows, cols, [True] * 16, first_pos=0,
                                   stride_pad=0)
    check_output(t, out, stride, raws, 0, rows, cols, [True] * 16)


@pytest.mark.parametrize("name", ["Q5_K", "IQ3_S", "F16"])
def test_routed_gather_skips_experts_without_rows(rt, gg, rng, name):
    """bounds: experts first_expert.. of the layer; members whose expert got no rows are
    skipped on the device, as the routed gathers of the decode step do."""
    t = ggml_type(name)
    rows, cols = 8, 256
    counts = np.array([0, 3, 0, 1, 2, 0, 5, 1], dtype=np.int32)  # rows per expert of the layer
    bounds = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    first_expert = 2  # members are experts 2..7
    present = [True] * 6
    out, stride, raws = run_gather(rt, gg, rng, t, rows, cols, present, first_pos=0,
                                   bounds=bounds, first_expert=first_expert)
    written = [bool(counts[first_expert + i]) for i in range(6)]
    check_output(t, out, stride, raws, 0, rows, cols, written)


@pytest.mark.parametrize("name,rows,cols", [
    ("Q4_K", 37, 1024), ("Q6_K", 29, 768), ("Q2_K", 41, 512), ("IQ4_NL", 151, 96),
    ("Q8_0", 41, 160), ("F32", 61, 40), ("F16", 173, 24), ("MXFP4", 67, 224)])
def test_gather_steps_many_groups_per_warp(rt, gg, rng, monkeypatch, name, rows, cols):
    """A launch of one block: each warp stages and decodes several steps of groups, the last
    group of each member partial where rows x cols is not a whole number of 256 values (F32,
    F16, IQ4_NL, Q8_0, MXFP4 here), sources at odd addresses."""
    from strata_rt.gemm import ggml_gather

    t = ggml_type(name)
    monkeypatch.setattr(ggml_gather, "GATHER_TARGET_BLOCKS", 1)
    groups = -(-rows * cols // 256)
    assert groups > 8 * ggml_gather.groups_per_step(t)  # more than one step a warp
    present = [True, False, True]
    out, stride, raws = run_gather(rt, gg, rng, t, rows, cols, present, first_pos=13)
    check_output(t, out, stride, raws, 13, rows, cols, present)


@pytest.mark.parametrize("rows,cols", [(61, 40), (64, 64), (129, 264), (3, 8)])
def test_f32_gather_from_every_source_alignment(rt, gg, rng, monkeypatch, rows, cols):
    """F32 reads its stage as 4-byte words, joined by funnel shifts where the source is not
    4-byte aligned: 16 members whose sources are 0 .. 15 bytes past a multiple of 16, one
    block a launch (several steps a warp but for the smallest shape), and a last group of
    136, 256, 8 and 24 values."""
    from strata_rt.gemm import ggml_gather

    t = ggml_type("F32")
    monkeypatch.setattr(ggml_gather, "GATHER_TARGET_BLOCKS", 1)
    present = [True] * 16
    out, stride, raws = run_gather(rt, gg, rng, t, rows, cols, present, first_pos=0,
                                   residues=list(range(16)))
    check_output(t, out, stride, raws, 0, rows, cols, present)


def test_f32_gather_many_blocks_and_skipped_members(rt, gg, rng):
    """F32 over the launcher's own grid (many blocks, one step a warp), members at 16-byte
    aligned, 4-byte aligned and odd sources beside members with address 0."""
    t = ggml_type("F32")
    rows, cols = 96, 2048
    present = [True, False, True, True, False, True]
    out, stride, raws = run_gather(rt, gg, rng, t, rows, cols, present, first_pos=7,
                                   residues=[0, 0, 4, 7, 0, 12])
    check_output(t, out, stride, raws, 7, rows, cols, present)


def test_gate_and_up_of_different_types_fill_one_image(rt, gg, rng):
    """A file's gate and up tensors may differ in type: two launches with the gate/up image's
    stride, the second offset by the gate rows, build the [2*ffn, hidden] image."""
    stream = rt.stream("test")
    ffn, hidden = 16, 512
    gate_t, up_t = ggml_type("Q4_K"), ggml_type("Q6_K")
    gate, up = expert_blocks(rng, gate_t, ffn, hidden), expert_blocks(rng, up_t, ffn, hidden)
    stride = image_bytes(2 * ffn, hidden)
    out = np.full(2 * stride, POISON, dtype=np.uint8)
    bufs = [rt.alloc(a.nbytes) for a in (gate, up, out)]
    try:
        for b, a in zip(bufs, (gate, up, out)):
            rt.memcpy_htod(b.ptr, a, stream)
        gg.gather(stream, gate_t, [bufs[0].ptr], bufs[2].ptr, ffn, hidden, first_pos=1,
                  image_stride=stride)
        gg.gather(stream, up_t, [bufs[1].ptr], bufs[2].ptr + image_bytes(ffn, hidden), ffn,
                  hidden, first_pos=1, image_stride=stride)
        rt.memcpy_dtoh(out, bufs[2].ptr, stream)
        stream.synchronize()
    finally:
        for b in bufs:
            b.free()
    assert (out[:stride] == POISON).all()
    half = image_bytes(ffn, hidden)
    assert_image(gate_t, out[stride:stride + half], gate, ffn, hidden)
    assert_image(up_t, out[stride + half:2 * stride], up, ffn, hidden)


def test_iq3_xxs_images_equal_the_iq3_xxs_format_gather(rt, gg, rng, monkeypatch):
    """On IQ3_XXS expert blobs, two launches (the gate/up range, then the down range) give the
    bytes of the format's own dequantizing gather (GroupedGemm.dequant_gather_iq3): the images
    a format built on this gather would hand the grouped GEMM are the ones it gets today."""
    from strata_rt.gemm.grouped_gemm import GroupedGemm, fp16_image_layout
    from strata_rt.quants.iq3_xxs import IQ3XXS

    monkeypatch.setenv("STRATA_F16_GEMM", "own")  # the gather alone: no CUTLASS build
    t = ggml_type("IQ3_XXS")
    hidden, ffn, n = 512, 256, 5
    lay = fp16_image_layout(IQ3XXS().layout(hidden, ffn))
    blobs = [random_blocks(rng, t, lay.blob_bytes // t.block_bytes).reshape(-1)
             for _ in range(n)]
    src = np.concatenate(blobs)
    stream = rt.stream("test")
    gu0 = np.full(16 * lay.gate_up_image_bytes, POISON, np.uint8)
    dn0 = np.full(16 * lay.down_image_bytes, POISON, np.uint8)
    host = (src, gu0, dn0, gu0, dn0)
    bufs = [rt.alloc(a.nbytes) for a in host]
    got = [np.empty_like(a) for a in host[1:]]
    try:
        for b, a in zip(bufs, host):
            rt.memcpy_htod(b.ptr, a, stream)
        srcs = [bufs[0].ptr + i * lay.blob_bytes for i in range(n)]
        GroupedGemm(rt).dequant_gather_iq3(stream, srcs, 2, bufs[1].ptr, bufs[2].ptr, lay)
        gg.gather(stream, t, [s + lay.gate_up_offset for s in srcs], bufs[3].ptr, 2 * ffn,
                  hidden, first_pos=2, image_stride=lay.gate_up_image_bytes)
        gg.gather(stream, t, [s + lay.down_offset for s in srcs], bufs[4].ptr, hidden, ffn,
                  first_pos=2, image_stride=lay.down_image_bytes)
        for h, b in zip(got, bufs[1:]):
            rt.memcpy_dtoh(h, b.ptr, stream)
        stream.synchronize()
    finally:
        for b in bufs:
            b.free()
    assert np.array_equal(got[0], got[2]) and np.array_equal(got[1], got[3])
    assert not np.array_equal(got[0], gu0)  # something was written


def test_gather_refuses_bad_geometry_and_alignment(rt, gg):
    stream = rt.stream("test")
    with pytest.raises(FormatError, match="whole number"):
        gg.gather(stream, "Q4_K", [0], 0, 4, 200)
    with pytest.raises(FormatError, match="16-byte"):
        gg.gather(stream, "Q8_0", [0], 8, 4, 32)
    with pytest.raises(FormatError, match="batch holds"):
        gg.gather(stream, "Q8_0", [0] * 3, 0, 4, 32, first_pos=14)

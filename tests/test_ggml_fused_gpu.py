"""The fused GGML GEMM on the GPU (strata_rt/gemm/ggml_fused.py; kernels/ggml/templates.cuh via
fused.cu, and the example plugin's tq2_0.cu): for every built-in type and the plugin's TQ2_0,
on fresh random blocks and activations, outputs poisoned with NaN first, the fused kernel on a
group buffer, its in-place twin on images in allocations of their own and its table twin over
the layer's experts (those outside the group with a table entry of 0, parts at offsets 0 and
4096 into their blobs) give the bytes of GgmlGather's fp16 images followed by the own grouped
fp16 GEMM (GroupedGemm.gemm), for every tile and several rows_hints, in groups of 1, 5 and 16
experts (some without rows, some rows outside the group); the gathered images equal the gguf
package's values rounded to fp16; and on moderate blocks the products agree with float64
products of those images.

Run: python -m pytest -q -m gpu tests/test_ggml_fused_gpu.py
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from _device_buffers import download, launch_poisoned, poisoned, upload
from _ggml_blocks import moderate_blocks, random_blocks

from strata_rt.formats.ggml_types import TYPES
from strata_rt.formats.numerics import nmse
from strata_rt.gemm.ggml_decoders import TILES, DecoderSpec
from strata_rt.gemm.ggml_fused import GgmlFused
from strata_rt.gemm.ggml_gather import GgmlGather, images_reference
from strata_rt.gemm.grouped_gemm import GroupedGemm, gemm_reference

pytestmark = pytest.mark.gpu
PLUGIN_SOURCE = (Path(__file__).resolve().parent / "plugins" / "strata_testfmt"
                 / "strata_testfmt" / "kernels" / "tq2_0.cu")
TQ2 = DecoderSpec("TQ2_0", 256, 66)
SPECS = {d.name: d for d in [*(DecoderSpec.of(t) for t in TYPES), TQ2]}
NAN_F32 = np.uint32(0xFFFFFFFF)  # what `poisoned` fills with
#: kernel vs float64 products of the same fp16 inputs (the fp16 GEMM's bound)
GEMM_NMSE = 1e-6
#: the fp16 GEMM tile the baseline runs (an own kernel: the fused kernels' bytes are its)
BASELINE_TILE = "gemm_f16_m64"
#: the parts' offsets in their blobs the table launches are given
TABLE_OFFSETS = (0, 4096)

#: (m, k, rows of each of the layer's experts, the group's expert ids): a group of one; five
#: experts, two without rows and one row outside the group; a full group of 16 with empty
#: experts and tile-straddling counts
CASES = {
    "one": (256, 512, [37], (0,)),
    "five": (128, 1024, [0, 3, 17, 0, 70, 1], (0, 1, 2, 3, 4)),
    "sixteen": (256, 512, [5, 0, 1, 16, 33, 0, 2, 64, 9, 0, 1, 31, 17, 4, 0, 3],
                tuple(range(16))),
}


@pytest.fixture(scope="module")
def launchers(rt) -> dict[str, tuple[GgmlGather, GgmlFused]]:
    return {"builtin": (GgmlGather(rt), GgmlFused(rt)),
            "plugin": (GgmlGather(rt, source=PLUGIN_SOURCE, decoders=[TQ2]),
                       GgmlFused(rt, source=PLUGIN_SOURCE, decoders=[TQ2]))}


@pytest.fixture(scope="module")
def f16_gemm(rt) -> GroupedGemm:
    with pytest.MonkeyPatch.context() as mp:  # the own kernels only: no CUTLASS build
        mp.setattr(rt, "f16_gemm", "own", raising=False)
        return GroupedGemm(rt, iq3_gather=False)


def images_want(d: DecoderSpec, raw: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """fp16 [rows, cols] of the gguf package's float32 values."""
    if d.name != TQ2.name:
        return images_reference(d.name, raw, rows, cols)
    vals = gguf.quants.dequantize(raw.reshape(rows, -1), gguf.GGMLQuantizationType.TQ2_0)
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(vals, np.float32).reshape(rows, cols).astype(np.float16)


def assert_same_fp16(name: str, got: np.ndarray, want: np.ndarray) -> None:
    """Bit for bit, NaN where the reference has NaN (its payload need not match)."""
    got, want = got.reshape(-1).view(np.float16), want.reshape(-1)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan), f"{name}: NaN positions differ"
    bad = np.flatnonzero(got[~nan].view(np.uint16) != want[~nan].view(np.uint16))
    assert bad.size == 0, f"{name}: {bad.size} of {got.size} gathered values differ"


def run_case(rt, rng, gather: GgmlGather, fused: GgmlFused, f16_gemm: GroupedGemm,
             d: DecoderSpec, case: str, blocks: str):
    """One group: gathers, the baseline GEMM and every fused launch. Returns (images fp16
    [n, m, k], activations, bounds, baseline, [fused outputs])."""
    m, k, counts, ids = CASES[case]
    bounds = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    rows, n = int(bounds[-1]), len(ids)
    make = moderate_blocks if blocks == "moderate" else random_blocks
    raws = np.stack([make(rng, d, m * k // d.block_values).reshape(-1) for _ in ids])
    img = fused.native_image_bytes(d, m, k)
    assert raws.shape[1] == img
    x32 = rng.standard_normal((rows, k), dtype=np.float32)
    x32[rng.integers(rows)] *= 40.0  # an outlier row
    x = x32.astype(np.float16)
    exact = max(1, max(int(bounds[e + 1] - bounds[e]) for e in ids))

    s = rt.stream("test")
    bufs = [upload(rt, s, a) for a in (raws, x, bounds)]
    d_native, d_x, d_bounds = (b.ptr for b in bufs)
    f16 = poisoned(rt, s, n * 2 * m * k)
    # in place: each image in an allocation of its own, allocated last position first, so the
    # addresses are neither contiguous nor in position order
    apart = [upload(rt, s, raws[p]) for p in reversed(range(n))][::-1]
    # table products over the layer's experts: expert ids[p]'s entry is its image's address
    # less the part's offset (the kernel adds it back); experts outside the group stay 0
    tables = {}
    for offset in TABLE_OFFSETS:
        table = np.zeros(len(counts), np.uint64)
        table[list(ids)] = [b.ptr - offset for b in apart]
        tables[offset] = upload(rt, s, table)
    bufs += [f16, *apart, *tables.values()]
    try:
        gather.gather(s, d, [d_native + p * img for p in range(n)], f16.ptr, m, k)
        images = download(rt, s, f16, np.float16, (n, m, k))

        def one(hint, tile=None, at=False, offset=None):
            def run(out):
                if offset is not None:
                    fused.gemm_table(s, d, tables[offset].ptr, offset, d_x, d_bounds, out, m,
                                     k, hint, len(counts), tile=tile)
                elif at:
                    fused.gemm_at(s, d, [b.ptr for b in apart], ids, d_x, d_bounds, out, m, k,
                                  hint, tile=tile)
                else:
                    fused.gemm(s, d, d_native, ids, d_x, d_bounds, out, m, k, hint, tile=tile)
            return launch_poisoned(rt, s, run, rows, m)

        baseline = launch_poisoned(rt, s, lambda out: f16_gemm.gemm(
            s, f16.ptr, ids, d_x, d_bounds, out, m, k, exact, tile=BASELINE_TILE), rows, m)
        outs = [one(h) for h in (exact, 1, 4 * exact + 100)]
        outs += [one(exact, t.name) for t in TILES] + [one(exact)]  # + a repeat
        outs += [one(h, at=True) for h in (exact, 1)]
        outs += [one(exact, t.name, at=True) for t in TILES]
        outs += [one(h, offset=o) for h in (exact, 1) for o in TABLE_OFFSETS]
        outs += [one(exact, t.name, offset=TABLE_OFFSETS[-1]) for t in TILES]
    finally:
        for b in bufs:
            b.free()
    for p in range(n):
        assert_same_fp16(f"{d.name} image {p}", images[p], images_want(d, raws[p], m, k))
    return images, x, bounds, baseline, outs


def check_outputs(d: DecoderSpec, case: str, bounds, baseline, outs) -> np.ndarray:
    """Every fused output equals the baseline; rows outside the group keep the poison.
    Returns the mask of the group's rows."""
    _, _, _, ids = CASES[case]
    inside = np.zeros(int(bounds[-1]), bool)
    for e in ids:
        inside[bounds[e]: bounds[e + 1]] = True
    assert np.all(baseline[~inside] == NAN_F32), "the baseline wrote rows outside the group"
    for i, other in enumerate(outs):
        assert np.all(other[~inside] == NAN_F32), f"launch {i}: rows outside the group written"
        bad = np.argwhere(other != baseline)
        assert bad.size == 0, (f"{d.name} {case}: fused launch {i}: {len(bad)} value(s) differ "
                               f"from gather + fp16 GEMM, first at (row, col) {tuple(bad[0])}")
    return inside


def _launchers_for(launchers, d: DecoderSpec):
    return launchers["plugin" if d.name == TQ2.name else "builtin"]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", list(SPECS))
def test_fused_is_gather_then_f16_gemm_byte_for_byte(rt, rng, launchers, f16_gemm, name, case):
    """Moderate blocks (finite, modest values): same bytes as the two-phase path for every
    tile and rows_hint, in place too; within the fp16 GEMM's bound of float64 products."""
    d = SPECS[name]
    gather, fused = _launchers_for(launchers, d)
    images, x, bounds, baseline, outs = run_case(rt, rng, gather, fused, f16_gemm, d, case,
                                                 "moderate")
    inside = check_outputs(d, case, bounds, baseline, outs)
    got = baseline[inside].view(np.float32)
    assert np.isfinite(got).all(), "rows of the group's experts left unwritten or not finite"
    m, k, _, ids = CASES[case]
    want = gemm_reference(images, ids, x, bounds, m, k)[inside]
    err = nmse(got, want)
    print(f"{name} {case}: fused = gather + fp16 GEMM bytes; NMSE {err:.3g} vs float64")
    assert err <= GEMM_NMSE


@pytest.mark.parametrize("name", list(SPECS))
def test_fused_matches_on_edge_scales(rt, rng, launchers, f16_gemm, name):
    """Random blocks with every finite scale pattern (zeros, subnormals, the largest fp16):
    values and products may overflow to infinity or NaN, and still every byte is the
    two-phase path's."""
    d = SPECS[name]
    gather, fused = _launchers_for(launchers, d)
    _, _, bounds, baseline, outs = run_case(rt, rng, gather, fused, f16_gemm, d, "five",
                                            "edge")
    check_outputs(d, "five", bounds, baseline, outs)

"""MMQ variants as format objects (QuantFormat.for_variant): what each name of
STRATA_MMQ_KERNEL returns for IQ3_XXS and FP16, the default variants' sizes, images, activations
and references, and the launchers they build (on a recording runtime here; on the GPU the
conformance suite and the Qwen3 shapes against float64).

The f16_gemm contract (quants/iq3_xxs_f16.py): images are fp16 of the exact dequantized
weights bit for bit; the reference and the kernel stay within FLOAT64_NMSE_BOUND = 1e-5 of a
float64 product of the exact weights and the float32 activations.
"""

from __future__ import annotations

import pickle
import re

import numpy as np
import pytest
from _format_harness import make_case, run_mmq, untouched
from _iq3_blocks import QWEN3_30B, SMALL, group_of

from strata_rt.errors import FormatError
from strata_rt.formats.activations import F16, Q8_1
from strata_rt.formats.contract import QuantFormat
from strata_rt.formats.numerics import nmse
from strata_rt.formats.registry import registry
from strata_rt.formats.testing import KERNEL_NMSE, run_conformance
from strata_rt.formats.testing_abi import Recorder
from strata_rt.gemm.grouped_gemm import TILES_BY_NAME, fp16_image_layout, gemm_reference
from strata_rt.quants.fp16 import FP16, FP16GemmKernels, FP16Kernels
from strata_rt.quants.iq3_xxs import IQ3XXS, IQ3XXSDequantF16
from strata_rt.quants.iq3_xxs_device import MMQ_VARIANTS, VARIANTS, IQ3XXSKernels
from strata_rt.quants.iq3_xxs_f16 import FLOAT64_NMSE_BOUND, IQ3XXSDequantF16Kernels

IQ3 = IQ3XXS()
QWEN3_235B = (4096, 1536)


# ------------------------------------------------------------------------------ for_variant
def test_iq3_variant_names_and_objects():
    assert IQ3.mmq_variants() == (*VARIANTS, "f16_fused") == (
        "f16_gemm", "f16_pipe", "f16", "int8", "int8_occ2", "f16_fused")
    default = IQ3.for_variant(None)
    assert type(default) is IQ3XXSDequantF16 and default.variant == "f16_gemm"
    assert type(IQ3.for_variant("f16_gemm")) is IQ3XXSDequantF16
    assert default.for_variant("f16_gemm") is default
    assert default.activation is F16 and not default.exact and default.native
    assert default.name == IQ3.name and default.ggml_type == IQ3.ggml_type
    for v in MMQ_VARIANTS:
        exact = default.for_variant(v)
        assert type(exact) is IQ3XXS and exact.variant == v
        assert exact.activation is Q8_1 and exact.exact
        assert exact.for_variant(v) is exact
    assert IQ3.variant == "f16_pipe" and IQ3.for_variant("f16_pipe") is IQ3


def test_fp16_variant_names_and_objects():
    fp = FP16()
    assert fp.mmq_variants() == ("gemm", "tile64") and fp.variant == "gemm"
    assert fp.for_variant(None) is fp and fp.for_variant("gemm") is fp
    tile = fp.for_variant("tile64")
    assert type(tile) is FP16 and tile.variant == "tile64"
    assert tile.activation is F16 and not tile.exact
    assert fp.kernels_class() is FP16GemmKernels and tile.kernels_class() is FP16Kernels
    assert tile.for_variant(None).variant == "gemm"


@pytest.mark.parametrize("fmt", [IQ3, IQ3.for_variant(None), FP16()], ids=repr)
def test_unknown_variant_names_the_valid_ones(fmt):
    with pytest.raises(FormatError, match=re.escape(
            f"MMQ variant 'bf16x' (STRATA_MMQ_KERNEL) is unknown; valid: "
            f"{', '.join(fmt.mmq_variants())}")):
        fmt.for_variant("bf16x")
    with pytest.raises(FormatError, match="f16_gemm"):
        IQ3XXS("f16_gemm")  # the plain object runs exact kernels only


def test_base_class_returns_itself_after_checking():
    test_i8 = registry()["test_i8"]
    assert type(test_i8).for_variant is QuantFormat.for_variant
    assert test_i8.for_variant(None) is test_i8
    assert test_i8.for_variant(test_i8.mmq_variants()[0]) is test_i8
    with pytest.raises(FormatError, match="valid: " + re.escape(test_i8.mmq_variants()[0])):
        test_i8.for_variant("nope")


def test_registered_objects_and_plugin_listing():
    reg = registry()
    assert reg["iq3_xxs"].mmq_variants()[0] == "f16_gemm"
    assert reg["fp16"].mmq_variants()[0] == "gemm"
    for name in ("f16_gemm", "f16_pipe", "int8_occ2"):
        assert name in reg["iq3_xxs"].description
    assert "tile64" in reg["fp16"].description


@pytest.mark.parametrize("fmt", [IQ3.for_variant(None), IQ3.for_variant("int8"),
                                 FP16().for_variant("tile64")], ids=repr)
def test_variants_survive_pickling(fmt):
    """Spawned conversion workers receive format objects by pickle."""
    back = pickle.loads(pickle.dumps(fmt))
    assert type(back) is type(fmt) and back.variant == fmt.variant


# ------------------------------------------------------------------------------ f16_gemm
@pytest.mark.parametrize("dims", [SMALL, QWEN3_30B, QWEN3_235B], ids=str)
def test_f16_layout_keeps_the_blob_and_sizes_fp16_images(dims):
    hidden, ffn = dims
    plain, f16 = IQ3.layout(hidden, ffn), IQ3.for_variant(None).layout(hidden, ffn)
    assert f16 == fp16_image_layout(plain)
    assert (f16.gate_up_image_bytes, f16.down_image_bytes) == (4 * ffn * hidden, 2 * hidden * ffn)
    assert f16.blob_bytes == plain.blob_bytes and f16.slot_bytes == plain.slot_bytes
    if dims == QWEN3_30B:  # the group buffer of 16 experts: 150 MB (issue 10)
        assert 16 * (f16.gate_up_image_bytes + f16.down_image_bytes) == 150_994_944


def test_f16_images_are_dequantize_cast_to_fp16(rng):
    f16 = IQ3.for_variant(None)
    hidden, ffn = SMALL
    blob = IQ3.random_expert(rng, hidden, ffn)
    gu, dn = f16.images(blob, hidden, ffn)
    gate, up, down = IQ3.unpack_expert(blob, hidden, ffn)
    assert gu.dtype == np.uint8 and gu.size == f16.layout(hidden, ffn).gate_up_image_bytes
    want_gu = np.vstack([gate, up]).astype(np.float16)
    assert np.array_equal(gu.view(np.uint16), want_gu.view(np.uint16).reshape(-1))
    assert np.array_equal(dn.view(np.uint16), down.astype(np.float16).view(np.uint16).reshape(-1))
    assert np.array_equal(f16.image_matrix(gu, 2 * ffn, hidden), want_gu.astype(np.float32))
    assert np.array_equal(f16.unpack_expert(blob, hidden, ffn)[2], down)  # exact, not rounded
    with pytest.raises(FormatError, match="takes 524288 bytes, got 524286"):
        f16.image_matrix(gu[:-2], 2 * ffn, hidden)


def _exact_float64(case) -> np.ndarray:
    """float64 product of the exact dequantized weights (IQ3XXS.unpack_expert) and the float32
    activations: the issue's yardstick (the case's own float64_product uses the fp16 images)."""
    out = np.zeros((case.rows, case.m))
    for p, e in enumerate(case.expert_ids):
        gate, up, down = IQ3.unpack_expert(case.blobs[p], case.hidden, case.ffn)
        w = np.vstack([gate, up]) if case.part == "gate_up" else down
        r0, r1 = case.bounds[e], case.bounds[e + 1]
        out[r0:r1] = case.x[r0:r1].astype(np.float64) @ w.astype(np.float64).T
    return out


@pytest.mark.parametrize("part", ["gate_up", "down"])
def test_f16_reference_within_the_stated_bound_of_float64(rng, part):
    f16 = IQ3.for_variant(None)
    counts, ids = group_of([0, 3], [5, 0, 150, 64, 1], rng, n_layer=12)
    c = make_case(f16, rng, *QWEN3_30B, part, counts, ids)
    got = c.reference()
    mask = c.group_rows()
    assert got.dtype == np.float32 and not got[~mask].any()
    assert np.array_equal(got, gemm_reference(c.image, ids, c.acts, c.bounds, c.m, c.k))
    assert c.acts.dtype == np.float16
    err = nmse(got[mask], _exact_float64(c)[mask])
    print(f"f16_gemm reference {part}: NMSE {err:.3g} vs float64 of the exact weights")
    assert 0 < err <= FLOAT64_NMSE_BOUND
    # the exact variants' reference stays the q8_1 one, an order of magnitude less accurate
    exact = make_case(IQ3, rng, *QWEN3_30B, part, counts, ids, c.blobs)
    exact.x = c.x
    assert nmse(exact.reference()[mask], _exact_float64(c)[mask]) > err


# ------------------------------------------------------------------------------ launchers
def _record(fmt, dims=SMALL):
    rec = Recorder()
    kern = fmt.kernels(rec, fmt.layout(*dims))
    return rec, kern


@pytest.mark.parametrize("variant", MMQ_VARIANTS)
def test_exact_launcher_takes_the_variant_from_the_format(monkeypatch, variant):
    monkeypatch.setenv("STRATA_MMQ_KERNEL", "int8" if variant != "int8" else "f16")
    rec, kern = _record(IQ3.for_variant(variant))
    assert isinstance(kern, IQ3XXSKernels) and kern.variant == variant
    kern.mmq(None, 0x1000, (0, 1), 0x2000, 0x3000, 0x4000, 512, 512, 40)
    assert rec.launches[-1].name == f"iq3_mmq_{variant}_m64"


def test_exact_launcher_refuses_the_f16_gemm_name():
    with pytest.raises(FormatError, match="f16_gemm is a format object"):
        IQ3XXSKernels(IQ3, Recorder(), IQ3.layout(*SMALL), variant="f16_gemm")


def test_f16_gemm_launcher_gathers_by_dequantizing_and_multiplies_by_gemm():
    f16 = IQ3.for_variant(None)
    rec, kern = _record(f16, QWEN3_30B)
    assert isinstance(kern, IQ3XXSDequantF16Kernels) and f16.offers_batched_gather()
    lay = f16.layout(*QWEN3_30B)
    kern.gather(None, 1 << 20, 7, 1 << 30, 2 << 30)
    one = rec.launches[-1]
    assert one.name == "iq3_dequant_gather" and one.grid[1:] == (1, 1)
    # ... first_pos 7, then no routing bounds (a plain gather copies its member)
    assert one.args[:2] == (1 << 20, 0) and one.args[-3:] == (7, 0, 0)
    srcs = [(1 + p) << 21 for p in range(5)]
    kern.gather_batch(None, srcs, 11, 1 << 30, 2 << 30)
    batch = rec.launches[-1]
    assert batch.name == "iq3_dequant_gather" and batch.grid[1:] == (5, 1)
    assert batch.args[:5] == tuple(srcs) and batch.args[-3:] == (11, 0, 0)
    assert batch.args[-5:-3] == (lay.gate_up_image_bytes, lay.down_image_bytes)
    with pytest.raises(FormatError, match="position 12"):
        kern.gather_batch(None, srcs, 12, 1 << 30, 2 << 30)
    kern.mmq(None, 1 << 30, (0, 1, 2), 0x2000, 0x3000, 0x4000, 1536, 2048, 300)
    gemm = rec.launches[-1]
    assert gemm.name in TILES_BY_NAME and gemm.grid == (1536 // 128, 3, 3)
    assert kern.fallbacks == 0


@pytest.mark.parametrize("variant,kernel", [("gemm", "gemm_f16_m32"), ("tile64", "fp16_mmq")])
def test_fp16_launchers(variant, kernel):
    rec, kern = _record(FP16().for_variant(variant), (256, 128))
    kern.mmq(None, 0x1000, (0, 1), 0x2000, 0x3000, 0x4000, 256, 128, 20)
    assert rec.launches[-1].name == kernel
    kern.gather(None, 0x5000, 3, 0x6000, 0x7000)
    assert rec.launches[-1].name == "fp16_gather"
    assert "iq3_dequant_gather" not in [p.name for p in rec.prepared]


# ------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [IQ3.for_variant(None), FP16()], ids=repr)
def test_gpu_conformance_of_the_default_variants(rt, fmt):
    report = run_conformance(fmt, runtime=rt)
    print(report)
    assert report.ok, str(report)
    # every check runs, but the in-place one for a format that does not read in place
    skipped = [r.name for r in report.results if r.status == "skip"
               and not (r.name == "gpu_mmq_in_place" and fmt.in_place_max_rows == 0)]
    assert not skipped, str(report)


@pytest.mark.gpu
@pytest.mark.parametrize("dims", [QWEN3_30B, QWEN3_235B], ids=["qwen3_30b", "qwen3_235b"])
@pytest.mark.parametrize("part", ["gate_up", "down"])
@pytest.mark.parametrize("rows", [[5, 0, 150, 64, 1], [0, 1, 3, 700],
                                  [1 + 9 * i for i in range(16)]], ids=["mixed", "uneven", "full"])
def test_gpu_f16_gemm_against_float64(rt, rng, dims, part, rows):
    """The default IQ3_XXS matmul as the engine runs it (format object's gather, activations
    and kernel) within KERNEL_NMSE of its reference and FLOAT64_NMSE_BOUND of float64 on the
    exact weights, the same bytes on a repeat and with rows_hint = 1."""
    f16 = IQ3.for_variant(None)
    counts, ids = group_of([0, 3], rows, rng, n_layer=20)
    c = make_case(f16, rng, *dims, part, counts, ids)
    got, again = run_mmq(rt, c), run_mmq(rt, c)
    mask = c.group_rows()
    assert untouched(got, ~mask), "rows outside the group were written"
    assert np.array_equal(got.view(np.uint32), again.view(np.uint32)), "repeat differs"
    assert np.isfinite(got[mask]).all()
    e_ref = nmse(got[mask], c.reference()[mask])
    e64 = nmse(got[mask], _exact_float64(c)[mask])
    print(f"f16_gemm {dims} {part}: NMSE {e_ref:.3g} vs reference, {e64:.3g} vs float64")
    assert e_ref <= KERNEL_NMSE and e64 <= FLOAT64_NMSE_BOUND

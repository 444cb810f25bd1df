"""MMQ variants as format objects (QuantFormat.for_variant): what each name of
STRATA_MMQ_KERNEL returns for IQ3_XXS, FP16 and a plain GGML type (the same class, another
`variant`), the default variants' sizes, images, activations and references, and the launchers
they build (on a recording runtime here; on the GPU the conformance suite and the Qwen3 shapes
against float64).

The f16_gemm contract (strata_rt/formats/ggml_format.py): images are fp16 of the exact
dequantized weights bit for bit; the reference and the kernel stay within FLOAT64_NMSE_BOUND =
1e-5 of a float64 product of the exact weights and the float32 activations.
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
from strata_rt.formats.ggml_format import F16_FUSED, FLOAT64_NMSE_BOUND
from strata_rt.formats.numerics import nmse
from strata_rt.formats.registry import registry
from strata_rt.formats.testing import KERNEL_NMSE, run_conformance
from strata_rt.formats.testing_abi import Recorder
from strata_rt.gemm.ggml_kernels import GGMLKernels
from strata_rt.gemm.grouped_gemm import TILES_BY_NAME, fp16_image_layout, gemm_reference
from strata_rt.quants.fp16 import FP16
from strata_rt.quants.ggml import Q4_K
from strata_rt.quants.iq3_xxs import IQ3XXS
from strata_rt.quants.iq3_xxs_device import MMQ_VARIANTS, IQ3XXSF16Kernels, IQ3XXSKernels

IQ3 = IQ3XXS()
IQ3_EXACT = IQ3.for_variant("f16_pipe")
QWEN3_235B = (4096, 1536)


# ------------------------------------------------------------------------------ for_variant
def test_iq3_variant_names_and_objects():
    assert IQ3.mmq_variants() == ("f16_gemm", "f16_fused", *MMQ_VARIANTS) == (
        "f16_gemm", "f16_fused", "f16_pipe", "f16", "int8", "int8_occ2")
    assert IQ3.variant == "f16_gemm" and IQ3.for_variant(None) is IQ3
    assert IQ3.for_variant("f16_gemm") is IQ3
    assert IQ3.activation is F16 and not IQ3.exact and IQ3.native
    fused = IQ3.for_variant("f16_fused")
    assert type(fused) is IQ3XXS and fused.variant == "f16_fused" and IQ3.variant == "f16_gemm"
    assert fused.activation is F16 and not fused.exact
    for v in MMQ_VARIANTS:
        exact = IQ3.for_variant(v)
        assert type(exact) is IQ3XXS and exact.variant == v
        assert exact.activation is Q8_1 and exact.exact and exact.image_dtype is None
        assert exact.for_variant(v) is exact and exact.in_place_max_rows == 0
        assert exact.name == IQ3.name and exact.ggml_type == IQ3.ggml_type
    assert IQ3.in_place_max_rows == 136 and fused.in_place_max_rows >= 1 << 30


def test_fp16_variant_names_and_objects():
    fp = FP16()
    assert fp.mmq_variants() == ("f16_gemm", "f16_fused") and fp.variant == "f16_gemm"
    assert fp.for_variant(None) is fp and fp.for_variant("f16_gemm") is fp
    fused = fp.for_variant("f16_fused")
    assert type(fused) is FP16 and fused.variant == "f16_fused"
    assert fused.activation is F16 and not fused.exact and fused.native
    assert fp.kernels_class() is GGMLKernels and fused.kernels_class() is GGMLKernels
    assert fused.for_variant(None).variant == "f16_gemm"
    # its blocks are the fp16 images: one layout, byte-copy gathers, no in-place products
    assert fp.layout(256, 128) == fused.layout(256, 128) and fp.images_are_blocks
    assert fp.in_place_max_rows == 0


def test_a_ggml_type_is_one_class_with_two_variants():
    q4 = Q4_K()
    assert (q4.name, q4.ggml_type, q4.block_values, q4.block_bytes) == ("q4_k", 12, 256, 144)
    assert q4.mmq_variants() == ("f16_gemm", "f16_fused") and not q4.quantizes
    fused = q4.for_variant(F16_FUSED)
    assert type(fused) is Q4_K and q4.variant == "f16_gemm"
    assert not q4.images_are_blocks and fused.images_are_blocks
    assert q4.layout(512, 256) == fp16_image_layout(fused.layout(512, 256))
    with pytest.raises(FormatError, match="read from GGUF files as llama-quantize writes them"):
        q4.quantize(np.zeros((1, 256), np.float32))


@pytest.mark.parametrize("fmt", [IQ3_EXACT, IQ3, FP16(), Q4_K()], ids=repr)
def test_unknown_variant_names_the_valid_ones(fmt):
    with pytest.raises(FormatError, match=re.escape(
            f"MMQ variant 'bf16x' (STRATA_MMQ_KERNEL) is unknown; valid: "
            f"{', '.join(fmt.mmq_variants())}")):
        fmt.for_variant("bf16x")
    with pytest.raises(FormatError, match="bf16x"):
        type(fmt)("bf16x")


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
    assert reg["fp16"].mmq_variants()[0] == "f16_gemm"
    for name in ("f16_gemm", "f16_fused", "f16_pipe", "int8_occ2"):
        assert name in reg["iq3_xxs"].description
    assert "f16_fused" in reg["fp16"].description and "f16_fused" in reg["q4_k"].description


@pytest.mark.parametrize("fmt", [IQ3.for_variant(None), IQ3.for_variant("int8"),
                                 FP16().for_variant("f16_fused"),
                                 Q4_K().for_variant("f16_fused")], ids=repr)
def test_variants_survive_pickling(fmt):
    """Spawned conversion workers receive format objects by pickle."""
    back = pickle.loads(pickle.dumps(fmt))
    assert type(back) is type(fmt) and back.variant == fmt.variant


# ------------------------------------------------------------------------------ f16_gemm
@pytest.mark.parametrize("dims", [SMALL, QWEN3_30B, QWEN3_235B], ids=str)
def test_f16_layout_keeps_the_blob_and_sizes_fp16_images(dims):
    hidden, ffn = dims
    plain, f16 = IQ3_EXACT.layout(hidden, ffn), IQ3.for_variant(None).layout(hidden, ffn)
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
    exact = make_case(IQ3_EXACT, rng, *QWEN3_30B, part, counts, ids, c.blobs)
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
    with pytest.raises(FormatError, match="fp16 variants run IQ3XXSF16Kernels"):
        IQ3XXSKernels(IQ3, Recorder(), IQ3.layout(*SMALL), variant="f16_gemm")


def test_f16_gemm_launcher_gathers_by_dequantizing_and_multiplies_by_gemm():
    f16 = IQ3.for_variant(None)
    rec, kern = _record(f16, QWEN3_30B)
    assert isinstance(kern, IQ3XXSF16Kernels) and f16.offers_batched_gather()
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


def test_fp16_launchers_copy_and_multiply_by_gemm():
    rec, kern = _record(FP16(), (256, 128))
    kern.mmq(None, 0x1000, (0, 1), 0x2000, 0x3000, 0x4000, 256, 128, 20)
    assert rec.launches[-1].name == "gemm_f16_m32"
    kern.gather(None, 0x5000, 3, 0x6000, 0x7000)
    assert rec.launches[-1].name == "gather_one"
    kern.gather_batch(None, [0x5000, 0x9000], 3, 0x6000, 0x7000)
    assert rec.launches[-1].name == "gather_batch"
    assert not {"iq3_dequant_gather"} & {p.name for p in rec.prepared}
    assert not any(p.name.startswith("ggml_gather_") for p in rec.prepared)


def test_ggml_f16_gemm_launchers_dequantize_each_part_and_multiply_by_gemm():
    """Q4_K f16_gemm: one dequantizing launch for the 2*ffn gate/up rows and one for the down
    rows (each at its range of the blob, into its group buffer at the fp16 image stride), the
    grouped fp16 GEMM for the products."""
    hidden, ffn = SMALL
    q4 = Q4_K()
    rec, kern = _record(q4, SMALL)
    lay = q4.layout(hidden, ffn)
    srcs = [(1 + p) << 21 for p in range(3)]
    kern.gather_batch(None, srcs, 5, 1 << 30, 2 << 30)
    gu, dn = rec.launches[-2:]
    assert gu.name == dn.name == "ggml_gather_Q4_K" and gu.grid[1] == dn.grid[1] == 3
    assert gu.args[:3] == tuple(s + lay.gate_up_offset for s in srcs)
    assert dn.args[:3] == tuple(s + lay.down_offset for s in srcs)
    # dst, image stride, values, first_pos, bounds, first_expert after the 16 sources
    assert gu.args[16:] == (1 << 30, lay.gate_up_image_bytes, 2 * ffn * hidden, 5, 0, 0)
    assert dn.args[16:] == (2 << 30, lay.down_image_bytes, hidden * ffn, 5, 0, 0)
    kern.gather_routed(None, srcs, 1 << 30, 2 << 30, 0x7000, 4)
    assert rec.launches[-1].args[-3:] == (0, 0x7000, 4)
    kern.mmq(None, 1 << 30, (0, 1, 2), 0x2000, 0x3000, 0x4000, 2 * ffn, hidden, 300)
    assert rec.launches[-1].name in TILES_BY_NAME


# ------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [IQ3.for_variant(None), FP16(), Q4_K()], ids=repr)
def test_gpu_conformance_of_the_default_variants(rt, fmt):
    report = run_conformance(fmt, runtime=rt)
    print(report)
    assert report.ok, str(report)
    # every check runs, but the in-place one for a format that does not read in place and
    # the quantizer's for a type read from files only (the gguf package has no Q4_K quantizer)
    allowed = set() if fmt.quantizes else {"roundtrip", "pack_unpack"}
    if fmt.in_place_max_rows == 0:
        allowed.add("gpu_mmq_in_place")
    skipped = [r.name for r in report.results if r.status == "skip" and r.name not in allowed]
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

"""Every loaded format (plugins.yaml and entry points, the test plugin included: every GGML type)
and every MMQ variant of it (fmt.for_variant) against the conformance suite: CPU checks always,
GPU checks with a device; and the suite's own checks catching what they exist to catch.

Each variant gets every check, except that exact variants after a format's first share its
numpy side (exact kernels are all bit-identical to one reference: IQ3_XXS's f16, int8 and
int8_occ2 after f16_pipe), so on the CPU only their launch ABI is checked again, and on the GPU
everything."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from strata_rt.errors import PluginError
from strata_rt.formats import ggml_types
from strata_rt.formats.contract import ids16
from strata_rt.formats.launchers import MMQ_ARG_TYPES, MMQ_TABLE_ARG_TYPES
from strata_rt.formats.registry import registry
from strata_rt.formats.testing import ConformanceSkip, Subject, conformance_cases, run_conformance
from strata_rt.formats.testing_abi import Prepared, Recorder, check_launch_abi, check_params
from strata_rt.gemm.ggml_decoders import TILES, DecoderSpec
from strata_rt.runtime.compile import nvcc_available


def _loaded():
    try:
        reg = registry()
    except PluginError as e:
        return [], str(e)
    return [reg[name] for name in reg.names()], ""


FORMATS, LOAD_ERROR = _loaded()
_SUBJECTS: dict[str, Subject] = {}
#: CPU checks a variant of the registered object's class runs again (the rest are the same)
_SAME_CLASS_CPU = ("launch_abi",)


def _label(fmt) -> str:
    variant = getattr(fmt, "variant", None)
    return fmt.name if variant is None else f"{fmt.name}[{variant}]"


def _variants() -> list[tuple[object, bool]]:
    """(format object, whether it gets every CPU check) for every variant of every loaded
    format, each object once."""
    out, seen = [], set()
    for fmt in FORMATS:
        exact_seen = False
        for v in fmt.mmq_variants():
            obj = fmt.for_variant(v)
            if _label(obj) not in seen:
                seen.add(_label(obj))
                out.append((obj, not (obj.exact and exact_seen)))
                exact_seen = exact_seen or obj.exact
    return out


VARIANTS = _variants()


def _subject(fmt) -> Subject:
    """One subject per format object per session, so the checks share their inputs."""
    key = _label(fmt)
    if key not in _SUBJECTS:
        _SUBJECTS[key] = Subject(fmt)
    return _SUBJECTS[key]


def _params(gpu: bool):
    return [pytest.param(fmt, case, id=f"{_label(fmt)}-{case.name}")
            for fmt, full in VARIANTS for case in conformance_cases(fmt)
            if case.gpu == gpu and (gpu or full or case.name in _SAME_CLASS_CPU)]


def _run(subject: Subject, case) -> None:
    try:
        detail = case.run(subject)
    except ConformanceSkip as e:
        pytest.skip(str(e))

    print(f"{subject.fmt.name} {case.name}: {detail}")


def test_registry_loads_with_test_plugin():
    assert not LOAD_ERROR, LOAD_ERROR
    assert "test_i8" in [f.name for f in FORMATS], "the entry point test plugin did not load"


def test_every_variant_is_covered():
    labels = [_label(fmt) for fmt, _ in VARIANTS]
    for want in ("iq3_xxs[f16_gemm]", "iq3_xxs[f16_fused]", "iq3_xxs[f16_pipe]",
                 "iq3_xxs[int8_occ2]", "fp16[f16_gemm]", "fp16[f16_fused]", "q2_blob[int8]",
                 "test_i8"):
        assert want in labels, labels
    for name in ggml_types.NAMES:
        if name not in ("IQ3_XXS", "F16"):
            assert {f"{name.lower()}[f16_gemm]", f"{name.lower()}[f16_fused]"} <= set(labels)
    full = {_label(fmt) for fmt, f in VARIANTS if f}
    assert {"iq3_xxs[f16_gemm]", "iq3_xxs[f16_fused]", "iq3_xxs[f16_pipe]", "fp16[f16_gemm]",
            "q4_k[f16_fused]", "q2_blob[int8]"} <= full
    assert "iq3_xxs[int8]" not in full


def _variant(label: str):
    return next(fmt for fmt, _ in VARIANTS if _label(fmt) == label)


def test_table_products_are_offered_where_experts_are_read_in_place():
    """offers_mmq_table: every variant that reads resident experts in place (IQ3_XXS's fp16
    variants, the GGML types', the plugin's TQ2_0), none that does not (the exact variants,
    q2_blob, fp16's f16_gemm, the plugin's test_i8)."""
    offered = {_label(fmt) for fmt, _ in VARIANTS if fmt.offers_mmq_table()}
    assert offered == {_label(fmt) for fmt, _ in VARIANTS if fmt.in_place_max_rows > 0}
    assert {"iq3_xxs[f16_fused]", "iq3_xxs[f16_gemm]", "q4_k[f16_fused]", "q4_k[f16_gemm]",
            "fp16[f16_fused]", "tq2_0[f16_fused]"} <= offered
    assert not offered & {"q2_blob[int8]", "q2_blob[f16_gemm]", "test_i8", "fp16[f16_gemm]",
                          "iq3_xxs[f16_pipe]", "iq3_xxs[int8]"}


def test_table_products_launch_the_parts_table_kernel():
    """GGMLKernels.mmq_table: one launch of the decoding GEMM's table kernel of the format's
    type over every expert; a variant that never reads in place refuses (the base class's
    PluginError) and launches nothing."""
    fmt = _variant("q4_k[f16_gemm]")
    rec = Recorder()
    lay = fmt.layout(512, 256)
    kern = fmt.kernels(rec, lay)  # type: ignore[attr-defined]
    kern.mmq_table(None, 1 << 20, lay.down_offset, 1 << 21, 1 << 22, 1 << 23, 512, 256, 40, 96)
    assert rec.calls == [("ggml_fused_tab_Q4_K_m64", (4, 96, 1), (256, 1, 1),
                          TILES[2].shape(DecoderSpec.of(fmt.gtype)).smem,
                          (1 << 20, lay.down_offset, 1 << 21, 1 << 22, 1 << 23, 512, 256))]
    assert rec.kernels["ggml_fused_tab_Q4_K_m64"] == MMQ_TABLE_ARG_TYPES
    never = _variant("fp16[f16_gemm]")
    rec = Recorder()
    kern = never.kernels(rec, never.layout(512, 256))  # type: ignore[attr-defined]
    with pytest.raises(PluginError, match="fp16 has no table products"):
        kern.mmq_table(None, 1 << 20, 0, 1 << 21, 1 << 22, 1 << 23, 512, 512, 17, 96)
    assert not rec.launches


@pytest.mark.parametrize("fmt, case", _params(gpu=False))
def test_conformance_cpu(fmt, case):
    _run(_subject(fmt), case)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, case", _params(gpu=True))
def test_conformance_gpu(fmt, case, rt):
    subject = _subject(fmt)
    subject.runtime = rt
    _run(subject, case)


def test_example_plugin_ships_its_kernels():
    """The example plugin carries a gather and an MMQ kernel as package data; without them its
    GPU conformance would skip as "no kernels". (Its folder also holds tq2_0.cu, a GGML decoder
    on strata_rt's shared templates.)"""
    test_i8 = next(f for f in FORMATS if f.name == "test_i8")
    names = [p.name for p in test_i8.kernel_sources()]
    assert "test_i8.cu" in names and set(names) <= {"test_i8.cu", "tq2_0.cu"}, (
        f"test_i8 kernel sources {names}: reinstall ./tests/plugins/strata_testfmt (its kernels "
        "are package data) or run with it on PYTHONPATH")
    assert test_i8.exact and test_i8.kernels_class().__name__ == "TestI8Kernels"


def test_report_counts_failures_and_skips():
    """run_conformance keeps going past a failing check and says which one failed."""
    test_i8 = next(f for f in FORMATS if f.name == "test_i8")

    class Broken(type(test_i8)):
        name = "broken_i8"
        roundtrip_nmse = 1e-12  # no int8 format meets this

    report = run_conformance(Broken(), seed=7)
    status = {r.name: r.status for r in report.results}
    assert status["roundtrip"] == "fail" and status["sizes"] == "pass"
    assert status["gpu_gather"] == "skip"
    assert not report.ok
    assert "broken_i8 FAILS" in str(report) and "seed 7" in str(report)


def _test_i8():
    return next(f for f in FORMATS if f.name == "test_i8")


def test_launch_abi_refuses_a_launcher_with_another_grid():
    """A launcher that puts row tiles on y and the group position on z (the old Q2 and FP16
    grid) fails the ABI check on the CPU, naming the grid."""
    fmt = _test_i8()

    class SwappedGrid(fmt.kernels_class()):
        def mmq(self, stream, weights, expert_ids, acts, bounds, out, m, k, rows_hint):
            self._mmq.launch(grid=(m // 64, -(-rows_hint // 8), len(expert_ids)),
                             block=(64, 1, 1), stream=stream,
                             args=(*ids16(expert_ids), weights, acts, bounds, out, m, k))

    class Swapped(type(fmt)):
        name = "swapped_i8"

        def kernels_class(self):
            return SwappedGrid

    with pytest.raises(AssertionError, match=r"MMQ grid \(\d+, 3, 4\).*group position = 4"):
        check_launch_abi(Subject(Swapped(), seed=3))


@pytest.mark.skipif(not nvcc_available(), reason="nvcc not on PATH")
def test_kernel_parameters_are_read_from_the_ptx(tmp_path: Path):
    """An MMQ kernel whose weights pointer comes first (the old Q2/FP16 signature) does not
    match the common argument types; the ABI order does."""
    src = tmp_path / "k.cu"
    src.write_text(textwrap.dedent("""
        #include "common/mma.cuh"
        extern "C" __global__ void old_order(const char* w, Ids16 ids, const char* a,
                                             const int* b, float* o, int m, int k) {}
        extern "C" __global__ void abi_order(Ids16 ids, const char* w, const char* a,
                                             const int* b, float* o, int m, int k) {}
    """))
    check_params(Prepared(src, "abi_order", MMQ_ARG_TYPES))
    with pytest.raises(AssertionError, match="old_order of k.cu: the launcher packs"):
        check_params(Prepared(src, "old_order", MMQ_ARG_TYPES))
    with pytest.raises(AssertionError, match="defines no extern"):
        check_params(Prepared(src, "missing", MMQ_ARG_TYPES))

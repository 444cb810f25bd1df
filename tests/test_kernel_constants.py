"""Constants a launcher shares with its kernel are read from the CUDA source
(resources.kernel_constant), so the source is their one copy: both spellings are read, a
missing one is an error, and the launchers' values are the sources' own."""

from __future__ import annotations

import pytest

from strata_rt.resources import KERNELS_ROOT, kernel_constant


def test_both_spellings_and_a_missing_name(tmp_path) -> None:
    src = tmp_path / "k.cu"
    src.write_text("#define BLOCK_THREADS 256  // a block\n"
                   "static constexpr int TILE_ROWS = 16;\n#define BLOCK_THREADS_X 7\n")
    assert kernel_constant(src, "BLOCK_THREADS") == 256
    assert kernel_constant(src, "TILE_ROWS") == 16
    with pytest.raises(ValueError, match="defines no integer TILE"):
        kernel_constant(src, "TILE")


def test_launchers_read_their_kernels_sources() -> None:
    from strata_rt.backends.cuda import sampling_kernels as sk
    from strata_rt.gemm import ggml_gemv as gv

    sampling = (KERNELS_ROOT / "model" / "sampling.cu").read_text()
    assert f"#define ARGMAX_THREADS {sk.ARGMAX_THREADS}\n" in sampling
    assert f"#define SAMPLE_THREADS {sk.THREADS}\n" in sampling
    rows = (KERNELS_ROOT / "ggml" / "gemv_f16_rows.cu").read_text()
    assert f"#define ROWS_WARPS {gv.ROWS_WARPS}" in rows
    assert f"constexpr int GEMV_WARPS = {gv.GEMV_WARPS};" in gv.GEMV_HEADER.read_text()


def test_table_kernels_are_defined_beside_their_twins() -> None:
    """Every tile's table entry (FormatKernels.mmq_table) is instantiated where the launchers
    look for it: iq3_fused_tab_<tile> with the tile's own parameters in fused.cu, the GGML
    template's ggml_fused_tab_<SUFFIX>_<tile> per tile line, and the block numbering and
    image lookup in mma.cuh; the argument types are the kernels' (table, offset, acts,
    bounds, out, m, k)."""
    from strata_rt.formats.launchers import MMQ_TABLE_ARG_TYPES
    from strata_rt.gemm import fused_gemm as fg
    from strata_rt.gemm.ggml_decoders import TEMPLATES_HEADER

    assert MMQ_TABLE_ARG_TYPES == "PqPPPii"
    fused = fg.FUSED_SOURCE.read_text()
    for t in fg.TILES:
        line = (f"FUSED_TABLE_KERNEL({fg.tab_name(t)}, {t.bm}, {t.warps}, {t.stages}, "
                f"{t.min_blocks})")
        assert f"\n{line}\n" in fused, line
    assert "ggml_fused_tab_##SUFFIX##_##NAME(const unsigned long long* __restrict__ table," \
        in TEMPLATES_HEADER.read_text()
    mma = (KERNELS_ROOT / "common" / "mma.cuh").read_text()
    assert "GroupedBlock table_block()" in mma and "table_image(const unsigned long long*" in mma


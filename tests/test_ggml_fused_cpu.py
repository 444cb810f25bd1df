"""The fused GGML GEMM without a GPU (strata_rt/gemm/ggml_fused.py, kernels/ggml/fused.cu and
templates.cuh): the tile list read from the template header, each type's pipeline against the
shared-memory limits and against the compiled templates' own sizing (host build), register
budgets and kernel names of the per-type and plugin builds, and the launcher's grids,
arguments, lazy per-type modules and refusals through a recording fake runtime. The bytes are
tested on the GPU (test_ggml_fused_gpu.py)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from _gemm_cases import assert_fits_registers
from _ggml_host import host_decoder, plugin_decoder
from _recording import RecordingKernel

from strata_rt.errors import FormatError
from strata_rt.formats.ggml_types import TYPES
from strata_rt.formats.launchers import MMQ_ARG_TYPES, MMQ_TABLE_ARG_TYPES
from strata_rt.gemm.ggml_decoders import TEMPLATES_HEADER, TILES, DecoderSpec, tiles_of_source
from strata_rt.gemm.ggml_fused import (
    AT_ARG_TYPES,
    ENTRIES,
    FUSED_SOURCE,
    ONLY_DEFINE,
    GgmlFused,
    kernel_name,
    native_image_bytes,
    pick_tile,
)
from strata_rt.gemm.ggml_gather import GATHER_ARG_TYPES, GgmlGather
from strata_rt.gemm.ggml_gemv import (
    DENSE_ARG_TYPES,
    DENSE_MODES,
    GEMV_ARG_TYPES,
    GEMV_HOST_SHARED,
    GEMV_HOST_WARPS,
    GEMV_ROWS,
    GEMV_SOURCE,
    GEMV_THREADS,
    GEMV_WARPS,
    HOST_PARTS,
    PARTS,
    ROWS_SOURCE,
    ROWS_WARPS,
    GgmlGemv,
    host_warps,
    stage_span,
    stage_values,
)
from strata_rt.gemm.ggml_gemv import kernel_name as gemv_kernel_name
from strata_rt.runtime.compile import (
    KERNELS_ROOT,
    compile_cubin,
    kernel_jobs,
    nvcc_available,
    nvcc_path,
)

needs_nvcc = pytest.mark.skipif(not nvcc_available(), reason="nvcc not found (PATH or "
                                "STRATA_NVCC)")
PLUGIN_SOURCE = (Path(__file__).resolve().parent / "plugins" / "strata_testfmt"
                 / "strata_testfmt" / "kernels" / "tq2_0.cu")
TQ2 = DecoderSpec("TQ2_0", 256, 66)
SPECS = [DecoderSpec.of(t) for t in TYPES] + [TQ2]
IDS = [d.name for d in SPECS]


class _Module:
    def __init__(self, rt: _Runtime):
        self.rt = rt

    def kernel(self, name: str, arg_types: str, overlap: bool = False) -> RecordingKernel:
        k = self.rt.kernels.setdefault(name, RecordingKernel())
        k.arg_types = arg_types  # type: ignore[attr-defined]
        return k


class _Runtime:
    """Records the modules asked for (source, defines) and hands out recording kernels."""

    def __init__(self):
        self.modules: list[tuple[Path, dict | None]] = []
        self.kernels: dict[str, RecordingKernel] = {}

    def module(self, source, defines=None, extra_flags=()):
        self.modules.append((Path(source), defines))
        return _Module(self)


# ------------------------------------------------------------------------------ tiles
def test_tile_list_is_read_from_the_template_header():
    assert [t.name for t in TILES] == ["m16", "m32", "m64"]
    assert tiles_of_source(TEMPLATES_HEADER.read_text()) == TILES
    for t in TILES:
        assert t.bm in (16, 32, 64) and t.bn == 128 and t.threads == 256, t
    with pytest.raises(FormatError, match="no STRATA_GGML_FUSED_TILES"):
        tiles_of_source("// nothing here\n")


@pytest.mark.parametrize("name", IDS)
def test_every_type_fits_the_shared_memory_limits(name):
    """Every tile keeps at least two stages per type within sm_80's per-block limit and, with
    min_blocks resident, within an sm_90 SM (2 KiB reserved per block)."""
    d = next(s for s in SPECS if s.name == name)
    for t in TILES:
        sh = t.shape(d)
        assert 2 <= sh.stages <= t.stages, (t, sh.stages)
        assert sh.smem <= 163 * 1024, (t, sh.smem)
        assert t.min_blocks * (sh.smem + 2048) <= 228 * 1024, (t, sh.smem)
        assert sh.launch.k_multiple == d.stage_values and sh.launch.shared == sh.smem
    # a row's stage bytes start at (i * stage bytes) % 16 into their first chunk, for some i:
    # the shared row holds them from the furthest such start, with no chunk to spare
    reach = max((i * d.stage_bytes) % 16 for i in range(16)) + d.stage_bytes
    assert reach <= d.weight_row_bytes < reach + 16


@needs_nvcc
def test_launcher_sizes_the_pipeline_as_the_templates_do():
    """The compiled FusedCfg (host build of the same templates) states each type's stage and
    shared memory; the launcher's mirror of the formula gives the same numbers."""
    got = {t.name: host_decoder().fused_geometry(t.name) for t in TYPES}
    got[TQ2.name] = plugin_decoder(PLUGIN_SOURCE).fused_geometry(TQ2.name)
    for d in SPECS:
        want = [(d.block_values, d.block_bytes, d.stage_values, d.stage_bytes,
                 d.weight_row_bytes, t.shape(d).stages, t.shape(d).smem) for t in TILES]
        assert got[d.name] == want, d.name


def test_kernel_names_of_the_three_entries():
    d, t = DecoderSpec.of(next(t for t in TYPES if t.name == "Q4_K")), TILES[1]
    assert [kernel_name(d, t, e) for e in ENTRIES] == [
        "ggml_fused_Q4_K_m32", "ggml_fused_at_Q4_K_m32", "ggml_fused_tab_Q4_K_m32"]
    assert kernel_name(TQ2, TILES[0]) == "ggml_fused_TQ2_0_m16"
    with pytest.raises(FormatError, match="entry 'table' is unknown"):
        kernel_name(d, t, "table")
    text = TEMPLATES_HEADER.read_text()  # the macro defines one kernel per entry
    for prefix in ("ggml_fused_##SUFFIX", "ggml_fused_at_##SUFFIX", "ggml_fused_tab_##SUFFIX"):
        assert text.count(prefix) == 1, prefix


def test_pick_tile():
    assert [pick_tile(h).bm for h in (0, 1, 16, 17, 32, 33, 10 ** 6)] == [16, 16, 16, 32, 32,
                                                                          64, 64]
    assert pick_tile(500, "m16").bm == 16
    with pytest.raises(FormatError, match="unknown"):
        pick_tile(1, "gemm_f16_m32")


# ------------------------------------------------------------------------------ compiles
@needs_nvcc
@pytest.mark.parametrize("name", ["Q8_0", "Q6_K", "IQ4_XS", "MXFP4", "F32", "IQ1_M"])
def test_one_type_build_fits_its_register_budget(tmp_path, name):
    """fused.cu with STRATA_GGML_ONLY=<TYPE> (how the launcher builds it): exactly that type's
    kernels, none spilling, min_blocks per SM within the registers (sm_90)."""
    d = DecoderSpec.of(next(t for t in TYPES if t.name == name))
    tiles = {kernel_name(d, t, e): t for t in TILES for e in ENTRIES}
    assert_fits_registers(FUSED_SOURCE, "sm_90", tiles, tmp_path, (f"-D{ONLY_DEFINE}={name}",))


@needs_nvcc
def test_plugin_source_builds_its_gather_and_fused_kernels(tmp_path):
    """The example plugin's one macro line instantiates its gather, every fused tile's three
    entries and its five matrix-vector kernels (the expert products' also in their _host
    form)."""

    class Gather:
        threads, min_blocks = 256, 1

    class Gemv:
        threads, min_blocks = GEMV_THREADS, 1

    class GemvHost:
        threads, min_blocks = 32 * GEMV_HOST_WARPS, 1

    tiles = {kernel_name(TQ2, t, e): t for t in TILES for e in ENTRIES}
    gemv = {gemv_kernel_name(TQ2, part): Gemv for part in (*PARTS, "dense")}
    gemv |= {gemv_kernel_name(TQ2, part): GemvHost for part in HOST_PARTS}
    assert_fits_registers(PLUGIN_SOURCE, "sm_90",
                          {**tiles, **gemv, "ggml_gather_TQ2_0": Gather}, tmp_path)


@needs_nvcc
def test_all_types_module_compiles_every_kernel():
    """fused.cu without the define (what `strata check-kernels` compiles): every type's nine
    kernels (three tiles x three entries) in one module."""
    cubin = compile_cubin(FUSED_SOURCE, "sm_90").read_bytes()
    names = set(re.findall(rb"(ggml_fused_\w+?)\x00", cubin))
    want = {kernel_name(DecoderSpec.of(t), tile, e).encode() for t in TYPES for tile in TILES
            for e in ENTRIES}
    assert want <= names
    assert FUSED_SOURCE.resolve() in [p for owner, p in kernel_jobs([]) if owner == "ggml"]


# ------------------------------------------------------------------------------ launcher
def test_builtin_modules_are_built_per_type_on_first_use():
    rt = _Runtime()
    fg = GgmlFused(rt)  # type: ignore[arg-type]
    assert rt.modules == []
    fg.gemm(None, "Q4_K", 4096, (3, 5, 9), 8192, 12288, 16384, 1536, 2048, 20)
    fg.gemm(None, "Q4_K", 4096, (3,), 8192, 12288, 16384, 1536, 2048, 1)
    fg.gemm_at(None, 14, [1 << 20], (3,), 8192, 12288, 16384, 1536, 2048, 100)  # Q6_K's id
    assert rt.modules == [(FUSED_SOURCE, {ONLY_DEFINE: "Q4_K"}),
                          (FUSED_SOURCE, {ONLY_DEFINE: "Q6_K"})]
    assert rt.kernels["ggml_fused_Q4_K_m32"].arg_types == MMQ_ARG_TYPES  # type: ignore
    assert rt.kernels["ggml_fused_at_Q6_K_m64"].arg_types == AT_ARG_TYPES  # type: ignore
    fg.gemm_table(None, "Q6_K", 1 << 20, 4096, 8192, 12288, 16384, 1536, 2048, 1, 128)
    assert len(rt.modules) == 2  # the table kernel is in the type's module
    assert rt.kernels["ggml_fused_tab_Q6_K_m16"].arg_types == MMQ_TABLE_ARG_TYPES  # type: ignore


def test_gemv_modules_are_built_per_type_and_a_plugins_once():
    rt = _Runtime()
    gv = GgmlGemv(rt)  # type: ignore[arg-type]
    assert rt.modules == []
    for gtype, part in (("Q4_K", "gate_up"), ("Q4_K", "down"), ("Q6_K", "down"),
                        ("Q4_K", "gate_up")):
        gv.kernel(gtype, part)
    assert rt.modules == [(GEMV_SOURCE, {ONLY_DEFINE: "Q4_K"}),
                          (GEMV_SOURCE, {ONLY_DEFINE: "Q6_K"})]
    assert rt.kernels["ggml_gemv_down_Q6_K"].arg_types == GEMV_ARG_TYPES  # type: ignore
    # a plugin's one module loads when the launcher is made, once for all its kernels
    rt = _Runtime()
    gp = GgmlGemv(rt, source=PLUGIN_SOURCE, decoders=[TQ2])  # type: ignore[arg-type]
    assert rt.modules == [(PLUGIN_SOURCE, None)]
    gp.kernel("TQ2_0", "gate_up")
    gp.kernel("TQ2_0", "down")
    assert rt.modules == [(PLUGIN_SOURCE, None)]
    assert set(rt.kernels) == {"ggml_gemv_gate_up_TQ2_0", "ggml_gemv_down_TQ2_0"}
    with pytest.raises(FormatError, match="part"):
        gp.kernel("TQ2_0", "up")


def test_dense_gemv_refuses_at_open_a_row_it_cannot_take():
    """decode_dense gemv loads each dense type's kernel at open, and there refuses a row
    length that is not whole blocks, naming decode_dense gemm, rather than at the first step."""
    rt = _Runtime()
    gv = GgmlGemv(rt)  # type: ignore[arg-type]
    gv.prepare_dense("Q4_K", 2048)
    gv.prepare_dense("F16", 2056)
    assert {"ggml_gemv_dense_Q4_K", "ggml_gemv_dense_F16", "gemv_f16_rows"} <= set(rt.kernels)
    with pytest.raises(FormatError, match=r"Q4_K rows of 2080 values .* decode_dense gemm"):
        gv.prepare_dense("Q4_K", 2080)
    with pytest.raises(FormatError, match="F16 rows of 2052"):
        gv.prepare_dense("F16", 2052)


@pytest.mark.parametrize("name,hidden,ffn,values", [("IQ3_XXS", 2048, 768, 256),
                                                     ("Q8_0", 288, 160, 256),
                                                     ("F16", 512, 136, 128),
                                                     ("F32", 384, 136, 64)])
def test_gemv_launch_geometry(name, hidden, ffn, values):
    """gate/up tiles are 8 output rows (16 weight rows), down tiles 16; a block has one warp
    per K stage up to GEMV_WARPS, or GEMV_HOST_WARPS in the _host kernels (a launch that reads
    host memory); stages
    shrink for the wide types (whole blocks kept)."""
    rt = _Runtime()
    gv = GgmlGemv(rt)  # type: ignore[arg-type]
    d = gv.decoder(name)
    assert stage_values(d) == values and values % d.block_values == 0
    assert GEMV_WARPS < GEMV_HOST_WARPS
    for host_reads, cap, tail in ((False, GEMV_WARPS, ""), (True, GEMV_HOST_WARPS, "_host")):
        gv.launch(None, "gate_up", name, 16, 0, 32, 48, 64, 80, 8, hidden, ffn, host_reads)
        gv.launch(None, "down", name, 16, 1024, 32, 48, 64, 80, 8, hidden, ffn, host_reads)
        gu = rt.kernels[f"ggml_gemv_gate_up{tail}_{name}"].calls[-1]
        dn = rt.kernels[f"ggml_gemv_down{tail}_{name}"].calls[-1]
        assert GEMV_ROWS == 16
        assert gu.grid == (-(-ffn // 8), 8, 1) and dn.grid == (-(-hidden // 16), 8, 1)
        assert gu.block == (32 * min(cap, -(-hidden // values)), 1, 1)
        assert dn.block == (32 * min(cap, -(-ffn // values)), 1, 1)
        assert dn.args == (16, 1024, 32, 48, 64, 80, hidden, ffn)
    # the 2,048-value IQ3_XXS rows: 8 stages, so the host launch takes twice the warps
    if name == "IQ3_XXS":
        assert rt.kernels["ggml_gemv_gate_up_host_IQ3_XXS"].calls[-1].block[0] == 2 * 32 * GEMV_WARPS


@needs_nvcc
@pytest.mark.parametrize("name,warps", [("Q8_0", 6), ("IQ3_XXS", 8), ("F16", 8)])
def test_host_kernels_are_built_for_the_warps_the_launcher_gives(tmp_path, name, warps):
    """The _host kernels' stage buffers, one per warp, stay under GEMV_HOST_SHARED: Q8_0's
    400-byte staged rows allow 6 warps, not 8 (8 would pass the 48 KiB of static shared
    memory). ptxas's shared bytes of the one-type build are the launcher's host_warps(d)
    buffers of 16 staged rows, plus the block's sums and the decoder's tables."""
    d = DecoderSpec.of(next(t for t in TYPES if t.name == name))
    assert host_warps(d) == warps <= GEMV_HOST_WARPS
    assert warps * GEMV_ROWS * stage_span(d) <= GEMV_HOST_SHARED
    out = subprocess.run(
        [str(nvcc_path()), "-cubin", "-O3", "-std=c++17", "-arch=sm_90", "-I", str(KERNELS_ROOT),
         f"-D{ONLY_DEFINE}={name}", "-Xptxas", "-v", "-o", str(tmp_path / "gemv.cubin"),
         str(GEMV_SOURCE)], capture_output=True, text=True, check=True).stderr
    smem = dict(re.findall(r"Compiling entry function '(\w+)'.*?(\d+) bytes smem", out, re.S))
    buffers = warps * GEMV_ROWS * stage_span(d)
    for part in HOST_PARTS:
        got = int(smem[gemv_kernel_name(d, part)])
        assert buffers <= got <= buffers + warps * GEMV_ROWS * 4 + 2048, (part, got)
        assert got <= 48 * 1024


@pytest.mark.parametrize("name,rows,k,w", [("Q4_K", 5120, 2048, 1 << 20),
                                           ("F16", 2048, 4096, (1 << 20) + 2),
                                           ("Q8_0", 40, 288, 1 << 20)])
def test_gemv_dense_launch_geometry_and_refusals(name, rows, k, w):
    """A dense matrix times one row: tiles of 16 rows, one warp per K stage up to GEMV_WARPS,
    the mode as its number; bad modes, lengths and addresses are refused, named. (F16 weights
    off 16 bytes: F16 on 16 bytes takes the warp-per-row kernel, the test below.)"""
    rt = _Runtime()
    gv = GgmlGemv(rt)  # type: ignore[arg-type]
    d = gv.decoder(name)
    for mode, code in DENSE_MODES.items():
        gv.dense(None, name, w, 1 << 21, 1 << 22, rows, k, mode)
        call = rt.kernels[f"ggml_gemv_dense_{name}"].calls[-1]
        assert call.grid == (-(-rows // 16), 1, 1)
        assert call.block == (32 * min(GEMV_WARPS, -(-k // stage_values(d))), 1, 1)
        assert call.args == (w, 1 << 21, 1 << 22, rows, k, code)
    assert rt.kernels[f"ggml_gemv_dense_{name}"].arg_types == DENSE_ARG_TYPES  # type: ignore
    with pytest.raises(FormatError, match="mode"):
        gv.dense(None, name, 1 << 20, 1 << 21, 1 << 22, rows, k, "bf16")
    with pytest.raises(FormatError, match="multiple"):
        gv.dense(None, name, 1 << 20, 1 << 21, 1 << 22, rows, k + 4, "f32")
    with pytest.raises(FormatError, match="16 bytes"):
        gv.dense(None, name, 1 << 20, (1 << 21) + 8, 1 << 22, rows, k, "f32")


@pytest.mark.parametrize("rows", [1, 5120, 151936])
def test_f16_dense_on_16_bytes_takes_a_warp_per_row(rows):
    """F16 weights on 16 bytes: gemv_f16_rows, ROWS_WARPS rows a block, loaded with the
    tiled kernel (ahead of any capture), the tiled kernel not launched."""
    rt = _Runtime()
    gv = GgmlGemv(rt)  # type: ignore[arg-type]
    gv.kernel("F16", "dense")
    assert "gemv_f16_rows" in rt.kernels
    for mode, code in DENSE_MODES.items():
        gv.dense(None, "F16", 1 << 20, 1 << 21, 1 << 22, rows, 2048, mode)
        call = rt.kernels["gemv_f16_rows"].calls[-1]
        assert call.grid == (-(-rows // ROWS_WARPS), 1, 1) and call.block == (32 * ROWS_WARPS, 1, 1)
        assert call.args == (1 << 20, 1 << 21, 1 << 22, rows, 2048, code)
    assert not rt.kernels["ggml_gemv_dense_F16"].calls
    text = ROWS_SOURCE.read_text()
    assert f"#define ROWS_WARPS {ROWS_WARPS}" in text


@pytest.mark.parametrize("name", ["Q4_K", "F16", "IQ3_XXS", "MXFP4"])
@pytest.mark.parametrize("hint,tile,row_tiles", [(1, "m16", 1), (20, "m32", 1),
                                                 (300, "m64", 5), (0, "m16", 1)])
def test_launch_geometry_and_arguments(name, hint, tile, row_tiles):
    rt = _Runtime()
    fg = GgmlFused(rt)  # type: ignore[arg-type]
    d = fg.decoder(name)
    fg.gemm(None, name, 4096, (3, 5, 9), 8192, 12288, 16384, 1536, 2048, hint)
    (call,) = rt.kernels[f"ggml_fused_{name}_{tile}"].calls
    shape = next(t for t in TILES if t.name == tile).shape(d)
    assert call.grid == (1536 // 128, 3, row_tiles) and call.block == (256, 1, 1)
    assert call.shared == shape.smem
    assert call.args == (3, 5, 9, *([-1] * 13), 4096, 8192, 12288, 16384, 1536, 2048)
    srcs = [1 << 20, 7 << 20]
    fg.gemm_at(None, name, srcs, (4, 2), 8192, 12288, 16384, 1536, 2048, hint)
    (call,) = rt.kernels[f"ggml_fused_at_{name}_{tile}"].calls
    assert call.args == (*srcs, *([0] * 14), 4, 2, *([-1] * 14), 8192, 12288, 16384, 1536, 2048)
    assert call.grid == (1536 // 128, 2, row_tiles) and call.shared == shape.smem
    fg.gemm_table(None, name, 1 << 20, 4096, 8192, 12288, 16384, 1536, 2048, hint, 128)
    (call,) = rt.kernels[f"ggml_fused_tab_{name}_{tile}"].calls
    assert call.args == (1 << 20, 4096, 8192, 12288, 16384, 1536, 2048)
    assert call.grid == (1536 // 128, 128, row_tiles) and call.block == (256, 1, 1)
    assert call.shared == shape.smem


GOOD = dict(stream=None, gtype="Q4_K", weights=4096, expert_ids=(0, 1), acts=8192,
            bounds=12288, out=16384, m=1536, k=2048, rows_hint=16)


@pytest.mark.parametrize("change,match", [
    ({"k": 2048 + 64}, "multiple of 256"),
    ({"gtype": "F16", "k": 2048 + 64}, "multiple of 128"),
    ({"gtype": "F32", "k": 2048 + 32}, "multiple of 64"),
    ({"gtype": "IQ3_XXS", "m": 1, "k": 256}, "not a multiple of 16"),
    ({"gtype": "F32", "m": 1 << 17, "k": 8192}, "4 GiB"),
    ({"m": 1000}, "m=1000"),
    ({"gtype": "Q8_1"}, "no decoder"),
    ({"gtype": "TQ2_0"}, "no decoder"),
    ({"expert_ids": tuple(range(17))}, "1..16"),
    ({"expert_ids": (2, -1)}, "-1"),
    ({"weights": 4100}, "weights"),
    ({"acts": 8200}, "acts"),
    ({"out": 16388}, "out"),
    ({"rows_hint": -1}, "-1"),
    ({"tile": "m128"}, "m128"),
])
def test_gemm_refuses_what_the_kernel_cannot_do(change, match):
    rt = _Runtime()
    fg = GgmlFused(rt)  # type: ignore[arg-type]
    with pytest.raises(FormatError, match=re.escape(match)):
        fg.gemm(**{**GOOD, **change})
    assert not any(k.calls for k in rt.kernels.values())


@pytest.mark.parametrize("change,match", [
    ({"sources": [1 << 20]}, "1 image addresses for 2 experts"),
    ({"sources": [1 << 20, (2 << 20) + 8]}, "image 1"),
    ({"gtype": "IQ2_XXS", "m": 1, "k": 256}, "not a multiple of 16"),
    ({"k": 100}, "k=100"),
])
def test_gemm_at_refuses_what_the_kernel_cannot_do(change, match):
    rt = _Runtime()
    fg = GgmlFused(rt)  # type: ignore[arg-type]
    args = {**GOOD, "sources": [1 << 20, 2 << 20], **change}
    del args["weights"]
    with pytest.raises(FormatError, match=re.escape(match)):
        fg.gemm_at(**args)
    assert not any(k.calls for k in rt.kernels.values())


@pytest.mark.parametrize("change,match", [
    ({"table": (1 << 20) + 4}, "not a nonzero multiple of 8"),
    ({"table": 0}, "not a nonzero multiple of 8"),
    ({"offset": 8}, "offset 8"),
    ({"offset": -4096}, "offset -4096"),
    ({"n_experts": 0}, "got 0"),
    ({"n_experts": 1 << 16}, "got 65536"),
    ({"gtype": "IQ2_XXS", "m": 1, "k": 256}, "not a multiple of 16"),
    ({"gtype": "F32", "m": 1 << 17, "k": 8192}, "4 GiB"),
    ({"k": 100}, "k=100"),
    ({"m": 1000}, "m=1000"),
    ({"out": 16388}, "out"),
    ({"rows_hint": -1}, "-1"),
    ({"tile": "m128"}, "m128"),
])
def test_gemm_table_refuses_what_the_kernel_cannot_do(change, match):
    rt = _Runtime()
    fg = GgmlFused(rt)  # type: ignore[arg-type]
    args = {**GOOD, "table": 1 << 20, "offset": 4096, "n_experts": 128, **change}
    del args["weights"], args["expert_ids"]
    with pytest.raises(FormatError, match=re.escape(match)):
        fg.gemm_table(**args)
    assert not any(k.calls for k in rt.kernels.values())


def test_native_image_bytes():
    assert native_image_bytes("Q4_K", 1536, 2048) == 1536 * 8 * 144
    assert native_image_bytes(TQ2, 256, 512) == 256 * 2 * 66
    assert native_image_bytes("F16", 128, 128) == 128 * 256
    with pytest.raises(FormatError, match="multiple of 256"):
        native_image_bytes("Q8_0", 128, 96)


def test_decoder_specs_are_checked():
    with pytest.raises(FormatError, match="C identifier"):
        DecoderSpec("TQ2-0", 256, 66)
    for values, nbytes in ((3, 4), (1, 3), (1, 8), (48, 20), (512, 100), (256, 0)):
        with pytest.raises(FormatError, match="do not fit"):
            DecoderSpec("X", values, nbytes)
    assert (TQ2.stage_values, TQ2.stage_bytes, TQ2.weight_row_bytes) == (256, 66, 80)


def test_plugin_launchers_use_the_plugin_module_and_its_decoders():
    rt = _Runtime()
    fg = GgmlFused(rt, source=PLUGIN_SOURCE, decoders=[TQ2])  # type: ignore[arg-type]
    gg = GgmlGather(rt, source=PLUGIN_SOURCE, decoders=[TQ2])  # type: ignore[arg-type]
    assert rt.modules == [(PLUGIN_SOURCE, None), (PLUGIN_SOURCE, None)]
    fg.gemm(None, "TQ2_0", 4096, (1,), 8192, 12288, 16384, 256, 512, 40)
    fg.gemm_at(None, TQ2, [1 << 20], (1,), 8192, 12288, 16384, 256, 512, 40, tile="m16")
    gg.gather(None, "TQ2_0", [0x1001], 0x10000, 256, 512)
    assert rt.kernels["ggml_fused_TQ2_0_m64"].calls[0].shared == TILES[2].shape(TQ2).smem
    assert len(rt.kernels["ggml_fused_at_TQ2_0_m16"].calls) == 1
    fg.gemm_table(None, TQ2, 1 << 20, 0, 8192, 12288, 16384, 256, 512, 40, 64)
    assert rt.kernels["ggml_fused_tab_TQ2_0_m64"].calls[0].grid == (2, 64, 1)
    (call,) = rt.kernels["ggml_gather_TQ2_0"].calls
    assert call.args[16:] == (0x10000, 2 * 256 * 512, 256 * 512, 0, 0, 0)
    assert rt.kernels["ggml_gather_TQ2_0"].arg_types == GATHER_ARG_TYPES  # type: ignore
    assert len(rt.modules) == 2  # nothing compiled per type for a plugin's module
    for launcher in (fg, gg):
        with pytest.raises(FormatError, match="not in this launcher's module"):
            launcher.decoder("Q4_K")
        with pytest.raises(FormatError, match="differs"):
            launcher.decoder(DecoderSpec("TQ2_0", 256, 64 + 4))
    with pytest.raises(FormatError, match="name its decoders"):
        GgmlFused(rt, source=PLUGIN_SOURCE)  # type: ignore[arg-type]
    with pytest.raises(FormatError, match="name its decoders"):
        GgmlGather(rt, source=PLUGIN_SOURCE)  # type: ignore[arg-type]

"""The CUTLASS grouped GEMM for sm_90 (strata_rt/gemm/cutlass_gemm.py, kernels/cutlass/).

CPU: the tile table against the source, header discovery, the STRATA_F16_GEMM policy, how
GroupedGemm hands launches over, and (with nvcc and the nvidia-cutlass headers) a real build
whose library loads and reports its ABI. GPU (sm_90): every kernel against float64 products of
the same fp16 inputs on fresh random inputs with outputs poisoned first, over 0, 1, odd and very
uneven rows per expert, 1 to 16 experts and both model geometries; same bytes run after run;
rows of other experts untouched; a captured CUDA graph replayed after the routing changed.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from _gemm_cases import GEMM_CASES, NAN_F32, _download, _upload, make_gemm_case, run_gemm

from strata_rt.errors import FormatError, KernelBuildError
from strata_rt.formats.numerics import nmse
from strata_rt.gemm import cutlass_gemm
from strata_rt.gemm.cutlass_gemm import (
    CUTLASS_BY_NAME,
    CUTLASS_SOURCE,
    CUTLASS_TILES,
    cutlass_for,
    cutlass_tile,
    find_headers,
)
from strata_rt.gemm.grouped_gemm import CUTLASS_MIN_ROWS, TILES, GroupedGemm, gemm_reference
from strata_rt.runtime.compile import nvcc_available

GEMM_NMSE = 1e-6
# ------------------------------------------------------------------------------ CPU
def test_tile_table_matches_the_source():
    text = CUTLASS_SOURCE.read_text()
    pattern = (r"^using (\w+) = Config<Shape<_(\d+), _(\d+), _64>, Shape<_(\d+), _1, _1>, "
               r"(Coop|Ping), \w+>;")
    configs = {m[0]: m[1:] for m in re.findall(pattern, text, re.M)}
    cases = re.findall(r"case (\d+): return workspace_of<(\w+)>", text)
    assert [int(i) for i, _ in cases] == [t.index for t in CUTLASS_TILES]
    for (_, name), t in zip(cases, CUTLASS_TILES):
        bm, bn, cluster, sched = configs[name]
        assert (int(bm), int(bn), int(cluster)) == (t.bm, t.bn, t.cluster), t
        assert sched == {"cooperative": "Coop", "pingpong": "Ping"}[t.schedule], t
    assert f"strata_cutlass_tiles(void) {{ return {len(CUTLASS_TILES)}; }}" in text
    assert f"strata_cutlass_abi(void) {{ return {cutlass_gemm.ABI}; }}" in text


def test_rule_covers_every_size():
    assert cutlass_tile(CUTLASS_MIN_ROWS).name in CUTLASS_BY_NAME
    assert cutlass_tile(10 ** 6).name in CUTLASS_BY_NAME
    with pytest.raises(FormatError, match="cutlass_9x9"):
        cutlass_tile(100, "cutlass_9x9")


def test_headers_from_a_checkout(tmp_path, monkeypatch):
    monkeypatch.setenv("STRATA_CUTLASS_DIR", str(tmp_path))
    headers, why = find_headers()
    assert headers is None and "include/cutlass/version.h" in why and str(tmp_path) in why
    (tmp_path / "include" / "cutlass").mkdir(parents=True)
    (tmp_path / "include" / "cutlass" / "version.h").write_text("#define CUTLASS_MAJOR 9\n")
    util = tmp_path / "tools" / "util" / "include" / "cutlass" / "util"
    util.mkdir(parents=True)
    (util / "packed_stride.hpp").write_text("")
    headers, why = find_headers()
    assert headers is not None and why == ""
    assert headers.include == tmp_path / "include" and b"MAJOR 9" in headers.version


class _FakeRuntime:
    def __init__(self, arch: str, f16_gemm: str = "auto"):
        self.arch, self.f16_gemm = arch, f16_gemm


def test_policy(monkeypatch, tmp_path, caplog):
    """The runtime's f16_gemm policy (an engine's EngineConfig.f16_gemm) decides; the
    environment's STRATA_F16_GEMM is the engine config's business, never read here."""
    monkeypatch.setenv("STRATA_F16_GEMM", "cutlass")  # ignored: only the runtime's policy counts
    assert cutlass_for(_FakeRuntime("sm_90", "own")) is None  # type: ignore[arg-type]
    assert cutlass_for(_FakeRuntime("sm_80")) is None  # type: ignore[arg-type]
    assert not caplog.records, "no warning where CUTLASS is simply not for this GPU"
    with pytest.raises(KernelBuildError, match="sm_90 only; this device is sm_80"):
        cutlass_for(_FakeRuntime("sm_80", "cutlass"))  # type: ignore[arg-type]
    monkeypatch.setenv("STRATA_CUTLASS_DIR", str(tmp_path))  # no headers there
    with pytest.raises(KernelBuildError, match="pip install nvidia-cutlass"):
        cutlass_for(_FakeRuntime("sm_90", "cutlass"))  # type: ignore[arg-type]
    assert cutlass_for(_FakeRuntime("sm_90")) is None  # type: ignore[arg-type]
    assert "own mma.sync kernels serve every size" in caplog.text


class _RecordingCutlass:
    def __init__(self):
        self.calls: list[tuple] = []

    def gemm(self, stream, *args, tile=None):
        self.calls.append((*args, tile))


def test_grouped_gemm_hands_large_launches_over():
    from _recording import RecordingKernel

    gg = GroupedGemm.__new__(GroupedGemm)
    gg._gemm = {t.name: RecordingKernel() for t in TILES}
    rec = _RecordingCutlass()
    gg._cutlass = rec  # type: ignore[assignment]
    args = (4096, (3, 5), 8192, 12288, 16384, 1536, 2048)
    gg.gemm(None, *args, CUTLASS_MIN_ROWS - 1)
    assert not rec.calls and sum(len(k.calls) for k in gg._gemm.values()) == 1
    gg.gemm(None, *args, CUTLASS_MIN_ROWS)
    gg.gemm(None, *args, 1, tile="cutlass_128x256")
    assert rec.calls == [(*args, CUTLASS_MIN_ROWS, None), (*args, 1, "cutlass_128x256")]
    gg.gemm(None, *args, 5000, tile="gemm_f16_m64")  # an own tile stays own
    assert len(gg._gemm["gemm_f16_m64"].calls) == 2 and len(rec.calls) == 2
    assert gg.tile_name(5000) == cutlass_tile(5000).name
    assert gg.tile_name(8) == "gemm_f16_m32"


@pytest.mark.slow
@pytest.mark.skipif(not nvcc_available() or find_headers()[0] is None,
                    reason="needs nvcc and the nvidia-cutlass headers (the test extra)")
def test_library_builds_and_loads():
    """The real build for sm_90a (a minute or two the first time; then the kernel cache)."""
    path = cutlass_gemm.build_library()
    lib = cutlass_gemm.load_library(path)
    assert lib.strata_cutlass_abi() == cutlass_gemm.ABI
    assert lib.strata_cutlass_args_bytes() >= 16 * (12 + 3 * 8)
    assert cutlass_gemm.build_library() == path  # cached


# ------------------------------------------------------------------------------ GPU
def _cutlass_or_skip(rt) -> cutlass_gemm.CutlassGemm:
    why = cutlass_gemm.unavailable_reason(rt)
    if why is not None:
        pytest.skip(why)
    gemm = cutlass_for(rt)
    assert gemm is not None
    return gemm


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,counts,ids", GEMM_CASES)
def test_gpu_matches_float64_and_is_deterministic(rt, rng, m, k, counts, ids):
    cg = _cutlass_or_skip(rt)
    case = make_gemm_case(rng, m, k, counts, ids)
    hint = max(1, case.max_rows())
    names = [t.name for t in CUTLASS_TILES]
    outs = run_gemm(rt, cg, case, [hint], [*names, names[0]])
    inside = case.rows_of_group()
    want = gemm_reference(case.images, ids, case.x, case.bounds, m, k)[inside]
    for name, raw in zip([*names, "repeat"], outs):
        assert np.all(raw[~inside] == NAN_F32), f"{name}: rows outside the group written"
        got = raw[inside].view(np.float32)
        assert np.isfinite(got).all(), f"{name}: rows of the group unwritten or not finite"
        if inside.any():
            err = nmse(got, want)
            print(f"{name} m={m} k={k}: NMSE {err:.3g} vs float64 of the same fp16 inputs")
            assert err <= GEMM_NMSE, name
    assert np.array_equal(outs[0], outs[-1]), "a repeat gave other bytes"
    # the own mma.sync kernels take the same k16 steps in the same order from zero: the
    # sm_90 tensor cores give the same bytes either way, so choosing a kernel by rows_hint
    # keeps the GEMM's bytes independent of rows_hint
    own = run_gemm(rt, GroupedGemm(rt), case, [hint], ["gemm_f16_m128", "gemm_f16_m32"])
    for raw in own:
        assert np.array_equal(raw[inside], outs[0][inside]), "CUTLASS and own kernels differ"


@pytest.mark.gpu
def test_gpu_graph_replay_follows_the_routing(rt, rng):
    """A captured launch reads bounds on the device: replayed after new routing was written
    into the same buffers, it computes the new products (no host value was baked in)."""
    cg = _cutlass_or_skip(rt)
    m, k, ids = 1536, 2048, (0, 1, 2, 3)
    first = make_gemm_case(rng, m, k, [300, 0, 5, 200], ids)
    second = make_gemm_case(rng, m, k, [1, 400, 0, 104], ids)
    assert first.x.shape == second.x.shape
    s = rt.stream("graph")
    bufs = [_upload(rt, s, a) for a in (first.images, first.x, first.bounds)]
    out = rt.alloc(first.x.shape[0] * m * 4)
    try:
        with rt.capture(s) as graph:
            cg.gemm(s, bufs[0].ptr, ids, bufs[1].ptr, bufs[2].ptr, out.ptr, m, k, 300)
        for case in (first, second):
            for buf, host in zip(bufs, (case.images, case.x, case.bounds)):
                rt.memcpy_htod(buf.ptr, np.ascontiguousarray(host), s)
            rt.memcpy_htod(out.ptr, np.full(case.x.shape[0] * m, NAN_F32), s)
            graph.launch(s)
            got = _download(rt, s, out.ptr, out.nbytes).view(np.float32).reshape(-1, m)
            want = gemm_reference(case.images, ids, case.x, case.bounds, m, k)
            assert nmse(got, want) <= GEMM_NMSE
    finally:
        for b in [*bufs, out]:
            b.free()


@pytest.mark.gpu
def test_gpu_many_streams_each_get_their_own_block(rt, rng):
    """More streams than the spare blocks, each launching once: blocks are topped up outside
    captures, and every stream's product is right."""
    cg = _cutlass_or_skip(rt)
    case = make_gemm_case(rng, 256, 128, [70, 3, 90], (0, 1, 2))
    want = gemm_reference(case.images, case.ids, case.x, case.bounds, 256, 128)
    for i in range(3 * cutlass_gemm.SPARE_BLOCKS):
        got = run_gemm(rt, cg, case, [90], [None])[0].view(np.float32)
        assert nmse(got, want) <= GEMM_NMSE, f"stream {i}"

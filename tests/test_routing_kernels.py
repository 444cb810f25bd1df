"""Routing kernels (kernels/common/routing.cu): the numpy twins and launcher checks on the CPU;
on a GPU, every kernel against its twin on fresh random inputs with outputs poisoned first,
determinism, chunk independence, and the fp16 numerics against the float32 reference."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from _device_buffers import download, poisoned, upload
from hypothesis import given, settings
from hypothesis import strategies as st

from strata_rt.backends.cuda.routing import kernels as routing_kernels
from strata_rt.backends.cuda.routing.kernels import (
    GEMM_TILE_RULE,
    GEMM_TILES,
    HIDDEN_MULTIPLE,
    MAX_EXPERTS,
    ROUTING_SOURCE,
    RoutingKernels,
    RoutingShapeError,
    check_routing_shape,
    counting_sort_ref,
    gemm_tile,
    gemm_tiles_for,
    n_tiles,
    route_ref,
    router_f16,
    router_logits_ref,
    tile_masks_ref,
    tile_sort_ref,
    to_f16,
    topk_softmax_ref,
    workspace_bytes,
)
from strata_rt.formats.testing_abi import Recorder
from strata_rt.weights.model import route

gpu = pytest.mark.gpu

#: measured set-flip rate of fp16 logits against float32 on these inputs: ~0.25% (H=2048,
#: E=128, k=8, logits of std 2); asserted with margin
MAX_SET_FLIPS = 0.01
#: weights of tokens whose picks agree with float32: measured max relative error ~0.3%
MAX_WEIGHT_REL = 0.01
#: fp32-accumulated logits against the exact product of the fp16 operands, relative to
#: sum_c |x_c w_c| (K/16 mma steps of float32 sums)
LOGIT_TOL = 4e-5
#: the tile every other tile's logits are compared with byte for byte (its K step divides every
#: supported hidden size)
REFERENCE_TILE = "m64"
#: (hidden, n_experts) of the byte-for-byte tile tests: the 235B router's hidden size (every
#: tile applies) with experts that fill no tile's BN, and 17 x 64 (the K-128 tiles are refused)
TILE_SHAPES = [(4096, 200), (1088, 60)]
#: (first, end) token ranges of those tests: 1, 33 and 1000 tokens (a multiple of no tile's BM),
#: the 33 at an offset that is not one either
TILE_CHUNKS = [(0, 1), (967, 1000), (0, 1000)]
#: shared memory of one SM of sm_90, and what the runtime reserves of it per block
SM_SHARED = 228 * 1024
BLOCK_RESERVED_SHARED = 1024


def _random_ids(rng, tokens, n_experts, top_k, skew=1.0):
    """Distinct experts per token, popularity skewed so some experts get nothing."""
    pop = rng.random(n_experts) ** (4 * skew)
    pop[rng.integers(0, n_experts, max(1, n_experts // 8))] = 0.0
    pop[0] = max(pop[0], 1e-3)
    pop /= pop.sum()
    keys = np.log(np.maximum(pop, 1e-30))[None, :] + rng.gumbel(size=(tokens, n_experts))
    return np.argsort(-keys, axis=1)[:, :top_k].astype(np.int32)


def _inputs(rng, tokens, hidden, n_experts):
    xn = rng.standard_normal((tokens, hidden), dtype=np.float32)
    router = (rng.standard_normal((n_experts, hidden)) * 2 / np.sqrt(hidden)).astype(np.float32)
    return xn, router


# ============================================================================ CPU: twins
@settings(max_examples=60, deadline=None)
@given(tokens=st.integers(1, 200), n_experts=st.sampled_from([2, 8, 32, 60, 128]),
       k_frac=st.floats(0.0, 1.0), seed=st.integers(0, 2**32 - 1))
def test_tile_sort_is_the_stable_counting_sort(tokens, n_experts, k_frac, seed):
    rng = np.random.default_rng(seed)
    top_k = 1 + int(k_frac * (min(16, n_experts) - 1))
    ids = _random_ids(rng, tokens, n_experts, top_k)
    for got, want in zip(tile_sort_ref(ids, n_experts), counting_sort_ref(ids, n_experts),
                         strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("tokens,n_experts,top_k", [(1, 32, 4), (33, 128, 8), (500, 60, 16)])
def test_counting_sort_ref_by_definition(rng, tokens, n_experts, top_k):
    ids = _random_ids(rng, tokens, n_experts, top_k)
    bounds, sorted_token, row_of = counting_sort_ref(ids, n_experts)
    assert bounds[0] == 0 and bounds[-1] == tokens * top_k
    assert (np.diff(bounds) == np.bincount(ids.reshape(-1), minlength=n_experts)).all()
    assert (np.diff(bounds) == 0).any(), "the case should hold an expert with no rows"
    assert sorted(row_of.tolist()) == list(range(tokens * top_k))
    for e in range(n_experts):
        toks = sorted_token[bounds[e]: bounds[e + 1]]
        assert (np.diff(toks) > 0).all()  # tokens ascending inside an expert
        assert (ids[toks] == e).any(axis=1).all()
    t = np.repeat(np.arange(tokens), top_k)
    assert (sorted_token[row_of] == t).all()
    assert (np.searchsorted(bounds, row_of, side="right") - 1 == ids.reshape(-1)).all()


def test_tile_masks_mark_each_pair_once(rng):
    ids = _random_ids(rng, 77, 32, 4)
    masks = tile_masks_ref(ids, 32)
    assert masks.shape == (32, n_tiles(77)) == (32, 3)
    bits = np.unpackbits(masks.astype("<u4").view(np.uint8)).sum()
    assert bits == ids.size
    t, j = 70, 2
    assert masks[ids[t, j], t // 32] >> np.uint32(t % 32) & np.uint32(1)


def test_topk_ref_ties_go_to_the_lower_id():
    logits = np.zeros((4, 32), np.float32)      # row 0: all equal
    logits[1, [5, 9, 20, 30]] = 1.0             # row 1: four equal winners
    logits[2, [7, 3]] = 2.0
    logits[2, [31, 1, 12]] = 1.0                # row 2: 3, 7 then 1, 12 (31 loses the tie)
    logits[3] = -1.0
    logits[3, 6] = -0.0                         # -0 and +0 are the same logit: 6 before 8
    logits[3, 8] = 0.0
    ids, w = topk_softmax_ref(logits, 4)
    np.testing.assert_array_equal(ids, [[0, 1, 2, 3], [5, 9, 20, 30], [3, 7, 1, 12],
                                        [6, 8, 0, 1]])
    np.testing.assert_allclose(w[0], 0.25, rtol=1e-6)
    np.testing.assert_allclose(w.sum(axis=1), 1.0, rtol=1e-6)


def test_topk_ref_agrees_with_model_route(rng):
    logits = (rng.standard_normal((300, 128)) * 2).astype(np.float32)
    ids, w = topk_softmax_ref(logits, 8)
    # route() on the logits themselves: an identity router multiplies exactly
    want_ids, want_w = route(logits, np.eye(128, dtype=np.float32), 8)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(w, want_w, rtol=2e-6)


def test_to_f16_rounds_to_nearest_even_and_clamps():
    one = np.float32(1.0)
    u = np.float32(2.0 ** -11)  # half an fp16 ulp at 1
    got = to_f16(np.array([one + u, one + 3 * u, 7e4, -1e9, np.inf, 65504.0, 65519.0],
                          np.float32))
    np.testing.assert_array_equal(got[:2], np.array([1.0, 1.0 + 4 * u], np.float16))
    np.testing.assert_array_equal(got[2:], np.array([65504, -65504, 65504, 65504, 65504],
                                                    np.float16))
    assert np.isnan(to_f16(np.array([np.nan], np.float32)))[0]
    assert router_f16(np.ones((2, 3, 4), np.float32)).dtype == np.float16


@pytest.mark.parametrize("hidden,n_experts,top_k", [(2048, 128, 8), (1024, 32, 4)])
def test_fp16_logits_change_few_picks(rng, hidden, n_experts, top_k):
    """The numerics statement, on the twin: fp16 operands with exact products summed in
    float64 (the kernel sums in float32, a far smaller error) against the float32 route."""
    xn, router = _inputs(rng, 3000, hidden, n_experts)
    r = route_ref(xn, router, top_k)
    ids32, w32 = route(xn, router, top_k)
    flips = (np.sort(ids32, axis=1) != np.sort(r["ids"], axis=1)).any(axis=1).mean()
    assert flips <= MAX_SET_FLIPS
    same = (ids32 == r["ids"]).all(axis=1)
    assert same.mean() > 0.95
    rel = np.abs(r["weights"][same] - w32[same]) / w32[same]
    assert rel.max() <= MAX_WEIGHT_REL
    l64 = xn.astype(np.float64) @ router.T.astype(np.float64)
    assert np.abs(r["logits"] - l64).max() <= 2e-3 * l64.std() * np.sqrt(hidden / 1024) + 1e-3


# ============================================================================ CPU: launcher
def test_shape_checks_name_every_problem():
    check_routing_shape(2048, 128, 8, 9200)
    check_routing_shape(4096, MAX_EXPERTS, 16)
    with pytest.raises(RoutingShapeError) as e:
        check_routing_shape(2000, 129, 17, 0)
    msg = str(e.value)
    for part in ("hidden=2000", "n_experts=129", "top_k=17", "tokens=0"):
        assert part in msg
    with pytest.raises(RoutingShapeError, match="top_k=9"):
        check_routing_shape(64, 8, 9)
    with pytest.raises(RoutingShapeError, match="n_experts=1024"):
        check_routing_shape(64, 1024, 8)


def test_workspace_and_tile_choice():
    assert n_tiles(1) == 1 and n_tiles(32) == 1 and n_tiles(33) == 2
    assert workspace_bytes(8192, 128, "f16") == (2 * 128 * 256 + 128) * 4
    for hidden in (2048, 4096):
        assert gemm_tile(254, hidden) == "m16k128" and gemm_tile(2048, hidden) == "m16k128"
        assert gemm_tile(2049, hidden) == "m64k128" and gemm_tile(8192, hidden) == "m64k128"
    # hidden 1088 is no multiple of 128: the K-64 and K-32 fallbacks
    assert gemm_tile(254, 1088) == "m16" and gemm_tile(2048, 1088) == "m16"
    assert gemm_tile(2049, 1088) == "m64" and gemm_tile(8192, 1088) == "m64"


def test_tile_rule_is_well_formed():
    assert all(name in GEMM_TILES for _, name in GEMM_TILE_RULE)
    # rows in order of chunk length (None: any length, only at the end, where a K-128 row
    # may still need a fallback row after it)
    bounds = [float("inf") if m is None else m for m, _ in GEMM_TILE_RULE]
    assert bounds == sorted(bounds)
    last_max, last = GEMM_TILE_RULE[-1]
    assert last_max is None, "the last row must cover every chunk length"
    assert HIDDEN_MULTIPLE % GEMM_TILES[last].bk == 0, "the last row must fit every hidden size"


@settings(max_examples=300, deadline=None)
@given(tokens=st.integers(1, 20000), hidden=st.integers(1, 128).map(lambda h: h * 64))
def test_tile_rule_never_picks_a_tile_whose_k_step_does_not_divide_hidden(tokens, hidden):
    for rule in (GEMM_TILE_RULE,
                 ((512, "m16k128"), (2048, "m64k64"), (2048, "m16"), (None, "m64k128"),
                  (None, "m64")),
                 ((None, "m64k128"), (None, "m64k64"), (None, "m64"))):
        name = gemm_tile(tokens, hidden, rule)
        assert GEMM_TILES[name].fits(hidden) and name in gemm_tiles_for(hidden)
        # the first row that covers the chunk and fits hidden, and no other
        want = next(n for m, n in rule
                    if (m is None or tokens <= m) and hidden % GEMM_TILES[n].bk == 0)
        assert name == want


def test_tile_rule_falls_back_where_the_k_step_does_not_divide_hidden():
    rule = ((512, "m16k128"), (2048, "m64k64"), (None, "m64k128"), (None, "m16"))
    assert [gemm_tile(t, 4096, rule) for t in (1, 512, 513, 2048, 2049)] == [
        "m16k128", "m16k128", "m64k64", "m64k64", "m64k128"]
    assert [gemm_tile(t, 1088, rule) for t in (1, 512, 513, 2048, 2049)] == [
        "m64k64", "m64k64", "m64k64", "m64k64", "m16"]
    assert gemm_tiles_for(1088) == ["m64", "m16", "m64k64"]
    assert gemm_tiles_for(4096) == list(GEMM_TILES)
    with pytest.raises(RoutingShapeError, match="no GEMM tile"):
        gemm_tile(100, 1088, ((None, "m16k128"),))


def test_launcher_kernels_exist_in_the_source():
    src = ROUTING_SOURCE.read_text()
    names = re.findall(r'mod\.kernel\(f?"([^"]+)"', Path(routing_kernels.__file__).read_text())
    assert names
    for name in names:
        if "{name}" in name:
            for tile in GEMM_TILES:
                assert f"router_logits_f16_{tile}(" in src
        elif "{npl}" in name:
            for npl in (1, 2, 4, 8, 16):
                assert f"TOPK_KERNEL({npl})" in src
        else:
            assert f"{name}(" in src


def test_gemm_tile_table_matches_the_kernel_templates():
    """The launcher's grid and shared-memory sizes come from the template arguments."""
    src = ROUTING_SOURCE.read_text()
    assert set(re.findall(r"\nrouter_logits_f16_(\w+)\(", src)) == set(GEMM_TILES)
    for name, tile in GEMM_TILES.items():
        m = re.search(rf"__launch_bounds__\((\d+)(?:, (\d+))?\)\nrouter_logits_f16_{name}\("
                      rf"[^{{]*\{{\s*router_gemm<(\d+), (\d+), (\d+), (\d+), (\d+), (\d+)>",
                      src)
        assert m, name
        threads, min_blocks = int(m[1]), int(m[2] or 1)
        args = tuple(map(int, m.groups()[2:]))
        tbm, tbn, wm, wn, bk, stages = args
        assert args == tuple(tile), name
        assert (tile.bm, tile.bn, tile.threads) == (tbm, tbn, wm * wn * 32) == (tbm, tbn, threads)
        assert tile.shared == stages * (tbm * (bk + 8) * 4 + tbn * (bk + 8) * 2) + tbm * (bk + 8) * 2
        # the kernel's static_asserts, restated: warps tile the block in 16 x 16 steps
        assert tbm % (16 * wm) == 0 and tbn % (16 * wn) == 0 and bk % 16 == 0 and stages >= 2
        # the blocks per SM the launch bounds ask for fit the shared memory of an sm_90 SM
        assert min_blocks * (tile.shared + BLOCK_RESERVED_SHARED) <= SM_SHARED, name


def test_launcher_refuses_a_tile_whose_k_step_does_not_divide_hidden():
    rt = Recorder()
    rk = RoutingKernels(rt)
    assert {f"router_logits_f16_{name}" for name in GEMM_TILES} <= set(rt.kernels)
    for name in ("m16k128", "m64k128"):
        with pytest.raises(RoutingShapeError, match=rf"tile '{name}' steps K by 128: "
                                                    r"hidden=1088 .*m64, m16, m64k64$"):
            rk.logits(None, 0x1000, 0x2000, 0x3000, 33, 1088, 60, tile=name)
    assert not rt.launches
    for name, tile in GEMM_TILES.items():
        rk.logits(None, 0x1000, 0x2000, 0x3000, 1000, 4096, 200, tile=name)
        kernel, grid, block, shared, args = rt.calls[-1]
        assert kernel == f"router_logits_f16_{name}"
        assert grid == (-(-1000 // tile.bm), -(-200 // tile.bn), 1)
        assert block == (tile.threads, 1, 1) and shared == tile.shared
        assert args == (0x1000, 0x2000, 0x3000, 1000, 4096, 200)
    assert rt.calls[list(GEMM_TILES).index("m16k128")][1:4] == ((63, 4, 1), (128, 1, 1), 108800)


def test_route_launches_four_kernels_with_the_engine_shapes():
    rt = Recorder()
    rk = RoutingKernels(rt)
    T, H, E, K = 9200, 2048, 128, 8
    rk.route(None, xn=0x1000, router16=0x2000, logits=0x3000, ids=0x4000, weights=0x5000,
             bounds=0x6000, sorted_token=0x7000, row_of=0x8000, workspace=0x9000, tokens=T,
             hidden=H, n_experts=E, top_k=K)
    names = [c[0] for c in rt.calls]
    assert names == ["router_logits_f16_m64k128", "topk_softmax_w4", "route_tile_scan",
                     "route_scatter"]
    gemm, topk, scan, scatter = rt.calls
    assert gemm[1] == (144, 1, 1) and gemm[2] == (256, 1, 1) and gemm[3] > 48 * 1024
    assert topk[1] == (288, 1, 1) and topk[2] == (1024, 1, 1)
    assert scan[1] == (128, 1, 1)
    assert scatter[1] == (288, 1, 1) and scatter[2] == (256, 1, 1)
    nt = 288
    assert scan[4] == (0x9000, nt, 0x9000 + E * nt * 4, 0x9000 + 2 * E * nt * 4)
    rt.launches.clear()
    rk.route(None, xn=0x1000, router16=0x2000, logits=0x3000, ids=0x4000, weights=0x5000,
             bounds=0x6000, sorted_token=0x7000, row_of=0x8000, workspace=0x9000, tokens=7,
             hidden=H, n_experts=256, top_k=16)
    assert [c[0] for c in rt.calls][:2] == ["router_logits_f16_m16k128", "topk_softmax_w8"]
    assert rt.calls[0][1] == (1, 4, 1) and rt.calls[3][2] == (512, 1, 1)
    with pytest.raises(RoutingShapeError, match="16-byte aligned"):
        rk.logits(None, 0x1004, 0x2000, 0x3000, 7, H, E)
    with pytest.raises(RoutingShapeError, match="tile 'm48' is unknown"):
        rk.logits(None, 0x1000, 0x2000, 0x3000, 7, H, E, tile="m48")


# ============================================================================ GPU


def _run(rt, s, rk, xn, router16, top_k, tile=None):
    """All four kernels on fresh poisoned outputs; returns every output on the host."""
    T, H = xn.shape
    E = router16.shape[0]
    dx, dr = upload(rt, s, xn), upload(rt, s, router16)
    out = {"logits": poisoned(rt, s, T * E * 4), "ids": poisoned(rt, s, T * top_k * 4),
           "weights": poisoned(rt, s, T * top_k * 4), "bounds": poisoned(rt, s, (E + 1) * 4),
           "sorted_token": poisoned(rt, s, T * top_k * 4),
           "row_of": poisoned(rt, s, T * top_k * 4),
           "workspace": poisoned(rt, s, workspace_bytes(T, E))}
    rk.route(s, xn=dx.ptr, router16=dr.ptr, **{k: b.ptr for k, b in out.items()}, tokens=T,
             hidden=H, n_experts=E, top_k=top_k, tile=tile)
    shapes = {"logits": (np.float32, (T, E)), "ids": (np.int32, (T, top_k)),
              "weights": (np.float32, (T, top_k)), "bounds": (np.int32, (E + 1,)),
              "sorted_token": (np.int32, (T * top_k,)), "row_of": (np.int32, (T * top_k,))}
    return {k: download(rt, s, out[k], *shapes[k]) for k in shapes}


@pytest.fixture
def rk(rt):
    return RoutingKernels(rt), rt.stream("routing test")


@gpu
@pytest.mark.parametrize("top_k", [4, 8])
@pytest.mark.parametrize("n_experts", [32, 128])
@pytest.mark.parametrize("tokens", [1, 7, 256, 8192, 9200])
def test_routing_matches_twin(rt, rk, rng, tokens, n_experts, top_k):
    kern, s = rk
    hidden = 2048 if n_experts == 128 else 1024
    xn, router = _inputs(rng, tokens, hidden, n_experts)
    xn[0] = 0.0  # an all-zero token: equal logits, ties to the lowest ids
    r16 = router_f16(router)
    got = _run(rt, s, kern, xn, r16, top_k)
    # logits: float32 accumulation of exact fp16 products
    want = router_logits_ref(xn, r16)
    scale = np.abs(to_f16(xn).astype(np.float64)) @ np.abs(r16.astype(np.float64)).T
    err = np.abs(got["logits"] - want)
    assert (err <= LOGIT_TOL * scale + 1e-30).all(), f"max err/scale {(err / scale).max():.2e}"
    # top-k: the twin's ids exactly on the GPU's own logits; weights within float32 rounding
    ids, w = topk_softmax_ref(got["logits"], top_k)
    np.testing.assert_array_equal(got["ids"], ids)
    np.testing.assert_array_equal(got["ids"][0], np.arange(top_k))
    np.testing.assert_allclose(got["weights"], w, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(got["weights"].sum(axis=1), 1.0, rtol=2e-6)
    # the sort: exact
    for name, arr in zip(("bounds", "sorted_token", "row_of"),
                         counting_sort_ref(got["ids"], n_experts), strict=True):
        np.testing.assert_array_equal(got[name], arr, err_msg=name)


@gpu
@pytest.mark.parametrize("n_experts,top_k", [(60, 16), (256, 8), (256, 16), (512, 1),
                                             (512, 16)])
def test_topk_and_sort_with_heavy_ties(rt, rk, rng, n_experts, top_k):
    """Small-integer logits tie everywhere: ids must follow the twin exactly."""
    kern, s = rk
    T = 1000
    logits = rng.integers(-3, 3, (T, n_experts)).astype(np.float32)
    logits[5] = -0.0
    dl = upload(rt, s, logits)
    ids_b, w_b = poisoned(rt, s, T * top_k * 4), poisoned(rt, s, T * top_k * 4)
    ws = poisoned(rt, s, workspace_bytes(T, n_experts))
    b, so, ro = (poisoned(rt, s, (n_experts + 1) * 4), poisoned(rt, s, T * top_k * 4),
                 poisoned(rt, s, T * top_k * 4))
    kern.topk(s, dl.ptr, T, n_experts, top_k, ids_b.ptr, w_b.ptr, ws.ptr)
    kern.sort(s, ids_b.ptr, T, n_experts, top_k, ws.ptr, b.ptr, so.ptr, ro.ptr)
    ids, w = topk_softmax_ref(logits, top_k)
    np.testing.assert_array_equal(download(rt, s, ids_b, np.int32, (T, top_k)), ids)
    np.testing.assert_allclose(download(rt, s, w_b, np.float32, (T, top_k)), w, rtol=1e-5)
    nt = n_tiles(T)
    masks = download(rt, s, ws, np.uint32, (n_experts, nt), check_tail=False)
    np.testing.assert_array_equal(masks, tile_masks_ref(ids, n_experts))
    want = counting_sort_ref(ids, n_experts)
    np.testing.assert_array_equal(download(rt, s, b, np.int32, (n_experts + 1,)), want[0])
    np.testing.assert_array_equal(download(rt, s, so, np.int32, (T * top_k,)), want[1])
    np.testing.assert_array_equal(download(rt, s, ro, np.int32, (T * top_k,)), want[2])


def _logits(rt, s, rk, xn, router16, tile):
    """The GEMM alone on a fresh poisoned output; logits float32 [T, E] on the host."""
    T, H = xn.shape
    E = router16.shape[0]
    dx, dr = upload(rt, s, xn), upload(rt, s, router16)
    out = poisoned(rt, s, T * E * 4)
    rk.logits(s, dx.ptr, dr.ptr, out.ptr, T, H, E, tile)
    return download(rt, s, out, np.float32, (T, E))


@gpu
@pytest.mark.parametrize("tile", list(GEMM_TILES))
def test_same_bytes_every_run_every_tile_and_chunk(rt, rk, rng, tile):
    kern, s = rk
    xn, router = _inputs(rng, 9200, 2048, 128)
    r16 = router_f16(router)
    a = _run(rt, s, kern, xn, r16, 8, tile=REFERENCE_TILE)
    b = _run(rt, s, kern, xn, r16, 8, tile=tile)
    c = _run(rt, s, kern, xn, r16, 8, tile=tile)
    for name in a:
        assert b[name].tobytes() == c[name].tobytes(), f"{name} differs between runs"
        assert a[name].tobytes() == b[name].tobytes(), f"{name} differs from {REFERENCE_TILE}"
    # a chunk of the same tokens routes them identically (rows differ only by the sort)
    part = _run(rt, s, kern, xn[4000:4257], r16, 8, tile=tile)
    for name in ("logits", "ids", "weights"):
        assert part[name].tobytes() == a[name][4000:4257].tobytes(), name


@gpu
@pytest.mark.parametrize("tile", list(GEMM_TILES))
@pytest.mark.parametrize("hidden,n_experts", TILE_SHAPES)
def test_every_tile_gives_the_reference_tiles_bytes(rt, rk, rng, hidden, n_experts, tile):
    """Each tile's logits against the reference tile's, byte for byte, on chunks whose length
    and offset are multiples of no tile's BM, and against the exact fp16 product; a tile whose
    K step does not divide hidden is refused before it launches."""
    kern, s = rk
    xn, router = _inputs(rng, 1000, hidden, n_experts)
    r16 = router_f16(router)
    if not GEMM_TILES[tile].fits(hidden):
        assert tile not in gemm_tiles_for(hidden)
        with pytest.raises(RoutingShapeError, match=f"tile '{tile}' steps K by"):
            _logits(rt, s, kern, xn[:33], r16, tile)
        return
    want = _logits(rt, s, kern, xn, r16, REFERENCE_TILE)
    exact = router_logits_ref(xn, r16)
    scale = np.abs(to_f16(xn).astype(np.float64)) @ np.abs(r16.astype(np.float64)).T
    tol = LOGIT_TOL * max(1.0, hidden / 2048)  # the bound grows with the number of K steps
    assert (np.abs(want - exact) <= tol * scale + 1e-30).all()
    for first, end in TILE_CHUNKS:
        got = _logits(rt, s, kern, xn[first:end], r16, tile)
        assert got.tobytes() == want[first:end].tobytes(), f"tokens {first}..{end - 1}"


@gpu
def test_picks_against_float32_reference(rt, rk, rng):
    kern, s = rk
    xn, router = _inputs(rng, 4096, 2048, 128)
    got = _run(rt, s, kern, xn, router_f16(router), 8)
    ids32, w32 = route(xn, router, 8)
    flips = (np.sort(ids32, axis=1) != np.sort(got["ids"], axis=1)).any(axis=1).mean()
    assert flips <= MAX_SET_FLIPS
    same = (ids32 == got["ids"]).all(axis=1)
    rel = np.abs(got["weights"][same] - w32[same]) / w32[same]
    assert same.mean() > 0.95 and rel.max() <= MAX_WEIGHT_REL

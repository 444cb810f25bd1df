"""Exact routing (strata_rt/backends/cuda/routing/exact.py, kernels/common/routing_exact.cu): the
definition and its fast CPU path on the CPU; on a GPU, the chunk's chain: its picks against the
definition on random and adversarial inputs (near-ties down to exact ties), the bound the proof
rests on, the weights, every tile's bytes and chunk independence, outputs poisoned first. A
decode step's one-token launches: test_routing_one_token.py."""

from __future__ import annotations

import re

import numpy as np
import pytest
from _device_buffers import download
from _routing_cases import (
    SHAPES,
    adversarial_tokens,
    assert_the_definitions_picks,
    crowded_router,
    near_tie_router,
    random_inputs,
    read_int,
    run_chain,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from strata_rt.backends.cuda.routing.exact import (
    ExactRoutingKernels,
    canonical_logits,
    exact_bound,
    rank,
    route_exact,
    router_norms,
    router_scale,
    softmax_weights,
    split_router,
)
from strata_rt.backends.cuda.routing.kernels import (
    RoutingKernels,
    RoutingShapeError,
    exact_workspace,
    n_tiles,
    workspace_bytes,
)
from strata_rt.backends.cuda.routing.split_tiles import (
    EXACT_SOURCE,
    SM90_SOURCE,
    SPLIT_TILES,
    WgmmaPresplitTile,
    WgmmaProducerTile,
    WgmmaSplitTile,
    runs_on,
    split_tile,
    tile_rule,
)

gpu = pytest.mark.gpu


def _loop_canonical(x: np.ndarray, w: np.ndarray) -> float:
    """The definition written out: 32 lanes, each a sequential float64 sum, then the xor tree."""
    lanes = [0.0] * 32
    for c in range(x.size):
        lanes[c % 32] += float(x[c]) * float(w[c])
    o = 16
    while o:
        lanes = [lanes[i] + lanes[i ^ o] for i in range(32)]
        o //= 2
    return lanes[0]


# ============================================================================ CPU
@settings(max_examples=25, deadline=None)
@given(hidden=st.sampled_from([32, 64, 96, 256]), seed=st.integers(0, 2**32 - 1))
def test_canonical_logits_are_the_written_definition(hidden, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((3, hidden), dtype=np.float32)
    w = rng.standard_normal((4, hidden), dtype=np.float32)
    got = canonical_logits(x, w, block=2)
    for t in range(3):
        for e in range(4):
            assert got[t, e] == _loop_canonical(x[t], w[e])


def test_canonical_logits_pad_a_hidden_size_off_the_lanes():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 40), dtype=np.float32)
    w = rng.standard_normal((3, 40), dtype=np.float32)
    got = canonical_logits(x, w)
    assert got[1, 2] == _loop_canonical(x[1], w[2])


@pytest.mark.parametrize("hidden,n_experts,top_k", SHAPES[:3])
def test_fast_path_equals_the_definition_on_near_ties(hidden, n_experts, top_k):
    rng = np.random.default_rng(hidden)
    x = adversarial_tokens(rng, 64, hidden)
    w = near_tie_router(rng, hidden, n_experts)
    ids, weights = route_exact(x, w, top_k)
    want = rank(canonical_logits(x, w), top_k)
    np.testing.assert_array_equal(ids, want)
    np.testing.assert_array_equal(ids[0], np.arange(top_k))  # all ties: the lowest ids
    np.testing.assert_array_equal(ids[3], ids[4])
    np.testing.assert_allclose(weights.sum(axis=1), 1.0, rtol=1e-6)


def test_exact_ties_go_to_the_lower_id_and_minus_zero_ties_plus_zero():
    lg = np.array([[0.0, -0.0, 1.0, 1.0]])
    np.testing.assert_array_equal(rank(lg, 4), [[2, 3, 0, 1]])
    w = np.array([[1.0, 0.0], [1.0, 0.0], [0.5, 0.0]], np.float32)
    ids, _ = route_exact(np.array([[2.0, 1.0]], np.float32), w, 2)
    np.testing.assert_array_equal(ids, [[0, 1]])


def test_weights_are_the_float32_softmax_renormalised():
    lg = np.array([[1.0, 3.0, 2.0, -1.0]], np.float32)
    w = softmax_weights(lg, np.array([[1, 2]]))
    p = np.exp(lg - lg.max()) / np.exp(lg - lg.max()).sum()
    np.testing.assert_allclose(w, [[p[0, 1] / (p[0, 1] + p[0, 2]), p[0, 2] / (p[0, 1] + p[0, 2])]],
                               rtol=1e-6)


def test_split_router_layout_and_scale():
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((2, 4, 64)) * 3).astype(np.float32)
    b = split_router(w)
    assert b.shape == (2, 8 * 4 * 64) and b.dtype == np.uint8
    for layer in range(2):
        sigma = router_scale(w[layer])
        assert 0.5 < np.abs(w[layer]).max() / sigma <= 1.0
        hi = b[layer, :512].view(np.float16).reshape(4, 64).astype(np.float64)
        lo = b[layer, 512:1024].view(np.float16).reshape(4, 64).astype(np.float64)
        np.testing.assert_array_equal(b[layer, 1024:].view(np.float32).reshape(4, 64), w[layer])
        rel = np.abs((hi + lo / 2048) * sigma - w[layer]) / np.abs(w[layer])
        assert rel.max() <= 2.0 ** -22


def test_bound_grows_with_the_hidden_size_and_the_router():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((8, 2048)).astype(np.float32)
    n = router_norms(w)
    small = exact_bound(n, 2048)
    assert 0 < small.c1 < exact_bound(n, 4096).c1
    assert exact_bound(router_norms(w * 4), 2048).c1 > 3.9 * small.c1


def test_tile_table_comes_from_the_kernel_sources():
    rows = re.findall(r"^SPLIT_KERNEL\((\w+),", EXACT_SOURCE.read_text(), flags=re.M)
    wg = re.findall(r"^SPLIT_SM90_KERNEL\((\w+),", SM90_SOURCE.read_text(), flags=re.M)
    assert rows and wg and set(rows) | set(wg) == set(SPLIT_TILES)
    for t in SPLIT_TILES.values():
        assert t.shared <= 227 * 1024
    # wgmma tiles: 64 x 128, router tiles swizzled (unpadded); run on sm_90 only
    assert all(isinstance(SPLIT_TILES[n], WgmmaSplitTile) for n in wg)
    assert SPLIT_TILES["wg64"].shared == (4 * (64 * 64 * 4 + 2 * 128 * 64 * 2)
                                          + 4 * 64 * 64 * 2 + 1024)
    assert runs_on(SPLIT_TILES["wg64"], "sm_90") and not runs_on(SPLIT_TILES["wg64"], "sm_80")
    # the producer schedule: three warpgroups, x in registers, a ring of split stages
    assert isinstance(SPLIT_TILES["wg64p"], WgmmaProducerTile)
    assert SPLIT_TILES["wg64p"].threads == 384 and SPLIT_TILES["wg64"].threads == 256
    assert isinstance(SPLIT_TILES["wg128p"], WgmmaProducerTile)
    assert SPLIT_TILES["wg128p"].threads == 256
    assert SPLIT_TILES["wg64p"].shared == 4 * (2 * 128 * 64 * 2 + 2 * 64 * 64 * 2) + 1024
    assert runs_on(SPLIT_TILES["m64"], "sm_80")
    assert split_tile(1, 4096) == "m16" and split_tile(9000, 4096) == "m64"
    assert split_tile(100, 1088) == "m16"
    for arch in ("sm_80", "sm_89", "sm_90"):
        rule = tile_rule(arch)
        assert rule[-1][0] is None
        assert all(runs_on(SPLIT_TILES[name], arch) for _, name in rule)
    assert split_tile(9000, 4096, tile_rule("sm_90")) == "wg64s3"
    sm90 = tile_rule("sm_90")
    assert [split_tile(t, 4096, sm90) for t in (1, 1024, 1025, 1536, 4096, 4097)] == [
        "m16k128", "m16k128", "wg128p", "wg128p", "wg128p", "wg64s3"]
    # presplit tiles: only where the caller gives x split, and then beyond 4,096 tokens
    presplit = [n for n, t in SPLIT_TILES.items() if t.presplit]
    assert presplit and all(n in wg and isinstance(SPLIT_TILES[n], WgmmaPresplitTile)
                            for n in presplit)
    assert all(split_tile(t, h, rule) not in presplit for t in (1, 5000, 9000)
               for h in (1024, 4096) for rule in (sm90, tile_rule("sm_80")))
    assert [split_tile(t, 4096, sm90, presplit=True) for t in (1024, 1025, 4096, 4097)] == [
        "m16k128", "wg64h3", "wg64h3", "wg64h4"]
    assert split_tile(9000, 4096, tile_rule("sm_80"), presplit=True) == "m64"
    for n in presplit:
        t = SPLIT_TILES[n]
        assert t.threads == 256 and t.shared == t.stages * (2 * 128 * 64 * 2 + 2 * 64 * 64 * 2) + 1024
    # 1,088 is no multiple of m16k128's K step: m16 takes its short chunks
    assert [split_tile(t, 1088, sm90) for t in (1000, 1025)] == ["m16", "wg128p"]
    assert split_tile(9000, 4096, tile_rule("sm_80")) == "m64"


def test_workspace_holds_the_norms_and_the_rerank_list_after_the_sort():
    ws = 0x10000
    parts = exact_workspace(ws, 1000, 128)
    assert parts.xnorm % 16 == 0 and parts.rscale >= parts.xnorm + 4000
    assert parts.rscale % 16 == 0 and parts.n_rerank >= parts.rscale + 4000
    assert parts.rerank % 16 == 0 and parts.rerank > parts.n_rerank
    assert parts.rerank + 16 * 1000 <= ws + workspace_bytes(1000, 128, "exact")
    assert workspace_bytes(1000, 128, "f16") < workspace_bytes(1000, 128, "exact")
    assert workspace_bytes(1000, 128, "fp32") == 0


def test_the_top_k_reads_xn_or_x_with_its_norm_never_both() -> None:
    """ExactRoutingKernels.topk names its rows: float32 xn, or the residual x with norm_w;
    any other mix is refused before a launch (on a recording runtime)."""
    from _fake_runtime import FakeRuntime

    from strata_rt.models.qwen3 import Qwen3Spec

    spec = Qwen3Spec(n_layers=1, hidden=256, n_heads=4, n_kv_heads=2, head_dim=64, vocab=64,
                     ffn=64, n_experts=8, top_k=2, context=64)
    rt = FakeRuntime(np.random.default_rng(0), spec)
    ex, s = ExactRoutingKernels(rt), rt.stream("compute")  # type: ignore[arg-type]
    bound = exact_bound(router_norms(np.ones((8, 256), np.float32)), 256)
    common = dict(logits=16, router32=32, ws=exact_workspace(1 << 20, 4, 8), tokens=4,
                  hidden=256, n_experts=8, top_k=2, bound=bound, ids=48, weights=64, masks=80)
    for rows in ({"xn": 96, "x": 112, "norm_w": 128}, {"x": 112}, {"xn": 96, "norm_w": 128},
                 {}):
        with pytest.raises(RoutingShapeError, match="reads xn, or x with norm_w"):
            ex.topk(s, **common, **rows)
    assert rt.launches == []
    ex.topk(s, **common, x=112, norm_w=128)
    assert rt.launched_on[-1][0].startswith("route_rerank_x_w")
    assert rt.launched_on[-1][2][1] == 112  # the residual rows
    ex.topk(s, **common, xn=96)
    assert rt.launched_on[-1][0].startswith("route_rerank_w") and rt.launched_on[-1][2][1] == 96


# ============================================================================ GPU
@pytest.fixture
def kernels(rt):
    return ExactRoutingKernels(rt), RoutingKernels(rt), rt.stream("exact routing test")


@gpu
@pytest.mark.parametrize("kind", ["random", "near_ties", "crowded"])
@pytest.mark.parametrize("tokens", [1, 7, 300, 4100])
@pytest.mark.parametrize("hidden,n_experts,top_k", SHAPES)
def test_gpu_picks_the_canonical_experts(rt, kernels, hidden, n_experts, top_k, tokens, kind):
    ex, rk, s = kernels
    rng = np.random.default_rng(tokens * 7 + hidden)
    if kind == "random":
        xn, router = random_inputs(rng, tokens, hidden, n_experts)
    elif kind == "near_ties":
        xn = adversarial_tokens(rng, tokens, hidden)
        router = near_tie_router(rng, hidden, n_experts)
    else:
        xn = rng.standard_normal((tokens, hidden), dtype=np.float32)
        router = crowded_router(rng, hidden, n_experts)
    got = run_chain(rt, s, ex, rk, xn, router, top_k)
    assert_the_definitions_picks(got, xn, router, top_k)
    # the proof's premise: every trusted token's logits (a norm within fp16's range) within
    # B(t) of the float64 product
    x64 = xn.astype(np.float64)
    ref = x64 @ router.astype(np.float64).T
    ok = got["xnorm"] <= 65504.0
    b = got["bound"].c1 * got["xnorm"][ok].astype(np.float64) + got["bound"].c0
    err = np.abs(got["logits"][ok].astype(np.float64) - ref[ok])
    assert (err <= b[:, None]).all(), f"max err / bound {(err / b[:, None]).max():.3f}"
    np.testing.assert_allclose(got["xnorm"][ok], np.sqrt((x64[ok] ** 2).sum(axis=1)), rtol=1e-5)
    if kind == "near_ties" and tokens >= 5:
        assert not got["xnorm"][1] <= 65504.0  # a value beyond fp16: always re-ranked
        assert got["rechecked"] >= 2
    print(f"{kind} T={tokens} H={hidden} E={n_experts}: re-ranked {got['rechecked']} of "
          f"{tokens}; max err/bound {(err / b[:, None]).max():.3f}")


@gpu
@pytest.mark.parametrize("tile", list(SPLIT_TILES))
def test_gpu_every_tile_and_chunk_gives_the_same_bytes(rt, kernels, tile):
    ex, rk, s = kernels
    if tile not in ex.tiles:
        pytest.skip(f"tile {tile} does not run on {rt.arch}")
    rng = np.random.default_rng(5)
    xn, router = random_inputs(rng, 1000, 4096, 128)
    whole = run_chain(rt, s, ex, rk, xn, router, 8, "m64")
    got = run_chain(rt, s, ex, rk, xn, router, 8, tile)
    # (the token norms, only an input of the bound, are summed in the tile's order)
    for k in ("logits", "ids", "weights"):
        assert got[k].tobytes() == whole[k].tobytes(), k
    part = run_chain(rt, s, ex, rk, xn[967:], router, 8, tile)
    for k in ("logits", "ids", "weights"):
        assert part[k].tobytes() == whole[k][967:].tobytes(), k
    np.testing.assert_allclose(got["xnorm"], whole["xnorm"],
                               rtol=1e-5 if SPLIT_TILES[tile].presplit else 1e-6)
    # fewer experts than a block's columns, a short K loop, one partial block of tokens
    xn, router = random_inputs(rng, 77, 1024, 64)
    small, ref = run_chain(rt, s, ex, rk, xn, router, 8, tile), run_chain(rt, s, ex, rk, xn, router, 8, "m64")
    for k in ("logits", "ids", "weights"):
        assert small[k].tobytes() == ref[k].tobytes(), k


@gpu
def test_gpu_rerank_list_resets_itself(rt, kernels):
    """Top-k launched again without its GEMM (as a captured graph may): the re-rank list starts
    from zero each time, so nothing is lost and nothing overflows."""
    ex, rk, s = kernels
    rng = np.random.default_rng(9)
    xn = adversarial_tokens(rng, 300, 1024)
    router = near_tie_router(rng, 1024, 64)
    first = run_chain(rt, s, ex, rk, xn, router, 8)
    assert first["listed_now"] == 0 and first["rechecked"] == 300  # reset after the re-rank
    parts, (dx, dr, ws, out, _) = first["parts"], first["buffers"]
    rt.memset_d8(out["ids"].ptr, 0xFF, 300 * 8 * 4, s)
    rt.memset_d8(ws.ptr, 0xFF, 64 * n_tiles(300) * 4, s)  # the tile masks
    ex.topk(s, logits=out["logits"].ptr, xn=dx.ptr, router32=dr.ptr + 64 * 1024 * 4, ws=parts,
            tokens=300, hidden=1024, n_experts=64, top_k=8, bound=first["bound"],
            ids=out["ids"].ptr, weights=out["weights"].ptr, masks=ws.ptr)
    np.testing.assert_array_equal(download(rt, s, out["ids"], np.int32, (300, 8)), first["ids"])
    assert read_int(rt, s, parts.reranked_total) == 600 and read_int(rt, s, parts.n_rerank) == 0


@gpu
def test_gpu_recheck_rate_on_random_tokens_is_small(rt, kernels):
    """Random tokens on the 30B router: the proof settles nearly every token without a
    re-ranking (the re-ranked share is the exact routing's extra cost)."""
    ex, rk, s = kernels
    rng = np.random.default_rng(6)
    xn, router = random_inputs(rng, 8192, 2048, 128)
    got = run_chain(rt, s, ex, rk, xn, router, 8)
    assert got["rechecked"] <= 0.2 * 8192, got["rechecked"]
    print(f"re-ranked {got['rechecked']} of 8192 tokens")


def test_rerank_launch_matches_its_kernel_source():
    from strata_rt.backends.cuda.routing.exact import RERANK_SOURCE, RERANK_THREADS

    warps = re.search(r"^#define RERANK_WARPS (\d+)", RERANK_SOURCE.read_text(), flags=re.M)
    assert warps and int(warps.group(1)) * 32 == RERANK_THREADS
    assert "__launch_bounds__(RERANK_WARPS * 32)" in RERANK_SOURCE.read_text()

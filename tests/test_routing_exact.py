"""Exact routing (strata_rt/backends/cuda/routing/exact.py, kernels/common/routing_exact.cu): the
definition and its fast CPU path on the CPU; on a GPU, the kernels' picks against the definition on
random and adversarial inputs (near-ties down to exact ties), the bound the proof rests on, the
weights, every tile's bytes and chunk independence, outputs poisoned first."""

from __future__ import annotations

import re

import numpy as np
import pytest
from _device_buffers import download, poisoned, upload
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
    x_parts,
)
from strata_rt.backends.cuda.routing.kernels import (
    RoutingKernels,
    counting_sort_ref,
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

#: (hidden, n_experts, top_k): the issue's tiny model, mid-size, Qwen3-30B and 235B routers
SHAPES = [(256, 8, 2), (1024, 64, 8), (2048, 128, 8), (4096, 128, 8)]


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


def _inputs(rng, tokens, hidden, n_experts):
    xn = rng.standard_normal((tokens, hidden), dtype=np.float32)
    router = (rng.standard_normal((n_experts, hidden)) * 2 / np.sqrt(hidden)).astype(np.float32)
    return xn, router


def near_tie_router(rng, hidden, n_experts):
    """Experts in pairs whose rows differ by a relative 1e-6 ... 1e-9 or not at all, so every
    token's top-k boundary cuts near-ties (and exact ties, which go to the lower id)."""
    base = (rng.standard_normal((n_experts // 2, hidden)) * 2 / np.sqrt(hidden)).astype(np.float32)
    eps = np.array([1e-6, -1e-6, 3e-7, 1e-7, -1e-8, 1e-9, 0.0, 0.0], np.float64)
    twin = base.astype(np.float64) * (1 + np.resize(eps, n_experts // 2))[:, None]
    router = np.empty((n_experts, hidden), np.float32)
    router[0::2], router[1::2] = base, twin.astype(np.float32)
    return router


def crowded_router(rng, hidden, n_experts):
    """Up to 48 experts whose rows are one row scaled by 1 + 1e-7 i (i in -3..3, so exact ties
    too): every token's candidates form one long run of near-ties, longer than a warp, that
    only canonical logits order."""
    router = (rng.standard_normal((n_experts, hidden)) * 2 / np.sqrt(hidden)).astype(np.float32)
    n = min(48, n_experts)
    scale = 1 + 1e-7 * rng.integers(-3, 4, n).astype(np.float64)
    router[:n] = (router[0].astype(np.float64) * 4 * scale[:, None]).astype(np.float32)
    return router


def adversarial_tokens(rng, tokens, hidden):
    """Random rows plus: all zeros (every logit ties), a value beyond fp16's range, values in
    fp16's subnormal range, and one token repeated (the same picks wherever it sits)."""
    xn = rng.standard_normal((tokens, hidden), dtype=np.float32)
    if tokens >= 5:
        xn[0] = 0.0
        xn[1, 3] = 1.0e5
        xn[2] *= np.float32(1e-6)
        xn[4] = xn[3]
    return xn


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


# ============================================================================ GPU
def _assert_the_definitions_picks(got, xn, router, top_k):
    """ids equal the definition's, weights within float32 rounding, and the sort's outputs
    those of the ids."""
    want_ids, want_w = route_exact(xn, router, top_k)
    np.testing.assert_array_equal(got["ids"], want_ids)
    np.testing.assert_allclose(got["weights"], want_w, rtol=2e-5, atol=1e-7)
    for name, arr in zip(("bounds", "sorted_token", "row_of"),
                         counting_sort_ref(got["ids"], router.shape[0]), strict=True):
        np.testing.assert_array_equal(got[name], arr, err_msg=name)


def _run(rt, s, ex, rk, xn, router, top_k, tile=None):
    """Split GEMM, exact top-k and the sort on poisoned outputs; every output on the host."""
    T, H = xn.shape
    E = router.shape[0]
    tile = tile or ex.tile(T, H)
    dx, dr = upload(rt, s, xn), upload(rt, s, split_router(router[None])[0])
    ws = poisoned(rt, s, workspace_bytes(T, E, "exact"))
    parts = exact_workspace(ws.ptr, T, E)
    rt.memset_d8(parts.reranked_total, 0, 4, s)
    gemm_x = dx
    if SPLIT_TILES[tile].presplit:
        # a presplit tile reads x's parts and the norms as the split RMSNorm writes them
        gemm_x = upload(rt, s, x_parts(xn))
        norms = np.sqrt((xn.astype(np.float64) ** 2).sum(axis=1)).astype(np.float32)
        rt.memcpy_htod(parts.xnorm, norms, s)
    out = {"logits": poisoned(rt, s, T * E * 4), "ids": poisoned(rt, s, T * top_k * 4),
           "weights": poisoned(rt, s, T * top_k * 4), "bounds": poisoned(rt, s, (E + 1) * 4),
           "sorted_token": poisoned(rt, s, T * top_k * 4),
           "row_of": poisoned(rt, s, T * top_k * 4)}
    ex.logits(s, gemm_x.ptr, dr.ptr, out["logits"].ptr, parts, T, H, E, router_scale(router),
              tile)
    bound = exact_bound(router_norms(router), H)
    ex.topk(s, logits=out["logits"].ptr, xn=dx.ptr, router32=dr.ptr + E * H * 4, ws=parts,
            tokens=T, hidden=H, n_experts=E, top_k=top_k, bound=bound, ids=out["ids"].ptr,
            weights=out["weights"].ptr, masks=ws.ptr)
    rk.sort(s, out["ids"].ptr, T, E, top_k, ws.ptr, out["bounds"].ptr,
            out["sorted_token"].ptr, out["row_of"].ptr)
    shapes = {"logits": (np.float32, (T, E)), "ids": (np.int32, (T, top_k)),
              "weights": (np.float32, (T, top_k)), "bounds": (np.int32, (E + 1,)),
              "sorted_token": (np.int32, (T * top_k,)), "row_of": (np.int32, (T * top_k,))}
    got = {k: download(rt, s, out[k], *shapes[k]) for k in shapes}
    host = np.empty(T * 4, np.uint8)
    rt.memcpy_dtoh(host, parts.xnorm, s)
    s.synchronize()
    got["xnorm"] = host.view(np.float32).copy()
    got["rechecked"] = _read_int(rt, s, parts.reranked_total)
    got["listed_now"] = _read_int(rt, s, parts.n_rerank)
    got["parts"], got["buffers"] = parts, (dx, dr, ws, out, gemm_x)
    got["bound"] = bound
    return got


def _read_int(rt, s, ptr):
    h = np.empty(4, np.uint8)
    rt.memcpy_dtoh(h, ptr, s)
    s.synchronize()
    return int(h.view(np.int32)[0])


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
        xn, router = _inputs(rng, tokens, hidden, n_experts)
    elif kind == "near_ties":
        xn = adversarial_tokens(rng, tokens, hidden)
        router = near_tie_router(rng, hidden, n_experts)
    else:
        xn = rng.standard_normal((tokens, hidden), dtype=np.float32)
        router = crowded_router(rng, hidden, n_experts)
    got = _run(rt, s, ex, rk, xn, router, top_k)
    _assert_the_definitions_picks(got, xn, router, top_k)
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


def _run_one(rt, s, ex, xn, router, top_k):
    """The one-token launches on poisoned outputs and workspace; every output on the host."""
    T, H = xn.shape
    E = router.shape[0]
    assert T == 1
    dx, dr = upload(rt, s, xn), upload(rt, s, split_router(router[None])[0])
    ws = poisoned(rt, s, workspace_bytes(T, E, "exact"))
    assert workspace_bytes(T, E, "exact") >= E * 8
    out = {"ids": poisoned(rt, s, top_k * 4), "weights": poisoned(rt, s, top_k * 4),
           "bounds": poisoned(rt, s, (E + 1) * 4), "sorted_token": poisoned(rt, s, top_k * 4),
           "row_of": poisoned(rt, s, top_k * 4)}
    ex.one(s, xn=dx.ptr, router32=dr.ptr + E * H * 4, hidden=H, n_experts=E, top_k=top_k,
           canon=ws.ptr, ids=out["ids"].ptr, weights=out["weights"].ptr,
           bounds=out["bounds"].ptr, sorted_token=out["sorted_token"].ptr,
           row_of=out["row_of"].ptr)
    shapes = {"ids": (np.int32, (T, top_k)), "weights": (np.float32, (T, top_k)),
              "bounds": (np.int32, (E + 1,)), "sorted_token": (np.int32, (T * top_k,)),
              "row_of": (np.int32, (T * top_k,))}
    got = {k: download(rt, s, out[k], *shapes[k]) for k in shapes}
    got["canon"] = download(rt, s, ws, np.float64, (E,))
    return got


@gpu
@pytest.mark.parametrize("kind", ["random", "near_ties", "crowded", "zero"])
@pytest.mark.parametrize("hidden,n_experts,top_k", [*SHAPES, (512, 320, 16)])
def test_gpu_one_token_launch_picks_the_canonical_experts(rt, kernels, hidden, n_experts,
                                                          top_k, kind):
    """A decode step's routing (one launch, no split GEMM): the definition's picks on random,
    near-tied and crowded routers and an all-zero token (every logit ties: the lowest ids),
    its canonical logits byte for byte, its weights, and the sort's outputs."""
    ex, rk, s = kernels
    rng = np.random.default_rng(hidden + n_experts + len(kind))
    xn = rng.standard_normal((1, hidden), dtype=np.float32)
    router = {"near_ties": near_tie_router, "crowded": crowded_router}.get(
        kind, lambda r, h, e: _inputs(r, 1, h, e)[1])(rng, hidden, n_experts)
    if kind == "zero":
        xn[:] = 0.0
    got = _run_one(rt, s, ex, xn, router, top_k)
    assert got["canon"].tobytes() == canonical_logits(xn, router)[0].tobytes()
    _assert_the_definitions_picks(got, xn, router, top_k)
    if kind == "zero":
        np.testing.assert_array_equal(got["ids"][0], np.arange(top_k))


@gpu
@pytest.mark.parametrize("overflow", [False, True])
@pytest.mark.parametrize("hidden,n_experts,top_k", SHAPES)
def test_gpu_one_token_launch_with_the_norm_gives_the_four_launches_bytes(
        rt, kernels, hidden, n_experts, top_k, overflow):
    """route_one_norm_logits + pick (one_normed) against rmsnorm_rows, route_one_logits, pick
    and convert_f16_rows on the same residual row: xn, the canonical logits, ids, weights, the
    sort, the token's fp16 activation rows and the finiteness flag, byte for byte (a row whose
    squares overflow: the same flag word)."""
    from strata_rt.backends.cuda.layer_kernels import ENGINE_SOURCE
    from strata_rt.formats.activations import F16, ActivationKernels

    ex, _, s = kernels
    rng = np.random.default_rng(hidden * 5 + top_k + overflow)
    x = (rng.standard_normal((1, hidden)) * 3).astype(np.float32)
    if overflow:
        x[0, 3] = 3e38
    w = (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
    router = _inputs(rng, 1, hidden, n_experts)[1]
    E, eps, layer = n_experts, 1e-6, 9
    dx, dw = upload(rt, s, x), upload(rt, s, w)
    dr = upload(rt, s, split_router(router[None])[0])
    router32 = dr.ptr + E * hidden * 4
    got = []
    for fused in (False, True):
        b = {"xn": poisoned(rt, s, hidden * 4), "act": poisoned(rt, s, top_k * hidden * 2),
             "canon": poisoned(rt, s, E * 8), "ids": poisoned(rt, s, top_k * 4),
             "weights": poisoned(rt, s, top_k * 4), "bounds": poisoned(rt, s, (E + 1) * 4),
             "sorted_token": poisoned(rt, s, top_k * 4), "row_of": poisoned(rt, s, top_k * 4)}
        flag = upload(rt, s, np.full(1, np.iinfo(np.uint64).max, np.uint64))
        sort = dict(ids=b["ids"].ptr, weights=b["weights"].ptr, bounds=b["bounds"].ptr,
                    sorted_token=b["sorted_token"].ptr, row_of=b["row_of"].ptr)
        if fused:
            ex.one_normed(s, x=dx.ptr, norm_w=dw.ptr, eps=eps, router32=router32,
                          hidden=hidden, n_experts=E, top_k=top_k, canon=b["canon"].ptr,
                          xn=b["xn"].ptr, act=b["act"].ptr, bad=flag.ptr, layer=layer, **sort)
        else:
            rt.module(ENGINE_SOURCE).kernel("rmsnorm_rows", "PPPifPi").launch(
                (1, 1, 1), (256, 1, 1), s, (dx.ptr, dw.ptr, b["xn"].ptr, hidden, eps, flag.ptr,
                                            layer))
            ex.one(s, xn=b["xn"].ptr, router32=router32, hidden=hidden, n_experts=E,
                   top_k=top_k, canon=b["canon"].ptr, **sort)
            ActivationKernels(rt).launch(F16, s, b["xn"].ptr, hidden, b["sorted_token"].ptr,
                                         b["act"].ptr, top_k, hidden)
        shapes = {"xn": (np.float32, (hidden,)), "act": (np.float16, (top_k, hidden)),
                  "canon": (np.float64, (E,)), "ids": (np.int32, (top_k,)),
                  "weights": (np.float32, (top_k,)), "bounds": (np.int32, (E + 1,)),
                  "sorted_token": (np.int32, (top_k,)), "row_of": (np.int32, (top_k,))}
        out = {k: download(rt, s, b[k], *shapes[k]) for k in shapes}
        out["flag"] = download(rt, s, flag, np.uint64, (1,), check_tail=False)
        for buf in (*b.values(), flag):
            buf.free()
        got.append(out)
    for name in got[0]:
        assert got[1][name].tobytes() == got[0][name].tobytes(), name
    assert int(got[1]["flag"][0]) == ((layer << 32) if overflow else np.iinfo(np.uint64).max)
    for buf in (dx, dw, dr):
        buf.free()


@gpu
@pytest.mark.parametrize("hidden,n_experts,top_k", SHAPES)
def test_gpu_one_token_launch_gives_the_chains_bytes_for_a_token_it_reranks_in_full(
        rt, kernels, hidden, n_experts, top_k):
    """A token whose norm is beyond fp16's range goes through the chain's full re-ranking
    (canonical logits of every expert); the one-token launch gives its ids and weights byte
    for byte."""
    ex, rk, s = kernels
    rng = np.random.default_rng(hidden * 3 + top_k)
    xn, router = _inputs(rng, 1, hidden, n_experts)
    xn[0, 5] = 1.0e5
    chain = _run(rt, s, ex, rk, xn, router, top_k)
    assert chain["rechecked"] == 1
    one = _run_one(rt, s, ex, xn, router, top_k)
    assert one["ids"].tobytes() == chain["ids"].tobytes()
    assert one["weights"].tobytes() == chain["weights"].tobytes()
    for name in ("bounds", "sorted_token", "row_of"):
        assert one[name].tobytes() == chain[name].tobytes(), name


def test_one_token_launch_matches_its_kernel_source():
    from strata_rt.backends.cuda.routing.exact import ONE_WARPS, RERANK_SOURCE

    text = RERANK_SOURCE.read_text()
    assert f"#define ONE_WARPS {ONE_WARPS}\n" in text
    from strata_rt.backends.cuda.routing.exact import ONE_NORM_WARPS

    assert f"#define ONE_NORM_WARPS {ONE_NORM_WARPS}\n" in text
    assert ONE_NORM_WARPS * 32 == 256  # rmsnorm_rows' block: the norm's bytes
    for npl in (1, 2, 4, 8, 16):
        assert f"ROUTE_ONE_PICK_KERNEL({npl})" in text


@gpu
@pytest.mark.parametrize("tile", list(SPLIT_TILES))
def test_gpu_every_tile_and_chunk_gives_the_same_bytes(rt, kernels, tile):
    ex, rk, s = kernels
    if tile not in ex.tiles:
        pytest.skip(f"tile {tile} does not run on {rt.arch}")
    rng = np.random.default_rng(5)
    xn, router = _inputs(rng, 1000, 4096, 128)
    whole = _run(rt, s, ex, rk, xn, router, 8, "m64")
    got = _run(rt, s, ex, rk, xn, router, 8, tile)
    # (the token norms, only an input of the bound, are summed in the tile's order)
    for k in ("logits", "ids", "weights"):
        assert got[k].tobytes() == whole[k].tobytes(), k
    part = _run(rt, s, ex, rk, xn[967:], router, 8, tile)
    for k in ("logits", "ids", "weights"):
        assert part[k].tobytes() == whole[k][967:].tobytes(), k
    np.testing.assert_allclose(got["xnorm"], whole["xnorm"],
                               rtol=1e-5 if SPLIT_TILES[tile].presplit else 1e-6)
    # fewer experts than a block's columns, a short K loop, one partial block of tokens
    xn, router = _inputs(rng, 77, 1024, 64)
    small, ref = _run(rt, s, ex, rk, xn, router, 8, tile), _run(rt, s, ex, rk, xn, router, 8, "m64")
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
    first = _run(rt, s, ex, rk, xn, router, 8)
    assert first["listed_now"] == 0 and first["rechecked"] == 300  # reset after the re-rank
    parts, (dx, dr, ws, out, _) = first["parts"], first["buffers"]
    rt.memset_d8(out["ids"].ptr, 0xFF, 300 * 8 * 4, s)
    rt.memset_d8(ws.ptr, 0xFF, 64 * n_tiles(300) * 4, s)  # the tile masks
    ex.topk(s, logits=out["logits"].ptr, xn=dx.ptr, router32=dr.ptr + 64 * 1024 * 4, ws=parts,
            tokens=300, hidden=1024, n_experts=64, top_k=8, bound=first["bound"],
            ids=out["ids"].ptr, weights=out["weights"].ptr, masks=ws.ptr)
    np.testing.assert_array_equal(download(rt, s, out["ids"], np.int32, (300, 8)), first["ids"])
    assert _read_int(rt, s, parts.reranked_total) == 600 and _read_int(rt, s, parts.n_rerank) == 0


@gpu
def test_gpu_recheck_rate_on_random_tokens_is_small(rt, kernels):
    """Random tokens on the 30B router: the proof settles nearly every token without a
    re-ranking (the re-ranked share is the exact routing's extra cost)."""
    ex, rk, s = kernels
    rng = np.random.default_rng(6)
    xn, router = _inputs(rng, 8192, 2048, 128)
    got = _run(rt, s, ex, rk, xn, router, 8)
    assert got["rechecked"] <= 0.2 * 8192, got["rechecked"]
    print(f"re-ranked {got['rechecked']} of 8192 tokens")


def test_rerank_launch_matches_its_kernel_source():
    from strata_rt.backends.cuda.routing.exact import RERANK_SOURCE, RERANK_THREADS

    warps = re.search(r"^#define RERANK_WARPS (\d+)", RERANK_SOURCE.read_text(), flags=re.M)
    assert warps and int(warps.group(1)) * 32 == RERANK_THREADS
    assert "__launch_bounds__(RERANK_WARPS * 32)" in RERANK_SOURCE.read_text()


@pytest.mark.parametrize("activation", ["f16", "q8_1"])
@pytest.mark.parametrize("tokens", [1, 5])
def test_a_decode_step_routes_in_two_launches_on_the_layers_float32_rows(tokens, activation):
    """The launch sequence of LayerKernels.route (a recording runtime, no GPU): one token goes
    through the one-token logits and pick on the float32 part of its layer's split router,
    with no counting sort; with fp16 activations the norm and the activations ride in the
    logits launch (route_one_norm_logits: no rmsnorm_rows, no convert_f16_rows); with q8_1 ones
    rmsnorm_rows runs first and the activations after. A chunk goes through the split GEMM,
    top-k and the sort."""
    from _fake_runtime import FakeRuntime, FakeStream

    from strata_rt.backends.cuda.layer_kernels import LayerKernels
    from strata_rt.backends.cuda.routing.exact import ONE_NORM_WARPS
    from strata_rt.formats.activations import F16, Q8_1
    from strata_rt.weights.model import QWEN3_30B_SPEC

    spec = QWEN3_30B_SPEC
    rt = FakeRuntime(np.random.default_rng(0), spec)
    names = ("x", "xn", "norm", "router", "logits", "topk_ids", "topk_w", "sorted_token",
             "row_of", "act_hidden", "route_ws", "nonfinite")
    ptr = {n: (i + 1) << 32 for i, n in enumerate(names)}
    act = F16 if activation == "f16" else Q8_1
    lk = LayerKernels(rt, spec, act, ptr, "exact", first=0)
    rng = np.random.default_rng(1)
    router = (rng.standard_normal((2, spec.n_experts, spec.hidden)) * 0.05).astype(np.float32)
    lk.router_weights(router)
    lk.route(FakeStream("compute"), 1, tokens, bounds=7 << 32, mark=lambda phase: None)
    E, H = spec.n_experts, spec.hidden
    layer1 = ptr["router"] + E * H * 8
    launched = [name for name, _, _ in rt.launched_on]
    if tokens == 1 and act is F16:
        assert launched == ["route_one_norm_logits", "route_one_pick_w4"]
        args = rt.launched_on[0][2]
        assert args[:4] == (ptr["x"], ptr["norm"] + H * 4, float(spec.rms_eps),
                            layer1 + E * H * 4)
        assert args[7:] == (ptr["xn"], ptr["act_hidden"], spec.top_k, ptr["nonfinite"], 1)
        assert E % ONE_NORM_WARPS == 0
    elif tokens == 1:
        assert launched[:3] == ["rmsnorm_rows", "route_one_logits", "route_one_pick_w4"]
        assert rt.launched_on[1][2][1] == layer1 + E * H * 4  # the float32 rows
        assert launched[3:] == ["quantize_q8_1_rows"]
    else:
        assert "route_one_logits" not in launched and "route_one_norm_logits" not in launched
        assert any("split" in n for n in launched) and any("scatter" in n for n in launched)
    if tokens == 1:
        assert not any("scan" in n or "scatter" in n or "split" in n for n in launched)

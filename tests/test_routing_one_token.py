"""Exact routing of a chunk of one token (a decode step): route_one_logits / route_one_pick and
route_one_norm_logits (kernels/common/routing_rerank.cu) against the definition and against the
chunk's chain on the same token, byte for byte, outputs poisoned first; their launch sequence in
LayerKernels.route on a recording runtime."""

from __future__ import annotations

import numpy as np
import pytest
from _device_buffers import download, poisoned, upload
from _routing_cases import (
    SHAPES,
    assert_the_definitions_picks,
    crowded_router,
    near_tie_router,
    random_inputs,
    run_chain,
)

from strata_rt.backends.cuda.routing.exact import (
    ExactRoutingKernels,
    canonical_logits,
    split_router,
)
from strata_rt.backends.cuda.routing.kernels import RoutingKernels, workspace_bytes

gpu = pytest.mark.gpu


@pytest.fixture
def kernels(rt):
    return ExactRoutingKernels(rt), RoutingKernels(rt), rt.stream("exact routing test")


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
        kind, lambda r, h, e: random_inputs(r, 1, h, e)[1])(rng, hidden, n_experts)
    if kind == "zero":
        xn[:] = 0.0
    got = _run_one(rt, s, ex, xn, router, top_k)
    assert got["canon"].tobytes() == canonical_logits(xn, router)[0].tobytes()
    assert_the_definitions_picks(got, xn, router, top_k)
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
    router = random_inputs(rng, 1, hidden, n_experts)[1]
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
    xn, router = random_inputs(rng, 1, hidden, n_experts)
    xn[0, 5] = 1.0e5
    chain = run_chain(rt, s, ex, rk, xn, router, top_k)
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

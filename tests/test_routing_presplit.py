"""The exact routing's presplit chain against the ordinary one, from the same residual rows.

Presplit: the split RMSNorm (rmsnorm_split_rows) writes x's fp16 parts and each token's scale
and norm, a presplit tile multiplies the parts, the re-rank normalises the rows it needs from x,
and the experts' fp16 activations are copies of the hi rows. Ordinary: rmsnorm_rows, the
three-stage wgmma tile on float32 xn, the re-rank on xn, convert_f16_rows. Everything a layer
reads afterwards must be the same bytes: logits, ids, weights, the sort, the activations and the
finiteness flag; the norm's parts are x_parts of rmsnorm_rows' xn, and x * scale * w is that xn.
"""

from __future__ import annotations

import numpy as np
import pytest
from _device_buffers import download, poisoned, upload

from strata_rt.backends.cuda.routing.exact import (
    ExactRoutingKernels,
    exact_bound,
    router_norms,
    router_scale,
    split_router,
    x_parts,
)
from strata_rt.backends.cuda.routing.kernels import (
    RoutingKernels,
    exact_workspace,
    workspace_bytes,
)
from strata_rt.backends.cuda.routing.split_tiles import SPLIT_TILES

PRESPLIT = [name for name, t in SPLIT_TILES.items() if t.presplit]
EPS, LAYER = 1e-6, 5
NO_FLAG = np.iinfo(np.uint64).max


def _residual_rows(rng, kind, tokens, hidden, n_experts):
    """Residual rows x, a norm weight w and a router: random; near-tied expert pairs (nearly
    every token re-ranked, from x); or rows that overflow (a row whose squares are not finite,
    and a norm weight that puts some xn beyond fp16's range, whose tokens are re-ranked whole)."""
    x = (rng.standard_normal((tokens, hidden)) * 3).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
    router = (rng.standard_normal((n_experts, hidden)) * 2 / np.sqrt(hidden)).astype(np.float32)
    if kind == "near_ties":
        base = router[: n_experts // 2]
        router[0::2] = base
        router[1::2] = (base.astype(np.float64) * (1 + 1e-7)).astype(np.float32)
    elif kind == "overflow":
        x[0, 3] = 3e38
        x[2, 5] = 90.0
        w[5] = 4e4
    return x, w, router


def _chain(rt, s, x, w, router, top_k, tile):
    """One chain on poisoned outputs (presplit if the tile is); every output on the host."""
    ex, rk = ExactRoutingKernels(rt), RoutingKernels(rt)
    from strata_rt.backends.cuda.layer_kernels import ENGINE_SOURCE
    from strata_rt.formats.activations import F16, ActivationKernels

    T, H = x.shape
    E = router.shape[0]
    presplit = SPLIT_TILES[tile].presplit
    dx, dw = upload(rt, s, x), upload(rt, s, w)
    dr = upload(rt, s, split_router(router[None])[0])
    ws = poisoned(rt, s, workspace_bytes(T, E, "exact"))
    parts = exact_workspace(ws.ptr, T, E)
    rt.memset_d8(parts.reranked_total, 0, 4, s)
    flag = upload(rt, s, np.full(1, NO_FLAG, np.uint64))
    b = {"xn": poisoned(rt, s, T * H * 4), "logits": poisoned(rt, s, T * E * 4),
         "ids": poisoned(rt, s, T * top_k * 4), "weights": poisoned(rt, s, T * top_k * 4),
         "bounds": poisoned(rt, s, (E + 1) * 4), "sorted_token": poisoned(rt, s, T * top_k * 4),
         "row_of": poisoned(rt, s, T * top_k * 4), "act": poisoned(rt, s, T * top_k * H * 2)}
    if presplit:
        ex.norm_split(s, x=dx.ptr, norm_w=dw.ptr, eps=EPS, parts=b["xn"].ptr, ws=parts,
                      tokens=T, hidden=H, bad=flag.ptr, layer=LAYER)
    else:
        rt.module(ENGINE_SOURCE).kernel("rmsnorm_rows", "PPPifPi").launch(
            (T, 1, 1), (256, 1, 1), s, (dx.ptr, dw.ptr, b["xn"].ptr, H, EPS, flag.ptr, LAYER))
    ex.logits(s, b["xn"].ptr, dr.ptr, b["logits"].ptr, parts, T, H, E, router_scale(router),
              tile)
    ex.topk(s, logits=b["logits"].ptr, router32=dr.ptr + E * H * 4, ws=parts, tokens=T,
            hidden=H, n_experts=E, top_k=top_k, bound=exact_bound(router_norms(router), H),
            ids=b["ids"].ptr, weights=b["weights"].ptr, masks=ws.ptr,
            xn=0 if presplit else b["xn"].ptr, x=dx.ptr if presplit else 0,
            norm_w=dw.ptr if presplit else 0)
    rk.sort(s, b["ids"].ptr, T, E, top_k, ws.ptr, b["bounds"].ptr, b["sorted_token"].ptr,
            b["row_of"].ptr)
    acts = ActivationKernels(rt)
    if presplit:
        acts.gather_f16(s, b["xn"].ptr, H, b["sorted_token"].ptr, b["act"].ptr, T * top_k, H)
    else:
        acts.launch(F16, s, b["xn"].ptr, H, b["sorted_token"].ptr, b["act"].ptr, T * top_k, H)
    shapes = {"xn": (np.uint8, (T * H * 4,)), "logits": (np.float32, (T, E)),
              "ids": (np.int32, (T, top_k)), "weights": (np.float32, (T, top_k)),
              "bounds": (np.int32, (E + 1,)), "sorted_token": (np.int32, (T * top_k,)),
              "row_of": (np.int32, (T * top_k,)), "act": (np.float16, (T * top_k, H))}
    got = {k: download(rt, s, b[k], *shapes[k]) for k in shapes}
    got["flag"] = download(rt, s, flag, np.uint64, (1,), check_tail=False)
    for name, ptr in (("xnorm", parts.xnorm), ("rscale", parts.rscale)):
        host = np.empty(T, np.float32)
        rt.memcpy_dtoh(host, ptr, s)
        s.synchronize()
        got[name] = host
    counted = np.empty(1, np.int32)
    rt.memcpy_dtoh(counted, parts.reranked_total, s)
    s.synchronize()
    got["rechecked"] = int(counted[0])
    for buf in (dx, dw, dr, ws, flag, *b.values()):
        buf.free()
    return got


@pytest.mark.gpu
@pytest.mark.parametrize("tile", PRESPLIT)
@pytest.mark.parametrize("kind", ["random", "near_ties", "overflow"])
@pytest.mark.parametrize("tokens,hidden,n_experts,top_k",
                         [(300, 1024, 64, 8), (77, 2048, 128, 8), (1000, 4096, 128, 8),
                          (130, 256, 8, 2)])
def test_gpu_presplit_chain_gives_the_ordinary_chains_bytes(rt, rng, tile, kind, tokens,
                                                            hidden, n_experts, top_k):
    if tile not in ExactRoutingKernels(rt).tiles:
        pytest.skip(f"tile {tile} does not run on {rt.arch}")
    x, w, router = _residual_rows(rng, kind, tokens, hidden, n_experts)
    s = rt.stream("presplit test")
    ordinary = _chain(rt, s, x, w, router, top_k, "wg64s3")
    got = _chain(rt, s, x, w, router, top_k, tile)
    for name in ("logits", "ids", "weights", "bounds", "sorted_token", "row_of", "act",
                 "flag"):
        assert got[name].tobytes() == ordinary[name].tobytes(), name
    xn = ordinary["xn"].view(np.float32).reshape(tokens, hidden)
    assert got["xn"].tobytes() == x_parts(xn).tobytes()
    # the activations: the hi rows of the sorted tokens (numpy), poisoned rows all written
    assert got["act"].tobytes() == x_parts(xn)[:tokens][got["sorted_token"]].tobytes()
    # the re-rank's recomputation: x * scale * w is rmsnorm_rows' xn, bit for bit
    again = (x * got["rscale"][:, None]) * w
    assert again.tobytes() == xn.tobytes()
    ok = np.isfinite(got["xnorm"])
    np.testing.assert_allclose(got["xnorm"][ok],
                               np.sqrt((xn[ok].astype(np.float64) ** 2).sum(axis=1)),
                               rtol=1e-5)
    if kind == "overflow":
        assert int(got["flag"][0]) == LAYER << 32  # row 0's squares are not finite
        assert got["xnorm"][2] > 65504.0  # beyond fp16: re-ranked whole
    else:
        assert int(got["flag"][0]) == NO_FLAG
    if kind == "near_ties":
        assert got["rechecked"] >= tokens // 2
    print(f"{kind} T={tokens} H={hidden}: re-ranked {got['rechecked']} (ordinary "
          f"{ordinary['rechecked']})")


@pytest.mark.parametrize("activation,presplit", [("f16", True), ("q8_1", False)])
def test_a_long_chunk_with_fp16_activations_routes_through_the_split_norm(activation, presplit):
    """LayerKernels.route's launches for a chunk of 5,000 tokens (a recording runtime, no GPU):
    with fp16 activations the split RMSNorm, a presplit tile, the top-k whose re-rank reads x,
    the sort and the fp16 row copy; with q8_1 activations rmsnorm_rows, the three-stage tile
    on float32 xn and the quantizer."""
    from _fake_runtime import FakeRuntime, FakeStream

    from strata_rt.backends.cuda.layer_kernels import LayerKernels
    from strata_rt.formats.activations import F16, Q8_1
    from strata_rt.weights.model import QWEN3_30B_SPEC

    spec = QWEN3_30B_SPEC
    rt = FakeRuntime(np.random.default_rng(0), spec)
    names = ("x", "xn", "norm", "router", "logits", "topk_ids", "topk_w", "sorted_token",
             "row_of", "act_hidden", "route_ws", "nonfinite")
    ptr = {n: (i + 1) << 32 for i, n in enumerate(names)}
    lk = LayerKernels(rt, spec, F16 if activation == "f16" else Q8_1, ptr, "exact", first=0)
    router = (np.random.default_rng(1).standard_normal((2, spec.n_experts, spec.hidden))
              * 0.05).astype(np.float32)
    lk.router_weights(router)
    T, H, E, K = 5000, spec.hidden, spec.n_experts, spec.top_k
    lk.route(FakeStream("compute"), 1, T, bounds=7 << 32, mark=lambda phase: None)
    launched = [name for name, _, _ in rt.launched_on]
    args = {name: a for name, _, a in rt.launched_on}
    norm_w = ptr["norm"] + H * 4
    if presplit:
        tile = next(t for t in PRESPLIT if f"router_logits_split_{t}" in launched)
        assert launched[:4] == ["rmsnorm_split_rows", f"router_logits_split_{tile}",
                                "topk_exact_w4", "route_rerank_x_w4"]
        assert launched[-1] == "gather_f16_rows"
        assert "rmsnorm_rows" not in launched and "convert_f16_rows" not in launched
        assert args["rmsnorm_split_rows"][:3] == (ptr["x"], norm_w, ptr["xn"])
        assert args["route_rerank_x_w4"][1] == ptr["x"] and args["route_rerank_x_w4"][3] == norm_w
        assert args["gather_f16_rows"][:4] == (ptr["xn"], H, ptr["sorted_token"],
                                               ptr["act_hidden"])
        assert args["gather_f16_rows"][4:] == (T * K, H)
        ws = exact_workspace(ptr["route_ws"], T, E)
        assert args["rmsnorm_split_rows"][3:5] == (ws.rscale, ws.xnorm)
    else:
        assert launched[:4] == ["rmsnorm_rows", "router_logits_split_wg64s3", "topk_exact_w4",
                                "route_rerank_w4"]
        assert launched[-1] == "quantize_q8_1_rows"
        assert not any(t in n for t in PRESPLIT for n in launched)

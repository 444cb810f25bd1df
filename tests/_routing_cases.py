"""Inputs and runs shared by the exact routing's tests (test_routing_exact.py, the chunk's
chain; test_routing_one_token.py, a decode step's launches): random and adversarial routers
and tokens, and the whole chain (split GEMM, top-k with re-ranking, the sort) on poisoned
outputs with every output read back."""

from __future__ import annotations

import numpy as np
from _device_buffers import download, poisoned, upload

from strata_rt.backends.cuda.routing.exact import (
    exact_bound,
    route_exact,
    router_norms,
    router_scale,
    split_router,
    x_parts,
)
from strata_rt.backends.cuda.routing.kernels import (
    counting_sort_ref,
    exact_workspace,
    workspace_bytes,
)
from strata_rt.backends.cuda.routing.split_tiles import SPLIT_TILES

#: (hidden, n_experts, top_k): the issue's tiny model, mid-size, Qwen3-30B and 235B routers
SHAPES = [(256, 8, 2), (1024, 64, 8), (2048, 128, 8), (4096, 128, 8)]


def random_inputs(rng, tokens, hidden, n_experts):
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


def assert_the_definitions_picks(got, xn, router, top_k):
    """ids equal the definition's, weights within float32 rounding, and the sort's outputs
    those of the ids."""
    want_ids, want_w = route_exact(xn, router, top_k)
    np.testing.assert_array_equal(got["ids"], want_ids)
    np.testing.assert_allclose(got["weights"], want_w, rtol=2e-5, atol=1e-7)
    for name, arr in zip(("bounds", "sorted_token", "row_of"),
                         counting_sort_ref(got["ids"], router.shape[0]), strict=True):
        np.testing.assert_array_equal(got[name], arr, err_msg=name)


def run_chain(rt, s, ex, rk, xn, router, top_k, tile=None):
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
    got["rechecked"] = read_int(rt, s, parts.reranked_total)
    got["listed_now"] = read_int(rt, s, parts.n_rerank)
    got["parts"], got["buffers"] = parts, (dx, dr, ws, out, gemm_x)
    got["bound"] = bound
    return got


def read_int(rt, s, ptr):
    h = np.empty(4, np.uint8)
    rt.memcpy_dtoh(h, ptr, s)
    s.synchronize()
    return int(h.view(np.int32)[0])

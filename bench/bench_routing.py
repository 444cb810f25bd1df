"""Per-layer routing cost of the three routing chains of the CUDA backend, kernel by kernel, on
the Qwen3-30B-A3B and Qwen3-235B-A22B router shapes: "fp32" (kernels/common/engine.cu: float32
logits on CUDA cores), "f16" (kernels/common/routing.cu: fp16 operands on tensor cores) and
"exact" (kernels/common/routing_exact.cu: split operands on tensor cores, the canonical picks
proven or re-ranked per token; the default).

    python bench/bench_routing.py [--tokens 254,2048,8192] [--shapes 30b,235b] [--reps 15]
                                  [--inner 20] [--json PATH]

Each cell is GPU time per launch: `inner` back-to-back launches captured in one CUDA graph (so
the Python launch cost never starves the GPU), replayed between two timing events; the median
of `reps` replays after two warm-ups. "total" is router GEMM + top-k + sort, the routing
measure (rmsnorm_rows, which all keep, is shown beside it); "sequence" times a chain replayed
as one graph. The exact chain launches overlapped where the device allows it (sm_90: each
kernel's blocks start while the one before finishes, runtime/overlap.py); "plain" is the same
chain launched ordinarily, timed in the same run. The exact chain's split GEMM is also timed
with every tile whose K step divides the hidden size (second table). Inputs: xn from
rmsnorm_rows on random hidden states, a random router (std 2/sqrt(hidden)); each chain's picks
are compared with the canonical ones (routing.exact.route_exact: fraction of tokens whose
expert set differs), the exact chain's ids and sort must equal them exactly, and the tokens its
top-k re-ranked are counted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from strata_rt.backends.cuda.routing.exact import (  # noqa: E402
    ExactRoutingKernels,
    exact_bound,
    route_exact,
    router_norms,
    router_scale,
    split_router,
)
from strata_rt.backends.cuda.routing.kernels import (  # noqa: E402
    RoutingKernels,
    counting_sort_ref,
    exact_workspace,
    gemm_tile,
    router_f16,
    workspace_bytes,
)
from strata_rt.backends.cuda.routing.split_tiles import SPLIT_TILES  # noqa: E402
from strata_rt.resources import KERNELS_ROOT  # noqa: E402

ENGINE_SOURCE = KERNELS_ROOT / "common" / "engine.cu"
#: (hidden, experts, top_k) of the router
SHAPES = {"30b": (2048, 128, 8), "235b": (4096, 128, 8)}
#: the engine's launch shapes (backends/cuda/executor.py)
ROUTER_TILE, TOPK_THREADS, SCATTER_THREADS, ROW_THREADS = 64, 128, 1024, 256
#: the issue's ceilings for the exact chain (GEMM + top-k + sort) at 8K tokens
TARGET_US = {"30b": 60, "235b": 120}
CHAINS = ("fp32", "f16", "exact")
#: the presplit chain's tile (sm_90): the split RMSNorm, this tile, the top-k whose re-rank
#: normalises from x, the sort
PRESPLIT_TILE = "wg64h4"


def bench_shape(rt, shape: str, tokens: int, reps: int, inner: int,
                rng: np.random.Generator, presplit_tile: str = PRESPLIT_TILE) -> dict:
    H, E, K = SHAPES[shape]
    T = tokens
    s = rt.stream("bench")
    ev = [rt.event("t0", timing=True), rt.event("t1", timing=True)]
    eng = rt.module(ENGINE_SOURCE)
    k_norm = eng.kernel("rmsnorm_rows", "PPPifPi")
    k_router = eng.kernel("router_logits", "PPPiii")
    k_topk = eng.kernel("topk_softmax", "PiiiPP")
    k_bounds = eng.kernel("expert_bounds", "PiiP")
    k_scatter = eng.kernel("expert_scatter", "PiiPPP")
    rk, ex = RoutingKernels(rt), ExactRoutingKernels(rt)
    # the same chain with every kernel launched ordinarily (the runtime's default overlaps the
    # exact chain's launches on sm_90: runtime/overlap.py), timed beside it
    overlap, rt.overlap_launches = rt.overlap_launches, False
    try:
        rk0, ex0 = RoutingKernels(rt), ExactRoutingKernels(rt)
    finally:
        rt.overlap_launches = overlap

    x = rng.standard_normal((T, H), dtype=np.float32)
    w = (1 + 0.1 * rng.standard_normal(H)).astype(np.float32)
    router = (rng.standard_normal((E, H)) * 2 / np.sqrt(H)).astype(np.float32)
    bufs = {}

    def up(name, arr):
        arr = np.ascontiguousarray(arr)
        bufs[name] = rt.alloc(arr.nbytes)
        rt.memcpy_htod(bufs[name].ptr, arr, s)
        return bufs[name].ptr

    def alloc(name, nbytes):
        bufs[name] = rt.alloc(max(nbytes, 16))
        return bufs[name].ptr

    px, pw, pr, pr16 = up("x", x), up("w", w), up("router", router), up("r16", router_f16(router))
    psplit = up("split", split_router(router[None])[0])
    xn, logits = alloc("xn", T * H * 4), alloc("logits", T * E * 4)
    xp, flag = alloc("xp", T * H * 4), up("flag", np.full(2, -1, np.int64))
    presplit = presplit_tile in ex.tiles  # its tiles run on sm_90 only
    chains = (*CHAINS, "presplit") if presplit else CHAINS
    out = {c: {n: alloc(f"{c}_{n}", T * K * 4) for n in ("ids", "w", "st", "ro")}
           for c in chains}
    bnd = {c: alloc(f"{c}_b", (E + 1) * 4) for c in chains}
    ws_f16, ws_ex = alloc("ws", workspace_bytes(T, E, "f16")), alloc("wsx", workspace_bytes(T, E))
    parts = exact_workspace(ws_ex, T, E)
    sigma, norms = router_scale(router), router_norms(router)
    tile16, tilex = gemm_tile(T, H), ex.tile(T, H)
    o, n, x_ = out["fp32"], out["f16"], out["exact"]

    def exact_topk(ex, chain="exact"):
        c = out[chain]
        presplit = chain == "presplit"
        ex.topk(s, logits=logits, router32=psplit + E * H * 4, ws=parts, tokens=T, hidden=H,
                n_experts=E, top_k=K, bound=exact_bound(norms, H), ids=c["ids"],
                weights=c["w"], masks=ws_ex, xn=0 if presplit else xn,
                x=px if presplit else 0, norm_w=pw if presplit else 0)

    launches = {
        "rmsnorm": lambda: k_norm.launch((T, 1, 1), (ROW_THREADS, 1, 1), s,
                                         (px, pw, xn, H, 1e-6, flag, 0)),
        "fp32 GEMM": lambda: k_router.launch((-(-T // ROUTER_TILE), -(-E // ROUTER_TILE), 1),
                                             (256, 1, 1), s, (xn, pr, logits, T, H, E)),
        "fp32 top-k": lambda: k_topk.launch((-(-T // TOPK_THREADS), 1, 1), (TOPK_THREADS, 1, 1),
                                            s, (logits, T, E, K, o["ids"], o["w"])),
        "fp32 sort": lambda: (
            k_bounds.launch((1, 1, 1), (SCATTER_THREADS, 1, 1), s, (o["ids"], T * K, E,
                                                                    bnd["fp32"]), shared=E * 4),
            k_scatter.launch((E, 1, 1), (SCATTER_THREADS, 1, 1), s,
                             (o["ids"], T * K, K, bnd["fp32"], o["st"], o["ro"]))),
        "f16 GEMM": lambda: rk.logits(s, xn, pr16, logits, T, H, E, tile16),
        "f16 top-k": lambda: rk.topk(s, logits, T, E, K, n["ids"], n["w"], ws_f16),
        "f16 sort": lambda: rk.sort(s, n["ids"], T, E, K, ws_f16, bnd["f16"], n["st"], n["ro"]),
        **{f"exact GEMM {t}": (lambda t=t: ex.logits(s, xp if SPLIT_TILES[t].presplit else xn,
                                                     psplit, logits, parts, T, H, E, sigma, t))
           for t, tl in ex.tiles.items() if tl.fits(H)},
        "exact top-k": lambda: exact_topk(ex),
        "exact sort": lambda: rk.sort(s, x_["ids"], T, E, K, ws_ex, bnd["exact"], x_["st"],
                                      x_["ro"]),
        "plain GEMM": lambda: ex0.logits(s, xn, psplit, logits, parts, T, H, E, sigma, tilex),
        "plain top-k": lambda: exact_topk(ex0),
        "plain sort": lambda: rk0.sort(s, x_["ids"], T, E, K, ws_ex, bnd["exact"], x_["st"],
                                       x_["ro"]),
    }
    launches["exact GEMM"] = launches[f"exact GEMM {tilex}"]
    if presplit:
        launches.update({
            "split rmsnorm": lambda: ex.norm_split(s, x=px, norm_w=pw, eps=1e-6, parts=xp,
                                                   ws=parts, tokens=T, hidden=H, bad=flag,
                                                   layer=0),
            "presplit top-k": lambda: exact_topk(ex, "presplit"),
            "presplit sort": lambda: rk.sort(s, out["presplit"]["ids"], T, E, K, ws_ex,
                                             bnd["presplit"], out["presplit"]["st"],
                                             out["presplit"]["ro"])})
        launches["presplit GEMM"] = launches[f"exact GEMM {presplit_tile}"]

    def down(ptr, count):
        host = np.empty(count, np.int32)
        rt.memcpy_dtoh(host, ptr, s)
        s.synchronize()
        return host

    # correctness first: each chain from the same xn (the presplit chain from its split
    # RMSNorm of the same x), its GEMM right before its top-k
    launches["rmsnorm"]()
    rechecked = 0  # the tokens the exact chain re-ranked (the presplit chain's counted apart)
    for c in chains:
        if c == "presplit":
            launches["split rmsnorm"]()
        rt.memset_d8(parts.reranked_total, 0, 4, s)
        launches[f"{c} GEMM"]()
        launches[f"{c} top-k"]()
        launches[f"{c} sort"]()
        if c == "exact":
            rechecked = int(down(parts.reranked_total, 1)[0])
    presplit_rechecked = int(down(parts.reranked_total, 1)[0]) if presplit else None
    ids = {c: down(out[c]["ids"], T * K).reshape(T, K) for c in chains}
    xn_host = np.empty(T * H, np.float32)
    rt.memcpy_dtoh(xn_host, xn, s)
    s.synchronize()
    canonical, _ = route_exact(xn_host.reshape(T, H), router, K)
    differ = {c: float((np.sort(ids[c], 1) != np.sort(canonical, 1)).any(axis=1).mean())
              for c in chains}
    sort_ok = True
    for c in chains[2:]:  # the exact chains: the canonical ids and their sort, exactly
        want = counting_sort_ref(ids[c], E)
        sort_ok = sort_ok and (np.array_equal(ids[c], canonical)
                               and np.array_equal(down(bnd[c], E + 1), want[0])
                               and np.array_equal(down(out[c]["st"], T * K), want[1])
                               and np.array_equal(down(out[c]["ro"], T * K), want[2]))

    def time_us(fn) -> float:
        for _ in range(2):
            fn()
        with rt.capture(s) as graph:
            for _ in range(inner):
                fn()
        samples = []
        for _ in range(reps + 2):
            ev[0].record(s)
            graph.launch(s)
            ev[1].record(s)
            samples.append(ev[0].elapsed_ms(ev[1]) * 1e3 / inner)
        graph.free()
        return statistics.median(samples[2:])

    us = {name: time_us(fn) for name, fn in launches.items() if name != "exact GEMM"}
    us["exact GEMM"] = us[f"exact GEMM {tilex}"]
    for c in (*chains, "plain"):
        us[f"{c} total"] = us[f"{c} GEMM"] + us[f"{c} top-k"] + us[f"{c} sort"]
        names = [f"{c} GEMM", f"{c} top-k", f"{c} sort"]
        us[f"{c} sequence"] = time_us(lambda names=names: [launches[m]() for m in names])
    if presplit:
        # the presplit chain's own RMSNorm does more than rmsnorm_rows: its total carries
        # the difference, so it compares with the others as the layer spends it
        us["norm delta"] = us["split rmsnorm"] - us["rmsnorm"]
        us["presplit total"] += us["norm delta"]
        us["presplit sequence"] += us["norm delta"]
    for b in bufs.values():
        b.free()
    # the chain a layer with fp16 activations runs (LayerKernels.route): presplit where the
    # rule picks a presplit tile for the chunk
    default = ("presplit" if presplit and SPLIT_TILES[ex.tile(T, H, presplit=True)].presplit
               else "exact")
    return {"shape": shape, "hidden": H, "experts": E, "top_k": K, "tokens": T,
            "gemm_tile": tilex, "f16_tile": tile16, "us": us, "default_chain": default,
            "presplit_tile": presplit_tile if presplit else None,
            "gemm_us_by_tile": {t: us[f"exact GEMM {t}"] for t in SPLIT_TILES
                                if f"exact GEMM {t}" in us},
            "picks_differ_from_canonical": differ, "rechecked": rechecked,
            "presplit_rechecked": presplit_rechecked, "sort_ok": sort_ok}


def table(rows: list[dict]) -> str:
    """The chains per shape and length. "presplit total" includes the split RMSNorm's extra
    time over rmsnorm_rows ("norm delta"); the target is checked on the chain a layer with
    fp16 activations runs (`default`)."""
    cols = ["rmsnorm"] + [f"{c} {p}" for c in ("fp32", "f16") for p in ("total",)] + [
        "exact GEMM", "exact top-k", "exact sort", "exact total", "exact sequence",
        "plain total", "plain sequence"]
    if all("presplit total" in r["us"] for r in rows):
        cols += ["norm delta", "presplit GEMM", "presplit top-k", "presplit total",
                 "presplit sequence"]
    lines = ["| shape | tokens | " + " | ".join(cols) + " | default | target | default vs "
             "fp32 / f16 | picks differ from canonical: fp32 / f16 / exact | re-ranked tokens "
             "| sort |", "|---" * (len(cols) + 8) + "|"]
    for r in rows:
        u, d = r["us"], r["picks_differ_from_canonical"]
        cells = [f"{u[c]:.1f}" for c in cols]
        cells[cols.index("exact GEMM")] += f" ({r['gemm_tile']})"
        if "presplit GEMM" in cols:
            cells[cols.index("presplit GEMM")] += f" ({r['presplit_tile']})"
        target, chain = TARGET_US[r["shape"]], r["default_chain"]
        total = u[f"{chain} total"]
        mark = "ok" if total <= target else "over"
        lines.append(
            f"| {r['shape']} | {r['tokens']} | " + " | ".join(cells)
            + f" | {chain} {total:.1f} | <= {target} {mark} | {u['fp32 total'] / total:.2f}x / "
            f"{u['f16 total'] / total:.2f}x"
            + f" | {100 * d['fp32']:.2f}% / {100 * d['f16']:.2f}% / {100 * d['exact']:.2f}%"
            + f" | {r['rechecked']} ({100 * r['rechecked'] / r['tokens']:.1f}%)"
            + f" | {'ok' if r['sort_ok'] else 'WRONG'} |")
    return "\n".join(lines)


def tile_table(rows: list[dict]) -> str:
    """Split GEMM microseconds per launch by tile: the rule's pick marked *, a tile whose K
    step does not divide the hidden size shown as -, the fastest named last."""
    lines = ["| shape | tokens | " + " | ".join(SPLIT_TILES) + " | fastest |",
             "|---" * (len(SPLIT_TILES) + 3) + "|"]
    for r in rows:
        by_tile = r["gemm_us_by_tile"]
        cells = [f"{by_tile[t]:.1f}" + (" *" if t == r["gemm_tile"] else "")
                 if t in by_tile else "-" for t in SPLIT_TILES]
        best = min(by_tile, key=by_tile.__getitem__)
        lines.append(f"| {r['shape']} | {r['tokens']} | " + " | ".join(cells)
                     + f" | {best} {by_tile[best]:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="254,2048,8192")
    ap.add_argument("--shapes", default="30b,235b")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--inner", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    from strata_rt.runtime import Runtime

    rng = np.random.default_rng(a.seed)
    rt = Runtime.open()
    try:
        rows = []
        for shape in a.shapes.split(","):
            for t in (int(v) for v in a.tokens.split(",")):
                rows.append(bench_shape(rt, shape, t, a.reps, a.inner, rng))
                print(f"{shape} {t}: {json.dumps(rows[-1]['us'])}", flush=True)
        device = f"{rt.name} ({rt.arch})"
    finally:
        rt.close()
    if a.json:
        a.json.write_text(json.dumps({"device": device, "rows": rows}, indent=1))
    print(f"\nRouting per layer on {device}: microseconds per launch (CUDA graph, median of "
          f"{a.reps}); targets for the exact chain at 8K tokens: 30b <= 60, 235b <= 120 us.\n")
    print(table(rows))
    print("\nExact routing's split GEMM by tile: microseconds per launch (* the rule's pick).\n")
    print(tile_table(rows))
    return 0 if all(r["sort_ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

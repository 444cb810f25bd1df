"""Per-layer routing cost: the engine's kernels (kernels/common/engine.cu) against the routing
kernels (kernels/common/routing.cu), kernel by kernel, on the Qwen3-30B-A3B and
Qwen3-235B-A22B router shapes.

    python bench/bench_routing.py [--tokens 254,2048,8192] [--shapes 30b,235b] [--reps 15]
                                  [--inner 20] [--json PATH]

Each cell is GPU time per launch: `inner` back-to-back launches captured in one CUDA graph
(so the Python launch cost never starves the GPU), replayed between two timing events; the
median of `reps` replays after two warm-ups. "sort" is expert_bounds + expert_scatter (old)
or route_tile_scan + route_scatter (new); "total" is router GEMM + top-k + sort, the issue's
routing measure (rmsnorm_rows, which both keep, is shown beside it). "sequence" times the
whole chain replayed as one graph. The router GEMM is also timed with every tile of GEMM_TILES
whose K step divides the hidden size (second table, "router GEMM by tile"; "gemm_us_by_tile" in
the JSON), whichever the rule picks. Inputs: xn from rmsnorm_rows on random hidden states, a
random router (std 2/sqrt(hidden)); the picks of the old and new chains are compared
(fraction of tokens whose expert set differs) and the new sort is checked against its ids.
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

from strata_rt.resources import KERNELS_ROOT  # noqa: E402
from strata_rt.routing_kernels import (  # noqa: E402
    GEMM_TILES,
    RoutingKernels,
    counting_sort_ref,
    gemm_tile,
    gemm_tiles_for,
    router_f16,
    workspace_bytes,
)

ENGINE_SOURCE = KERNELS_ROOT / "common" / "engine.cu"
#: (hidden, experts, top_k) of the router
SHAPES = {"30b": (2048, 128, 8), "235b": (4096, 128, 8)}
#: the engine's launch shapes (cuda_engine.py)
ROUTER_TILE, TOPK_THREADS, SCATTER_THREADS, ROW_THREADS = 64, 128, 1024, 256
TARGET_US = 60


def bench_shape(rt, shape: str, tokens: int, reps: int, inner: int,
                rng: np.random.Generator) -> dict:
    H, E, K = SHAPES[shape]
    T = tokens
    s = rt.stream("bench")
    ev = [rt.event("t0", timing=True), rt.event("t1", timing=True)]
    eng = rt.module(ENGINE_SOURCE)
    k_norm = eng.kernel("rmsnorm_rows", "PPPif")
    k_router = eng.kernel("router_logits", "PPPiii")
    k_topk = eng.kernel("topk_softmax", "PiiiPP")
    k_bounds = eng.kernel("expert_bounds", "PiiP")
    k_scatter = eng.kernel("expert_scatter", "PiiPPP")
    rk = RoutingKernels(rt)

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
    xn, logits = alloc("xn", T * H * 4), alloc("logits", T * E * 4)
    o = {n: alloc("old_" + n, T * K * 4) for n in ("ids", "w", "st", "ro")}
    n = {n: alloc("new_" + n, T * K * 4) for n in ("ids", "w", "st", "ro")}
    ob, nb = alloc("old_b", (E + 1) * 4), alloc("new_b", (E + 1) * 4)
    ws = alloc("ws", workspace_bytes(T, E))

    launches = {
        "rmsnorm": lambda: k_norm.launch((T, 1, 1), (ROW_THREADS, 1, 1), s,
                                         (px, pw, xn, H, 1e-6)),
        "old router": lambda: k_router.launch((-(-T // ROUTER_TILE), -(-E // ROUTER_TILE), 1),
                                              (256, 1, 1), s, (xn, pr, logits, T, H, E)),
        "old top-k": lambda: k_topk.launch((-(-T // TOPK_THREADS), 1, 1), (TOPK_THREADS, 1, 1),
                                           s, (logits, T, E, K, o["ids"], o["w"])),
        "old sort": lambda: (
            k_bounds.launch((1, 1, 1), (SCATTER_THREADS, 1, 1), s, (o["ids"], T * K, E, ob),
                            shared=E * 4),
            k_scatter.launch((E, 1, 1), (SCATTER_THREADS, 1, 1), s,
                             (o["ids"], T * K, K, ob, o["st"], o["ro"]))),
        **{f"new GEMM {tile}": (lambda tile=tile: rk.logits(s, xn, pr16, logits, T, H, E, tile))
           for tile in gemm_tiles_for(H)},
        "new top-k": lambda: rk.topk(s, logits, T, E, K, n["ids"], n["w"], ws),
        "new sort": lambda: rk.sort(s, n["ids"], T, E, K, ws, nb, n["st"], n["ro"]),
    }
    # correctness first: old chain, then new chain, both from the same xn
    launches["rmsnorm"]()
    launches["old router"]()
    launches["old top-k"]()
    launches["old sort"]()
    rk.route(s, xn=xn, router16=pr16, logits=logits, ids=n["ids"], weights=n["w"], bounds=nb,
             sorted_token=n["st"], row_of=n["ro"], workspace=ws, tokens=T, hidden=H,
             n_experts=E, top_k=K)

    def down(ptr, count):
        host = np.empty(count, np.int32)
        rt.memcpy_dtoh(host, ptr, s)
        s.synchronize()
        return host

    old_ids, new_ids = down(o["ids"], T * K).reshape(T, K), down(n["ids"], T * K).reshape(T, K)
    flips = float((np.sort(old_ids, 1) != np.sort(new_ids, 1)).any(axis=1).mean())
    want = counting_sort_ref(new_ids, E)
    sort_ok = (np.array_equal(down(nb, E + 1), want[0])
               and np.array_equal(down(n["st"], T * K), want[1])
               and np.array_equal(down(n["ro"], T * K), want[2]))

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

    us = {name: time_us(fn) for name, fn in launches.items()}
    tile = gemm_tile(T, H)
    us["old total"] = us["old router"] + us["old top-k"] + us["old sort"]
    us["new GEMM"] = us[f"new GEMM {tile}"]
    us["new total"] = us["new GEMM"] + us["new top-k"] + us["new sort"]

    def old_seq():
        for name in ("old router", "old top-k", "old sort"):
            launches[name]()

    def new_seq():
        for name in (f"new GEMM {tile}", "new top-k", "new sort"):
            launches[name]()

    us["old sequence"] = time_us(old_seq)
    us["new sequence"] = time_us(new_seq)
    for b in bufs.values():
        b.free()
    return {"shape": shape, "hidden": H, "experts": E, "top_k": K, "tokens": T,
            "gemm_tile": tile, "us": us,
            "gemm_us_by_tile": {t: us[f"new GEMM {t}"] for t in gemm_tiles_for(H)},
            "set_flips_vs_old": flips, "sort_ok": sort_ok}


def table(rows: list[dict]) -> str:
    cols = ["rmsnorm", "old router", "old top-k", "old sort", "old total", "new GEMM",
            "new top-k", "new sort", "new total"]
    lines = ["| shape | tokens | " + " | ".join(cols) + " | speedup | sequence old / new "
             "| other GEMM tile | picks differ | sort |",
             "|---" * (len(cols) + 7) + "|"]
    for r in rows:
        u = r["us"]
        other = [t for t in r["gemm_us_by_tile"] if t != r["gemm_tile"]]
        cells = [f"{u[c]:.1f}" for c in cols]
        cells[cols.index("new GEMM")] += f" ({r['gemm_tile']})"
        mark = "" if u["new total"] <= TARGET_US else " (over target)"
        lines.append(
            f"| {r['shape']} | {r['tokens']} | " + " | ".join(cells) + mark
            + f" | {u['old total'] / u['new total']:.1f}x"
            + f" | {u['old sequence']:.1f} / {u['new sequence']:.1f}"
            + " | " + ", ".join(f"{t} {u[f'new GEMM {t}']:.1f}" for t in other)
            + f" | {100 * r['set_flips_vs_old']:.2f}% | {'ok' if r['sort_ok'] else 'WRONG'} |")
    return "\n".join(lines)


def tile_table(rows: list[dict]) -> str:
    """Router GEMM microseconds per launch by tile: the rule's pick marked *, a tile whose K
    step does not divide the hidden size shown as -, the fastest named last."""
    lines = ["| shape | tokens | " + " | ".join(GEMM_TILES) + " | fastest |",
             "|---" * (len(GEMM_TILES) + 3) + "|"]
    for r in rows:
        by_tile = r["gemm_us_by_tile"]
        cells = [f"{by_tile[t]:.1f}" + (" *" if t == r["gemm_tile"] else "")
                 if t in by_tile else "-" for t in GEMM_TILES]
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
          f"{a.reps}); target: new total <= {TARGET_US} us at 8K tokens.\n")
    print(table(rows))
    print("\nRouter GEMM by tile: microseconds per launch (* the tile the rule picks).\n")
    print(tile_table(rows))
    return 0 if all(r["sort_ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

"""bench/bench_routing.py on the CPU: one shape and length through the real launchers against a
recording runtime (no CUDA), so a GPU run meets no argument or bookkeeping error, and the
presplit chain is timed with its own RMSNorm and re-rank, its total carrying the norm's
difference."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import _fake_runtime  # noqa: E402
import bench_routing  # noqa: E402

from strata_rt.weights.model import MoESpec  # noqa: E402


def test_a_length_beyond_the_ordinary_tiles_times_the_presplit_chain(monkeypatch):
    from strata_rt.runtime import Runtime

    spec = MoESpec(n_layers=1, hidden=2048, ffn=768, n_experts=128, top_k=8)
    _fake_runtime.install(monkeypatch, np.random.default_rng(0), spec,
                          _fake_runtime.BenchRuntime)
    rt = Runtime.open()
    monkeypatch.setattr(rt, "memcpy_dtoh", lambda host, src, stream: host.fill(0))
    monkeypatch.setattr(bench_routing, "route_exact",
                        lambda xn, router, k: (np.zeros((xn.shape[0], k), np.int32), None))
    row = bench_routing.bench_shape(rt, "30b", 5000, 1, 1, np.random.default_rng(1))
    launched = {name for name, _, _ in rt.launched_on}
    assert {"rmsnorm_rows", "rmsnorm_split_rows", "router_logits_split_wg64h4",
            "router_logits_split_wg64s3", "route_rerank_w4", "route_rerank_x_w4"} <= launched
    assert row["default_chain"] == "presplit" and row["presplit_tile"] == "wg64h4"
    u = row["us"]
    assert u["norm delta"] == u["split rmsnorm"] - u["rmsnorm"]
    assert u["presplit total"] == (u["presplit GEMM"] + u["presplit top-k"]
                                   + u["presplit sort"] + u["norm delta"])
    assert row["rechecked"] == 0 and row["presplit_rechecked"] == 0
    assert "wg64h4" in row["gemm_us_by_tile"] and "wg64h3" in row["gemm_us_by_tile"]
    text = bench_routing.table([row])
    assert "presplit total" in text and f"| presplit {u['presplit total']:.1f} |" in text
    assert "wg64h4" in bench_routing.tile_table([row])

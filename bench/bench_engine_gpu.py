"""The CUDA engine on the Qwen3-30B-A3B shape: streamed bytes against the pinned PCIe ceiling
measured in the same process, host share of the wall time, and CUDA-graph replay against plain
launches on the streamed walk.

    python bench/bench_engine_gpu.py [--resident-fraction 0.25] [--json out.json]

Times are host-clock walls around whole prompts (after a warm-up prompt of each size); the
PCIe ceiling is CUDA events around 256 MiB pinned host-to-device copies.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import numpy as np

from strata_rt.engine import Engine, EngineConfig
from strata_rt.weights.model import QWEN3_30B_SPEC, Model

MIB = 1 << 20


def pinned_h2d_gbps(rt, nbytes: int = 256 * MIB, reps: int = 5) -> float:
    host = rt.pinned({"buf": nbytes})
    dev = rt.alloc(nbytes)
    s = rt.stream("bench")
    a, b = rt.event("a", timing=True), rt.event("b", timing=True)
    rt.memcpy_htod(dev.ptr, host.view("buf"), s)  # warm-up
    times = []
    for _ in range(reps):
        a.record(s)
        rt.memcpy_htod(dev.ptr, host.view("buf"), s)
        b.record(s)
        times.append(a.elapsed_ms(b) / 1e3)
    dev.free()
    host.free()
    return nbytes / statistics.median(times) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--resident-fraction", type=float, default=0.25)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 8192])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    spec = QWEN3_30B_SPEC
    model = Model.synthetic(spec, 1)
    cache = int(spec.total_experts * args.resident_fraction)
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    eng = Engine.open(EngineConfig(model=model, backend="cuda", expert_cache=cache))
    open_s = time.perf_counter() - t0
    rt = eng.backend.rt
    ceiling = pinned_h2d_gbps(rt)
    result = {"device": rt.name, "python": platform.python_version(), "spec": str(spec),
              "resident_experts": cache, "chunk": eng.chunk_tokens, "open_s": open_s,
              "pinned_h2d_gbps": ceiling, "runs": []}
    print(f"{rt.name}; {spec}; {cache} resident; open {open_s:.1f} s; pinned H2D "
          f"{ceiling:.1f} GB/s")
    for n in args.lengths:
        for rep in range(args.repeats + 1):  # rep 0 warms up (and is the plain-launch trial)
            h = rng.standard_normal((n, spec.hidden), dtype=np.float32)
            _, st = eng.prefill(h)
            gbps = st.bytes_streamed / st.wall_s / 1e9
            row = {"tokens": n, "rep": rep, "wall_ms": st.wall_s * 1e3,
                   "tokens_per_s": n / st.wall_s, "streamed_gb": st.bytes_streamed / 1e9,
                   "streamed_gbps": gbps, "pcie_share": gbps / ceiling,
                   "host_share": st.host_s / st.wall_s, "host_syncs": st.host_syncs,
                   "gathers": st.gathers_launched, "mmq": st.mmq_launches}
            result["runs"].append(row)
            print(f"{n:6d} tok rep {rep}: {row['wall_ms']:8.1f} ms  {row['tokens_per_s']:9.0f} "
                  f"tok/s  streamed {row['streamed_gb']:.2f} GB at {gbps:5.1f} GB/s "
                  f"({100 * row['pcie_share']:.0f}% of pinned)  host {100 * row['host_share']:.0f}%"
                  f"  syncs {st.host_syncs}  gathers {st.gathers_launched}")
    trials = {str(k): v for k, v in eng.driver.graph_trials.items()}
    result["graph_trials"] = trials
    for T, tr in trials.items():
        if "graph" in tr:
            print(f"walk of {T} tokens: plain {tr['plain'] * 1e3:.1f} ms, graph "
                  f"{tr['graph'] * 1e3:.1f} ms -> {tr['choice']}")
    eng.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

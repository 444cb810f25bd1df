"""The host's share of a whole model's decode step, without a GPU: the CUDA backend's own
Python (engine, driver, executor, launchers) on the recording runtime of the tests
(tests/_fake_runtime.py), whose driver calls cost next to nothing, so what is timed is what the
engine itself spends between a step's wait and the next step's launch.

Why: with the step replayed as one CUDA graph, the GPU idles while the host reads the last
step's result and issues the next; bench_decode.py measures the sum on a GPU, this isolates the
engine's part of it and compares the two ways a greedy step takes its token (decode_argmax
"host": the vocabulary's float32 row copied, checked and argmaxed; "device": 16 bytes read) in
the same run. The model is a small seeded one with the Qwen3 vocabulary and an F16 head; the
graph's replay is one call whatever the layer count.

    python bench/bench_step_host.py [--steps 300] [--vocab 151936] [--decode gemv]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from _fake_runtime import install  # noqa: E402

import strata_rt.backends.cuda.dense.kernels as dense_kernels  # noqa: E402
import strata_rt.backends.cuda.sampling_kernels as sampling_kernels  # noqa: E402
from strata_rt.engine import Engine, EngineConfig  # noqa: E402
from strata_rt.models.qwen3 import Qwen3Model, Qwen3Spec  # noqa: E402
from strata_rt.weights.model import SMALL_SPEC  # noqa: E402


class _NoCublas:
    """cuBLAS stand-in: the recording runtime runs no library."""

    version = (0, 0, 0)

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def gemm(self, *args: object, **kwargs: object) -> None:
        pass

    def destroy(self) -> None:
        pass


def step_host_us(argmax: str, decode: str, vocab: int, steps: int) -> list[float]:
    """Microseconds of each of `steps` greedy decode steps (after the graph trials)."""
    mp = pytest.MonkeyPatch()
    try:
        holder = install(mp, np.random.default_rng(0), SMALL_SPEC)
        mp.setattr(dense_kernels, "Cublas", _NoCublas)
        # the recording runtime copies nothing back: the argmax's 16 bytes name token 1
        mp.setattr(sampling_kernels.DeviceArgmax, "token", lambda self: 1)
        spec = Qwen3Spec(n_layers=SMALL_SPEC.n_layers, hidden=SMALL_SPEC.hidden, n_heads=8,
                         n_kv_heads=2, head_dim=64, vocab=vocab, ffn=SMALL_SPEC.ffn,
                         n_experts=SMALL_SPEC.n_experts, top_k=SMALL_SPEC.top_k, context=4096)
        whole = Qwen3Model.synthetic(spec, 3, "iq3_xxs", dense_type="F16")
        cfg = EngineConfig(model=whole, backend="cuda", timing=False, context=steps + 64,
                           prefill=64, decode=decode, decode_argmax=argmax,
                           expert_cache=spec.n_experts * spec.n_layers)
        with Engine.open(cfg) as eng:
            rt = holder["rt"]
            rt.tokens = 5
            eng.prefill(np.arange(5))
            rt.tokens = 1
            for _ in range(3):  # plain launches, the captured replay's trial, a replay
                eng.prefill_argmax(np.array([7]))
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                eng.prefill_argmax(np.array([7]))
                times.append((time.perf_counter() - t0) * 1e6)
        return times
    finally:
        mp.undo()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300, help="timed steps per mode (default 300)")
    ap.add_argument("--vocab", type=int, default=151_936, help="vocabulary (default Qwen3's)")
    ap.add_argument("--decode", default="gemv", choices=("routed", "gemv"),
                    help="the decode plan (default gemv)")
    args = ap.parse_args()
    rows = {}
    for argmax in ("host", "device"):
        rows[argmax] = statistics.median(step_host_us(argmax, args.decode, args.vocab,
                                                      args.steps))
    print(f"| decode_argmax | host us a step (median of {args.steps}) | against host |")
    print("| --- | ---: | ---: |")
    for argmax, us in rows.items():
        print(f"| {argmax} | {us:.1f} | {us / rows['host']:.2f}x |")


if __name__ == "__main__":
    main()

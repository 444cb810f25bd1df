"""What bench_mmq.py and the benchmarks built on it share: the Qwen3-30B-A3B expert shapes,
the routing they time, TFLOPS, and the timing rule (two warm-ups, then the median of CUDA-event
timings). A module of its own so that bench_mmq's torch side (mmq_torch.py) and
engine_order.py use the same rule without importing bench_mmq.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import numpy as np

HIDDEN, FFN, EXPERTS, TOP_K = 2048, 768, 128, 8
PARTS = {"gate_up": (2 * FFN, HIDDEN), "down": (HIDDEN, FFN)}  # (m, k)
#: distinct expert blobs; the 128 experts cycle through them (content does not change speed)
UNIQUE = 8


def routing(rng: np.random.Generator, tokens: int) -> np.ndarray:
    """Rows per expert for top-8 routing with log-normal expert popularity (sigma 0.45, Gumbel
    top-k): busy experts get about 2-3x the mean, quiet ones a third of it."""
    logp = rng.normal(0.0, 0.45, EXPERTS)
    scores = logp[None, :] + rng.gumbel(size=(tokens, EXPERTS))
    top = np.argpartition(-scores, TOP_K, axis=1)[:, :TOP_K]
    return np.bincount(top.reshape(-1), minlength=EXPERTS).astype(np.int64)


def tflops(rows: int, m: int, k: int, ms: float) -> float:
    return 2.0 * rows * m * k / (ms * 1e-3) / 1e12


#: warm-up runs before the timed ones
WARMUPS = 2


def median_ms(run, reps: int, timer) -> float:
    for _ in range(WARMUPS):
        run()
    return statistics.median(timer(run) for _ in range(reps))


def torch_event_timer(torch: Any) -> Callable[[Callable[[], Any]], float]:
    """fn -> milliseconds between two CUDA events around it on torch's current stream."""
    def timer(fn: Callable[[], Any]) -> float:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b)

    return timer


def runtime_event_timer(rt: Any, stream: Any) -> Callable[[Callable[[], Any]], float]:
    """fn -> milliseconds between two strata_rt events around it on `stream`."""
    ev = [rt.event("t0", timing=True), rt.event("t1", timing=True)]

    def timer(fn: Callable[[], Any]) -> float:
        ev[0].record(stream)
        fn()
        ev[1].record(stream)
        return ev[0].elapsed_ms(ev[1])

    return timer

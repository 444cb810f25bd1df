"""CUDA-event timing through torch for the benchmarks' ceilings and peers (one copy: every
bench that measures a rate in the same process as strata_rt times it the same way)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def cuda_seconds(torch: Any, fn: Callable[[], Any], reps: int) -> float:
    """Mean seconds of `fn` over `reps` back-to-back calls after one untimed call, between two
    CUDA events on the current stream."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def pinned_h2d_gb_s(torch: Any, sizes: dict[str, int], reps: int = 20) -> dict[str, float]:
    """Pinned host-to-device GB/s per copy size: {label: GB/s} for {label: bytes}."""
    host = torch.empty(max(sizes.values()), dtype=torch.uint8).pin_memory()
    dev = torch.empty_like(host, device="cuda")
    out = {}
    for label, n in sizes.items():
        def copy(n: int = n, host: Any = host, dev: Any = dev) -> None:
            dev[:n].copy_(host[:n], non_blocking=True)

        out[label] = n / cuda_seconds(torch, copy, reps) / 1e9
    host = dev = None  # the pinned and device buffers go before the caller's next allocation
    torch.cuda.empty_cache()
    return out
